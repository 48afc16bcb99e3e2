"""CUDA: Triton kernels first, library kernels where installed, PyTorch as the last resort."""

from __future__ import annotations

from attnserve.arch import LayerKind
from attnserve.platforms.base import Platform

_STANDARD = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION", "TORCH_SDPA")


def describe(compute_capability: tuple[int, int] | None = None) -> Platform:
    name = "NVIDIA GPU"
    if compute_capability is None:
        import torch

        if torch.cuda.is_available() and not getattr(torch.version, "hip", None):
            compute_capability = torch.cuda.get_device_capability()
            name = torch.cuda.get_device_name()
        else:
            compute_capability = (9, 0)
    return Platform(
        name="cuda", device_type="cuda", compute_capability=tuple(compute_capability), device_name=name,
        priorities=(
            (LayerKind.FULL, _STANDARD),
            (LayerKind.SLIDING, _STANDARD),
            (LayerKind.MLA, ("FLASHMLA", "TRITON_MLA", "TORCH_MLA")),
            (LayerKind.SPARSE_MLA, ("FLASHMLA_SPARSE", "TRITON_MLA_SPARSE", "TORCH_MLA_SPARSE")),
            # the Triton state backends: measured on the H200 (docs/performance.md, hybrid rows),
            # faster than the PyTorch forms (decode at batch 8-64, prefill from 8K tokens) and graph-captured
            (LayerKind.GDN, ("TRITON_GDN", "TORCH_GDN")),
            (LayerKind.MAMBA, ("TRITON_MAMBA", "TORCH_MAMBA")),
            (LayerKind.LIGHTNING, ("TRITON_LIGHTNING", "TORCH_LIGHTNING")),
            (LayerKind.KDA, ("TRITON_KDA", "TORCH_KDA")),
            (LayerKind.NSA, ("TORCH_NSA",)),
        ),
    )
