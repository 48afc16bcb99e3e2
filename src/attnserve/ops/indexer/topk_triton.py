"""Triton top-k of score rows by radix select: the DSA indexer's selection, without a sort.

``topk_rows(scores, lens, topk)`` returns, for every row, the positions of its ``topk`` largest
finite scores among the first ``lens[row]`` columns (fewer when fewer are finite; -1 fills the
rest). Nothing past ``lens[row]`` is read, so a row of a short sequence in a wide buffer (a CUDA
graph's ``max_model_len`` columns) costs its length, not the width.

How: each float32 score maps to an unsigned 32-bit key in the same order (flip every bit of a
negative number, the sign bit of a positive one). A row is cut into chunks of a few thousand
columns, one program each. Four launches each add every chunk's 256-bin histogram of one key
byte (among the keys that share the bytes already fixed) into the row's; from those, every
program derives the same cut: the byte where the count of larger keys reaches ``topk``. After
the fourth, the key of the k-th largest score is known, and how many keys equal to it make the
cut. A counting launch records each chunk's keys above and equal to that key, and a writing
launch stores each chunk's picks at the offset the chunks before it give (ties go to the
earlier columns). Seven launches, each reading the row once; no sort, no host sync, and the
same result whatever the launch order (no atomics decide a position).

The result is a set in position order, not best first: sparse attention does not depend on
the order of its keys. ``-inf`` marks a column that is not a candidate (masked keys).
The PyTorch twin is ``ops.indexer.logits_triton.topk_from_logits`` (``torch.topk``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve import env

__all__ = ["CHUNK", "sortable_key", "topk_rows"]

# columns per program on a GPU (benchmarks/gpu_dsa_probe.py micro; H200, graph-timed): top-2,048
# of 8 rows of 8K took 30 / 38 / 51 us at 1K / 2K / 4K (torch.topk 48); 64 rows of 32K 92 / 84 /
# 85 (torch.topk 69); 8 rows of 8K in a 128K-wide buffer 30 / 37 / 52 (torch.topk 63)
CHUNK = 2048


# fmt: off
@triton.jit
def sortable_key(x):
    """float32 -> uint32 key with the same order (-inf lowest among the floats)."""
    bits = x.to(tl.int32, bitcast=True)
    flip = (bits >> 31) | -2147483648  # all ones for a negative number, else the sign bit
    return (bits ^ flip).to(tl.uint32, bitcast=True)


@triton.jit
def _tile_histogram(src, start, n, prefix, BLOCK: tl.constexpr, SHIFT: tl.constexpr, FIRST: tl.constexpr):
    """256-bin histogram of key byte SHIFT over one tile, among finite keys matching ``prefix``."""
    offs = start + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < n, other=float("-inf"))
    key = sortable_key(x)
    live = (offs < n) & (x > float("-inf"))
    if not FIRST:
        live = live & ((key >> (SHIFT + 8)) == prefix)
    return tl.histogram(((key >> SHIFT) & 255).to(tl.int32), 256, mask=live)


@triton.jit
def _tile_select(src, dst, start, n, threshold, equal_quota, written, equal_seen, BLOCK: tl.constexpr):
    """Write the tile's keys above ``threshold``, and equal ones while the quota lasts."""
    offs = start + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < n, other=float("-inf"))
    key = sortable_key(x)
    live = (offs < n) & (x > float("-inf"))
    equal = live & (key == threshold)
    equal_rank = equal_seen + tl.cumsum(equal.to(tl.int32), 0) - 1
    take = (live & (key > threshold)) | (equal & (equal_rank < equal_quota))
    slot = written + tl.cumsum(take.to(tl.int32), 0) - 1
    tl.store(dst + slot, offs, mask=take)
    return written + tl.sum(take.to(tl.int32), 0), equal_seen + tl.sum(equal.to(tl.int32), 0)


