"""The Mamba-1 mixer of Jamba: projections, Jamba's dt/B/C norms, and the output projection.

``MambaMixer.forward(hidden [T, D]) -> [T, D]``: ``[x | z] = in_proj(h)``; the backend
(``TORCH_MAMBA``) runs ``x`` through the short conv (with bias) and SiLU, asks the layer for the
token-wise SSM inputs (``ssm_params``: ``[dt | B | C] = x_proj(x)``, RMSNorms on each,
``dt = softplus(dt_proj(dt))``), and scans ``h <- exp(dt A) h + dt B x``, ``y = C.h + D x``, gated
by ``SiLU(z)``; then ``out_proj``. The runner binds ``state_cache`` (conv ``[slots, Di, K-1]``,
recurrent ``[slots, Di, N]``), ``backend`` and ``group_id``.

Parameter names follow the HF checkpoints (``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``,
``A_log``, ``D``, ``out_proj``, ``dt_layernorm``, ``b_layernorm``, ``c_layernorm``). Not here: the
scan arithmetic (``attention/state/mamba.py``), Mamba-2 (multi-head, grouped B/C).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.arch import LayerSpec, MambaDims, ModelArch
from attnserve.core.forward_context import get_forward_context
from attnserve.layers.norm import RMSNorm

__all__ = ["MambaMixer"]


class MambaMixer(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        dims = spec.mixer
        if spec.state is None or not isinstance(dims, MambaDims):
            raise ValueError(f"layer {spec.index}: MambaMixer needs LayerSpec.state and .mixer (MambaDims)")
        self.layer_id = spec.index
        ((inner, width),) = spec.state.conv  # [Di, K-1]
        ((_, d_state),) = spec.state.recurrent  # [Di, N]
        hidden = arch.hidden_size
        self.dt_rank = dims.dt_rank
        self.inner, self.d_state = inner, d_state
        proj_bias, eps = dims.proj_bias, dims.norm_eps
        self.in_proj = nn.Linear(hidden, 2 * inner, bias=proj_bias)
        self.conv1d = nn.Conv1d(
            inner, inner, width + 1, groups=inner, bias=dims.conv_bias
        )
        self.x_proj = nn.Linear(inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, inner, bias=True)
        a = torch.arange(1, d_state + 1, dtype=torch.float32).log()  # S4D-real init
        self.A_log = nn.Parameter(a.expand(inner, -1).clone())
        self.D = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, hidden, bias=proj_bias)
        self.dt_layernorm = RMSNorm(self.dt_rank, eps=eps)
        self.b_layernorm = RMSNorm(d_state, eps=eps)
        self.c_layernorm = RMSNorm(d_state, eps=eps)
        # bound by the model runner once the state pool is allocated
        self.state_cache: Any = None
        self.backend: Any = None
        self.group_id: int = -1

    @property
    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight.view(self.inner, -1)  # [Di, 1, K] -> [Di, K]

    @property
    def conv_bias(self) -> torch.Tensor | None:
        return self.conv1d.bias

    @property
    def A(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())  # [Di, N]

    def ssm_params(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, Di] after the conv -> (dt [T, Di] float32 after softplus, B [T, N], C [T, N])."""
        dt, b, c = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        dt = F.linear(dt, self.dt_proj.weight).float() + self.dt_proj.bias.float()
        return F.softplus(dt), b, c

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] (after the input norm) -> [T, D]."""
        x, z = self.in_proj(hidden).chunk(2, dim=-1)  # [T, Di] each
        meta = get_forward_context().attn_metadata[self.group_id]
        y = self.backend.forward(self, (x, z), self.state_cache, meta)  # [T, Di]
        return self.out_proj(y)
