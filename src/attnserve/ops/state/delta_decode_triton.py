"""The gated delta rule's decode step (Gated DeltaNet, KDA) as one Triton kernel.

One program per (sequence, value head, tile of ``block_v`` value columns) reads its state tile
``S`` [dk, block_v] once, does the whole step in registers and writes it back once::

    S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q

with q and k those of the head's key head (value head h reads key head ``h // (Hv // Hk)``),
l2-normalised (eps inside the root) and q scaled by ``dk^-0.5``, as ``_prepare_qk`` in
``attention/state/gated_delta.py`` does. The log decay ``g`` is one value per head (Gated
DeltaNet) or one per key channel (KDA: each row of ``S`` decays at its own rate), a constexpr
switch. The PyTorch path gathers the rows, scales, runs two einsums, adds and scatters: about
five passes over the state and several launches, where this is one read and one write. Each
value tile recomputes the (small) q/k normalisation rather than sharing it.

Arithmetic is float32 whatever the input dtypes; the state is stored back in its own dtype and
the output in v's. A sequence whose state row is negative (padding) is skipped: its state is not
touched and its output is zeros. Two sequences must not share a state row (as in the twin, the
result would be undefined), except a CUDA graph's padded rows, which all run on the null slot 0,
whose content and their outputs nobody reads. The twin is ``delta_rule_decode``
(``attention/state``). Not here: the chunked prefill, the short conv, the gates that produce
``g`` and ``beta``. Configs are pinned (no autotune); under ``TRITON_INTERPRET=1`` the value
tile covers the whole head, since the interpreter pays per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve import env

__all__ = ["MAX_HEAD_K", "fused_delta_rule_decode"]

MAX_HEAD_K = 256  # the whole key dim of a tile lives in registers


# Kernels keep dense argument lists, as in ops/attention/paged_triton.py.
# fmt: off
@triton.jit
def _delta_rule_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, idx_ptr, out_ptr,
                              sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sg_b, sg_h, sg_k, sbeta_b, sbeta_h,
                              ss_n, ss_h, ss_k, ss_v, group, dk, dv, scale, eps,
                              L2NORM: tl.constexpr, G_PER_CHANNEL: tl.constexpr,
                              BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < dv
    out = out_ptr + (b * tl.num_programs(1) + h).to(tl.int64) * dv + cols  # out is [B, Hv, dv]
    slot = tl.load(idx_ptr + b).to(tl.int64)
    if slot < 0:  # a padded sequence: no state to advance
        tl.store(out, tl.zeros([BLOCK_V], dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=col_ok)
        return
    rows = tl.arange(0, BLOCK_K)
    row_ok = rows < dk
    b64 = b.to(tl.int64)
    hk = h // group  # the key head this value head reads
    q = tl.load(q_ptr + b64 * sq_b + hk * sq_h + rows, mask=row_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b64 * sk_b + hk * sk_h + rows, mask=row_ok, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    q = q * scale
    v = tl.load(v_ptr + b64 * sv_b + h * sv_h + cols, mask=col_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + b64 * sbeta_b + h * sbeta_h).to(tl.float32)
    mask = row_ok[:, None] & col_ok[None, :]
    s_ptrs = state_ptr + slot * ss_n + h * ss_h + rows[:, None].to(tl.int64) * ss_k + cols[None, :] * ss_v
    s = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    if G_PER_CHANNEL:  # one log decay per key channel: row i of S decays by exp(g_i)
        g = tl.load(g_ptr + b64 * sg_b + h * sg_h + rows * sg_k, mask=row_ok, other=0.0).to(tl.float32)
        s = s * tl.exp(g)[:, None]
    else:
        s = s * tl.exp(tl.load(g_ptr + b64 * sg_b + h * sg_h).to(tl.float32))
    u = beta * (v - tl.sum(s * k[:, None], axis=0))  # [BLOCK_V]
    s = s + k[:, None] * u[None, :]
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=mask)
    o = tl.sum(s * q[:, None], axis=0)  # from the float32 state, as the twin
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=col_ok)
# fmt: on


def _block_v(dv: int, block_v: int | None) -> tuple[int, int]:
    """(value columns per program, warps): the whole head in the interpreter, else 32 columns
    (a [128, 32] float32 tile is 16 KiB per program; not yet tuned on the H200)."""
    if block_v is None:
        block_v = triton.next_power_of_2(dv) if env.triton_interpret() else min(32, triton.next_power_of_2(dv))
    if block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    return block_v, 4 if block_v >= 32 else 2


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor, state_indices: torch.Tensor) -> None:
    b, hk, dk = q.shape
    _, hv, dv = v.shape
    if k.shape != q.shape or v.shape[0] != b or beta.shape != (b, hv):
        raise ValueError(f"want q, k [B, Hk, dk], v [B, Hv, dv], beta [B, Hv]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, beta {tuple(beta.shape)}")
    if hv % hk:
        raise ValueError(f"{hv} value heads cannot share {hk} key heads")
    if g.shape not in ((b, hv), (b, hv, 1), (b, hv, dk)):
        raise ValueError(f"g must be [B, Hv], [B, Hv, 1] or [B, Hv, dk]; got {tuple(g.shape)}")
    if state.dim() != 4 or state.shape[1:] != (hv, dk, dv):
        raise ValueError(f"state must be [pool, {hv}, {dk}, {dv}], got {tuple(state.shape)}")
    if state_indices.shape != (b,):
        raise ValueError(f"state_indices must be [{b}], got {tuple(state_indices.shape)}")
    if dk > MAX_HEAD_K:
        raise ValueError(f"head_k_dim {dk} > {MAX_HEAD_K}: the kernel keeps a whole key column in registers")


def fused_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    state_indices: torch.Tensor,
    use_qk_l2norm: bool = False,
    block_v: int | None = None,
) -> torch.Tensor:
    """One token per sequence of the gated delta rule, in one launch; ``delta_rule_decode``'s twin.

    Args:
        q, k: [B, Hk, dk]; v: [B, Hv, dv] (Hk divides Hv; fp32, fp16 or bf16, last dim
            contiguous or copied).
        g: [B, Hv] or [B, Hv, 1] log decay per head, or [B, Hv, dk] per key channel (<= 0).
        beta: [B, Hv] write strength.
        state: [pool, Hv, dk, dv] in any float dtype and strides; rows ``state_indices`` ([B],
            distinct; negative: skipped) are updated in place.
        use_qk_l2norm: l2-normalise q and k (eps 1e-6 inside the root) before use.
        block_v: value columns per program (a power of two); None: the pinned choice.

    Returns:
        [B, Hv, dv] in the dtype of ``v``; zeros for skipped sequences.
    """
    _check(q, k, v, g, beta, state, state_indices)
    b, hk, dk = q.shape
    _, hv, dv = v.shape
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    per_channel = g.dim() == 3 and g.shape[-1] == dk and dk > 1
    g3 = g if g.dim() == 3 else g[..., None]  # [B, Hv, 1 or dk]
    out = torch.empty(b, hv, dv, dtype=v.dtype, device=v.device)
    if b == 0:
        return out
    bv, warps = _block_v(dv, block_v)
    # fmt: off
    _delta_rule_decode_kernel[(b, hv, triton.cdiv(dv, bv))](
        q, k, v, g3, beta, state, state_indices, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g3.stride(0), g3.stride(1), g3.stride(2), beta.stride(0), beta.stride(1),
        state.stride(0), state.stride(1), state.stride(2), state.stride(3), hv // hk, dk, dv,
        dk ** -0.5, 1e-6, L2NORM=use_qk_l2norm, G_PER_CHANNEL=per_channel,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=bv, num_warps=warps)
    # fmt: on
    return out
