"""Sparse absorbed MLA (DSA: DeepSeek-V3.2, GLM-5) at 64+ heads as a Gluon Hopper kernel.

``ops/mla/sparse_triton.sparse_mla``'s contract restricted to bf16 latent rows (rank 512 +
rope 64, any page size), heads a multiple of 64: each query row (a decode or a prefill token)
attends only its top-k selected rows, ``topk_indices`` [T, K] absolute positions of its
request (``token_req``), -1 unused, positions at or past the request's length skipped; a row
with none gets 0. The design is ``ops/mla/decode_gluon``'s (whose jit helpers it imports): a program
of 8 warps owns 64 heads of one query row, every MMA uses ``warps_per_cta [4, 2]`` (the two warp
groups split N), Q stays in shared memory, P goes through shared memory, and P @ V of tile t is
issued back to back with the scores of tile t + 1. Split-KV runs over the K indices, with
``prepare_latent_launch``'s partials and ``launch.finish()``'s merge.

A key tile is 64 selected rows, gathered: Hopper's TMA cannot gather rows, so each thread
copies 16-byte pieces with ``cp.async`` (``async_copy_global_to_shared``) from a pointer tensor
whose warp covers four rows x 128 bytes (whole lines; 18 copies a thread a tile) into the
128-byte-swizzled stage the wgmma reads. Unused rows are masked: the copy zero-fills them (no
stale data or NaN reaches P @ V) and their scores are -inf. Per tile t a program:

1. issues P @ V of tile t - 1 (its stage, P of t - 1), async;
2. waits for its own copies of tile t (``wait_group(0)``), fences them for the async proxy and
   meets the other warps at a barrier: the whole tile is in its stage;
3. issues the scores of tile t (three wgmma groups: two value halves and the rope part);
4. waits for P @ V of t - 1 (the scores stay in flight), so stage t - 1 and P are free;
5. gathers tile t + 1 into that stage (addresses from cache slots looked up one step before)
   and loads the indices of tile t + 2;
6. waits for the scores, masks unused keys, runs the online softmax, rescales the
   accumulators, stores P; then looks up the block table for the indices of tile t + 2.

So the gather of a tile is in flight for about one tile of compute, and neither the index load
nor the block-table load it depends on stalls a copy's issue. Before tile 0, the gathers of
tiles 0 and 1 are issued first and Q (72 KB, plain loads) is read while they are in flight; a
split with no tile reads nothing. Shared memory: Q 72 KB, two stages of 72 KB, P 8 KB (a
third stage would need 296 KB; 227 KB is the limit).

Not here: fp8 rows (656 bytes, on Triton), other ranks, fewer than 64 heads. No interpreter
runs Gluon: CPU tests compile it for sm_90; ``benchmarks/gpu_mla_sparse_gluon.py`` checks and
times it on a Hopper GPU. The PyTorch twin is ``attention.reference_mla.sparse_mla_attention``.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma_wait

from attnserve.ops import launch as launch_helpers
from attnserve.ops.hopper import issue_pv, store_p
from attnserve.ops.mla.gluon_tiles import (
    KV_LORA_RANK,
    KV_SMEM,
    PE_SMEM,
    SHAPE,
    TILE,
    issue_scores,
    load_q,
    softmax_tile,
    sparse_class_problem,
    store_out,
    tile_positions,
    tile_slots,
)
from attnserve.ops.mla.latent import LOG2E, prepare_latent_launch

__all__ = ["check_sparse_gluon_inputs", "sparse_mla_gluon"]


# Kernels keep their dense argument lists: one argument per line would triple their length.
# fmt: off
@gluon.jit
def _gather_tile(cache_ptr, slots, kv0, kv1, pe, LAYOUT: gl.constexpr):
    """cp.async of the 64 rows at ``slots`` [TILE] (SliceLayout(1, LAYOUT)) into one stage:
    value halves kv0, kv1 [TILE, 256], rope pe [TILE, 64]; rows with slot -1 are zero-filled.
    LAYOUT gives each thread 8 contiguous bf16 (16 bytes), a warp 4 rows x 128 bytes."""
    HALF: gl.constexpr = kv0.shape[1]
    ROW: gl.constexpr = 2 * HALF + pe.shape[1]  # 576 elements a cache row
    ok = (slots >= 0)[:, None]
    rows = cache_ptr + gl.where(slots >= 0, slots, 0).to(gl.int64) * ROW
    dh = gl.arange(0, HALF, layout=gl.SliceLayout(0, LAYOUT))
    dr = gl.arange(0, pe.shape[1], layout=gl.SliceLayout(0, LAYOUT))
    async_copy.async_copy_global_to_shared(kv0, rows[:, None] + dh[None, :], mask=ok)
    async_copy.async_copy_global_to_shared(kv1, rows[:, None] + HALF + dh[None, :], mask=ok)
    async_copy.async_copy_global_to_shared(pe, rows[:, None] + 2 * HALF + dr[None, :], mask=ok)


@gluon.jit
def _tile_landed():
    """This thread's copies done (one group in flight at most), fenced for the wgmma (async
    proxy), and every other thread's too (the barrier)."""
    async_copy.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit(do_not_specialize=("num_splits", "num_idx", "stride_bt"),  # per step
           do_not_specialize_on_alignment=("bt_ptr", "seq_lens_ptr", "req_ptr"))