@triton.jit
def _cut_so_far(hist_ptr, row, PASSES: tl.constexpr, K: tl.constexpr):
    """(prefix, remaining, total) after the first PASSES byte passes of a row: the key bytes
    fixed, how many keys sharing them still make the cut, and the row's finite keys."""
    bins = tl.arange(0, 256)
    prefix = tl.zeros((), dtype=tl.uint32)
    remaining = tl.full((), K, dtype=tl.int32)
    total = tl.zeros((), dtype=tl.int32)
    for p in tl.static_range(PASSES):
        hist = tl.load(hist_ptr + (row.to(tl.int64) * 4 + p) * 256 + bins)
        if p == 0:
            total = tl.sum(hist, 0)
        at_least = tl.cumsum(hist, 0, reverse=True)  # keys whose byte is >= bin
        byte = tl.maximum(tl.max(tl.where(at_least >= remaining, bins, -1), 0), 0)
        remaining -= tl.sum(tl.where(bins > byte, hist, 0), 0)
        prefix = (prefix << 8) | byte.to(tl.uint32)
    return prefix, remaining, total


@triton.jit(do_not_specialize=("width", "stride_s"), do_not_specialize_on_alignment=("lens_ptr",))
def _topk_hist_kernel(scores_ptr, lens_ptr, hist_ptr, width, stride_s, K: tl.constexpr,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr, PASS: tl.constexpr,
                      INTERPRET: tl.constexpr):
    """Pass PASS: this chunk's histogram of key byte PASS, added to the row's."""
    row = tl.program_id(0)
    n = tl.minimum(tl.load(lens_ptr + row).to(tl.int32), width)
    lo = tl.program_id(1) * CHUNK
    if lo >= n:
        return
    hi = tl.minimum(lo + CHUNK, n)
    prefix, remaining, total = _cut_so_far(hist_ptr, row, PASS, K)
    src = scores_ptr + row.to(tl.int64) * stride_s
    hist = tl.zeros([256], dtype=tl.int32)
    if INTERPRET:  # the interpreter's range() cannot take a loaded bound
        start = lo
        while start < hi:
            hist += _tile_histogram(src, start, hi, prefix, BLOCK, 24 - 8 * PASS, PASS == 0)
            start += BLOCK
    else:
        for start in range(lo, hi, BLOCK):
            hist += _tile_histogram(src, start, hi, prefix, BLOCK, 24 - 8 * PASS, PASS == 0)
    tl.atomic_add(hist_ptr + (row.to(tl.int64) * 4 + PASS) * 256 + tl.arange(0, 256), hist)


@triton.jit(do_not_specialize=("width", "stride_s", "stride_o", "num_parts"),
            do_not_specialize_on_alignment=("lens_ptr",))
def _topk_select_kernel(scores_ptr, lens_ptr, hist_ptr, counts_ptr, out_ptr, width, stride_s,
                        stride_o, num_parts, K: tl.constexpr, CHUNK: tl.constexpr,
                        BLOCK: tl.constexpr, PARTS_PAD: tl.constexpr, WRITE: tl.constexpr,
                        INTERPRET: tl.constexpr):
    """Count (WRITE False: keys above the cut and equal to it, per chunk) or write the row's
    selection, each chunk at the offset the counts of the chunks before it give."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    n = tl.minimum(tl.load(lens_ptr + row).to(tl.int32), width)
    lo = part * CHUNK
    if (part > 0) & (lo >= n):  # chunk 0 always runs: it writes the -1 tail
        return
    hi = tl.minimum(lo + CHUNK, n)
    prefix, remaining, total = _cut_so_far(hist_ptr, row, 4, K)
    take_all = total <= K  # every finite key makes the cut: no threshold
    threshold = tl.where(take_all, 0, prefix).to(tl.uint32)
    equal_quota = tl.where(take_all, 0, remaining)
    src = scores_ptr + row.to(tl.int64) * stride_s
    counts = counts_ptr + row.to(tl.int64) * num_parts * 2
    if WRITE:
        parts = tl.arange(0, PARTS_PAD)
        above = tl.load(counts + parts * 2, mask=parts < num_parts, other=0)
        equal = tl.load(counts + parts * 2 + 1, mask=parts < num_parts, other=0)
        equal_before = tl.sum(tl.where(parts < part, equal, 0), 0)
        written = tl.sum(tl.where(parts < part, above, 0), 0) + tl.minimum(equal_before, equal_quota)
        dst = out_ptr + row.to(tl.int64) * stride_o
        if INTERPRET:
            start = lo
            while start < hi:
                written, equal_before = _tile_select(src, dst, start, hi, threshold, equal_quota,
                                                     written, equal_before, BLOCK)
                start += BLOCK
        else:
            for start in range(lo, hi, BLOCK):
                written, equal_before = _tile_select(src, dst, start, hi, threshold, equal_quota,
                                                     written, equal_before, BLOCK)
        if part == 0:
            taken = tl.sum(above, 0) + tl.minimum(tl.sum(equal, 0), equal_quota)
            for start in range(0, K, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                tl.store(dst + offs, -1, mask=(offs >= taken) & (offs < K))
    else:
        above = 0
        equal = 0
        if INTERPRET:
            start = lo
            while start < hi:
                a, e = _tile_count(src, start, hi, threshold, BLOCK)
                above += a
                equal += e
                start += BLOCK
        else:
            for start in range(lo, hi, BLOCK):
                a, e = _tile_count(src, start, hi, threshold, BLOCK)
                above += a
                equal += e
        tl.store(counts + part * 2, above)
        tl.store(counts + part * 2 + 1, equal)


@triton.jit
def _tile_count(src, start, n, threshold, BLOCK: tl.constexpr):
    """(keys above ``threshold``, keys equal to it) among the tile's finite keys."""
    offs = start + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < n, other=float("-inf"))
    key = sortable_key(x)
    live = (offs < n) & (x > float("-inf"))
    above = tl.sum((live & (key > threshold)).to(tl.int32), 0)
    return above, tl.sum((live & (key == threshold)).to(tl.int32), 0)
