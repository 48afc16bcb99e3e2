"""fla-org's NSA model (``model_type: nsa``, ``NSAForCausalLM``): native sparse attention in a
Llama-style pre-norm decoder.

No official NSA checkpoint exists; the public model code is flash-linear-attention's
(``fla/models/nsa/modeling_nsa.py``), and this file reads its checkpoints: ``model.embeddings``,
per layer ``attn_norm`` -> ``attn`` (``layers/nsa.py``) -> residual, ``mlp_norm`` -> a SwiGLU
``mlp`` (FLA's ``GatedMLP``: gate/up/down, no biases) -> residual, a final ``model.norm``, and
``lm_head`` (tied to the embeddings only when ``tie_word_embeddings`` says so; FLA's default
is untied). Norms are RMSNorm with ``norm_eps``. The MLP width is ``intermediate_size`` when
given, else FLA's rule: ``int(hidden_size * hidden_ratio * 2 / 3)`` rounded up to a multiple of
256 (``hidden_ratio`` 4 when unset). The config checks (heads, blocks, window, activation) are in
``arch.families._nsa``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from attnserve.arch import ArchError, LayerSpec, ModelArch
from attnserve.layers.activation import gated, get_act_fn
from attnserve.layers.linear import MergedLinear
from attnserve.layers.norm import RMSNorm
from attnserve.layers.nsa import NSAAttention
from attnserve.models.weights import load_named_weights

__all__ = ["NSAForCausalLM", "NSAOptions"]


@dataclass(frozen=True, slots=True)
class NSAOptions:
    qkv_bias: bool
    norm_eps: float
    intermediate_size: int

    @classmethod
    def from_arch(cls, arch: ModelArch) -> NSAOptions:
        c = arch.hf_config
        inter = c.get("intermediate_size")
        if inter is None:
            ratio = c.get("hidden_ratio") or 4
            inter = int(arch.hidden_size * ratio * 2 / 3)
            inter = 256 * ((inter + 256 - 1) // 256)
        if isinstance(inter, bool) or not isinstance(inter, int) or inter <= 0:
            raise ArchError(f"nsa: intermediate_size must be a positive integer, got {inter!r}")
        return cls(qkv_bias=bool(c.get("qkv_bias", False)), norm_eps=float(c.get("norm_eps", 1e-6)),
                   intermediate_size=inter)


class NSAMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.act = get_act_fn("silu")  # FLA's "swish"
        self.gate_up_proj = MergedLinear(hidden, [inter, inter], bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.gate_up_proj(x), self.act))


class NSABlock(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec, opts: NSAOptions):
        super().__init__()
        self.attn_norm = RMSNorm(arch.hidden_size, eps=opts.norm_eps)
        self.attn = NSAAttention(arch.hidden_size, spec, qkv_bias=opts.qkv_bias)
        self.mlp_norm = RMSNorm(arch.hidden_size, eps=opts.norm_eps)
        self.mlp = NSAMLP(arch.hidden_size, opts.intermediate_size)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual adds are fused into the next norm: returns (block output, residual)."""
        if residual is None:
            residual, hidden = hidden, self.attn_norm(hidden)
        else:
            hidden, residual = self.attn_norm(hidden, residual)
        hidden = self.attn(positions, hidden)
        hidden, residual = self.mlp_norm(hidden, residual)
        return self.mlp(hidden), residual


class NSAForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.arch = arch
        opts = NSAOptions.from_arch(arch)
        self.embeddings = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(NSABlock(arch, s, opts) for s in arch.layers)
        self.norm = RMSNorm(arch.hidden_size, eps=opts.norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embeddings.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embeddings(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = self.arch.tie_word_embeddings

        def rename(name: str):
            name = name.removeprefix("model.")
            if name == "lm_head.weight":
                return None if tied else name
            for proj, shard in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
                if f".attn.{proj}." in name:
                    return name.replace(proj, "qkv_proj"), shard
            for proj, shard in (("gate_proj", 0), ("up_proj", 1)):
                if f".mlp.{proj}." in name:
                    return name.replace(proj, "gate_up_proj"), shard
            return name

        load_named_weights(self, weights, rename)
