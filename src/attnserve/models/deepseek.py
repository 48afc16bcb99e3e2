"""DeepSeek-V2/V3 decoders and the families that share them (deepseek_v2, deepseek_v3, kimi_k2,
and the sparse-MLA ones: deepseek_v32, glm_moe_dsa).

Each layer is MLA attention (``layers/mla.py``) and an MLP: a dense SwiGLU MLP for the first
``first_k_dense_replace`` layers (``LayerSpec.moe`` False), DeepSeek MoE after them (routed
experts with softmax greedy / group-limited greedy (V2) or sigmoid noaux_tc with a correction
bias (V3, V3.2, Kimi-K2, GLM-5), plus shared experts; ``layers/moe.py``). Kimi-K2 is
DeepSeek-V3 under its own model type. A config without MLA (``kv_lora_rank`` null, or
``qk_nope_head_dim`` and ``qk_rope_head_dim`` both 0) gets Llama's attention, as in vLLM.
DeepSeek-V3.2 and GLM-5 are the same decoder with DSA
attention (``LayerKind.SPARSE_MLA``: the lightning indexer selects each token's top-k keys);
each layer hands its top-k to the next as the skeleton's carry, so that a GLM-5 "shared" layer
reuses the previous full layer's selection (None before the first sparse layer and for dense
MLA).

Not here: the multi-token-prediction layer that V3 / V3.2 / GLM-5 checkpoints carry after the
last layer (its weights are skipped). FP8 block-quantised checkpoints (``weight_scale_inv``)
reach ``load_weights`` already dequantised (``models/quantized.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from attnserve.arch import LayerSpec, LlamaOptions, ModelArch
from attnserve.layers.mla import MLAAttention
from attnserve.layers.moe import DeepseekMoE, GatedMLP
from attnserve.layers.norm import RMSNorm
from attnserve.models.base import CausalLM, dense_width
from attnserve.models.llama import LlamaAttention

__all__ = ["DeepseekForCausalLM"]


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        # a config without MLA dims (or kv_lora_rank null) has plain attention layers, as in vLLM
        self.plain = spec.mla is None
        self.self_attn = LlamaAttention(arch, spec, LlamaOptions()) if self.plain else MLAAttention(arch, spec)
        if spec.moe:
            self.mlp: nn.Module = DeepseekMoE(arch)
        else:
            self.mlp = GatedMLP(arch.hidden_size, dense_width(arch), arch.hidden_act,
                                bias=arch.options.mlp_bias)
        self.input_layernorm = RMSNorm(arch.hidden_size, eps=arch.norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps=arch.norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, topk_indices: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(positions [T], hidden [T, D], previous top-k) -> (hidden [T, D], this layer's top-k)."""
        x = self.input_layernorm(hidden)
        if self.plain:
            attn = self.self_attn(positions, x)
        else:
            attn, topk_indices = self.self_attn.forward_with_topk(positions, x, topk_indices)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), topk_indices


class DeepseekForCausalLM(CausalLM):
    extra_layers_are_mtp = True  # checkpoints keep their MTP layers after the last one

    def __init__(self, arch: ModelArch):
        super().__init__(arch, lambda s: DeepseekDecoderLayer(arch, s), RMSNorm(arch.hidden_size, eps=arch.norm_eps))
