"""The decode steps of Mamba-1 (Jamba) and lightning attention (MiniMax) as one Triton kernel each.

Mamba: one program per (sequence, tile of ``block_d`` channels) reads its state tile ``h``
[block_d, N] once, does the step in registers and writes it back once::

    h <- exp(dt A) h + (dt x) B;  y = h . C + D x;  y <- y * SiLU(z)

Lightning: one program per (sequence, head, tile of ``block_v`` value columns) reads its state
tile ``S`` [dk, block_v] once and writes it back once::

    S <- exp(-s_h) S + k v^T;  o = S^T q

The PyTorch twins (``selective_scan_decode``, ``lightning_attention_decode`` in
``attention/state``) gather the rows, decay, add, scatter and contract: several passes over the
state and several launches, where these are one read and one write.

Arithmetic is float32 whatever the input dtypes; the state is stored back in its own dtype and
the output in x's (Mamba) or v's (lightning). A sequence whose state row is negative (padding)
is skipped: its state is not touched and its output is zeros. Two sequences must not share a
state row (as in the twins, the result would be undefined), except a CUDA graph's padded rows,
which all run on the null slot 0, whose content and their outputs nobody reads. Not here: the
prefill forms, the short conv, the projections and gates around the step. Configs are pinned (no
autotune); under ``TRITON_INTERPRET=1`` a tile covers the whole channel dim or head, since the
interpreter pays per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve import env

__all__ = ["MAX_D_STATE", "MAX_HEAD_K", "fused_lightning_decode", "fused_selective_scan_decode"]

MAX_D_STATE = 256  # a whole state row of a channel lives in registers
MAX_HEAD_K = 256  # the whole key dim of a lightning tile lives in registers


# Kernels keep dense argument lists, as in ops/attention/paged_triton.py.
# fmt: off
@triton.jit
def _selective_scan_decode_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, state_ptr, idx_ptr, out_ptr,
                                  sx_b, sdt_b, sa_d, sa_n, sb_b, sc_b, sz_b, ss_p, ss_d, ss_n, dim, n,
                                  HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    chan_ok = chans < dim
    out = out_ptr + b.to(tl.int64) * dim + chans  # out is [B, D]
    slot = tl.load(idx_ptr + b).to(tl.int64)
    if slot < 0:  # a padded sequence: no state to advance
        tl.store(out, tl.zeros([BLOCK_D], dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=chan_ok)
        return
    b64 = b.to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n
    mask = chan_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + b64 * sx_b + chans, mask=chan_ok, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + b64 * sdt_b + chans, mask=chan_ok, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + chans[:, None] * sa_d + cols[None, :] * sa_n, mask=mask, other=0.0).to(tl.float32)
    bb = tl.load(b_ptr + b64 * sb_b + cols, mask=col_ok, other=0.0).to(tl.float32)
    cc = tl.load(c_ptr + b64 * sc_b + cols, mask=col_ok, other=0.0).to(tl.float32)
    h_ptrs = state_ptr + slot * ss_p + chans[:, None].to(tl.int64) * ss_d + cols[None, :] * ss_n
    h = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_D, BLOCK_N]
    h = h * tl.exp(dt[:, None] * a) + (dt * x)[:, None] * bb[None, :]
    tl.store(h_ptrs, h.to(state_ptr.dtype.element_ty), mask=mask)
    y = tl.sum(h * cc[None, :], axis=1)  # from the float32 state, as the twin
    if HAS_D:
        y = y + x * tl.load(d_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + b64 * sz_b + chans, mask=chan_ok, other=0.0).to(tl.float32)
        y = y * (z * tl.sigmoid(z))
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=chan_ok)


@triton.jit
def _lightning_decode_kernel(q_ptr, k_ptr, v_ptr, rate_ptr, state_ptr, idx_ptr, out_ptr,
                             sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, ss_p, ss_h, ss_k, ss_v, dk, dv,
                             BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < dv
    out = out_ptr + (b * tl.num_programs(1) + h).to(tl.int64) * dv + cols  # out is [B, H, dv]
    slot = tl.load(idx_ptr + b).to(tl.int64)
    if slot < 0:  # a padded sequence: no state to advance
        tl.store(out, tl.zeros([BLOCK_V], dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=col_ok)
        return
    rows = tl.arange(0, BLOCK_K)
    row_ok = rows < dk
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * sq_b + h * sq_h + rows, mask=row_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b64 * sk_b + h * sk_h + rows, mask=row_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b64 * sv_b + h * sv_h + cols, mask=col_ok, other=0.0).to(tl.float32)
    decay = tl.exp(-tl.load(rate_ptr + h).to(tl.float32))
    mask = row_ok[:, None] & col_ok[None, :]
    s_ptrs = state_ptr + slot * ss_p + h * ss_h + rows[:, None].to(tl.int64) * ss_k + cols[None, :] * ss_v
    s = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    s = s * decay + k[:, None] * v[None, :]
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=mask)
    o = tl.sum(s * q[:, None], axis=0)  # from the float32 state, as the twin
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=col_ok)
# fmt: on


def _tile(size: int, tile: int | None, gpu_default: int, name: str) -> tuple[int, int]:
    """(rows or columns per program, warps): the whole extent in the interpreter, else
    ``gpu_default`` (not yet tuned on the H200)."""
    if tile is None:
        whole = triton.next_power_of_2(size)
        tile = whole if env.triton_interpret() else min(gpu_default, whole)
    if tile & (tile - 1):
        raise ValueError(f"{name} must be a power of two, got {tile}")
    return tile, 4 if tile >= 32 else 2


def _rows_check(state_indices: torch.Tensor, b: int) -> None:
    if state_indices.shape != (b,):
        raise ValueError(f"state_indices must be [{b}], got {tuple(state_indices.shape)}")


def fused_selective_scan_decode(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    ssm_state: torch.Tensor,
    *,
    state_indices: torch.Tensor,
    block_d: int | None = None,
) -> torch.Tensor:
    """One token per sequence of the Mamba-1 scan, in one launch; ``selective_scan_decode``'s twin.

    Args:
        x: [B, D] conv output; dt: [B, D] step sizes after softplus; z: [B, D] gate or None.
        A: [D, N] (negative); B, C: [B, N]; D: [D] skip or None (any float dtypes).
        ssm_state: [pool, D, N] in any float dtype and strides; rows ``state_indices`` ([B],
            distinct; negative: skipped) are updated in place.
        block_d: channels per program (a power of two); None: the pinned choice.

    Returns:
        [B, D] in the dtype of ``x``; zeros for skipped sequences.
    """
    b, dim = x.shape
    n = A.shape[-1]
    if dt.shape != x.shape or (z is not None and z.shape != x.shape) or A.shape != (dim, n):
        raise ValueError(f"want x, dt, z [B, D], A [D, N]; got x {tuple(x.shape)}, dt {tuple(dt.shape)}, "
                         f"z {None if z is None else tuple(z.shape)}, A {tuple(A.shape)}")
    if B.shape != (b, n) or C.shape != (b, n) or (D is not None and D.shape != (dim,)):
        raise ValueError(f"want B, C [{b}, {n}], D [{dim}]; got B {tuple(B.shape)}, C {tuple(C.shape)}, "
                         f"D {None if D is None else tuple(D.shape)}")
    if ssm_state.dim() != 3 or ssm_state.shape[1:] != (dim, n):
        raise ValueError(f"ssm_state must be [pool, {dim}, {n}], got {tuple(ssm_state.shape)}")
    _rows_check(state_indices, b)
    if n > MAX_D_STATE:
        raise ValueError(f"d_state {n} > {MAX_D_STATE}: the kernel keeps a whole state row in registers")
    has_d, has_z = D is not None, z is not None
    x, dt, B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, dt, B, C))
    z = x if z is None else (z if z.stride(-1) == 1 else z.contiguous())  # x: a placeholder when HAS_Z is off
    skip = A if D is None else D.contiguous()  # A: a placeholder when HAS_D is off
    out = torch.empty(b, dim, dtype=x.dtype, device=x.device)
    if b == 0:
        return out
    bd, warps = _tile(dim, block_d, 64, "block_d")
    # fmt: off
    _selective_scan_decode_kernel[(b, triton.cdiv(dim, bd))](
        x, dt, A, B, C, skip, z, ssm_state, state_indices, out,
        x.stride(0), dt.stride(0), A.stride(0), A.stride(1), B.stride(0), C.stride(0), z.stride(0),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), dim, n,
        HAS_D=has_d, HAS_Z=has_z, BLOCK_D=bd, BLOCK_N=triton.next_power_of_2(n), num_warps=warps)
    # fmt: on
    return out


def fused_lightning_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay_rates: torch.Tensor,
    state: torch.Tensor,
    *,
    state_indices: torch.Tensor,
    block_v: int | None = None,
) -> torch.Tensor:
    """One token per sequence of lightning attention, in one launch; ``lightning_attention_decode``'s twin.

    Args:
        q, k: [B, H, dk]; v: [B, H, dv] (any float dtypes).
        decay_rates: [H] the per-head ``s_h`` (the decay is ``exp(-s_h)``).
        state: [pool, H, dk, dv] in any float dtype and strides; rows ``state_indices`` ([B],
            distinct; negative: skipped) are updated in place.
        block_v: value columns per program (a power of two); None: the pinned choice.

    Returns:
        [B, H, dv] in the dtype of ``v``; zeros for skipped sequences.
    """
    b, h, dk = q.shape
    dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:2] != (b, h) or decay_rates.shape != (h,):
        raise ValueError(f"want q, k [B, H, dk], v [B, H, dv], decay_rates [H]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, decay_rates {tuple(decay_rates.shape)}")
    if state.dim() != 4 or state.shape[1:] != (h, dk, dv):
        raise ValueError(f"state must be [pool, {h}, {dk}, {dv}], got {tuple(state.shape)}")
    _rows_check(state_indices, b)
    if dk > MAX_HEAD_K:
        raise ValueError(f"head dim {dk} > {MAX_HEAD_K}: the kernel keeps a whole key column in registers")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    rates = decay_rates.to(q.device).contiguous()
    out = torch.empty(b, h, dv, dtype=v.dtype, device=v.device)
    if b == 0:
        return out
    bv, warps = _tile(dv, block_v, 32, "block_v")
    # fmt: off
    _lightning_decode_kernel[(b, h, triton.cdiv(dv, bv))](
        q, k, v, rates, state, state_indices, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        state.stride(0), state.stride(1), state.stride(2), state.stride(3), dk, dv,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=bv, num_warps=warps)
    # fmt: on
    return out
