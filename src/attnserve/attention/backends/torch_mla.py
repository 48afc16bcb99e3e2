"""TORCH_MLA: dense MLA over the paged latent cache with PyTorch on any device.

Each new token's latent row ``[c_kv ; k_pe]`` (after ``kv_a_layernorm`` and RoPE) is written
to its slot, in the model dtype or in the 656-byte fp8 layout of ``kvcache/fp8.py``. Then:

- decodes (one new token) run in the absorbed ("MQA") form, batched: the query becomes
  ``[W_UK^T q_nope ; q_pe]`` (``kv_lora_rank + rope`` wide), attends over the raw latent rows
  as a single KV head whose value is the first ``kv_lora_rank`` dims, and ``W_UV`` maps the
  result back to per-head values;
- prefills (a whole prompt, a chunk over earlier chunks, or a prompt after a prefix-cache
  hit) run in the expanded ("MHA") form, one request at a time: every cached latent of the
  sequence, earlier chunks included, is expanded through ``kv_b_proj`` into per-head K/V.

Both forms read the latents back from the cache, so an fp8 cache is seen the same way by
every token. The arguments follow the backend contract with MLA meanings: ``q`` is
``[T, H, d_nope + R]`` (``q_nope`` then rotated ``q_pe``), ``k`` is the new latent rows
``[T, kv_lora_rank + R]``, ``v`` is None. The layer gives ``scale``, ``kv_lora_rank``,
``qk_rope_head_dim`` and ``w_kv_b`` (``kv_b_proj`` as [H, d_nope + d_v, kv_lora_rank]).
Not here: sparse (DSA) MLA, the projections (``layers/mla.py``), Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnserve.attention.backend import AttentionBackend
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.kvcache.fp8 import dequantize_mla_fp8, quantize_mla_fp8

__all__ = [
    "TorchMLABackend",
    "TorchMLAMetadata",
    "attend_absorbed",
    "attend_expanded",
    "pack_latent_rows",
    "read_latent",
    "scatter_rows",
    "write_latent_rows",
]


@dataclass(slots=True)
class TorchMLAMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 where nothing is written
    num_decodes: int
    decode_slots: torch.Tensor | None  # [B_dec, S_max] cache rows of each decode's keys (0 = pad)
    decode_valid: torch.Tensor | None  # [B_dec, S_max] bool: the key exists
    prefills: list[tuple[int, int, torch.Tensor]]  # (q_start, q_end, slots [S]) per prefill


def write_latent_rows(
    cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor, kv_lora_rank: int
) -> None:
    """Store latent rows [T, L + R] at their slots (-1 skipped).

    Args:
        cache: [num_blocks, block_size, L + R] in a float dtype, or uint8
            [num_blocks, block_size, fp8 row bytes] (``quantize_mla_fp8`` rows).
        rows: [T, L + R] ``c_kv`` after its norm, then ``k_pe`` after RoPE.
        slot_mapping: [T] int64.
        kv_lora_rank: L.
    """
    scatter_rows(cache, pack_latent_rows(rows, cache, kv_lora_rank), slot_mapping)


def scatter_rows(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``rows`` [T, W] (already in the cache's dtype and row width) at their slots of a
    paged cache [num_blocks, block_size, W]; slot -1 writes nothing.

    No boolean indexing (its size is data, which a CUDA graph cannot replay): a row with slot -1
    rewrites slot 0, a row of the null block that no token owns, with what it holds.
    """
    flat = cache.view(-1, cache.shape[-1])  # [num_slots, row width]
    slots = slot_mapping.clamp(min=0)
    flat.index_copy_(0, slots, torch.where((slot_mapping >= 0)[:, None], rows, flat.index_select(0, slots)))


