"""Pure-PyTorch paged MLA, the DSA lightning indexer and sparse MLA: the oracle twins.

Plain loops over requests, float32 arithmetic, written to be obviously right, not fast; every
fast MLA / sparse-MLA backend is tested against these. Not a backend (no metadata, no
registry), not a model layer (no projections beyond ``kv_b_proj``'s two halves, no RoPE).

Paged layouts (block 0 is the null block; ``block_table [B, max_blocks]`` int32; position p of
request b lives in slot ``block_table[b, p // block_size] * block_size + p % block_size``):

- latent cache ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` in the model dtype
  (``c_kv`` after its norm, then ``k_pe`` after RoPE), or ``[num_blocks, block_size, 656]``
  uint8 in the fp8 layout of ``kvcache/fp8.py``;
- indexer cache ``[num_blocks, block_size, head_dim]`` in the model dtype, or
  ``[num_blocks, block_size, head_dim + 4]`` uint8 (Hadamard-rotated e4m3 + fp32 scale).

Weights: ``kv_b_proj`` viewed ``[H, d_nope + d_v, kv_lora_rank]`` splits into
``w_uk [H, d_nope, kv_lora_rank]`` and ``w_uv [H, d_v, kv_lora_rank]``.
"""

from __future__ import annotations

import torch

from attnserve.kvcache.fp8 import (
    FP8_TILE,
    dequantize_indexer_fp8,
    dequantize_mla_fp8,
    hadamard,
    indexer_fp8_views,
    quantize_act_fp8,
    quantize_indexer_fp8,
    quantize_mla_fp8,
)

__all__ = [
    "absorb_q",
    "apply_w_uv",
    "gather_indexer_keys",
    "gather_latent",
    "indexer_topk",
    "mla_decode_absorbed",
    "mla_prefill_expanded",
    "sparse_mla_attention",
    "write_indexer_keys",
    "write_latent",
]


# ----------------------------------------------------------------------------- paged storage


