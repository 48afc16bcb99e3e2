"""Triton paged attention for standard (MHA/GQA/MQA) layers: one kernel for mixed batches.

``unified_attention`` runs decode, prefill and chunked prefill over a cached prefix in one
launch. A program owns a block of query tokens of one request and every query head of one KV
head (GQA rows are stacked, so K/V are read once per group), walks the request's block table
and keeps an online softmax in fp32. Long decodes split the context over several programs
(split-KV) whose partial outputs are merged by log-sum-exp: by default inside the same launch,
by the last split to finish for its (q block, KV head) (an int32 arrival counter per such row in
a persistent per-device workspace: each split stores its partial rows, then counts itself in
with an acq_rel atomic; the one that arrives last reads every split's rows, writes the output
and sets the counter back to 0 for the next launch or graph replay); with ``merge="kernel"``
by a second kernel, the older form kept for timing against it.

It is not a backend: building metadata and choosing when to call it live in
``attention/backends``. Writing new K/V into the cache is ``ops/attention/kv_write_triton.py``. The
PyTorch twin it must match is ``attention.reference.paged_attention``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnserve import env
from attnserve.ops.launch import compute_dtype, num_sms, pow2
from attnserve.ops.tiles import find_seq

__all__ = ["AttentionConfig", "pick_config", "pick_num_splits", "split_counters", "unified_attention"]

_LOG2E = tl.constexpr(1.4426950408889634)  # scores are kept in log2 units: exp2 is cheaper


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Launch shape of one call: rows = block_q tokens x group_pad query heads."""

    block_q: int  # query tokens per program
    group_pad: int  # query heads per KV head, padded to a power of two
    block_n: int  # keys per inner-loop tile
    num_warps: int
    num_stages: int

    @property
    def block_m(self) -> int:
        return self.block_q * self.group_pad