def _sparse_mla_gluon_kernel(q_ptr, cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, bt_ptr,
                             seq_lens_ptr, idx_ptr, req_ptr, qk_scale, num_heads, num_splits,
                             num_idx, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                             stride_it, PAGE_SIZE: gl.constexpr, KV_SMEM: gl.constexpr,
                             PE_SMEM: gl.constexpr, SPLIT: gl.constexpr):
    ROWS: gl.constexpr = 64  # heads a program, the M of every MMA
    HALF: gl.constexpr = 256  # value columns a half (kv_lora_rank 512)
    R: gl.constexpr = 64  # rope columns
    DT: gl.constexpr = gl.bfloat16
    # 8 warps as [4, 2]: the two warp groups split N (keys of S, columns of O), never M
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 32, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 128, 16])
    LD_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    ROW_SLICE: gl.constexpr = gl.SliceLayout(1, LD_LAYOUT)  # one value per gathered row
    KEY_SLICE: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)  # one value per key column of S

    head0 = gl.program_id(0) * ROWS
    row = gl.program_id(1)
    split = gl.program_id(2)
    req = gl.load(req_ptr + row)
    seq_len = gl.load(seq_lens_ptr + req)
    num_tiles = gl.cdiv(num_idx, TILE)
    per_split = gl.cdiv(num_tiles, num_splits)
    lo = split * per_split
    n = gl.minimum(lo + per_split, num_tiles) - lo  # this split's key tiles (none: n <= 0)
    end = gl.minimum(num_idx, (lo + n) * TILE)  # past this: another split's indices
    idx_row = idx_ptr + row.to(gl.int64) * stride_it
    bt_row = bt_ptr + req.to(gl.int64) * stride_bt

    # shared memory: Q 72 KB, two tile stages 144 KB, P 8 KB (227 KB is the limit)
    q0_smem = gl.allocate_shared_memory(DT, [ROWS, HALF], KV_SMEM)
    q1_smem = gl.allocate_shared_memory(DT, [ROWS, HALF], KV_SMEM)
    qpe_smem = gl.allocate_shared_memory(DT, [ROWS, R], PE_SMEM)
    kv0_bufs = gl.allocate_shared_memory(DT, [2, TILE, HALF], KV_SMEM)
    kv1_bufs = gl.allocate_shared_memory(DT, [2, TILE, HALF], KV_SMEM)
    pe_bufs = gl.allocate_shared_memory(DT, [2, TILE, R], PE_SMEM)
    p_smem = gl.allocate_shared_memory(DT, [ROWS, TILE], PE_SMEM)

    acc0 = gl.zeros([ROWS, HALF], gl.float32, O_LAYOUT)
    acc1 = gl.zeros([ROWS, HALF], gl.float32, O_LAYOUT)
    m_i = gl.full([ROWS], -1e30, gl.float32, gl.SliceLayout(1, S_LAYOUT))  # finite: no inf - inf
    l_part = gl.zeros([ROWS, TILE], gl.float32, S_LAYOUT)
    if n > 0:
        # the index and block-table loads of tiles 0 and 1 first, then both gathers, then Q
        # by plain loads while the gathers are in flight
        pos0 = tile_positions(idx_row, lo, end, seq_len, ROW_SLICE)
        pos1 = tile_positions(idx_row, lo + 1, end, seq_len, ROW_SLICE)
        slots0 = tile_slots(bt_row, pos0, PAGE_SIZE)
        slots = tile_slots(bt_row, pos1, PAGE_SIZE)
        _gather_tile(cache_ptr, slots0, kv0_bufs.index(0), kv1_bufs.index(0), pe_bufs.index(0),
                     LD_LAYOUT)
        async_copy.commit_group()
        if n > 1:
            _gather_tile(cache_ptr, slots, kv0_bufs.index(1), kv1_bufs.index(1),
                         pe_bufs.index(1), LD_LAYOUT)
        async_copy.commit_group()
        pos_next = tile_positions(idx_row, lo + 2, end, seq_len, ROW_SLICE)
        pos_s = tile_positions(idx_row, lo, end, seq_len, KEY_SLICE)
        load_q(q_ptr, q0_smem, q1_smem, qpe_smem, row, head0, stride_qt, stride_qh, LD_LAYOUT)
        async_copy.wait_group(1)  # tile 0 (tile 1 may stay in flight)
        fence_async_shared()  # Q's stores and tile 0's copies, before the wgmma reads them
        gl.thread_barrier()
        s = issue_scores(q0_smem, q1_smem, qpe_smem, kv0_bufs.index(0), kv1_bufs.index(0),
                          pe_bufs.index(0), S_LAYOUT)
        s = warpgroup_mma_wait(0, deps=(s,))
        p, m_i, l_part, alpha = softmax_tile(s, m_i, l_part, pos_s, qk_scale, S_LAYOUT)
        store_p(p_smem, p)
        slots = tile_slots(bt_row, pos_next, PAGE_SIZE)  # of tile 2
        for j in range(1, n):
            cur = (j - 1) % 2
            nxt = j % 2
            pos_s = tile_positions(idx_row, lo + j, end, seq_len, KEY_SLICE)  # for the softmax
            # P @ V of tile j - 1, then the scores of tile j: back to back on the tensor cores
            acc0, acc1 = issue_pv(p_smem, kv0_bufs.index(cur), kv1_bufs.index(cur), acc0, acc1)
            _tile_landed()  # tile j, gathered during the previous step
            s = issue_scores(q0_smem, q1_smem, qpe_smem, kv0_bufs.index(nxt),
                              kv1_bufs.index(nxt), pe_bufs.index(nxt), S_LAYOUT)
            acc0, acc1 = warpgroup_mma_wait(3, deps=(acc0, acc1))  # P @ V done, scores running
            gl.thread_barrier()  # both warp groups are done with stage cur and with P
            # tile j + 1 into stage cur: in flight through the scores of j, its softmax and
            # P @ V of j; the indices of tile j + 2 load meanwhile
            if j + 1 < n:
                _gather_tile(cache_ptr, slots, kv0_bufs.index(cur), kv1_bufs.index(cur),
                             pe_bufs.index(cur), LD_LAYOUT)
            async_copy.commit_group()
            pos_next = tile_positions(idx_row, lo + j + 2, end, seq_len, ROW_SLICE)
            s = warpgroup_mma_wait(0, deps=(s,))
            p, m_i, l_part, alpha = softmax_tile(s, m_i, l_part, pos_s, qk_scale, S_LAYOUT)
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT), assert_trivial=True)
            acc0 = acc0 * alpha_o[:, None]
            acc1 = acc1 * alpha_o[:, None]
            store_p(p_smem, p)
            slots = tile_slots(bt_row, pos_next, PAGE_SIZE)
        last = (n - 1) % 2
        acc0, acc1 = issue_pv(p_smem, kv0_bufs.index(last), kv1_bufs.index(last), acc0, acc1)
        acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
    store_out(out_ptr, part_out_ptr, part_lse_ptr, acc0, acc1, m_i, l_part, row, head0, split,
               num_heads, num_splits, stride_ot, stride_oh, SPLIT, S_LAYOUT, O_LAYOUT)
