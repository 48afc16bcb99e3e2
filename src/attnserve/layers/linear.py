"""Linear layers with weight loaders: fused QKV and merged gate/up projections.

Checkpoints store q, k, v (and gate, up) as separate tensors; the engine keeps them fused so a
step runs one matrix product instead of three. Each parameter carries a ``weight_loader`` that
knows where a checkpoint shard goes (nano-vllm's inverted loading), and a module holding fused
projections names where its checkpoint tensors go with a ``rename(suffix) -> Target`` method
(``qkv_rename`` and ``gate_up_rename`` here; ``models/base.rename_in`` asks it).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MergedLinear", "QKVLinear", "Target", "default_weight_loader", "fused_rename", "gate_up_rename",
           "prefixed", "qkv_rename"]

# where a checkpoint tensor goes: a parameter name, (parameter name, shard), or None to skip it
Target = tuple[str, object] | str | None


def prefixed(prefix: str, target: Target) -> Target:
    """``target`` (a name, a (name, shard) pair or None) under ``prefix``."""
    if isinstance(target, tuple):
        return prefix + target[0], target[1]
    return target and prefix + target


def fused_rename(suffix: str, fused: str, parts: tuple[tuple[str, object], ...]) -> Target:
    """``{part}.*`` -> (``{fused}.*``, the part's shard) for the parts one fused projection holds;
    any other name unchanged."""
    for part, shard in parts:
        if suffix.startswith(part + "."):
            return fused + suffix[len(part):], shard
    return suffix


def qkv_rename(suffix: str) -> Target:
    """``q_proj.*``, ``k_proj.*``, ``v_proj.*`` -> (``qkv_proj.*``, "q" | "k" | "v")."""
    return fused_rename(suffix, "qkv_proj", (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")))


def gate_up_rename(suffix: str) -> Target:
    """``gate_proj.*`` -> (``gate_up_proj.*``, 0), ``up_proj.*`` -> shard 1."""
    return fused_rename(suffix, "gate_up_proj", (("gate_proj", 0), ("up_proj", 1)))


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class QKVLinear(nn.Linear):
    """[q (H*D) | k (Hkv*D) | v (Hkv*Dv)] in one weight; shards "q", "k", "v" or None (fused)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_size: int, bias: bool,
                 head_size_v: int | None = None):
        self.sizes = {"q": num_heads * head_size, "k": num_kv_heads * head_size,
                      "v": num_kv_heads * (head_size_v or head_size)}
        super().__init__(hidden, sum(self.sizes.values()), bias=bias)
        self.weight.weight_loader = self._load
        if bias:
            self.bias.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        if shard is None:
            return default_weight_loader(param, loaded)
        offset = {"q": 0, "k": self.sizes["q"], "v": self.sizes["q"] + self.sizes["k"]}[shard]
        target = param.data.narrow(0, offset, self.sizes[shard])
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch for {shard}_proj: expected {tuple(target.shape)}, "
                             f"checkpoint {tuple(loaded.shape)}")
        target.copy_(loaded)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.sizes["q"], self.sizes["k"], self.sizes["v"]], dim=-1)


class MergedLinear(nn.Linear):
    """Several output blocks in one weight (gate/up); shard i loads block i, None the whole."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool):
        self.out_sizes = list(out_sizes)
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.weight.weight_loader = self._load
        if bias:
            self.bias.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        if shard is None:
            return default_weight_loader(param, loaded)
        offset = sum(self.out_sizes[:shard])
        target = param.data.narrow(0, offset, self.out_sizes[shard])
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch for shard {shard}: expected {tuple(target.shape)}, "
                             f"checkpoint {tuple(loaded.shape)}")
        target.copy_(loaded)
