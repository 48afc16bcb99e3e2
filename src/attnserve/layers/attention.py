"""The attention layer of standard models: holds its spec, and delegates to its backend.

The model computes q, k, v (projections, q/k norms) and hands them over with its RoPE; this layer
rotates q and k (``RotaryEmbedding``) and hands them to the backend chosen for its KV cache group,
with the layer's cache and the step's metadata, or, where the backend fuses RoPE into its cache
write (``AttentionBackend.fuses_rope``) and the rotation depends on the position alone, leaves
the rotation to the backend (``forward_rope``). A per-head q/k RMSNorm (``qk_norm``, Qwen3) runs
before the rotation: here, or in the backend's fused kernel along with it where the rotation is
left to the backend and the norms are plain RMSNorms in q's dtype. ALiBi slopes, learned sinks
and soft-capping are layer properties the backend reads.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from attnserve.arch import LayerSpec
from attnserve.core.forward_context import get_forward_context

if TYPE_CHECKING:
    from attnserve.layers.norm import RMSNorm
    from attnserve.layers.rotary import RotaryEmbedding

__all__ = ["Attention"]


class Attention(nn.Module):
    def __init__(self, spec: LayerSpec, *, sinks: bool = False, alibi_slopes: torch.Tensor | None = None):
        super().__init__()
        self.layer_id = spec.index
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_size = spec.head_size
        self.head_size_v = spec.head_size_v
        self.scale = spec.scale
        self.window = spec.window
        self.softcap = spec.softcap
        self.sinks = nn.Parameter(torch.zeros(spec.num_heads)) if sinks else None
        if alibi_slopes is not None:
            self.register_buffer("alibi_slopes", alibi_slopes.float(), persistent=False)
        else:
            self.alibi_slopes = None
        self.k_scale = 1.0
        self.v_scale = 1.0
        # bound by the model runner once the KV cache is allocated
        self.backend: Any = None
        self.group_id: int = -1
        self.kv_cache: Any = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor | None = None, rope: RotaryEmbedding | None = None,
                qk_norm: tuple[RMSNorm, RMSNorm] | None = None) -> torch.Tensor:
        """q [T, H*D] or [T, H, D], k [T, Hkv*D] or [T, Hkv, D], v [T, Hkv*Dv] -> [T, H*Dv].

        With ``rope`` (and the tokens' ``positions``), q and k are rotated here or in the backend;
        with ``qk_norm`` (q_norm, k_norm), each q and k head is normalised first, likewise.
        """
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_size)
        k = k.view(t, self.num_kv_heads, self.head_size)
        v = v.view(t, self.num_kv_heads, self.head_size_v)
        ctx = get_forward_context()
        meta = ctx.attn_metadata[self.group_id]
        if rope is not None and positions is None:
            raise ValueError("rope needs the tokens' positions")
        table = rope.position_table(positions) if rope is not None and self.backend.fuses_rope else None
        if qk_norm is not None:
            fused = _fusable_norms(qk_norm, q, k) if table is not None else None
            if fused is None:
                q, k = qk_norm[0](q), qk_norm[1](k)
            else:
                table = replace(table, qk_norm=fused)
        if table is not None:
            out = self.backend.forward_rope(self, q, k, v, self.kv_cache, meta, table)
            return out.reshape(t, self.num_heads * self.head_size_v)
        if rope is not None:
            q, k = rope(positions, q, k, ctx.token_seq_lens)
        out = self.backend.forward(self, q, k, v, self.kv_cache, meta)
        return out.reshape(t, self.num_heads * self.head_size_v)


def _fusable_norms(qk_norm: tuple[RMSNorm, RMSNorm], q: torch.Tensor,
                   k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, float] | None:
    """The norms as ``RopeTable.qk_norm`` where a fused kernel rounds as they do: plain (not
    zero-centred) RMSNorms whose weights have q's and k's dtype; None otherwise."""
    q_norm, k_norm = qk_norm
    if any(getattr(n, "zero_centered", True) for n in qk_norm):
        return None
    if q_norm.weight.dtype != q.dtype or k_norm.weight.dtype != k.dtype:
        return None
    return q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps
