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
            # TORCH_* first until the Triton state backends are measured on a GPU (issue #20)
            (LayerKind.GDN, ("TORCH_GDN", "TRITON_GDN")),
            (LayerKind.MAMBA, ("TORCH_MAMBA", "TRITON_MAMBA")),
            (LayerKind.LIGHTNING, ("TORCH_LIGHTNING", "TRITON_LIGHTNING")),
            (LayerKind.KDA, ("TORCH_KDA", "TRITON_KDA")),
            (LayerKind.NSA, ("TORCH_NSA",)),
        ),
    )
