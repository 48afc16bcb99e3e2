"""Small-M matrix products with a fused prologue: y [M, N] = f(x) [M, K] @ W [N, K]^T (+ bias).

For decode batches (M up to ``MAX_M``), where a step is bound by reading the weights: each
program owns a ``block_n`` slice of W's rows and loops over K in ``block_k`` chunks (W is
K-contiguous, as ``nn.Linear.weight`` stores it, so every tile load is coalesced), with no
split-K and no second reduction kernel. The prologue f is computed per K chunk from the raw
activations in every program, so the elementwise op before the product needs no kernel or
round trip of its own:

- ``linear``: f(x) = x.
- ``rms_norm_linear``: f = RMSNorm(x) * w, or RMSNorm(x + residual) * w with ``x + residual``
  also written out (by program 0, once) as the next residual; each program first sums the
  squares of its whole rows (a few KB read from L2, whole rows per step where they fit).
- ``act_and_mul_linear``: x = [gate | up] [M, 2K], f = act(gate) * up (``FUSED_ACTS``).

The prologues round where ``layers/fused.py``'s twins round (the normed row cast to the dtype
before the weight, the activation cast before the product), so f(x) is the unfused path's
operand bit for bit up to fp32 math functions and reduction order; products accumulate in fp32
and y is rounded once to x's dtype. Without ``GemvConfig.dot`` (meant for M == 1) a program
multiplies elementwise into a [block_n, block_k] fp32 tile ([M, block_n, block_k] for M > 1)
and sums it once after the loop; with ``dot`` the tile product is a ``tl.dot`` with M padded to
16 (IEEE fp32 for fp32 inputs).

Configs are pinned, never autotuned (autotuning breaks CUDA-graph capture and the interpreter):
``CONFIGS`` maps (prologue, M bucket, N, K) to a ``GemvConfig`` and ``config_for`` falls back to
a rule of thumb; ``benchmarks/gpu_gemv.py`` sweeps candidates and prints the entries to pin, and every
wrapper takes an explicit ``config``. Under ``TRITON_INTERPRET=1`` one small config runs.

What this is not: the dispatch (``layers/gemv.py`` decides when these run and holds the PyTorch
twins), large-M GEMMs (cuBLAS), quantised weights, autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnserve import env
from attnserve.ops.dense.fused_triton import ACT_IDS, FUSED_ACTS, gated_product

__all__ = ["CONFIGS", "MAX_M", "PROLOGUES", "GemvConfig", "act_and_mul_linear", "config_for", "linear",
           "rms_norm_linear"]

MAX_M = 16  # the most rows a launch takes (the dot path pads M to 16)
PROLOGUES = ("plain", "norm", "act")  # f(x) = x, RMSNorm(x [+ residual]), act(gate) * up
_PLAIN, _RMS, _ACT = 0, 1, 2  # their ids in the kernel


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """One launch shape: W rows per program, K per loop step, warps, pipelining depth, and
    whether the tile product is a ``tl.dot`` (M padded to 16) or an elementwise multiply."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    dot: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {v}")
        if self.dot and (self.block_n < 16 or self.block_k < 16):
            raise ValueError(f"a dot config needs block_n and block_k >= 16, got {self}")
        if self.num_stages < 1:
            raise ValueError(f"GemvConfig.num_stages must be >= 1, got {self.num_stages}")


# (prologue, M bucket: 1, 2, 4, 8 or 16, N, K) -> config. Entries pin the winners of
# ``benchmarks/gpu_gemv.py`` on the H200; shapes not listed take ``_rule_of_thumb``.
# The H200 sweep of 2026-12-02 (M == 1; at M >= 2 cuBLAS won every shape, layers/gemv.MAX_M):
CONFIGS: dict[tuple[str, int, int, int], GemvConfig] = {
    ("norm", 1, 6144, 4096): GemvConfig(8, 1024, 4, 3),  # Llama-3.1-8B qkv: 16.9 us (70%)
    ("norm", 1, 28672, 4096): GemvConfig(8, 1024, 4, 3),  # gate_up: 60.3 us (92%)
    ("plain", 1, 4096, 4096): GemvConfig(8, 512, 4, 3),  # o_proj: 10.7 us (74%)
    ("act", 1, 4096, 14336): GemvConfig(8, 512, 4, 3),  # down: 29.6 us (94%)
    ("norm", 1, 4096, 1024): GemvConfig(4, 1024, 4, 3),  # Qwen3-0.6B qkv
    ("norm", 1, 6144, 1024): GemvConfig(8, 1024, 4, 3),  # Qwen3-0.6B gate_up
}
_INTERPRET_CONFIG = GemvConfig(block_n=32, block_k=64, num_warps=1, num_stages=1)
_SMS = 132  # H200 multiprocessors
_SLOTS = 6 * _SMS  # M == 1 programs resident at once (~80 registers x 128 threads each)


