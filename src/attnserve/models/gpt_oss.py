"""GPT-OSS (gpt-oss-20b, gpt-oss-120b).

What this file is: the decoder, in the Llama shape, with GPT-OSS's differences:
- attention with learned per-head sinks (``Attention(spec, sinks=True)``, loaded from
  ``self_attn.sinks``), q/k/v/o biases, YaRN RoPE, and sliding-window layers alternating with
  full ones (both already in each ``LayerSpec``);
- RMSNorm with float32 weights, the product taken before casting back (as transformers keeps
  these norms in float32);
- a ``SparseMoE`` on every layer: a router with a bias, a softmax over the top-k logits, and
  experts with biases and the clamped SwiGLU ``(up + 1) * gate * sigmoid(alpha * gate)``
  (its limit and alpha in ``arch.options``, a ``GptOssOptions``);
- loading the experts from the fused checkpoint layout (``gate_up_proj`` [E, H, 2I] with gate and
  up interleaved, ``down_proj`` [E, I, H], plus biases). The released MXFP4 checkpoints
  (``*_blocks`` + ``*_scales``) reach it in that layout, dequantised as they are read
  (``models/quantized.py``).

What it is not: an MXFP4 compute path (experts run in the model dtype, so gpt-oss-20b takes
about 42 GB in bf16), the harmony chat format, or reasoning-effort controls.
"""

from __future__ import annotations

import torch
from torch import nn

from attnserve.arch import LayerSpec, LlamaOptions, ModelArch
from attnserve.layers.attention import Attention
from attnserve.layers.linear import Target
from attnserve.layers.moe import FusedExperts, SparseMoE
from attnserve.models.base import CausalLM
from attnserve.models.llama import LlamaAttention

__all__ = ["GptOssForCausalLM"]

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
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        opts, moe = arch.options, arch.moe
        bias = opts.attention_bias
        self.self_attn = GptOssAttention(arch, spec, LlamaOptions(qkv_bias=bias, o_bias=bias))
        experts = FusedExperts(moe.num_experts, arch.hidden_size, moe.intermediate_size, bias=True,
                               swiglu_limit=opts.swiglu_limit, swiglu_alpha=opts.swiglu_alpha)
        self.mlp = SparseMoE(moe, experts, router_bias=True, softmax_after_topk=True)
        self.input_layernorm = GptOssRMSNorm(arch.hidden_size, arch.norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(arch.hidden_size, arch.norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, carry: None) -> tuple[torch.Tensor, None]:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), None


class GptOssForCausalLM(CausalLM):
    extra_layers_are_mtp = True  # checkpoints keep their MTP layers after the last one
    renamed_layer_modules = (("self_attn.sinks", "self_attn.attn.sinks"), ("mlp.router.", "mlp.gate."))

    def __init__(self, arch: ModelArch):
        if arch.moe is None:
            raise ValueError("gpt_oss: the config names no experts (num_local_experts)")
        super().__init__(arch, lambda s: GptOssDecoderLayer(arch, s), GptOssRMSNorm(arch.hidden_size, arch.norm_eps))

    def rename_layer(self, layer: int, suffix: str) -> Target:
        fused = _EXPERT_TENSORS.get(suffix.removeprefix("mlp.experts."))
        if suffix.startswith("mlp.experts.") and fused is not None:
            return "mlp.experts." + fused[0], (None, fused[1])
        return super().rename_layer(layer, suffix)
