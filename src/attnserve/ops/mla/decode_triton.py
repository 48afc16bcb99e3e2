"""Triton absorbed ("MQA") MLA decode over the paged latent cache, rows gathered by pointer.

``mla_decode`` attends one absorbed query per row, ``[W_UK^T q_nope ; q_pe]`` for every head,
over its request's latent rows ``[c_kv ; k_pe]`` (``ops/mla/latent.py``: a single KV head whose
value is the first ``kv_lora_rank`` dims of the same row, so each row is read once for its key and
its value). A program owns ``block_h`` query heads of one row (stacked as the rows of ``tl.dot``,
so 128 heads run on tensor cores) and walks the block table, gathering each key tile's rows by
pointer: any page size, model-dtype or fp8 rows. Long contexts are split over several programs
(split-KV) whose partials ``latent.merge_splits`` combines by log-sum-exp.

The result is ``u`` [B, H, kv_lora_rank]; ``W_UV`` and ``o_proj`` are the caller's. A query row
need not be a decode: the TRITON_MLA backend also runs each token of a short prefill as a row of
its own, with its request's block table row and its causal key count. The same contract by TMA
tiles is ``decode_triton_tma.py``, by a Hopper Gluon kernel ``decode_gluon.py``; which one runs is
``attention/kernels.py``'s choice. Not here: long prefills (the backend's expanded PyTorch path),
writing the cache (``backends/torch_mla.write_latent_rows``). The PyTorch twin is
``attention.reference_mla.mla_decode_absorbed``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve.ops.mla.latent import (
    LOG2E,
    MLAConfig,
    attend_latent_tile,
    load_absorbed_q,
    load_latent_rows,
    prepare_latent_launch,
    store_latent_rows,
)

__all__ = ["mla_decode"]


# Kernels keep their dense argument lists: one argument per line would triple their length.
# fmt: off
@triton.jit
def _decode_tile(acc, m_i, l_i, q_nope, q_pe, t, bt_row, seq_len, qk_scale, kv_ptr, pe_ptr,
                 sc_ptr, s_kvb, s_kvs, s_peb, s_pes, s_scb, s_scs, PAGE: tl.constexpr,
                 BLOCK_N: tl.constexpr, L: tl.constexpr, L_PAD: tl.constexpr, R: tl.constexpr,
                 R_PAD: tl.constexpr, FP8: tl.constexpr, TILE: tl.constexpr, DT: tl.constexpr,
                 PRECISION: tl.constexpr):
    k_pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = k_pos < seq_len
    blk = tl.load(bt_row + k_pos // PAGE, mask=valid, other=0).to(tl.int64)
    kv, pe = load_latent_rows(kv_ptr, pe_ptr, sc_ptr, blk, k_pos % PAGE, valid, s_kvb, s_kvs,
                              s_peb, s_pes, s_scb, s_scs, L, L_PAD, R, R_PAD, FP8, TILE, DT)
    return attend_latent_tile(acc, m_i, l_i, q_nope, q_pe, kv, pe, valid, qk_scale, PRECISION)


@triton.jit(do_not_specialize=("num_splits", "stride_bt"),  # per step: no variant per class
            do_not_specialize_on_alignment=("bt_ptr", "seq_lens_ptr"))
def _mla_decode_kernel(q_ptr, kv_ptr, pe_ptr, sc_ptr, out_ptr, part_out_ptr, part_lse_ptr, bt_ptr,
                       seq_lens_ptr, qk_scale, num_heads, num_splits, stride_qt, stride_qh,
                       stride_ot, stride_oh, stride_bt, s_kvb, s_kvs, s_peb, s_pes, s_scb, s_scs,
                       PAGE: tl.constexpr, L: tl.constexpr, L_PAD: tl.constexpr, R: tl.constexpr,
                       R_PAD: tl.constexpr, FP8: tl.constexpr, TILE: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr,
                       PRECISION: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    seq = tl.program_id(0)
    split = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    seq_len = tl.load(seq_lens_ptr + seq)
    q_nope, q_pe = load_absorbed_q(q_ptr, seq, heads, head_ok, stride_qt, stride_qh, L, L_PAD, R,
                                   R_PAD, DT)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(num_tiles, num_splits)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, num_tiles)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_H], -1e30, dtype=tl.float32)  # finite: no inf - inf
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, L_PAD], dtype=tl.float32)
    if INTERPRET:  # the interpreter's range() cannot take a loaded bound
        t = lo
        while t < hi:
            acc, m_i, l_i = _decode_tile(
                acc, m_i, l_i, q_nope, q_pe, t, bt_row, seq_len, qk_scale, kv_ptr, pe_ptr, sc_ptr,
                s_kvb, s_kvs, s_peb, s_pes, s_scb, s_scs, PAGE, BLOCK_N, L, L_PAD, R, R_PAD, FP8,
                TILE, DT, PRECISION)
            t += 1
    else:
        for t in range(lo, hi):
            acc, m_i, l_i = _decode_tile(
                acc, m_i, l_i, q_nope, q_pe, t, bt_row, seq_len, qk_scale, kv_ptr, pe_ptr, sc_ptr,
                s_kvb, s_kvs, s_peb, s_pes, s_scb, s_scs, PAGE, BLOCK_N, L, L_PAD, R, R_PAD, FP8,
                TILE, DT, PRECISION)
    if SPLIT:  # partial rows [seq, head, split], merged by _merge_kernel
        row = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
        store_latent_rows(part_out_ptr + row * L, part_lse_ptr + row, acc, m_i, l_i, head_ok,
                          True, L, L_PAD)
    else:
        out_rows = out_ptr + seq.to(tl.int64) * stride_ot + heads * stride_oh
        store_latent_rows(out_rows, part_lse_ptr, acc, m_i, l_i, head_ok, False, L, L_PAD)


# fmt: on


def mla_decode(
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
    """Absorbed MLA decode: one query row per request over all its cached latent rows.

    Args:
        q: [B, H, L + R] absorbed queries ``[W_UK^T q_nope ; q_pe]``, last dim contiguous.
        latent_cache: [num_blocks, block_size, L + R] in a float dtype, or uint8 fp8 rows
            (``kvcache/fp8.py``); block 0 is the null block.
        block_table: [B, max_blocks] int32; seq_lens: [B] int32 keys of each request (0: the
            row's output is 0).
        kv_lora_rank: L; scale: softmax scale (pass it explicitly, e.g. 0.1352 for V3).
        max_seq_len: host-side bound of ``seq_lens`` (no device sync is made).
        out: [B, H, L] written in place; default a new tensor in q's dtype.
        num_splits: key splits per (request, head block); default ``pick_mla_splits``.
        config: launch shape; default ``pick_mla_config``.
    Returns:
        ``out``: u = softmax(scale * q . rows) @ c_kv per head (apply W_UV for the values).
    """
    launch = prepare_latent_launch(
        q, latent_cache, kv_lora_rank, max_seq_len, out, num_splits, config
    )
    if q.shape[0] == 0:
        return launch.out
    o = launch.out
    # fmt: off
    _mla_decode_kernel[launch.grid](
        q, *launch.cache_args[:3], o, launch.part_out, launch.part_lse, block_table, seq_lens,
        scale * LOG2E, q.shape[1], launch.num_splits, q.stride(0), q.stride(1), o.stride(0),
        o.stride(1), block_table.stride(0), *launch.cache_args[3:], **launch.meta,
    )
    # fmt: on
    return launch.finish()
