"""TORCH_KDA: Kimi delta attention (Kimi-Linear) over a state pool in PyTorch.

Per step: the three short convs (q, k, v, each with its own conv state), then the recurrent
one-token KDA step for decode requests and the chunked WY form for the rest; the decode/prefill
split is ``StateMetadata`` (``torch_gdn.py``).

What it is not: the projections, the forget gate that produces ``g``, the sigmoid-gated RMSNorm
(the layer, ``layers/kda.py``), the arithmetic (``layers/state_ops``), or a kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from attnserve.attention.backend import AttentionBackend
from attnserve.attention.backends.torch_gdn import StateMetadata, build_state_metadata, conv_forward
from attnserve.layers.state_ops import kda_decode, kda_prefill

__all__ = ["TorchKDABackend", "kda_forward"]


class TorchKDABackend(AttentionBackend):
    name = "TORCH_KDA"

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
        g: torch.Tensor,
        beta: torch.Tensor,
        state_cache: Any,
        metadata: StateMetadata,
    ) -> torch.Tensor:
        """The KDA output of every token; the layer's three conv states and its state advance.

        Args:
            layer: ``num_heads``, ``head_dim`` and ``conv_weights`` (q, k, v: each [H*d, K]).
            q, k, v: [T, H*d] projections before their convs.
            g: [T, H, d] per-channel log decay (<= 0, float32); beta: [T, H].
            state_cache: ``conv`` (q, k, v: each [num_slots, H*d, K-1]), ``recurrent[0]``
                [num_slots, H, d, d].
            metadata: the step's ``StateMetadata``.
        Returns:
            [T, H, d] in the dtype of ``v``.
        """
        return kda_forward(layer, q, k, v, g, beta, state_cache, metadata)


def kda_forward(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state_cache: Any, metadata: StateMetadata, *, decode: Callable = kda_decode) -> torch.Tensor:
    """``TorchKDABackend.forward`` with the one-token step ``decode`` (TRITON_KDA passes its kernel)."""
    t, h, d = q.shape[0], layer.num_heads, layer.head_dim
    q, k, v = (
        conv_forward(x, w, None, conv, metadata).view(t, h, d)  # [T, H, d]
        for x, w, conv in zip((q, k, v), layer.conv_weights, state_cache.conv)
    )
    state, md = state_cache.recurrent[0], metadata
    return md.split(
        lambda s: decode(q[s], k[s], v[s], g[s], beta[s], state, state_indices=md.decode_slots,
                         use_qk_l2norm=True),
        lambda s: kda_prefill(q[s], k[s], v[s], g[s], beta[s], state, **md.prefill_args(),
                              use_qk_l2norm=True, chunk_size=md.chunk_size(64)))
