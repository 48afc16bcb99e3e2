"""Native sparse attention (NSA), the attention module of fla-org's ``NSAForCausalLM``.

What this file is: the projections of one NSA layer and the hand-off to its backend. From the
normed hidden state x it computes q [H, D], k and v [Hkv, D] (``q_proj``/``k_proj``/``v_proj``,
fused into ``qkv_proj`` here, with FLA's optional bias), RoPE on q and k over the whole head
(NeoX half-split), the gates ``sigmoid(g_proj x)`` laid out [H, 3] (compression, selection,
window: FLA's ``'(h d) -> h d', d=3``), and applies ``o_proj`` (no bias) to what the backend
returns. The layer owns one paged K/V cache (``LayerKind.NSA`` -> ``FullAttentionSpec``); the
runner binds ``layer_id``, ``kv_cache``, ``backend`` and ``group_id`` on it.

What it is not: no attention arithmetic. Compression, block selection, the window and the gated
sum are the backend's (``attention/backends/torch_nsa.py``, whose ``nsa_attention`` states the
math).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnserve.arch import LayerSpec
from attnserve.core.forward_context import get_forward_context
from attnserve.layers.linear import QKVLinear, qkv_rename
from attnserve.layers.rotary import get_rope

__all__ = ["NSAAttention"]


class NSAAttention(nn.Module):
    """One NSA layer's attention: ``forward(positions [T], hidden [T, D]) -> [T, D]``."""

    def __init__(self, hidden_size: int, spec: LayerSpec, *, qkv_bias: bool = False):
        super().__init__()
        if spec.nsa is None:
            raise ValueError(f"layer {spec.index}: NSAAttention needs LayerSpec.nsa")
        self.num_heads, self.num_kv_heads, self.head_size = spec.num_heads, spec.num_kv_heads, spec.head_size
        self.scale = spec.scale
        self.nsa_block_size = spec.nsa.block_size
        self.num_selected = spec.nsa.num_selected
        self.window = spec.nsa.window
        self.qkv_proj = QKVLinear(hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_size, bias=qkv_bias)
        self.g_proj = nn.Linear(hidden_size, spec.num_heads * 3, bias=False)
        self.o_proj = nn.Linear(spec.num_heads * spec.head_size, hidden_size, bias=False)
        self.rotary_emb = get_rope(spec.rope, spec.head_size)
        # bound by the model runner once the KV cache is allocated
        self.layer_id = spec.index
        self.backend: Any = None
        self.group_id: int = -1
        self.kv_cache: Any = None

    rename = staticmethod(qkv_rename)  # the checkpoint's q_proj/k_proj/v_proj

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.reshape(t, self.num_heads, self.head_size)  # [T, H, D]
        k = k.reshape(t, self.num_kv_heads, self.head_size)  # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, self.head_size)
        gates = torch.sigmoid(self.g_proj(hidden).view(t, self.num_heads, 3))  # [T, H, (cmp, slc, swa)]
        ctx = get_forward_context()
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k, ctx.token_seq_lens)
        meta = ctx.attn_metadata[self.group_id]
        out = self.backend.forward(self, q, k, v, self.kv_cache, meta, gates=gates)  # [T, H, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_size))
