"""TORCH_MLA_SPARSE: DSA (DeepSeek-V3.2, GLM-5) in PyTorch over the paged latent and indexer caches.

A sparse-MLA layer's latent rows and indexer keys live in one KV cache group, so they share a
block table and a slot mapping. The layer makes two calls per step:

1. ``select_topk`` (layers that run an indexer): stores each new token's indexer key, in the
   model dtype or as the 132-byte fp8 row of ``kvcache/fp8.py`` (Hadamard-rotated e4m3 values,
   then one fp32 scale), scores every key of the token's sequence and keeps the best ``topk``:

   - model-dtype cache, exact (transformers' ``DeepseekV32Indexer``, in its operation order):
     ``I[t, s] = sum_h (w[t, h] * H^-0.5) * relu(D^-0.5 * q[t, h] . k[s])`` in float32;
   - fp8 cache, DeepSeek's deployed ``fp8_index``: the query is rotated and quantised per
     (token, head) like the keys, ``I[t, s] = s_k[s] * sum_h w[t, h] H^-0.5 s_q[t, h] D^-0.5
     relu(q8[t, h] . k8[s])``.

   Keys after the token (``s > pos(t)``) are masked; the result is [T, topk] int32 absolute
   positions, best first, -1 in the slots beyond the valid keys, never a future position.
   Absolute positions are what make chunked prefill and prefix-cache hits work unchanged.
2. ``forward(..., topk_indices=...)``: stores the new latent rows (as TORCH_MLA does) and
   attends in the absorbed ("MQA") form over only each query's selected rows:
   ``softmax_j(scale * [W_UK^T q_nope ; q_pe] . [c_kv ; k_pe]_j)``, ``u = sum_j p_j c_kv_j``,
   ``o_h = W_UV^h u``, with the same softmax scale as dense MLA. A query whose slots are all
   -1 gets 0. GLM-5 "shared" layers call only this, with the previous full layer's indices.

Decodes are scored as one batch; prefills one request at a time, in chunks of queries so the
[Q, H_I, S] score tensor stays bounded. Not here: the projections and RoPE
(``layers/indexer.py``, ``layers/mla.py``), Triton kernels, and the twin
(``attention/reference_mla.py``: ``indexer_topk``, ``sparse_mla_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnserve.attention.backend import AttentionBackend
from attnserve.attention.backends.torch_mla import read_latent, scatter_rows, write_latent_rows
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.kvcache.fp8 import (
    hadamard,
    indexer_fp8_views,
    quantize_act_fp8,
    quantize_indexer_fp8,
)

__all__ = [
    "TorchMLASparseBackend",
    "TorchMLASparseMetadata",
    "attend_sparse",
    "index_scores",
    "write_indexer_rows",
]

# Elements of one chunk's largest intermediate (index scores [Q, H_I, S] or gathered latent
# rows [T, K, L + R]): 2^24 float32 values = 64 MiB.
_CHUNK_ELEMENTS = 1 << 24


@dataclass(slots=True)
class TorchMLASparseMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 where nothing is written
    positions: torch.Tensor  # [T] int64 absolute position of each new token
    token_req: torch.Tensor  # [T] int64 the request each token belongs to
    key_slots: torch.Tensor  # [B, S_max] int64 cache row of each key position (0 = pad)
    num_decodes: int
    prefills: list[tuple[int, int, int, int]]  # (q_start, q_end, request, seq_len) per prefill


def write_indexer_rows(cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store indexer keys [T, D] (after k_norm and RoPE) at their slots (-1 skipped).

    Args:
        cache: [num_blocks, block_size, D] in a float dtype, or uint8
            [num_blocks, block_size, D + 4] (``quantize_indexer_fp8`` rows).
        k: [T, D] un-rotated keys.
        slot_mapping: [T] int64.
    """
    rows = quantize_indexer_fp8(k) if cache.dtype == torch.uint8 else k.to(cache.dtype)
    if rows.shape[-1] != cache.shape[-1]:
        raise ValueError(f"indexer rows of {rows.shape[-1]} do not fit a cache of {cache.shape[-1]}")
    scatter_rows(cache, rows, slot_mapping)


