"""ROCm: the same Triton kernels as CUDA (Triton targets AMD GPUs), then PyTorch."""

from __future__ import annotations

from attnserve.arch import LayerKind
from attnserve.platforms.base import Platform

_STANDARD = ("TRITON_ATTN", "FLEX_ATTENTION", "TORCH_SDPA")


def describe(compute_capability: tuple[int, int] | None = None) -> Platform:
    name = "AMD GPU"
    if compute_capability is None:
        import torch

        if torch.cuda.is_available() and getattr(torch.version, "hip", None):
            compute_capability = torch.cuda.get_device_capability()
            name = torch.cuda.get_device_name()
        else:
            compute_capability = (9, 4)  # MI300
    return Platform(
        name="rocm", device_type="cuda", compute_capability=tuple(compute_capability), device_name=name,
        priorities=(
            (LayerKind.FULL, _STANDARD),
            (LayerKind.SLIDING, _STANDARD),
            (LayerKind.MLA, ("TRITON_MLA", "TORCH_MLA")),
            (LayerKind.SPARSE_MLA, ("TRITON_MLA_SPARSE", "TORCH_MLA_SPARSE")),
            (LayerKind.GDN, ("TORCH_GDN", "TRITON_GDN")),  # TRITON_GDN first once run on a GPU
            (LayerKind.MAMBA, ("TORCH_MAMBA", "TRITON_MAMBA")),  # TRITON_MAMBA first once run on a GPU
            (LayerKind.LIGHTNING, ("TORCH_LIGHTNING", "TRITON_LIGHTNING")),  # TRITON_LIGHTNING first once run on a GPU
            (LayerKind.KDA, ("TORCH_KDA", "TRITON_KDA")),  # TRITON_KDA first once run on a GPU
            (LayerKind.NSA, ("TORCH_NSA",)),
        ),
    )
