"""Compiling Triton kernels for the H200 (sm_90) without a GPU, for the kernel tests.

A test gives a script body that wraps kernels in ``record`` and calls the real launch code; the
body runs in a fresh interpreter without ``TRITON_INTERPRET``, the recorded launches (GPU
configs, constexprs, dtypes) are compiled down to a cubin, and each prints one line
``compiled <kernel> shared <bytes>``. That catches what the interpreter cannot: typing,
layouts, shared memory.
"""

from __future__ import annotations

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
    src = ASTSource(kernel, signature, {(names.index(k),): v for k, v in consts.items()}, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    print("compiled", kernel.__name__, "shared", compiled.metadata.shared, flush=True)
"""


def compile_for_sm90(body: str) -> list[int]:
    """Run ``body`` (launches under ``record``) and compile what it launched for sm_90.

    Returns:
        The shared memory in bytes of each compiled launch, in launch order.
    """
    # Triton's cache is keyed by the kernel source, so a cached compile is still a valid check.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PRELUDE + body + _COMPILE], env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode == 77:
        pytest.skip(f"no Triton CUDA backend to compile with: {proc.stdout.strip()}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    shared = [int(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("compiled")]
    assert max(shared, default=0) <= 227 * 1024, proc.stdout  # H100/H200 shared memory per block
    return shared
