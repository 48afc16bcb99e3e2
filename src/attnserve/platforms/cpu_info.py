"""The host CPU: its model name and the instruction-set flags attnserve's CPU choices read.

Two choices read them: ``dtype="auto"`` on CPU (bfloat16 where the CPU has native bf16 dot
products, AVX512_BF16 or AMX-BF16, float32 elsewhere: ``CpuInfo.auto_dtype``) and the path
the C++ decode kernel takes (``CpuInfo.decode_isa``: AVX-512 with bf16 dot products, AVX-512,
or AVX2). Linux's ``/proc/cpuinfo`` is read where it exists (the flags the kernel reports, so
the OS's support included); elsewhere, or where it cannot be read, torch's own CPU probes
(``torch.cpu._is_*_supported``, from the cpuinfo library). ``ATTNSERVE_CPU_ISA`` (``env.py``)
caps the flags (``avx2``: as an AVX2-only CPU), for debugging and benchmarks.

What this is not: the Platform record (``base.py``) or the backends' priorities (``cpu.py``).
"""

from __future__ import annotations

import functools
import platform as host
from dataclasses import dataclass
from pathlib import Path

from attnserve import env

__all__ = ["ISA_LEVELS", "CpuInfo", "cpu_info", "detect"]

# the flags attnserve reads or reports, by their /proc/cpuinfo names
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
         "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # what the AVX-512 kernels need
# ATTNSERVE_CPU_ISA's caps, lowest first: the flags each one drops
ISA_LEVELS = ("avx2", "avx512", "avx512_bf16")
_ABOVE = {
    "avx2": frozenset(f for f in FLAGS if f.startswith(("avx512", "amx"))),
    "avx512": frozenset({"avx512_bf16", "avx512_fp16"} | {f for f in FLAGS if f.startswith("amx")}),
    "avx512_bf16": frozenset(f for f in FLAGS if f.startswith("amx")),
}


@dataclass(frozen=True, slots=True)
class CpuInfo:
    model: str  # "AMD EPYC 9R14 ...", or "" where unknown
    machine: str  # x86_64, aarch64, arm64, ...
    flags: frozenset[str]  # of FLAGS, after the cap
    source: str  # where the flags came from: "/proc/cpuinfo" or "torch.cpu"
    cap: str | None = None  # ATTNSERVE_CPU_ISA when set

    @property
    def x86_64(self) -> bool:
        return self.machine.lower() in ("x86_64", "amd64")

    @property
    def bf16_dot(self) -> str | None:
        """The native bf16 dot products this CPU has ("AMX-BF16", "AVX512_BF16"), or None."""
        if "amx_bf16" in self.flags and "amx_tile" in self.flags:
            return "AMX-BF16"
        if "avx512_bf16" in self.flags:
            return "AVX512_BF16"
        return None

    @property
    def decode_isa(self) -> str | None:
        """The C++ decode kernel's path on this CPU: avx512_bf16, avx512, avx2; None without AVX2."""
        if not self.x86_64 or not {"avx2", "fma", "f16c"} <= self.flags:
            return None
        if not set(_AVX512) <= self.flags:
            return "avx2"
        return "avx512_bf16" if "avx512_bf16" in self.flags else "avx512"

    def auto_dtype(self, checkpoint_dtype: str) -> tuple[str, str]:
        """``dtype="auto"`` on this CPU: (dtype, why). bfloat16 where the CPU has native bf16
        dot products (torch's bf16 matrix products run 3-4x float32's there), float32 elsewhere
        (bf16 without them is emulated: about 1/6 of float32's rate on an AVX2 CPU); the
        checkpoint's dtype is converted as it loads."""
        capped = f" (ATTNSERVE_CPU_ISA={self.cap})" if self.cap else ""
        if self.bf16_dot:
            dtype, why = "bfloat16", f"this CPU has native bf16 dot products ({self.bf16_dot}){capped}"
        else:
            dtype, why = "float32", f"this CPU has no native bf16 dot products (AVX512_BF16, AMX-BF16){capped}"
        return dtype, f'dtype "auto" on CPU: {why}; the checkpoint\'s dtype is {checkpoint_dtype}'

    def describe(self) -> str:
        """One line: the model, the machine and the flags (as ``/proc/cpuinfo`` names them)."""
        flags = " ".join(f for f in FLAGS if f in self.flags) or "none of attnserve's"
        capped = f", capped by ATTNSERVE_CPU_ISA={self.cap}" if self.cap else ""
        return f"{self.model or 'unknown CPU'} ({self.machine}); flags: {flags} (from {self.source}{capped})"


def _from_proc(text: str) -> tuple[str, frozenset[str]] | None:
    model, flags = "", None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and flags is None:  # x86 / arm64 names
            flags = frozenset(value.split())
        if model and flags is not None:
            break
    return None if flags is None else (model, flags)


def _from_torch() -> frozenset[str]:
    import torch

    probe = {name: getattr(torch.cpu, f"_is_{name}_supported", None)
             for name in ("avx2", "avx512", "avx512_bf16", "amx_tile", "vnni")}
    has = {name: bool(fn()) if fn is not None else False for name, fn in probe.items()}
    flags = set()
    if has["avx2"]:
        flags |= {"avx2", "fma", "f16c"}  # torch's AVX2 level needs FMA; every AVX2 CPU has F16C
    if has["avx512"]:
        flags |= set(_AVX512)  # torch's AVX512 level: F, BW, VL, DQ
    if has["avx512_bf16"]:
        flags.add("avx512_bf16")
    if has["vnni"]:
        flags.add("avx512_vnni")
    if has["amx_tile"]:
        flags |= {"amx_tile", "amx_bf16"}  # every AMX CPU so far has AMX-BF16
    return frozenset(flags)


def detect(cap: str | None = None, proc_cpuinfo: str | None = "/proc/cpuinfo") -> CpuInfo:
    """This CPU's info, its flags capped at ``cap`` (one of ISA_LEVELS, or None). Reads
    ``proc_cpuinfo`` where it exists (None: torch's probes only)."""
    if cap is not None and cap not in ISA_LEVELS:
        raise ValueError(f"a CPU instruction-set cap must be one of {', '.join(ISA_LEVELS)}, got {cap!r}")
    parsed = None
    if proc_cpuinfo is not None:
        try:
            parsed = _from_proc(Path(proc_cpuinfo).read_text(errors="replace"))
        except OSError:  # not Linux, or no access
            parsed = None
    if parsed is not None:
        model, flags, source = parsed[0], parsed[1], "/proc/cpuinfo"
    else:
        model, flags, source = host.processor(), _from_torch(), "torch.cpu"
    flags = frozenset(f for f in FLAGS if f in flags)
    if cap is not None:
        flags -= _ABOVE[cap]
    return CpuInfo(model=model, machine=host.machine(), flags=flags, source=source, cap=cap)


@functools.cache
def _cached(cap: str | None) -> CpuInfo:
    return detect(cap)


def cpu_info() -> CpuInfo:
    """This machine's CPU (detected once per ``ATTNSERVE_CPU_ISA`` value)."""
    return _cached(env.cpu_isa())
