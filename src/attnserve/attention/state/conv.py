"""Causal depthwise conv1d with a per-sequence state, and the varlen helpers of all state ops.

The short convolution that Gated DeltaNet, Mamba and KDA apply before their recurrence. Each
sequence keeps its last ``K-1`` *pre-activation* inputs in a row of a conv-state pool
``[pool, channels, K-1]``; a prefill starts from that row (or from zeros for a new sequence) and
writes back the last ``K-1`` inputs of the concatenation [old state | new tokens], so a sequence
shorter than ``K-1`` keeps part of its old state.

This file also holds the three helpers every state op shares (flat tokens -> padded batch and
back, and reading the state rows). It is not a kernel: pure PyTorch, float32 arithmetic; no
weights, no module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

__all__ = [
    "causal_conv1d_prefill",
    "causal_conv1d_update",
    "pad_varlen",
    "read_states",
    "unpad_varlen",
]


def pad_varlen(x: torch.Tensor, query_start_loc: torch.Tensor, multiple: int = 1) -> torch.Tensor:
    """Flat tokens [T, ...] -> zero-padded batch [B, L, ...], L a multiple of ``multiple``.

    Padding is at the end of each sequence; every state op treats a zero token (zero key,
    zero step size, zero log decay) as a no-op on the state.
    """
    lens = query_start_loc.diff().tolist()
    padded = pad_sequence(list(torch.split(x, lens)), batch_first=True)  # [B, max_len, ...]
    extra = -padded.shape[1] % multiple
    if extra:
        pad = [0, 0] * (padded.dim() - 2) + [0, extra]
        padded = F.pad(padded, pad)
    return padded


def unpad_varlen(y: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pad_varlen``: [B, L, ...] -> [T, ...] in sequence order."""
    lens = query_start_loc.diff().to(y.device)
    valid = torch.arange(y.shape[1], device=y.device)[None, :] < lens[:, None]  # [B, L]
    return y[valid]


def read_states(
    state: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows ``state_indices`` of a state pool as float32, zeroed where there is no initial state."""
    rows = state[state_indices].float()
    if has_initial_state is None:
        return rows
    keep = has_initial_state.to(rows.device).view(-1, *([1] * (rows.dim() - 1)))
    return torch.where(keep, rows, torch.zeros_like(rows))


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    silu: bool = False,
) -> torch.Tensor:
    """Depthwise causal conv over several sequences, each continuing from its conv state.

    Args:
        x: [T, C] new tokens of B sequences, flat; sequence b owns rows
            ``query_start_loc[b]:query_start_loc[b+1]``.
        weight: [C, K] one filter per channel (HF ``conv1d.weight.squeeze(1)``).
        bias: [C] or None.
        conv_state: [pool, C, K-1] previous inputs, oldest first; rows ``state_indices`` are read
            (or taken as zeros where ``has_initial_state`` is False) and overwritten in place.
        query_start_loc: [B+1] int32 cumulative token counts.
        state_indices: [B] int64 rows of ``conv_state``.
        has_initial_state: [B] bool.
        silu: apply SiLU to the output.

    Returns:
        [T, C] in the dtype of ``x``.
    """
    width = weight.shape[1] - 1
    xs = pad_varlen(x, query_start_loc).float().transpose(1, 2)  # [B, C, L]
    init = read_states(conv_state, state_indices, has_initial_state)  # [B, C, K-1]
    full = torch.cat([init, xs], dim=-1)  # [B, C, K-1+L]
    out = F.conv1d(
        full,
        weight.float().unsqueeze(1),
        None if bias is None else bias.float(),
        groups=weight.shape[0],
    )  # [B, C, L]
    if silu:
        out = F.silu(out)
    # The new state of sequence b is full[b, :, len_b : len_b + K-1].
    lens = query_start_loc.diff().to(x.device).long()
    cols = lens[:, None] + torch.arange(width, device=x.device)[None, :]  # [B, K-1]
    new = full.gather(2, cols[:, None, :].expand(-1, full.shape[1], -1))  # [B, C, K-1]
    conv_state[state_indices] = new.to(conv_state.dtype)
    return unpad_varlen(out.transpose(1, 2), query_start_loc).to(x.dtype)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    *,
    state_indices: torch.Tensor,
    silu: bool = False,
) -> torch.Tensor:
    """One decode token per sequence: conv over [state | x], then shift x into the state.

    Args:
        x: [B, C] one new token per sequence.
        weight: [C, K]; bias: [C] or None.
        conv_state: [pool, C, K-1], rows ``state_indices`` read and updated in place.
        state_indices: [B] int64.
        silu: apply SiLU to the output.

    Returns:
        [B, C] in the dtype of ``x``.
    """
    full = torch.cat(
        [conv_state[state_indices].float(), x.float()[:, :, None]], dim=-1
    )  # [B, C, K]
    out = (full * weight.float()).sum(-1)  # [B, C]
    if bias is not None:
        out = out + bias.float()
    if silu:
        out = F.silu(out)
    conv_state[state_indices] = full[:, :, 1:].to(conv_state.dtype)
    return out.to(x.dtype)
