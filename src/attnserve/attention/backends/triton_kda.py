"""TRITON_KDA: Kimi delta attention with the decode step fused into one Triton kernel (CUDA, ROCm).

The same contract, metadata and state layout as TORCH_KDA (``torch_kda.py``), and the same step
(``kda_forward``): the three short convs, then the decode tokens' recurrence through
``ops/triton_gdn.fused_delta_rule_decode`` with its per-key-channel decay (each sequence's state
read once and written once). Prefills keep the chunked PyTorch form. On CPU it runs only when
named, under Triton's interpreter (tests). Not graph-captured: hybrid models run eagerly.
"""

from __future__ import annotations

from typing import Any

import torch

from attnserve.attention.backend import AttentionBackend
from attnserve.attention.backends.torch_gdn import StateMetadata, build_state_metadata
from attnserve.attention.backends.torch_kda import kda_forward
from attnserve.attention.ops.triton_gdn import fused_delta_rule_decode

__all__ = ["TritonKDABackend"]


class TritonKDABackend(AttentionBackend):
    """Kimi delta attention: short convs, chunked prefill (PyTorch), fused recurrent decode (Triton)."""

    name = "TRITON_KDA"

    def __init__(self, block_size: int):
        self.block_size = block_size

    def build_metadata(self, common: Any, group_id: int) -> StateMetadata:
        return build_state_metadata(common)

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state_cache: Any, metadata: StateMetadata) -> torch.Tensor:
        """``kda_forward`` with the fused decode step; returns [T, H, d] (see TORCH_KDA)."""
        return kda_forward(layer, q, k, v, g, beta, state_cache, metadata, decode=fused_delta_rule_decode)
