"""The shared decoder skeleton that every model family fills in, and the weight loading it runs.

``CausalLM`` holds the token embedding (``embed_tokens``), one decoder layer per ``LayerSpec``
(``layers``, built by the family), the final norm (``norm``) and the output head (``lm_head``,
tied to the embedding when ``ModelArch.tie_word_embeddings`` says so). ``forward(input_ids,
positions) -> hidden`` embeds, runs the layers and the final norm; ``compute_logits(hidden)``
applies the family's logit scale and final soft-cap (``ModelArch.logit_scale``,
``final_softcap``). ``load_weights`` streams a checkpoint through the renames the families
share: tensors never loaded (a family's ``skipped_prefixes``: vision towers, MTP modules), the
prefix stripped (``model.``, ``transformer.``, ...), module names that differ from the
skeleton's (``h.`` -> ``layers.``, ...), RoPE buffers, a tied ``lm_head.weight``, and layers past
``num_layers`` skipped where the family's checkpoints carry multi-token-prediction layers (an
error elsewhere); inside a layer, each module holding fused projections says where its
checkpoint tensors go (``rename_in``: q/k/v -> ``qkv_proj`` shards, gate/up -> ``gate_up_proj``
shards, stacked experts, ...).

A family file keeps what differs: its decoder layer, attention or MLP blocks that really differ,
the embedding or final-norm step where it differs (``embed``, ``final_norm``), its checkpoint
names (class attributes, ``rename_layer``) and tensor transforms (``checkpoint``).

Not here: the layers themselves (``layers/``), reading safetensors and putting tensors in place
(``models/weights.py``), quantised checkpoints (``models/quantized.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from attnserve.arch import LayerSpec, ModelArch
from attnserve.layers.activation import get_act_fn
from attnserve.layers.linear import Target, prefixed
from attnserve.layers.norm import RMSNorm
from attnserve.models.weights import load_named_weights

__all__ = ["CausalLM", "PlainMLP", "add_norm", "deinterleave_qkv", "dense_width", "rename_in"]

Weights = Iterable[tuple[str, torch.Tensor]]

_LAYER = re.compile(r"^layers\.(\d+)\.")


class CausalLM(nn.Module):
    """A decoder-only language model: embedding, the layer stack, final norm, output head.

    Every decoder layer is called as ``layer(positions, hidden, carry) -> (hidden, carry)``:
    ``carry`` is what a family threads from one layer to the next (the residual stream when the
    residual add is fused into the next norm, DSA's top-k), None for the others.
    """

    # checkpoint names: never loaded; stripped (the first that matches); renamed to the
    # skeleton's module names; renamed inside each layer (before its modules' own renames)
    skipped_prefixes: tuple[str, ...] = ()
    stripped_prefixes: tuple[str, ...] = ("model.",)
    renamed_modules: tuple[tuple[str, str], ...] = ()
    renamed_layer_modules: tuple[tuple[str, str], ...] = ()
    # the family's checkpoints may hold layers past num_layers (multi-token prediction), which
    # are skipped; elsewhere such a tensor is an error (a config that does not fit its weights)
    extra_layers_are_mtp: bool = False

    def __init__(self, arch: ModelArch, layer: Callable[[LayerSpec], nn.Module], norm: nn.Module):
        """``layer`` builds the decoder layer of one ``LayerSpec``; ``norm`` is the final norm."""
        super().__init__()
        if arch.unsupported is not None:
            raise ValueError(arch.unsupported)
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(layer(s) for s in arch.layers)
        self.norm = norm
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T], positions [T] -> hidden [T, D] after the final norm."""
        hidden, carry = self.embed(input_ids, positions), None
        for layer in self.layers:
            hidden, carry = layer(positions, hidden, carry)
        return self.final_norm(hidden, carry)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first layer's input [T, D]."""
        return self.embed_tokens(input_ids)

    def final_norm(self, hidden: torch.Tensor, carry: object) -> torch.Tensor:
        """The last layer's output (and carry) -> the normed hidden state [T, D]."""
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, V]: float32 where the family scales or soft-caps them, else
        in the head's dtype (the sampler's greedy path takes the argmax there, exact, without a
        float32 copy of the whole [N, V]; everything else converts)."""
        logits = self.lm_head(hidden)
        scale, cap = self.arch.logit_scale, self.arch.final_softcap
        if scale is None and cap is None:
            return logits
        logits = logits.float()
        if scale is not None:
            logits = logits * scale
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits

    # --- weights ------------------------------------------------------------------------

    def load_weights(self, weights: Weights) -> None:
        load_named_weights(self, self.checkpoint(weights), self.rename)

    def checkpoint(self, weights: Weights) -> Weights:
        """The checkpoint stream, with the family's tensor transforms (none by default)."""
        return weights

    def rename(self, name: str) -> Target:
        """A checkpoint name -> its parameter, (parameter, shard), or None to skip it."""
        if name.startswith(self.skipped_prefixes) or "rotary_emb" in name:
            return None
        original = name
        name = _swap_prefix(name, tuple((p, "") for p in self.stripped_prefixes))
        name = _swap_prefix(name, self.renamed_modules)
        if name == "lm_head.weight" and self.arch.tie_word_embeddings:
            return None
        m = _LAYER.match(name)
        if m is None:
            return name
        layer = int(m.group(1))
        if layer >= self.arch.num_layers:
            if not self.extra_layers_are_mtp:
                raise ValueError(f"checkpoint tensor '{original}' belongs to layer {layer}, but the config has "
                                 f"{self.arch.num_layers} layers")
            return None  # multi-token-prediction layers after the last decoder layer
        return prefixed(m.group(0), self.rename_layer(layer, name[m.end() :]))

    def rename_layer(self, layer: int, suffix: str) -> Target:
        """A name under ``layers.{layer}.``: the family's module renames, then its modules' own."""
        return rename_in(self.layers[layer], _swap_prefix(suffix, self.renamed_layer_modules))


