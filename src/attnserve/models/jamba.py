"""Jamba (AI21 Jamba v0.1 / 1.5): Mamba-1 layers with a softmax attention layer every few.

Each decoder layer is pre-norm (RMSNorm) around a mixer and a feed-forward block:
- mixer: ``MambaMixer`` (``layers/mamba.py``, a state layer, with Jamba's dt/B/C RMSNorms) or
  Llama-style attention without any positional encoding (``LayerSpec.rope`` is None);
- feed-forward: where ``LayerSpec.moe``, a ``SparseMoE`` whose top-k softmax weights are *not*
  renormalised (Jamba's router; the checkpoint calls it ``router``), else a SwiGLU MLP.
The layer pattern (``attn_layer_period``/``offset``, ``expert_layer_period``/``offset``) comes
from ``ModelArch``. Norm names follow the checkpoint: ``input_layernorm``, ``pre_ff_layernorm``,
``final_layernorm``.

Not here: Mamba-2, the training-only load-balancing loss.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from attnserve.arch import LayerKind, LayerSpec, ModelArch
from attnserve.layers.mamba import MambaMixer
from attnserve.layers.moe import FusedExperts, GatedMLP, SparseMoE
from attnserve.layers.norm import RMSNorm
from attnserve.models.llama import LlamaAttention, LlamaOptions
from attnserve.models.weights import load_named_weights

__all__ = ["JambaForCausalLM"]

Target = tuple[str, object] | str | None  # what a rename returns for load_named_weights

_LAYER = re.compile(r"^layers\.(\d+)\.")


def _prefixed(prefix: str, target: Target) -> Target:
    """``target`` (a name, a (name, shard) pair or None) under ``prefix``."""
    if isinstance(target, tuple):
        return prefix + target[0], target[1]
    return target and prefix + target


def _feed_forward(arch: ModelArch, spec: LayerSpec) -> nn.Module:
    act = arch.hf_config.get("hidden_act", "silu")
    if not spec.moe:
        return GatedMLP(arch.hidden_size, arch.hf_config["intermediate_size"], act)
    moe = replace(arch.moe, norm_topk_prob=False)  # Jamba keeps the raw top-k softmax weights
    return SparseMoE(
        moe, FusedExperts(moe.num_experts, arch.hidden_size, moe.intermediate_size, act=act)
    )


class JambaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec, eps: float):
        super().__init__()
        self.is_mamba = spec.kind is LayerKind.MAMBA
        if self.is_mamba:
            self.mamba = MambaMixer(arch, spec)
        else:
            self.self_attn = LlamaAttention(arch, spec, LlamaOptions(norm_eps=eps))
        self.feed_forward = _feed_forward(arch, spec)
        self.input_layernorm = RMSNorm(arch.hidden_size, eps=eps)
        self.pre_ff_layernorm = RMSNorm(arch.hidden_size, eps=eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(hidden)
        hidden = hidden + (self.mamba(h) if self.is_mamba else self.self_attn(positions, h))
        return hidden + self.feed_forward(self.pre_ff_layernorm(hidden))


class JambaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.arch = arch
        eps = arch.hf_config.get("rms_norm_eps", 1e-6)
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(JambaDecoderLayer(arch, s, eps) for s in arch.layers)
        self.final_layernorm = RMSNorm(arch.hidden_size, eps=eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.final_layernorm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @staticmethod
    def _rename_layer(layer: nn.Module, suffix: str) -> Target:
        for proj, shard in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
            if suffix.startswith(f"self_attn.{proj}."):
                return suffix.replace(proj, "qkv_proj"), shard
        if suffix.startswith("feed_forward."):
            rest = suffix[len("feed_forward.") :]
            if rest.startswith("router."):
                rest = "gate." + rest[len("router.") :]
            block = SparseMoE if isinstance(layer.feed_forward, SparseMoE) else GatedMLP
            return _prefixed("feed_forward.", block.rename(rest))
        return suffix

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> Target:
            name = name[len("model.") :] if name.startswith("model.") else name
            if name == "lm_head.weight":
                return None if self.arch.tie_word_embeddings else name
            m = _LAYER.match(name)
            if m is None:
                return name
            if int(m.group(1)) >= self.arch.num_layers:
                return None
            target = self._rename_layer(self.layers[int(m.group(1))], name[m.end() :])
            return _prefixed(m.group(0), target)

        load_named_weights(self, weights, rename)
