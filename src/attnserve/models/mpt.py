"""MPT (MosaicML): ALiBi with MPT's own slopes, fused ``Wqkv``, no biases, tied embeddings.

MPT's slopes are ``1 / 2 ** (i * alibi_bias_max / P)`` for ``i = 1..P``, ``P`` the next power of
two; for a head count that is not a power of two it keeps the odd-indexed slopes, then the
even-indexed ones, cut to ``num_heads`` (``mpt_alibi_slopes``). The bias ``-slope * (pos_q -
pos_k)`` is added after the softmax scale. ``Wqkv`` is ``[q | k | v]`` (with ``kv_n_heads`` KV
heads for MQA/GQA ``attn_type``), optionally clamped by ``clip_qkv``. ``no_bias`` (true in every
released MPT) drops the biases of the linears and LayerNorms; the MLP is ``expansion_ratio *
d_model`` wide with exact GELU. ``logit_scale`` multiplies the logits as MosaicML's code does.

transformers' MPT ignores ``alibi_bias_max`` (always 8), ``expansion_ratio`` (always 4),
``no_bias``, ``logit_scale`` and the MQA/GQA ``attn_type``; it agrees with this file for the
values every released MPT uses. Not here: ``qk_ln`` and ``prefix_lm`` (rejected).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.arch import LayerSpec, ModelArch
from attnserve.layers.attention import Attention
from attnserve.layers.linear import QKVLinear
from attnserve.layers.norm import LayerNorm
from attnserve.models.weights import load_named_weights

__all__ = ["MPTForCausalLM", "MPTOptions", "mpt_alibi_slopes"]


def mpt_alibi_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> torch.Tensor:
    """MPT's ALiBi slopes [num_heads], float32 (equal to BLOOM's when ``alibi_bias_max`` is 8)."""
    pow2 = 2 ** math.ceil(math.log2(num_heads))
    exponents = torch.arange(1, pow2 + 1, dtype=torch.float32) * (alibi_bias_max / pow2)
    slopes = 1.0 / torch.pow(2, exponents)
    if pow2 != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


@dataclass(frozen=True, slots=True)
class MPTOptions:
    bias: bool
    ffn_size: int
    eps: float
    clip_qkv: float | None
    alibi_bias_max: float
    logit_scale: float | None

    @classmethod
    def from_arch(cls, arch: ModelArch) -> MPTOptions:
        c = arch.hf_config
        attn: Mapping[str, Any] = c.get("attn_config") or {}
        for flag in ("qk_ln", "prefix_lm"):
            if attn.get(flag):
                raise ValueError(f"mpt: attn_config.{flag}=true is not supported")
        scale = c.get("logit_scale")
        if scale == "inv_sqrt_d_model":
            scale = 1.0 / math.sqrt(arch.hidden_size)
        return cls(
            bias=not c.get("no_bias", True),
            ffn_size=int(c.get("expansion_ratio", 4) * arch.hidden_size),
            eps=c.get("layer_norm_epsilon", 1e-5),
            clip_qkv=attn.get("clip_qkv"),
            alibi_bias_max=float(attn.get("alibi_bias_max", 8)),
            logit_scale=float(scale) if scale is not None else None,
        )


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


class MPTMLP(nn.Module):
    def __init__(self, hidden: int, opts: MPTOptions):
        super().__init__()
        self.up_proj = nn.Linear(hidden, opts.ffn_size, bias=opts.bias)
        self.down_proj = nn.Linear(opts.ffn_size, hidden, bias=opts.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class MPTBlock(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec, opts: MPTOptions):
        super().__init__()
        self.norm_1 = LayerNorm(arch.hidden_size, eps=opts.eps, bias=opts.bias)
        self.attn = MPTAttention(arch, spec, opts)
        self.norm_2 = LayerNorm(arch.hidden_size, eps=opts.eps, bias=opts.bias)
        self.ffn = MPTMLP(arch.hidden_size, opts)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn(self.norm_1(hidden))
        return hidden + self.ffn(self.norm_2(hidden))


class MPTForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.arch = arch
        self.opts = MPTOptions.from_arch(arch)
        self.wte = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.blocks = nn.ModuleList(MPTBlock(arch, s, self.opts) for s in arch.layers)
        self.norm_f = LayerNorm(arch.hidden_size, eps=self.opts.eps, bias=self.opts.bias)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.wte(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self.norm_f(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        return logits * self.opts.logit_scale if self.opts.logit_scale is not None else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, self._checkpoint(weights), lambda name: name)

    def _checkpoint(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = name.removeprefix("transformer.")
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            yield name, tensor