def pack_latent_rows(rows: torch.Tensor, cache: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """Latent rows [T, L + R] as ``cache`` stores them: its dtype, or fp8 rows for a uint8 cache
    (computed on ``rows``' device, whatever device ``cache`` is on)."""
    if cache.dtype == torch.uint8:
        packed = quantize_mla_fp8(rows[:, :kv_lora_rank], rows[:, kv_lora_rank:])
    else:
        packed = rows.to(cache.dtype)
    if packed.shape[-1] != cache.shape[-1]:
        raise ValueError(
            f"latent rows of {packed.shape[-1]} do not fit a cache of {cache.shape[-1]}"
        )
    return packed


def read_latent(
    cache: torch.Tensor, slots: torch.Tensor, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows of the cache at ``slots`` [...] as [..., L + R] in ``dtype`` (fp8 dequantised)."""
    flat = cache.view(-1, cache.shape[-1])
    rows = flat[slots]
    if cache.dtype != torch.uint8:
        return rows.to(dtype)
    c_kv, k_pe = dequantize_mla_fp8(rows, kv_lora_rank, rope_dim)
    return torch.cat([c_kv, k_pe], dim=-1).to(dtype)


def _mask_or_causal(mask: torch.Tensor | None, q_len: int, s_len: int, device) -> dict:
    """SDPA masking arguments; ``None`` means causal with the queries as the last positions."""
    if mask is not None:
        return {"attn_mask": mask[:, None]}  # [B, 1, Q, S]
    if q_len == s_len:
        return {"is_causal": True}
    qpos = torch.arange(s_len - q_len, s_len, device=device)
    causal = torch.arange(s_len, device=device)[None, :] <= qpos[:, None]  # [Q, S]
    return {"attn_mask": causal}


def attend_absorbed(
    q: torch.Tensor,
    latent: torch.Tensor,
    mask: torch.Tensor | None,
    w_kv_b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """MLA in the absorbed form: one latent KV head, ``kv_lora_rank + R`` wide.

    Args:
        q: [B, Q, H, d_nope + R] (``q_nope`` then rotated ``q_pe``).
        latent: [B, S, L + R] latent rows of each sequence, in q's dtype.
        mask: [B, Q, S] bool keys each query may see; None: causal, queries last.
        w_kv_b: [H, d_nope + d_v, L] (``kv_b_proj``: W_UK rows, then W_UV rows).
        scale: softmax scale.
    Returns:
        [B, Q, H, d_v] per-head outputs before o_proj.
    """
    kv_lora_rank = w_kv_b.shape[-1]
    d_nope = q.shape[-1] - (latent.shape[-1] - kv_lora_rank)
    w_uk, w_uv = w_kv_b[:, :d_nope], w_kv_b[:, d_nope:]
    q_nope, q_pe = q[..., :d_nope], q[..., d_nope:]
    b, q_len, heads = q.shape[:3]
    s_len = latent.shape[1]
    q_latent = torch.einsum("bqhd,hdl->bqhl", q_nope, w_uk)  # [B, Q, H, L]
    # one latent KV head: fold the heads into the query rows, so the keys are never repeated
    # per head (SDPA's enable_gqa would materialise H copies of them on some devices)
    q_abs = torch.cat([q_latent, q_pe], dim=-1).transpose(1, 2).reshape(b, 1, heads * q_len, -1)  # [B, 1, H*Q, L+R]
    keys = latent[:, None]  # [B, 1, S, L + R]
    if mask is None and q_len > 1:
        qpos = torch.arange(s_len - q_len, s_len, device=q.device)
        mask = (torch.arange(s_len, device=q.device)[None, :] <= qpos[:, None]).expand(b, q_len, s_len)
    attn_mask = None
    if mask is not None:  # [B, Q, S] -> [B, 1, H*Q, S], rows in the same (head, query) order
        attn_mask = mask[:, None].expand(b, heads, q_len, s_len).reshape(b, 1, heads * q_len, s_len)
    u = F.scaled_dot_product_attention(q_abs, keys, keys[..., :kv_lora_rank], attn_mask=attn_mask,
                                       scale=scale)  # [B, 1, H*Q, L]
    u = u.view(b, heads, q_len, kv_lora_rank)
    return torch.einsum("bhql,hvl->bqhv", u, w_uv)


def attend_expanded(
    q: torch.Tensor,
    latent: torch.Tensor,
    mask: torch.Tensor | None,
    w_kv_b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """MLA in the expanded form: per-head ``K = [W_UK c_kv ; k_pe]``, ``V = W_UV c_kv``.

    Same arguments and result as ``attend_absorbed``.
    """
    num_heads, kv_lora_rank = w_kv_b.shape[0], w_kv_b.shape[-1]
    d_nope = q.shape[-1] - (latent.shape[-1] - kv_lora_rank)
    b, s = latent.shape[:2]
    c_kv, k_pe = latent[..., :kv_lora_rank], latent[..., kv_lora_rank:]
    kv = F.linear(c_kv, w_kv_b.reshape(-1, kv_lora_rank))
    kv = kv.view(b, s, num_heads, w_kv_b.shape[1])  # [B, S, H, d_nope + d_v]
    k_nope, v = kv[..., :d_nope], kv[..., d_nope:]
    k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, num_heads, -1)], dim=-1)  # [B, S, H, dk]
    masking = _mask_or_causal(mask, q.shape[1], s, q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, **masking
    )  # [B, H, Q, d_v]
    return out.transpose(1, 2)


class TorchMLABackend(AttentionBackend):
    name = "TORCH_MLA"

    def _slots(self, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
        pos = torch.arange(seq_len, device=block_table_row.device)
        blocks = block_table_row.long()[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def build_metadata(self, common: CommonAttentionMetadata, group_id: int) -> TorchMLAMetadata:
        bt = common.block_tables[group_id]
        nd = common.num_decodes
        dec_slots = dec_valid = None
        if nd:
            lens = common.seq_lens_cpu[:nd]
            pos = torch.arange(max(lens), device=bt.device)
            index = (pos // self.block_size).clamp(max=bt.shape[1] - 1).expand(nd, -1)
            blocks = bt[:nd].long().gather(1, index)  # [B_dec, S_max]
            dec_valid = pos[None, :] < torch.tensor(lens, device=bt.device)[:, None]
            dec_slots = torch.where(dec_valid, blocks * self.block_size + pos % self.block_size, 0)
        q = common.query_start_loc_cpu
        prefills = [
            (q[i], q[i + 1], self._slots(bt[i], common.seq_lens_cpu[i]))
            for i in range(nd, common.num_reqs)
        ]
        return TorchMLAMetadata(common.slot_mappings[group_id], nd, dec_slots, dec_valid, prefills)

    def forward(self, layer, q, k, v, kv_cache, metadata: TorchMLAMetadata) -> torch.Tensor:
        """Write the new latent rows ``k`` and attend; returns [T, H, d_v] in q's dtype."""
        cache = kv_cache["latent"]
        rank, rope = layer.kv_lora_rank, layer.qk_rope_head_dim
        write_latent_rows(cache, k, metadata.slot_mapping, rank)
        w_kv_b = layer.w_kv_b.to(q.dtype)
        out = q.new_empty(q.shape[0], q.shape[1], w_kv_b.shape[1] - layer.qk_nope_head_dim)
        nd = metadata.num_decodes
        if nd:
            latent = read_latent(cache, metadata.decode_slots, rank, rope, q.dtype)  # [B, S, L+R]
            mask = metadata.decode_valid[:, None, :]  # [B, 1, S]
            out[:nd] = attend_absorbed(q[:nd, None], latent, mask, w_kv_b, layer.scale)[:, 0]
        for start, end, slots in metadata.prefills:
            latent = read_latent(cache, slots, rank, rope, q.dtype)[None]  # [1, S, L + R]
            o = attend_expanded(q[None, start:end], latent, None, w_kv_b, layer.scale)
            out[start:end] = o[0]
        return out
