"""Normalisation layers: RMSNorm (plain or zero-centred) and LayerNorm, computed in float32."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LayerNorm", "RMSNorm"]


class RMSNorm(nn.Module):
    """``x / rms(x) * w``; with ``zero_centered`` the weight is stored as ``w - 1`` (Gemma)."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm (weight and optional bias), computed in float32 for low-precision inputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        w = self.weight.float() if self.weight is not None else None
        b = self.bias.float() if self.bias is not None else None
        return nn.functional.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)
