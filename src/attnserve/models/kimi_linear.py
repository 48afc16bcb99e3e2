"""Kimi-Linear: Kimi delta attention (KDA) layers with an MLA layer every few, DeepSeek-style MoE.

Each decoder layer is pre-norm (RMSNorm) around a mixer and an MLP:
- mixer: ``KimiDeltaAttention`` (``layers/kda.py``, a state layer) or ``MLAAttention``
  (``layers/mla.py``) without positional encoding: transformers' ``KimiLinearAttention`` never
  rotates, and the released config says ``mla_use_nope: true``, so RoPE is dropped unless a
  config sets ``mla_use_nope`` to false explicitly;
- MLP: ``DeepseekMoE`` (sigmoid scores with a correction bias, renormalised, routed scaling,
  shared experts) where ``LayerSpec.moe`` says so, a SwiGLU MLP elsewhere. Checkpoints name the
  block ``block_sparse_moe`` (experts ``w1``/``w3``/``w2``) or ``mlp``.

Not here: the KDA arithmetic (``attention/state/kda.py``), MTP layers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from attnserve.arch import LayerKind, LayerSpec, ModelArch
from attnserve.layers.kda import KimiDeltaAttention
from attnserve.layers.mla import MLAAttention
from attnserve.layers.moe import DeepseekMoE, GatedMLP
from attnserve.layers.norm import RMSNorm
from attnserve.models.weights import load_named_weights

__all__ = ["KimiLinearForCausalLM"]

Target = tuple[str, object] | str | None  # what a rename returns for load_named_weights

_LAYER = re.compile(r"^layers\.(\d+)\.")


def _prefixed(prefix: str, target: Target) -> Target:
    """``target`` (a name, a (name, shard) pair or None) under ``prefix``."""
    if isinstance(target, tuple):
        return prefix + target[0], target[1]
    return target and prefix + target


def _mla_spec(arch: ModelArch, spec: LayerSpec) -> LayerSpec:
    """The MLA layer as Kimi-Linear runs it: NoPE unless the config asks for RoPE."""
    if arch.hf_config.get("mla_use_nope") is False:
        return spec
    return replace(spec, rope=None, scale=spec.mla.qk_head_dim**-0.5)


class KimiLinearDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec, eps: float):
        super().__init__()
        c = arch.hf_config
        self.is_kda = spec.kind is LayerKind.KDA
        if self.is_kda:
            self.self_attn: nn.Module = KimiDeltaAttention(arch, spec)
        else:
            self.self_attn = MLAAttention(arch, _mla_spec(arch, spec))
        if spec.moe:
            self.mlp: nn.Module = DeepseekMoE(arch)
        else:
            self.mlp = GatedMLP(
                arch.hidden_size, c["intermediate_size"], c.get("hidden_act", "silu")
            )
        self.input_layernorm = RMSNorm(arch.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps=eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(hidden)
        hidden = hidden + (self.self_attn(h) if self.is_kda else self.self_attn(positions, h))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class KimiLinearForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.arch = arch
        eps = arch.hf_config.get("rms_norm_eps", 1e-5)
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(KimiLinearDecoderLayer(arch, s, eps) for s in arch.layers)
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

    def _rename_layer(self, layer: int, suffix: str) -> Target:
        if suffix.startswith("block_sparse_moe."):
            suffix = "mlp." + suffix[len("block_sparse_moe.") :]
        if suffix.startswith("mlp."):
            block = DeepseekMoE if self.arch.layers[layer].moe else GatedMLP
            return _prefixed("mlp.", block.rename(suffix[len("mlp.") :]))
        attn = self.layers[layer].self_attn
        if isinstance(attn, KimiDeltaAttention):
            for proj, shard in (("q_proj", 0), ("k_proj", 1), ("v_proj", 2)):
                if suffix.startswith(f"self_attn.{proj}."):
                    return suffix.replace(proj, "qkv_proj"), shard
        elif hasattr(attn, "fused_qkv_a_proj"):
            for proj, shard in (("q_a_proj", 0), ("kv_a_proj_with_mqa", 1)):
                if suffix.startswith(f"self_attn.{proj}."):
                    return suffix.replace(proj, "fused_qkv_a_proj"), shard
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
            layer = int(m.group(1))
            if layer >= self.arch.num_layers:
                return None
            return _prefixed(m.group(0), self._rename_layer(layer, name[m.end() :]))

        load_named_weights(self, weights, rename)
