"""GPT-OSS (gpt-oss-20b, gpt-oss-120b).

What this file is: the decoder, in the Llama shape, with GPT-OSS's differences:
- attention with learned per-head sinks (``Attention(spec, sinks=True)``, loaded from
  ``self_attn.sinks``), q/k/v/o biases, YaRN RoPE, and sliding-window layers alternating with
  full ones (both already in each ``LayerSpec``);
- RMSNorm with float32 weights, the product taken before casting back (as transformers keeps
  these norms in float32);
- a ``SparseMoE`` on every layer: a router with a bias, a softmax over the top-k logits, and
  experts with biases and the clamped SwiGLU ``(up + 1) * gate * sigmoid(alpha * gate)``;
- loading the experts from the fused checkpoint layout (``gate_up_proj`` [E, H, 2I] with gate and
  up interleaved, ``down_proj`` [E, I, H], plus biases). The released MXFP4 checkpoints
  (``*_blocks`` + ``*_scales``) reach it in that layout, dequantised as they are read
  (``models/quantized.py``).

What it is not: an MXFP4 compute path (experts run in the model dtype, so gpt-oss-20b takes
about 42 GB in bf16), the harmony chat format, or reasoning-effort controls.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from attnserve.arch import LayerSpec, ModelArch
from attnserve.layers.attention import Attention
from attnserve.layers.moe import FusedExperts, SparseMoE
from attnserve.models.llama import LlamaAttention, LlamaOptions
from attnserve.models.moe_families import rename_decoder_weight
from attnserve.models.weights import load_named_weights

__all__ = ["GptOssForCausalLM"]

_LAYER_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.*)$")
# fused expert tensors of the checkpoint -> (FusedExperts parameter, shard layout)
_EXPERT_TENSORS = {
    "gate_up_proj": ("w13", "gate_up_interleaved"),
    "gate_up_proj_bias": ("w13_bias", "gate_up_interleaved"),
    "down_proj": ("w2", "down_transposed"),
    "down_proj_bias": ("w2_bias", "down_transposed"),
}


class GptOssRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class GptOssAttention(LlamaAttention):
    """Llama's attention with a learned sink logit per head (``self.attn.sinks``)."""

    def __init__(self, arch: ModelArch, spec: LayerSpec, opts: LlamaOptions):
        super().__init__(arch, spec, opts)
        self.attn = Attention(spec, sinks=True)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec, opts: LlamaOptions):
        super().__init__()
        c, moe = arch.hf_config, arch.moe
        self.self_attn = GptOssAttention(arch, spec, opts)
        experts = FusedExperts(
            moe.num_experts,
            arch.hidden_size,
            moe.intermediate_size,
            bias=True,
            swiglu_limit=float(c.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(c.get("swiglu_alpha", 1.702)),
        )
        self.mlp = SparseMoE(moe, experts, router_bias=True, softmax_after_topk=True)
        self.input_layernorm = GptOssRMSNorm(arch.hidden_size, opts.norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(arch.hidden_size, opts.norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class GptOssForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        if arch.moe is None:
            raise ValueError("gpt_oss: the config names no experts (num_local_experts)")
        self.arch = arch
        bias = bool(arch.hf_config.get("attention_bias", True))
        opts = LlamaOptions(
            qkv_bias=bias, o_bias=bias, norm_eps=arch.hf_config.get("rms_norm_eps", 1e-5)
        )
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(GptOssDecoderLayer(arch, s, opts) for s in arch.layers)
        self.norm = GptOssRMSNorm(arch.hidden_size, opts.norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, self._rename)

    def _rename(self, name: str):
        m = _LAYER_NAME.match(name)
        if m is not None and int(m.group(1)) < self.arch.num_layers:
            prefix, rest = f"layers.{m.group(1)}.", m.group(2)
            if rest == "self_attn.sinks":
                return prefix + "self_attn.attn.sinks"
            if rest.startswith("mlp.router."):
                return prefix + "mlp.gate." + rest[len("mlp.router.") :]
            fused = _EXPERT_TENSORS.get(rest.removeprefix("mlp.experts."))
            if rest.startswith("mlp.experts.") and fused is not None:
                return prefix + "mlp.experts." + fused[0], (None, fused[1])
        return rename_decoder_weight(self, name)