def index_scores(q: torch.Tensor, weights: torch.Tensor, key_rows: torch.Tensor) -> torch.Tensor:
    """Index scores of queries over raw indexer cache rows, float32, unmasked.

    Args:
        q: [B, Q, H, D] queries after RoPE (un-rotated).
        weights: [B, Q, H] raw ``weights_proj(x)``.
        key_rows: [B, S, D] keys in a float dtype (exact scores), or uint8 [B, S, D + 4] fp8
            rows (DeepSeek's fp8 scores: q is rotated and quantised here).
    Returns:
        [B, Q, S] float32.
    """
    b, nq, heads, dim = q.shape
    if key_rows.dtype == torch.uint8:
        k8, k_scale = indexer_fp8_views(key_rows.contiguous())  # [B, S, D], [B, S]
        q8, q_scale = quantize_act_fp8(hadamard(q))  # [B, Q, H, D], [B, Q, H]
        logits = torch.relu(q8.view(b, nq * heads, dim) @ k8.float().transpose(1, 2))
        w = weights.float() * heads**-0.5 * q_scale * dim**-0.5  # [B, Q, H]
        out = w.view(b, nq, 1, heads) @ logits.view(b, nq, heads, -1)  # [B, Q, 1, S]
        return out.squeeze(-2) * k_scale[:, None, :]
    dots = q.float().view(b, nq * heads, dim) @ key_rows.float().transpose(1, 2)  # [B, Q*H, S]
    dots = torch.relu(dots * dim**-0.5)
    w = weights.float() * heads**-0.5  # [B, Q, H]
    out = w.view(b, nq, 1, heads) @ dots.view(b, nq, heads, -1)  # [B, Q, 1, S]
    return out.squeeze(-2)


