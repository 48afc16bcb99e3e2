"""TORCH_GDN: Gated DeltaNet over a state pool in PyTorch; the metadata all state backends share.

Each step's requests are split at ``num_state_decodes``: the leading requests (one new token and
a state already in their slot) take the recurrent one-token forms; the rest (first chunks, later
chunks, one-token prompts) take the varlen prefill forms, which read the state only where
``has_initial_state`` says so. ``StateMetadata`` is that split, built once per step and group;
the Mamba, lightning and KDA backends build the same one (``build_state_metadata``).
``gdn_forward`` is the whole layer step; TRITON_GDN (``triton_gdn.py``) runs it with its fused
decode kernel in place of the PyTorch decode step.

What it is not: the projections, the gated RMSNorm and the output projection (the layer,
``layers/gdn.py``), the arithmetic (``layers/state_ops``), or a kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attnserve.attention.backend import AttentionBackend
from attnserve.layers.state_ops import (
    causal_conv1d_prefill,
    causal_conv1d_update,
    gated_delta_decode,
    gated_delta_prefill,
)

__all__ = ["StateMetadata", "TorchGDNBackend", "build_state_metadata", "conv_forward", "gdn_forward"]


@dataclass(slots=True)
class StateMetadata:
    """One step of a state group, split into the decode part and the prefill part.

    Tokens ``[:num_decodes]`` belong to the decode requests (one each, in request order), tokens
    ``[num_decodes:]`` to the prefill requests, laid out by ``prefill_query_start_loc``.
    """

    num_decodes: int
    decode_slots: torch.Tensor  # [num_decodes] int64
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, from 0
    prefill_slots: torch.Tensor  # [num_prefills] int64
    prefill_has_initial_state: torch.Tensor  # [num_prefills] bool
    max_prefill_len: int = 0  # new tokens of the longest prefill request

    @property
    def num_prefills(self) -> int:
        return self.prefill_slots.shape[0]

    def split(self, decode: Callable[[slice], torch.Tensor], prefill: Callable[[slice], torch.Tensor]
              ) -> torch.Tensor:
        """``decode(tokens)`` on the decode tokens and ``prefill(tokens)`` on the prefill tokens
        (each given the slice of the step's tokens it owns), outputs in token order."""
        nd = self.num_decodes
        outs = []
        if nd:
            outs.append(decode(slice(None, nd)))
        if self.num_prefills:
            outs.append(prefill(slice(nd, None)))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def prefill_args(self) -> dict[str, torch.Tensor]:
        """The keyword arguments every chunked prefill form takes from the step."""
        return dict(query_start_loc=self.prefill_query_start_loc, state_indices=self.prefill_slots,
                    has_initial_state=self.prefill_has_initial_state)

    def chunk_size(self, largest: int) -> int:
        """Tokens per chunk (block) of a prefill form: ``largest``, or the power of two that
        covers the longest prefill when that is shorter (padding to a chunk is wasted work; the
        chunk size does not change the result)."""
        return min(largest, 1 << max(self.max_prefill_len - 1, 0).bit_length())


def build_state_metadata(common: Any) -> StateMetadata:
    """The decode/prefill split of one step from ``CommonAttentionMetadata`` (``state_slots``,
    ``has_initial_state``, ``num_state_decodes``, ``query_start_loc``)."""
    if common.state_slots is None or common.has_initial_state is None:
        raise ValueError("a step with state layers needs state_slots and has_initial_state")
    nd = common.num_state_decodes
    qsl = common.query_start_loc
    if common.query_start_loc_cpu[nd] != nd:
        raise ValueError(
            f"the first {nd} requests are state decodes but do not have one token each"
        )
    slots = common.state_slots.long()
    q = common.query_start_loc_cpu
    return StateMetadata(
        num_decodes=nd,
        decode_slots=slots[:nd],
        prefill_query_start_loc=(qsl[nd:] - qsl[nd]).to(torch.int32),
        prefill_slots=slots[nd:],
        prefill_has_initial_state=common.has_initial_state[nd:].bool(),
        max_prefill_len=max((q[i + 1] - q[i] for i in range(nd, len(q) - 1)), default=0),
    )


def conv_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    metadata: StateMetadata,
) -> torch.Tensor:
    """SiLU(causal depthwise conv) of every token, each continuing its sequence's conv state.

    Args:
        x: [T, C] pre-conv inputs (decode tokens first).
        weight: [C, K]; bias: [C] or None.
        conv_state: [num_slots, C, K-1], updated in place.
        metadata: the step's ``StateMetadata``.
    Returns:
        [T, C] in the dtype of ``x``.
    """
    md = metadata
    return md.split(
        lambda s: causal_conv1d_update(x[s], weight, bias, conv_state, state_indices=md.decode_slots, silu=True),
        lambda s: causal_conv1d_prefill(x[s], weight, bias, conv_state, **md.prefill_args(), silu=True))


