"""TORCH_MLA: dense MLA over the paged latent cache with PyTorch on any device.

Each new token's latent row ``[c_kv ; k_pe]`` (after ``kv_a_layernorm`` and RoPE) is written
to its slot, in the model dtype or in the 656-byte fp8 layout of ``kvcache/fp8.py``. Then:

- decodes (one new token) run in the absorbed ("MQA") form, batched: the query becomes
  ``[W_UK^T q_nope ; q_pe]`` (``kv_lora_rank + rope`` wide), attends over the raw latent rows
  as a single KV head whose value is the first ``kv_lora_rank`` dims, and ``W_UV`` maps the
  result back to per-head values;
- prefills (a whole prompt, a chunk over earlier chunks, or a prompt after a prefix-cache
  hit) run in the expanded ("MHA") form, one request at a time (``prefill_expanded``): every
  cached latent of the sequence, earlier chunks included, is expanded through ``kv_b_proj``
  into per-head K/V. Past ``context_chunk`` keys the context is expanded a chunk at a time
  into a bounded workspace, each chunk's attention kept with its log-sum-exp
  (``attention_lse``) and the partials merged (``merge_partials``), as vLLM's chunked-context
  MLA prefill does: the memory of a prefill no longer grows with its context.

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
    "attention_lse",
    "context_chunk",
    "merge_partials",
    "pack_latent_rows",
    "prefill_expanded",
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


# Elements of the largest tensors one context chunk of the expanded prefill holds at once: its
# K/V expanded through kv_b_proj (d_nope + d_v per head and key), its K with k_pe and its V padded
# to K's width (the fused kernels take one head size). 2^28 in bf16 is 512 MiB: DeepSeek-V3's
# 128 heads get chunks of 3,072 keys, 16 heads (TP 8) 26,624. A prefill's context beyond one
# chunk costs time, not memory.
_CONTEXT_ELEMENTS = 1 << 28
_CHUNK_ALIGN = 256


def context_chunk(num_heads: int, head_size: int, nope_dim: int, v_dim: int) -> int:
    """Keys of the context one chunk of ``prefill_expanded`` expands at a time (a multiple of 256)."""
    per_key = num_heads * (nope_dim + v_dim + 2 * max(head_size, v_dim))
    return max(_CHUNK_ALIGN, _CONTEXT_ELEMENTS // per_key // _CHUNK_ALIGN * _CHUNK_ALIGN)


def _math_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """``attention_lse`` in plain PyTorch (the twin of the fused kernels, and their fallback):
    query rows in chunks that bound the [B, H, rows, S] float32 scores at 2^24 elements."""
    b, h, q_len, _ = q.shape
    s_len = k.shape[2]
    out = q.new_empty(b, h, q_len, v.shape[-1], dtype=torch.float32)
    lse = q.new_empty(b, h, q_len, dtype=torch.float32)
    step = max(1, (1 << 24) // max(1, b * h * s_len))
    for a in range(0, q_len, step):
        e = min(a + step, q_len)
        scores = torch.matmul(q[:, :, a:e].float(), k.float().transpose(-1, -2)) * scale
        if causal:  # square causal block: query i sees keys 0..i (top-left aligned, as the kernels)
            seen = torch.arange(s_len, device=q.device)[None, :] <= torch.arange(a, e, device=q.device)[:, None]
            scores = scores.masked_fill(~seen, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)
        out[:, :, a:e] = torch.matmul(torch.exp(scores - row_lse[..., None]), v.float())
        lse[:, :, a:e] = row_lse
    return out, lse


def _fused_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """PyTorch's fused attention kernels that also return the log-sum-exp (their SDPA does
    not): flash attention (fp16/bf16, one head size: V is padded) where it runs, else the
    memory-efficient kernel on CUDA. None where neither takes the call."""
    d, dv = k.shape[-1], v.shape[-1]
    if q.device.type == "cpu":
        if dv != d:  # zero columns of V add zero columns to the output
            v = F.pad(v, (0, d - dv)) if dv < d else v
            if dv > d:  # zero columns of q and K add nothing to the scores
                q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]
        return out[..., :dv], lse
    if q.device.type == "cuda":
        if q.dtype in (torch.float16, torch.bfloat16) and max(d, dv) <= 256:
            width = max(d, dv)
            qp, kp, vp = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t for t in (q, k, v))
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qp, kp, vp, 0.0, causal, False,
                                                                          scale=scale)[:2]
            return out[..., :dv], lse
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                          scale=scale)[:2]
        return out, lse[..., : q.shape[2]]
    return None


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False,
                  *, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and each query row's log-sum-exp of its scaled scores (natural log).

    Args:
        q: [B, H, Q, D]; k: [B, H, S, D]; v: [B, H, S, Dv], one dtype.
        scale: softmax scale.
        causal: query i sees keys 0..i (a square block: Q == S); else every key.
        fused: False runs the PyTorch math twin (what the tests compare the kernels against).
    Returns:
        out [B, H, Q, Dv] (q's dtype from a fused kernel, float32 from the twin) and
        lse [B, H, Q] float32.
    """
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"a causal block is square: {q.shape[2]} queries over {k.shape[2]} keys")
    if fused:
        try:
            result = _fused_lse(q, k, v, scale, causal)
        except torch.OutOfMemoryError:  # a memory failure is the plan's to answer, not a fallback's
            raise
        except (RuntimeError, NotImplementedError):  # a shape or dtype the kernels do not take
            result = None
        if result is not None:
            return result
    return _math_lse(q, k, v, scale, causal)