def _topk(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """[..., S] scores and visibility -> [..., topk] int32 best positions, -1 past the valid."""
    scores = scores.masked_fill(~visible, float("-inf"))
    k = min(topk, scores.shape[-1])
    best, idx = scores.topk(k, dim=-1)
    idx = torch.where(torch.isneginf(best), -1, idx).to(torch.int32)
    if k == topk:
        return idx
    pad = idx.new_full((*idx.shape[:-1], topk - k), -1)
    return torch.cat([idx, pad], dim=-1)


def attend_sparse(
    q: torch.Tensor, latent: torch.Tensor, valid: torch.Tensor, w_kv_b: torch.Tensor, scale: float
) -> torch.Tensor:
    """Absorbed MLA of each query over its own selected latent rows.

    Args:
        q: [T, H, d_nope + R] (``q_nope`` then rotated ``q_pe``).
        latent: [T, K, L + R] the selected rows of each query, in q's dtype.
        valid: [T, K] bool: the slot holds a selected key (False for -1 slots).
        w_kv_b: [H, d_nope + d_v, L] (``kv_b_proj``: W_UK rows, then W_UV rows).
        scale: softmax scale (the dense MLA one).
    Returns:
        [T, H, d_v]; 0 for a query with no valid slot.
    """
    kv_lora_rank = w_kv_b.shape[-1]
    d_nope = q.shape[-1] - (latent.shape[-1] - kv_lora_rank)
    w_uk, w_uv = w_kv_b[:, :d_nope], w_kv_b[:, d_nope:]
    q_latent = torch.einsum("thd,hdl->thl", q[..., :d_nope], w_uk)  # [T, H, L]
    q_abs = torch.cat([q_latent, q[..., d_nope:]], dim=-1)  # [T, H, L + R]
    scores = (q_abs @ latent.transpose(1, 2)).float() * scale  # [T, H, K]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0).to(q.dtype)  # all -1: NaN -> 0
    u = probs @ latent[..., :kv_lora_rank]  # [T, H, L]
    return torch.einsum("thl,hvl->thv", u, w_uv)


def _chunks(total: int, per_item: int):
    """(start, end) ranges over ``total`` items so a chunk holds about ``_CHUNK_ELEMENTS``."""
    step = max(1, _CHUNK_ELEMENTS // max(per_item, 1))
    for start in range(0, total, step):
        yield start, min(start + step, total)


def write_and_attend(backend, layer, q: torch.Tensor, k: torch.Tensor, kv_cache, metadata,
                     topk_indices: torch.Tensor | None) -> torch.Tensor:
    """The sparse-MLA backends' ``forward``: write the step's new latent rows ``k``, then run the
    backend's ``attend`` over the selected rows (the host-latent wrapper calls ``attend`` alone,
    over its staged rows).

    ``q``, ``k`` and the result have TORCH_MLA's meanings; ``topk_indices`` [T, K] holds absolute
    positions (-1 unused) from ``select_topk`` or, on a GLM-5 "shared" layer, from the previous
    full layer. Returns [T, H, d_v] in q's dtype.
    """
    if topk_indices is None:
        raise ValueError(f"{backend.name} attends over top-k indices: pass topk_indices")
    cache = kv_cache["latent"]
    write_latent_rows(cache, k, metadata.slot_mapping, layer.kv_lora_rank)
    return backend.attend(layer, q, cache, metadata, topk_indices)


class TorchMLASparseBackend(AttentionBackend):
    name = "TORCH_MLA_SPARSE"

    def build_metadata(
        self, common: CommonAttentionMetadata, group_id: int
    ) -> TorchMLASparseMetadata:
        bt = common.block_tables[group_id]
        dev, bs = bt.device, self.block_size
        pos = torch.arange(common.max_seq_len, device=dev)
        index = (pos // bs).clamp(max=bt.shape[1] - 1).expand(common.num_reqs, -1)
        blocks = bt.long().gather(1, index)  # [B, S_max]
        valid = pos[None, :] < torch.tensor(common.seq_lens_cpu, device=dev)[:, None]
        key_slots = torch.where(valid, blocks * bs + pos % bs, 0)
        query_lens = torch.tensor(common.query_lens_cpu, device=dev)
        token_req = torch.repeat_interleave(torch.arange(common.num_reqs, device=dev), query_lens)
        q = common.query_start_loc_cpu
        prefills = [
            (q[i], q[i + 1], i, common.seq_lens_cpu[i])
            for i in range(common.num_decodes, common.num_reqs)
        ]
        return TorchMLASparseMetadata(
            slot_mapping=common.slot_mappings[group_id],
            positions=common.positions.long(),
            token_req=token_req,
            key_slots=key_slots,
            num_decodes=common.num_decodes,
            prefills=prefills,
        )

    def select_topk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        weights: torch.Tensor,
        kv_cache: dict[str, torch.Tensor],
        metadata: TorchMLASparseMetadata,
        *,
        topk: int,
    ) -> torch.Tensor:
        """Store the new indexer keys and pick each new token's top-k keys.

        Args:
            q: [T, H_I, D] indexer queries after RoPE; k: [T, D] new keys after k_norm and RoPE.
            weights: [T, H_I] raw ``weights_proj(x)`` (float32).
            kv_cache: the layer's caches; ``"indexer"`` is read and written.
            metadata: what ``build_metadata`` returned for the layer's group.
            topk: the output width (``index_topk``).
        Returns:
            [T, topk] int32 absolute positions, best first; -1 beyond the valid keys.
        """
        cache = kv_cache["indexer"]
        write_indexer_rows(cache, k, metadata.slot_mapping)
        flat = cache.view(-1, cache.shape[-1])
        out = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
        pos = metadata.positions
        nd = metadata.num_decodes
        heads = q.shape[1]
        key_pos = torch.arange(metadata.key_slots.shape[1], device=q.device)
        for a, b in _chunks(nd, heads * key_pos.numel()):  # decodes, batched
            rows = flat[metadata.key_slots[a:b]]  # [b - a, S_max, W]
            scores = index_scores(q[a:b, None], weights[a:b, None], rows)[:, 0]  # [b - a, S_max]
            out[a:b] = _topk(scores, key_pos[None, :] <= pos[a:b, None], topk)
        for start, end, req, seq_len in metadata.prefills:
            rows = flat[metadata.key_slots[req, :seq_len]][None]  # [1, S, W]
            key_pos = torch.arange(seq_len, device=q.device)
            for a, b in _chunks(end - start, heads * seq_len):
                a, b = start + a, start + b
                scores = index_scores(q[None, a:b], weights[None, a:b], rows)[0]  # [Q, S]
                out[a:b] = _topk(scores, key_pos[None, :] <= pos[a:b, None], topk)
        return out

    def forward(self, layer, q, k, v, kv_cache, metadata: TorchMLASparseMetadata, *,
                topk_indices: torch.Tensor | None = None) -> torch.Tensor:
        return write_and_attend(self, layer, q, k, kv_cache, metadata, topk_indices)

    def attend(
        self,
        layer,
        q: torch.Tensor,
        cache: torch.Tensor,
        metadata: TorchMLASparseMetadata,
        topk_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Sparse MLA over latent rows already in ``cache`` (``forward`` without the write):
        [T, H, d_nope + R] queries, [T, K] positions -> [T, H, d_v]."""
        rank, rope = layer.kv_lora_rank, layer.qk_rope_head_dim
        w_kv_b = layer.w_kv_b.to(q.dtype)
        out = q.new_empty(q.shape[0], q.shape[1], w_kv_b.shape[1] - layer.qk_nope_head_dim)
        idx = topk_indices.long()
        valid = idx >= 0
        for a, b in _chunks(q.shape[0], idx.shape[1] * (rank + rope)):
            slots = metadata.key_slots[metadata.token_req[a:b, None], idx[a:b].clamp(min=0)]
            latent = read_latent(cache, slots, rank, rope, q.dtype)  # [t, K, L + R]
            out[a:b] = attend_sparse(q[a:b], latent, valid[a:b], w_kv_b, layer.scale)
        return out
