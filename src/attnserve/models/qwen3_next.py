"""Qwen3-Next and Qwen3.5 (text): Gated DeltaNet layers with gated softmax attention every few.

Each decoder layer is pre-norm (zero-centred RMSNorms: ``x / rms(x) * (1 + w)``) around a token
mixer and an MLP:
- mixer: ``GatedDeltaNet`` (``layers/gdn.py``, a state layer) or ``GatedAttention``: q/k/v with
  q/k RMSNorm (zero-centred), partial NeoX RoPE (``partial_rotary_factor``, 0.25), paged
  attention, and a sigmoid output gate that ``q_proj`` emits beside q, per head [q | gate];
- MLP: qwen3_next (and qwen3_5_moe) a ``SharedExpertMoE`` (softmax top-k routed experts plus a
  shared expert scaled by ``sigmoid(shared_expert_gate(x))``) where ``LayerSpec.moe`` says so,
  a dense SwiGLU MLP elsewhere; qwen3_5 a dense SwiGLU MLP everywhere.

Checkpoints: Qwen3-Next groups the GDN input projections by key head (``in_proj_qkvz``,
``in_proj_ba``), Qwen3.5 stores them apart (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``); both load into one flat layout. Multimodal Qwen3.5 checkpoints keep the text
model under ``model.language_model.``; the vision tower and the MTP layers are skipped.

Not here: the vision tower (M-RoPE reduces to plain RoPE for text positions), MTP speculative
decoding.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from attnserve.arch import LayerKind, LayerSpec, ModelArch, MoESpec
from attnserve.core.forward_context import get_forward_context
from attnserve.layers.attention import Attention
from attnserve.layers.gdn import GatedDeltaNet
from attnserve.layers.linear import QKVLinear
from attnserve.layers.moe import FusedExperts, GatedMLP, SparseMoE
from attnserve.layers.norm import RMSNorm
from attnserve.layers.rotary import get_rope
from attnserve.models.weights import load_named_weights

__all__ = ["Qwen3NextForCausalLM", "SharedExpertMoE"]

Target = tuple[str, object] | str | None  # what a rename returns for load_named_weights

_LAYER = re.compile(r"^layers\.(\d+)\.")
_SKIPPED = ("mtp.", "model.visual.", "visual.")
_GDN_SHARDS = {  # checkpoint projection -> (parameter, shard)
    "in_proj_qkvz": ("in_proj_qkvz", "grouped"),
    "in_proj_ba": ("in_proj_ba", "grouped"),
    "in_proj_qkv": ("in_proj_qkvz", 0),
    "in_proj_z": ("in_proj_qkvz", 1),
    "in_proj_b": ("in_proj_ba", 0),
    "in_proj_a": ("in_proj_ba", 1),
}


def _prefixed(prefix: str, target: Target) -> Target:
    """``target`` (a name, a (name, shard) pair or None) under ``prefix``."""
    if isinstance(target, tuple):
        return prefix + target[0], target[1]
    return target and prefix + target


def _norm(arch: ModelArch, dim: int) -> RMSNorm:
    return RMSNorm(dim, eps=arch.hf_config.get("rms_norm_eps", 1e-6), zero_centered=True)


class GatedAttention(nn.Module):
    """Softmax attention with q/k norms, partial RoPE and a per-head sigmoid output gate."""

    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        bias = bool(arch.hf_config.get("attention_bias", False))
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_size = spec.head_size
        # q_proj emits [q | gate] per head: twice the query width
        self.qkv_proj = QKVLinear(
            arch.hidden_size, 2 * spec.num_heads, spec.num_kv_heads, spec.head_size, bias=bias
        )
        self.o_proj = nn.Linear(spec.num_heads * spec.head_size, arch.hidden_size, bias=bias)
        self.q_norm = _norm(arch, spec.head_size)
        self.k_norm = _norm(arch, spec.head_size)
        self.rotary_emb = get_rope(spec.rope, spec.head_size)
        self.attn = Attention(spec)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q_gate = q_gate.view(t, self.num_heads, 2 * self.head_size)  # [T, H, 2d]: [q | gate]
        q, gate = q_gate.chunk(2, dim=-1)  # [T, H, d] each
        q = self.q_norm(q)
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_size))  # [T, Hkv, d]
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k, get_forward_context().token_seq_lens)
        out = self.attn(q.reshape(t, -1), k.reshape(t, -1), v)  # [T, H*d]
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


class SharedExpertMoE(nn.Module):
    """Routed experts (``SparseMoE``) + a shared expert times ``sigmoid(shared_expert_gate(x))``.

    Checkpoint names under ``mlp.``: ``gate.weight``, ``experts.N.{gate,up,down}_proj.weight``
    (or the fused ``experts.gate_up_proj`` / ``experts.down_proj``), ``shared_expert.*``,
    ``shared_expert_gate.weight``.
    """

    def __init__(self, arch: ModelArch, spec: MoESpec):
        super().__init__()
        act = arch.hf_config.get("hidden_act", "silu")
        experts = FusedExperts(spec.num_experts, arch.hidden_size, spec.intermediate_size, act=act)
        self.routed = SparseMoE(spec, experts)
        self.shared_expert = GatedMLP(arch.hidden_size, spec.shared_intermediate_size, act)
        self.shared_expert_gate = nn.Linear(arch.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.routed(x) + shared

    @staticmethod
    def rename(suffix: str) -> Target:
        if suffix.startswith("shared_expert."):
            return _prefixed("shared_expert.", GatedMLP.rename(suffix[len("shared_expert.") :]))
        if suffix.startswith("shared_expert_gate."):
            return suffix
        fused = {
            "experts.gate_up_proj": ("experts.w13", (None, "gate_up")),
            "experts.down_proj": ("experts.w2", (None, "down")),
        }.get(suffix)
        return _prefixed("routed.", fused or SparseMoE.rename(suffix))


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        self.is_gdn = spec.kind is LayerKind.GDN
        if self.is_gdn:
            self.linear_attn = GatedDeltaNet(arch, spec)
        else:
            self.self_attn = GatedAttention(arch, spec)
        if spec.moe:
            self.mlp: nn.Module = SharedExpertMoE(arch, arch.moe)
        else:
            self.mlp = GatedMLP(
                arch.hidden_size,
                arch.hf_config["intermediate_size"],
                arch.hf_config.get("hidden_act", "silu"),
            )
        self.input_layernorm = _norm(arch, arch.hidden_size)
        self.post_attention_layernorm = _norm(arch, arch.hidden_size)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(hidden)
        hidden = hidden + (self.linear_attn(h) if self.is_gdn else self.self_attn(positions, h))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3NextForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(arch, s) for s in arch.layers)
        self.norm = _norm(arch, arch.hidden_size)
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
        """A name under ``layers.{layer}.`` -> parameter suffix, (suffix, shard), or None."""
        for proj, shard in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
            if suffix.startswith(f"self_attn.{proj}."):
                return suffix.replace(proj, "qkv_proj"), shard
        m = re.match(r"linear_attn\.(in_proj_\w+)\.weight$", suffix)
        if m and m.group(1) in _GDN_SHARDS:
            param, shard = _GDN_SHARDS[m.group(1)]
            return f"linear_attn.{param}.weight", shard
        if suffix.startswith("mlp."):
            return _prefixed("mlp.", self.layers[layer].mlp.rename(suffix[len("mlp.") :]))
        return suffix

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> Target:
            if name.startswith(_SKIPPED) or "rotary_emb" in name:
                return None
            for prefix in ("model.language_model.", "model."):
                if name.startswith(prefix):
                    name = name[len(prefix) :]
                    break
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
