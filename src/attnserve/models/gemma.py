"""The Gemma decoders: Gemma 1 (``gemma``), Gemma 2 (``gemma2``), Gemma 3 text (``gemma3_text``).

What the three share: zero-centred RMSNorm (weights stored as ``w - 1``, applied as
``x * (1 + w)`` in float32), embeddings scaled by ``sqrt(hidden_size)`` in the model dtype, a
GeGLU MLP (tanh-approximated GELU), tied input/output embeddings. Gemma 2 and 3 add a norm
after attention and a pair around the MLP (four per layer), alternating sliding/full layers,
attention-logit soft-capping (Gemma 2) and final-logit soft-capping; Gemma 3 adds q/k RMSNorm
and its own RoPE for sliding layers. Per-layer windows, RoPE, softmax scale
(``query_pre_attn_scalar ** -0.5``) and attention soft-cap come from ``LayerSpec``; the backend
applies the window and the soft-cap. The rest is read once from the config into
``GemmaOptions``.

What it is not: the Gemma 3 vision tower and its multimodal projector (a multimodal checkpoint
loads its language model only; image tokens and their bidirectional attention are not
supported), bidirectional EmbeddingGemma, Gemma 3n.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnserve.arch import LayerSpec, ModelArch, RopeConfig
from attnserve.core.forward_context import get_forward_context
from attnserve.layers.activation import gated, get_act_fn
from attnserve.layers.attention import Attention
from attnserve.layers.linear import MergedLinear, QKVLinear
from attnserve.layers.norm import RMSNorm
from attnserve.layers.rotary import RotaryEmbedding, get_rope
from attnserve.models.weights import load_named_weights

__all__ = ["GemmaForCausalLM", "GemmaOptions"]

# checkpoint prefixes of the language model inside a Gemma 3 multimodal checkpoint
# (transformers 5 spelling first, then the original one)
_LM_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
_SKIPPED_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


@dataclass(frozen=True, slots=True)
class GemmaOptions:
    act: str = "gelu_pytorch_tanh"
    norm_eps: float = 1e-6
    attention_bias: bool = False
    sandwich_norms: bool = False  # Gemma 2/3: post-attention norm and pre/post-MLP norms
    qk_norm: bool = False  # Gemma 3
    final_softcap: float | None = None

    @classmethod
    def from_arch(cls, arch: ModelArch) -> GemmaOptions:
        c = arch.hf_config
        mt = arch.model_type
        if c.get("use_bidirectional_attention"):
            raise ValueError(
                f"{mt}: use_bidirectional_attention=true (an embedding model) is not supported"
            )
        if mt == "gemma":
            # transformers reads hidden_act and treats the legacy "gelu" as the tanh approximation
            act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
            act = "gelu_pytorch_tanh" if act == "gelu" else act
        else:
            act = c.get("hidden_activation") or "gelu_pytorch_tanh"
        return cls(
            act=act,
            norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(c.get("attention_bias", False)),
            sandwich_norms=mt != "gemma",
            qk_norm=mt == "gemma3_text",
            final_softcap=_final_softcap(c, mt),
        )


def _final_softcap(c: Mapping[str, Any], mt: str) -> float | None:
    """Gemma 2's config class caps at 30 when the field is absent; an explicit null is no cap."""
    if mt == "gemma":
        return None
    cap = c.get("final_logit_softcapping", 30.0 if mt == "gemma2" else None)
    return None if cap is None else float(cap)


def _norm(dim: int, opts: GemmaOptions) -> RMSNorm:
    return RMSNorm(dim, eps=opts.norm_eps, zero_centered=True)


class GemmaAttention(nn.Module):
    def __init__(
        self, arch: ModelArch, spec: LayerSpec, opts: GemmaOptions, rope: RotaryEmbedding | None
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = (
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_size,
        )
        self.qkv_proj = QKVLinear(
            arch.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_size,
            bias=opts.attention_bias,
        )
        self.o_proj = nn.Linear(
            spec.num_heads * spec.head_size, arch.hidden_size, bias=opts.attention_bias
        )
        self.q_norm = _norm(spec.head_size, opts) if opts.qk_norm else None
        self.k_norm = _norm(spec.head_size, opts) if opts.qk_norm else None
        self.rotary_emb = rope
        self.attn = Attention(spec)  # window, scale and soft-cap travel in the spec

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.reshape(t, self.num_heads, self.head_size)  # [T, H, D]
        k = k.reshape(t, self.num_kv_heads, self.head_size)  # [T, Hkv, D]
        if self.q_norm is not None:  # Gemma 3: per-head RMSNorm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k, get_forward_context().token_seq_lens)
        out = self.attn(q.reshape(t, -1), k.reshape(t, -1), v)  # [T, H*D]
        return self.o_proj(out)


class GemmaMLP(nn.Module):
    """GeGLU: ``down(act(gate(x)) * up(x))`` with gate and up fused in one weight."""

    def __init__(self, hidden: int, inter: int, act: str):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [inter, inter], bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.gate_up_proj(x), self.act))


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, arch: ModelArch, spec: LayerSpec, opts: GemmaOptions, rope: RotaryEmbedding | None
    ):
        super().__init__()
        d = arch.hidden_size
        self.self_attn = GemmaAttention(arch, spec, opts, rope)
        self.mlp = GemmaMLP(d, arch.hf_config["intermediate_size"], opts.act)
        self.input_layernorm = _norm(d, opts)
        # Gemma 1: the norm before the MLP; Gemma 2/3: the norm of the attention output
        self.post_attention_layernorm = _norm(d, opts)
        self.sandwich = opts.sandwich_norms
        if opts.sandwich_norms:
            self.pre_feedforward_layernorm = _norm(d, opts)
            self.post_feedforward_layernorm = _norm(d, opts)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if not self.sandwich:
            hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        attn = self.self_attn(positions, self.input_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class GemmaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.arch = arch
        opts = GemmaOptions.from_arch(arch)
        self.final_softcap = opts.final_softcap
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        # float32 first, then the model dtype at use: the same rounding as transformers
        self.register_buffer(
            "embed_scale",
            torch.tensor(math.sqrt(arch.hidden_size), dtype=torch.float32),
            persistent=False,
        )
        ropes: dict[RopeConfig, RotaryEmbedding] = {}  # one table per distinct RoPE (local, global)

        def rope_for(spec: LayerSpec) -> RotaryEmbedding | None:
            if spec.rope is None:
                return None
            if spec.rope not in ropes:
                ropes[spec.rope] = get_rope(spec.rope, spec.head_size)
            return ropes[spec.rope]

        self.layers = nn.ModuleList(
            GemmaDecoderLayer(arch, s, opts, rope_for(s)) for s in arch.layers
        )
        self.norm = _norm(arch.hidden_size, opts)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, D]
        hidden = hidden * self.embed_scale.to(hidden.dtype)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.final_softcap is not None:
            logits = self.final_softcap * torch.tanh(logits / self.final_softcap)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, self._rename)

    def _rename(self, name: str):
        """Checkpoint name -> (parameter, shard), the parameter name, or None to skip."""
        if name.startswith(_SKIPPED_PREFIXES) or "rotary_emb" in name:
            return None
        for prefix in _LM_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if name == "lm_head.weight":
            return None if self.arch.tie_word_embeddings else name
        for proj, shard in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
            if f"self_attn.{proj}." in name:
                return name.replace(proj, "qkv_proj"), shard
        for proj, shard in (("gate_proj", 0), ("up_proj", 1)):
            if f"mlp.{proj}." in name:
                return name.replace(proj, "gate_up_proj"), shard
        return name
