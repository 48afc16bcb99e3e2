"""Platforms: which machine we run on, its device, and its attention-backend priorities.

``current_platform()`` detects this machine; ``get_platform(name)`` builds one by name so that
``attnserve inspect --platform cuda`` can explain a choice for a machine we are not on.
"""

from __future__ import annotations

import torch

from attnserve.platforms.base import Platform

__all__ = ["Platform", "current_platform", "get_platform", "PLATFORM_NAMES", "to_device"]

PLATFORM_NAMES = ("cpu", "cuda", "rocm")


def get_platform(name: str, compute_capability: tuple[int, int] | None = None) -> Platform:
    """A platform by name; for cuda/rocm without a device, ``compute_capability`` defaults to
    the device's if one is present, else to Hopper (9, 0) for cuda and (9, 4) for rocm."""
    name = name.lower()
    if name == "cpu":
        from attnserve.platforms import cpu

        return cpu.describe()
    if name == "cuda":
        from attnserve.platforms import cuda

        return cuda.describe(compute_capability)
    if name == "rocm":
        from attnserve.platforms import rocm

        return rocm.describe(compute_capability)
    raise ValueError(f"unknown platform '{name}' (choose from {', '.join(PLATFORM_NAMES)})")


def current_platform() -> Platform:
    from attnserve import env

    forced = env.force_platform()
    if forced:
        return get_platform(forced)
    import torch

    if torch.cuda.is_available():
        return get_platform("rocm" if getattr(torch.version, "hip", None) else "cuda")
    return get_platform("cpu")


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device``. To CUDA the copy goes through pinned memory without
    blocking: a plain copy (or ``torch.tensor(..., device=cuda)``) waits for all the work queued
    on the stream, so a step launched ahead of the one running (async scheduling) would wait
    for it."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
