"""Activation functions by their HF names, and the gated form used by SwiGLU/GeGLU MLPs."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["get_act_fn", "gated"]


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


_ACTS = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _gelu_new,
    "gelu_fast": _gelu_new,
    "gelu_python": F.gelu,
}


def get_act_fn(name: str):
    try:
        return _ACTS[name]
    except KeyError:
        raise ValueError(f"unsupported activation '{name}' (supported: {', '.join(sorted(_ACTS))})") from None


def gated(gate_up: torch.Tensor, act) -> torch.Tensor:
    """[..., 2I] laid out [gate | up] -> act(gate) * up, [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up
