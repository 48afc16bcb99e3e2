"""Triton JIT helpers that kernels of several files share: the online-softmax step of the MLA tile
loops (``ops/mla/decode_triton.py``, ``ops/mla/decode_triton_tma.py``) and the search from a
query block to its request in a varlen batch (``ops/attention/paged_triton.py``,
``ops/attention/prefill_gluon.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["find_seq", "softmax_step"]


@triton.jit
def softmax_step(s, m_i, l_i, valid, qk_scale):
    """Raw scores [BLOCK_H, BLOCK_N] of one key tile (``valid`` keys) -> (P, new running max,
    new running sum, the old accumulator's rescale), in log2 units (qk_scale includes log2(e))."""
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, m_new, l_i * alpha + tl.sum(p, 1), alpha


@triton.jit
def find_seq(qsl_ptr, num_seqs, q_block_id, BLOCK_Q: tl.constexpr):
    """Largest request i whose first q block id (qsl[i] // BLOCK_Q + i) is <= q_block_id."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid)
        if BLOCK_Q > 1:
            first = first // BLOCK_Q + mid
        if first <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1
