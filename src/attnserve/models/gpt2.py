"""GPT-2 and GPT-BigCode (SantaCoder, StarCoder 1): learned positions, pre-LayerNorm blocks.

Both add a learned position embedding (``wpe``) to the token embedding, run LayerNorm ->
attention -> residual, LayerNorm -> MLP (``c_fc`` -> activation -> ``c_proj``) -> residual,
and tie the LM head to ``wte`` by default. GPT-2 stores its projections as HF ``Conv1D`` weights
``[in, out]`` (transposed here at load time); GPT-BigCode uses ``nn.Linear``. With
``multi_query`` GPT-BigCode's fused ``c_attn`` is ``[q (H*D) | k (D) | v (D)]``; without it the
rows are per head ``[q_h, k_h, v_h]`` and are reordered at load time (``arch.options``, a
``GPT2Options``, says which). The softmax scale (``scale_attn_weights``,
``scale_attn_by_inverse_layer_idx``) is already in ``LayerSpec.scale``. The checkpoint's ``wte``,
``h`` and ``ln_f`` are the skeleton's ``embed_tokens``, ``layers`` and ``norm``.

Not here: cross-attention (``add_cross_attention``: encoder-decoder use only) and
``reorder_and_upcast_attn`` (a mixed-precision training detail; the arithmetic is the same).
"""

from __future__ import annotations

import torch
from torch import nn

from attnserve.arch import LayerSpec, ModelArch
from attnserve.layers.attention import Attention
from attnserve.layers.linear import QKVLinear, Target
from attnserve.layers.norm import LayerNorm
from attnserve.models.base import CausalLM, PlainMLP, Weights, deinterleave_qkv

__all__ = ["GPT2LMHeadModel"]

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in old GPT-2 checkpoints


class GPT2Attention(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        self.c_attn = QKVLinear(
            arch.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_size, bias=True
        )
        self.c_proj = nn.Linear(spec.num_heads * spec.head_size, arch.hidden_size, bias=True)
        self.attn = Attention(spec)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn.split(self.c_attn(hidden))
        return self.c_proj(self.attn(q, k, v))


class GPT2Block(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        d = arch.hidden_size
        self.ln_1 = LayerNorm(d, eps=arch.norm_eps)
        self.attn = GPT2Attention(arch, spec)
        self.ln_2 = LayerNorm(d, eps=arch.norm_eps)
        self.mlp = PlainMLP(d, arch.intermediate_size, arch.hidden_act, bias=True, names=("c_fc", "c_proj"))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, carry: None) -> tuple[torch.Tensor, None]:
        hidden = hidden + self.attn(self.ln_1(hidden))
        return hidden + self.mlp(self.ln_2(hidden)), None


class GPT2LMHeadModel(CausalLM):
    """GPT-2 and GPT-BigCode; the model type picks the weight layout."""

    stripped_prefixes = ("transformer.",)
    renamed_modules = (("wte.", "embed_tokens."), ("h.", "layers."), ("ln_f.", "norm."))

    def __init__(self, arch: ModelArch):
        super().__init__(arch, lambda s: GPT2Block(arch, s), LayerNorm(arch.hidden_size, eps=arch.norm_eps))
        self.wpe = nn.Embedding(arch.max_position_embeddings or 1024, arch.hidden_size)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) + self.wpe(positions)

    def rename(self, name: str) -> Target:
        return None if name.endswith(_MASK_BUFFERS) else super().rename(name)

    def checkpoint(self, weights: Weights) -> Weights:
        """Conv1D weights transposed to [out, in]; per-head QKV rows put in ``[q | k | v]``."""
        spec, opts = self.arch.layers[0], self.arch.options
        for name, tensor in weights:
            if opts.conv1d and name.endswith(_CONV1D):
                tensor = tensor.t()
            if opts.per_head_qkv and ".attn.c_attn." in name:
                tensor = deinterleave_qkv(tensor, spec.num_heads, spec.num_kv_heads, spec.head_size)
            yield name, tensor
