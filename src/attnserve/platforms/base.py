"""The Platform record: a device type, its compute capability, and backend priority lists."""

from __future__ import annotations

from dataclasses import dataclass

from attnserve.arch import LayerKind
from attnserve.platforms.cpu_info import CpuInfo

__all__ = ["Platform"]


@dataclass(frozen=True, slots=True)
class Platform:
    name: str  # cpu | cuda | rocm
    device_type: str  # the torch device type: cpu | cuda
    compute_capability: tuple[int, int] | None = None
    device_name: str = ""
    # Backend names in order of preference, per layer kind.
    priorities: tuple[tuple[LayerKind, tuple[str, ...]], ...] = ()
    cpu: CpuInfo | None = None  # the host CPU (cpu platform): dtype="auto" reads its flags

    def backend_priority(self, kind: LayerKind) -> tuple[str, ...]:
        for k, names in self.priorities:
            if k is kind:
                return names
        return ()

    @property
    def label(self) -> str:
        if self.compute_capability is None:
            return self.name
        major, minor = self.compute_capability
        return f"{self.name} (compute capability {major}.{minor})"
