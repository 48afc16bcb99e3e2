"""Decode-sized linears with the op before them fused in: dispatch and PyTorch twins.

At M <= ``MAX_M`` rows (decode batches) a step is bound by reading weights, and the RMSNorm
before qkv and gate_up and the act-and-mul before down are kernels of their own. Here:

- ``linear(x, layer)``: ``layer(x)``;
- ``norm_linear(norm, x, residual, layer)``: ``layer(norm(x + residual))`` and the new residual
  (the first layer passes no residual: ``layer(norm(x))``, x);
- ``act_linear(gate_up, act, layer)``: ``layer(act(gate) * up)``.

Each runs one small-M Triton kernel (``ops/dense/gemv_triton.py``) where it applies: a CUDA tensor,
Triton importable, 1 <= M <= ``MAX_M``, ``layer`` a plain dense ``nn.Linear`` (its forward is
``nn.Linear.forward``: the fused QKV and gate/up linears and column-parallel shards are;
tensor parallelism's ``RowParallelLinear`` is not, nor anything quantised) in x's float dtype,
an RMSNorm that is not zero-centred in that dtype, an activation with a fused form; and the
caller's ``enabled``, read when the model is built: the engine's plan chose the ``triton_gemv``
variant of ``dense.small_m`` (``attention/kernels.py``; ``disabled_kernels=("triton_gemv",)``
keeps the separate kernels and cuBLAS). Elsewhere the modules
run exactly as before: the norm (its own fused kernel on CUDA), the gated activation, the
linear (cuBLAS), so CPU results and the large-M path do not change. The decision depends only
on shapes, dtypes and devices, so a CUDA graph captures the same kernels it replays.

``override_impl`` forces the kernels ("triton"; on CPU tensors they need ``TRITON_INTERPRET=1``)
or the modules ("torch"), for tests. The ``*_ref`` functions are the PyTorch twins of the three
kernels, the unfused arithmetic (``layers/fused.py``'s twins, then ``F.linear``).

What this is not: the kernels, large-M GEMMs, the final norm and lm_head (lm_head already runs
at the bandwidth floor through cuBLAS).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.attention import kernels
from attnserve.layers.activation import fused_act_name, gated
from attnserve.layers.fused import act_and_mul_ref, rms_norm_ref
from attnserve.layers.norm import RMSNorm

__all__ = [
    "MAX_M",
    "act_linear",
    "act_linear_ref",
    "enabled",
    "linear",
    "norm_linear",
    "norm_linear_ref",
    "override_impl",
]

# the largest decode batch that runs the kernels; at most triton_gemv.MAX_M. The H200 sweep
# (benchmarks/gpu_gemv.py, 2026-12-02): at M == 1 the fused kernels beat cuBLAS plus the separate
# norm / activation on every shape; from M == 2 cuBLAS won (the tl.dot path reached 45-82% of
# bandwidth against cuBLAS's 75-99%, and the act prologue 13-57%)
MAX_M = 1
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_IMPLS = ("triton", "torch")
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("attnserve_gemv_impl", default=None)


@functools.cache
def _kernels() -> ModuleType | None:
    try:
        from attnserve.ops.dense import gemv_triton as triton_gemv
    except ImportError:
        return None
    return triton_gemv


def enabled() -> bool:
    """Whether a model built now uses the kernels: unless the engine building it chose another
    variant of ``dense.small_m`` (outside an engine's build: yes, where the device allows)."""
    return kernels.model_kernel("dense.small_m") in (None, "triton_gemv")


@contextlib.contextmanager
def override_impl(impl: str | None) -> Iterator[None]:
    """Within the block: "triton" runs the kernels wherever the shapes allow (``enabled``
    ignored), "torch" the unfused modules, None decides automatically."""
    if impl is not None and impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS} or None, got '{impl}'")
    if impl == "triton" and _kernels() is None:
        raise ImportError("the small-M kernels need triton (pip install attnserve[gpu])")
    token = _override.set(impl)
    try:
        yield
    finally:
        _override.reset(token)


def _applies(x: torch.Tensor, layer: nn.Module, enabled: bool) -> bool:
    """Whether ``layer`` on ``x`` runs a kernel; cheapest checks first (eager decode asks per call)."""
    impl = _override.get()
    if impl == "torch" or (impl is None and not enabled) or x.dim() != 2 or not 0 < x.shape[0] <= MAX_M:
        return False
    if type(layer).forward is not nn.Linear.forward:
        return False
    w = layer.weight
    if w.dtype != x.dtype or x.dtype not in _DTYPES or w.dim() != 2 or w.stride(-1) != 1:
        return False
    return impl == "triton" or (x.is_cuda and _kernels() is not None)


def linear(x: torch.Tensor, layer: nn.Module, enabled: bool = True) -> torch.Tensor:
    """``layer(x)``: x [M, K] -> [M, N]; the small-M kernel where it applies."""
    if _applies(x, layer, enabled):
        return _kernels().linear(x, layer.weight, layer.bias)
    return layer(x)


def norm_linear(
    norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, layer: nn.Module, enabled: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer(norm(s)), s)`` with s = x + residual, or s = x when ``residual`` is None.

    Args:
        norm: the layer's norm (fused for a plain RMSNorm; any norm module otherwise).
        x: [M, K] the block output (or the embedding, first layer).
        residual: [M, K] or None.
        layer: the linear after the norm.
    """
    if isinstance(norm, RMSNorm) and not norm.zero_centered and norm.weight.dtype == x.dtype \
            and _applies(x, layer, enabled):
        y = _kernels().rms_norm_linear(x, norm.weight, norm.eps, layer.weight, layer.bias, residual)
        return y if residual is not None else (y, x)
    if residual is None:
        return layer(norm(x)), x
    if isinstance(norm, RMSNorm):  # the residual add fused into the norm's kernel
        h, residual = norm(x, residual)
    else:
        residual = x + residual
        h = norm(residual)
    return layer(h), residual


def act_linear(gate_up: torch.Tensor, act, layer: nn.Module, enabled: bool = True) -> torch.Tensor:
    """``layer(act(gate) * up)`` for gate_up [M, 2I] = [gate | up]; ``act`` from ``get_act_fn``."""
    name = fused_act_name(act)
    if name is not None and _applies(gate_up, layer, enabled):
        return _kernels().act_and_mul_linear(gate_up, name, layer.weight, layer.bias)
    return layer(gated(gate_up, act))


# --- PyTorch twins of the kernels ----------------------------------------------------------------


def norm_linear_ref(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Twin of ``triton_gemv.rms_norm_linear``: ``rms_norm_ref`` then ``F.linear``; with a
    residual ``(y, x + residual)``."""
    if residual is None:
        return F.linear(rms_norm_ref(x, norm_weight, eps), weight, bias)
    h, s = rms_norm_ref(x, norm_weight, eps, residual)
    return F.linear(h, weight, bias), s


def act_linear_ref(
    gate_up: torch.Tensor, act: str, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Twin of ``triton_gemv.act_and_mul_linear``: ``act_and_mul_ref`` then ``F.linear``."""
    return F.linear(act_and_mul_ref(gate_up, act), weight, bias)
