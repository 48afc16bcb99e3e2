"""Normalisation layers: RMSNorm (plain or zero-centred) and LayerNorm, computed in float32.

RMSNorm's arithmetic, with an optional fused residual add, lives in ``layers/fused.py`` (a
Triton kernel on CUDA, its PyTorch twin elsewhere).
"""

from __future__ import annotations

import torch
from torch import nn

from attnserve.layers.fused import rms_norm

__all__ = ["LayerNorm", "RMSNorm"]


class RMSNorm(nn.Module):
    """``x / rms(x) * w``; with ``zero_centered`` the weight is stored as ``w - 1`` (Gemma)."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)`` in one pass."""
        return rms_norm(x, self.weight, self.eps, residual, self.zero_centered)


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm (weight and optional bias), computed in float32 for low-precision inputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        w = self.weight.float() if self.weight is not None else None
        b = self.bias.float() if self.bias is not None else None
        return nn.functional.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)
