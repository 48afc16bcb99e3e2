"""TORCH_LIGHTNING: MiniMax lightning attention over a state pool in PyTorch.

Per step: the recurrent one-token form for decode requests and the block-wise prefill for the
rest (each continuing its ``KV`` state or starting from zeros); the decode/prefill split is
``StateMetadata`` (``torch_gdn.py``). Lightning layers have no conv state. ``lightning_forward``
is the whole layer step; TRITON_LIGHTNING (``triton_lightning.py``) runs it with its fused decode
kernel in place of the PyTorch decode step.

What it is not: the SiLU'd qkv projection, the RMSNorm over all heads and the sigmoid output
gate (the layer, ``layers/lightning.py``), the arithmetic (``layers/state_ops``), or a kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from attnserve.attention.backend import AttentionBackend
from attnserve.attention.backends.torch_gdn import StateMetadata, build_state_metadata
from attnserve.layers.state_ops import lightning_attention_decode, lightning_attention_prefill

__all__ = ["TorchLightningBackend", "lightning_forward"]


class TorchLightningBackend(AttentionBackend):
    name = "TORCH_LIGHTNING"

    def __init__(self, block_size: int):
        self.block_size = block_size

    def build_metadata(self, common: Any, group_id: int) -> StateMetadata:
        return build_state_metadata(common)

    def forward(
        self,
        layer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        state_cache: Any,
        metadata: StateMetadata,
    ) -> torch.Tensor:
        """``o_t = sum_{j<=t} lambda^(t-j) (q_t . k_j) v_j`` per head, over cached and new tokens.

        Args:
            layer: ``decay_rates`` [H] (the per-head ``s_h``, float32) and ``block_size`` (tokens
                per prefill block).
            q, k: [T, H, dk]; v: [T, H, dv] (after the SiLU).
            state_cache: ``recurrent[0]`` [num_slots, H, dk, dv].
            metadata: the step's ``StateMetadata``.
        Returns:
            [T, H, dv] in the dtype of ``v``.
        """
        return lightning_forward(layer, q, k, v, state_cache, metadata)


def lightning_forward(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state_cache: Any,
                      metadata: StateMetadata, *, decode: Callable = lightning_attention_decode) -> torch.Tensor:
    """``TorchLightningBackend.forward`` with the one-token step ``decode``, called as
    ``lightning_attention_decode`` (TRITON_LIGHTNING passes its kernel)."""
    state, rates, md = state_cache.recurrent[0], layer.decay_rates, metadata
    return md.split(
        lambda s: decode(q[s], k[s], v[s], rates, state, state_indices=md.decode_slots),
        lambda s: lightning_attention_prefill(q[s], k[s], v[s], rates, state, **md.prefill_args(),
                                              block_size=md.chunk_size(layer.block_size)))
