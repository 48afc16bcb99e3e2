"""MPT (MosaicML): ALiBi with MPT's own slopes, fused ``Wqkv``, no biases, tied embeddings.

MPT's slopes are ``1 / 2 ** (i * alibi_bias_max / P)`` for ``i = 1..P``, ``P`` the next power of
two; for a head count that is not a power of two it keeps the odd-indexed slopes, then the
even-indexed ones, cut to ``num_heads`` (``mpt_alibi_slopes``). The bias ``-slope * (pos_q -
pos_k)`` is added after the softmax scale. ``Wqkv`` is ``[q | k | v]`` (with ``kv_n_heads`` KV
heads for MQA/GQA ``attn_type``), optionally clamped by ``clip_qkv``. ``no_bias`` (true in every
released MPT) drops the biases of the linears and LayerNorms; the MLP is ``expansion_ratio *
d_model`` wide with exact GELU. ``logit_scale`` multiplies the logits as MosaicML's code does
(``ModelArch.logit_scale``); the other switches are ``arch.options``, an ``MPTOptions``. The
checkpoint's ``wte``, ``blocks`` and ``norm_f`` are the skeleton's ``embed_tokens``, ``layers``,
``norm``.

transformers' MPT ignores ``alibi_bias_max`` (always 8), ``expansion_ratio`` (always 4),
``no_bias``, ``logit_scale`` and the MQA/GQA ``attn_type``; it agrees with this file for the
values every released MPT uses. Not here: ``qk_ln`` and ``prefix_lm`` (rejected).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from attnserve.arch import LayerSpec, ModelArch, MPTOptions
from attnserve.layers.attention import Attention
from attnserve.layers.linear import QKVLinear
from attnserve.layers.norm import LayerNorm
from attnserve.models.base import CausalLM, PlainMLP

__all__ = ["MPTForCausalLM", "mpt_alibi_slopes"]


def mpt_alibi_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> torch.Tensor:
    """MPT's ALiBi slopes [num_heads], float32 (equal to BLOOM's when ``alibi_bias_max`` is 8)."""
    pow2 = 2 ** math.ceil(math.log2(num_heads))
    exponents = torch.arange(1, pow2 + 1, dtype=torch.float32) * (alibi_bias_max / pow2)
    slopes = 1.0 / torch.pow(2, exponents)
    if pow2 != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


class MPTAttention(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec, opts: MPTOptions):
        super().__init__()
        self.clip_qkv = opts.clip_qkv
        self.Wqkv = QKVLinear(
            arch.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_size, bias=opts.bias
        )
        self.out_proj = nn.Linear(spec.num_heads * spec.head_size, arch.hidden_size, bias=opts.bias)
        self.attn = Attention(
            spec, alibi_slopes=mpt_alibi_slopes(spec.num_heads, opts.alibi_bias_max)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.Wqkv(hidden)
        if self.clip_qkv:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = self.Wqkv.split(qkv)
        return self.out_proj(self.attn(q, k, v))


class MPTBlock(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        d, opts = arch.hidden_size, arch.options
        self.norm_1 = LayerNorm(d, eps=arch.norm_eps, bias=opts.bias)
        self.attn = MPTAttention(arch, spec, opts)
        self.norm_2 = LayerNorm(d, eps=arch.norm_eps, bias=opts.bias)
        self.ffn = PlainMLP(d, arch.intermediate_size, arch.hidden_act, bias=opts.bias)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, carry: None) -> tuple[torch.Tensor, None]:
        hidden = hidden + self.attn(self.norm_1(hidden))
        return hidden + self.ffn(self.norm_2(hidden)), None


class MPTForCausalLM(CausalLM):
    stripped_prefixes = ("transformer.",)
    renamed_modules = (("wte.", "embed_tokens."), ("blocks.", "layers."), ("norm_f.", "norm."))

    def __init__(self, arch: ModelArch):
        norm = LayerNorm(arch.hidden_size, eps=arch.norm_eps, bias=arch.options.bias)
        super().__init__(arch, lambda s: MPTBlock(arch, s), norm)
