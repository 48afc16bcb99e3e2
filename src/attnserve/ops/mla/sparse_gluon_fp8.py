"""Sparse absorbed MLA (DSA) over fp8 latent rows as a Gluon Hopper kernel.

``ops/mla/sparse_gluon``'s contract and design (whose jit helpers it imports, with
``ops/mla/decode_gluon``'s) for the fp8 cache of ``kvcache/fp8.py`` ("V32_FP8Sparse", 656 bytes a row:
512 e4m3 values | 4 fp32 scales, one per 128-value tile | 64 bf16 rope values), any page size,
heads a multiple of 64. A program of 8 warps owns 64 heads of one query row and walks its key
tiles of 64 selected rows; the MMAs are the bf16 kernel's (``warps_per_cta [4, 2]``, Q in shared
memory, P through shared memory), on bf16 values dequantised in shared memory.

Shared memory (227 KB a block): Q 72 KB, one converted tile (the two [64, 256] bf16 value halves
the wgmmas read, 64 KB), two raw stages (64 x 512 e4m3 bytes + 64 x 4 scales, 33 KB each), two
rope stages (bf16 [64, 64], 8 KB each) and P 8 KB: 226 KB. The rope values are bf16 already, so
``cp.async`` puts them straight into a 128-byte-swizzled rope stage; only the values and scales
go through a raw stage (plain rows, read back by the warps). Two converted tiles (as the bf16
kernel's two stages) would leave no room for any raw stage, and two raw stages of whole 656-byte
rows would need 234 KB. With one converted tile, tile t + 1 can be converted only once P @ V of
tile t has read it; the conversion is split by value half so that it overlaps the tensor cores:

1. issue P @ V of tile t - 1 (two wgmmas, one per value half), async;
2. wait for this thread's copies of tile t and for the first P @ V half, then a barrier: the raw
   stage of t is whole and value half 0 is free; dequantise half 0 (while half 1's P @ V runs),
   fence it for the async proxy, barrier, and issue the scores over half 0;
3. wait for the second P @ V half (the scores stay in flight), barrier, dequantise half 1, fence,
   barrier, issue the scores over half 1 and the rope part; the block-table lookup of tile t + 2
   (its indices were loaded at the top of the step) goes meanwhile;
4. wait for the scores, mask unused keys, run the online softmax, rescale the accumulators,
   store P (barrier): now tile t's raw stage and rope stage are free, and the gather of tile
   t + 2 goes into them; it is in flight for about a whole step.

Dequantisation: by [64, 64] pieces, each thread reads 16 e4m3 bytes of a row (in one 128-value
tile: one scale; the raw stage is XOR-swizzled by 16-byte pieces so a warp's 8 rows x 64 bytes
meet all 32 banks) and writes value * scale (exact: scales are powers of two) as bf16 into the
swizzled value half.

Registers: the converted tile and Q sit at fixed addresses, so every wgmma descriptor of the loop
would be loop-invariant; the compiler then hoisted some 80 of them (64-bit each) out of the loop
and spilled them. The loop takes those buffers as ``.index(j >> 30)`` of one-slot allocations:
always slot 0 (there are at most 2^25 tiles), but the compiler cannot tell, so it rebuilds the
descriptors each step (a few integer ops) instead.
Unused rows (-1, past the request's length, past the split) are zero-filled by the copies (values,
scales and rope), so they dequantise to 0 and no stale data or NaN reaches P @ V; their scores
are -inf. Split-KV, masking and the output are the bf16 kernel's.

Not here: bf16 rows (``ops/mla/sparse_gluon``), other ranks, fewer than 64 heads (Triton's
``sparse_mla``). No interpreter runs Gluon: CPU tests compile it for sm_90;
``benchmarks/gpu_mla_sparse_gluon.py --rows fp8`` checks and times it on a Hopper GPU. The
PyTorch twin is ``attention.reference_mla.sparse_mla_attention`` on the fp8 cache.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from attnserve.ops.hopper import issue_pv, store_p
from attnserve.ops.mla.gluon_tiles import (
    KV_LORA_RANK,
    KV_SMEM,
    PE_SMEM,
    SHAPE,
    TILE,
    load_q,
    softmax_tile,
    store_out,
    tile_positions,
    tile_slots,
)
from attnserve.ops.mla.latent import LOG2E, prepare_latent_launch
from attnserve.ops.mla.sparse_gluon import check_sparse_gluon_inputs

__all__ = ["check_sparse_gluon_fp8_inputs", "sparse_mla_gluon_fp8"]

# raw stages: e4m3 rows with their 16-byte pieces XOR-swizzled by row % 8 (a warp reading 8 rows
# x 64 bytes then meets all 32 banks), plain fp32 scales
_VAL_SMEM = gl.SwizzledSharedLayout(16, 1, 8, order=[1, 0])
_SC_SMEM = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])


# Kernels keep their dense argument lists: one argument per line would triple their length.
# fmt: off
@gluon.jit
def _gather_fp8_tile(val_ptr, sc_ptr, pe_ptr, slots, vals, scs, pe, VAL_LD: gl.constexpr,
                     SC_LD: gl.constexpr, PE_LD: gl.constexpr):
    """cp.async of the fp8 rows at ``slots`` [TILE] (SliceLayout(1, VAL_LD)): e4m3 values into
    ``vals`` [TILE, 512], fp32 scales into ``scs`` [TILE, 4] (raw stage), bf16 rope into ``pe``
    [TILE, 64] (swizzled, as the wgmma reads it); rows with slot -1 are zero-filled. The three
    pointers are the same cache seen as e4m3, fp32 and bf16 (656, 164 and 328 elements a row)."""
    L: gl.constexpr = vals.shape[1]  # 512 e4m3 bytes, then the scales at byte L, the rope at L + 16
    NT: gl.constexpr = scs.shape[1]  # 4 scales
    ROW: gl.constexpr = L + 4 * NT + 2 * pe.shape[1]  # 656 bytes
    ok = slots >= 0
    base = gl.where(ok, slots, 0).to(gl.int64)
    dv = gl.arange(0, L, layout=gl.SliceLayout(0, VAL_LD))
    rows = val_ptr + base * ROW
    async_copy.async_copy_global_to_shared(vals, rows[:, None] + dv[None, :], mask=ok[:, None])
    base_s = gl.convert_layout(base, gl.SliceLayout(1, SC_LD), assert_trivial=True)
    ok_s = gl.convert_layout(ok, gl.SliceLayout(1, SC_LD), assert_trivial=True)
    ds = gl.arange(0, NT, layout=gl.SliceLayout(0, SC_LD))
    rows_s = sc_ptr + base_s * (ROW // 4) + L // 4
    async_copy.async_copy_global_to_shared(scs, rows_s[:, None] + ds[None, :], mask=ok_s[:, None])
    base_r = gl.convert_layout(base, gl.SliceLayout(1, PE_LD), assert_trivial=True)
    ok_r = gl.convert_layout(ok, gl.SliceLayout(1, PE_LD), assert_trivial=True)
    dr = gl.arange(0, pe.shape[1], layout=gl.SliceLayout(0, PE_LD))
    rows_r = pe_ptr + base_r * (ROW // 2) + (L + 4 * NT) // 2
    async_copy.async_copy_global_to_shared(pe, rows_r[:, None] + dr[None, :], mask=ok_r[:, None])


@gluon.jit
def _dequant_half(vals, scs, kv, h: gl.constexpr, CV_LAYOUT: gl.constexpr):
    """Value half h of a raw stage (scale tiles 2h, 2h + 1 of 128 values) as bf16 value * its
    tile's scale into ``kv`` [TILE, 256] (swizzled), by pieces of CV_LAYOUT's width."""
    W: gl.constexpr = CV_LAYOUT.threads_per_warp[1] * CV_LAYOUT.size_per_thread[1]
    for i in gl.static_range(kv.shape[1] // W):
        # columns h * 256 + i * W.. of the row's 512 values, in scale tile (h * 256 + i * W) // 128
        v = vals.slice(h * kv.shape[1] + i * W, W, dim=1).load(CV_LAYOUT)  # [TILE, W] e4m3
        sc = scs.slice((h * kv.shape[1] + i * W) // 128, 1, dim=1).load(CV_LAYOUT)  # [TILE, 1]
        kv.slice(i * W, W, dim=1).store((v.to(gl.float32) * sc).to(kv.dtype))


@gluon.jit
def _convert_landed():
    """The generic-proxy stores of a dequantised half fenced for the wgmma (async proxy), and
    every thread's done (the barrier)."""
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit(do_not_specialize=("num_splits", "num_idx", "stride_bt"),  # per step
           do_not_specialize_on_alignment=("bt_ptr", "seq_lens_ptr", "req_ptr"))
