"""Absorbed MLA decode at 64+ heads as a Gluon (``triton.experimental.gluon``) Hopper kernel.

The contract of ``ops/mla/decode_triton.mla_decode`` restricted to the DeepSeek shape: bf16 queries and
latent rows (``kv_lora_rank`` 512 + rope 64), 64-row pages, heads a multiple of 64 or fewer
than 64 (16 or 32: DeepSeek-V2-Lite, V3 split over GPUs; the program's other rows are padding,
zero queries whose outputs are never stored), one query row per request. A program (8 warps: two warp groups) owns 64 heads of one request and walks its
pages, one page a key tile; long contexts are split over programs (split-KV) whose partials
``triton_mla.merge_splits`` combines, in the same [rows, heads, splits, L] fp32 + lse (log2)
layout as ``prepare_latent_launch``.

What the layouts say, against the Triton kernel (``ops/mla/decode_triton_tma``): every MMA uses
``warps_per_cta [4, 2]``, so the two warp groups split the N dimension instead of both doing
all of M = 64. The scores [64 heads, 64 keys] are computed once: each warp group takes 32 keys
(the row max is one cross-warp reduction per tile; the row sum is kept per column and reduced
once at the end). P goes to shared memory as the A operand of P @ V, where each warp group
accumulates its own half of the 512 output columns (two [64, 256] fp32 accumulators, 128
registers a thread). Q (64 x 576) stays in shared memory; a page comes by TMA as three boxes
(two 256-column value halves, the rope part) into one of two stages, each with its mbarrier.
The three score MMAs of a page are issued async and waited once. Each step issues P @ V of page
t and the scores of page t + 1 back to back (no tensor-core bubble between them); once P @ V of
t is done, while the scores still run, the TMA of page t + 2 goes into the stage t used, so a
page is in flight for about one page of compute. The softmax is not overlapped with MMAs
(FlashMLA's ping-pong of the two warp groups needs warp specialization; not attempted here).

A page the sequence ends inside (always a split's last) is loaded whole; its scores past the
sequence are masked to -inf, and before its P @ V the value rows past the sequence are zeroed in
shared memory (they may hold stale data or NaN; 0 * NaN must not reach the accumulator). The
grid is (head blocks, rows, splits): the programs of one request's head blocks are adjacent, so
its pages should come from HBM about once and from L2 for the other head block (unmeasured).

Not here: fp8 rows, pages other than 64, other ranks, several query rows per request (the
Triton kernels take those). No interpreter runs Gluon: CPU tests compile it for sm_90 only; the
numbers come from ``benchmarks/gpu_mla_gluon.py`` on a Hopper GPU. The PyTorch twin is
``attention.reference_mla.mla_decode_absorbed``.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from attnserve.ops import launch as launch_helpers
from attnserve.ops.hopper import issue_pv, store_p, zero_rows_from
from attnserve.ops.mla.gluon_tiles import (
    HEADS_PER_PROGRAM,
    KV_LORA_RANK,
    MAX_GRID_Y,
    PAGE,
    ROPE,
    SHAPE,
    issue_scores,
    load_q_heads,
    softmax_page,
    store_out,
)
from attnserve.ops.mla.latent import LOG2E, pick_mla_splits, prepare_latent_launch

__all__ = ["check_gluon_inputs", "mla_decode_gluon"]


# Kernels keep their dense argument lists: one argument per line would triple their length.
# fmt: off
@gluon.jit
def _issue_page_load(kv_desc, pe_desc, bars, kv0_bufs, kv1_bufs, pe_bufs, bt_row, lo, j, n):
    """TMA of the split's page j (of n; none past n) into stage j % 2, on that stage's barrier."""
    PAGE_: gl.constexpr = kv_desc.block_type.shape[0]
    HALF: gl.constexpr = kv_desc.block_type.shape[1]
    ok = j < n
    stage = j % 2
    blk = gl.load(bt_row + lo + gl.minimum(j, n - 1))  # a page of this split, even when not ok
    row = blk * PAGE_
    bar = bars.index(stage)
    mbarrier.expect(bar, 2 * kv_desc.block_type.nbytes + pe_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(kv_desc, [row, 0], bar, kv0_bufs.index(stage), pred=ok)
    tma.async_copy_global_to_shared(kv_desc, [row, HALF], bar, kv1_bufs.index(stage), pred=ok)
    tma.async_copy_global_to_shared(pe_desc, [row, 2 * HALF], bar, pe_bufs.index(stage), pred=ok)


@gluon.jit
def _zero_stale_rows(kv0, kv1, seq_len, tile, LAYOUT: gl.constexpr):
    """If key tile ``tile`` (in shared memory as kv0, kv1) is the page the sequence ends inside,
    zero its value rows past the sequence, so P @ V meets 0 there, never stale data or NaN."""
    PAGE_: gl.constexpr = kv0.shape[0]
    num_full = seq_len // PAGE_
    if tile == num_full:  # only when seq_len % PAGE: tiles stop before num_full otherwise
        zero_rows_from(kv0, seq_len - num_full * PAGE_, LAYOUT)
        zero_rows_from(kv1, seq_len - num_full * PAGE_, LAYOUT)
        fence_async_shared()  # generic-proxy stores, then async-proxy (wgmma) reads
        gl.thread_barrier()


@gluon.jit(do_not_specialize=("num_splits", "stride_bt"),  # per step: no variant per class
           do_not_specialize_on_alignment=("bt_ptr", "seq_lens_ptr"))
def _mla_decode_gluon_kernel(q_ptr, kv_desc, pe_desc, out_ptr, part_out_ptr, part_lse_ptr, bt_ptr,
                             seq_lens_ptr, qk_scale, num_heads, num_splits, stride_qt, stride_qh,
                             stride_ot, stride_oh, stride_bt, SPLIT: gl.constexpr):
    ROWS: gl.constexpr = 64  # heads a program, the M of every MMA
    PAGE_: gl.constexpr = kv_desc.block_type.shape[0]
    HALF: gl.constexpr = kv_desc.block_type.shape[1]
    R: gl.constexpr = pe_desc.block_type.shape[1]
    DT: gl.constexpr = kv_desc.dtype
    # 8 warps as [4, 2]: the two warp groups split N (keys of S, columns of O), never M
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 32, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 128, 16])
    LD_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])

    head0 = gl.program_id(0) * ROWS
    seq = gl.program_id(1)
    split = gl.program_id(2)
    seq_len = gl.load(seq_lens_ptr + seq)
    num_tiles = gl.cdiv(seq_len, PAGE_)
    per_split = gl.cdiv(num_tiles, num_splits)
    lo = split * per_split
    n = gl.minimum(lo + per_split, num_tiles) - lo  # this split's pages (none: n <= 0)
    bt_row = bt_ptr + seq.to(gl.int64) * stride_bt

    # shared memory: Q 72 KB, two page stages 144 KB, P 8 KB (227 KB is the limit)
    q0_smem = gl.allocate_shared_memory(DT, [ROWS, HALF], kv_desc.layout)
    q1_smem = gl.allocate_shared_memory(DT, [ROWS, HALF], kv_desc.layout)
    qpe_smem = gl.allocate_shared_memory(DT, [ROWS, R], pe_desc.layout)
    kv0_bufs = gl.allocate_shared_memory(DT, [2, PAGE_, HALF], kv_desc.layout)
    kv1_bufs = gl.allocate_shared_memory(DT, [2, PAGE_, HALF], kv_desc.layout)
    pe_bufs = gl.allocate_shared_memory(DT, [2, PAGE_, R], pe_desc.layout)
    p_smem = gl.allocate_shared_memory(DT, [ROWS, PAGE_], pe_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(bars.index(i), count=1)
    load_q_heads(q_ptr, q0_smem, q1_smem, qpe_smem, seq, head0, num_heads, stride_qt, stride_qh,
                  LD_LAYOUT)
    fence_async_shared()
    gl.thread_barrier()

    acc0 = gl.zeros([ROWS, HALF], gl.float32, O_LAYOUT)
    acc1 = gl.zeros([ROWS, HALF], gl.float32, O_LAYOUT)
    m_i = gl.full([ROWS], -1e30, gl.float32, gl.SliceLayout(1, S_LAYOUT))  # finite: no inf - inf
    l_part = gl.zeros([ROWS, PAGE_], gl.float32, S_LAYOUT)
    if n > 0:
        _issue_page_load(kv_desc, pe_desc, bars, kv0_bufs, kv1_bufs, pe_bufs, bt_row, lo, 0, n)
        _issue_page_load(kv_desc, pe_desc, bars, kv0_bufs, kv1_bufs, pe_bufs, bt_row, lo, 1, n)
        mbarrier.wait(bars.index(0), 0)
        s = issue_scores(q0_smem, q1_smem, qpe_smem, kv0_bufs.index(0), kv1_bufs.index(0),
                          pe_bufs.index(0), S_LAYOUT)
        s = warpgroup_mma_wait(0, deps=(s,))
        p, m_i, l_part, alpha = softmax_page(s, m_i, l_part, lo * PAGE_, seq_len, qk_scale,
                                              S_LAYOUT)
        store_p(p_smem, p)
        for j in range(1, n):
            cur = (j - 1) % 2
            nxt = j % 2
            # issue order = completion order: P @ V of page j - 1, then the scores of page j,
            # back to back on the tensor cores
            acc0, acc1 = issue_pv(p_smem, kv0_bufs.index(cur), kv1_bufs.index(cur), acc0, acc1)
            mbarrier.wait(bars.index(nxt), (j // 2) & 1)
            s = issue_scores(q0_smem, q1_smem, qpe_smem, kv0_bufs.index(nxt),
                              kv1_bufs.index(nxt), pe_bufs.index(nxt), S_LAYOUT)
            acc0, acc1 = warpgroup_mma_wait(3, deps=(acc0, acc1))  # P @ V done, scores running
            gl.thread_barrier()  # both warp groups are done with stage cur and with P
            # page j + 1 into stage cur: in flight through the scores of j, its softmax and
            # P @ V of j
            _issue_page_load(kv_desc, pe_desc, bars, kv0_bufs, kv1_bufs, pe_bufs, bt_row, lo,
                             j + 1, n)
            s = warpgroup_mma_wait(0, deps=(s,))
            p, m_i, l_part, alpha = softmax_page(s, m_i, l_part, (lo + j) * PAGE_, seq_len,
                                                  qk_scale, S_LAYOUT)
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT), assert_trivial=True)
            acc0 = acc0 * alpha_o[:, None]
            acc1 = acc1 * alpha_o[:, None]
            store_p(p_smem, p)
        last = (n - 1) % 2
        # the scores of the last page are done; if the sequence ends inside it, its stale
        # value rows are zeroed now, with no MMA in flight
        _zero_stale_rows(kv0_bufs.index(last), kv1_bufs.index(last), seq_len, lo + n - 1,
                         LD_LAYOUT)
        acc0, acc1 = issue_pv(p_smem, kv0_bufs.index(last), kv1_bufs.index(last), acc0, acc1)
        acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
    for i in gl.static_range(2):
        mbarrier.invalidate(bars.index(i))
    store_out(out_ptr, part_out_ptr, part_lse_ptr, acc0, acc1, m_i, l_part, seq, head0, split,
               num_heads, num_splits, stride_ot, stride_oh, SPLIT, S_LAYOUT, O_LAYOUT)
# fmt: on


def check_gluon_inputs(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    out: torch.Tensor | None,
) -> None:
    """ValueError unless the inputs are in the class the kernel takes (see the module doc)."""
    if kv_lora_rank != KV_LORA_RANK:
        raise ValueError(f"mla_decode_gluon takes kv_lora_rank {KV_LORA_RANK}, got {kv_lora_rank}")
    if q.dim() != 3 or q.shape[2] != KV_LORA_RANK + ROPE:
        raise ValueError(f"q must be [rows, heads, {KV_LORA_RANK + ROPE}], got {tuple(q.shape)}")
    if not _heads_fit(q.shape[1]):
        raise ValueError(f"heads must be a multiple of {HEADS_PER_PROGRAM} or fewer, got "
                         f"{q.shape[1]}")  # fmt: skip
    if q.shape[0] > MAX_GRID_Y:
        raise ValueError(f"at most {MAX_GRID_Y} query rows a launch, got {q.shape[0]}")
    want = (PAGE, KV_LORA_RANK + ROPE)
    if latent_cache.dim() != 3 or tuple(latent_cache.shape[1:]) != want:
        raise ValueError(f"latent cache must be [blocks, {want[0]}, {want[1]}], got "
                         f"{tuple(latent_cache.shape)}")  # fmt: skip
    if q.dtype != torch.bfloat16 or latent_cache.dtype != torch.bfloat16:
        raise ValueError(f"bf16 q and cache only, got {q.dtype} and {latent_cache.dtype}")
    if q.stride(-1) != 1 or not latent_cache.is_contiguous():
        raise ValueError("q must be contiguous in its last dimension and the cache contiguous")
    if latent_cache.data_ptr() % 16:
        raise ValueError("the latent cache must be 16-byte aligned (TMA)")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"block_table must be 2-D int32, got {block_table.dtype}")
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (q.shape[0],):
        raise ValueError(f"seq_lens must be int32 [{q.shape[0]}], got {tuple(seq_lens.shape)}")
    if block_table.shape[0] != q.shape[0]:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {q.shape[0]} queries")
    if out is not None and (out.shape != q.shape[:2] + (KV_LORA_RANK,) or out.stride(-1) != 1):
        raise ValueError(f"out must be [rows, heads, {KV_LORA_RANK}] with unit last stride")
    devices = {t.device for t in (q, latent_cache, block_table, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"inputs on several devices: {sorted(map(str, devices))}")
    launch_helpers.require_hopper(q.device, "mla_decode_gluon")


def _heads_fit(heads: int) -> bool:
    """64 heads a program: a multiple of 64, or fewer heads in one program whose other rows
    are padding (zero queries, never stored)."""
    return 0 < heads < HEADS_PER_PROGRAM or (heads > 0 and heads % HEADS_PER_PROGRAM == 0)


def _descriptors(latent_cache: torch.Tensor) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors over the cache seen as [blocks * 64, 576] rows: [64, 256] value boxes
    and [64, 64] rope boxes, 128-byte swizzled as the wgmma operands want them."""
    rows = latent_cache.view(-1, latent_cache.shape[-1])
    half = KV_LORA_RANK // 2
    kv_layout = gl.NVMMASharedLayout.get_default_for([PAGE, half], gl.bfloat16)
    pe_layout = gl.NVMMASharedLayout.get_default_for([PAGE, ROPE], gl.bfloat16)
    return (TensorDescriptor.from_tensor(rows, [PAGE, half], kv_layout),
            TensorDescriptor.from_tensor(rows, [PAGE, ROPE], pe_layout))  # fmt: skip