def gdn_forward(
    layer,
    mixed_qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_cache: Any,
    metadata: StateMetadata,
    decode: Callable[..., torch.Tensor] = gated_delta_decode,
) -> torch.Tensor:
    """The delta-rule output of every token; the layer's conv and recurrent states advance.

    Args:
        layer: ``num_k_heads``, ``num_v_heads``, ``head_k_dim``, ``head_v_dim`` and
            ``conv_weight`` [C, K] (C = 2 * Hk * dk + Hv * dv).
        mixed_qkv: [T, C] the projected [q | k | v] before the conv.
        g: [T, Hv] log decay (<= 0, float32); beta: [T, Hv] write strength.
        state_cache: ``conv[0]`` [num_slots, C, K-1], ``recurrent[0]`` [num_slots, Hv, dk, dv].
        metadata: the step's ``StateMetadata``.
        decode: the recurrent step of the decode tokens, called as ``gated_delta_decode``
            (TRITON_GDN passes its fused kernel); prefills always take the chunked form.
    Returns:
        [T, Hv, dv] in the dtype of ``mixed_qkv``.
    """
    t = mixed_qkv.shape[0]
    x = conv_forward(mixed_qkv, layer.conv_weight, None, state_cache.conv[0], metadata)
    key_dim = layer.num_k_heads * layer.head_k_dim
    q, k, v = x.split([key_dim, key_dim, layer.num_v_heads * layer.head_v_dim], dim=-1)
    q = q.reshape(t, layer.num_k_heads, layer.head_k_dim)  # [T, Hk, dk]
    k = k.reshape(t, layer.num_k_heads, layer.head_k_dim)
    v = v.reshape(t, layer.num_v_heads, layer.head_v_dim)  # [T, Hv, dv]
    state, md = state_cache.recurrent[0], metadata
    return md.split(
        lambda s: decode(q[s], k[s], v[s], g[s], beta[s], state, state_indices=md.decode_slots, use_qk_l2norm=True),
        lambda s: gated_delta_prefill(q[s], k[s], v[s], g[s], beta[s], state, **md.prefill_args(),
                                      use_qk_l2norm=True, chunk_size=md.chunk_size(64)))


class TorchGDNBackend(AttentionBackend):
    """Gated DeltaNet: short conv, then the chunked (prefill) or recurrent (decode) delta rule."""

    name = "TORCH_GDN"

    def __init__(self, block_size: int):
        self.block_size = block_size

    def build_metadata(self, common: Any, group_id: int) -> StateMetadata:
        return build_state_metadata(common)

    def forward(self, layer, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state_cache: Any,
                metadata: StateMetadata) -> torch.Tensor:
        """``gdn_forward`` with the PyTorch decode step; returns [T, Hv, dv]."""
        return gdn_forward(layer, mixed_qkv, g, beta, state_cache, metadata)
