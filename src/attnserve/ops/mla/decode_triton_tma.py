"""Absorbed MLA decode whose key tiles arrive by TMA: whole pages of latent rows, no gathers.

The same contract as ``ops/mla/decode_triton.mla_decode`` (``mla_decode_tma`` below, where
``tma_fits`` says the cache allows it; ``attention/kernels.py`` picks it): one absorbed query row per program and head block, walking its block
table. Where the page is at least the key tile (``block_size % block_n == 0``) a tile of
``block_n`` keys is ``block_n`` consecutive rows of one page, so it is one tensor-descriptor load
(Hopper's TMA engine copies it to shared memory; no per-row address registers, no masks). The
latent row is split in three column ranges of at most 256 (TMA's box limit): two halves of the
``kv_lora_rank`` values and the rope part. The halves are kept apart through the tile, so the
512-wide accumulator is two 256-wide ones and each ``P @ V`` is its own warp-group MMA. A key
tile that the sequence ends inside (only the last, past ``seq_len // block_n`` full tiles) is
read with masked pointer loads instead, so rows past the sequence (stale or never written) never
meet the softmax. Model-dtype caches only; fp8 rows take the pointer kernel.

The PyTorch twin is ``attention.reference_mla.mla_decode_absorbed``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from attnserve.ops.launch import has_tma
from attnserve.ops.mla.latent import LOG2E, MLAConfig, prepare_latent_launch
from attnserve.ops.tiles import softmax_step

__all__ = ["mla_decode_tma", "mla_decode_tma_kernel", "tma_descriptors", "tma_fits"]


def _is_pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def tma_fits(latent_cache: torch.Tensor, kv_lora_rank: int, block_n: int) -> bool:
    """Whether ``latent_cache`` [blocks, page, L + R] can feed the TMA kernel with block_n-key
    tiles: a float dtype, whole tiles inside a page, column ranges TMA and ``tl.arange`` take,
    rows whose stride is a multiple of 16 bytes."""
    if latent_cache.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    width = latent_cache.shape[-1]
    rope = width - kv_lora_rank
    half = kv_lora_rank // 2
    elem = latent_cache.element_size()
    return (
        latent_cache.shape[1] % block_n == 0
        and kv_lora_rank % 2 == 0
        and _is_pow2(half)
        and _is_pow2(rope)
        and max(half, rope) * elem <= 1024
        and half <= 256
        and rope <= 256
        and latent_cache.is_contiguous()
        and (width * elem) % 16 == 0
        and latent_cache.data_ptr() % 16 == 0
    )


def tma_descriptors(latent_cache: torch.Tensor, kv_lora_rank: int, block_n: int):
    """(values descriptor with [block_n, L/2] boxes, rope descriptor with [block_n, R] boxes)
    over the cache seen as [blocks * page, L + R] rows."""
    rows = latent_cache.view(-1, latent_cache.shape[-1])
    rope = rows.shape[1] - kv_lora_rank
    kv_desc = TensorDescriptor.from_tensor(rows, [block_n, kv_lora_rank // 2])
    pe_desc = TensorDescriptor.from_tensor(rows, [block_n, rope])
    return kv_desc, pe_desc


# Kernels keep their dense argument lists: one argument per line would triple their length.
# fmt: off
@triton.jit
def _split_tile(acc0, acc1, m_i, l_i, q0, q1, q_pe, kv0, kv1, pe, valid, qk_scale,
                PRECISION: tl.constexpr):
    """Online-softmax update with one key tile held as two value halves and the rope part."""
    s = tl.dot(q0, tl.trans(kv0), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N]
    s = tl.dot(q1, tl.trans(kv1), s, input_precision=PRECISION)
    s = tl.dot(q_pe, tl.trans(pe), s, input_precision=PRECISION)
    p, m_new, l_i, alpha = softmax_step(s, m_i, l_i, valid, qk_scale)
    p = p.to(kv0.dtype)
    acc0 = tl.dot(p, kv0, acc0 * alpha[:, None], input_precision=PRECISION)
    acc1 = tl.dot(p, kv1, acc1 * alpha[:, None], input_precision=PRECISION)
    return acc0, acc1, m_new, l_i


@triton.jit
def _tma_tile(acc0, acc1, m_i, l_i, q0, q1, q_pe, t, bt_row, seq_len, qk_scale, kv_desc,
              pe_desc, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, L: tl.constexpr,
              HALF: tl.constexpr, DT: tl.constexpr, PRECISION: tl.constexpr):
    """A whole tile: BLOCK_N consecutive rows of one page, three descriptor loads."""
    k0 = t * BLOCK_N
    row = tl.load(bt_row + k0 // PAGE) * PAGE + k0 % PAGE
    kv0 = kv_desc.load([row, 0]).to(DT)
    kv1 = kv_desc.load([row, HALF]).to(DT)
    pe = pe_desc.load([row, L]).to(DT)
    valid = k0 + tl.arange(0, BLOCK_N) < seq_len  # all true; keeps one tile function
    return _split_tile(acc0, acc1, m_i, l_i, q0, q1, q_pe, kv0, kv1, pe, valid, qk_scale,
                       PRECISION)


@triton.jit
def _store_halves(out_rows, lse_rows, acc0, acc1, m_i, l_i, head_ok, PARTIAL: tl.constexpr,
                  HALF: tl.constexpr):
    """Normalised halves to ``out_rows`` [BLOCK_H] pointers (0 where no key was seen); PARTIAL
    rows also store their lse (log2 units, -inf when empty) for ``merge_splits``."""
    d = tl.arange(0, HALF)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    dt = out_rows.dtype.element_ty
    ptrs = out_rows[:, None] + d[None, :]
    tl.store(ptrs, (acc0 / l_safe[:, None]).to(dt), mask=head_ok[:, None])
    tl.store(ptrs + HALF, (acc1 / l_safe[:, None]).to(dt), mask=head_ok[:, None])
    if PARTIAL:
        tl.store(lse_rows, tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf")), mask=head_ok)


@triton.jit(do_not_specialize=("num_splits", "stride_bt"),  # per step: no variant per class
            do_not_specialize_on_alignment=("bt_ptr", "seq_lens_ptr"))
def mla_decode_tma_kernel(q_ptr, kv_desc, pe_desc, rows_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                           bt_ptr, seq_lens_ptr, qk_scale, num_heads, num_splits, stride_qt,
                           stride_qh, stride_ot, stride_oh, stride_bt, stride_row,
                           PAGE: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr,
                           PRECISION: tl.constexpr, SPLIT: tl.constexpr,
                           INTERPRET: tl.constexpr):
    HALF: tl.constexpr = L // 2
    seq = tl.program_id(0)
    split = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    seq_len = tl.load(seq_lens_ptr + seq)
    dh = tl.arange(0, HALF)
    dr = tl.arange(0, R)
    q_base = q_ptr + seq.to(tl.int64) * stride_qt + heads * stride_qh  # [BLOCK_H]
    q0 = tl.load(q_base[:, None] + dh[None, :], mask=head_ok[:, None], other=0.0).to(DT)
    q1 = tl.load(q_base[:, None] + HALF + dh[None, :], mask=head_ok[:, None], other=0.0).to(DT)
    q_pe = tl.load(q_base[:, None] + L + dr[None, :], mask=head_ok[:, None], other=0.0).to(DT)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(num_tiles, num_splits)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, num_tiles)
    num_full = seq_len // BLOCK_N  # tiles before it hold BLOCK_N keys each
    full_hi = tl.minimum(hi, num_full)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_H], -1e30, dtype=tl.float32)  # finite: no inf - inf
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    if INTERPRET:  # the interpreter's range() cannot take a loaded bound
        t = lo
        while t < full_hi:
            acc0, acc1, m_i, l_i = _tma_tile(
                acc0, acc1, m_i, l_i, q0, q1, q_pe, t, bt_row, seq_len, qk_scale, kv_desc,
                pe_desc, PAGE, BLOCK_N, L, HALF, DT, PRECISION)
            t += 1
    else:
        for t in range(lo, full_hi):
            acc0, acc1, m_i, l_i = _tma_tile(
                acc0, acc1, m_i, l_i, q0, q1, q_pe, t, bt_row, seq_len, qk_scale, kv_desc,
                pe_desc, PAGE, BLOCK_N, L, HALF, DT, PRECISION)
    if (lo <= num_full) & (num_full < hi):  # the tile the sequence ends in, if this split's
        k_pos = num_full * BLOCK_N + tl.arange(0, BLOCK_N)  # masked rows, never past seq_len
        valid = k_pos < seq_len
        blk = tl.load(bt_row + k_pos // PAGE, mask=valid, other=0).to(tl.int64)
        rows = rows_ptr + (blk * PAGE + k_pos % PAGE) * stride_row  # [BLOCK_N]
        kv0 = tl.load(rows[:, None] + dh[None, :], mask=valid[:, None], other=0.0).to(DT)
        kv1 = tl.load(rows[:, None] + HALF + dh[None, :], mask=valid[:, None], other=0.0).to(DT)
        pe = tl.load(rows[:, None] + L + dr[None, :], mask=valid[:, None], other=0.0).to(DT)
        acc0, acc1, m_i, l_i = _split_tile(acc0, acc1, m_i, l_i, q0, q1, q_pe, kv0, kv1, pe,
                                           valid, qk_scale, PRECISION)
    if SPLIT:  # partial rows [seq, head, split], merged by triton_mla._merge_kernel
        row = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
        _store_halves(part_out_ptr + row * L, part_lse_ptr + row, acc0, acc1, m_i, l_i, head_ok,
                      True, HALF)
    else:
        out_rows = out_ptr + seq.to(tl.int64) * stride_ot + heads * stride_oh
        _store_halves(out_rows, part_lse_ptr, acc0, acc1, m_i, l_i, head_ok, False, HALF)
# fmt: on


def mla_decode_tma(
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
    config: MLAConfig | None = None,
) -> torch.Tensor:
    """``decode_triton.mla_decode``'s contract (the same arguments and result) with key tiles by
    TMA.

    Raises:
        ValueError: a cache ``tma_fits`` refuses with the config's key tile, or a device
            without tensor-descriptor loads (before Hopper).
    """
    launch = prepare_latent_launch(q, latent_cache, kv_lora_rank, max_seq_len, out, num_splits, config)
    cfg = launch.config
    if not has_tma(q.device):
        raise ValueError(f"the TMA decode kernel needs tensor-descriptor loads (Hopper or later), not {q.device}")
    if not tma_fits(latent_cache, kv_lora_rank, cfg.block_n):
        raise ValueError(f"a latent cache of shape {tuple(latent_cache.shape)} and {latent_cache.dtype} cannot "
                         f"feed {cfg.block_n}-key TMA tiles (tma_fits)")
    if q.shape[0] == 0:
        return launch.out
    o = launch.out
    meta = {k: launch.meta[k] for k in ("PAGE", "L", "R", "BLOCK_H", "BLOCK_N", "DT", "PRECISION",
                                        "SPLIT", "INTERPRET", "num_warps", "num_stages")}  # fmt: skip
    rows = latent_cache.view(-1, latent_cache.shape[-1])
    # fmt: off
    mla_decode_tma_kernel[launch.grid](
        q, *tma_descriptors(latent_cache, kv_lora_rank, cfg.block_n), rows, o,
        launch.part_out, launch.part_lse, block_table, seq_lens, scale * LOG2E, q.shape[1],
        launch.num_splits, q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        block_table.stride(0), rows.stride(0), **meta,
    )
    # fmt: on
    return launch.finish()