def _sparse_mla_gluon_fp8_kernel(q_ptr, val_ptr, sc_ptr, pe_ptr, out_ptr, part_out_ptr,
                                 part_lse_ptr, bt_ptr, seq_lens_ptr, idx_ptr, req_ptr, qk_scale,
                                 num_heads, num_splits, num_idx, stride_qt, stride_qh, stride_ot,
                                 stride_oh, stride_bt, stride_it, PAGE_SIZE: gl.constexpr,
                                 KV_SMEM: gl.constexpr, PE_SMEM: gl.constexpr,
                                 VAL_SMEM: gl.constexpr, SC_SMEM: gl.constexpr, SPLIT: gl.constexpr):
    ROWS: gl.constexpr = 64  # heads a program, the M of every MMA
    HALF: gl.constexpr = 256  # value columns a half (kv_lora_rank 512)
    R: gl.constexpr = 64  # rope columns
    NT: gl.constexpr = 4  # fp8 scale tiles a row
    DT: gl.constexpr = gl.bfloat16
    # 8 warps as [4, 2]: the two warp groups split N (keys of S, columns of O), never M
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 32, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 128, 16])
    LD_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # bf16: Q, rope
    # 16 e4m3 bytes a thread, a warp 4 rows x 128 bytes (whole lines): the gather and the
    # dequantisation; the scales (4 bytes a thread) with the same rows a thread
    VAL_LD: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0])
    SC_LD: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [8, 1], [1, 0])
    CV_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [8, 1], [1, 0])
    ROW_SLICE: gl.constexpr = gl.SliceLayout(1, VAL_LD)  # one value per gathered row
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

    # shared memory: Q 72 KB, the converted tile 64 KB, two raw stages 66 KB, two rope stages
    # 16 KB, P 8 KB (226 KB; 227 KB is the limit)
    q0_buf = gl.allocate_shared_memory(DT, [1, ROWS, HALF], KV_SMEM)
    q1_buf = gl.allocate_shared_memory(DT, [1, ROWS, HALF], KV_SMEM)
    qpe_buf = gl.allocate_shared_memory(DT, [1, ROWS, R], PE_SMEM)
    q0_smem = q0_buf.index(0)
    q1_smem = q1_buf.index(0)
    qpe_smem = qpe_buf.index(0)
    kv0_buf = gl.allocate_shared_memory(DT, [1, TILE, HALF], KV_SMEM)
    kv1_buf = gl.allocate_shared_memory(DT, [1, TILE, HALF], KV_SMEM)
    kv0 = kv0_buf.index(0)
    kv1 = kv1_buf.index(0)
    val_bufs = gl.allocate_shared_memory(val_ptr.dtype.element_ty, [2, TILE, 2 * HALF], VAL_SMEM)
    sc_bufs = gl.allocate_shared_memory(gl.float32, [2, TILE, NT], SC_SMEM)
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
        _gather_fp8_tile(val_ptr, sc_ptr, pe_ptr, slots0, val_bufs.index(0), sc_bufs.index(0),
                         pe_bufs.index(0), VAL_LD, SC_LD, LD_LAYOUT)
        async_copy.commit_group()
        if n > 1:
            _gather_fp8_tile(val_ptr, sc_ptr, pe_ptr, slots, val_bufs.index(1),
                             sc_bufs.index(1), pe_bufs.index(1), VAL_LD, SC_LD, LD_LAYOUT)
        async_copy.commit_group()
        pos_next = tile_positions(idx_row, lo + 2, end, seq_len, ROW_SLICE)
        pos_s = tile_positions(idx_row, lo, end, seq_len, KEY_SLICE)
        load_q(q_ptr, q0_smem, q1_smem, qpe_smem, row, head0, stride_qt, stride_qh, LD_LAYOUT)
        async_copy.wait_group(1)  # tile 0 (tile 1 may stay in flight)
        gl.thread_barrier()  # every thread's copies of tile 0
        _dequant_half(val_bufs.index(0), sc_bufs.index(0), kv0, 0, CV_LAYOUT)
        _dequant_half(val_bufs.index(0), sc_bufs.index(0), kv1, 1, CV_LAYOUT)
        _convert_landed()  # and Q's stores, and the rope copies
        s = gl.zeros([ROWS, TILE], gl.float32, S_LAYOUT)
        s = warpgroup_mma(q0_smem, kv0.permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma(q1_smem, kv1.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(qpe_smem, pe_bufs.index(0).permute((1, 0)), s, is_async=True)
        slots = tile_slots(bt_row, pos_next, PAGE_SIZE)  # of tile 2
        s = warpgroup_mma_wait(0, deps=(s,))
        p, m_i, l_part, alpha = softmax_tile(s, m_i, l_part, pos_s, qk_scale, S_LAYOUT)
        store_p(p_smem, p)  # its barrier: tile 0's raw and rope stages are free
        if n > 2:
            _gather_fp8_tile(val_ptr, sc_ptr, pe_ptr, slots, val_bufs.index(0), sc_bufs.index(0),
                             pe_bufs.index(0), VAL_LD, SC_LD, LD_LAYOUT)
        async_copy.commit_group()
        for j in range(1, n):
            st = j % 2  # tile j's raw and rope stage; tile j + 2 goes there next
            z = j >> 30  # 0, but not to the compiler: see the module doc
            kv0 = kv0_buf.index(z)
            kv1 = kv1_buf.index(z)
            q0_smem = q0_buf.index(z)
            q1_smem = q1_buf.index(z)
            qpe_smem = qpe_buf.index(z)
            pos_s = tile_positions(idx_row, lo + j, end, seq_len, KEY_SLICE)  # for the softmax
            pos_next = tile_positions(idx_row, lo + j + 2, end, seq_len, ROW_SLICE)
            acc0, acc1 = issue_pv(p_smem, kv0, kv1, acc0, acc1)  # of tile j - 1
            async_copy.wait_group(1)  # tile j (tile j + 1 may stay in flight)
            acc0, acc1 = warpgroup_mma_wait(1, deps=(acc0, acc1))  # P @ V over half 0 done
            gl.thread_barrier()  # tile j landed everywhere; both warp groups done with half 0
            _dequant_half(val_bufs.index(st), sc_bufs.index(st), kv0, 0, CV_LAYOUT)
            _convert_landed()
            s = gl.zeros([ROWS, TILE], gl.float32, S_LAYOUT)
            s = warpgroup_mma(q0_smem, kv0.permute((1, 0)), s, use_acc=False, is_async=True)
            acc0, acc1 = warpgroup_mma_wait(1, deps=(acc0, acc1))  # P @ V over half 1 done
            gl.thread_barrier()  # both warp groups done with half 1 and with P
            _dequant_half(val_bufs.index(st), sc_bufs.index(st), kv1, 1, CV_LAYOUT)
            _convert_landed()
            s = warpgroup_mma(q1_smem, kv1.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(qpe_smem, pe_bufs.index(st).permute((1, 0)), s, is_async=True)
            slots = tile_slots(bt_row, pos_next, PAGE_SIZE)  # of tile j + 2
            s = warpgroup_mma_wait(0, deps=(s,))
            p, m_i, l_part, alpha = softmax_tile(s, m_i, l_part, pos_s, qk_scale, S_LAYOUT)
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT), assert_trivial=True)
            acc0 = acc0 * alpha_o[:, None]
            acc1 = acc1 * alpha_o[:, None]
            store_p(p_smem, p)  # its barrier: every warp group's scores of tile j are done
            # tile j + 2 into tile j's stages: in flight through the whole next step
            if j + 2 < n:
                _gather_fp8_tile(val_ptr, sc_ptr, pe_ptr, slots, val_bufs.index(st),
                                 sc_bufs.index(st), pe_bufs.index(st), VAL_LD, SC_LD, LD_LAYOUT)
            async_copy.commit_group()
        acc0, acc1 = issue_pv(p_smem, kv0_buf.index(0), kv1_buf.index(0), acc0, acc1)  # last tile
        acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
    store_out(out_ptr, part_out_ptr, part_lse_ptr, acc0, acc1, m_i, l_part, row, head0, split,
               num_heads, num_splits, stride_ot, stride_oh, SPLIT, S_LAYOUT, O_LAYOUT)
# fmt: on


def check_sparse_gluon_fp8_inputs(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    topk_indices: torch.Tensor,
    token_req: torch.Tensor,
    kv_lora_rank: int,
    out: torch.Tensor | None,
) -> None:
    """ValueError unless the inputs are in the class the kernel takes (see the module doc)."""
    check_sparse_gluon_inputs(q, latent_cache, block_table, seq_lens, topk_indices, token_req,
                              kv_lora_rank, out, fp8=True)  # fmt: skip


def _launch(q, latent_cache, block_table, seq_lens, topk_indices, token_req, scale, out,
            num_splits):  # fmt: skip
    """The launch itself, for inputs ``check_sparse_gluon_fp8_inputs`` passed (the sm_90
    compile test records it on CPU tensors)."""
    num_idx = topk_indices.shape[1]
    launch = prepare_latent_launch(q, latent_cache, KV_LORA_RANK, num_idx, out, num_splits, SHAPE,
                                   sparse=True)  # fmt: skip
    if q.shape[0] == 0 or num_idx == 0:
        return launch.out.zero_()
    rows, head_blocks, splits = launch.grid
    o = launch.out
    # the same bytes seen as e4m3 values, fp32 scales and bf16 rope (no copies)
    views = (latent_cache.view(torch.float8_e4m3fn), latent_cache.view(torch.float32),
             latent_cache.view(torch.bfloat16))  # fmt: skip
    # fmt: off
    _sparse_mla_gluon_fp8_kernel[(head_blocks, rows, splits)](
        q, *views, o, launch.part_out, launch.part_lse, block_table, seq_lens, topk_indices,
        token_req, scale * LOG2E, q.shape[1], launch.num_splits, num_idx, q.stride(0),
        q.stride(1), o.stride(0), o.stride(1), block_table.stride(0), topk_indices.stride(0),
        PAGE_SIZE=latent_cache.shape[1],
        KV_SMEM=KV_SMEM, PE_SMEM=PE_SMEM, VAL_SMEM=_VAL_SMEM,
        SC_SMEM=_SC_SMEM,
        SPLIT=launch.num_splits > 1, num_warps=8,
    )
    # fmt: on
    return launch.finish()


def sparse_mla_gluon_fp8(
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
    """Absorbed MLA of each query row over its selected fp8 latent rows (``sparse_mla``'s
    contract) by the Gluon kernel.

    Args:
        q: [T, H, 576] bf16 absorbed queries ``[W_UK^T q_nope ; q_pe]``, H a multiple of 64.
        latent_cache: [num_blocks, page, 656] uint8 fp8 rows (``kvcache/fp8.py``), contiguous,
            16-byte aligned; block 0 is the null block.
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
    check_sparse_gluon_fp8_inputs(q, latent_cache, block_table, seq_lens, topk_indices,
                                  token_req, kv_lora_rank, out)  # fmt: skip
    return _launch(q, latent_cache, block_table, seq_lens, topk_indices, token_req, scale, out,
                   num_splits)  # fmt: skip
