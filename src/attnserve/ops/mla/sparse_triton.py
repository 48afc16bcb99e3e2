"""Triton kernel of DSA (DeepSeek-V3.2, GLM-5): sparse MLA over the top-k rows.

``sparse_mla``: absorbed MLA of each query row (a decode or a prefill token) over only its
selected latent rows. Indices are absolute positions of the row's request, mapped to cache
slots through the block table inside the kernel; -1 slots (and positions at or past the
request's length) are skipped, and a row with none gets 0. The tiles, fp8 dequantisation and
split-KV merge are ``ops/mla/decode_triton.py``'s.

The indexer that picks the rows is ``ops/indexer/logits_triton.py`` (re-exported here). Not here:
writing the caches (``backends/torch_mla_sparse``), projections and RoPE. The PyTorch twin is
``attention.reference_mla.sparse_mla_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve.ops.indexer.logits_triton import (
    IndexerConfig,
    indexer_logits,
    lightning_indexer_topk,
    pick_indexer_config,
    topk_from_logits,
)
from attnserve.ops.mla.latent import (
    LOG2E,
    MLAConfig,
    attend_latent_tile,
    load_absorbed_q,
    load_latent_rows,
    prepare_latent_launch,
    store_latent_rows,
)

__all__ = [
    "IndexerConfig",
    "indexer_logits",
    "lightning_indexer_topk",
    "pick_indexer_config",
    "sparse_mla",
    "topk_from_logits",
]


# fmt: off
@triton.jit
def _sparse_tile(acc, m_i, l_i, q_nope, q_pe, t, idx_row, num_idx, bt_row, seq_len, qk_scale,
                 kv_ptr, pe_ptr, sc_ptr, s_kvb, s_kvs, s_peb, s_pes, s_scb, s_scs,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, L: tl.constexpr, L_PAD: tl.constexpr,
                 R: tl.constexpr, R_PAD: tl.constexpr, FP8: tl.constexpr, TILE: tl.constexpr,
                 DT: tl.constexpr, PRECISION: tl.constexpr):
    kk = t * BLOCK_N + tl.arange(0, BLOCK_N)
    pos = tl.load(idx_row + kk, mask=kk < num_idx, other=-1)
    valid = (pos >= 0) & (pos < seq_len)
    blk = tl.load(bt_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
    kv, pe = load_latent_rows(kv_ptr, pe_ptr, sc_ptr, blk, pos % PAGE, valid, s_kvb, s_kvs,
                              s_peb, s_pes, s_scb, s_scs, L, L_PAD, R, R_PAD, FP8, TILE, DT)
    return attend_latent_tile(acc, m_i, l_i, q_nope, q_pe, kv, pe, valid, qk_scale, PRECISION)


@triton.jit(do_not_specialize=("num_splits", "num_idx", "stride_bt"),  # per step
            do_not_specialize_on_alignment=("bt_ptr", "seq_lens_ptr", "req_ptr"))
def _sparse_mla_kernel(q_ptr, kv_ptr, pe_ptr, sc_ptr, out_ptr, part_out_ptr, part_lse_ptr, bt_ptr,
                       seq_lens_ptr, idx_ptr, req_ptr, qk_scale, num_heads, num_splits, num_idx,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_it, s_kvb,
                       s_kvs, s_peb, s_pes, s_scb, s_scs, PAGE: tl.constexpr, L: tl.constexpr,
                       L_PAD: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
                       FP8: tl.constexpr, TILE: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_N: tl.constexpr, DT: tl.constexpr, PRECISION: tl.constexpr,
                       SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    seq = tl.load(req_ptr + row).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_nope, q_pe = load_absorbed_q(q_ptr, row, heads, head_ok, stride_qt, stride_qh, L, L_PAD, R,
                                   R_PAD, DT)
    per_split = tl.cdiv(tl.cdiv(num_idx, BLOCK_N), num_splits)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, tl.cdiv(num_idx, BLOCK_N))
    idx_row = idx_ptr + row.to(tl.int64) * stride_it
    bt_row = bt_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_H], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, L_PAD], dtype=tl.float32)
    if INTERPRET:  # the interpreter's range() cannot take a loaded bound
        t = lo
        while t < hi:
            acc, m_i, l_i = _sparse_tile(
                acc, m_i, l_i, q_nope, q_pe, t, idx_row, num_idx, bt_row, seq_len, qk_scale,
                kv_ptr, pe_ptr, sc_ptr, s_kvb, s_kvs, s_peb, s_pes, s_scb, s_scs, PAGE, BLOCK_N,
                L, L_PAD, R, R_PAD, FP8, TILE, DT, PRECISION)
            t += 1
    else:
        for t in range(lo, hi):
            acc, m_i, l_i = _sparse_tile(
                acc, m_i, l_i, q_nope, q_pe, t, idx_row, num_idx, bt_row, seq_len, qk_scale,
                kv_ptr, pe_ptr, sc_ptr, s_kvb, s_kvs, s_peb, s_pes, s_scb, s_scs, PAGE, BLOCK_N,
                L, L_PAD, R, R_PAD, FP8, TILE, DT, PRECISION)
    if SPLIT:
        part = (row.to(tl.int64) * num_heads + heads) * num_splits + split
        store_latent_rows(part_out_ptr + part * L, part_lse_ptr + part, acc, m_i, l_i, head_ok,
                          True, L, L_PAD)
    else:
        out_rows = out_ptr + row.to(tl.int64) * stride_ot + heads * stride_oh
        store_latent_rows(out_rows, part_lse_ptr, acc, m_i, l_i, head_ok, False, L, L_PAD)


# fmt: on


def sparse_mla(
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
    config: MLAConfig | None = None,
) -> torch.Tensor:
    """Absorbed MLA of each query row over its selected latent rows (FlashMLA sparse contract).

    Args:
        q: [T, H, L + R] absorbed queries ``[W_UK^T q_nope ; q_pe]`` (decode or prefill rows).
        latent_cache: model-dtype or fp8 latent cache, block 0 null (see ``mla_decode``).
        block_table: [B, max_blocks] int32; seq_lens: [B] int32.
        topk_indices: [T, K] int32 absolute positions of row t's request; -1 marks an unused
            slot, and positions >= the request's length are skipped too.
        token_req: [T] int32 or int64, the request (row of ``block_table``) of each query row.
        kv_lora_rank: L; scale: the softmax scale (the dense MLA one).
        out: [T, H, L], written in place; default new, in q's dtype.
        num_splits: splits of the K indices per row; default ``pick_mla_splits``.
        config: launch shape; default ``pick_mla_config``.
    Returns:
        ``out``: u per row and head; 0 for a row whose slots are all unused.
    """
    num_idx = topk_indices.shape[1]
    launch = prepare_latent_launch(q, latent_cache, kv_lora_rank, num_idx, out, num_splits, config,
                                   sparse=True)
    if q.shape[0] == 0 or num_idx == 0:
        return launch.out.zero_()
    o = launch.out
    # fmt: off
    _sparse_mla_kernel[launch.grid](
        q, *launch.cache_args[:3], o, launch.part_out, launch.part_lse, block_table, seq_lens,
        topk_indices, token_req, scale * LOG2E, q.shape[1], launch.num_splits, num_idx,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), block_table.stride(0),
        topk_indices.stride(0), *launch.cache_args[3:], **launch.meta,
    )
    # fmt: on
    return launch.finish()