def pick_config(
    head_size: int, group: int, max_query_len: int, interpret: bool | None = None
) -> AttentionConfig:
    """Block shapes from the problem shape (no autotuning: one config per shape class).

    Args:
        head_size: the larger of the K and V head sizes.
        group: query heads per KV head.
        max_query_len: longest run of new tokens in the batch (1 means decode only).
        interpret: force the interpreter's config; default ``env.triton_interpret()``.
    Returns:
        An ``AttentionConfig``; rows per program are at least 16, as ``tl.dot`` needs.
    """
    if interpret is None:
        interpret = env.triton_interpret()
    group_pad = pow2(group)
    # Defaults measured on the H200 with benchmarks/tune_attention.py (bf16, GQA 32/8, head
    # 128): decode 64-key tiles, 4 warps, 2 stages were within 2% of the best of 54 variants
    # at every shape (3 stages lost up to 14%); prefill 128x64 tiles, 4 warps, 4 stages gave
    # 335 TFLOP/s at 8K against 287 for the 8-warp, 3-stage guess.
    if max_query_len == 1:  # decode: one token per program, pad the head group to 16 rows
        block_n = 64 if interpret or head_size <= 128 else 32
        return AttentionConfig(1, max(16, group_pad), block_n, 4, 1 if interpret else 2)
    if interpret:  # few, large programs: the interpreter pays per program and per op
        target_m, block_n, warps, stages = 64, 64, 4, 1
    elif head_size <= 128:
        target_m, block_n, warps, stages = 128, 64, 4, 4
    else:
        target_m, block_n, warps, stages = 64, 64, 8, 2
    block_q = max(1, target_m // group_pad)
    block_q = max(min(block_q, pow2(max_query_len)), pow2(16 // group_pad))
    return AttentionConfig(block_q, group_pad, block_n, warps, stages)


def pick_num_splits(
    num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, device: torch.device
) -> int:
    """KV splits per (request, KV head): enough programs for about four waves of SMs.

    Only decode-only batches split; each split keeps at least one 64-key tile; powers of two
    only, so that few reduce kernels get compiled. Under the interpreter: 1.
    """
    if max_query_len != 1 or device.type != "cuda" or env.triton_interpret():
        return 1
    programs = num_seqs * num_kv_heads
    # about four waves: on the H200, batch 16 at 16K context read 97% of bandwidth with 4
    # splits against 78% with the 2 that two waves gave (benchmarks/tune_attention.py); short
    # contexts split down to one tile a split: batch 1 at 1K took 9.5 us with 16 splits
    # against 21.8 with the 2 that 512-key splits allowed, batch 2 at 4K 19.0 against 26.4
    # (tune_attention.py --splits, 2026-12-01); 64 splits at most (128 lost at 16K-64K)
    want = triton.cdiv(4 * num_sms(device), programs)
    splits = min(want, max_seq_len // 64, 64)
    return 1 if splits < 2 else 1 << (splits.bit_length() - 1)


# Per-step integers (batch sizes, split counts, block-table widths) are not specialised on: by
# default Triton compiles a variant per class of each integer (== 1, divisible by 16, other)
# and per 16-byte alignment of each pointer, and a new variant met mid-run costs seconds of
# compilation in that step (on the H200: 2.6-3.9 s, twice in the nano-vllm workload, where the
# prefill part of a mixed step reads seq_lens[num_decodes:]).
_PER_STEP = ("num_seqs", "num_splits", "stride_bt")
_SLICED = ("bt_ptr", "qsl_ptr", "seq_lens_ptr")  # metadata slices start anywhere

# Kernels keep their dense argument lists: one argument per line would triple their length.
# fmt: off
@triton.jit
def _attend_tile(acc, m_i, l_i, q, t, k_base, v_base, bt_row, q_pos, slope, seq_len, window,
                 qk_scale, softcap, stride_kb, stride_ks, stride_vb, stride_vs,
                 MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, USE_ALIBI: tl.constexpr,
                 USE_SOFTCAP: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, HEAD_V: tl.constexpr,
                 HEAD_V_PAD: tl.constexpr, DT: tl.constexpr, PRECISION: tl.constexpr):
    """Online-softmax update with key tile t; scores in log2 units.

    A MASKED tile may hold keys past seq_len, beyond the causal diagonal or outside the
    window; an unmasked tile is visible to every row, so it skips the mask arithmetic.
    """
    d = tl.arange(0, HEAD_PAD)
    dv = tl.arange(0, HEAD_V_PAD)
    k_pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
    if MASKED:  # past seq_len the table may end: read the null block there, masked below
        blk = tl.load(bt_row + k_pos // PAGE, mask=k_pos < seq_len, other=0)
    else:
        blk = tl.load(bt_row + k_pos // PAGE)
    blk = blk.to(tl.int64)
    k_off = blk * stride_kb + (k_pos % PAGE) * stride_ks  # [BLOCK_N]
    v_off = blk * stride_vb + (k_pos % PAGE) * stride_vs
    k = tl.load(k_base + k_off[None, :] + d[:, None], mask=d[:, None] < HEAD, other=0.0)
    v_mask = dv[None, :] < HEAD_V
    if MASKED:  # unused slots may hold NaN, and 0 * NaN would reach acc
        v_mask = v_mask & (k_pos[:, None] < seq_len)
    v = tl.load(v_base + v_off[:, None] + dv[None, :], mask=v_mask, other=0.0)
    s = tl.dot(q, k.to(DT), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    if USE_SOFTCAP or USE_ALIBI:
        s = s * qk_scale
        if USE_SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both infinities
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        if USE_ALIBI:
            s = s - slope[:, None] * (q_pos[:, None] - k_pos[None, :]).to(tl.float32)
        s = s * _LOG2E
    else:
        s = s * (qk_scale * _LOG2E)
    if MASKED:
        visible = k_pos[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(DT), v.to(DT), acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, tile_begin, tile_end, k_base, v_base, bt_row, q_pos,
                  slope, seq_len, window, qk_scale, softcap, stride_kb, stride_ks, stride_vb,
                  stride_vs, MASKED: tl.constexpr, USE_WINDOW: tl.constexpr,
                  USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_N: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr,
                  HEAD_V: tl.constexpr, HEAD_V_PAD: tl.constexpr, DT: tl.constexpr,
                  PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """Key tiles [tile_begin, tile_end). A for loop on GPU (software-pipelined); a while loop
    under the interpreter, whose range() cannot take a loaded bound with numpy 2."""
    if INTERPRET:
        t = tile_begin
        while t < tile_end:
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, t, k_base, v_base, bt_row, q_pos, slope, seq_len, window,
                qk_scale, softcap, stride_kb, stride_ks, stride_vb, stride_vs, MASKED,
                USE_WINDOW, USE_ALIBI, USE_SOFTCAP, PAGE, BLOCK_N, HEAD, HEAD_PAD, HEAD_V,
                HEAD_V_PAD, DT, PRECISION)
            t += 1
    else:
        for t in range(tile_begin, tile_end):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, t, k_base, v_base, bt_row, q_pos, slope, seq_len, window,
                qk_scale, softcap, stride_kb, stride_ks, stride_vb, stride_vs, MASKED,
                USE_WINDOW, USE_ALIBI, USE_SOFTCAP, PAGE, BLOCK_N, HEAD, HEAD_PAD, HEAD_V,
                HEAD_V_PAD, DT, PRECISION)
    return acc, m_i, l_i


@triton.jit
def _locate(qsl_ptr, num_seqs, order, BLOCK_Q: tl.constexpr, DECODE_ONLY: tl.constexpr):
    """This program's (request, first token row, new tokens, q block of the request), from its
    rank ``order`` in the launch order of the first grid axis."""
    q_block_id = tl.num_programs(0) - 1 - order  # last (longest) blocks first
    if DECODE_ONLY:  # max_query_len == 1: program i is request i, no search
        seq = q_block_id
    else:
        seq = find_seq(qsl_ptr, num_seqs, q_block_id, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if DECODE_ONLY:
        q_block = 0
    elif BLOCK_Q > 1:
        q_block = q_block_id - (q_start // BLOCK_Q + seq)
    else:
        q_block = q_block_id - q_start
    return seq, q_start, q_len, q_block


@triton.jit
def _store_rows(out_rows, lse_rows, acc, m_i, l_i, row_ok, v_scale, PARTIAL: tl.constexpr,
                HEAD_V: tl.constexpr, HEAD_V_PAD: tl.constexpr):
    """Normalised rows to out; PARTIAL rows stay fp32 and add their lse (log2, -inf if empty)."""
    dv = tl.arange(0, HEAD_V_PAD)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None] * v_scale
    mask = row_ok[:, None] & (dv[None, :] < HEAD_V)
    tl.store(out_rows[:, None] + dv[None, :], o.to(out_rows.dtype.element_ty), mask=mask)
    if PARTIAL:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_rows, lse, mask=row_ok)


@triton.jit
def _key_tiles(q_pos_lo, q_pos_hi, window, split, num_splits, USE_WINDOW: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """This program's key tiles: [lo, full_lo) masked, [full_lo, full_hi) not, [full_hi, hi)."""
    begin = 0
    full_begin = 0
    if USE_WINDOW:
        begin = tl.maximum(q_pos_lo - window + 1, 0)
        full_begin = tl.maximum(q_pos_hi - window + 1, 0)
    tile_lo = begin // BLOCK_N
    tile_hi = tl.cdiv(q_pos_hi + 1, BLOCK_N)
    full_hi = (q_pos_lo + 1) // BLOCK_N  # tiles whose last key is <= every row's position
    full_lo = tl.minimum(tl.cdiv(full_begin, BLOCK_N), full_hi)
    per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
    lo = tile_lo + split * per_split
    hi = tl.minimum(lo + per_split, tile_hi)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _merge_chunk(part_out_ptr, part_lse_ptr, first, s0, num_splits, m, denom, o,
                 CHUNK: tl.constexpr, HEAD_V: tl.constexpr, HEAD_V_PAD: tl.constexpr):
    """Fold splits [s0, s0 + CHUNK) of one (token, head) row into the running (m, denom, o)."""
    s = s0 + tl.arange(0, CHUNK)
    dv = tl.arange(0, HEAD_V_PAD)
    # .cg: the other splits' rows were written by other SMs; read them from L2, not L1
    lse = tl.load(part_lse_ptr + first + s, mask=s < num_splits, other=float("-inf"),
                  cache_modifier=".cg")
    m_new = tl.maximum(m, tl.max(lse, 0))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # every split empty so far
    w = tl.where(lse > float("-inf"), tl.exp2(lse - m_safe), 0.0)
    part = tl.load(part_out_ptr + (first + s)[:, None] * HEAD_V + dv[None, :],
                   mask=(w[:, None] > 0.0) & (dv[None, :] < HEAD_V), other=0.0,
                   cache_modifier=".cg")
    alpha = tl.exp2(m - m_safe)
    return m_new, denom * alpha + tl.sum(w, 0), o * alpha + tl.sum(part * w[:, None], 0)


@triton.jit
def _merge_head(part_out_ptr, part_lse_ptr, out_row, first, sinks_ptr, head, v_scale,
                num_splits, USE_SINKS: tl.constexpr, CHUNK: tl.constexpr, HEAD_V: tl.constexpr,
                HEAD_V_PAD: tl.constexpr, INTERPRET: tl.constexpr):
    """out = sum_s 2^(lse_s - M) o_s / (sum_s 2^(lse_s - M) + 2^(sink - M)) for one (token,
    head): its splits' rows start at ``first``; CHUNK of them per step, online."""
    m = tl.full([], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([], dtype=tl.float32)
    if USE_SINKS:  # the sink starts the running max and adds 2^0 = 1, as in the kernel above
        m = tl.load(sinks_ptr + head).to(tl.float32) * _LOG2E
        denom += 1.0
    o = tl.zeros([HEAD_V_PAD], dtype=tl.float32)
    if INTERPRET:  # range() cannot take a run-time bound there (see _attend_tiles)
        s0 = 0
        while s0 < num_splits:
            m, denom, o = _merge_chunk(part_out_ptr, part_lse_ptr, first, s0, num_splits, m,
                                       denom, o, CHUNK, HEAD_V, HEAD_V_PAD)
            s0 += CHUNK
    else:
        for s0 in range(0, num_splits, CHUNK):
            m, denom, o = _merge_chunk(part_out_ptr, part_lse_ptr, first, s0, num_splits, m,
                                       denom, o, CHUNK, HEAD_V, HEAD_V_PAD)
    dv = tl.arange(0, HEAD_V_PAD)
    o = o / tl.where(denom > 0.0, denom, 1.0) * v_scale
    tl.store(out_row + dv, o.to(out_row.dtype.element_ty), mask=dv < HEAD_V)


@triton.jit
def _merge_own_rows(part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr, v_scale, num_splits,
                    q_start, q_len, q_block, kv_head, num_heads, stride_ot, stride_oh,
                    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, USE_SINKS: tl.constexpr,
                    CHUNK: tl.constexpr, HEAD_V: tl.constexpr, HEAD_V_PAD: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """The last split's merge: every (token, head) row of this program, one at a time."""
    for r in range(BLOCK_Q * GROUP):
        tok = q_block * BLOCK_Q + r // GROUP
        if tok < q_len:
            token = (q_start + tok).to(tl.int64)
            head = kv_head * GROUP + r % GROUP
            _merge_head(part_out_ptr, part_lse_ptr, out_ptr + token * stride_ot + head * stride_oh,
                        (token * num_heads + head) * num_splits, sinks_ptr, head, v_scale,
                        num_splits, USE_SINKS, CHUNK, HEAD_V, HEAD_V_PAD, INTERPRET)


@triton.jit(do_not_specialize=_PER_STEP, do_not_specialize_on_alignment=_SLICED)
def _attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr, bt_ptr,
    qsl_ptr, seq_lens_ptr, alibi_ptr, sinks_ptr, qk_scale, softcap, v_scale, window, num_seqs,
    num_splits, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, HEAD_V: tl.constexpr,
    HEAD_V_PAD: tl.constexpr, USE_WINDOW: tl.constexpr, USE_ALIBI: tl.constexpr,
    USE_SINKS: tl.constexpr, USE_SOFTCAP: tl.constexpr, SPLIT: tl.constexpr,
    MERGE_LAST: tl.constexpr, MERGE_CHUNK: tl.constexpr, DECODE_ONLY: tl.constexpr, DT: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    if DECODE_ONLY:  # launch order: every KV head of a request before the next request, so
        # that the last requests (the runner puts the longest decodes last) start first and the
        # short ones fill the end of the launch; not each head's requests in turn
        rank = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        kv_head = rank % tl.num_programs(1)
        order = rank // tl.num_programs(1)
    else:
        kv_head = tl.program_id(1)
        order = tl.program_id(0)
    split = tl.program_id(2)
    seq, q_start, q_len, q_block = _locate(qsl_ptr, num_seqs, order, BLOCK_Q, DECODE_ONLY)
    if q_block * BLOCK_Q >= q_len:  # spare program, or a request without new tokens
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)  # row = token * GROUP_PAD + head in group
    tok = q_block * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (tok < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = ctx_len + tok
    d = tl.arange(0, HEAD_PAD)
    q_off = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh  # [BLOCK_M]
    q = tl.load(q_ptr + q_off[:, None] + d[None, :],
                mask=row_ok[:, None] & (d[None, :] < HEAD), other=0.0).to(DT)

    slope = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    if USE_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], -1e30, dtype=tl.float32)  # finite: no inf - inf
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    if USE_SINKS and not SPLIT:  # the sink starts the running max and adds exp(0) = 1
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        m_i = sink * _LOG2E
        l_i += 1.0
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_V_PAD], dtype=tl.float32)

    q_pos_lo = ctx_len + q_block * BLOCK_Q
    q_pos_hi = ctx_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q) - 1
    lo, full_lo, full_hi, hi = _key_tiles(q_pos_lo, q_pos_hi, window, split, num_splits,
                                          USE_WINDOW, BLOCK_N)
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for phase in tl.static_range(3):  # masked (window edge), fully visible, masked (diagonal)
        if phase == 0:
            begin, end = lo, full_lo
        elif phase == 1:
            begin, end = full_lo, full_hi
        else:
            begin, end = full_hi, hi
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, begin, end, k_base, v_base, bt_row, q_pos, slope, seq_len, window,
            qk_scale, softcap, stride_kb, stride_ks, stride_vb, stride_vs, phase != 1,
            USE_WINDOW, USE_ALIBI, USE_SOFTCAP, PAGE, BLOCK_N, HEAD, HEAD_PAD, HEAD_V,
            HEAD_V_PAD, DT, PRECISION, INTERPRET)

    token = (q_start + tok).to(tl.int64)
    if SPLIT:  # partial rows [token, head, split], merged below or by _merge_splits_kernel
        first = (token * (GROUP * tl.num_programs(1)) + head) * num_splits
        _store_rows(part_out_ptr + (first + split) * HEAD_V, part_lse_ptr + first + split, acc,
                    m_i, l_i, row_ok, 1.0, True, HEAD_V, HEAD_V_PAD)
        if MERGE_LAST:
            # one counter per (q block, KV head): ``order``, not program_id(0), which in the
            # decode launch order is not the q block (two rows would share a counter and merge
            # before every split had stored its partials)
            counter = counter_ptr + order * tl.num_programs(1) + kv_head
            tl.debug_barrier()  # every thread's partial rows are stored before the release
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:  # the last split of this (q block, KV head)
                _merge_own_rows(part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr, v_scale,
                                num_splits, q_start, q_len, q_block, kv_head,
                                GROUP * tl.num_programs(1), stride_ot, stride_oh, GROUP, BLOCK_Q,
                                USE_SINKS, MERGE_CHUNK, HEAD_V, HEAD_V_PAD, INTERPRET)
                tl.store(counter, 0)  # clean for the next launch (stream order)
    else:
        _store_rows(out_ptr + token * stride_ot + head * stride_oh, part_lse_ptr, acc, m_i, l_i,
                    row_ok, v_scale, False, HEAD_V, HEAD_V_PAD)


@triton.jit(do_not_specialize=("num_seqs", "num_splits"), do_not_specialize_on_alignment=("qsl_ptr",))
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr, qsl_ptr, v_scale,
                         num_seqs, num_heads, num_splits, stride_ot, stride_oh,
                         SPLITS_PAD: tl.constexpr, HEAD_V: tl.constexpr,
                         HEAD_V_PAD: tl.constexpr, USE_SINKS: tl.constexpr,
                         INTERPRET: tl.constexpr):
    """The separate merge (``merge="kernel"``): one program per (token, head)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(qsl_ptr + num_seqs):  # padding rows beyond the batch's tokens
        return
    o_off = token.to(tl.int64) * stride_ot + head * stride_oh
    _merge_head(part_out_ptr, part_lse_ptr, out_ptr + o_off,
                (token.to(tl.int64) * num_heads + head) * num_splits, sinks_ptr, head, v_scale,
                num_splits, USE_SINKS, SPLITS_PAD, HEAD_V, HEAD_V_PAD, INTERPRET)


# fmt: on


_MERGES = ("last_split", "kernel")
_MIN_COUNTERS = 4096
_MERGE_CHUNK = 64  # splits the in-kernel merge reads per step: pick_num_splits' most, one variant


@functools.cache
def _arrival_counters(device: torch.device, size: int) -> torch.Tensor:
    """[size] int32 zeros on ``device``, allocated once per (device, size) and kept for good.

    The in-kernel merge's counters: each launch leaves them at 0. Sizes are powers of two, so
    few are ever made; none is freed, since a captured CUDA graph keeps pointing at the one it
    was captured with. Launches on two streams of one device at once would share counters: the
    engine runs its forwards on one stream.
    """
    return torch.zeros(size, dtype=torch.int32, device=device)


def split_counters(device: torch.device, rows: int) -> torch.Tensor:
    """The persistent int32 arrival counters of ``merge="last_split"`` launches on ``device``
    (one a row; at least ``rows``, shared by every launch), each 0 between launches."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _arrival_counters(device, max(_MIN_COUNTERS, triton.next_power_of_2(rows)))


def _check_inputs(q, key_cache, value_cache, out, block_table) -> None:
    num_heads, num_kv_heads = q.shape[1], key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if q.shape[2] != key_cache.shape[3] or out.shape[2] != value_cache.shape[3]:
        raise ValueError(
            f"head sizes differ: q {tuple(q.shape)}, key_cache "
            f"{tuple(key_cache.shape)}, value_cache {tuple(value_cache.shape)}, "
            f"out {tuple(out.shape)}"
        )
    named = dict(q=q, key_cache=key_cache, value_cache=value_cache, out=out, table=block_table)
    for name, t in named.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")


def unified_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    alibi: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int | None = None,
    merge: str = "last_split",
) -> torch.Tensor:
    """Causal paged attention of a mixed batch (decodes, prefills, chunked prefills).

    Args:
        q: [num_tokens, num_heads, head_size]; request i owns rows
            ``query_start_loc[i]:query_start_loc[i+1]``, the last tokens of its sequence.
            Rows past ``query_start_loc[-1]`` (padding) are left untouched in ``out``.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size(_v)],
            q's dtype or ``torch.float8_e4m3fn``; block 0 is the null block.
        out: [num_tokens, num_heads, head_size_v], written in place.
        block_table: [num_seqs, max_blocks] int32; query_start_loc: [num_seqs + 1] int32;
            seq_lens: [num_seqs] int32 (cached tokens after this step).
        scale: softmax scale. window: keys with ``pos_q - pos_k < window`` are visible.
        alibi: [num_heads] slopes (bias ``-slope * (pos_q - pos_k)``). sinks: [num_heads]
            logits that join only the denominator. softcap: ``cap * tanh(s / cap)``.
        k_scale, v_scale: dequantisation scales of an fp8 cache.
        max_query_len, max_seq_len: host-side upper bounds (no device sync is made);
            ``max_query_len == 1`` selects the decode path (one program per request).
        num_splits: KV splits per program; default ``pick_num_splits`` (decode only).
        merge: how split partials are merged: "last_split" (in the same launch, by the split
            that finishes last) or "kernel" (a second launch; the older form, for timing).
    Returns:
        ``out``.
    """
    _check_inputs(q, key_cache, value_cache, out, block_table)
    if merge not in _MERGES:
        raise ValueError(f"merge must be one of {_MERGES}, got {merge!r}")
    interpret = env.triton_interpret()
    num_tokens, num_heads, head = q.shape
    num_kv_heads, head_v = key_cache.shape[2], value_cache.shape[3]
    num_seqs, group = seq_lens.shape[0], num_heads // num_kv_heads
    cfg = pick_config(max(head, head_v), group, max_query_len, interpret)
    if num_splits is None:
        num_splits = pick_num_splits(num_seqs, num_kv_heads, max_query_len, max_seq_len, q.device)
    split = num_splits > 1
    part_out = part_lse = out  # unused unless split
    if split:  # [num_tokens, num_heads, num_splits, head_size_v] partial outputs, and lse
        part_out = q.new_empty(num_tokens, num_heads, num_splits, head_v, dtype=torch.float32)
        part_lse = q.new_empty(num_tokens, num_heads, num_splits, dtype=torch.float32)
    decode_only = max_query_len == 1
    if decode_only:
        num_q_blocks = num_seqs
    else:  # enough for every request's blocks; spare programs return at once
        num_q_blocks = num_tokens // cfg.block_q + num_seqs if cfg.block_q > 1 else num_tokens
    merge_last = split and merge == "last_split"
    # unused without merge_last: out, not a metadata slice whose alignment varies (a recompile)
    counters = split_counters(q.device, num_q_blocks * num_kv_heads) if merge_last else out
    dt = compute_dtype(q.dtype, interpret)
    alibi_arg, sinks_arg = (x if x is not None else q for x in (alibi, sinks))  # q: unused
    # fmt: off
    _attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        q, key_cache, value_cache, out, part_out, part_lse, counters, block_table,
        query_start_loc, seq_lens, alibi_arg, sinks_arg, scale * k_scale, softcap or 1.0, v_scale, window or 0,
        num_seqs, num_splits, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3], block_table.stride(0),
        GROUP=group, GROUP_PAD=cfg.group_pad, BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n,
        PAGE=key_cache.shape[1], HEAD=head, HEAD_PAD=pow2(head, 16), HEAD_V=head_v,
        HEAD_V_PAD=pow2(head_v, 16), USE_WINDOW=window is not None, USE_ALIBI=alibi is not None,
        USE_SINKS=sinks is not None, USE_SOFTCAP=softcap is not None, SPLIT=split,
        MERGE_LAST=merge_last, MERGE_CHUNK=_MERGE_CHUNK, DECODE_ONLY=decode_only, DT=dt, PRECISION="ieee" if dt == tl.float32 else "tf32",
        INTERPRET=interpret, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split and not merge_last:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, sinks_arg, query_start_loc, v_scale, num_seqs, num_heads,
            num_splits, out.stride(0), out.stride(1), SPLITS_PAD=pow2(num_splits, 2),
            HEAD_V=head_v, HEAD_V_PAD=pow2(head_v, 16), USE_SINKS=sinks is not None,
            INTERPRET=interpret, num_warps=4,
        )
    # fmt: on
    return out