def _slots(
    cache: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept rows (slot >= 0) and their (block, offset) coordinates."""
    block_size = cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    return keep, slots // block_size, slots % block_size


def _rows_at(
    cache: torch.Tensor, block_table_row: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Raw cache rows (cache dtype) of logical positions [N] of one request."""
    block_size = cache.shape[1]
    positions = positions.long()
    blocks = block_table_row.long()[positions // block_size]
    return cache[blocks, positions % block_size]


def _decode_latent(rows: torch.Tensor, kv_lora_rank: int | None) -> torch.Tensor:
    """[N, kv_lora_rank + rope_dim] float32 from raw latent rows of either dtype."""
    if rows.dtype != torch.uint8:
        return rows.float()
    if kv_lora_rank is None:
        raise ValueError("an fp8 latent cache needs kv_lora_rank to be read")
    rope_bytes = rows.shape[-1] - kv_lora_rank - 4 * (kv_lora_rank // FP8_TILE)
    c_kv, k_pe = dequantize_mla_fp8(rows, kv_lora_rank, rope_bytes // 2)
    return torch.cat([c_kv, k_pe], dim=-1)


def write_latent(
    cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store latent rows ``[c_kv ; k_pe]`` of new tokens at their slots (-1 slots skipped).

    Args:
        cache: model-dtype ``[num_blocks, block_size, L + R]`` or fp8 uint8 rows.
        c_kv: [num_tokens, L] after kv_a_layernorm; k_pe: [num_tokens, R] after RoPE.
        slot_mapping: [num_tokens] int.
    """
    keep, blocks, offsets = _slots(cache, slot_mapping)
    if cache.dtype == torch.uint8:
        rows = quantize_mla_fp8(c_kv[keep], k_pe[keep])
    else:
        rows = torch.cat([c_kv[keep], k_pe[keep]], dim=-1).to(cache.dtype)
    if rows.shape[-1] != cache.shape[-1]:
        raise ValueError(f"latent rows of {rows.shape[-1]} do not fit a cache of {cache.shape[-1]}")
    cache[blocks, offsets] = rows


def gather_latent(
    cache: torch.Tensor,
    block_table_row: torch.Tensor,
    seq_len: int,
    *,
    kv_lora_rank: int | None = None,
) -> torch.Tensor:
    """[seq_len, L + R] float32 latent rows of one request, position order (fp8 dequantised;
    ``kv_lora_rank`` is required for an fp8 cache, whose row width alone is ambiguous)."""
    positions = torch.arange(seq_len, device=cache.device)
    return _decode_latent(_rows_at(cache, block_table_row, positions), kv_lora_rank)


def write_indexer_keys(cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store indexer keys [num_tokens, D] (after k_norm and RoPE); an fp8 cache gets
    ``quantize_indexer_fp8`` rows (Hadamard rotation, then e4m3 + scale)."""
    keep, blocks, offsets = _slots(cache, slot_mapping)
    if cache.dtype == torch.uint8:
        rows = quantize_indexer_fp8(k[keep])
    else:
        rows = k[keep].to(cache.dtype)
    if rows.shape[-1] != cache.shape[-1]:
        raise ValueError(
            f"indexer rows of {rows.shape[-1]} do not fit a cache of {cache.shape[-1]}"
        )
    cache[blocks, offsets] = rows


def gather_indexer_keys(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """[seq_len, D] float32 indexer keys of one request. Keys of an fp8 cache come back
    dequantised *in the Hadamard-rotated space* (apply ``hadamard`` to un-rotate them)."""
    rows = _rows_at(cache, block_table_row, torch.arange(seq_len, device=cache.device))
    return dequantize_indexer_fp8(rows) if cache.dtype == torch.uint8 else rows.float()


# ----------------------------------------------------------------------------- dense MLA


def absorb_q(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """MQA-form query ``[W_UK^T q_nope ; q_pe]``: [T, H, d_nope], [T, H, R] -> [T, H, L+R] fp32."""
    q_latent = torch.einsum("thd,hdl->thl", q_nope.float(), w_uk.float())  # [T, H, L]
    return torch.cat([q_latent, q_pe.float()], dim=-1)


def apply_w_uv(u: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Per-head value up-projection ``W_UV u``: [T, H, L] -> [T, H, d_v] float32."""
    return torch.einsum("thl,hvl->thv", u.float(), w_uv.float())


def _latent_attention(
    q_abs: torch.Tensor,
    latent: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    allowed: torch.Tensor | None,
) -> torch.Tensor:
    """Single-KV-head attention over latent rows: q [Q, H, L+R], rows [S, L+R] -> u [Q, H, L].

    ``allowed [Q, S]`` masks keys; a query with no allowed key gets u = 0.
    """
    scores = torch.einsum("qhc,sc->hqs", q_abs.float(), latent) * scale  # [H, Q, S]
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    return torch.einsum("hqs,sl->qhl", probs, latent[:, :kv_lora_rank])


def _causal(num_queries: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[Q, S] bool: queries are the last ``num_queries`` positions of the sequence."""
    qpos = torch.arange(seq_len - num_queries, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= qpos[:, None]


def mla_decode_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal MLA in the absorbed ("MQA") form over a paged latent cache.

    Args:
        q_nope: [T, H, d_nope]; q_pe: [T, H, R] (after RoPE). Request i owns rows
            ``query_start_loc[i]:query_start_loc[i+1]``, the last tokens of its sequence.
        latent_cache: model-dtype or fp8 latent cache (see the module docstring).
        block_table: [B, max_blocks]; seq_lens: [B] tokens in the cache after this step.
        w_uk: [H, d_nope, L]; w_uv: [H, d_v, L]; scale: the softmax scale (pass it explicitly).
    Returns:
        [T, H, d_v] per-head outputs before o_proj, in q_nope's dtype.
    """
    kv_lora_rank = w_uk.shape[-1]
    q_abs = absorb_q(q_nope, q_pe, w_uk)  # [T, H, L + R]
    out = torch.zeros(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1], device=q_nope.device)
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        latent = gather_latent(latent_cache, block_table[i], seq_len, kv_lora_rank=kv_lora_rank)
        allowed = _causal(end - start, seq_len, q_nope.device)
        u = _latent_attention(q_abs[start:end], latent, kv_lora_rank, scale, allowed)
        out[start:end] = apply_w_uv(u, w_uv)
    return out.to(q_nope.dtype)


def mla_prefill_expanded(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same result as ``mla_decode_absorbed`` through expanded per-head K/V ("MHA mode"):
    ``K = [W_UK c_kv ; k_pe]``, ``V = W_UV c_kv`` for every cached token. Same arguments and
    return value."""
    kv_lora_rank, num_heads = w_uk.shape[-1], q_nope.shape[1]
    q = torch.cat([q_nope.float(), q_pe.float()], dim=-1)  # [T, H, d_nope + R]
    out = torch.zeros(q.shape[0], num_heads, w_uv.shape[1], device=q.device)
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        latent = gather_latent(latent_cache, block_table[i], seq_len, kv_lora_rank=kv_lora_rank)
        c_kv, k_pe = latent[:, :kv_lora_rank], latent[:, kv_lora_rank:]
        k_nope = torch.einsum("sl,hdl->shd", c_kv, w_uk.float())  # [S, H, d_nope]
        v = torch.einsum("sl,hvl->shv", c_kv, w_uv.float())  # [S, H, d_v]
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, num_heads, -1)], dim=-1)  # [S, H, dk]
        scores = torch.einsum("qhd,shd->hqs", q[start:end], k) * scale  # [H, Q, S]
        allowed = _causal(end - start, seq_len, q.device)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out[start:end] = torch.einsum("hqs,shv->qhv", probs, v)
    return out.to(q_nope.dtype)


# ----------------------------------------------------------------------------- DSA


def _exact_index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """HF ``DeepseekV32Indexer`` scores: q [Q, H, D], w [Q, H], k [S, D] -> [Q, S]
    ``sum_h (w * H^-0.5) * relu(D^-0.5 * q.k)``, in the same operation order."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    scores = torch.relu(torch.matmul(q.float(), k.float().T) * head_dim**-0.5)  # [Q, H, S]
    weights = w.float() * num_heads**-0.5  # [Q, H]
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [Q, S]


def _fp8_index_scores(
    q: torch.Tensor, w: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor
) -> torch.Tensor:
    """DeepSeek's fp8 scores (``kernel.py::fp8_index``): q is rotated and quantised here;
    k8 [S, D] are e4m3 values (as float) of rotated keys with scales k_scale [S]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    q8, q_scale = quantize_act_fp8(hadamard(q))  # [Q, H, D], [Q, H]
    weights = w.float() * num_heads**-0.5 * q_scale * head_dim**-0.5  # [Q, H]
    logits = torch.relu(torch.matmul(q8, k8.T))  # [Q, H, S]
    return torch.matmul(weights.unsqueeze(-2), logits).squeeze(-2) * k_scale  # [Q, S]


def _request_index_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    index_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    seq_len: int,
    fp8: bool,
) -> torch.Tensor:
    """Index scores [Q, S] of one request's queries over all its cached keys."""
    rows = _rows_at(index_cache, block_table_row, torch.arange(seq_len, device=q.device))
    stored_fp8 = index_cache.dtype == torch.uint8
    if fp8:
        if stored_fp8:
            values, k_scale = indexer_fp8_views(rows.contiguous())
            return _fp8_index_scores(q, w, values.float(), k_scale)
        k8, k_scale = quantize_act_fp8(hadamard(rows))
        return _fp8_index_scores(q, w, k8, k_scale)
    if stored_fp8:
        # Keys were stored rotated: rotate q too, the dot products are unchanged.
        return _exact_index_scores(hadamard(q.float()), w, dequantize_indexer_fp8(rows))
    return _exact_index_scores(q, w, rows)


def indexer_topk(
    q_idx: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    *,
    topk: int,
    fp8: bool,
) -> torch.Tensor:
    """The DSA lightning indexer: the top-k causal keys of every query token.

    Args:
        q_idx: [T, H_I, D] indexer queries after RoPE (un-rotated).
        weights: [T, H_I] raw ``weights_proj(x)``; the ``H_I^-0.5`` and ``D^-0.5`` scalings
            are applied here, as in transformers' ``DeepseekV32Indexer``.
        index_cache: model-dtype or fp8 indexer cache (see the module docstring).
        block_table, query_start_loc, seq_lens: as in ``mla_decode_absorbed``.
        positions: [T] absolute position of each query; key s is visible iff s <= pos(t).
        topk: output width.
        fp8: score as DeepSeek's deployed path does (Hadamard, then per-vector e4m3 of q and
            k; keys of a model-dtype cache are quantised on the fly); False: exact float32.
    Returns:
        [T, topk] int32 absolute positions, best first; -1 fills the slots beyond the
        ``min(pos(t) + 1, seq_len)`` valid keys. Never a future position.
    """
    out = torch.full((q_idx.shape[0], topk), -1, dtype=torch.int32, device=q_idx.device)
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[i], qsl[i + 1]
        if end == start or seq_len == 0:
            continue
        scores = _request_index_scores(
            q_idx[start:end], weights[start:end], index_cache, block_table[i], seq_len, fp8
        )  # [Q, S]
        key_pos = torch.arange(seq_len, device=scores.device)
        visible = key_pos[None, :] <= positions[start:end, None].to(scores.device)
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(topk, seq_len)
        best, idx = scores.topk(k, dim=-1)  # [Q, k]
        out[start:end, :k] = torch.where(torch.isneginf(best), -1, idx).to(torch.int32)
    return out


def sparse_mla_attention(
    q_absorbed: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    topk_indices: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    query_start_loc: torch.Tensor | None = None,
) -> torch.Tensor:
    """MQA-form MLA over only the selected latent rows of each query (FlashMLA sparse contract).

    Args:
        q_absorbed: [T, H, L + R] (``absorb_q``).
        latent_cache: model-dtype or fp8 latent cache.
        block_table: [B, max_blocks]. Without ``query_start_loc`` row t serves query t (a
            decode batch, B == T); with it, request i owns queries
            ``query_start_loc[i]:query_start_loc[i+1]``.
        topk_indices: [T, K] absolute positions; -1 marks an unused slot.
        kv_lora_rank: L; scale: softmax scale.
    Returns:
        [T, H, L] float32 ``u`` (apply ``apply_w_uv`` for per-head outputs); 0 for a query
        whose indices are all -1.
    """
    num_tokens = q_absorbed.shape[0]
    if query_start_loc is None:
        owner = torch.arange(num_tokens)
    else:
        counts = (query_start_loc[1:] - query_start_loc[:-1]).cpu()
        owner = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    out = torch.zeros(num_tokens, q_absorbed.shape[1], kv_lora_rank, device=q_absorbed.device)
    for t in range(num_tokens):
        idx = topk_indices[t]
        idx = idx[idx >= 0]
        if idx.numel() == 0:
            continue
        rows = _rows_at(latent_cache, block_table[int(owner[t])], idx)
        latent = _decode_latent(rows, kv_lora_rank)  # [K_valid, L + R]
        out[t] = _latent_attention(q_absorbed[t : t + 1], latent, kv_lora_rank, scale, None)[0]
    return out
