"""The Gemma decoders: Gemma 1 (``gemma``), Gemma 2 (``gemma2``), Gemma 3 text (``gemma3_text``).

What the three share: zero-centred RMSNorm (weights stored as ``w - 1``, applied as
``x * (1 + w)`` in float32), embeddings scaled by ``sqrt(hidden_size)`` in the model dtype, a
GeGLU MLP (tanh-approximated GELU), tied input/output embeddings. Gemma 2 and 3 add a norm
after attention and a pair around the MLP (four per layer), alternating sliding/full layers,
attention-logit soft-capping (Gemma 2) and final-logit soft-capping; Gemma 3 adds q/k RMSNorm
and its own RoPE for sliding layers. Per-layer windows, RoPE, softmax scale
(``query_pre_attn_scalar ** -0.5``) and attention soft-cap come from ``LayerSpec``; the backend
applies the window and the soft-cap. The final soft-cap is ``ModelArch.final_softcap`` (applied
by ``CausalLM.compute_logits``); the rest is ``arch.options``, a ``GemmaOptions``.

What it is not: the Gemma 3 vision tower and its multimodal projector (a multimodal checkpoint
loads its language model only; image tokens and their bidirectional attention are not
supported), bidirectional EmbeddingGemma, Gemma 3n.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from attnserve.arch import GemmaOptions, LayerSpec, ModelArch, RopeConfig
from attnserve.layers.attention import Attention
from attnserve.layers.linear import QKVLinear, qkv_rename
from attnserve.layers.moe import GatedMLP
from attnserve.layers.norm import RMSNorm
from attnserve.layers.rotary import RotaryEmbedding, get_rope
from attnserve.models.base import CausalLM, dense_width

__all__ = ["GemmaForCausalLM"]


def _norm(dim: int, arch: ModelArch) -> RMSNorm:
    return RMSNorm(dim, eps=arch.norm_eps, zero_centered=True)


class GemmaAttention(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec, rope: RotaryEmbedding | None):
        super().__init__()
        opts: GemmaOptions = arch.options
        self.num_heads, self.num_kv_heads, self.head_size = spec.num_heads, spec.num_kv_heads, spec.head_size
        self.qkv_proj = QKVLinear(arch.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_size,
                                  bias=opts.attention_bias)
        self.o_proj = nn.Linear(spec.num_heads * spec.head_size, arch.hidden_size, bias=opts.attention_bias)
        self.q_norm = _norm(spec.head_size, arch) if opts.qk_norm else None
        self.k_norm = _norm(spec.head_size, arch) if opts.qk_norm else None
        self.rotary_emb = rope
        self.attn = Attention(spec)  # window, scale and soft-cap travel in the spec

    rename = staticmethod(qkv_rename)  # the checkpoint's q_proj/k_proj/v_proj

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.reshape(t, self.num_heads, self.head_size)  # [T, H, D]
        k = k.reshape(t, self.num_kv_heads, self.head_size)  # [T, Hkv, D]
        if self.q_norm is not None:  # Gemma 3: per-head RMSNorm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn(q, k, v, positions, self.rotary_emb)  # [T, H*D]; RoPE in attn
        return self.o_proj(out)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec, rope: RotaryEmbedding | None):
        super().__init__()
        d = arch.hidden_size
        self.self_attn = GemmaAttention(arch, spec, rope)
        self.mlp = GatedMLP(d, dense_width(arch), arch.hidden_act)  # GeGLU
        self.input_layernorm = _norm(d, arch)
        # Gemma 1: the norm before the MLP; Gemma 2/3: the norm of the attention output
        self.post_attention_layernorm = _norm(d, arch)
        self.sandwich = arch.options.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = _norm(d, arch)
            self.post_feedforward_layernorm = _norm(d, arch)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, carry: None) -> tuple[torch.Tensor, None]:
        if not self.sandwich:
            hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
            return hidden + self.mlp(self.post_attention_layernorm(hidden)), None
        attn = self.self_attn(positions, self.input_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp), None


class GemmaForCausalLM(CausalLM):
    # a Gemma 3 multimodal checkpoint: its vision tower and projector are skipped; the language
    # model's prefix in transformers 5's spelling first, then the original one
    skipped_prefixes = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                        "model.multi_modal_projector.")
    stripped_prefixes = ("model.language_model.", "language_model.model.", "language_model.", "model.")

    def __init__(self, arch: ModelArch):
        ropes: dict[RopeConfig, RotaryEmbedding] = {}  # one table per distinct RoPE (local, global)

        def layer(spec: LayerSpec) -> GemmaDecoderLayer:
            if spec.rope is not None and spec.rope not in ropes:
                ropes[spec.rope] = get_rope(spec.rope, spec.head_size)
            return GemmaDecoderLayer(arch, spec, ropes.get(spec.rope))

        super().__init__(arch, layer, _norm(arch.hidden_size, arch))
        # float32 first, then the model dtype at use: the same rounding as transformers
        self.register_buffer("embed_scale", torch.tensor(math.sqrt(arch.hidden_size), dtype=torch.float32),
                             persistent=False)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, D]
        return hidden * self.embed_scale.to(hidden.dtype)
