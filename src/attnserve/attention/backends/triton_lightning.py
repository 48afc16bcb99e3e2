"""TRITON_LIGHTNING: MiniMax lightning attention with the decode step fused into one Triton kernel
(CUDA, ROCm).

The same contract, metadata and state layout as TORCH_LIGHTNING (``torch_lightning.py``), and
the same step (``lightning_forward``): the decode tokens' recurrence through
``ops/triton_state_decode.fused_lightning_decode`` (each sequence's state read once and written
once); prefills keep the block-wise PyTorch form. On CPU it runs only when named, under Triton's
interpreter (tests). Not graph-captured: hybrid models run eagerly.
"""

from __future__ import annotations

from typing import Any

import torch

from attnserve.attention.backend import AttentionBackend
from attnserve.attention.backends.torch_gdn import StateMetadata, build_state_metadata
from attnserve.attention.backends.torch_lightning import lightning_forward
from attnserve.attention.ops.triton_state_decode import fused_lightning_decode

__all__ = ["TritonLightningBackend"]


class TritonLightningBackend(AttentionBackend):
    """Lightning attention: block prefill (PyTorch), fused recurrent decode (Triton)."""

    name = "TRITON_LIGHTNING"

    def __init__(self, block_size: int):
        self.block_size = block_size

    def build_metadata(self, common: Any, group_id: int) -> StateMetadata:
        return build_state_metadata(common)

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state_cache: Any,
                metadata: StateMetadata) -> torch.Tensor:
        """``lightning_forward`` with the fused decode step; returns [T, H, dv] (see TORCH_LIGHTNING)."""
        return lightning_forward(layer, q, k, v, state_cache, metadata, decode=fused_lightning_decode)
