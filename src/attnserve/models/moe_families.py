"""Mixture-of-experts decoders of the Llama shape: mixtral, qwen3_moe and glm4_moe.

Each is Llama's pre-norm decoder (``LlamaAttention`` from ``models/llama.py``: fused QKV, RoPE,
paged attention; its switches in ``arch.options``) with the MLP of some layers replaced by a
block from ``layers/moe.py``:
- mixtral: every layer a ``SparseMoE`` (softmax, top-k, renormalised); the checkpoint calls the
  block ``block_sparse_moe`` and its experts ``w1``/``w3``/``w2``; sliding window if configured.
- qwen3_moe: q/k RMSNorm; a ``SparseMoE`` (``norm_topk_prob``) where ``decoder_sparse_step`` and
  ``mlp_only_layers`` put one, a dense SwiGLU MLP elsewhere.
- glm4_moe: partial rotary (``partial_rotary_factor`` 0.5), q/k/v bias, optional q/k RMSNorm
  (``use_qk_norm``); a ``DeepseekMoE`` (sigmoid scores + correction bias, grouped ``noaux_tc``
  choice, shared expert, routed scaling) from layer ``first_k_dense_replace`` on. The MTP layers
  the checkpoint stores past ``num_hidden_layers`` are skipped.

It is not: qwen2_moe (a sigmoid-gated shared expert), MTP speculative decoding, quantised
expert kernels (fp8 checkpoints are dequantised as they are read: ``models/quantized.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from attnserve.arch import LayerSpec, ModelArch
from attnserve.layers.moe import DeepseekMoE, FusedExperts, GatedMLP, SparseMoE
from attnserve.layers.norm import RMSNorm
from attnserve.models.base import CausalLM
from attnserve.models.llama import LlamaAttention

__all__ = ["MoEForCausalLM"]

# the families whose router is DeepSeek's (float32, sigmoid scores with a correction bias,
# shared experts) rather than a plain linear gate in the model dtype
_DEEPSEEK_ROUTED = frozenset({"glm4_moe"})


def _mlp(arch: ModelArch, spec: LayerSpec) -> nn.Module:
    if not spec.moe:
        return GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act)
    if arch.model_type in _DEEPSEEK_ROUTED:
        return DeepseekMoE(arch)
    moe = arch.moe
    experts = FusedExperts(moe.num_experts, arch.hidden_size, moe.intermediate_size, act=arch.hidden_act)
    return SparseMoE(moe, experts)


class MoEDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        self.self_attn = LlamaAttention(arch, spec, arch.options)
        self.mlp = _mlp(arch, spec)
        self.input_layernorm = RMSNorm(arch.hidden_size, eps=arch.norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps=arch.norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, carry: None) -> tuple[torch.Tensor, None]:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), None


class MoEForCausalLM(CausalLM):
    extra_layers_are_mtp = True  # checkpoints keep their MTP layers after the last one
    renamed_layer_modules = (("block_sparse_moe.", "mlp."),)  # Mixtral's name of the MoE block

    def __init__(self, arch: ModelArch):
        super().__init__(arch, lambda s: MoEDecoderLayer(arch, s), RMSNorm(arch.hidden_size, eps=arch.norm_eps))
