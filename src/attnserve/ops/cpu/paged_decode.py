"""Paged decode attention on x86-64 CPUs: the C++ kernel of ``csrc/``, with an AVX-512 path
(bf16 dot products where the CPU has AVX512_BF16) and an AVX2 path, chosen at run time.

One query token per sequence reads its K/V cache blocks in place (no gathered copy), the query
heads of a KV head together, with float32 accumulation and an online softmax (see
``csrc/cpu_paged_decode.cpp``). The paths (``ISAS``), best first:

- ``avx512_bf16``: AVX-512 with ``vdpbf16ps`` for bfloat16 caches (q . k and the weighted values
  as bf16 dot products, float32 sums; the softmax weights rounded to bf16 as torch's own bf16
  attention rounds them); float32 and float16 caches take the ``avx512`` kernel;
- ``avx512``: AVX-512F/BW/VL/DQ, rows widened to float32;
- ``avx2``: AVX2 + FMA + F16C, the build's baseline.

The AVX-512 code is compiled through per-function target attributes, so the library loads on
any AVX2 CPU; the path is the best both the CPU's flags (``platforms/cpu_info.py``, capped by
``ATTNSERVE_CPU_ISA``) and the library's own cpuid check allow, and ``paged_decode(isa=...)``
forces one (a path the CPU lacks is an error). It is built just in time with
``torch.utils.cpp_extension`` on first use (gcc, 15-25 s once) into attnserve's cache,
``~/.cache/attnserve/torch_extensions/attnserve_cpu_paged_decode-<key>``, the key a hash of its
sources and header, flags, Python and torch (``extension.py``): later starts load that build in
milliseconds, and the log says whether it was built or loaded. It registers as
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
from pathlib import Path

import torch

from attnserve.ops.cpu.extension import load_extension
from attnserve.platforms.cpu_info import cpu_info

__all__ = ["DTYPES", "ISAS", "available", "cpu_support", "kernel_isa", "paged_decode", "prepare", "supported_isas"]

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
# the op, the AVX2 path, the AVX-512 paths; paged_decode.h, their shared header, is in the build's key
_SOURCES = [_CSRC / "cpu_paged_decode.cpp", _CSRC / "paged_decode_avx2.cpp", _CSRC / "paged_decode_avx512.cpp"]
_HEADERS = [_CSRC / "paged_decode.h"]
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]  # OpenMP: at::parallel_for's threads
_LDFLAGS = ["-fopenmp"]  # libgomp.so.1: the one torch has loaded already
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ISAS = ("avx2", "avx512", "avx512_bf16")  # the kernel's paths, lowest first (the op's codes 1, 2, 3)
_built: str | None = None  # None: not tried yet; "": built; else why it cannot run
_isa: str | None = None  # the path paged_decode takes by default, once built


def cpu_support() -> str | None:
    """Why this CPU cannot run the kernel, or None."""
    info = cpu_info()
    if not info.x86_64:
        return f"not an x86-64 CPU ({info.machine})"
    if info.decode_isa is None:
        return f"no AVX2 + FMA + F16C (flags: {' '.join(sorted(info.flags)) or 'none'})"
    return None


def supported_isas() -> tuple[str, ...]:
    """The paths this CPU runs, lowest first: those up to both the flags' (capped by
    ``ATTNSERVE_CPU_ISA``) and the library's cpuid check. Builds the kernel; () where it
    cannot run."""
    if not available():
        return ()
    best = min(ISAS.index(cpu_info().decode_isa), int(torch.ops.attnserve_cpu.best_isa()) - 1)
    return ISAS[:best + 1]


def _build() -> str:
    """"" when the extension is built and registered, else why it cannot run (logged)."""
    global _isa
    why = cpu_support()
    if why is None:
        try:
            loaded = load_extension("attnserve_cpu_paged_decode", _SOURCES, _HEADERS, _CFLAGS, _LDFLAGS)
            best = min(ISAS.index(cpu_info().decode_isa), int(torch.ops.attnserve_cpu.best_isa()) - 1)
            _isa = ISAS[best]
            logger.info("CPU decode kernel: the %s path, %s", _isa, loaded.describe())
            logger.debug("CPU decode kernel: %s", cpu_info().describe())
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


def kernel_isa() -> str | None:
    """The path ``paged_decode`` takes by default here; None where the kernel cannot run."""
    return _isa if available() else None


def paged_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """Decode attention over the paged cache, written into ``out``.

    Args:
        q: [B, H, D], the head dimension contiguous.
        key_cache, value_cache: [num_blocks, block_size, Hkv, D / Dv] in q's dtype.
        block_table: [>= B, W] int32 block ids, rows contiguous; seq_lens: [>= B] int32 keys
            per sequence (the query is the last of them), contiguous.
        scale: the softmax scale.
        out: [B, H, Dv] in q's dtype.
        isa: the path, one of ``ISAS`` (tests, benchmarks); None: ``kernel_isa()``.
    Returns:
        ``out``.
    Raises:
        RuntimeError: the kernel cannot run here, bad inputs, or an ``isa`` this CPU lacks.
        ValueError: an ``isa`` that names no path.
    """
    if not available():
        raise RuntimeError("the CPU decode kernel is not available here (see the log)")
    if isa is None:
        isa = _isa
    elif isa not in ISAS:
        raise ValueError(f"isa must be one of {', '.join(ISAS)}, got {isa!r}")
    torch.ops.attnserve_cpu.paged_decode(q, key_cache, value_cache, block_table, seq_lens, float(scale), out,
                                         ISAS.index(isa) + 1)
    return out