# fmt: on


def topk_rows(
    scores: torch.Tensor,
    lens: torch.Tensor,
    topk: int,
    out: torch.Tensor | None = None,
    *,
    chunk: int | None = None,
) -> torch.Tensor:
    """Positions of each row's ``topk`` largest finite scores among its first ``lens`` columns.

    Args:
        scores: [T, W] float32; ``-inf`` marks a column that is not a candidate. Columns at or
            past ``lens[row]`` are never read (they may hold anything).
        lens: [T] integer columns of each row to consider (clamped to W).
        topk: how many to keep.
        out: [T, topk] int32 to write; default new.
        chunk: columns per program, a multiple of the tile (1024 on a GPU, 256 under the
            interpreter); default ``CHUNK`` (the interpreter: two tiles).
    Returns:
        [T, topk] int32: the selected columns in increasing order, then -1 where the row had
        fewer than ``topk`` finite scores. Of keys tied at the cut, the earlier columns win.
    """
    if scores.dtype != torch.float32 or scores.dim() != 2 or scores.stride(1) != 1:
        raise ValueError(
            f"topk_rows takes [T, W] float32 rows, got {scores.dtype} {tuple(scores.shape)}"
        )
    if lens.shape != scores.shape[:1]:
        raise ValueError(f"lens {tuple(lens.shape)} does not match {scores.shape[0]} rows")
    rows, width = scores.shape
    if out is None:
        out = torch.empty(rows, topk, dtype=torch.int32, device=scores.device)
    if rows == 0 or topk == 0:
        return out
    interpret = env.triton_interpret()
    block = 256 if interpret else 1024
    chunk = chunk or (2 * block if interpret else CHUNK)  # keys per program
    if chunk % block:
        raise ValueError(f"chunk {chunk} is not a multiple of the tile, {block}")
    parts = max(1, triton.cdiv(width, chunk))
    hist = torch.zeros(rows, 4, 256, dtype=torch.int32, device=scores.device)
    counts = torch.zeros(rows, parts, 2, dtype=torch.int32, device=scores.device)
    meta = dict(K=topk, CHUNK=chunk, BLOCK=block, INTERPRET=interpret, num_warps=4)
    for p in range(4):  # one launch per key byte: each needs every chunk's previous histograms
        _topk_hist_kernel[(rows, parts)](
            scores, lens, hist, width, scores.stride(0), PASS=p, **meta
        )
    for write in (False, True):
        _topk_select_kernel[(rows, parts)](
            scores,
            lens,
            hist,
            counts,
            out,
            width,
            scores.stride(0),
            out.stride(0),
            parts,
            PARTS_PAD=triton.next_power_of_2(parts),
            WRITE=write,
            **meta,
        )
    return out
