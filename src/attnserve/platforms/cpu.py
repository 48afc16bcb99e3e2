"""CPU: pure-PyTorch backends for every mechanism (what vLLM refuses on CPU, attnserve runs), and
the host CPU's model and instruction-set flags (``cpu_info.py``), which ``dtype="auto"`` reads."""

from __future__ import annotations

from attnserve.arch import LayerKind
from attnserve.platforms.base import Platform
from attnserve.platforms.cpu_info import CpuInfo, cpu_info

_STANDARD = ("TORCH_SDPA", "FLEX_ATTENTION")


def describe(compute_capability: tuple[int, int] | None = None, cpu: CpuInfo | None = None) -> Platform:
    """The CPU platform of this machine (``cpu``: another CPU's info, for tests)."""
    cpu = cpu if cpu is not None else cpu_info()
    return Platform(
        name="cpu", device_type="cpu", device_name=cpu.model or "cpu",
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
        cpu=cpu,
    )
