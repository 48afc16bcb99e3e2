"""BLOOM: ALiBi attention, a LayerNorm on the embeddings, biases everywhere, tied LM head.

The fused ``query_key_value`` rows are per head ``[q_h, k_h, v_h]`` and are reordered into
``[q | k | v]`` at load time. ALiBi slopes are BLOOM's (``attention/reference.alibi_slopes``);
the bias ``-slope * (pos_q - pos_k)`` is added after the ``1/sqrt(head_size)`` scaling.
``apply_residual_connection_post_layernorm`` makes each residual branch start from the
LayerNorm output instead of the block input (``arch.options``, a ``BloomOptions``). The MLP is
``4 * hidden`` with tanh-GELU. The checkpoint's ``word_embeddings``, ``h`` and ``ln_f`` are the
skeleton's ``embed_tokens``, ``layers`` and ``norm``.

Not here: ``pretraining_tp`` / ``slow_but_exact`` (they only split the same matrix products
into slices during training).
"""

from __future__ import annotations

import torch
from torch import nn

from attnserve.arch import LayerSpec, ModelArch
from attnserve.attention.reference import alibi_slopes
from attnserve.layers.attention import Attention
from attnserve.layers.linear import QKVLinear
from attnserve.layers.norm import LayerNorm
from attnserve.models.base import CausalLM, PlainMLP, Weights, deinterleave_qkv

__all__ = ["BloomForCausalLM"]


class BloomAttention(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        self.query_key_value = QKVLinear(
            arch.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_size, bias=True
        )
        self.dense = nn.Linear(spec.num_heads * spec.head_size, arch.hidden_size, bias=True)
        self.attn = Attention(spec, alibi_slopes=alibi_slopes(spec.num_heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query_key_value.split(self.query_key_value(hidden))
        return self.dense(self.attn(q, k, v))


class BloomBlock(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        d = arch.hidden_size
        self.residual_post_ln = arch.options.residual_post_ln
        self.input_layernorm = LayerNorm(d, eps=arch.norm_eps)
        self.self_attention = BloomAttention(arch, spec)
        self.post_attention_layernorm = LayerNorm(d, eps=arch.norm_eps)
        self.mlp = PlainMLP(d, arch.intermediate_size, arch.hidden_act, bias=True,
                            names=("dense_h_to_4h", "dense_4h_to_h"))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, carry: None) -> tuple[torch.Tensor, None]:
        normed = self.input_layernorm(hidden)
        hidden = (normed if self.residual_post_ln else hidden) + self.self_attention(normed)
        normed = self.post_attention_layernorm(hidden)
        return (normed if self.residual_post_ln else hidden) + self.mlp(normed), None


class BloomForCausalLM(CausalLM):
    stripped_prefixes = ("transformer.",)
    renamed_modules = (("word_embeddings.", "embed_tokens."), ("h.", "layers."), ("ln_f.", "norm."))

    def __init__(self, arch: ModelArch):
        super().__init__(arch, lambda s: BloomBlock(arch, s), LayerNorm(arch.hidden_size, eps=arch.norm_eps))
        self.word_embeddings_layernorm = LayerNorm(arch.hidden_size, eps=arch.norm_eps)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings_layernorm(self.embed_tokens(input_ids))

    def checkpoint(self, weights: Weights) -> Weights:
        """Per-head QKV rows put in ``[q | k | v]``."""
        spec = self.arch.layers[0]
        for name, tensor in weights:
            if ".query_key_value." in name:
                tensor = deinterleave_qkv(tensor, spec.num_heads, spec.num_kv_heads, spec.head_size)
            yield name, tensor
