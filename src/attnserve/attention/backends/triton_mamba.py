"""TRITON_MAMBA: the Mamba-1 scan (Jamba) with the decode step fused into one Triton kernel (CUDA, ROCm).

The same contract, metadata and state layout as TORCH_MAMBA (``torch_mamba.py``), and the same
step (``mamba_forward``): the short conv and ``ssm_params`` of every token, then the decode
tokens' scan step through ``ops/triton_state_decode.fused_selective_scan_decode`` (each
sequence's state read once and written once, skip and gate in the same pass). Prefills keep the
chunked PyTorch scan, and the conv stays PyTorch. On CPU it runs only when named, under
Triton's interpreter (tests). Not graph-captured: hybrid models run eagerly.
"""

from __future__ import annotations

from typing import Any

import torch

from attnserve.attention.backend import AttentionBackend
from attnserve.attention.backends.torch_gdn import StateMetadata, build_state_metadata
from attnserve.attention.backends.torch_mamba import mamba_forward
from attnserve.attention.ops.triton_state_decode import fused_selective_scan_decode

__all__ = ["TritonMambaBackend"]


class TritonMambaBackend(AttentionBackend):
    """Mamba-1: short conv, chunked prefill scan (PyTorch), fused recurrent decode (Triton)."""

    name = "TRITON_MAMBA"

    def __init__(self, block_size: int):
        self.block_size = block_size

    def build_metadata(self, common: Any, group_id: int) -> StateMetadata:
        return build_state_metadata(common)

    def forward(self, layer, x: torch.Tensor, z: torch.Tensor, state_cache: Any, metadata: StateMetadata
                ) -> torch.Tensor:
        """``mamba_forward`` with the fused decode step; returns [T, Di] (see TORCH_MAMBA)."""
        return mamba_forward(layer, x, z, state_cache, metadata, decode=fused_selective_scan_decode)
