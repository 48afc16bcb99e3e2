"""Compiling Triton kernels for the H200 (sm_90) without a GPU, for the kernel tests.

A test gives a script body that wraps kernels in ``record`` and calls the real launch code; the
body runs in a fresh interpreter without ``TRITON_INTERPRET``, the recorded launches (GPU
configs, constexprs, dtypes) are compiled down to a cubin, and each prints one line
``compiled {json}``. That catches what the interpreter cannot: typing, layouts, shared memory;
with ``ptxas=True`` also the registers and spills (the bundled ptxas on the PTX, as the driver
would load it), the pipeliner's async copies (TTGIR), the wgmma forms, their waits, the TMA
loads and the cp.async sizes (PTX). Gluon kernels (``triton.experimental.gluon``) compile from
their own source class.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PRELUDE = r"""
import sys
import torch
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type
except ImportError as exc:
    print(exc); sys.exit(77)
try:
    from triton.experimental.gluon._runtime import GluonASTSource
except ImportError:  # a Triton without Gluon: only its own kernels compile
    GluonASTSource = None

calls = []


class _Recorder:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: calls.append((self.kernel, args, kwargs))


def record(module, *names):
    for name in names:
        setattr(module, name, _Recorder(getattr(module, name)))
"""

_COMPILE = r"""
import json, os, re, subprocess, tempfile

ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
for kernel, args, kwargs in calls:
    names = kernel.arg_names
    consts = {k: v for k, v in kwargs.items() if k in names}
    options = {k: v for k, v in kwargs.items() if k not in names}
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        value = args[i]
        signature[name] = mangle_type(value)
        aligned = value.data_ptr() % 16 == 0 if torch.is_tensor(value) else (
            isinstance(value, int) and value % 16 == 0)
        if aligned:  # what the launcher would specialise on for such values
            attrs[(i,)] = [["tt.divisibility", 16]]
    gluon = getattr(kernel, "is_gluon", lambda: False)()
    source = GluonASTSource if gluon else ASTSource  # Gluon kernels skip TTIR
    src = source(kernel, signature, {(names.index(k),): v for k, v in consts.items()}, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    info = {"kernel": kernel.__name__, "shared": compiled.metadata.shared}
    if PTXAS:
        ptx = compiled.asm["ptx"]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernel.ptx")
            with open(path, "w") as f:
                f.write(ptx)
            report = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", path + ".cubin"],
                                    capture_output=True, text=True, check=True).stderr
        info["regs"] = int(re.search(r"Used (\d+) registers", report).group(1))
        info["spill"] = sum(int(n) for n in re.findall(r"(\d+) bytes spill", report))
        info["async_copies"] = compiled.asm["ttgir"].count("ttg.async_copy_global_to_local")
        info["wgmma"] = sorted(set(re.findall(r"wgmma\.mma_async\S*", ptx)))
        info["wgmma_waits"] = sorted(int(n) for n in re.findall(r"wgmma\.wait_group\S* (\d+)", ptx))
        info["tma_loads"] = ptx.count("cp.async.bulk.tensor")
        info["setmaxnreg"] = sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
        info["wgmma_a_regs"] = bool(re.search(r"wgmma\.mma_async\S*\s+\{[^}]*\},\s*\{", ptx))
        copies = re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (\w+)", ptx)
        info["cp_async_bytes"] = sorted({int(n, 0) for n in copies})
        info["e4m3_cvts"] = ptx.count("cvt.rn.f16x2.e4m3x2")
    print("compiled", json.dumps(info), flush=True)
"""


def compile_for_sm90(body: str, ptxas: bool = False) -> list[dict]:
    """Run ``body`` (launches under ``record``) and compile what it launched for sm_90.

    Returns:
        One dict per compiled launch, in launch order: ``kernel``, ``shared`` (bytes) and, with
        ``ptxas``, ``regs``, ``spill`` (bytes stored and loaded), ``async_copies`` (in the
        TTGIR), ``wgmma`` (the distinct instructions of the PTX), ``wgmma_waits`` (the pending
        counts of its ``wgmma.wait_group``s, sorted), ``tma_loads`` (its TMA load sites),
        ``setmaxnreg`` (the distinct register counts warp-specialized partitions set, sorted),
        ``wgmma_a_regs`` (whether some wgmma takes its A operand from registers),
        ``cp_async_bytes`` (the distinct sizes of its non-bulk ``cp.async`` copies) and
        ``e4m3_cvts`` (its e4m3-pair conversions to f16).
    """
    # Triton's cache is keyed by the kernel source, so a cached compile is still a valid check.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = _PRELUDE + body + f"\nPTXAS = {ptxas}\n" + _COMPILE
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode == 77:
        pytest.skip(f"no Triton CUDA backend to compile with: {proc.stdout.strip()}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    prefix = "compiled "
    infos = [json.loads(line[len(prefix):]) for line in proc.stdout.splitlines() if line.startswith(prefix)]
    assert max((i["shared"] for i in infos), default=0) <= 227 * 1024, proc.stdout  # H100/H200 per block
    return infos
