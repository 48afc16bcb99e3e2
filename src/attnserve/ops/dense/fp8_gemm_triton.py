"""Block-scaled FP8 GEMM (W8A8) in Triton: DeepSeek-V3's fp8 format kept in fp8 through the matmul.

The weight is a checkpoint's block-fp8 tensor as stored: ``w`` [N, K] ``float8_e4m3fn`` and one
float32 scale per [bn, bk] block, ``w_scale`` [ceil(N / bn), ceil(K / bk)] (the weight is each
value times its block's scale: ``models/quantized.dequantize_fp8_blocks``). Activations are
quantised on the fly per token and group of ``bk`` columns (``quantize_act_fp8_groups``: a scale
of amax / 448 per group, DeepSeek's and vLLM's dynamic scheme), so that each ``bk``-wide slice of
the reduction has one activation scale per row and one weight scale per ``bn`` columns:

    out[m, n] = sum_g (sum_{k in g} a[m, k] * w[n, k]) * a_scale[m, g] * w_scale[n // bn, g]

``fp8_block_matmul`` runs that with one FP8 dot (tensor cores on Hopper) per slice, scaled and
added into a float32 accumulator; edge blocks (N or K not a multiple of the block) are masked.
The PyTorch twins (``quantize_act_fp8_groups_torch``, ``fp8_block_matmul_torch``) compute the
same in float32: dequantised operands, one matmul.

Tested under Triton's interpreter with fp8 operands (``tests/kernels/test_triton_fp8_gemm.py``):
the quantiser rounds to e4m3 in float32 arithmetic (``_round_e4m3``), since the interpreter's own
fp8 conversion rounds wrongly where a value carries into the next exponent.

Not here yet: the dispatch (no model layer calls these: issue #42 wires them into the linear
layers and the grouped MoE kernels), a small-M (decode) path that reads the weight once with
more programs along N, per-channel and per-tensor scales, and configs timed on a GPU (the
pinned ones below are a first guess: 64 x 128 tiles, the group as the K step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["FP8_MAX", "fp8_block_matmul", "fp8_block_matmul_torch", "quantize_act_fp8_groups",
           "quantize_act_fp8_groups_torch"]

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_MIN_AMAX = 1e-10  # an all-zero group gets a tiny scale, not a division by zero


def _check_act(x: torch.Tensor, group: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"activations must be [tokens, features], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"activations must be float32, float16 or bfloat16, got {x.dtype}")
    if not isinstance(group, int) or group < 16 or group & (group - 1):
        raise ValueError(f"the quantisation group must be a power of two of at least 16, got {group!r}")


def quantize_act_fp8_groups_torch(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K / group)]): each group of ``group``
    columns of a row divided by amax / 448 (the PyTorch twin of ``quantize_act_fp8_groups``)."""
    _check_act(x, group)
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.zeros(m, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    tiles = padded.view(m, groups, group)
    scale = tiles.abs().amax(dim=-1).clamp_min(_MIN_AMAX) / FP8_MAX  # [M, G]
    q = (tiles / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(m, groups * group)[:, :k]
    return q.to(torch.float8_e4m3fn), scale


@triton.jit
def _round_e4m3(v):
    """``v`` (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, in float32
    arithmetic: the conversion after it is then exact. Triton's interpreter converts with a
    rounding that is wrong where it carries into the exponent (1.98 -> 1.0); the GPU's
    conversion rounds to nearest even, as this does."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # below 2^-6: e4m3's subnormal step
    quantum = tl.exp2((exponent - 3).to(tl.float32))  # 3 mantissa bits
    scaled = v / quantum  # exact: a power of two; |scaled| < 16
    rounded = (scaled + 12582912.0) - 12582912.0  # 1.5 * 2^23: float32 rounds to an integer, ties to even
    return rounded * quantum


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, n_groups,
                     GROUP: tl.constexpr, FMAX: tl.constexpr, MIN_AMAX: tl.constexpr):
    row = tl.program_id(0)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX) / FMAX
    q = _round_e4m3(tl.minimum(tl.maximum(x / scale, -FMAX), FMAX))
    tl.store(q_ptr + row * stride_q + cols, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row * n_groups + g, scale)


def quantize_act_fp8_groups(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations -> (e4m3 [M, K], float32 scales [M, ceil(K / group)]), one program per
    (row, group): the scale is the group's amax / 448, the values divided by it and rounded to
    e4m3 (saturating). Equals ``quantize_act_fp8_groups_torch`` to the bit."""
    _check_act(x, group)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    groups = -(-k // group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        _quantize_kernel[(m, groups)](x, q, scale, k, x.stride(0), q.stride(0), groups, GROUP=group,
                                      FMAX=FP8_MAX, MIN_AMAX=_MIN_AMAX)
    return q, scale


def _check_matmul(a, a_scale, w, w_scale, block) -> tuple[int, int]:
    """The block (bn, bk) after checking every shape and dtype, naming what does not fit."""
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"block must be two positive integers (bn, bk), got {block!r}")
    bn, bk = block
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"the block's K size must be a power of two of at least 16, got {bk}")
    for name, t in (("a", a), ("w", w)):
        if t.dim() != 2 or t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name} must be a 2-d float8_e4m3fn tensor, got {t.dtype} of shape {tuple(t.shape)}")
    (m, k), (n, kw) = a.shape, w.shape
    if k != kw:
        raise ValueError(f"a has {k} columns but w has {kw}: a is [M, K], w is [N, K]")
    groups = -(-k // bk)
    if tuple(a_scale.shape) != (m, groups):
        raise ValueError(f"a_scale has shape {tuple(a_scale.shape)}, but a {tuple(a.shape)} in groups of {bk} "
                         f"needs ({m}, {groups})")
    if tuple(w_scale.shape) != (-(-n // bn), groups):
        raise ValueError(f"w_scale has shape {tuple(w_scale.shape)}, but w {tuple(w.shape)} in blocks of "
                         f"{list(block)} needs ({-(-n // bn)}, {groups})")
    if a_scale.dtype != torch.float32 or w_scale.dtype != torch.float32:
        raise ValueError(f"scales must be float32, got a_scale {a_scale.dtype}, w_scale {w_scale.dtype}")
    return bn, bk


def fp8_block_matmul_torch(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                           block: tuple[int, int] = (128, 128), out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``fp8_block_matmul``'s PyTorch twin: both operands dequantised in float32, one matmul."""
    bn, bk = _check_matmul(a, a_scale, w, w_scale, block)
    k, n = a.shape[1], w.shape[0]
    a_deq = a.float() * a_scale.repeat_interleave(bk, dim=1)[:, :k]
    w_deq = w.float() * w_scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (a_deq @ w_deq.T).to(out_dtype)


@triton.jit
def _matmul_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, M, N, stride_am, stride_wn, stride_cm, K: tl.constexpr,
                   BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # K is a compile-time constant (a layer's width): the loop's bound, which Triton's
    # interpreter cannot take from a runtime argument under NumPy 2.4
    n_groups: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_scale_row = (rn // BN) * n_groups
    for g in range(0, n_groups):
        cols = g * BLOCK_K + rk
        k_ok = cols < K
        a = tl.load(a_ptr + rm[:, None] * stride_am + cols[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + cols[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        partial = tl.dot(a, tl.trans(w), out_dtype=tl.float32)
        a_s = tl.load(as_ptr + rm * n_groups + g, mask=m_ok, other=0.0)
        w_s = tl.load(ws_ptr + w_scale_row + g, mask=n_ok, other=0.0)
        acc += partial * a_s[:, None] * w_s[None, :]
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_block_matmul(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     block: tuple[int, int] = (128, 128), out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a @ w.T`` with block-scaled FP8 operands.

    Args:
        a: [M, K] e4m3 activations; a_scale: [M, ceil(K / bk)] float32 (``quantize_act_fp8_groups``
            with ``group=bk``).
        w: [N, K] e4m3 weight; w_scale: [ceil(N / bn), ceil(K / bk)] float32, one per block.
        block: (bn, bk), the checkpoint's ``weight_block_size``; bk a power of two >= 16.
        out_dtype: the result's dtype.
    Returns:
        [M, N] in ``out_dtype``: the float32 sum of each K slice's FP8 dot times its two scales.
    Raises:
        ValueError: a shape, dtype or block that does not fit, naming it.
    """
    bn, bk = _check_matmul(a, a_scale, w, w_scale, block)
    (m, k), n = a.shape, w.shape[0]
    if a.stride(-1) != 1:
        a = a.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if not m or not n:
        return out
    block_m, block_n = 64, 128
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _matmul_kernel[grid](a, a_scale.contiguous(), w, w_scale.contiguous(), out, m, n, a.stride(0), w.stride(0),
                         out.stride(0), K=k, BN=bn, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, num_warps=4)
    return out
