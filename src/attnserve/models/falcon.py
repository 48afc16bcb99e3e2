"""Falcon: the three attention layouts and two block shapes of the ``falcon`` model type.

Falcon-7B (``multi_query``: one KV head, parallel attention and MLP off one LayerNorm),
Falcon-40B/180B (``new_decoder_architecture``: GQA with ``num_kv_heads``, two LayerNorms
``ln_attn``/``ln_mlp``, or one when ``num_ln_in_parallel_attn`` is 1 as in Falcon2-11B), plain
MHA, and Falcon-RW (``alibi``: ALiBi instead of NeoX rotary, usually with ``parallel_attn``
off and biases on). The fused ``query_key_value`` weight is reordered once at load time into
the engine's ``[q | k | v]`` layout (``deinterleave_qkv``, also used by BLOOM and GPT-BigCode).

Not here: the legacy ``RefinedWeb``/``RefinedWebModel`` model types (their checkpoints need
``trust_remote_code``), and the bfloat16 rounding of ``slope * position`` that the Falcon-RW code
applies to its ALiBi tensor (the backend takes one slope per head; the slopes are rounded to
bfloat16 as HF does, the products are not).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from attnserve.arch import LayerSpec, ModelArch
from attnserve.attention.reference import alibi_slopes
from attnserve.core.forward_context import get_forward_context
from attnserve.layers.activation import get_act_fn
from attnserve.layers.attention import Attention
from attnserve.layers.linear import QKVLinear
from attnserve.layers.norm import LayerNorm
from attnserve.layers.rotary import get_rope
from attnserve.models.weights import load_named_weights

__all__ = ["FalconForCausalLM", "FalconOptions", "deinterleave_qkv"]


def deinterleave_qkv(
    t: torch.Tensor, num_heads: int, num_kv_heads: int, head_size: int
) -> torch.Tensor:
    """Reorder fused QKV rows grouped per KV head into ``[q | k | v]``.

    Args:
        t: a fused weight [out, in] or bias [out] whose rows are, per KV head, the group's
            ``num_heads // num_kv_heads`` query heads, then its key head, then its value head
            (BLOOM, Falcon MHA and GQA, GPT-BigCode MHA: ``[q_h, k_h, v_h]`` per head).
        num_heads, num_kv_heads, head_size: the attention shape.
    Returns:
        The same rows as ``[q (H*D) | k (Hkv*D) | v (Hkv*D)]``.
    """
    group = num_heads // num_kv_heads
    rest = t.shape[1:]
    rows = t.reshape(num_kv_heads, group + 2, head_size, *rest)  # [Hkv, group + 2, D, (in)]
    q = rows[:, :group].reshape(num_heads * head_size, *rest)  # [H*D, (in)]
    k = rows[:, group].reshape(num_kv_heads * head_size, *rest)  # [Hkv*D, (in)]
    v = rows[:, group + 1].reshape(num_kv_heads * head_size, *rest)
    return torch.cat([q, k, v])


@dataclass(frozen=True, slots=True)
class FalconOptions:
    new_arch: bool  # new_decoder_architecture: GQA, attention and MLP always in parallel
    two_ln: bool  # ln_attn and ln_mlp instead of input_layernorm
    parallel: bool  # attention and MLP read the same input (one residual add)
    bias: bool
    grouped_qkv: bool  # query_key_value rows grouped per KV head (all but multi_query)
    ffn_size: int
    act: str
    eps: float

    @classmethod
    def from_arch(cls, arch: ModelArch) -> FalconOptions:
        c = arch.hf_config
        new_arch = bool(c.get("new_decoder_architecture", False))
        num_ln = c.get("num_ln_in_parallel_attn")
        if num_ln is None and new_arch:
            num_ln = 2
        parallel = bool(c.get("parallel_attn", True))
        if new_arch and not parallel:
            raise ValueError(
                "falcon: new_decoder_architecture requires parallel_attn (as in transformers)"
            )
        return cls(
            new_arch=new_arch,
            two_ln=new_arch and num_ln == 2,
            parallel=new_arch or parallel,
            bias=bool(c.get("bias", False)),
            grouped_qkv=new_arch or not bool(c.get("multi_query", True)),
            ffn_size=c.get("ffn_hidden_size") or 4 * arch.hidden_size,
            act=c.get("activation", "gelu"),
            eps=c.get("layer_norm_epsilon", 1e-5),
        )


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
        t = hidden.shape[0]
        q, k, v = self.query_key_value.split(self.query_key_value(hidden))
        if self.rotary_emb is not None:
            q = q.reshape(t, self.num_heads, self.head_size)  # [T, H, D]
            k = k.reshape(t, self.num_kv_heads, self.head_size)  # [T, Hkv, D]
            q, k = self.rotary_emb(positions, q, k, get_forward_context().token_seq_lens)
            q, k = q.reshape(t, -1), k.reshape(t, -1)  # [T, H*D], [T, Hkv*D]
        return self.dense(self.attn(q, k, v))


class FalconMLP(nn.Module):
    def __init__(self, hidden: int, opts: FalconOptions):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, opts.ffn_size, bias=opts.bias)
        self.act = get_act_fn(opts.act)
        self.dense_4h_to_h = nn.Linear(opts.ffn_size, hidden, bias=opts.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class FalconDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec, opts: FalconOptions):
        super().__init__()
        d = arch.hidden_size
        self.opts = opts
        self.self_attention = FalconAttention(arch, spec, opts)
        self.mlp = FalconMLP(d, opts)
        if opts.two_ln:
            self.ln_attn = LayerNorm(d, eps=opts.eps)
            self.ln_mlp = LayerNorm(d, eps=opts.eps)
        else:
            self.input_layernorm = LayerNorm(d, eps=opts.eps)
        if not opts.parallel:
            self.post_attention_layernorm = LayerNorm(d, eps=opts.eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if self.opts.two_ln:
            attn_in, mlp_in = self.ln_attn(hidden), self.ln_mlp(hidden)
        else:
            attn_in = mlp_in = self.input_layernorm(hidden)
        attn_out = self.self_attention(positions, attn_in)
        if self.opts.parallel:
            return hidden + attn_out + self.mlp(mlp_in)
        hidden = hidden + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class FalconForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.arch = arch
        self.opts = FalconOptions.from_arch(arch)
        self.word_embeddings = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.h = nn.ModuleList(FalconDecoderLayer(arch, s, self.opts) for s in arch.layers)
        self.ln_f = LayerNorm(arch.hidden_size, eps=self.opts.eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.word_embeddings.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids)
        for layer in self.h:
            hidden = layer(positions, hidden)
        return self.ln_f(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, self._checkpoint(weights), lambda name: name)

    def _checkpoint(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names without the ``transformer.`` prefix; grouped QKV rows put in ``[q | k | v]``."""
        spec = self.arch.layers[0]
        for name, tensor in weights:
            name = name.removeprefix("transformer.")
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            if self.opts.grouped_qkv and ".query_key_value." in name:
                tensor = deinterleave_qkv(tensor, spec.num_heads, spec.num_kv_heads, spec.head_size)
            yield name, tensor
