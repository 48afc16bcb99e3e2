"""Causal paged prefill (GQA, head 128) as a Gluon (``triton.experimental.gluon``) Hopper kernel.

The contract of ``ops/attention/paged_triton.unified_attention`` restricted to its prefill class:
``max_query_len > 1``, plain causal attention (no window, alibi, sinks, softcap or fp8 scales),
bf16 or fp16 q and caches, head size 128 for K and V, 1..8 query heads per KV head, pages a
multiple of 8 rows, contiguous caches. Requests may have cached context before their new tokens
(prefix hits, chunked prefill): those keys are visible to every query of the chunk.

A program owns 128 query rows, token-major as in the Triton kernel: ``128 / group_pad`` tokens of
one request x the padded query heads of one KV head, so a K/V tile serves the whole head group.
Two consumer warp groups take rows 0-63 and 64-127 (every MMA is M = 64 a warp group); a loader
warp (warp specialization, 24 registers; the consumers get 240) brings the key tiles. Either the
two warp groups are one 8-warp partition (``warps_per_cta [8, 1]``, in lockstep) or, ``split``,
each its own 4-warp partition, so that they drift apart and one's softmax overlaps the other's
MMAs. Q goes to shared memory once (plain loads), as two 64-column halves. A tile of ``block_n``
keys comes by TMA into one of ``stages`` shared-memory stages: the caches are seen as
``[num_blocks * page, kv_heads * 128]`` rows and a tile is ``block_n / box`` boxes of ``[box,
64]`` (``box = gcd(page, block_n)``) per 64-column half of K and of V, each at its page's row
(from the block table; the null block 0 past the sequence). 64 columns are the 128-byte swizzle
width, so a box is whole swizzle atoms of the stage's ``[block_n, 64]`` buffer and lands at a
plain row offset in it. Each stage has a ready barrier (TMA bytes) and an empty one (one arrival
per consumer partition once its P V of that tile is done); the loader waits for empty, then
issues the next tile into it.

Per tile j: S_j = Q K_j^T (two async wgmma, K = 64 each, N = block_n); then P_{j-1} V_{j-1}
(P a register A operand: the softmax output in the wgmma dot-operand layout, no shared memory;
one async wgmma per 64-column half of O). With ``overlap`` (FA3's intra-warpgroup overlap) the
softmax of S_j runs while P_{j-1} V_{j-1} is still on the tensor cores (wait for the two score
groups only, then for the rest); without it both are waited first. The online softmax is in log2
units (exp2, the scale folded into one FMA). Tiles whose last key precedes every row's position
skip the mask; the 1-2 diagonal tiles mask keys past the row's position or the sequence. The last
tile of a sequence is loaded whole: its scores past the sequence are masked, and before its P V
the value rows past the sequence are zeroed in shared memory (stale slots may hold NaN, and 0 *
NaN = NaN; split: each partition zeroes one half, and both wait on a barrier for the other).
Rows past a request's new tokens (and padded heads) read zero queries and are not stored.

The grid is (q blocks, KV heads), q blocks in reverse (the last, longest blocks of each request
first; ``find_seq`` maps a q block to its request as the Triton kernel does). Not here: decode
steps, windows, alibi, sinks, softcap, fp8 caches, other head sizes (the Triton kernel takes
those; ``check_prefill_inputs`` says which). No interpreter runs Gluon: CPU tests compile it for
sm_90 only; ``benchmarks/gpu_prefill_gluon.py`` checks and times it on a Hopper GPU. The PyTorch
twin is ``attention.reference.paged_attention``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# the helpers both Gluon kernels share (same code): P V over two halves, zeroing stale rows
from attnserve.ops import launch as launch_helpers
from attnserve.ops.hopper import issue_pv, zero_rows_from
from attnserve.ops.tiles import find_seq

__all__ = ["CONFIGS", "DEFAULT_CONFIG", "PrefillConfig", "check_prefill_inputs", "launch_prefill",
           "launch_prefill_attention", "prefill_attention_gluon"]  # fmt: skip

HEAD, HALF, ROWS, MAX_GROUP = 128, 64, 128, 8
LOADER_REGS = gl.constexpr(24)  # registers a thread of the TMA warp keeps (setmaxnreg)
CONSUMER_REGS = gl.constexpr(240)  # a worker warp group's, where each has its partition
LOG2E = 1.4426950408889634
_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """One variant of the kernel: keys a tile, tiles in flight, softmax overlapped with P V."""

    block_n: int
    stages: int
    overlap: bool
    split: bool = False  # each warp group its own partition (4 warps), not one of 8

    def __post_init__(self):
        if self.block_n not in (64, 128) or not 2 <= self.stages <= 6:
            raise ValueError(f"block_n 64 or 128 and 2..6 stages, got {self}")
        if (ROWS + 2 * self.stages * self.block_n) * HEAD * 2 > 224 * 1024:
            raise ValueError(f"{self}: Q and the K/V stages exceed 224 KB of shared memory")


CONFIGS = {
    "n128_s3_overlap": PrefillConfig(128, 3, True),  # Q 32 KB + 3 x 64 KB stages
    "n128_s3_split": PrefillConfig(128, 3, True, True),
    "n64_s6_split": PrefillConfig(64, 6, True, True),  # Q 32 KB + 6 x 32 KB
    "n128_s3_plain": PrefillConfig(128, 3, False),  # the softmax not overlapped
}
# measured on the H200 (benchmarks/gpu_prefill_gluon.py, 2026-12-03, 32/8 heads, one request):
# the split variant was fastest at every length, 519 / 562 / 599 TFLOP/s at 4K / 16K / 32K
# tokens, against 441 / 494 / 503 for n128_s3_overlap and 263 / 345 / 351 for the Triton kernel
DEFAULT_CONFIG = CONFIGS["n128_s3_split"]


# Kernels keep their dense argument lists: one argument per line would triple their length.
# fmt: off
@gluon.jit
def _issue_tile(k_desc, v_desc, bar, k_lo, k_hi, v_lo, v_hi, bt_row, seq_len, col, t,
                PAGE: gl.constexpr):
    """TMA of key tile t into one stage (its four [BLOCK_N, 64] buffers): per box of the tile,
    its K and V rows, both 64-column halves, all on the stage's ready barrier."""
    BOX: gl.constexpr = k_desc.block_type.shape[0]
    H: gl.constexpr = k_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_lo.shape[0]
    mbarrier.expect(bar, 4 * (BLOCK_N // BOX) * k_desc.block_type.nbytes)
    for b in gl.static_range(BLOCK_N // BOX):
        pos = t * BLOCK_N + b * BOX  # the box's first key; past the sequence: the null block
        blk = gl.load(bt_row + pos // PAGE, mask=pos < seq_len, other=0)
        row = blk * PAGE + pos % PAGE
        tma.async_copy_global_to_shared(k_desc, [row, col], bar, k_lo.slice(b * BOX, BOX))
        tma.async_copy_global_to_shared(k_desc, [row, col + H], bar, k_hi.slice(b * BOX, BOX))
        tma.async_copy_global_to_shared(v_desc, [row, col], bar, v_lo.slice(b * BOX, BOX))
        tma.async_copy_global_to_shared(v_desc, [row, col + H], bar, v_hi.slice(b * BOX, BOX))


@gluon.jit
def _loader(k_desc, v_desc, ready, empty, k_lo, k_hi, v_lo, v_hi, bt_row, seq_len, col, n_tiles,
            PAGE: gl.constexpr):
    """Worker partition (one warp): every key tile of the program, each into the stage the
    consumers released last (a stage's first use waits for nothing: parity 1 of a new barrier)."""
    STAGES: gl.constexpr = k_lo.shape[0]
    for t in range(n_tiles):
        stage = t % STAGES
        mbarrier.wait(empty.index(stage), ((t // STAGES) & 1) ^ 1)
        _issue_tile(k_desc, v_desc, ready.index(stage), k_lo.index(stage), k_hi.index(stage),
                    v_lo.index(stage), v_hi.index(stage), bt_row, seq_len, col, t, PAGE)


@gluon.jit
def _issue_scores(q_lo, q_hi, k_lo, k_hi, S_LAYOUT: gl.constexpr):
    """Async S = Q K^T over the two 64-column halves: two wgmma groups, one result."""
    M: gl.constexpr = q_lo.shape[0]
    N: gl.constexpr = k_lo.shape[0]
    s = gl.zeros([M, N], gl.float32, S_LAYOUT)
    s = warpgroup_mma(q_lo, k_lo.permute((1, 0)), s, use_acc=False, is_async=True)
    return warpgroup_mma(q_hi, k_hi.permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax_tile(s, m_i, l_i, t, n_full, q_pos, seq_len, qk_scale, DT: gl.constexpr,
                  P_LAYOUT: gl.constexpr):
    """Online-softmax step (log2 units) with key tile t: P in the A-operand layout of P V, the
    new max and sum, and the rescale of the old accumulator. Tiles from n_full on are masked."""
    BLOCK_N: gl.constexpr = s.shape[1]
    if t >= n_full:  # keys past the row's position or past the sequence (stale: maybe NaN)
        keys = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        visible = (keys[None, :] <= q_pos[:, None]) & (keys < seq_len)[None, :]
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p = gl.convert_layout(p.to(DT), P_LAYOUT)
    return p, m_new, l_i, alpha


@gluon.jit
def _load_q(q_ptr, q_lo, q_hi, q_start, q_len, q_block, kv_head, stride_qt, stride_qh,
            GROUP: gl.constexpr, GROUP_PAD: gl.constexpr, ROW0: gl.constexpr,
            LAYOUT: gl.constexpr):
    """Query rows ROW0.. of the program's 128 (token-major: row = token * GROUP_PAD + head in
    group) into shared memory by plain loads; rows past the new tokens or the group are 0."""
    BLOCK_Q: gl.constexpr = 128 // GROUP_PAD
    H: gl.constexpr = q_lo.shape[1]
    rows = ROW0 + gl.arange(0, q_lo.shape[0], layout=gl.SliceLayout(1, LAYOUT))
    tok = q_block * BLOCK_Q + rows // GROUP_PAD
    ok = (tok < q_len) & (rows % GROUP_PAD < GROUP)
    off = (q_start + tok).to(gl.int64) * stride_qt + (kv_head * GROUP + rows % GROUP_PAD) * stride_qh
    ptrs = q_ptr + off[:, None] + gl.arange(0, H, layout=gl.SliceLayout(0, LAYOUT))[None, :]
    q_lo.store(gl.load(ptrs, mask=ok[:, None], other=0.0))
    q_hi.store(gl.load(ptrs + H, mask=ok[:, None], other=0.0))


@gluon.jit
def _store_out(out_ptr, acc_lo, acc_hi, l_i, q_start, q_len, q_block, kv_head, stride_ot,
               stride_oh, GROUP: gl.constexpr, GROUP_PAD: gl.constexpr, ROW0: gl.constexpr):
    """Normalised live rows ROW0.. to ``out`` (rows past the new tokens or the group untouched)."""
    O_LAYOUT: gl.constexpr = acc_lo.type.layout
    BLOCK_Q: gl.constexpr = 128 // GROUP_PAD
    H: gl.constexpr = acc_lo.shape[1]
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT), assert_trivial=True)
    inv = (1.0 / gl.where(l_o > 0.0, l_o, 1.0))[:, None]
    rows = ROW0 + gl.arange(0, acc_lo.shape[0], layout=gl.SliceLayout(1, O_LAYOUT))
    tok = q_block * BLOCK_Q + rows // GROUP_PAD
    ok = ((tok < q_len) & (rows % GROUP_PAD < GROUP))[:, None]
    off = (q_start + tok).to(gl.int64) * stride_ot + (kv_head * GROUP + rows % GROUP_PAD) * stride_oh
    dst = out_ptr + off[:, None] + gl.arange(0, H, layout=gl.SliceLayout(0, O_LAYOUT))[None, :]
    DT: gl.constexpr = out_ptr.dtype.element_ty
    gl.store(dst, (acc_lo * inv).to(DT), mask=ok)
    gl.store(dst + H, (acc_hi * inv).to(DT), mask=ok)


@gluon.jit
def _consumer(q_ptr, out_ptr, q_lo, q_hi, k_lo, k_hi, v_lo, v_hi, ready, empty, zeroed, q_start,
              q_len, q_block, kv_head, seq_len, n_tiles, n_full, qk_scale, stride_qt, stride_qh,
              stride_ot, stride_oh, GROUP: gl.constexpr, GROUP_PAD: gl.constexpr,
              OVERLAP: gl.constexpr, WG: gl.constexpr, NPART: gl.constexpr):
    """A consumer partition: the 128 rows (8 warps, NPART 1) or warp group WG's 64 of them
    (4 warps, NPART 2): Q, the tiles, the output. Every partition releases each stage."""
    NW: gl.constexpr = gl.num_warps()
    M: gl.constexpr = q_lo.shape[0]
    H: gl.constexpr = q_lo.shape[1]
    STAGES: gl.constexpr = k_lo.shape[0]
    BLOCK_N: gl.constexpr = k_lo.shape[1]
    DT: gl.constexpr = q_lo.dtype
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, H, 16])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    LD_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    _load_q(q_ptr, q_lo, q_hi, q_start, q_len, q_block, kv_head, stride_qt, stride_qh, GROUP,
            GROUP_PAD, WG * M, LD_LAYOUT)
    fence_async_shared()  # generic-proxy stores, then async-proxy (wgmma) reads
    gl.thread_barrier()

    rows = WG * M + gl.arange(0, M, layout=gl.SliceLayout(1, S_LAYOUT))
    q_pos = seq_len - q_len + q_block * (128 // GROUP_PAD) + rows // GROUP_PAD  # past: unstored
    m_i = gl.full([M], -1e30, gl.float32, gl.SliceLayout(1, S_LAYOUT))  # finite: no inf - inf
    l_i = gl.zeros([M], gl.float32, gl.SliceLayout(1, S_LAYOUT))
    acc_lo = gl.zeros([M, H], gl.float32, O_LAYOUT)
    acc_hi = gl.zeros([M, H], gl.float32, O_LAYOUT)

    mbarrier.wait(ready.index(0), 0)
    s = _issue_scores(q_lo, q_hi, k_lo.index(0), k_hi.index(0), S_LAYOUT)
    s = warpgroup_mma_wait(0, deps=(s,))
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, 0, n_full, q_pos, seq_len, qk_scale, DT,
                                       P_LAYOUT)
    for t in range(1, n_tiles):
        cur = t % STAGES
        prev = (t - 1) % STAGES
        mbarrier.wait(ready.index(cur), (t // STAGES) & 1)
        # issue order = completion order: the scores of t, then P V of t - 1
        s = _issue_scores(q_lo, q_hi, k_lo.index(cur), k_hi.index(cur), S_LAYOUT)
        acc_lo, acc_hi = issue_pv(p, v_lo.index(prev), v_hi.index(prev), acc_lo, acc_hi)
        if OVERLAP:  # the softmax of t runs while P V of t - 1 is on the tensor cores
            s = warpgroup_mma_wait(2, deps=(s,))
            p_new, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, t, n_full, q_pos, seq_len,
                                                   qk_scale, DT, P_LAYOUT)
            acc_lo, acc_hi, p = warpgroup_mma_wait(0, deps=(acc_lo, acc_hi, p))
            gl.thread_barrier()  # this partition's warps are done with stage prev: release it
            mbarrier.arrive(empty.index(prev), count=1)
        else:
            s, acc_lo, acc_hi, p = warpgroup_mma_wait(0, deps=(s, acc_lo, acc_hi, p))
            gl.thread_barrier()
            mbarrier.arrive(empty.index(prev), count=1)
            p_new, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, t, n_full, q_pos, seq_len,
                                                   qk_scale, DT, P_LAYOUT)
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT), assert_trivial=True)
        acc_lo = acc_lo * alpha_o[:, None]
        acc_hi = acc_hi * alpha_o[:, None]
        p = p_new
    last = (n_tiles - 1) % STAGES
    if n_tiles * BLOCK_N > seq_len:  # the sequence ends inside the last tile: zero its value
        # rows past the sequence (WG 0 the low half, WG 1 the high one; one partition: both),
        # then every partition waits for all of them
        if NPART == 1 or WG == 0:
            zero_rows_from(v_lo.index(last), seq_len - (n_tiles - 1) * BLOCK_N, LD_LAYOUT)
        if NPART == 1 or WG == 1:
            zero_rows_from(v_hi.index(last), seq_len - (n_tiles - 1) * BLOCK_N, LD_LAYOUT)
        fence_async_shared()  # generic-proxy stores, then async-proxy (wgmma) reads
        gl.thread_barrier()
        mbarrier.arrive(zeroed, count=1)
        mbarrier.wait(zeroed, 0)
    acc_lo, acc_hi = issue_pv(p, v_lo.index(last), v_hi.index(last), acc_lo, acc_hi)
    acc_lo, acc_hi, p = warpgroup_mma_wait(0, deps=(acc_lo, acc_hi, p))
    _store_out(out_ptr, acc_lo, acc_hi, l_i, q_start, q_len, q_block, kv_head, stride_ot,
               stride_oh, GROUP, GROUP_PAD, WG * M)


@gluon.jit(do_not_specialize=("num_seqs", "stride_bt"),  # per step: no variant per class
           do_not_specialize_on_alignment=("bt_ptr", "qsl_ptr", "seq_lens_ptr"))
def _prefill_kernel(q_ptr, k_desc, v_desc, out_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, qk_scale,
                    num_seqs, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    GROUP: gl.constexpr, GROUP_PAD: gl.constexpr, PAGE: gl.constexpr,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr,
                    SPLIT: gl.constexpr):
    M: gl.constexpr = 128  # query rows a program: two warp groups of 64
    H: gl.constexpr = k_desc.block_type.shape[1]  # 64: half a head, the swizzle width
    BLOCK_Q: gl.constexpr = M // GROUP_PAD
    DT: gl.constexpr = k_desc.dtype
    kv_head = gl.program_id(1)
    q_block_id = gl.num_programs(0) - 1 - gl.program_id(0)  # last (longest) blocks first
    seq = find_seq(qsl_ptr, num_seqs, q_block_id, BLOCK_Q)
    q_start = gl.load(qsl_ptr + seq)
    q_len = gl.load(qsl_ptr + seq + 1) - q_start
    q_block = q_block_id - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:  # spare program, or a request without new tokens
        return
    seq_len = gl.load(seq_lens_ptr + seq)
    q_pos_lo = seq_len - q_len + q_block * BLOCK_Q
    q_pos_hi = seq_len - q_len + gl.minimum(q_len, (q_block + 1) * BLOCK_Q) - 1
    n_tiles = gl.cdiv(q_pos_hi + 1, BLOCK_N)
    n_full = (q_pos_lo + 1) // BLOCK_N  # tiles whose last key is <= every row's position
    bt_row = bt_ptr + seq.to(gl.int64) * stride_bt
    col = kv_head * (2 * H)

    # shared memory: Q 32 KB, STAGES x (K, V) x 2 halves x BLOCK_N x 128 B
    q_lo = gl.allocate_shared_memory(DT, [M, H], k_desc.layout)
    q_hi = gl.allocate_shared_memory(DT, [M, H], k_desc.layout)
    k_lo = gl.allocate_shared_memory(DT, [STAGES, BLOCK_N, H], k_desc.layout)
    k_hi = gl.allocate_shared_memory(DT, [STAGES, BLOCK_N, H], k_desc.layout)
    v_lo = gl.allocate_shared_memory(DT, [STAGES, BLOCK_N, H], k_desc.layout)
    v_hi = gl.allocate_shared_memory(DT, [STAGES, BLOCK_N, H], k_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    zeroed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    NPART: gl.constexpr = 2 if SPLIT else 1  # consumer partitions: each releases every stage
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NPART)
    mbarrier.init(zeroed, count=NPART)
    fence_async_shared()  # the barriers' init before their use by TMA
    if SPLIT:  # a partition per warp group (4 warps each), so that they drift apart: one's
        # softmax runs while the other's MMAs do; WG 1 is the first worker (warps 4-7)
        gl.warp_specialize([
            (_consumer, (q_ptr, out_ptr, q_lo.slice(0, 64), q_hi.slice(0, 64), k_lo, k_hi, v_lo,
                         v_hi, ready, empty, zeroed, q_start, q_len, q_block, kv_head, seq_len,
                         n_tiles, n_full, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
                         GROUP, GROUP_PAD, OVERLAP, 0, 2)),
            (_consumer, (q_ptr, out_ptr, q_lo.slice(64, 64), q_hi.slice(64, 64), k_lo, k_hi,
                         v_lo, v_hi, ready, empty, zeroed, q_start, q_len, q_block, kv_head,
                         seq_len, n_tiles, n_full, qk_scale, stride_qt, stride_qh, stride_ot,
                         stride_oh, GROUP, GROUP_PAD, OVERLAP, 1, 2)),
            (_loader, (k_desc, v_desc, ready, empty, k_lo, k_hi, v_lo, v_hi, bt_row, seq_len,
                       col, n_tiles, PAGE)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (q_ptr, out_ptr, q_lo, q_hi, k_lo, k_hi, v_lo, v_hi, ready, empty,
                         zeroed, q_start, q_len, q_block, kv_head, seq_len, n_tiles, n_full,
                         qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, GROUP, GROUP_PAD,
                         OVERLAP, 0, 1)),
            (_loader, (k_desc, v_desc, ready, empty, k_lo, k_hi, v_lo, v_hi, bt_row, seq_len,
                       col, n_tiles, PAGE)),
        ], [1], [LOADER_REGS])
    mbarrier.invalidate(zeroed)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
# fmt: on


def check_prefill_inputs(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         out: torch.Tensor, block_table: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                         max_query_len: int, num_splits: int | None = None, **features) -> None:
    """ValueError naming the first input outside the class the kernel takes (module doc).

    ``features``: ``unified_attention``'s window, alibi, sinks, softcap (must be None) and
    k_scale, v_scale (must be 1.0).
    """
    scales = {k: features.pop(k) for k in ("k_scale", "v_scale") if k in features}
    used = [name for name, value in features.items() if value is not None]
    if used or any(v != 1.0 for v in scales.values()):
        raise ValueError(f"plain causal attention only, got {used or list(scales)}")
    if num_splits not in (None, 1):
        raise ValueError(f"prefill is not split over keys, got num_splits={num_splits}")
    if max_query_len <= 1:
        raise ValueError(f"prefill steps only (max_query_len > 1), got {max_query_len}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be positive and finite, got {scale}")
    if q.dim() != 3 or q.shape[2] != HEAD:
        raise ValueError(f"q must be [tokens, heads, {HEAD}], got {tuple(q.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q must be bf16 or fp16, got {q.dtype}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4 or cache.shape[3] != HEAD or cache.shape != key_cache.shape:
            raise ValueError(f"{name} must be [blocks, page, kv_heads, {HEAD}] like key_cache, "
                             f"got {tuple(cache.shape)}")  # fmt: skip
        if cache.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {cache.dtype}")
        if not cache.is_contiguous() or cache.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous and 16-byte aligned (TMA)")
    num_blocks, page, num_kv_heads = key_cache.shape[:3]
    if page % 8:
        raise ValueError(f"page size must be a multiple of 8, got {page}")
    if num_blocks * page >= 2**31:
        raise ValueError(f"{num_blocks} blocks of {page} rows exceed int32 TMA coordinates")
    if q.shape[1] % num_kv_heads or not 1 <= q.shape[1] // num_kv_heads <= MAX_GROUP:
        raise ValueError(f"{q.shape[1]} query heads for {num_kv_heads} KV heads: need 1 to "
                         f"{MAX_GROUP} query heads per KV head")  # fmt: skip
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    if q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("q and out must be contiguous in their last dimension")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    metadata = (("seq_lens", seq_lens, 1, (num_seqs,)),
                ("block_table", block_table, 2, (num_seqs,)),
                ("query_start_loc", query_start_loc, 1, (num_seqs + 1,)))  # fmt: skip
    for name, t, dims, lead in metadata:
        if t.dtype != torch.int32 or t.dim() != dims or tuple(t.shape[:1]) != lead:
            raise ValueError(f"{name} must be int32 with {dims} dims and {lead[0]} rows, got "
                             f"{t.dtype} {tuple(t.shape)}")  # fmt: skip
    if block_table.stride(-1) != 1:
        raise ValueError("block_table must be contiguous in its last dimension")
    named = dict(q=q, key_cache=key_cache, value_cache=value_cache, out=out,
                 block_table=block_table, query_start_loc=query_start_loc, seq_lens=seq_lens)
    devices = {t.device for t in named.values()}
    if len(devices) != 1:
        raise ValueError(f"inputs on several devices: {sorted(map(str, devices))}")
    launch_helpers.require_hopper(q.device, "the Gluon prefill kernel")


def _descriptors(key_cache, value_cache, block_n):
    """TMA descriptors over the caches seen as [blocks * page, kv_heads * 128] rows: boxes of
    [gcd(page, block_n), 64], 128-byte swizzled as the wgmma operands want them."""
    num_blocks, page, num_kv_heads, head = key_cache.shape
    box = [math.gcd(page, block_n), HALF]
    layout = gl.NVMMASharedLayout.get_default_for(box, _DTYPES[key_cache.dtype])
    return [TensorDescriptor.from_tensor(c.view(num_blocks * page, num_kv_heads * head), box, layout)
            for c in (key_cache, value_cache)]  # fmt: skip


def launch_prefill(q, key_cache, value_cache, out, block_table, query_start_loc, seq_lens, scale,
                   config: PrefillConfig = DEFAULT_CONFIG):
    """The launch itself, without input checks: for inputs ``check_prefill_inputs`` passed, or
    a backend's, whose layer and cache the kernel table's ``takes`` passed and whose metadata
    the engine builds (int32, one row per request). The sm_90 compile test records it on CPU tensors."""
    num_tokens, num_heads = q.shape[:2]
    num_kv_heads = key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    num_q_blocks = num_tokens // (ROWS // group_pad) + num_seqs  # spare programs return at once
    # fmt: off
    _prefill_kernel[(num_q_blocks, num_kv_heads)](
        q, *_descriptors(key_cache, value_cache, config.block_n), out, block_table,
        query_start_loc, seq_lens, scale * LOG2E, num_seqs, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), block_table.stride(0), GROUP=group, GROUP_PAD=group_pad,
        PAGE=key_cache.shape[1], BLOCK_N=config.block_n, STAGES=config.stages,
        OVERLAP=config.overlap, SPLIT=config.split, num_warps=4 if config.split else 8,
    )
    # fmt: on
    return out


def launch_prefill_attention(q, key_cache, value_cache, out, block_table, query_start_loc, seq_lens, *,
                             scale: float, max_query_len: int, max_seq_len: int, num_splits=None,
                             merge: str = "kernel", window=None, alibi=None, sinks=None, softcap=None,
                             k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """``unified_attention``'s call as TRITON_ATTN makes it, to ``launch_prefill``: the
    ``attention.prefill/gluon`` variant's launch. No per-call checks: the kernel table's
    ``takes`` admitted the layer and cache when the variant was chosen (plain causal attention,
    so the feature arguments are None and the scales 1), and the engine builds the metadata."""
    del max_query_len, max_seq_len, num_splits, merge, window, alibi, sinks, softcap, k_scale, v_scale
    return launch_prefill(q, key_cache, value_cache, out, block_table, query_start_loc, seq_lens, scale)


def prefill_attention_gluon(
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
    config: PrefillConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Causal paged prefill (``unified_attention``'s contract and arguments) by the Gluon kernel.

    Args:
        q, key_cache, value_cache, out, block_table, query_start_loc, seq_lens, scale,
            max_query_len: as ``unified_attention``, within the class of the module doc.
        window, alibi, sinks, softcap, k_scale, v_scale, num_splits: must be their defaults.
        max_seq_len, merge: accepted for the same call, unused (no split over keys).
        config: the kernel variant (``CONFIGS``).
    Returns:
        ``out``, rows of the batch's new tokens written; rows past ``query_start_loc[-1]``
        untouched.
    Raises:
        ValueError: inputs outside that class, or not on a Hopper GPU.
    """
    check_prefill_inputs(q, key_cache, value_cache, out, block_table, query_start_loc, seq_lens,
                         scale=scale, window=window, alibi=alibi, sinks=sinks, softcap=softcap,
                         k_scale=k_scale, v_scale=v_scale, max_query_len=max_query_len,
                         num_splits=num_splits)  # fmt: skip
    del max_seq_len, merge
    return launch_prefill(q, key_cache, value_cache, out, block_table, query_start_loc, seq_lens,
                          scale, config)  # fmt: skip
