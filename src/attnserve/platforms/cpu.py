"""CPU: pure-PyTorch backends for every mechanism (what vLLM refuses on CPU, attnserve runs)."""

from __future__ import annotations

from attnserve.arch import LayerKind
from attnserve.platforms.base import Platform

_STANDARD = ("TORCH_SDPA", "FLEX_ATTENTION")


def describe(compute_capability: tuple[int, int] | None = None) -> Platform:
    return Platform(
        name="cpu", device_type="cpu", device_name="cpu",
        priorities=(
            (LayerKind.FULL, _STANDARD),
            (LayerKind.SLIDING, _STANDARD),
            (LayerKind.MLA, ("TORCH_MLA",)),
            (LayerKind.SPARSE_MLA, ("TORCH_MLA_SPARSE",)),
            (LayerKind.GDN, ("TORCH_GDN",)),
            (LayerKind.MAMBA, ("TORCH_MAMBA",)),
            (LayerKind.LIGHTNING, ("TORCH_LIGHTNING",)),
            (LayerKind.KDA, ("TORCH_KDA",)),
            (LayerKind.NSA, ("TORCH_NSA",)),
        ),
    )
