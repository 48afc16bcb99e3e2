"""MiniMax-Text-01 / MiniMax-M1: lightning attention layers with a softmax layer every few, MoE.

Each decoder layer uses DeepNorm-style residuals, where the residual is the *normalised* input::

    h = RMSNorm_in(x);  x1 = alpha_attn * h + beta_attn * mixer(h)
    h2 = RMSNorm_post(x1);  out = alpha_mlp * h2 + beta_mlp * MoE(h2)

- mixer: ``LightningAttention`` (``layers/lightning.py``, a state layer) or Llama-style GQA with
  RoPE (``LayerSpec.rope``); the alpha/beta factors differ between the two kinds;
- MoE: every layer a ``SparseMoE`` (softmax top-k, renormalised), named ``block_sparse_moe``
  with experts ``w1``/``w3``/``w2`` in the checkpoint.
The factors are ``arch.options`` (a ``MiniMaxOptions``), read under transformers' names
(``linear_attn_alpha_factor``, ...) or MiniMax's original ones (``layernorm_linear_attention_alpha``,
...) by ``arch.families.deepnorm_factors``; missing ones are 1.

Not here: MiniMax-M2 (``minimax_m2``, a plain softmax-attention MoE), the vision towers of
MiniMax-VL.
"""

from __future__ import annotations

import torch
from torch import nn

from attnserve.arch import LayerKind, LayerSpec, LlamaOptions, ModelArch
from attnserve.layers.lightning import LightningAttention
from attnserve.layers.moe import FusedExperts, SparseMoE
from attnserve.layers.norm import RMSNorm
from attnserve.models.base import CausalLM
from attnserve.models.llama import LlamaAttention

__all__ = ["MiniMaxForCausalLM"]


class MiniMaxDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        self.is_lightning = spec.kind is LayerKind.LIGHTNING
        if self.is_lightning:
            self.self_attn: nn.Module = LightningAttention(arch, spec)
        else:
            self.self_attn = LlamaAttention(arch, spec, LlamaOptions())
        moe = arch.moe
        self.block_sparse_moe = SparseMoE(
            moe, FusedExperts(moe.num_experts, arch.hidden_size, moe.intermediate_size, act=arch.hidden_act)
        )
        self.input_layernorm = RMSNorm(arch.hidden_size, eps=arch.norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps=arch.norm_eps)
        f = arch.options.lightning if self.is_lightning else arch.options.full
        self.alpha_attn, self.beta_attn, self.alpha_mlp, self.beta_mlp = (
            f.alpha_attn, f.beta_attn, f.alpha_mlp, f.beta_mlp
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, carry: None) -> tuple[torch.Tensor, None]:
        h = self.input_layernorm(hidden)
        mixed = self.self_attn(h) if self.is_lightning else self.self_attn(positions, h)
        h = self.post_attention_layernorm(h * self.alpha_attn + mixed * self.beta_attn)
        return h * self.alpha_mlp + self.block_sparse_moe(h) * self.beta_mlp, None


class MiniMaxForCausalLM(CausalLM):
    extra_layers_are_mtp = True  # checkpoints keep their MTP layers after the last one

    def __init__(self, arch: ModelArch):
        if arch.moe is None:
            raise ValueError(f"{arch.model_type}: MiniMax needs a MoE spec (num_local_experts)")
        super().__init__(arch, lambda s: MiniMaxDecoderLayer(arch, s), RMSNorm(arch.hidden_size, eps=arch.norm_eps))
