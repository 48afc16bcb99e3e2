"""MiniMax lightning attention: linear attention with a fixed per-head decay; block prefill, decode.

Per head h, with a state ``KV`` [dk, dv] and a decay ``lambda_h = exp(-s_h)``::

    KV <- lambda_h * KV + k_t^T v_t;  o_t = q_t KV    (= sum_{j<=t} lambda_h^(t-j) (q_t . k_j) v_j)

No softmax, no 1/sqrt(d) scale, no RoPE. Prefill works in blocks: inside a block a masked decay
matrix, across blocks the carried state read with ``lambda^(t+1)`` and updated with the key
decay ``lambda^(n-1-j)``; it equals the recurrence up to rounding.

Not here: the SiLU'd qkv projection, the RMSNorm over all heads, the sigmoid output gate. Pure
PyTorch, float32 arithmetic; states are read from and written back to a state pool.
"""

from __future__ import annotations

import torch

from attnserve.attention.state.conv import pad_varlen, read_states, unpad_varlen

__all__ = ["lightning_attention_decode", "lightning_attention_prefill", "lightning_decay_rates"]


def lightning_decay_rates(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """Per-head decay rates ``s_h`` of layer ``layer_idx`` (0-based) of ``num_layers``.

    ``s_h = 2^(-8 (h+1) / num_heads) * (1 - l / (L - 1 + 1e-5) + 1e-5)``, as MiniMax-Text-01 and
    the transformers port compute it (the 1e-5 inside the denominator keeps L = 1 finite). The
    per-token decay is ``exp(-s_h)``.

    Returns:
        [num_heads] float32.
    """
    heads = torch.arange(1, num_heads + 1, dtype=torch.float64)
    factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return (2.0 ** (-8.0 * heads / num_heads) * factor).float()


def _block_step(
    s: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cum: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block. s [B,H,dk,dv]; q, k [B,H,C,dk]; v [B,H,C,dv]; cum [B,H,C] log decay to t."""
    size = q.shape[2]
    after = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)  # j > t
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(after, float("-inf")).exp()
    intra = ((q @ k.transpose(-1, -2)) * pair) @ v  # [B, H, C, dv]
    inter = (q * cum.exp()[..., None]) @ s  # [B, H, C, dv]
    last = cum[..., -1:]  # [B, H, 1]
    s = s * last[..., None].exp() + (k * (last - cum).exp()[..., None]).transpose(-1, -2) @ v
    return intra + inter, s


def lightning_attention_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay_rates: torch.Tensor,
    state: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    block_size: int = 256,
) -> torch.Tensor:
    """Block-wise lightning attention over several sequences.

    Args:
        q, k: [T, H, dk]; v: [T, H, dv]; sequence b owns rows
            ``query_start_loc[b]:query_start_loc[b+1]`` ([B+1] int32).
        decay_rates: [H] the ``s_h`` of ``lightning_decay_rates``.
        state: [pool, H, dk, dv]; rows ``state_indices`` ([B] int64) are read (zeros where
            ``has_initial_state`` [B] is False) and overwritten in place.
        block_size: tokens per block (MiniMax: 256).

    Returns:
        [T, H, dv] in the dtype of ``v``.
    """
    ones = torch.ones(q.shape[0], device=q.device)
    valid = pad_varlen(ones, query_start_loc, block_size)[:, None]  # [B, 1, L], 0 on padding
    qp, kp, vp = (
        pad_varlen(x.float(), query_start_loc, block_size).transpose(1, 2) for x in (q, k, v)
    )  # [B, H, L, d]
    rate = decay_rates.float().to(q.device)[None, :, None]  # [1, H, 1]
    s = read_states(state, state_indices, has_initial_state)  # [B, H, dk, dv]
    outs = []
    for start in range(0, qp.shape[2], block_size):
        part = slice(start, start + block_size)
        cum = -rate * valid[..., part].cumsum(-1)  # [B, H, C]; padding does not decay
        o, s = _block_step(s, qp[:, :, part], kp[:, :, part], vp[:, :, part], cum)
        outs.append(o)
    state[state_indices] = s.to(state.dtype)
    out = torch.cat(outs, dim=2).transpose(1, 2)  # [B, L, H, dv]
    return unpad_varlen(out, query_start_loc).to(v.dtype)


def lightning_attention_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay_rates: torch.Tensor,
    state: torch.Tensor,
    *,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One token per sequence: q, k [B, H, dk], v [B, H, dv]; decay_rates [H].

    Returns:
        [B, H, dv] in the dtype of ``v``; the state rows are updated in place.
    """
    decay = torch.exp(-decay_rates.float().to(q.device))[None, :, None, None]  # [1, H, 1, 1]
    s = state[state_indices].float() * decay + k.float()[..., None] * v.float()[..., None, :]
    state[state_indices] = s.to(state.dtype)
    return torch.einsum("bhkv,bhk->bhv", s, q.float()).to(v.dtype)