def merge_partials(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold the attention ``part`` over more keys into ``out`` in place, by their log-sum-exps:
    ``out`` [..., Q, Dv] float32 and ``lse`` [..., Q] float32 become those over both key sets."""
    new = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - new)[..., None]).add_(part.float() * torch.exp(part_lse - new)[..., None])
    lse.copy_(new)


def _expand(latent: torch.Tensor, w_kv_b: torch.Tensor, d_nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows [S, L + R] -> per-head K [H, S, d_nope + R] and V [H, S, d_v]."""
    num_heads, kv_lora_rank = w_kv_b.shape[0], w_kv_b.shape[-1]
    kv = F.linear(latent[:, :kv_lora_rank], w_kv_b.reshape(-1, kv_lora_rank)).view(latent.shape[0], num_heads, -1)
    k_pe = latent[:, None, kv_lora_rank:].expand(-1, num_heads, -1)
    k = torch.cat([kv[..., :d_nope], k_pe], dim=-1).transpose(0, 1)
    return k, kv[..., d_nope:].transpose(0, 1)


def prefill_expanded(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    kv_lora_rank: int,
    rope_dim: int,
    w_kv_b: torch.Tensor,
    scale: float,
    chunk: int | None = None,
) -> torch.Tensor:
    """One request's prefill in the expanded form, the context in chunks of bounded memory.

    Args:
        q: [Q, H, d_nope + R] the request's new tokens, the last Q of its keys.
        cache: the paged latent cache; slots: [S] its keys' cache rows in position order (S >= Q).
        kv_lora_rank, rope_dim: L and R; w_kv_b: [H, d_nope + d_v, L] in q's dtype.
        scale: softmax scale.
        chunk: context keys expanded at a time (default ``context_chunk`` of the layer's shape).
    Returns:
        [Q, H, d_v] in q's dtype. At most ``chunk`` keys (the new ones aside) it is
        ``attend_expanded`` over all keys at once; past that, the new tokens attend causally among
        themselves and to each context chunk, and the partials merge by their log-sum-exps.
    """
    q_len, num_heads = q.shape[:2]
    d_nope = q.shape[-1] - rope_dim
    d_v = w_kv_b.shape[1] - d_nope
    s_len = slots.shape[0]
    chunk = chunk or context_chunk(num_heads, q.shape[-1], d_nope, d_v)
    context = s_len - q_len
    if context <= chunk:
        latent = read_latent(cache, slots, kv_lora_rank, rope_dim, q.dtype)[None]  # [1, S, L + R]
        return attend_expanded(q[None], latent, None, w_kv_b, scale)[0]
    qh = q.transpose(0, 1)[None]  # [1, H, Q, dq]
    k, v = _expand(read_latent(cache, slots[context:], kv_lora_rank, rope_dim, q.dtype), w_kv_b, d_nope)
    part, lse = attention_lse(qh, k[None], v[None], scale, causal=True)
    out = part.float()
    for a in range(0, context, chunk):
        k, v = _expand(read_latent(cache, slots[a : min(a + chunk, context)], kv_lora_rank, rope_dim, q.dtype),
                       w_kv_b, d_nope)
        part, part_lse = attention_lse(qh, k[None], v[None], scale)
        merge_partials(out, lse, part, part_lse)
        del k, v, part, part_lse
    return out[0].transpose(0, 1).to(q.dtype)


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
            out[start:end] = prefill_expanded(q[start:end], cache, slots, rank, rope, w_kv_b, layer.scale)
        return out