def _launch(q, latent_cache, block_table, seq_lens, scale, max_seq_len, out, num_splits):
    """The launch itself, for inputs ``check_gluon_inputs`` passed (the sm_90 compile test
    records it on CPU tensors)."""
    if num_splits is None and q.shape[1] < HEADS_PER_PROGRAM:
        # padded rows: memory-bound, so one wave of programs (one a SM: ~225 KB of shared
        # memory each) with up to 256 splits of at least 256 keys (a split's [heads, 512] fp32
        # partial is then under 1/9 of its keys' bytes at 16 heads)
        num_splits = pick_mla_splits(q.shape[0], max_seq_len, q.device, min_keys=256,
                                     one_wave=True)  # fmt: skip
    launch = prepare_latent_launch(
        q, latent_cache, KV_LORA_RANK, max_seq_len, out, num_splits, SHAPE
    )
    if q.shape[0] == 0:
        return launch.out
    rows, head_blocks, splits = launch.grid
    o = launch.out
    # fmt: off
    _mla_decode_gluon_kernel[(head_blocks, rows, splits)](
        q, *_descriptors(latent_cache), o, launch.part_out, launch.part_lse, block_table,
        seq_lens, scale * LOG2E, q.shape[1], launch.num_splits, q.stride(0), q.stride(1),
        o.stride(0), o.stride(1), block_table.stride(0), SPLIT=launch.num_splits > 1,
        num_warps=8,
    )
    # fmt: on
    return launch.finish()