def _m_bucket(m: int) -> int:
    return 1 if m <= 1 else triton.next_power_of_2(m)


def _rule_of_thumb(m: int, n: int, k: int, prologue: str) -> GemvConfig:
    """No split-K, so the grid is N / block_n programs. For M == 1, 4K-element tiles (8 KB of
    bf16, 32 fp32 accumulators a thread at 4 warps) and the widest block_n whose grid is one
    round of resident programs with >= 3 per SM (enough bytes in flight, no tail round); where
    none is, narrow rows over many rounds (the last round short). The weight loads are
    pipelined (3 stages; under the norm prologue too, where sm_90 builds take 110-240 registers
    a thread against 64-86, and the H200 still ran it fastest). With M > 1, ``tl.dot``
    tiles of 16 x block_n x block_k, >= 3 programs per SM."""
    if m == 1:
        fits = [b for b in (64, 32, 16, 8, 4) if 3 * _SMS <= triton.cdiv(n, b) <= _SLOTS]
        block_n = fits[0] if fits else 8 if triton.cdiv(n, 8) > _SLOTS else 4
        block_k = min(4096 // block_n, triton.next_power_of_2(k))
        # the norm prologue's sm_90 builds use more registers pipelined, but the H200 sweep
        # still found 3 stages fastest at every shape
        return GemvConfig(block_n, block_k, num_warps=4, num_stages=3)
    block_n = next((b for b in (64, 32) if triton.cdiv(n, b) >= 3 * _SMS), 16)
    block_k = min(128 if block_n == 64 else 256, triton.next_power_of_2(k))
    return GemvConfig(block_n, block_k, num_warps=4, num_stages=3, dot=True)


def config_for(m: int, n: int, k: int, prologue: str = "plain") -> GemvConfig:
    """The pinned config of a product: ``CONFIGS``, else the rule of thumb; the interpreter's."""
    if env.triton_interpret():
        return _INTERPRET_CONFIG
    return CONFIGS.get((prologue, _m_bucket(m), n, k)) or _rule_of_thumb(m, n, k, prologue)


# fmt: off
@triton.jit
def _row_inv_rms(x_ptr, r_ptr, s_ptr, rows, m_ok, sx, sr, eps, write, K: tl.constexpr,
                 HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / rms [BLOCK_M] of each row of s = x (+ r, rounded to x's dtype); with a residual,
    s is stored at ``s_ptr`` (contiguous [M, K]) where ``write`` (one program does it)."""
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask = m_ok[:, None] & (k[None, :] < K)
        s = tl.load(x_ptr + rows[:, None] * sx + k[None, :], mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + rows[:, None] * sr + k[None, :], mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(s.dtype)
            tl.store(s_ptr + rows[:, None] * K + k[None, :], s, mask=mask & write)
        s = s.to(tl.float32)
        acc += s * s
    return tl.rsqrt(tl.sum(acc, axis=1) / K + eps)


@triton.jit
def _operand(x_ptr, r_ptr, nw_ptr, rows, m_ok, k, k_ok, sx, sr, inv, K: tl.constexpr,
             PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr):
    """f(x) [BLOCK_M, BLOCK_K] at columns ``k``, in x's dtype (0 where masked)."""
    mask = m_ok[:, None] & k_ok[None, :]
    at = x_ptr + rows[:, None] * sx + k[None, :]
    x = tl.load(at, mask=mask, other=0.0)
    if PROLOGUE == 2:  # x = [gate | up]
        x = gated_product(x, tl.load(at + K, mask=mask, other=0.0), ACT)
    elif PROLOGUE == 1:  # as layers/norm.py: x / rms cast to the dtype, then times the weight
        ty = x.dtype
        if HAS_RES:
            r = tl.load(r_ptr + rows[:, None] * sr + k[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(ty)
        h = (x.to(tl.float32) * inv[:, None]).to(ty).to(tl.float32)
        w = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        x = (w[None, :] * h).to(ty)
    return x


@triton.jit(do_not_specialize=("M",))  # M only masks: one variant per BLOCK_M, not per M
def _gemv_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, s_ptr, M, N, sx, sr, sw, sy, eps,
                 K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                 HAS_BIAS: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NORM_BLOCK: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    m_ok = rows < M
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_rows = w_ptr + n.to(tl.int64)[:, None] * sw  # [BLOCK_N, 1]
    inv = tl.full([BLOCK_M], 1.0, tl.float32)
    if PROLOGUE == 1:
        inv = _row_inv_rms(x_ptr, r_ptr, s_ptr, rows, m_ok, sx, sr, eps, pid == 0, K, HAS_RES,
                           BLOCK_M, NORM_BLOCK)
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif BLOCK_M == 1:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):  # pipelined loads (cp.async)
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        if EVEN_K:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a = _operand(x_ptr, r_ptr, nw_ptr, rows, m_ok, k, k_ok, sx, sr, inv, K, PROLOGUE, HAS_RES, ACT)
        if DOT:
            acc = tl.dot(a, tl.trans(w), acc=acc, input_precision=PRECISION)
        elif BLOCK_M == 1:  # [1, BLOCK_K] * [BLOCK_N, BLOCK_K], summed once after the loop
            acc2 += a.to(tl.float32) * w.to(tl.float32)
        else:  # [BLOCK_M, 1, BLOCK_K] * [1, BLOCK_N, BLOCK_K], likewise
            acc3 += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if not DOT:
        if BLOCK_M == 1:
            acc = tl.sum(acc2, axis=1)[None, :]
        else:
            acc = tl.sum(acc3, axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rows[:, None] * sy + n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
# fmt: on


def _norm_block(block_m: int, k: int, block_k: int) -> int:
    """Columns per step of the sum-of-squares pass: whole rows where they fit in 4K elements (one
    round trip to L2 before the first weight load at M == 1, K <= 4096), at most 32 fp32 values a
    thread at 4 warps (more would raise the registers of the whole kernel)."""
    if env.triton_interpret():
        return block_k
    return min(triton.next_power_of_2(k), max(16, 4096 // block_m))


def _check(x: torch.Tensor, k: int, weight: torch.Tensor, bias: torch.Tensor | None, what: str) -> None:
    if x.dim() != 2 or x.shape[0] > MAX_M:
        raise ValueError(f"{what}: x must be [M, ...] with M <= {MAX_M}, got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"{what}: weight must be a row-major [N, {k}], got {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    if weight.dtype != x.dtype or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{what}: x ({x.dtype}) and weight ({weight.dtype}) must share one float dtype")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"{what}: bias must be [{weight.shape[0]}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(x, residual, norm_weight, weight, bias, s_out, k, eps, prologue, act, config) -> torch.Tensor:
    m, n = x.shape[0], weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    cfg = config or config_for(m, n, k, PROLOGUES[prologue])
    block_m = max(16, triton.next_power_of_2(m)) if cfg.dot else triton.next_power_of_2(m)
    res = residual if residual is not None else x
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, res, norm_weight if norm_weight is not None else x, weight, bias if bias is not None else weight,
        y, s_out if s_out is not None else y, m, n, x.stride(0), res.stride(0), weight.stride(0), y.stride(0),
        float(eps), K=k, PROLOGUE=prologue, HAS_RES=residual is not None, ACT=act, HAS_BIAS=bias is not None,
        DOT=cfg.dot, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NORM_BLOCK=_norm_block(block_m, k, cfg.block_k),
        EVEN_K=k % cfg.block_k == 0, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return y


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, config: GemvConfig | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [M, K], M <= ``MAX_M``: y [M, N] in x's dtype."""
    x = _rows(x)
    _check(x, x.shape[-1], weight, bias, "linear")
    return _launch(x, None, None, weight, bias, None, x.shape[1], 0.0, _PLAIN, 0, config)


def rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``F.linear(rms_norm(x [+ residual]), weight, bias)`` in one launch.

    Args:
        x: [M, K], M <= ``MAX_M``.
        norm_weight: [K], x's dtype (a plain RMSNorm weight, not zero-centred).
        eps: added to the mean square.
        weight: [N, K] row-major, x's dtype; bias: [N] or None.
        residual: [M, K] like x, or None.
    Returns:
        y [M, N]; with a residual ``(y, s)``, s = x + residual [M, K] (a new tensor), y computed
        from rms_norm(s). The same roundings as ``rms_norm_ref`` then ``F.linear``.
    """
    x = _rows(x)
    k = x.shape[-1]
    _check(x, k, weight, bias, "rms_norm_linear")
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"rms_norm_linear: norm weight must be [{k}] {x.dtype}, got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype}")
    s_out = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"rms_norm_linear: residual {tuple(residual.shape)} {residual.dtype} must match "
                             f"x {tuple(x.shape)} {x.dtype}")
        residual = _rows(residual)
        s_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = _launch(x, residual, norm_weight.contiguous(), weight, bias, s_out, k, eps, _RMS, 0, config)
    return y if s_out is None else (y, s_out)


def act_and_mul_linear(
    gate_up: torch.Tensor,
    act: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """``F.linear(act(gate) * up, weight, bias)`` for gate_up [M, 2K] = [gate | up], one launch.

    ``act`` is one of ``FUSED_ACTS``; y [M, N] in gate_up's dtype.
    """
    if act not in ACT_IDS:
        raise ValueError(f"unsupported fused activation '{act}' (supported: {FUSED_ACTS})")
    gate_up = _rows(gate_up)
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"act_and_mul_linear: gate_up must be [M, 2K], got {tuple(gate_up.shape)}")
    k = gate_up.shape[-1] // 2
    _check(gate_up, k, weight, bias, "act_and_mul_linear")
    return _launch(gate_up, None, None, weight, bias, None, k, 0.0, _ACT, ACT_IDS[act], config)
