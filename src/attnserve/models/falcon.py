"""Falcon: the three attention layouts and two block shapes of the ``falcon`` model type.

Falcon-7B (``multi_query``: one KV head, parallel attention and MLP off one LayerNorm),
Falcon-40B/180B (``new_decoder_architecture``: GQA with ``num_kv_heads``, two LayerNorms
``ln_attn``/``ln_mlp``, or one when ``num_ln_in_parallel_attn`` is 1 as in Falcon2-11B), plain
MHA, and Falcon-RW (``alibi``: ALiBi instead of NeoX rotary, usually with ``parallel_attn``
off and biases on). The layout switches are ``arch.options`` (a ``FalconOptions``). The fused
``query_key_value`` weight is reordered once at load time into the engine's ``[q | k | v]``
layout (``models.base.deinterleave_qkv``, also used by BLOOM and GPT-BigCode); the checkpoint's
``word_embeddings``, ``h`` and ``ln_f`` are the skeleton's ``embed_tokens``, ``layers``, ``norm``.

Not here: the legacy ``RefinedWeb``/``RefinedWebModel`` model types (their checkpoints need
``trust_remote_code``), and the bfloat16 rounding of ``slope * position`` that the Falcon-RW code
applies to its ALiBi tensor (the backend takes one slope per head; the slopes are rounded to
bfloat16 as HF does, the products are not).
"""

from __future__ import annotations

import torch
from torch import nn

from attnserve.arch import FalconOptions, LayerSpec, ModelArch
from attnserve.attention.reference import alibi_slopes
from attnserve.layers.attention import Attention
from attnserve.layers.linear import QKVLinear
from attnserve.layers.norm import LayerNorm
from attnserve.layers.rotary import get_rope
from attnserve.models.base import CausalLM, PlainMLP, Weights, deinterleave_qkv

__all__ = ["FalconForCausalLM"]


def falcon_alibi_slopes(spec: LayerSpec) -> torch.Tensor:
    """Falcon-RW's ALiBi: BLOOM's slopes rounded to bfloat16, and scaled by the softmax scale
    (the bias is added to ``q.k`` before the ``1/sqrt(head_size)`` factor, unlike BLOOM's)."""
    return alibi_slopes(spec.num_heads).bfloat16().float() * spec.scale


class FalconAttention(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec, opts: FalconOptions):
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_size = spec.head_size
        self.query_key_value = QKVLinear(
            arch.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_size, bias=opts.bias
        )
        self.dense = nn.Linear(spec.num_heads * spec.head_size, arch.hidden_size, bias=opts.bias)
        self.rotary_emb = get_rope(spec.rope, spec.head_size)
        self.attn = Attention(spec, alibi_slopes=falcon_alibi_slopes(spec) if spec.alibi else None)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query_key_value.split(self.query_key_value(hidden))
        return self.dense(self.attn(q, k, v, positions, self.rotary_emb))  # RoPE (if any) in attn


class FalconDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        d, opts, eps = arch.hidden_size, arch.options, arch.norm_eps
        self.opts = opts
        self.self_attention = FalconAttention(arch, spec, opts)
        self.mlp = PlainMLP(d, arch.intermediate_size, arch.hidden_act, bias=opts.bias,
                            names=("dense_h_to_4h", "dense_4h_to_h"))
        if opts.two_ln:
            self.ln_attn = LayerNorm(d, eps=eps)
            self.ln_mlp = LayerNorm(d, eps=eps)
        else:
            self.input_layernorm = LayerNorm(d, eps=eps)
        if not opts.parallel:
            self.post_attention_layernorm = LayerNorm(d, eps=eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, carry: None) -> tuple[torch.Tensor, None]:
        if self.opts.two_ln:
            attn_in, mlp_in = self.ln_attn(hidden), self.ln_mlp(hidden)
        else:
            attn_in = mlp_in = self.input_layernorm(hidden)
        attn_out = self.self_attention(positions, attn_in)
        if self.opts.parallel:
            return hidden + attn_out + self.mlp(mlp_in), None
        hidden = hidden + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), None


class FalconForCausalLM(CausalLM):
    stripped_prefixes = ("transformer.",)
    renamed_modules = (("word_embeddings.", "embed_tokens."), ("h.", "layers."), ("ln_f.", "norm."))

    def __init__(self, arch: ModelArch):
        super().__init__(arch, lambda s: FalconDecoderLayer(arch, s), LayerNorm(arch.hidden_size, eps=arch.norm_eps))

    def checkpoint(self, weights: Weights) -> Weights:
        """Grouped QKV rows put in ``[q | k | v]``."""
        spec, grouped = self.arch.layers[0], self.arch.options.grouped_qkv
        for name, tensor in weights:
            if grouped and ".query_key_value." in name:
                tensor = deinterleave_qkv(tensor, spec.num_heads, spec.num_kv_heads, spec.head_size)
            yield name, tensor