# fmt: on


def check_sparse_gluon_inputs(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    topk_indices: torch.Tensor,
    token_req: torch.Tensor,
    kv_lora_rank: int,
    out: torch.Tensor | None,
    fp8: bool = False,
) -> None:
    """ValueError unless the inputs are in the class the kernel takes (see the module doc;
    ``fp8``: the fp8-row kernel's class, ``ops/mla/sparse_gluon_fp8``)."""
    problem = sparse_class_problem(q, latent_cache, kv_lora_rank, fp8)
    if problem:
        raise ValueError(problem)
    rows = q.shape[0]
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"block_table must be 2-D int32, got {block_table.dtype}")
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (block_table.shape[0],):
        raise ValueError(f"seq_lens must be int32 [{block_table.shape[0]}] (one per block-table "
                         f"row), got {seq_lens.dtype} {tuple(seq_lens.shape)}")  # fmt: skip
    if topk_indices.dtype != torch.int32 or topk_indices.dim() != 2:
        raise ValueError(f"topk_indices must be 2-D int32, got {topk_indices.dtype}")
    if topk_indices.shape[0] != rows or (topk_indices.shape[1] and topk_indices.stride(1) != 1):
        raise ValueError(f"topk_indices must be [{rows}, K] with unit last stride, got "
                         f"{tuple(topk_indices.shape)}")  # fmt: skip
    if token_req.dtype not in (torch.int32, torch.int64) or tuple(token_req.shape) != (rows,):
        raise ValueError(f"token_req must be int32 or int64 [{rows}], got {token_req.dtype} "
                         f"{tuple(token_req.shape)}")  # fmt: skip
    if out is not None and (out.shape != q.shape[:2] + (KV_LORA_RANK,) or out.stride(-1) != 1):
        raise ValueError(f"out must be [rows, heads, {KV_LORA_RANK}] with unit last stride")
    tensors = (q, latent_cache, block_table, seq_lens, topk_indices, token_req)
    devices = {t.device for t in tensors + ((out,) if out is not None else ())}
    if len(devices) != 1:
        raise ValueError(f"inputs on several devices: {sorted(map(str, devices))}")
    launch_helpers.require_hopper(q.device, "sparse_mla_gluon_fp8" if fp8 else "sparse_mla_gluon")


