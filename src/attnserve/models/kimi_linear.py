"""Kimi-Linear: Kimi delta attention (KDA) layers with an MLA layer every few, DeepSeek-style MoE.

Each decoder layer is pre-norm (RMSNorm) around a mixer and an MLP:
- mixer: ``KimiDeltaAttention`` (``layers/kda.py``, a state layer) or ``MLAAttention``
  (``layers/mla.py``) without positional encoding: transformers' ``KimiLinearAttention`` never
  rotates, and the released config says ``mla_use_nope: true``, so the reader drops RoPE from
  the layer's spec unless a config sets ``mla_use_nope`` to false explicitly;
- MLP: ``DeepseekMoE`` (sigmoid scores with a correction bias, renormalised, routed scaling,
  shared experts) where ``LayerSpec.moe`` says so, a SwiGLU MLP elsewhere. Checkpoints name the
  block ``block_sparse_moe`` (experts ``w1``/``w3``/``w2``) or ``mlp``.

Not here: the KDA arithmetic (``attention/state/kda.py``), MTP layers.
"""

from __future__ import annotations

import torch
from torch import nn

from attnserve.arch import LayerKind, LayerSpec, ModelArch
from attnserve.layers.kda import KimiDeltaAttention
from attnserve.layers.mla import MLAAttention
from attnserve.layers.moe import DeepseekMoE, GatedMLP
from attnserve.layers.norm import RMSNorm
from attnserve.models.base import CausalLM, dense_width

__all__ = ["KimiLinearForCausalLM"]


class KimiLinearDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        self.is_kda = spec.kind is LayerKind.KDA
        if self.is_kda:
            self.self_attn: nn.Module = KimiDeltaAttention(arch, spec)
        else:
            self.self_attn = MLAAttention(arch, spec)
        if spec.moe:
            self.mlp: nn.Module = DeepseekMoE(arch)
        else:
            self.mlp = GatedMLP(arch.hidden_size, dense_width(arch), arch.hidden_act)
        self.input_layernorm = RMSNorm(arch.hidden_size, eps=arch.norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps=arch.norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, carry: None) -> tuple[torch.Tensor, None]:
        h = self.input_layernorm(hidden)
        hidden = hidden + (self.self_attn(h) if self.is_kda else self.self_attn(positions, h))
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), None


class KimiLinearForCausalLM(CausalLM):
    extra_layers_are_mtp = True  # checkpoints keep their MTP layers after the last one
    renamed_layer_modules = (("block_sparse_moe.", "mlp."),)  # checkpoints use either name

    def __init__(self, arch: ModelArch):
        super().__init__(arch, lambda s: KimiLinearDecoderLayer(arch, s), RMSNorm(arch.hidden_size, eps=arch.norm_eps))
