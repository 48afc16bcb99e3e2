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
``in_proj_a``); both load into one flat layout (``GatedDeltaNet.rename``). Multimodal Qwen3.5
checkpoints keep the text model under ``model.language_model.``; the vision tower and the MTP
layers are skipped.

Not here: the vision tower (M-RoPE reduces to plain RoPE for text positions), MTP speculative
decoding.
"""

from __future__ import annotations

import torch
from torch import nn

from attnserve.arch import LayerKind, LayerSpec, ModelArch, MoESpec
from attnserve.layers.attention import Attention
from attnserve.layers.gdn import GatedDeltaNet
from attnserve.layers.linear import QKVLinear, Target, prefixed, qkv_rename
from attnserve.layers.moe import FusedExperts, GatedMLP, SparseMoE
from attnserve.layers.norm import RMSNorm
from attnserve.layers.rotary import get_rope
from attnserve.models.base import CausalLM, dense_width

__all__ = ["Qwen3NextForCausalLM", "SharedExpertMoE"]


def _norm(arch: ModelArch, dim: int) -> RMSNorm:
    return RMSNorm(dim, eps=arch.norm_eps, zero_centered=True)


class GatedAttention(nn.Module):
    """Softmax attention with q/k norms, partial RoPE and a per-head sigmoid output gate."""

    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        bias = arch.options.attention_bias
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

    rename = staticmethod(qkv_rename)  # the checkpoint's q_proj/k_proj/v_proj

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q_gate = q_gate.view(t, self.num_heads, 2 * self.head_size)  # [T, H, 2d]: [q | gate]
        q, gate = q_gate.chunk(2, dim=-1)  # [T, H, d] each
        q = self.q_norm(q)
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_size))  # [T, Hkv, d]
        out = self.attn(q, k, v, positions, self.rotary_emb)  # [T, H*d]; RoPE in attn
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


class SharedExpertMoE(nn.Module):
    """Routed experts (``SparseMoE``) + a shared expert times ``sigmoid(shared_expert_gate(x))``.

    Checkpoint names under ``mlp.``: ``gate.weight``, ``experts.N.{gate,up,down}_proj.weight``
    (or the fused ``experts.gate_up_proj`` / ``experts.down_proj``), ``shared_expert.*``,
    ``shared_expert_gate.weight``.
    """

    def __init__(self, arch: ModelArch, spec: MoESpec):
        super().__init__()
        act = arch.hidden_act
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
            return prefixed("shared_expert.", GatedMLP.rename(suffix[len("shared_expert.") :]))
        if suffix.startswith("shared_expert_gate."):
            return suffix
        fused = {
            "experts.gate_up_proj": ("experts.w13", (None, "gate_up")),
            "experts.down_proj": ("experts.w2", (None, "down")),
        }.get(suffix)
        return prefixed("routed.", fused or SparseMoE.rename(suffix))


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
            self.mlp = GatedMLP(arch.hidden_size, dense_width(arch), arch.hidden_act)
        self.input_layernorm = _norm(arch, arch.hidden_size)
        self.post_attention_layernorm = _norm(arch, arch.hidden_size)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, carry: None) -> tuple[torch.Tensor, None]:
        h = self.input_layernorm(hidden)
        hidden = hidden + (self.linear_attn(h) if self.is_gdn else self.self_attn(positions, h))
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), None


class Qwen3NextForCausalLM(CausalLM):
    extra_layers_are_mtp = True  # checkpoints keep their MTP layers after the last one
    skipped_prefixes = ("mtp.", "model.visual.", "visual.")
    stripped_prefixes = ("model.language_model.", "model.")

    def __init__(self, arch: ModelArch):
        super().__init__(arch, lambda s: Qwen3NextDecoderLayer(arch, s), _norm(arch, arch.hidden_size))
