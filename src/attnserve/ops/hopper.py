"""Gluon helpers that Hopper kernels of several operations share (``triton.experimental.gluon``).

``issue_pv`` (async P @ V into two 64..256-column accumulator halves), ``zero_rows_from`` (zero a
shared tile's rows past a sequence before they meet an MMA: stale slots may hold NaN, and 0 * NaN
is NaN) and ``store_p`` (P to shared memory, fenced for the next wgmma of both warp groups) serve
the MLA decode kernels (``ops/mla/``) and the causal prefill (``ops/attention/prefill_gluon.py``).
What it is not: host code (``ops/launch.py``), or any kernel's main loop.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

__all__ = ["issue_pv", "store_p", "zero_rows_from"]


@gluon.jit
def issue_pv(p_smem, kv0, kv1, acc0, acc1):
    """Async acc_h += P V_h for both value halves (each warp group: its 128 columns of each)."""
    acc0 = warpgroup_mma(p_smem, kv0, acc0, is_async=True)
    acc1 = warpgroup_mma(p_smem, kv1, acc1, is_async=True)
    return acc0, acc1


@gluon.jit
def store_p(p_smem, p):
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()  # visible to the next wgmma (async proxy) ...
    gl.thread_barrier()  # ... of both warp groups


@gluon.jit
def zero_rows_from(buf, first, LAYOUT: gl.constexpr):
    """Rows ``first..`` of a [PAGE, N] shared tile set to 0 (through registers)."""
    rows = gl.arange(0, buf.shape[0], layout=gl.SliceLayout(1, LAYOUT))
    x = buf.load(LAYOUT)
    buf.store(gl.where((rows < first)[:, None], x, gl.zeros_like(x)))
