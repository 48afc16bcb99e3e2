"""Jamba (AI21 Jamba v0.1 / 1.5): Mamba-1 layers with a softmax attention layer every few.

Each decoder layer is pre-norm (RMSNorm) around a mixer and a feed-forward block:
- mixer: ``MambaMixer`` (``layers/mamba.py``, a state layer, with Jamba's dt/B/C RMSNorms) or
  Llama-style attention without any positional encoding (``LayerSpec.rope`` is None);
- feed-forward: where ``LayerSpec.moe``, a ``SparseMoE`` whose top-k softmax weights are *not*
  renormalised (Jamba's router; the checkpoint calls it ``router``), else a SwiGLU MLP.
The layer pattern (``attn_layer_period``/``offset``, ``expert_layer_period``/``offset``) comes
from ``ModelArch``, the Mamba constants from ``LayerSpec.mixer``. Norm names follow the checkpoint:
``input_layernorm``, ``pre_ff_layernorm``, ``final_layernorm`` (the skeleton's ``norm``).

Not here: Mamba-2, the training-only load-balancing loss.
"""

from __future__ import annotations

import torch
from torch import nn

from attnserve.arch import LayerKind, LayerSpec, LlamaOptions, ModelArch
from attnserve.layers.mamba import MambaMixer
from attnserve.layers.moe import FusedExperts, GatedMLP, SparseMoE
from attnserve.layers.norm import RMSNorm
from attnserve.models.base import CausalLM, dense_width
from attnserve.models.llama import LlamaAttention

__all__ = ["JambaForCausalLM"]


def _feed_forward(arch: ModelArch, spec: LayerSpec) -> nn.Module:
    if not spec.moe:
        return GatedMLP(arch.hidden_size, dense_width(arch), arch.hidden_act)
    moe = arch.moe  # norm_topk_prob False: Jamba keeps the raw top-k softmax weights
    return SparseMoE(moe, FusedExperts(moe.num_experts, arch.hidden_size, moe.intermediate_size, act=arch.hidden_act))


class JambaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        self.is_mamba = spec.kind is LayerKind.MAMBA
        if self.is_mamba:
            self.mamba = MambaMixer(arch, spec)
        else:
            self.self_attn = LlamaAttention(arch, spec, LlamaOptions())
        self.feed_forward = _feed_forward(arch, spec)
        self.input_layernorm = RMSNorm(arch.hidden_size, eps=arch.norm_eps)
        self.pre_ff_layernorm = RMSNorm(arch.hidden_size, eps=arch.norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, carry: None) -> tuple[torch.Tensor, None]:
        h = self.input_layernorm(hidden)
        hidden = hidden + (self.mamba(h) if self.is_mamba else self.self_attn(positions, h))
        return hidden + self.feed_forward(self.pre_ff_layernorm(hidden)), None


class JambaForCausalLM(CausalLM):
    extra_layers_are_mtp = True  # checkpoints keep their MTP layers after the last one
    renamed_modules = (("final_layernorm.", "norm."),)
    renamed_layer_modules = (("feed_forward.router.", "feed_forward.gate."),)

    def __init__(self, arch: ModelArch):
        super().__init__(arch, lambda s: JambaDecoderLayer(arch, s), RMSNorm(arch.hidden_size, eps=arch.norm_eps))
