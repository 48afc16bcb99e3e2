"""Pure-PyTorch paged attention: the oracle twin every fast backend is tested against.

Plain loops over requests, float32 arithmetic, no tricks. Slow on purpose: it is written to
be obviously right, not fast. Layout of the paged cache (the contract of every standard
backend): ``key_cache [num_blocks, block_size, num_kv_heads, head_size]`` and ``value_cache
[num_blocks, block_size, num_kv_heads, head_size_v]``; block 0 is the null block.
"""

from __future__ import annotations

import math

import torch

__all__ = ["alibi_slopes", "gather_kv", "paged_attention", "write_kv"]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi slopes for any head count (Press et al.; non-powers of two interleave a second
    geometric series, as BLOOM and MPT do)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra_base ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store new K/V [num_tokens, num_kv_heads, D] at their slots (``-1`` slots are skipped)."""
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kq = (k[keep].float() / k_scale).to(key_cache.dtype)
    vq = (v[keep].float() / v_scale).to(value_cache.dtype)
    if key_cache.dtype == torch.float8_e4m3fn:  # index float8 through its bytes
        key_cache.view(torch.uint8)[blocks, offsets] = kq.view(torch.uint8)
        value_cache.view(torch.uint8)[blocks, offsets] = vq.view(torch.uint8)
    else:
        key_cache[blocks, offsets] = kq
        value_cache[blocks, offsets] = vq


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int, scale: float = 1.0) -> torch.Tensor:
    """[seq_len, num_kv_heads, D] float32 of one sequence, position order."""
    block_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blocks = block_table_row.long()[pos // block_size]
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8)[blocks, pos % block_size].view(cache.dtype).float() * scale
    return cache[blocks, pos % block_size].float() * scale


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, *,
                    scale: float, window: int | None = None, alibi: torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None, softcap: float | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0,
                    positions: torch.Tensor | None = None, key_positions: list[torch.Tensor] | None = None,
                    ) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached sequence.

    Args:
        q: [num_tokens, num_heads, head_size]; request i owns rows
            ``query_start_loc[i]:query_start_loc[i+1]``, the last tokens of its sequence.
        window: keys visible to a query, itself included (``pos_q - pos_k < window``).
        alibi: [num_heads] slopes; the bias is ``-slope * (pos_q - pos_k)``.
        sinks: [num_heads] learned logits that join the softmax denominator only.
        softcap: scores become ``softcap * tanh(scores / softcap)`` before masking.
        k_scale, v_scale: dequantisation scales of an fp8 cache.
        positions, key_positions: override the positions used for masks and biases (StreamingLLM
            caches whose slots are not sequence positions); default: slot order.
    Returns:
        [num_tokens, num_heads, head_size_v] in q's dtype.
    """
    num_heads = q.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape[0], num_heads, value_cache.shape[-1], dtype=q.dtype, device=q.device)
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        k = gather_kv(key_cache, block_table[i], seq_len, k_scale)  # [S, Hkv, D]
        v = gather_kv(value_cache, block_table[i], seq_len, v_scale)
        k = k.repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.repeat_interleave(group, dim=1)
        qi = q[start:end].float()  # [Q, H, D]
        if key_positions is not None:
            kpos = key_positions[i].to(q.device)
            qpos = positions[start:end].to(q.device)
        else:
            kpos = torch.arange(seq_len, device=q.device)
            qpos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale  # [H, Q, S]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        dist = (qpos[:, None] - kpos[None, :]).float()  # [Q, S]
        if alibi is not None:
            scores = scores - alibi.float().view(-1, 1, 1) * dist
        mask = dist < 0
        if window is not None:
            mask |= dist >= window
        scores = scores.masked_fill(mask, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
