"""TRITON_GDN: Gated DeltaNet with the decode step fused into one Triton kernel (CUDA, ROCm).

The same contract, metadata and state layout as TORCH_GDN (``torch_gdn.py``), and the same step
(``gdn_forward``): the short conv of every token, then the decode tokens' recurrence through
``ops/triton_gdn.fused_delta_rule_decode`` (each sequence's state read once and written once)
where TORCH_GDN gathers, scales, runs two einsums and scatters. Prefills keep the chunked
PyTorch form, and the conv stays PyTorch. On CPU it runs only when named, under Triton's
interpreter (tests). Not graph-captured: hybrid models run eagerly (``runner/cuda_graph.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from attnserve.attention.backend import AttentionBackend
from attnserve.attention.backends.torch_gdn import StateMetadata, build_state_metadata, gdn_forward
from attnserve.attention.ops.triton_gdn import fused_delta_rule_decode

__all__ = ["TritonGDNBackend"]


class TritonGDNBackend(AttentionBackend):
    """Gated DeltaNet: short conv, chunked prefill (PyTorch), fused recurrent decode (Triton)."""

    name = "TRITON_GDN"

    def __init__(self, block_size: int):
        self.block_size = block_size

    def build_metadata(self, common: Any, group_id: int) -> StateMetadata:
        return build_state_metadata(common)

    def forward(self, layer, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state_cache: Any,
                metadata: StateMetadata) -> torch.Tensor:
        """``gdn_forward`` with the fused decode step; returns [T, Hv, dv] (see TORCH_GDN)."""
        return gdn_forward(layer, mixed_qkv, g, beta, state_cache, metadata, decode=fused_delta_rule_decode)
