"""Model families: HF ``model_type`` -> the attnserve implementation, imported when used.

The "module:Class" of each family is in ``arch.families.FAMILIES`` (the one table of families);
this file resolves it lazily.
"""

from __future__ import annotations

import importlib

from torch import nn

from attnserve.arch import FAMILIES, ModelArch

__all__ = ["get_model_class", "supported_model_types"]


def supported_model_types() -> list[str]:
    return sorted(t for t, family in FAMILIES.items() if family.model is not None)


def get_model_class(arch: ModelArch) -> type[nn.Module]:
    family = FAMILIES.get(arch.model_type)
    target = family.model if family is not None else None
    if target is None:
        raise ValueError(f"model_type '{arch.model_type}' has no attnserve implementation yet "
                         f"(implemented: {', '.join(supported_model_types())}); "
                         f"`attnserve inspect` still reads its config")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)
