"""The Gated DeltaNet layer (Qwen3-Next, Qwen3.5): projections, gates, gated norm, output.

``GatedDeltaNet.forward(hidden [T, D]) -> [T, D]``: ``[q | k | v | z] = in_proj_qkvz(h)`` and
``[b | a] = in_proj_ba(h)``; the backend (``TORCH_GDN``) runs the short conv over ``[q | k | v]``
and the gated delta rule with ``beta = sigmoid(b)`` and ``g = -exp(A_log) * softplus(a +
dt_bias)``; then ``out_proj(w * RMSNorm(o) * SiLU(z))`` per value head. The runner binds
``state_cache`` (conv ``[slots, C, K-1]``, recurrent ``[slots, Hv, dk, dv]``), ``backend`` and
``group_id``.

The projections are kept flat: ``in_proj_qkvz`` is [q (Hk*dk) | k (Hk*dk) | v (Hv*dv) | z
(Hv*dv)] and ``in_proj_ba`` is [b (Hv) | a (Hv)]. Qwen3.5 checkpoints store them that way
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``: shards 0 and 1); Qwen3-Next
checkpoints group them by key head (``in_proj_qkvz``: Hk groups of [q | k | v | z], ``in_proj_ba``:
Hk groups of [b | a]), which the shard ``"grouped"`` un-groups once, at load time.

Also here: ``GatedRMSNorm``, shared with KDA (``layers/kda.py``). Not here: the conv and
recurrence arithmetic (``attention/state``), the decode/prefill split (the backend).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.arch import GDNDims, LayerSpec, ModelArch
from attnserve.core.forward_context import get_forward_context
from attnserve.layers.linear import MergedLinear, Target

__all__ = ["GatedDeltaNet", "GatedRMSNorm"]

_GATE_ACTS = {"silu": F.silu, "sigmoid": torch.sigmoid}
_CHECKPOINT_SHARDS = {  # checkpoint projection -> (parameter, shard)
    "in_proj_qkvz": ("in_proj_qkvz", "grouped"),  # Qwen3-Next: grouped by key head
    "in_proj_ba": ("in_proj_ba", "grouped"),
    "in_proj_qkv": ("in_proj_qkvz", 0),  # Qwen3.5: stored apart
    "in_proj_z": ("in_proj_qkvz", 1),
    "in_proj_b": ("in_proj_ba", 0),
    "in_proj_a": ("in_proj_ba", 1),
}


class GatedRMSNorm(nn.Module):
    """``w * RMSNorm(x) * act(gate)`` over the last dim, in float32 (GDN: SiLU, KDA: sigmoid)."""

    def __init__(self, dim: int, eps: float = 1e-6, act: str = "silu"):
        super().__init__()
        self.eps = eps
        self.act = _GATE_ACTS[act]
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float() * self.act(gate.float())).to(x.dtype)


def ungroup_rows(weight: torch.Tensor, num_groups: int, sizes: list[int]) -> torch.Tensor:
    """Rows laid out as ``num_groups`` groups of [part_0 | part_1 | ...] (sizes per group) ->
    [all part_0 rows | all part_1 rows | ...], groups in order within each part."""
    grouped = weight.reshape(num_groups, sum(sizes), *weight.shape[1:])  # [G, sum(sizes), ...]
    parts = grouped.split(sizes, dim=1)
    return torch.cat([p.reshape(-1, *weight.shape[1:]) for p in parts])


class GatedDeltaNet(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        dims = spec.mixer
        if not isinstance(dims, GDNDims):
            raise ValueError(f"layer {spec.index}: GatedDeltaNet needs LayerSpec.mixer (GDNDims)")
        self.layer_id = spec.index
        self.num_v_heads, self.head_k_dim, self.head_v_dim = (
            spec.num_heads,
            spec.head_size,
            spec.head_size_v,
        )
        self.num_k_heads = dims.num_k_heads
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"layer {spec.index}: {self.num_v_heads} value heads cannot share "
                f"{self.num_k_heads} key heads"
            )
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        kernel = dims.conv_kernel
        self.in_proj_qkvz = MergedLinear(
            arch.hidden_size, [self.conv_dim, self.value_dim], bias=False
        )
        self.in_proj_ba = MergedLinear(
            arch.hidden_size, [self.num_v_heads, self.num_v_heads], bias=False
        )
        self.in_proj_qkvz.weight.weight_loader = self._load_qkvz
        self.in_proj_ba.weight.weight_loader = self._load_ba
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(
            torch.linspace(1.0, 16.0, self.num_v_heads).log()
        )  # checkpoints overwrite
        self.norm = GatedRMSNorm(self.head_v_dim, eps=dims.norm_eps, act="silu")
        self.out_proj = nn.Linear(self.value_dim, arch.hidden_size, bias=False)
        # bound by the model runner once the state pool is allocated
        self.state_cache: Any = None
        self.backend: Any = None
        self.group_id: int = -1

    @property
    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight.view(self.conv_dim, -1)  # [C, 1, K] -> [C, K]

    @staticmethod
    def rename(suffix: str) -> Target:
        """A checkpoint input projection (either layout) -> (``in_proj_qkvz``/``in_proj_ba``, shard)."""
        name, dot, rest = suffix.partition(".")
        if rest == "weight" and name in _CHECKPOINT_SHARDS:
            param, shard = _CHECKPOINT_SHARDS[name]
            return f"{param}.weight", shard
        return suffix

    def _load_qkvz(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
        if shard == "grouped":  # Qwen3-Next: per key head [q | k | v | z]
            g = self.num_v_heads // self.num_k_heads
            sizes = [self.head_k_dim, self.head_k_dim, g * self.head_v_dim, g * self.head_v_dim]
            loaded, shard = ungroup_rows(loaded, self.num_k_heads, sizes), None
        self.in_proj_qkvz._load(param, loaded, shard)

    def _load_ba(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
        if shard == "grouped":  # Qwen3-Next: per key head [b | a]
            g = self.num_v_heads // self.num_k_heads
            loaded, shard = ungroup_rows(loaded, self.num_k_heads, [g, g]), None
        self.in_proj_ba._load(param, loaded, shard)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] (after the input norm) -> [T, D]."""
        t = hidden.shape[0]
        mixed_qkv, z = self.in_proj_qkvz(hidden).split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(hidden).chunk(2, dim=-1)  # [T, Hv] each
        beta = torch.sigmoid(b)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [T, Hv]
        meta = get_forward_context().attn_metadata[self.group_id]
        core = self.backend.forward(self, (mixed_qkv, g, beta), self.state_cache, meta)  # [T, Hv, dv]
        out = self.norm(core, z.reshape(t, self.num_v_heads, self.head_v_dim))
        return self.out_proj(out.reshape(t, self.value_dim))