def _swap_prefix(name: str, pairs: tuple[tuple[str, str], ...]) -> str:
    """``name`` with the first matching ``old`` prefix replaced by its ``new``."""
    for old, new in pairs:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def rename_in(module: nn.Module, name: str) -> Target:
    """Where checkpoint tensor ``name`` (relative to ``module``) goes: down the module tree to the
    first module with a ``rename(suffix)`` method (fused projections, stacked experts, skipped
    buffers), which maps the rest of the name; unchanged where no module renames."""
    head, _, rest = name.partition(".")
    child = module._modules.get(head) if rest else None
    if child is None:
        return name
    rename = getattr(child, "rename", None)
    return prefixed(head + ".", rename(rest) if rename is not None else rename_in(child, rest))


def add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): one fused kernel for RMSNorm on CUDA."""
    if isinstance(norm, RMSNorm):
        return norm(x, residual)
    residual = x + residual
    return norm(residual), residual


def dense_width(arch: ModelArch) -> int:
    """The dense MLP width, which the family's layers need."""
    if arch.intermediate_size is None:
        raise ValueError(f"{arch.model_type}: the config gives no intermediate_size")
    return arch.intermediate_size


class PlainMLP(nn.Module):
    """``down_proj(act(up_proj(x)))``: the MLP of GPT-2, Falcon, BLOOM, MPT and StarCoder2.

    ``names`` are the checkpoint's names of the two projections (``rename`` maps them).
    """

    def __init__(self, hidden: int, inter: int, act: str, *, bias: bool,
                 names: tuple[str, str] = ("up_proj", "down_proj")):
        super().__init__()
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.act = get_act_fn(act)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.checkpoint_names = {names[0]: "up_proj", names[1]: "down_proj"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))

    def rename(self, suffix: str) -> Target:
        head, dot, rest = suffix.partition(".")
        return self.checkpoint_names.get(head, head) + dot + rest


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
