"""fla-org's NSA model (``model_type: nsa``, ``NSAForCausalLM``): native sparse attention in a
Llama-style pre-norm decoder.

No official NSA checkpoint exists; the public model code is flash-linear-attention's
(``fla/models/nsa/modeling_nsa.py``), and this file reads its checkpoints: ``model.embeddings``,
per layer ``attn_norm`` -> ``attn`` (``layers/nsa.py``) -> residual, ``mlp_norm`` -> a SwiGLU
``mlp`` (FLA's ``GatedMLP``: gate/up/down, no biases) -> residual, a final ``model.norm``, and
``lm_head`` (tied to the embeddings only when ``tie_word_embeddings`` says so; FLA's default
is untied). Norms are RMSNorm with ``norm_eps``, the residual add fused into the next norm. The
config checks (heads, blocks, window, activation) and the MLP width (FLA's rule when
``intermediate_size`` is unset) are in ``arch/readers_mla_state.nsa``.
"""

from __future__ import annotations

import torch
from torch import nn

from attnserve.arch import LayerSpec, ModelArch
from attnserve.layers.moe import GatedMLP
from attnserve.layers.norm import RMSNorm
from attnserve.layers.nsa import NSAAttention
from attnserve.models.base import CausalLM

__all__ = ["NSAForCausalLM"]


class NSABlock(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        d = arch.hidden_size
        self.attn_norm = RMSNorm(d, eps=arch.norm_eps)
        self.attn = NSAAttention(d, spec, qkv_bias=arch.options.qkv_bias)
        self.mlp_norm = RMSNorm(d, eps=arch.norm_eps)
        self.mlp = GatedMLP(d, arch.intermediate_size, arch.hidden_act)  # FLA's "swish": SiLU

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


class NSAForCausalLM(CausalLM):
    renamed_modules = (("embeddings.", "embed_tokens."),)

    def __init__(self, arch: ModelArch):
        super().__init__(arch, lambda s: NSABlock(arch, s), RMSNorm(arch.hidden_size, eps=arch.norm_eps))

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden, residual)[0]
