"""Paged decode attention on x86-64 CPUs: the AVX2 + FMA kernel of ``csrc/cpu_paged_decode.cpp``.

One query token per sequence reads its K/V cache blocks in place (no gathered copy), the query
heads of a KV head together, with float32 accumulation and an online softmax (see the C++
file). It is built just in time with ``torch.utils.cpp_extension`` on first use (gcc, a few
tens of seconds once; torch caches the build under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``, and rebuilds only when the source changes) and registered as
``torch.ops.attnserve_cpu.paged_decode``.

``available()`` says whether it can run here: not switched off (``ATTNSERVE_CPU_DECODE_KERNEL=0``),
an x86-64 CPU with AVX2, and a build that succeeded; a failed build is logged once and the
caller keeps its PyTorch path. ``supports`` says whether it serves a given layer and dtype.
The PyTorch twin is TORCH_SDPA's bucketed decode (``attention/backends/torch_sdpa.py``) and
``attention/reference.py``.

What it is not: prefills, windows, ALiBi, sinks, soft-capping, fp8 caches, GPUs.
"""

from __future__ import annotations

import logging
import platform
import time
from pathlib import Path

import torch

from attnserve import env

__all__ = ["available", "supports", "paged_decode", "DTYPES"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "cpu_paged_decode.cpp"
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]  # OpenMP: at::parallel_for's threads
_LDFLAGS = ["-fopenmp"]  # libgomp.so.1: the one torch has loaded already
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_built: bool | None = None  # None: not tried yet


def _cpu_ok() -> str | None:
    """Why this CPU cannot run the kernel, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"no AVX2 (torch reports {capability})"
    return None


def _build() -> bool:
    why = _cpu_ok()
    if why is None:
        try:
            from torch.utils import cpp_extension

            start = time.perf_counter()
            cpp_extension.load("attnserve_cpu_paged_decode", [str(_SOURCE)], extra_cflags=_CFLAGS,
                               extra_ldflags=_LDFLAGS, is_python_module=False, verbose=False)
            seconds = time.perf_counter() - start
            (logger.info if seconds > 1.0 else logger.debug)("CPU decode kernel built in %.1f s (cached for the "
                                                              "next start)", seconds)
            return True
        except Exception as e:  # no compiler, no ninja, a failed build: the PyTorch path stays
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    logger.warning("CPU decode kernel unavailable (%s): decodes take the bucketed SDPA path", why)
    return False


def available() -> bool:
    """Whether the kernel can run (switched on, this CPU, built; the first call builds it)."""
    global _built
    if not env.cpu_decode_kernel():
        return False
    if _built is None:
        _built = _build()
    return _built


def supports(layer, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the kernel serves this layer's decodes: plain causal attention (no window, ALiBi,
    sinks or soft-capping) on CPU tensors of one float dtype, head dims a multiple of 8."""
    return (q.device.type == "cpu" and q.dtype in DTYPES and key_cache.dtype == q.dtype
            and value_cache.dtype == q.dtype and q.shape[-1] % 8 == 0 and value_cache.shape[-1] % 8 == 0
            and layer.window is None and layer.alibi_slopes is None and layer.sinks is None
            and layer.softcap is None and getattr(layer, "streaming", None) is None)


def paged_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """Decode attention over the paged cache, written into ``out``.

    Args:
        q: [B, H, D], the head dimension contiguous.
        key_cache, value_cache: [num_blocks, block_size, Hkv, D / Dv] in q's dtype.
        block_table: [>= B, W] int32 block ids, rows contiguous; seq_lens: [>= B] int32 keys
            per sequence (the query is the last of them), contiguous.
        scale: the softmax scale.
        out: [B, H, Dv] in q's dtype.
    Returns:
        ``out``.
    """
    if not available():
        raise RuntimeError("the CPU decode kernel is not available here (see the log)")
    torch.ops.attnserve_cpu.paged_decode(q, key_cache, value_cache, block_table, seq_lens, float(scale), out)
    return out
