"""The device's two ceilings, measured in the run that quotes fractions of them.

A kernel's bandwidth or FLOP rate means little without the rate the same device reaches, in
the same run, at its simplest job: a device-to-device copy (bytes counted as read + write) and
a dense matrix product (cuBLAS ``torch.mm``, bf16 on CUDA, 2 n^3 FLOPs).
``measure_ceilings`` times both; ``fractions`` turns a kernel's rates into percentages of the
measured ceilings and of the nominal ones the project quoted before (``NOMINAL_BW``,
``NOMINAL_FLOPS``), so older numbers stay comparable.

On CUDA the time is ``triton.testing.do_bench``'s median (CUDA events); on CPU, where it has
no events, the median of a ``time.perf_counter`` loop, at tiny default sizes and with a float32
product (CPU bf16 matmuls are slow). CPU numbers only show that the code runs; they are no
device's ceiling. Not a kernel benchmark itself: ``gpu_attention.py``, ``gpu_mla.py`` and
``gpu_moe.py`` call it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

NOMINAL_BW = 4.25e12  # bytes/s: device copy (read + write) on the lent H200, as quoted so far
NOMINAL_FLOPS = 790e12  # FLOP/s: bf16 dense matrix product on the H200, as quoted so far
CUDA_SIZES = (1 << 30, 8192)  # copy bytes (each way), matmul n
CPU_SIZES = (8 << 20, 256)


def median_seconds(fn: Callable[[], object], device: torch.device, rep_ms: int = 100) -> float:
    """Median seconds of ``fn()``: do_bench on CUDA, a perf_counter loop (>= 5 calls) on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e-3
    fn()  # warm-up: first touch of the pages, thread pool start
    times: list[float] = []
    deadline = time.perf_counter() + rep_ms * 1e-3
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 1000):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _copy_seconds(num_bytes: int, device: torch.device) -> float:
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)  # same dtype, contiguous: a plain device-to-device copy
    return median_seconds(lambda: dst.copy_(src), device)


def _gemm_seconds(n: int, dtype: torch.dtype, device: torch.device) -> float:
    g = torch.Generator(device).manual_seed(0)
    a, b = (torch.randn(n, n, generator=g, device=device, dtype=dtype) for _ in range(2))
    return median_seconds(lambda: torch.mm(a, b), device)


def measure_ceilings(
    device: str | torch.device = "cuda",
    *,
    copy_bytes: int | None = None,
    gemm_n: int | None = None,
) -> dict:
    """Copy bandwidth and matmul rate of ``device``, timed now.

    Args:
        device: a CUDA device or the CPU (smoke runs).
        copy_bytes: bytes of the copied buffer (each of source and destination); default 1 GiB
            on CUDA, 8 MiB on CPU.
        gemm_n: the product is n x n times n x n; default 8192 on CUDA, 256 on CPU.

    Returns:
        a JSON-ready dict: ``copy_bw`` (B/s, read + write) and ``matmul_flops`` (FLOP/s), the
        sizes, dtype and timer behind them, and ``nominal_bw`` / ``nominal_flops``.
    """
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"measure_ceilings: device must be cuda or cpu, got {device}")
    cuda = device.type == "cuda"
    default_bytes, default_n = CUDA_SIZES if cuda else CPU_SIZES
    copy_bytes = default_bytes if copy_bytes is None else copy_bytes
    gemm_n = default_n if gemm_n is None else gemm_n
    for name, value in (("copy_bytes", copy_bytes), ("gemm_n", gemm_n)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"measure_ceilings: {name} must be a positive int, got {value!r}")
    dtype = torch.bfloat16 if cuda else torch.float32

    copy_s = _copy_seconds(copy_bytes, device)
    gemm_s = _gemm_seconds(gemm_n, dtype, device)
    if cuda:
        torch.cuda.empty_cache()
    result = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "copy_bytes": copy_bytes,
        "copy_us": copy_s * 1e6,
        "copy_bw": 2 * copy_bytes / copy_s,
        "gemm_n": gemm_n,
        "gemm_dtype": str(dtype).removeprefix("torch."),
        "gemm_us": gemm_s * 1e6,
        "matmul_flops": 2.0 * gemm_n**3 / gemm_s,
        "timer": "triton do_bench median" if cuda else "perf_counter median",
        "nominal_bw": NOMINAL_BW,
        "nominal_flops": NOMINAL_FLOPS,
    }
    if not cuda:
        result["note"] = "CPU smoke: tiny sizes, float32 matmul (CPU bf16 is slow); no ceiling"
    return result


def fractions(ceilings: dict, *, bw: float | None = None, flops: float | None = None) -> dict:
    """Percent of the nominal and the measured ceilings for a rate in B/s and/or FLOP/s:
    ``pct_bw``, ``pct_bw_measured``, ``pct_flops``, ``pct_flops_measured``."""
    out = {}
    if bw is not None:
        out["pct_bw"] = 100 * bw / ceilings["nominal_bw"]
        out["pct_bw_measured"] = 100 * bw / ceilings["copy_bw"]
    if flops is not None:
        out["pct_flops"] = 100 * flops / ceilings["nominal_flops"]
        out["pct_flops_measured"] = 100 * flops / ceilings["matmul_flops"]
    return out


def describe(ceilings: dict) -> str:
    """One line for the printed report."""
    return (
        f"ceilings measured in this run on {ceilings['device']}: copy "
        f"{ceilings['copy_bw'] / 1e12:.2f} TB/s (nominal {ceilings['nominal_bw'] / 1e12:.2f}), "
        f"{ceilings['gemm_dtype']} mm n={ceilings['gemm_n']} "
        f"{ceilings['matmul_flops'] / 1e12:.1f} TFLOP/s (nominal "
        f"{ceilings['nominal_flops'] / 1e12:.0f})"
    )