def _launch(q, latent_cache, block_table, seq_lens, topk_indices, token_req, scale, out,
            num_splits):  # fmt: skip
    """The launch itself, for inputs ``check_sparse_gluon_inputs`` passed (the sm_90 compile
    test records it on CPU tensors)."""
    num_idx = topk_indices.shape[1]
    launch = prepare_latent_launch(q, latent_cache, KV_LORA_RANK, num_idx, out, num_splits, SHAPE,
                                   sparse=True)  # fmt: skip
    if q.shape[0] == 0 or num_idx == 0:
        return launch.out.zero_()
    rows, head_blocks, splits = launch.grid
    o = launch.out
    # fmt: off
    _sparse_mla_gluon_kernel[(head_blocks, rows, splits)](
        q, latent_cache, o, launch.part_out, launch.part_lse, block_table, seq_lens, topk_indices,
        token_req, scale * LOG2E, q.shape[1], launch.num_splits, num_idx, q.stride(0),
        q.stride(1), o.stride(0), o.stride(1), block_table.stride(0), topk_indices.stride(0),
        PAGE_SIZE=latent_cache.shape[1],
        KV_SMEM=KV_SMEM, PE_SMEM=PE_SMEM,
        SPLIT=launch.num_splits > 1, num_warps=8,
    )
    # fmt: on
    return launch.finish()


def sparse_mla_gluon(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    topk_indices: torch.Tensor,
    token_req: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA of each query row over its selected latent rows (``sparse_mla``'s contract)
    by the Gluon kernel.

    Args:
        q: [T, H, 576] bf16 absorbed queries ``[W_UK^T q_nope ; q_pe]``, H a multiple of 64.
        latent_cache: [num_blocks, page, 576] bf16, contiguous; block 0 is the null block.
        block_table: [B, max_blocks] int32; seq_lens: [B] int32.
        topk_indices: [T, K] int32 absolute positions of row t's request, unit last stride;
            -1 marks an unused slot, and positions >= the request's length are skipped too.
        token_req: [T] int32 or int64, the request (row of ``block_table``) of each query row.
        kv_lora_rank: must be 512; scale: softmax scale.
        out: [T, H, 512] written in place; default a new bf16 tensor.
        num_splits: splits of the K indices per row; default ``pick_mla_splits`` (one wave of
            programs, as ``sparse_mla`` at 64+ heads).
    Returns:
        ``out``: u per row and head; 0 for a row whose slots are all unused.
    Raises:
        ValueError: inputs outside that class, or not on a Hopper GPU.
    """
    check_sparse_gluon_inputs(q, latent_cache, block_table, seq_lens, topk_indices, token_req,
                              kv_lora_rank, out)  # fmt: skip
    return _launch(q, latent_cache, block_table, seq_lens, topk_indices, token_req, scale, out,
                   num_splits)  # fmt: skip