def mla_decode_gluon(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode (``triton_mla.mla_decode``'s contract) by the Gluon kernel.

    Args:
        q: [B, H, 576] bf16 absorbed queries ``[W_UK^T q_nope ; q_pe]``, H a multiple of 64
            or fewer than 64 (padded).
        latent_cache: [num_blocks, 64, 576] bf16, contiguous; block 0 is the null block.
        block_table: [B, max_blocks] int32; seq_lens: [B] int32 (0: the row's output is 0).
        kv_lora_rank: must be 512; scale: softmax scale.
        max_seq_len: host-side bound of ``seq_lens`` (sizes the default splits; no sync).
        out: [B, H, 512] written in place; default a new bf16 tensor.
        num_splits: key splits per (request, head block); default ``pick_mla_splits`` (one
            wave of programs: as ``mla_decode`` at 64+ heads, up to 256 splits of 256+ keys
            below 64 heads).
    Returns:
        ``out``: u = softmax(scale * q . rows) @ c_kv per head.
    Raises:
        ValueError: inputs outside that class, or not on a Hopper GPU.
    """
    check_gluon_inputs(q, latent_cache, block_table, seq_lens, kv_lora_rank, out)
    return _launch(q, latent_cache, block_table, seq_lens, scale, max_seq_len, out, num_splits)
