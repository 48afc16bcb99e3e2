"""GPT-2 and GPT-BigCode (SantaCoder, StarCoder 1): learned positions, pre-LayerNorm blocks.

Both add a learned position embedding (``wpe``) to the token embedding, run LayerNorm ->
attention -> residual, LayerNorm -> MLP (``c_fc`` -> activation -> ``c_proj``) -> residual,
and tie the LM head to ``wte`` by default. GPT-2 stores its projections as HF ``Conv1D`` weights
``[in, out]`` (transposed here at load time); GPT-BigCode uses ``nn.Linear``. With
``multi_query`` GPT-BigCode's fused ``c_attn`` is ``[q (H*D) | k (D) | v (D)]``; without it the
rows are per head ``[q_h, k_h, v_h]`` and are reordered at load time. The softmax scale
(``scale_attn_weights``, ``scale_attn_by_inverse_layer_idx``) is already in ``LayerSpec.scale``.

Not here: cross-attention (``add_cross_attention``: encoder-decoder use only) and
``reorder_and_upcast_attn`` (a mixed-precision training detail; the arithmetic is the same).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from attnserve.arch import LayerSpec, ModelArch
from attnserve.layers.activation import get_act_fn
from attnserve.layers.attention import Attention
from attnserve.layers.linear import QKVLinear
from attnserve.layers.norm import LayerNorm
from attnserve.models.falcon import deinterleave_qkv
from attnserve.models.weights import load_named_weights

__all__ = ["GPT2LMHeadModel", "GPT2Options"]

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in old GPT-2 checkpoints


@dataclass(frozen=True, slots=True)
class GPT2Options:
    conv1d: bool  # GPT-2: weights stored [in, out]
    per_head_qkv: bool  # GPT-BigCode MHA: c_attn rows [q_h, k_h, v_h] per head
    inner_size: int
    act: str
    eps: float

    @classmethod
    def from_arch(cls, arch: ModelArch) -> GPT2Options:
        c = arch.hf_config
        gpt2 = arch.model_type == "gpt2"
        if c.get("add_cross_attention"):
            raise ValueError(
                f"{arch.model_type}: add_cross_attention (encoder-decoder use) is not supported"
            )
        return cls(
            conv1d=gpt2,
            per_head_qkv=not gpt2 and not c.get("multi_query", True),
            inner_size=c.get("n_inner") or 4 * arch.hidden_size,
            act=c.get("activation_function", "gelu_new" if gpt2 else "gelu_pytorch_tanh"),
            eps=c.get("layer_norm_epsilon", 1e-5),
        )


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


class GPT2MLP(nn.Module):
    def __init__(self, hidden: int, opts: GPT2Options):
        super().__init__()
        self.c_fc = nn.Linear(hidden, opts.inner_size, bias=True)
        self.act = get_act_fn(opts.act)
        self.c_proj = nn.Linear(opts.inner_size, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec, opts: GPT2Options):
        super().__init__()
        self.ln_1 = LayerNorm(arch.hidden_size, eps=opts.eps)
        self.attn = GPT2Attention(arch, spec)
        self.ln_2 = LayerNorm(arch.hidden_size, eps=opts.eps)
        self.mlp = GPT2MLP(arch.hidden_size, opts)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden))
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2LMHeadModel(nn.Module):
    """GPT-2 and GPT-BigCode; the model type picks the weight layout."""

    def __init__(self, arch: ModelArch):
        super().__init__()
        self.arch = arch
        self.opts = GPT2Options.from_arch(arch)
        max_pos = arch.max_position_embeddings or 1024
        self.wte = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.wpe = nn.Embedding(max_pos, arch.hidden_size)
        self.h = nn.ModuleList(GPT2Block(arch, s, self.opts) for s in arch.layers)
        self.ln_f = LayerNorm(arch.hidden_size, eps=self.opts.eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)
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
        """HF names without ``transformer.``; Conv1D weights transposed to [out, in]; per-head
        QKV rows put in ``[q | k | v]``; old checkpoints' mask buffers skipped."""
        spec = self.arch.layers[0]
        for name, tensor in weights:
            name = name.removeprefix("transformer.")
            if name.endswith(_MASK_BUFFERS) or (
                name == "lm_head.weight" and self.arch.tie_word_embeddings
            ):
                continue
            if self.opts.conv1d and name.endswith(_CONV1D):
                tensor = tensor.t()
            if self.opts.per_head_qkv and ".attn.c_attn." in name:
                tensor = deinterleave_qkv(tensor, spec.num_heads, spec.num_kv_heads, spec.head_size)
            yield name, tensor
