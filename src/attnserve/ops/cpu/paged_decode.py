"""Paged decode attention on x86-64 CPUs: the AVX2 + FMA kernel of ``csrc/cpu_paged_decode.cpp``.

One query token per sequence reads its K/V cache blocks in place (no gathered copy), the query
heads of a KV head together, with float32 accumulation and an online softmax (see the C++
file). It is built just in time with ``torch.utils.cpp_extension`` on first use (gcc, a few
tens of seconds once; torch caches the build under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``, and rebuilds only when the source changes) and registered as
``torch.ops.attnserve_cpu.paged_decode``.

It is the ``cpu_ext`` variant of ``attention.decode`` (``attention/kernels.py``, whose ``takes``
says which layers it serves: plain causal attention of a float dtype, head sizes a multiple of 8,
a cache of the model dtype). ``prepare()`` is its prepare hook: it builds the extension (once,
then cached) and says why it cannot run here (not an x86-64 CPU with AVX2, a failed build), so
the plan passes it over for TORCH_SDPA's bucketed decode (``disabled_kernels=("cpu_ext",)``
turns it off). The PyTorch twin is that bucketed decode (``attention/backends/torch_sdpa.py``)
and ``attention/reference.py``.

What it is not: prefills, windows, ALiBi, sinks, soft-capping, fp8 caches, GPUs.
"""

from __future__ import annotations

import logging
import platform
import time
from pathlib import Path

import torch

__all__ = ["DTYPES", "available", "cpu_support", "paged_decode", "prepare"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "cpu_paged_decode.cpp"
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]  # OpenMP: at::parallel_for's threads
_LDFLAGS = ["-fopenmp"]  # libgomp.so.1: the one torch has loaded already
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_built: str | None = None  # None: not tried yet; "": built; else why it cannot run


def cpu_support() -> str | None:
    """Why this CPU cannot run the kernel, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"no AVX2 (torch reports {capability})"
    return None


def _build() -> str:
    """"" when the extension is built and registered, else why it cannot run (logged)."""
    why = cpu_support()
    if why is None:
        try:
            from torch.utils import cpp_extension

            start = time.perf_counter()
            cpp_extension.load("attnserve_cpu_paged_decode", [str(_SOURCE)], extra_cflags=_CFLAGS,
                               extra_ldflags=_LDFLAGS, is_python_module=False, verbose=False)
            seconds = time.perf_counter() - start
            (logger.info if seconds > 1.0 else logger.debug)("CPU decode kernel built in %.1f s (cached for the "
                                                              "next start)", seconds)
            return ""
        except Exception as e:  # no compiler, no ninja, a failed build: the PyTorch path stays
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    logger.warning("CPU decode kernel unavailable (%s): decodes take the bucketed SDPA path", why)
    return why or "the build failed"


def prepare() -> str | None:
    """The prepare hook: build the kernel (the first call; later calls return at once); None
    when it can run, else why not."""
    global _built
    if _built is None:
        _built = _build()
    return _built or None


def available() -> bool:
    """Whether the kernel can run here (this CPU, built; the first call builds it)."""
    return prepare() is None


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
