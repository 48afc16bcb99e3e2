"""BLOOM: ALiBi attention, a LayerNorm on the embeddings, biases everywhere, tied LM head.

The fused ``query_key_value`` rows are per head ``[q_h, k_h, v_h]`` and are reordered into
``[q | k | v]`` at load time. ALiBi slopes are BLOOM's (``attention/reference.alibi_slopes``);
the bias ``-slope * (pos_q - pos_k)`` is added after the ``1/sqrt(head_size)`` scaling.
``apply_residual_connection_post_layernorm`` makes each residual branch start from the
LayerNorm output instead of the block input. The MLP is ``4 * hidden`` with tanh-GELU.

Not here: ``pretraining_tp`` / ``slow_but_exact`` (they only split the same matrix products
into slices during training).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.arch import LayerSpec, ModelArch
from attnserve.attention.reference import alibi_slopes
from attnserve.layers.attention import Attention
from attnserve.layers.linear import QKVLinear
from attnserve.layers.norm import LayerNorm
from attnserve.models.falcon import deinterleave_qkv
from attnserve.models.weights import load_named_weights

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


class BloomMLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, 4 * hidden, bias=True)
        self.dense_4h_to_h = nn.Linear(4 * hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class BloomBlock(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec, eps: float, residual_post_ln: bool):
        super().__init__()
        self.residual_post_ln = residual_post_ln
        self.input_layernorm = LayerNorm(arch.hidden_size, eps=eps)
        self.self_attention = BloomAttention(arch, spec)
        self.post_attention_layernorm = LayerNorm(arch.hidden_size, eps=eps)
        self.mlp = BloomMLP(arch.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        hidden = (normed if self.residual_post_ln else hidden) + self.self_attention(normed)
        normed = self.post_attention_layernorm(hidden)
        return (normed if self.residual_post_ln else hidden) + self.mlp(normed)


class BloomForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.arch = arch
        c = arch.hf_config
        eps = c.get("layer_norm_epsilon", 1e-5)
        residual_post_ln = bool(c.get("apply_residual_connection_post_layernorm", False))
        self.word_embeddings = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.word_embeddings_layernorm = LayerNorm(arch.hidden_size, eps=eps)
        self.h = nn.ModuleList(BloomBlock(arch, s, eps, residual_post_ln) for s in arch.layers)
        self.ln_f = LayerNorm(arch.hidden_size, eps=eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.word_embeddings.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.word_embeddings_layernorm(self.word_embeddings(input_ids))
        for block in self.h:
            hidden = block(hidden)
        return self.ln_f(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, self._checkpoint(weights), lambda name: name)

    def _checkpoint(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names without ``transformer.``; per-head QKV rows put in ``[q | k | v]``."""
        spec = self.arch.layers[0]
        for name, tensor in weights:
            name = name.removeprefix("transformer.")
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            if ".query_key_value." in name:
                tensor = deinterleave_qkv(tensor, spec.num_heads, spec.num_kv_heads, spec.head_size)
            yield name, tensor
