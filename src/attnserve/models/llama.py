"""The Llama-style decoder and the families that share it.

llama (Llama 1/2 MHA, Llama 3 GQA), mistral (sliding window), qwen2 (QKV bias), qwen3 (q/k
RMSNorm, head_dim apart from hidden/heads), phi3 (checkpoints with fused qkv and gate_up) and
starcoder2 (LayerNorm with biases, a plain GELU MLP). The differences are read once from the
config into ``LlamaOptions``; the forward is one code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnserve.arch import LayerSpec, ModelArch
from attnserve.core.forward_context import get_forward_context
from attnserve.layers.activation import gated, get_act_fn
from attnserve.layers.attention import Attention
from attnserve.layers.linear import MergedLinear, QKVLinear
from attnserve.layers.norm import LayerNorm, RMSNorm
from attnserve.layers.rotary import get_rope
from attnserve.models.weights import load_named_weights

__all__ = ["LlamaForCausalLM", "LlamaOptions"]


@dataclass(frozen=True, slots=True)
class LlamaOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    gated_mlp: bool = True  # SwiGLU (gate/up/down) or a plain fc -> act -> proj MLP
    layer_norm: bool = False  # LayerNorm with bias instead of RMSNorm
    norm_eps: float = 1e-6
    act: str = "silu"

    @classmethod
    def from_arch(cls, arch: ModelArch) -> LlamaOptions:
        c = arch.hf_config
        mt = arch.model_type
        if mt == "starcoder2":
            bias = bool(c.get("use_bias", True))
            return cls(qkv_bias=bias, o_bias=bias, mlp_bias=bias, gated_mlp=False, layer_norm=True,
                       norm_eps=c.get("norm_epsilon", 1e-5), act=c.get("hidden_act", "gelu_pytorch_tanh"))
        attention_bias = bool(c.get("attention_bias", False))
        return cls(
            qkv_bias=True if mt == "qwen2" else attention_bias,
            o_bias=attention_bias if mt != "qwen2" else False,
            mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=mt == "qwen3",
            norm_eps=c.get("rms_norm_eps", 1e-6),
            act=c.get("hidden_act", "silu"),
        )


def _add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): one fused kernel for RMSNorm on CUDA."""
    if isinstance(norm, RMSNorm):
        return norm(x, residual)
    residual = x + residual
    return norm(residual), residual


def _norm(dim: int, opts: LlamaOptions) -> nn.Module:
    return LayerNorm(dim, eps=opts.norm_eps) if opts.layer_norm else RMSNorm(dim, eps=opts.norm_eps)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec, opts: LlamaOptions):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = spec.num_heads, spec.num_kv_heads, spec.head_size
        self.qkv_proj = QKVLinear(arch.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_size,
                                  bias=opts.qkv_bias)
        self.o_proj = nn.Linear(spec.num_heads * spec.head_size, arch.hidden_size, bias=opts.o_bias)
        self.q_norm = RMSNorm(spec.head_size, opts.norm_eps) if opts.qk_norm else None
        self.k_norm = RMSNorm(spec.head_size, opts.norm_eps) if opts.qk_norm else None
        self.rotary_emb = get_rope(spec.rope, spec.head_size)
        self.attn = Attention(spec)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.reshape(t, self.num_heads, self.head_size)  # [T, H, D]
        k = k.reshape(t, self.num_kv_heads, self.head_size)  # [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k, get_forward_context().token_seq_lens)
        return self.o_proj(self.attn(q.reshape(t, -1), k.reshape(t, -1), v))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, opts: LlamaOptions):
        super().__init__()
        self.act = get_act_fn(opts.act)
        self.gated = opts.gated_mlp
        if opts.gated_mlp:
            self.gate_up_proj = MergedLinear(hidden, [inter, inter], bias=opts.mlp_bias)
            self.down_proj = nn.Linear(inter, hidden, bias=opts.mlp_bias)
        else:
            self.c_fc = nn.Linear(hidden, inter, bias=opts.mlp_bias)
            self.c_proj = nn.Linear(inter, hidden, bias=opts.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(gated(self.gate_up_proj(x), self.act))
        return self.c_proj(self.act(self.c_fc(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec, opts: LlamaOptions):
        super().__init__()
        self.self_attn = LlamaAttention(arch, spec, opts)
        self.mlp = LlamaMLP(arch.hidden_size, arch.hf_config["intermediate_size"], opts)
        self.input_layernorm = _norm(arch.hidden_size, opts)
        self.post_attention_layernorm = _norm(arch.hidden_size, opts)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual adds are fused into the next norm: returns (block output, residual)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = _add_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = _add_norm(self.post_attention_layernorm, hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.arch = arch
        opts = LlamaOptions.from_arch(arch)
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, s, opts) for s in arch.layers)
        self.norm = _norm(arch.hidden_size, opts)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return _add_norm(self.norm, hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights) -> None:
        tied = self.arch.tie_word_embeddings

        def rename(name: str):
            if name.startswith("model."):
                name = name[len("model."):]
            if "rotary_emb" in name:
                return None
            if name == "lm_head.weight":
                return None if tied else name
            for proj, shard in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
                if f"self_attn.{proj}." in name:
                    return name.replace(proj, "qkv_proj"), shard
            for proj, shard in (("gate_proj", 0), ("up_proj", 1)):
                if f"mlp.{proj}." in name:
                    return name.replace(proj, "gate_up_proj"), shard
            return name

        load_named_weights(self, weights, rename)
