"""Triton top-k of score rows in two reads: the DSA indexer's selection, ``topk_rows``' result.

``topk_rows_twopass(scores, lens, topk)`` returns what ``topk_triton.topk_rows`` returns (same
contract, same result, element for element): for every row, the columns of its ``topk``
largest finite scores among its first ``lens[row]`` columns, in increasing column order, then
-1 where the row has fewer finite scores; of scores tied at the cut, the earlier columns win.
Nothing past ``lens[row]`` is read. A memset and three launches, each row read twice:

1. **Sketch** (a program a chunk of a row). Each group of g keys (strided: column j of each of
   g slices of the chunk; g = 16 for rows of at least 64 topk columns, down to 2 for short
   ones) gives its largest key, counted by an atomic in the row's histogram: ``bins`` bins,
   bins / 64 an octave over [2^-16, 2^16) of either sign, clamped outside, and a coarse copy
   (64 bins each) beside it. The maxima are distinct scores, so the lower edge ``lo`` of the
   bin where the count of maxima at or above it reaches ``topk`` bounds the k-th largest score
   from below. Only 1/g of the keys cost an atomic: Triton's ``tl.histogram`` costs bins / 32
   population counts a key, far too slow for a fine histogram of every key.
2. **Collect** (a program a chunk). Every program finds ``lo`` from the sketch (coarse, then
   the 64 fine bins of the cut) and appends its chunk's keys >= ``lo`` (the candidates) and
   their columns to the row's buffer, at the offset the chunks before it give: a decoupled
   look-back (a chunk publishes its count, then sums its predecessors'); chunks are numbered by
   an atomic ticket in the order programs start, so a program only waits for programs already
   running, whatever the GPU's dispatch order. The buffer is in column order. Each candidate
   also counts in a second histogram, ``bins2`` bins spanning [lo, the sketch's top key] in
   key space: fine wherever the row's scores lie.
3. **Resolve** (a program a row). The second histogram gives the bin holding the k-th largest
   candidate and how many of its members make the cut; the k-th largest key ``T`` among those
   members is a min or a max (all or one of them make the cut), a pairwise rank (at most 64
   members), or 4-bit radix rounds (many: ties). The buffer is then written out: the keys
   above ``T`` and the first keys equal to it, in column order, then -1. The common case (at
   most ``tile`` candidates) runs on one tile in registers.

Candidates number about ``topk`` plus the sketch's cut-bin population plus the top keys that
share a group with a larger one (top keys clustered in a block of the row). A row with more
than ``cap`` (scores all equal, a top-k packed in one block much longer than topk, scores far
outside the binned range) resolves over its own columns instead, by the same program: slower
(one SM reading the row a few times), still exact. No host synchronisation (CUDA-graph safe);
the atomics decide only counts and which program takes which chunk, never the result.

A producer of the scores may fill the sketch itself (``sketch_maxima``: any grouping that
covers every column gives a valid bound) and call with ``sketched=True``, saving pass 1's
read: the fused-logits option, not wired into the logits kernels yet. The PyTorch twin is
``ops.indexer.logits_triton.topk_from_logits`` (``torch.topk``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnserve import env
from attnserve.ops.indexer.topk_triton import sortable_key

__all__ = [
    "TwoPassConfig",
    "pick_twopass_config",
    "sketch_rows",
    "topk_rows_twopass",
    "topk_workspace",
]

_FINE, _MEMBERS = 64, 64
FINE = tl.constexpr(_FINE)  # fine bins of the sketch under one coarse bin
MEMBERS = tl.constexpr(_MEMBERS)  # cut-bin members ranked pairwise; more take the radix rounds


# fmt: off
@triton.jit
def _bin1(key, SH1: tl.constexpr, HP: tl.constexpr, HN: tl.constexpr, HALF: tl.constexpr):
    """Sketch bin of a key: HALF bins for negatives in [-2^16, -2^-16], HALF for positives in
    [2^-16, 2^16), clamped outside (monotone in the key)."""
    h = (key >> SH1).to(tl.int32)
    pos = HALF + tl.minimum(h - HP, HALF - 1)
    neg = tl.minimum(tl.maximum(h - HN, 0), HALF - 1)
    return tl.where(h >= HP, pos, neg)


@triton.jit
def _bin1_lo(b, SH1: tl.constexpr, HP: tl.constexpr, HN: tl.constexpr, HALF: tl.constexpr):
    """The smallest key in sketch bin ``b`` (0 for bin 0)."""
    h = tl.where(b >= HALF, HP + b - HALF, HN + b)
    lo = h.to(tl.uint32) << SH1
    return tl.where(b <= 0, 0, lo).to(tl.uint32)


@triton.jit
def sketch_maxima(gk, hist_row, SH1: tl.constexpr, HP: tl.constexpr, HN: tl.constexpr,
                  HALF: tl.constexpr, NC1: tl.constexpr):
    """Add group maxima (sortable keys, 0 for a group without a finite score) to a row's sketch
    (``hist_row``); returns their coarse histogram, for the caller to add to the row's coarse
    one (``tl.atomic_add`` of the bins > 0). Any grouping of the row's keys gives a valid
    bound: a fused logits epilogue may call this with the maxima of its own tiles."""
    glive = gk > 0
    b = _bin1(gk, SH1, HP, HN, HALF)
    tl.atomic_add(hist_row + b, 1, mask=glive, sem="relaxed")
    return tl.histogram(b // FINE, NC1, mask=glive)


@triton.jit
def _load_keys(src, offs, n, FULL: tl.constexpr):
    """Sortable keys of a row's columns ``offs``, 0 where not a candidate (past n, -inf); FULL:
    every column is below n (an unmasked, vectorisable load)."""
    if FULL:
        x = tl.load(src + offs)
        live = x > float("-inf")
    else:
        x = tl.load(src + offs, mask=offs < n, other=float("-inf"))
        live = (offs < n) & (x > float("-inf"))
    return tl.where(live, sortable_key(x), 0)


@triton.jit
def _sketch_chunk(src, lo, n, g, hist_row, coarse_row, CHUNK: tl.constexpr, FULL: tl.constexpr,
                  SH1: tl.constexpr, HP: tl.constexpr, HN: tl.constexpr, HALF: tl.constexpr,
                  NC1: tl.constexpr):
    """The chunk as 16 slices of CHUNK / 16 columns, loaded at once; every ``g`` consecutive
    slices (g in 2, 4, 8, 16) make groups of g keys (group j: column j of each slice), whose
    maxima are counted."""
    W: tl.constexpr = CHUNK // 16
    offs = lo + tl.arange(0, 16)[:, None] * W + tl.arange(0, W)[None, :]
    keys = _load_keys(src, offs, n, FULL)  # [16, W]
    if g == 16:
        coarse = sketch_maxima(tl.max(keys, 0), hist_row, SH1, HP, HN, HALF, NC1)
    elif g == 8:
        coarse = sketch_maxima(tl.reshape(tl.max(tl.reshape(keys, [2, 8, W]), 1), [2 * W]),
                               hist_row, SH1, HP, HN, HALF, NC1)
    elif g == 4:
        coarse = sketch_maxima(tl.reshape(tl.max(tl.reshape(keys, [4, 4, W]), 1), [4 * W]),
                               hist_row, SH1, HP, HN, HALF, NC1)
    else:
        coarse = sketch_maxima(tl.reshape(tl.max(tl.reshape(keys, [8, 2, W]), 1), [8 * W]),
                               hist_row, SH1, HP, HN, HALF, NC1)
    tl.atomic_add(coarse_row + tl.arange(0, NC1), coarse, mask=coarse > 0, sem="relaxed")


@triton.jit(do_not_specialize=("width", "stride_s"), do_not_specialize_on_alignment=("lens_ptr",))
def _sketch_kernel(scores_ptr, lens_ptr, hist_ptr, coarse_ptr, width, stride_s, K: tl.constexpr,
                   CHUNK: tl.constexpr, GMAX: tl.constexpr, ALIGN: tl.constexpr, NB1: tl.constexpr,
                   NC1: tl.constexpr, SH1: tl.constexpr, HP: tl.constexpr, HN: tl.constexpr):
    """Pass 1: the chunk's group maxima into the row's sketch."""
    row = tl.program_id(0)
    n = tl.minimum(tl.load(lens_ptr + row).to(tl.int32), width)
    lo = tl.program_id(1) * CHUNK
    if lo >= n:
        return
    src = scores_ptr + row.to(tl.int64) * tl.multiple_of(stride_s, ALIGN)
    hist_row = hist_ptr + row.to(tl.int64) * NB1
    coarse_row = coarse_ptr + row.to(tl.int64) * NC1
    HALF: tl.constexpr = NB1 // 2
    # groups of g keys while the row keeps >= 4 K groups, at least 2 (a row of at most ``cap``
    # columns never overflows the buffer, whatever the sketch)
    g = tl.where(n >= 64 * K, 16, tl.where(n >= 32 * K, 8, tl.where(n >= 16 * K, 4, 2)))
    g = tl.maximum(tl.minimum(g, GMAX), 2)
    if lo + CHUNK <= n:
        _sketch_chunk(src, lo, n, g, hist_row, coarse_row, CHUNK, True, SH1, HP, HN, HALF, NC1)
    else:
        _sketch_chunk(src, lo, n, g, hist_row, coarse_row, CHUNK, False, SH1, HP, HN, HALF, NC1)


@triton.jit
def _sketch_cut(hist_row, coarse_row, K: tl.constexpr, NB1: tl.constexpr, NC1: tl.constexpr,
                NB2: tl.constexpr, SH1: tl.constexpr, HP: tl.constexpr, HN: tl.constexpr):
    """(lo, S2) of a row from its sketch: ``lo`` the smallest key of the bin where the count of
    maxima at or above it reaches K (0 when it never does: every finite key is a candidate),
    ``S2`` the shift that maps ``[lo, the top bin's last key]`` onto NB2 bins."""
    HALF: tl.constexpr = NB1 // 2
    cb = tl.arange(0, NC1)
    coarse = tl.load(coarse_row + cb)
    at_least = tl.cumsum(coarse, 0, reverse=True)
    c_cut = tl.max(tl.where(at_least >= K, cb, -1), 0)
    c_top = tl.max(tl.where(coarse > 0, cb, 0), 0)
    fb = tl.arange(0, FINE)
    fine = tl.load(hist_row + tl.maximum(c_cut, 0) * FINE + fb)
    need = K - tl.sum(tl.where(cb > c_cut, coarse, 0), 0)
    f_cut = tl.max(tl.where(tl.cumsum(fine, 0, reverse=True) >= need, fb, 0), 0)
    lo = tl.where(c_cut >= 0, _bin1_lo(c_cut * FINE + f_cut, SH1, HP, HN, HALF), 0).to(tl.uint32)
    top = tl.load(hist_row + c_top * FINE + fb)
    b_top = c_top * FINE + tl.max(tl.where(top > 0, fb, 0), 0)
    hi = tl.where(b_top >= NB1 - 1, 0xFFFFFFFF, _bin1_lo(b_top + 1, SH1, HP, HN, HALF) - 1).to(tl.uint32)
    span = tl.where(hi > lo, hi - lo, 0).to(tl.uint32)
    shifts = tl.arange(0, 32)
    s2 = tl.sum(((span >> shifts.to(tl.uint32)) >= NB2).to(tl.int32), 0)  # span >> s2 < NB2
    return lo, s2


@triton.jit(do_not_specialize=("width", "stride_s", "buf_cap", "num_parts"),
            do_not_specialize_on_alignment=("lens_ptr",))
def _collect_kernel(scores_ptr, lens_ptr, hist_ptr, coarse_ptr, hist2_ptr, status_ptr, meta_ptr,
                    cand_ptr, width, stride_s, buf_cap, num_parts, K: tl.constexpr,
                    CHUNK: tl.constexpr, ALIGN: tl.constexpr, NB1: tl.constexpr, NC1: tl.constexpr,
                    NB2: tl.constexpr, SH1: tl.constexpr, HP: tl.constexpr, HN: tl.constexpr,
                    LOOK: tl.constexpr):
    """Pass 2: the chunk's candidates (keys >= lo) into the row's buffer in column order, and
    into the row's candidate histogram."""
    row = tl.program_id(0)
    n = tl.minimum(tl.load(lens_ptr + row).to(tl.int32), width)
    if n <= 0:
        return
    meta = meta_ptr + row.to(tl.int64) * 4  # [candidates, lo, S2, ticket]
    # chunks in the order programs start: a program waits only for programs already running
    part = tl.atomic_add(meta + 3, 1, sem="relaxed")
    lo_col = part * CHUNK
    if lo_col >= n:
        return
    offs = lo_col + tl.arange(0, CHUNK)
    src = scores_ptr + row.to(tl.int64) * tl.multiple_of(stride_s, ALIGN)
    if lo_col + CHUNK <= n:
        key = _load_keys(src, offs, n, True)
    else:
        key = _load_keys(src, offs, n, False)
    lo, s2 = _sketch_cut(hist_ptr + row.to(tl.int64) * NB1, coarse_ptr + row.to(tl.int64) * NC1,
                         K, NB1, NC1, NB2, SH1, HP, HN)
    cand = (key > 0) & (key >= lo)
    count = tl.sum(cand.to(tl.int32), 0)
    status = status_ptr + row.to(tl.int64) * num_parts
    tl.atomic_xchg(status + part, count + 1, sem="relaxed")  # published (0: not yet)
    # look back: the counts of every chunk before this one, LOOK at a time
    before = 0
    start = 0
    while start < part:
        prev = start + tl.arange(0, LOOK)
        seen = tl.load(status + prev, mask=prev < part, other=1, volatile=True)
        while tl.min(seen, 0) == 0:  # a chunk before this one has not counted yet
            seen = tl.load(status + prev, mask=prev < part, other=1, volatile=True)
        before += tl.sum(seen - 1, 0)
        start += LOOK
    slot = before + tl.cumsum(cand.to(tl.int32), 0) - 1
    dst = cand_ptr + row.to(tl.int64) * 2 * buf_cap
    keep = cand & (slot < buf_cap)
    tl.store(dst + slot, key.to(tl.int32, bitcast=True), mask=keep)
    tl.store(dst + buf_cap + slot, offs, mask=keep)
    # the row's candidate histogram (< NB2 unless a producer's sketch missed the row's max)
    bin2 = tl.minimum(((key - lo) >> s2.to(tl.uint32)).to(tl.int32), NB2 - 1)
    tl.atomic_add(hist2_ptr + row.to(tl.int64) * NB2 + bin2, 1, mask=cand, sem="relaxed")
    if part == (n - 1) // CHUNK:  # the last chunk: the row's totals
        tl.store(meta, before + count)
        tl.store(meta + 1, lo.to(tl.int32, bitcast=True))
        tl.store(meta + 2, s2)


@triton.jit
def _source_tile(src, cand_row, buf_cap, start, lo, total, FROM_ROW: tl.constexpr, TILE: tl.constexpr):
    """(keys, columns, candidate mask) of one tile of the row's candidates in column order:
    the buffer's slots ``start + [0, TILE)``, or the row's columns there (FROM_ROW; ``total``
    its length) keeping the keys >= lo."""
    idx = start + tl.arange(0, TILE)
    if FROM_ROW:
        x = tl.load(src + idx, mask=idx < total, other=float("-inf"))
        key = sortable_key(x)
        return key, idx, (idx < total) & (x > float("-inf")) & (key >= lo)
    else:
        ok = idx < total
        key = tl.load(cand_row + idx, mask=ok, other=0).to(tl.uint32, bitcast=True)
        col = tl.load(cand_row + buf_cap + idx, mask=ok, other=-1)
        return key, col, ok


@triton.jit
def _radix_rounds(src, cand_row, buf_cap, lo, total, base, s2, quota, FROM_ROW: tl.constexpr,
                  TILE: tl.constexpr, INTERPRET: tl.constexpr):
    """The ``quota``-th largest of the keys in ``[base, base + 2^s2)`` (4-bit digits of
    ``key - base``, high to low) and how many keys equal to it make the cut."""
    rounds = (s2 + 3) // 4
    digits = tl.arange(0, 16)
    prefix = tl.zeros((), dtype=tl.uint32)
    r = 0
    while r < rounds:
        shift = (4 * (rounds - 1 - r)).to(tl.uint32)
        hist = tl.zeros([16], dtype=tl.int32)
        if INTERPRET:  # the interpreter's range() cannot take a loaded bound
            start = 0
            while start < total:
                key, col, ok = _source_tile(src, cand_row, buf_cap, start, lo, total, FROM_ROW, TILE)
                rel = key - base
                match = ok & (key >= base) & ((rel >> shift >> 4) == prefix) & ((rel >> s2.to(tl.uint32)) == 0)
                hist += tl.histogram(((rel >> shift) & 15).to(tl.int32), 16, mask=match)
                start += TILE
        else:
            for start in range(0, total, TILE):
                key, col, ok = _source_tile(src, cand_row, buf_cap, start, lo, total, FROM_ROW, TILE)
                rel = key - base
                match = ok & (key >= base) & ((rel >> shift >> 4) == prefix) & ((rel >> s2.to(tl.uint32)) == 0)
                hist += tl.histogram(((rel >> shift) & 15).to(tl.int32), 16, mask=match)
        at_least = tl.cumsum(hist, 0, reverse=True)
        digit = tl.maximum(tl.max(tl.where(at_least >= quota, digits, -1), 0), 0)
        quota -= tl.sum(tl.where(digits > digit, hist, 0), 0)
        prefix = (prefix << 4) | digit.to(tl.uint32)
        r += 1
    return base + prefix, quota


@triton.jit
def _write_tile(src, cand_row, buf_cap, start, lo, total, threshold, quota, written, equal_seen,
                dst, FROM_ROW: tl.constexpr, TILE: tl.constexpr):
    key, col, ok = _source_tile(src, cand_row, buf_cap, start, lo, total, FROM_ROW, TILE)
    equal = ok & (key == threshold)
    rank = equal_seen + tl.cumsum(equal.to(tl.int32), 0) - 1
    take = (ok & (key > threshold)) | (equal & (rank < quota))
    slot = written + tl.cumsum(take.to(tl.int32), 0) - 1
    tl.store(dst + slot, col, mask=take)
    return written + tl.sum(take.to(tl.int32), 0), equal_seen + tl.sum(equal.to(tl.int32), 0)


@triton.jit
def _rank_members(cand_row, buf_cap, lo, total, base, s2, quota, members, scratch,
                  TILE: tl.constexpr, INTERPRET: tl.constexpr):
    """``_radix_rounds`` for a few members (at most MEMBERS) in the buffer: copied to scratch and
    ranked pairwise."""
    found = 0
    if INTERPRET:
        start = 0
        while start < total:
            key, col, ok = _source_tile(cand_row, cand_row, buf_cap, start, lo, total, False, TILE)
            member = ok & (key >= base) & (((key - base) >> s2.to(tl.uint32)) == 0)
            at = found + tl.cumsum(member.to(tl.int32), 0) - 1
            tl.store(scratch + at, key.to(tl.int32, bitcast=True), mask=member & (at < MEMBERS))
            found += tl.sum(member.to(tl.int32), 0)
            start += TILE
    else:
        for start in range(0, total, TILE):
            key, col, ok = _source_tile(cand_row, cand_row, buf_cap, start, lo, total, False, TILE)
            member = ok & (key >= base) & (((key - base) >> s2.to(tl.uint32)) == 0)
            at = found + tl.cumsum(member.to(tl.int32), 0) - 1
            tl.store(scratch + at, key.to(tl.int32, bitcast=True), mask=member & (at < MEMBERS))
            found += tl.sum(member.to(tl.int32), 0)
    tl.debug_barrier()  # every thread's scratch stores before the loads
    m = tl.arange(0, MEMBERS)
    valid = m < members
    mk = tl.load(scratch + m, mask=valid, other=0).to(tl.uint32, bitcast=True)
    greater = tl.sum(((mk[None, :] > mk[:, None]) & valid[None, :]).to(tl.int32), 1)
    threshold = tl.min(tl.where(valid & (greater < quota), mk, 0xFFFFFFFF), 0).to(tl.uint32)
    return threshold, quota - tl.sum((valid & (mk > threshold)).to(tl.int32), 0)


@triton.jit
def _resolve_path(src, cand_row, buf_cap, dst, lo, total, s2, b2, quota, members, scratch,
                  FROM_ROW: tl.constexpr, TILE: tl.constexpr, INTERPRET: tl.constexpr):
    """The threshold among the cut bin's members, then the row's selection in column order."""
    base = lo + (b2.to(tl.uint32) << s2.to(tl.uint32))
    if FROM_ROW:
        threshold, quota_eq = _radix_rounds(src, cand_row, buf_cap, lo, total, base, s2, quota,
                                            FROM_ROW, TILE, INTERPRET)
    elif members <= MEMBERS:
        threshold, quota_eq = _rank_members(cand_row, buf_cap, lo, total, base, s2, quota, members,
                                            scratch, TILE, INTERPRET)
    else:
        threshold, quota_eq = _radix_rounds(src, cand_row, buf_cap, lo, total, base, s2, quota,
                                            FROM_ROW, TILE, INTERPRET)
    written = 0
    equal_seen = 0
    if INTERPRET:
        start = 0
        while start < total:
            written, equal_seen = _write_tile(src, cand_row, buf_cap, start, lo, total, threshold,
                                              quota_eq, written, equal_seen, dst, FROM_ROW, TILE)
            start += TILE
    else:
        for start in range(0, total, TILE):
            written, equal_seen = _write_tile(src, cand_row, buf_cap, start, lo, total, threshold,
                                              quota_eq, written, equal_seen, dst, FROM_ROW, TILE)


@triton.jit
def _tile_threshold(key, member, base, s2, quota, members, scratch):
    """``_radix_rounds`` over one tile in registers: the quota-th largest member key and how
    many keys equal to it make the cut. Taking every member, or one, is a min or a max; a few
    members are ranked pairwise (through scratch), many by 4-bit rounds in registers."""
    if quota == members:
        threshold = tl.min(tl.where(member, key, 0xFFFFFFFF), 0).to(tl.uint32)
        quota_eq = tl.sum((member & (key == threshold)).to(tl.int32), 0)
    elif quota == 1:
        threshold = tl.max(tl.where(member, key, 0), 0).to(tl.uint32)
        quota_eq = tl.full((), 1, tl.int32)
    elif members <= MEMBERS:
        at = tl.cumsum(member.to(tl.int32), 0) - 1
        tl.store(scratch + at, key.to(tl.int32, bitcast=True), mask=member)
        tl.debug_barrier()  # every thread's scratch stores before the loads
        m = tl.arange(0, MEMBERS)
        valid = m < members
        mk = tl.load(scratch + m, mask=valid, other=0).to(tl.uint32, bitcast=True)
        greater = tl.sum(((mk[None, :] > mk[:, None]) & valid[None, :]).to(tl.int32), 1)
        threshold = tl.min(tl.where(valid & (greater < quota), mk, 0xFFFFFFFF), 0).to(tl.uint32)
        quota_eq = quota - tl.sum((valid & (mk > threshold)).to(tl.int32), 0)
    else:
        rel = key - base
        rounds = (s2 + 3) // 4
        digits = tl.arange(0, 16)
        prefix = tl.zeros((), dtype=tl.uint32)
        left = quota
        r = 0
        while r < rounds:
            shift = (4 * (rounds - 1 - r)).to(tl.uint32)
            match = member & ((rel >> shift >> 4) == prefix)
            hist = tl.histogram(((rel >> shift) & 15).to(tl.int32), 16, mask=match)
            at_least = tl.cumsum(hist, 0, reverse=True)
            digit = tl.maximum(tl.max(tl.where(at_least >= left, digits, -1), 0), 0)
            left -= tl.sum(tl.where(digits > digit, hist, 0), 0)
            prefix = (prefix << 4) | digit.to(tl.uint32)
            r += 1
        threshold = base + prefix
        quota_eq = left
    return threshold, quota_eq


@triton.jit(do_not_specialize=("width", "stride_s", "stride_o", "buf_cap"),
            do_not_specialize_on_alignment=("lens_ptr",))
def _resolve_kernel(scores_ptr, lens_ptr, hist2_ptr, meta_ptr, cand_ptr, scratch_ptr, out_ptr,
                    width, stride_s, stride_o, buf_cap, K: tl.constexpr, NB2: tl.constexpr,
                    TILE: tl.constexpr, INTERPRET: tl.constexpr):
    """Pass 3, a program per row: the exact cut among the candidates, the selection written."""
    row = tl.program_id(0)
    meta = meta_ptr + row.to(tl.int64) * 4
    dst = out_ptr + row.to(tl.int64) * stride_o
    cand_row = cand_ptr + row.to(tl.int64) * 2 * buf_cap
    scratch = scratch_ptr + row.to(tl.int64) * MEMBERS
    # everything the common case needs, loaded at once: the totals, the histogram, the buffer's
    # first tile (read past the candidates, within the buffer; masked below)
    total = tl.load(meta)  # candidates of the row
    lo = tl.load(meta + 1).to(tl.uint32, bitcast=True)
    s2 = tl.load(meta + 2)
    bins = tl.arange(0, NB2)
    hist = tl.load(hist2_ptr + row.to(tl.int64) * NB2 + bins)
    idx = tl.arange(0, TILE)
    key = tl.load(cand_row + idx, mask=idx < buf_cap, other=0).to(tl.uint32, bitcast=True)
    col = tl.load(cand_row + buf_cap + idx, mask=idx < buf_cap, other=-1)
    if total <= K:  # every candidate (every finite key) makes the cut
        if K <= TILE:
            tl.store(dst + idx, tl.where(idx < total, col, -1), mask=idx < K)
        else:
            for start in range(0, K, TILE):
                at = start + idx
                c = tl.load(cand_row + buf_cap + at, mask=at < total, other=-1)
                tl.store(dst + at, c, mask=at < K)
    else:
        at_least = tl.cumsum(hist, 0, reverse=True)
        b2 = tl.max(tl.where(at_least >= K, bins, 0), 0)
        quota = K - tl.sum(tl.where(bins > b2, hist, 0), 0)  # of the cut bin's members
        members = tl.sum(tl.where(bins == b2, hist, 0), 0)
        base = lo + (b2.to(tl.uint32) << s2.to(tl.uint32))
        if total <= TILE:  # the common case: one tile, in registers
            ok = idx < total
            member = ok & (key >= base) & (((key - base) >> s2.to(tl.uint32)) == 0)
            threshold, quota_eq = _tile_threshold(key, member, base, s2, quota, members, scratch)
            equal = ok & (key == threshold)
            take = (ok & (key > threshold)) | (equal & (tl.cumsum(equal.to(tl.int32), 0) <= quota_eq))
            tl.store(dst + tl.cumsum(take.to(tl.int32), 0) - 1, col, mask=take)
        elif total <= buf_cap:
            _resolve_path(scores_ptr, cand_row, buf_cap, dst, lo, total, s2, b2, quota, members,
                          scratch, False, TILE, INTERPRET)
        else:  # more candidates than the buffer holds: the same over the row itself
            n = tl.minimum(tl.load(lens_ptr + row).to(tl.int32), width)
            _resolve_path(scores_ptr + row.to(tl.int64) * stride_s, cand_row, buf_cap, dst, lo, n,
                          s2, b2, quota, members, scratch, True, TILE, INTERPRET)
# fmt: on


@dataclass(frozen=True)
class TwoPassConfig:
    """Launch shape of ``topk_rows_twopass`` (host-side; sizes are powers of two)."""

    chunk: int  # columns a program of pass 2 (collect)
    group: int  # the largest group of keys one sketch count stands for
    bins: int  # sketch bins a row (bins / 64 an octave)
    bins2: int  # candidate-histogram bins a row
    cap: int  # candidates the buffer holds a row
    tile: int  # candidates a step of the resolve launch
    sketch_chunk: int = 4096  # columns a program of pass 1 (sketch), 16 slices
    sketch_warps: int = 2
    collect_warps: int = 8
    resolve_warps: int = 8


def pick_twopass_config(rows: int, width: int, topk: int, device: torch.device) -> TwoPassConfig:
    """Sketch programs of 4096 columns (2 warps: 6 resident an SM), collect programs of 2048 (8
    warps, 62 registers: 4 resident); smaller for batches of at most 16 rows (more programs a
    row) and under the interpreter (1024); groups up to 16; 4096 + 4096 histogram bins
    a row (2048 + 2048 past 1024 rows, to bound the memset); a buffer of max(4 topk, 16384)
    candidates a row (fewer for many rows: about 2^22 slots in all, never under 2 topk nor over
    the width)."""
    interpret = env.triton_interpret() or device.type != "cuda"
    if interpret:
        sketch_chunk = chunk = 1024
    else:  # by the batch alone, so that a decode step's growing width compiles nothing new
        sketch_chunk, chunk = (
            (1024, 1024) if rows <= 4 else (2048, 1024) if rows <= 16 else (4096, 2048)
        )
    many = rows > 1024
    want = max(4 * topk, 16384)
    cap = max(2 * topk, min(want, (1 << 22) // max(rows, 1)))
    cap = min(
        triton.next_power_of_2(cap),
        max(triton.next_power_of_2(2 * topk), triton.next_power_of_2(width)),
    )
    return TwoPassConfig(
        chunk=chunk,
        group=16,
        bins=2048 if many else 4096,
        bins2=2048 if many else 4096,
        cap=max(cap, 16),
        tile=1024 if interpret else 4096,
        sketch_chunk=sketch_chunk,
        sketch_warps=max(1, sketch_chunk // 2048),
        collect_warps=max(1, min(8, chunk // 256)),
    )


def _sketch_constants(bins: int) -> dict:
    """SH1, HP, HN of a sketch of ``bins`` bins: bins / 64 a octave over +-[2^-16, 2^16)."""
    per_octave = bins // 64
    sh1 = 23 - (per_octave.bit_length() - 1)
    hp = (0x80000000 | (111 << 23)) >> sh1  # key of +2^-16
    hn = (0xFFFFFFFF ^ (0x80000000 | (143 << 23))) >> sh1  # key of -2^16
    return dict(SH1=sh1, HP=hp, HN=hn)


def topk_workspace(
    rows: int, width: int, topk: int, device: torch.device, config: TwoPassConfig | None = None
) -> dict[str, torch.Tensor]:
    """The zeroed counters (one memset) and the candidate buffers of a call: ``hist``
    [rows, bins] and ``coarse`` [rows, bins / 64] (the sketch, which a fused producer may fill
    before ``topk_rows_twopass(..., workspace=)``), ``hist2``, ``status``, ``meta``, ``cand``,
    ``scratch``."""
    cfg = config or pick_twopass_config(rows, width, topk, device)
    parts = triton.cdiv(width, cfg.chunk)
    nc1 = cfg.bins // _FINE
    sizes = [cfg.bins, nc1, cfg.bins2, parts, 4]
    flat = torch.zeros(rows * sum(sizes), dtype=torch.int32, device=device)
    views = [v.view(rows, size) for v, size in zip(flat.split([rows * s for s in sizes]), sizes)]
    return {
        "hist": views[0], "coarse": views[1], "hist2": views[2], "status": views[3], "meta": views[4],
        "cand": torch.empty(rows, 2, cfg.cap, dtype=torch.int32, device=device),
        "scratch": torch.empty(rows, _MEMBERS, dtype=torch.int32, device=device),
        "config": cfg,
    }  # fmt: skip


def _check(scores: torch.Tensor, lens: torch.Tensor) -> None:
    if scores.dtype != torch.float32 or scores.dim() != 2 or scores.stride(1) != 1:
        raise ValueError(
            f"topk_rows_twopass takes [T, W] float32 rows, got {scores.dtype} {tuple(scores.shape)}"
        )
    if lens.shape != scores.shape[:1]:
        raise ValueError(f"lens {tuple(lens.shape)} does not match {scores.shape[0]} rows")


def _align(scores: torch.Tensor) -> int:
    """4 when every row starts 16-byte aligned (vector loads), else 1."""
    return 4 if scores.stride(0) % 4 == 0 and scores.data_ptr() % 16 == 0 else 1


def sketch_rows(scores: torch.Tensor, lens: torch.Tensor, topk: int, workspace: dict) -> None:
    """Pass 1 alone: the rows' group maxima into ``workspace``'s sketch (what a fused producer
    does instead; then ``topk_rows_twopass(..., workspace=workspace, sketched=True)``)."""
    _check(scores, lens)
    rows, width = scores.shape
    if rows == 0 or width == 0 or topk == 0:
        return
    cfg = workspace["config"]
    _sketch_kernel[(rows, triton.cdiv(width, cfg.sketch_chunk))](
        scores, lens, workspace["hist"], workspace["coarse"], width, scores.stride(0), K=topk,
        CHUNK=cfg.sketch_chunk, GMAX=cfg.group, ALIGN=_align(scores), num_warps=cfg.sketch_warps,
        NB1=cfg.bins, NC1=cfg.bins // _FINE, **_sketch_constants(cfg.bins),
    )  # fmt: skip


def topk_rows_twopass(
    scores: torch.Tensor,
    lens: torch.Tensor,
    topk: int,
    out: torch.Tensor | None = None,
    *,
    config: TwoPassConfig | None = None,
    workspace: dict | None = None,
    sketched: bool = False,
) -> torch.Tensor:
    """Positions of each row's ``topk`` largest finite scores among its first ``lens`` columns
    (``topk_rows``' contract and result, in two reads of the row).

    Args:
        scores: [T, W] float32; ``-inf`` marks a column that is not a candidate. Columns at or
            past ``lens[row]`` are never read.
        lens: [T] integer columns of each row to consider (clamped to W).
        topk: how many to keep.
        out: [T, topk] int32 to write; default new.
        config: launch shape; default ``pick_twopass_config``.
        workspace: ``topk_workspace``'s tensors (default: made here, one memset).
        sketched: the workspace's sketch is already filled (a fused producer ran pass 1 with
            the same config); pass 1 is skipped.
    Returns:
        [T, topk] int32: the selected columns in increasing order, then -1 where the row had
        fewer than ``topk`` finite scores. Of keys tied at the cut, the earlier columns win.
    """
    _check(scores, lens)
    rows, width = scores.shape
    if out is None:
        out = torch.empty(rows, topk, dtype=torch.int32, device=scores.device)
    if rows == 0 or topk == 0:
        return out
    if width == 0:
        return out.fill_(-1)
    ws = workspace or topk_workspace(rows, width, topk, scores.device, config)
    if not sketched:
        sketch_rows(scores, lens, topk, ws)
    _collect(scores, lens, topk, ws)
    _resolve(scores, lens, topk, ws, out)
    return out


def _collect(scores: torch.Tensor, lens: torch.Tensor, topk: int, ws: dict) -> None:
    """Pass 2 (after the sketch)."""
    rows, width = scores.shape
    cfg = ws["config"]
    _collect_kernel[(rows, triton.cdiv(width, cfg.chunk))](
        scores, lens, ws["hist"], ws["coarse"], ws["hist2"], ws["status"], ws["meta"], ws["cand"],
        width, scores.stride(0), cfg.cap, ws["status"].shape[1], K=topk, CHUNK=cfg.chunk,
        ALIGN=_align(scores), NB1=cfg.bins, NC1=cfg.bins // _FINE, NB2=cfg.bins2, LOOK=64,
        num_warps=cfg.collect_warps, **_sketch_constants(cfg.bins),
    )  # fmt: skip


def _resolve(
    scores: torch.Tensor, lens: torch.Tensor, topk: int, ws: dict, out: torch.Tensor
) -> None:
    """Pass 3 (after the collect; it reads the workspace only, so it may run again)."""
    rows, width = scores.shape
    cfg = ws["config"]
    _resolve_kernel[(rows,)](
        scores, lens, ws["hist2"], ws["meta"], ws["cand"], ws["scratch"], out, width,
        scores.stride(0), out.stride(0), cfg.cap, K=topk, NB2=cfg.bins2, TILE=cfg.tile,
        INTERPRET=env.triton_interpret(), num_warps=cfg.resolve_warps,
    )  # fmt: skip
