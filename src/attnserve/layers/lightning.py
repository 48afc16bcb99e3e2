"""The lightning attention layer of MiniMax-Text-01 / MiniMax-M1 (linear attention with decay).

``LightningAttention.forward(hidden [T, D]) -> [T, D]``: ``[q | k | v] = act(qkv_proj(h))`` laid
out per head as [q | k | v] (no RoPE, no softmax, no 1/sqrt(d)); the backend
(``TORCH_LIGHTNING``) computes ``o_t = sum_{j<=t} lambda_h^(t-j) (q_t . k_j) v_j`` over the
sequence's state and its new tokens, with the per-head decay ``lambda_h = exp(-s_h)`` of this
layer (``decay_rates``, float32); then ``out_proj(sigmoid(output_gate(h)) * RMSNorm(o))``, the
norm taken over all heads at once. The runner binds ``state_cache`` (recurrent
``[slots, H, d, d]``, no conv), ``backend`` and ``group_id``.

Not here: the block/recurrent arithmetic (``attention/state/lightning.py``), the DeepNorm
residuals around the layer (``models/minimax.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnserve.arch import LayerSpec, LightningDims, ModelArch
from attnserve.attention.state import lightning_decay_rates
from attnserve.core.forward_context import get_forward_context
from attnserve.layers.activation import get_act_fn
from attnserve.layers.linear import Target
from attnserve.layers.norm import RMSNorm

__all__ = ["LightningAttention"]

_NORM_EPS = 1e-6  # transformers builds this norm with the RMSNorm default, not rms_norm_eps
# decay tables MiniMax checkpoints store; recomputed here from the layer index
_CHECKPOINT_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


class LightningAttention(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        if not isinstance(spec.mixer, LightningDims):
            raise ValueError(f"layer {spec.index}: LightningAttention needs LayerSpec.mixer (LightningDims)")
        self.layer_id = spec.index
        self.num_heads, self.head_dim = spec.num_heads, spec.head_size
        inner = self.num_heads * self.head_dim
        self.block_size = spec.mixer.block_size
        self.act = get_act_fn(arch.hidden_act)
        self.qkv_proj = nn.Linear(arch.hidden_size, 3 * inner, bias=False)
        self.output_gate = nn.Linear(arch.hidden_size, inner, bias=False)
        self.out_proj = nn.Linear(inner, arch.hidden_size, bias=False)
        self.norm = RMSNorm(inner, eps=_NORM_EPS)
        rates = lightning_decay_rates(self.num_heads, spec.index, arch.num_layers)
        self.register_buffer("decay_rates", rates, persistent=False)  # [H] float32
        # bound by the model runner once the state pool is allocated
        self.state_cache: Any = None
        self.backend: Any = None
        self.group_id: int = -1

    @staticmethod
    def rename(suffix: str) -> Target:
        """The checkpoint's decay tables are skipped (None); other names are this module's own."""
        return None if suffix in _CHECKPOINT_BUFFERS else suffix

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] (after the input norm) -> [T, D]."""
        t = hidden.shape[0]
        qkv = self.act(self.qkv_proj(hidden)).view(t, self.num_heads, 3 * self.head_dim)
        q, k, v = qkv.split(self.head_dim, dim=-1)  # [T, H, d] each
        meta = get_forward_context().attn_metadata[self.group_id]
        o = self.backend.forward(self, (q, k, v), self.state_cache, meta)  # [T, H, d]
        o = self.norm(o.reshape(t, self.num_heads * self.head_dim))
        return self.out_proj(torch.sigmoid(self.output_gate(hidden)) * o)
