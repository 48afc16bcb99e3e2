"""Activation functions by their HF names, and the gated form used by SwiGLU/GeGLU MLPs.

``gated`` runs the fused act-and-mul of ``layers/fused.py`` (a Triton kernel on CUDA) for silu,
exact gelu and gelu_pytorch_tanh; other activations stay two torch ops.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnserve.layers.fused import act_and_mul

__all__ = ["fused_act_name", "gated", "get_act_fn"]


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTS = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_new,
    "gelu_fast": _gelu_new,
    "gelu_python": F.gelu,
}
_FUSED_NAMES = {F.silu: "silu", F.gelu: "gelu", _gelu_tanh: "gelu_pytorch_tanh"}  # act -> kernel


def get_act_fn(name: str):
    try:
        return _ACTS[name]
    except KeyError:
        raise ValueError(f"unsupported activation '{name}' (supported: {', '.join(sorted(_ACTS))})") from None


def fused_act_name(act) -> str | None:
    """The ``FUSED_ACTS`` name of an activation function from ``get_act_fn``; None where no
    fused kernel computes it."""
    return _FUSED_NAMES.get(act)


def gated(gate_up: torch.Tensor, act) -> torch.Tensor:
    """[..., 2I] laid out [gate | up] -> act(gate) * up, [..., I]."""
    fused = fused_act_name(act)
    if fused is not None:
        return act_and_mul(gate_up, fused)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up
