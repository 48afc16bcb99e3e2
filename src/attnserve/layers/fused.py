"""Fused elementwise ops (RMSNorm + residual, RoPE, act-and-mul): dispatch and PyTorch twins.

Each op runs the Triton kernel of ``ops/dense/fused_triton.py`` on CUDA tensors when Triton
is importable, and otherwise its PyTorch twin below, which is the arithmetic ``layers/norm.py``,
``layers/rotary.py`` and ``layers/activation.py`` always had (so CPU results are unchanged).
``override_impl`` forces one side, for tests (on CPU tensors the kernels then need
``TRITON_INTERPRET=1``).

What this is not: the layers themselves (they call in here), nor a registry of kernel
libraries. The ops are out of place and inference only (no autograd through the kernels).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from types import ModuleType

import torch
import torch.nn.functional as F

__all__ = [
    "FUSED_ACTS",
    "act_and_mul",
    "act_and_mul_ref",
    "forced_impl",
    "override_impl",
    "rms_norm",
    "rms_norm_ref",
    "rotary",
    "rotary_ref",
    "rotate_ref",
    "uses_kernel",
]

FUSED_ACTS = ("silu", "gelu", "gelu_pytorch_tanh")  # HF names; "gelu" is the exact (erf) form
_TWIN_ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}
_IMPLS = ("triton", "torch")
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "attnserve_fused_impl", default=None
)


@functools.cache
def _kernels() -> ModuleType | None:
    """The Triton module, imported on first use; None where Triton is missing."""
    try:
        from attnserve.ops.dense import fused_triton as triton_fused
    except ImportError:
        return None
    return triton_fused


@contextlib.contextmanager
def override_impl(impl: str | None) -> Iterator[None]:
    """Within the block, every fused op runs ``impl``: "triton", "torch", or None (automatic)."""
    if impl is not None and impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS} or None, got '{impl}'")
    if impl == "triton" and _kernels() is None:
        raise ImportError("the fused kernels need triton (pip install attnserve[gpu])")
    token = _override.set(impl)
    try:
        yield
    finally:
        _override.reset(token)


def forced_impl() -> str | None:
    """The implementation ``override_impl`` forces in this context, or None."""
    return _override.get()


def uses_kernel(x: torch.Tensor) -> bool:
    """Whether an op on ``x`` runs the Triton kernel (else the PyTorch twin)."""
    impl = _override.get()
    if impl is not None:
        return impl == "triton"
    return x.is_cuda and _kernels() is not None


# --- RMSNorm ---------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    zero_centered: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x`` (or of ``x + residual``); see ``rms_norm_ref`` for the contract."""
    if uses_kernel(x):
        return _kernels().rms_norm(x, weight, eps, residual, zero_centered)
    return rms_norm_ref(x, weight, eps, residual, zero_centered)


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    zero_centered: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """PyTorch twin: ``x / rms(x) * w`` in float32, or ``* (1 + w)`` when ``zero_centered``.

    Args:
        x: [..., D].
        weight: [D].
        eps: added to the mean square.
        residual: same shape and dtype as ``x``, or None.
        zero_centered: the weight is stored as ``w - 1`` (Gemma).
    Returns:
        ``out``; with a residual ``(out, r)``, ``r = x + residual`` and ``out`` the norm of r
        (vLLM's fused_add_rms_norm). Without ``zero_centered`` the float32 result is cast to
        x's dtype before the weight multiply.
    """
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                f"{tuple(x.shape)} {x.dtype}"
            )
        r = x + residual
        return rms_norm_ref(r, weight, eps, None, zero_centered), r
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (h * (1.0 + weight.float())).to(dtype)
    return weight * h.to(dtype)


# --- RoPE ------------------------------------------------------------------------------------


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_table: torch.Tensor,
    positions: torch.Tensor,
    rotary_dim: int,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] by a position-indexed table; see ``rotary_ref``."""
    if uses_kernel(q):
        return _kernels().rotary(q, k, cos_sin_table, positions, rotary_dim, interleaved)
    return rotary_ref(q, k, cos_sin_table, positions, rotary_dim, interleaved)


def rotary_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_table: torch.Tensor,
    positions: torch.Tensor,
    rotary_dim: int,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch twin of the fused RoPE.

    Args:
        q: [T, Hq, D].
        k: [T, Hk, D].
        cos_sin_table: [max_pos, rotary_dim] float32, cos | sin halves of each row.
        positions: [T] integer positions, each below ``max_pos``.
        rotary_dim: the leading dims of each head that rotate; the rest pass through.
        interleaved: GPT-J adjacent pairs if True, else NeoX halves.
    Returns:
        (q, k) rotated, new tensors of the same shapes and dtypes.
    """
    rows = cos_sin_table.index_select(0, positions.long())  # [T, rotary_dim]
    cos, sin = rows.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, rotary_dim // 2]
    q_out = rotate_ref(q, cos.to(q.dtype), sin.to(q.dtype), rotary_dim, interleaved)
    return q_out, rotate_ref(k, cos.to(k.dtype), sin.to(k.dtype), rotary_dim, interleaved)


def rotate_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleaved: bool
) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` dims of x [T, H, D] by cos/sin [T, 1, rotary_dim // 2].

    Args:
        x: [T, H, D].
        cos: [T, 1, rotary_dim // 2] in x's dtype.
        sin: same as ``cos``.
        rotary_dim: even, at most D.
        interleaved: GPT-J adjacent pairs if True, else NeoX halves.
    Returns:
        [T, H, D] in x's dtype; dims past ``rotary_dim`` are x's.
    """
    rd = rotary_dim
    x_rot = x[..., :rd]
    if interleaved:  # pairs (x0, x1), (x2, x3), ...
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        out = out.flatten(-2)  # [T, H, rd // 2, 2] -> [T, H, rd]
    else:  # NeoX: pairs (x_i, x_{i + rd/2})
        x1, x2 = x_rot[..., : rd // 2], x_rot[..., rd // 2 :]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    if rd == x.shape[-1]:
        return out
    return torch.cat([out, x[..., rd:]], dim=-1)


# --- act-and-mul -----------------------------------------------------------------------------


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` for gate_up [..., 2I] = [gate | up]; see ``act_and_mul_ref``."""
    if uses_kernel(gate_up):
        return _kernels().act_and_mul(gate_up, act)
    return act_and_mul_ref(gate_up, act)


def act_and_mul_ref(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """PyTorch twin of the fused gated activation.

    Args:
        gate_up: [..., 2I] laid out [gate | up].
        act: one of ``FUSED_ACTS``.
    Returns:
        [..., I]: ``act(gate) * up`` in gate_up's dtype.
    """
    if act not in _TWIN_ACTS:
        raise ValueError(f"unsupported fused activation '{act}' (supported: {FUSED_ACTS})")
    gate, up = gate_up.chunk(2, dim=-1)
    return _TWIN_ACTS[act](gate) * up
