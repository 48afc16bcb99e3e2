"""The online-softmax step the MLA tile loops share (``ops/triton_mla.py``, ``ops/triton_mla_tma.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["softmax_step"]


@triton.jit
def softmax_step(s, m_i, l_i, valid, qk_scale):
    """Raw scores [BLOCK_H, BLOCK_N] of one key tile (``valid`` keys) -> (P, new running max,
    new running sum, the old accumulator's rescale), in log2 units (qk_scale includes log2(e))."""
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, m_new, l_i * alpha + tl.sum(p, 1), alpha
