"""MiniMax-Text-01 / MiniMax-M1: lightning attention layers with a softmax layer every few, MoE.

Each decoder layer uses DeepNorm-style residuals, where the residual is the *normalised* input::

    h = RMSNorm_in(x);  x1 = alpha_attn * h + beta_attn * mixer(h)
    h2 = RMSNorm_post(x1);  out = alpha_mlp * h2 + beta_mlp * MoE(h2)

- mixer: ``LightningAttention`` (``layers/lightning.py``, a state layer) or Llama-style GQA with
  RoPE (``LayerSpec.rope``); the alpha/beta factors differ between the two kinds;
- MoE: every layer a ``SparseMoE`` (softmax top-k, renormalised), named ``block_sparse_moe``
  with experts ``w1``/``w3``/``w2`` in the checkpoint.
The factors are read from the config under transformers' names (``linear_attn_alpha_factor``,
``full_attn_beta_factor``, ``mlp_alpha_factor``, ...) or MiniMax's original ones
(``layernorm_linear_attention_alpha``, ``layernorm_full_attention_beta``,
``layernorm_mlp_alpha``, ...); missing ones are 1.

Not here: MiniMax-M2 (``minimax_m2``, a plain softmax-attention MoE), the vision towers of
MiniMax-VL.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from attnserve.arch import LayerKind, LayerSpec, ModelArch
from attnserve.layers.lightning import LightningAttention
from attnserve.layers.moe import FusedExperts, SparseMoE
from attnserve.layers.norm import RMSNorm
from attnserve.models.llama import LlamaAttention, LlamaOptions
from attnserve.models.weights import load_named_weights

__all__ = ["MiniMaxForCausalLM", "deepnorm_factors"]

Target = tuple[str, object] | str | None  # what a rename returns for load_named_weights

_LAYER = re.compile(r"^layers\.(\d+)\.")
_LIGHTNING_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


def _prefixed(prefix: str, target: Target) -> Target:
    """``target`` (a name, a (name, shard) pair or None) under ``prefix``."""
    if isinstance(target, tuple):
        return prefix + target[0], target[1]
    return target and prefix + target


def deepnorm_factors(
    config: Mapping[str, Any], lightning: bool
) -> tuple[float, float, float, float]:
    """(alpha_attn, beta_attn, alpha_mlp, beta_mlp) of a lightning or a softmax layer."""
    hf, orig = ("linear_attn", "linear_attention") if lightning else ("full_attn", "full_attention")

    def factor(hf_name: str, orig_name: str) -> float:
        value = config.get(hf_name, config.get(orig_name))
        return 1.0 if value is None else float(value)

    return (
        factor(f"{hf}_alpha_factor", f"layernorm_{orig}_alpha"),
        factor(f"{hf}_beta_factor", f"layernorm_{orig}_beta"),
        factor("mlp_alpha_factor", "layernorm_mlp_alpha"),
        factor("mlp_beta_factor", "layernorm_mlp_beta"),
    )


class MiniMaxDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec, eps: float):
        super().__init__()
        self.is_lightning = spec.kind is LayerKind.LIGHTNING
        if self.is_lightning:
            self.self_attn: nn.Module = LightningAttention(arch, spec)
        else:
            self.self_attn = LlamaAttention(arch, spec, LlamaOptions(norm_eps=eps))
        moe = arch.moe
        act = arch.hf_config.get("hidden_act", "silu")
        self.block_sparse_moe = SparseMoE(
            moe, FusedExperts(moe.num_experts, arch.hidden_size, moe.intermediate_size, act=act)
        )
        self.input_layernorm = RMSNorm(arch.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps=eps)
        self.alpha_attn, self.beta_attn, self.alpha_mlp, self.beta_mlp = deepnorm_factors(
            arch.hf_config, self.is_lightning
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(hidden)
        mixed = self.self_attn(h) if self.is_lightning else self.self_attn(positions, h)
        h = self.post_attention_layernorm(h * self.alpha_attn + mixed * self.beta_attn)
        return h * self.alpha_mlp + self.block_sparse_moe(h) * self.beta_mlp


class MiniMaxForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        if arch.moe is None:
            raise ValueError(f"{arch.model_type}: MiniMax needs a MoE spec (num_local_experts)")
        self.arch = arch
        eps = arch.hf_config.get("rms_norm_eps", 1e-5)
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(MiniMaxDecoderLayer(arch, s, eps) for s in arch.layers)
        self.norm = RMSNorm(arch.hidden_size, eps=eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @staticmethod
    def _rename_layer(suffix: str) -> Target:
        for proj, shard in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
            if suffix.startswith(f"self_attn.{proj}."):
                return suffix.replace(proj, "qkv_proj"), shard
        if suffix.startswith("self_attn.") and suffix[len("self_attn.") :] in _LIGHTNING_BUFFERS:
            return None  # decay tables: recomputed from the layer index
        if suffix.startswith("block_sparse_moe."):
            rest = suffix[len("block_sparse_moe.") :]
            return _prefixed("block_sparse_moe.", SparseMoE.rename(rest))
        return suffix

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> Target:
            name = name[len("model.") :] if name.startswith("model.") else name
            if "rotary_emb" in name:
                return None
            if name == "lm_head.weight":
                return None if self.arch.tie_word_embeddings else name
            m = _LAYER.match(name)
            if m is None:
                return name
            if int(m.group(1)) >= self.arch.num_layers:
                return None
            return _prefixed(m.group(0), self._rename_layer(name[m.end() :]))

        load_named_weights(self, weights, rename)
