"""StreamingLLM attention (Xiao et al., 2023): attention sinks plus a window, positions in the cache.

A sequence keeps its first ``sinks`` tokens and its last ``window``; a query at position p sees
sink keys and keys with ``p - p_k < window``. Positions are those *within the cache*: the E
tokens dropped between the sinks and the window are not counted, so a sink key sits E
positions closer to the query than in the text. Keys are cached rotated at their text
positions and RoPE is relative, so window keys need no change; only sink keys are rotated E
further (and ALiBi's distance to them shortened by E), with E computed per query. Used by the
PyTorch backends; not a backend itself.
"""

from __future__ import annotations

import torch

__all__ = ["attend_streaming", "dropped_before"]


def dropped_before(qpos: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """E per query: tokens between the sinks and the window of a query at ``qpos``."""
    return torch.clamp(qpos - window + 1 - sinks, min=0)


def attend_streaming(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, qpos: torch.Tensor,
                     layer) -> torch.Tensor:
    """One request.

    Args:
        q: [Q, H, D] queries at positions ``qpos`` [Q]; keys, vals: [S, Hkv, D(v)], position
            order (dropped blocks hold zeros and are masked out).
        layer: scale, streaming (sinks, window), rotary_emb (or None without RoPE),
            alibi_slopes, softcap, sinks (learned sink logits; unrelated to StreamingLLM's).
    Returns:
        [Q, H, Dv].
    """
    sinks, window = layer.streaming
    num_q, heads, _ = q.shape
    s_len = keys.shape[0]
    group = heads // keys.shape[1]
    kpos = torch.arange(s_len, device=q.device)
    drop = dropped_before(qpos, sinks, window)  # [Q]
    n_sink = min(sinks, s_len)
    kf = keys.float().repeat_interleave(group, dim=1)  # [S, H, D]
    vf = vals.float().repeat_interleave(group, dim=1)
    qf = q.float()
    scores = torch.einsum("qhd,khd->hqk", qf, kf)  # [H, Q, S]
    if n_sink and layer.rotary_emb is not None:
        # sink keys seen from each query: rotated E_q positions further (R(E) R(p) k = R(p + E) k)
        shifted = keys[:n_sink].unsqueeze(0).expand(num_q, -1, -1, -1).reshape(num_q * n_sink, *keys.shape[1:])
        pos = drop.repeat_interleave(n_sink)
        _, shifted = layer.rotary_emb(pos, shifted[:, :1].expand(-1, heads, -1).contiguous(), shifted)
        shifted = shifted.view(num_q, n_sink, *keys.shape[1:]).float().repeat_interleave(group, dim=2)
        scores[:, :, :n_sink] = torch.einsum("qhd,qkhd->hqk", qf, shifted)
    scores = scores * layer.scale
    if layer.softcap is not None:
        scores = layer.softcap * torch.tanh(scores / layer.softcap)
    dist = qpos[:, None] - kpos[None, :]  # [Q, S] text distance
    visible = (dist >= 0) & ((kpos[None, :] < sinks) | (dist < window))
    if layer.alibi_slopes is not None:
        cache_dist = dist - torch.where(kpos[None, :] < sinks, drop[:, None], 0)
        scores = scores - layer.alibi_slopes.float().view(-1, 1, 1) * cache_dist[None].float()
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if layer.sinks is not None:
        sink = layer.sinks.float().view(-1, 1, 1).expand(-1, num_q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)
