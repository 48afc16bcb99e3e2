"""The Kimi delta attention layer (KDA, Kimi-Linear): projections, forget gate, gated norm.

``KimiDeltaAttention.forward(hidden [T, D]) -> [T, D]``: ``q, k, v`` projections (fused here:
``qkv_proj``, shards 0/1/2 for the checkpoint's ``q_proj``/``k_proj``/``v_proj``); the
per-channel log decay ``g = -exp(A_log_h) * softplus(f_b_proj(f_a_proj(h)) + dt_bias)`` [T, H, d]
and ``beta = sigmoid(b_proj(h))``; the backend (``TORCH_KDA``) runs the three short convs (SiLU)
and the delta rule with q/k l2-normalised; then ``o_proj(w * RMSNorm(o) * sigmoid(g_b_proj(
g_a_proj(h))))`` per head. The runner binds ``state_cache`` (conv q/k/v, each
``[slots, H*d, K-1]``; recurrent ``[slots, H, d, d]``), ``backend`` and ``group_id``.

Not here: the arithmetic (``attention/state/kda.py``), Kimi-Linear's MLA layers
(``layers/mla.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.arch import KDADims, LayerSpec, ModelArch
from attnserve.core.forward_context import get_forward_context
from attnserve.layers.gdn import GatedRMSNorm
from attnserve.layers.linear import MergedLinear, Target, fused_rename

__all__ = ["KimiDeltaAttention"]


def _short_conv(channels: int, kernel: int) -> nn.Conv1d:
    return nn.Conv1d(channels, channels, kernel, groups=channels, bias=False)


def _load_any_shape(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
    if loaded.numel() != param.numel():
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded.reshape(param.shape))


class KimiDeltaAttention(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        if spec.state is None or not isinstance(spec.mixer, KDADims):
            raise ValueError(f"layer {spec.index}: KimiDeltaAttention needs LayerSpec.state and .mixer (KDADims)")
        self.layer_id = spec.index
        h, d = self.num_heads, self.head_dim = spec.num_heads, spec.head_size
        inner, hidden = h * d, arch.hidden_size
        kernel = spec.state.conv[0][1] + 1
        self.qkv_proj = MergedLinear(hidden, [inner] * 3, bias=False)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (_short_conv(inner, kernel) for _ in range(3))
        self.f_a_proj = nn.Linear(hidden, d, bias=False)
        self.f_b_proj = nn.Linear(d, inner, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(inner, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.linspace(1.0, 16.0, h).log().view(1, 1, h, 1))
        self.A_log.weight_loader = _load_any_shape  # [H] in FLA's layout, [1, 1, H, 1] in HF's
        self.b_proj = nn.Linear(hidden, h, bias=False)
        self.g_a_proj = nn.Linear(hidden, d, bias=False)
        self.g_b_proj = nn.Linear(d, inner, bias=False)
        self.o_norm = GatedRMSNorm(d, eps=spec.mixer.norm_eps, act="sigmoid")
        self.o_proj = nn.Linear(inner, hidden, bias=False)
        # bound by the model runner once the state pool is allocated
        self.state_cache: Any = None
        self.backend: Any = None
        self.group_id: int = -1

    @staticmethod
    def rename(suffix: str) -> Target:
        """Checkpoint ``q_proj.*``, ``k_proj.*``, ``v_proj.*`` -> (``qkv_proj.*``, 0 | 1 | 2)."""
        return fused_rename(suffix, "qkv_proj", (("q_proj", 0), ("k_proj", 1), ("v_proj", 2)))

    @property
    def conv_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v) filters, each [H*d, K]."""
        return tuple(
            c.weight.view(c.weight.shape[0], -1)
            for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        )

    def forget_gate(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] -> per-channel log decay [T, H, d], float32, <= 0."""
        f = self.f_b_proj(self.f_a_proj(hidden)).float() + self.dt_bias.float()
        f = f.view(-1, self.num_heads, self.head_dim)  # [T, H, d]
        return -self.A_log.float().view(self.num_heads, 1).exp() * F.softplus(f)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] (after the input norm) -> [T, D]."""
        t = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).chunk(3, dim=-1)  # [T, H*d] each
        g = self.forget_gate(hidden)
        beta = torch.sigmoid(self.b_proj(hidden))  # [T, H]
        meta = get_forward_context().attn_metadata[self.group_id]
        o = self.backend.forward(self, (q, k, v, g, beta), self.state_cache, meta)  # [T, H, d]
        gate = self.g_b_proj(self.g_a_proj(hidden)).view(t, self.num_heads, self.head_dim)
        return self.o_proj(self.o_norm(o, gate).reshape(t, -1))
