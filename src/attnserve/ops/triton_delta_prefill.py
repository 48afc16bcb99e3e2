"""The gated delta rule's chunked prefill (Gated DeltaNet, KDA) as one Triton kernel.

DRAFT
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve import env

__all__ = ["MAX_HEAD_K", "fused_delta_rule_prefill", "fused_gated_delta_prefill", "fused_kda_prefill"]

MAX_HEAD_K = 256  # a whole key column of the state tile lives in registers
MAX_CHUNK = 64  # tokens per chunk: up to four sub-blocks (the inverse's series stops at N^3)
SUB = 16  # tokens per sub-block of the triangular solve (the smallest tl.dot)


# Kernels keep dense argument lists, as in triton_paged_attention.py.
# fmt: off
@triton.jit
def _block_diag(x3, NB: tl.constexpr, BC: tl.constexpr):
    """[NB, BC, BC] blocks -> the block-diagonal [NB*BC, NB*BC] matrix."""
    nb = tl.arange(0, NB)
    same = nb[:, None, None, None] == nb[None, None, :, None]  # [NB, 1, NB, 1]
    return tl.reshape(tl.where(same, tl.expand_dims(x3, 2), 0.0), [NB * BC, NB * BC])


@triton.jit
def _diag_blocks(x, NB: tl.constexpr, BC: tl.constexpr):
    """The NB diagonal [BC, BC] blocks of x [NB*BC, NB*BC], as [NB, BC, BC]."""
    nb = tl.arange(0, NB)
    same = nb[:, None, None, None] == nb[None, None, :, None]
    return tl.sum(tl.where(same, tl.reshape(x, [NB, BC, NB, BC]), 0.0), axis=2)


@triton.jit
def _wy_inverse(a_d, low, NB: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr, SOLVE_PREC: tl.constexpr):
    """(I + A)^-1 for the strictly lower A = blockdiag(a_d) + low (a_d [NB, BC, BC]: the diagonal
    blocks; low [NB*BC, NB*BC]: the part below them).

    The diagonal blocks by doubling: with X_b the inverse of the b x b diagonal blocks (X_1 = I),
    X_2b = X_b - X_b L_b X_b, L_b the entries that pair the two b-halves of each 2b-block (the
    block formula [[X1, 0], [-X2 A21 X1, X2]]). Then, with D^-1 = X_BC and N = D^-1 low (N^NB = 0):
    (I + A)^-1 = (I - N + N^2 - N^3) D^-1. Every term is a product of bounded factors (block
    forward substitution, not a series in powers of A, whose entries can grow like binomials)."""
    ri = tl.arange(0, BC)[None, :, None]
    ci = tl.arange(0, BC)[None, None, :]
    x = tl.where(ri == ci, 1.0, 0.0) + tl.zeros([NB, BC, BC], dtype=tl.float32)
    for i in tl.static_range(4):
        H = 1 << i
        if H < BC:
            half = tl.where((ri // H == ci // H + 1) & ((ri // H) % 2 == 1), a_d, 0.0)
            x = x - tl.dot(tl.dot(x, half, input_precision=SOLVE_PREC), x, input_precision=SOLVE_PREC)
    dinv = _block_diag(x, NB, BC)
    if NB == 1:
        tinv = dinv
    elif NB == 2:
        tinv = dinv - tl.dot(tl.dot(dinv, low, input_precision=PREC), dinv, input_precision=PREC)
    else:
        n = tl.dot(dinv, low, input_precision=PREC)
        n2 = tl.dot(n, n, input_precision=PREC)
        tinv = dinv + tl.dot(n2 - n - tl.dot(n, n2, input_precision=PREC), dinv, input_precision=PREC)
    return tinv


@triton.jit
def _gdn_intra(q, k, cum, beta, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr, SOLVE_PREC: tl.constexpr):
    """One log decay per head: the chunk's (I + A)^-1 and P = lower_incl(q k^T exp(cum_t - cum_j))."""
    t = tl.arange(0, BT)
    dec = tl.exp(tl.where(t[:, None] >= t[None, :], cum[:, None] - cum[None, :], float("-inf")))
    kt = tl.trans(k)
    a = tl.where(t[:, None] > t[None, :], tl.dot(k, kt, input_precision=PREC) * dec, 0.0) * beta[:, None]
    p = tl.dot(q, kt, input_precision=PREC) * dec
    blk = t // BC
    low = tl.where(blk[:, None] > blk[None, :], a, 0.0)
    return _wy_inverse(_diag_blocks(a, BT // BC, BC), low, BT // BC, BC, PREC, SOLVE_PREC), p


@triton.jit
def _kda_level(q, k, g, low, p, a_d, p_d, BT: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
               PREC: tl.constexpr, H: tl.constexpr):
    """Adds the pairs of level H (t in the second H-block of a 2H-block, j in the first) to
    low, p (H >= BC: across sub-blocks) or a_d, p_d (H < BC: inside them), split at the last
    token before t's H-block: rowf = exp(cum_t - cum_{r-1}), colf = exp(cum_{r-1} - cum_j)."""
    if H < BT:
        if H == 1:
            rowf = tl.exp(g)
            kc = k
        else:
            g3 = tl.reshape(g, [BT // H, H, BK])
            inc = tl.cumsum(g3, axis=1)
            rowf = tl.reshape(tl.exp(inc), [BT, BK])
            kc = k * tl.reshape(tl.exp(tl.expand_dims(tl.sum(g3, axis=1), 1) - inc), [BT, BK])
        if H >= BC:
            tb = tl.arange(0, BT) // H
            m = (tb[:, None] == tb[None, :] + 1) & (tb[:, None] % 2 == 1)
            kct = tl.trans(kc)
            low += tl.where(m, tl.dot(k * rowf, kct, input_precision=PREC), 0.0)
            p += tl.where(m, tl.dot(q * rowf, kct, input_precision=PREC), 0.0)
        else:
            NB: tl.constexpr = BT // BC
            ri = tl.arange(0, BC)[None, :, None] // H
            ci = tl.arange(0, BC)[None, None, :] // H
            m3 = (ri == ci + 1) & (ri % 2 == 1)
            kct3 = tl.permute(tl.reshape(kc, [NB, BC, BK]), (0, 2, 1))
            a_d += tl.where(m3, tl.dot(tl.reshape(k * rowf, [NB, BC, BK]), kct3, input_precision=PREC), 0.0)
            p_d += tl.where(m3, tl.dot(tl.reshape(q * rowf, [NB, BC, BK]), kct3, input_precision=PREC), 0.0)
    return low, p, a_d, p_d


@triton.jit
def _kda_intra(q, k, g, beta, BT: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
               SOLVE_PREC: tl.constexpr):
    """One log decay per key channel: (I + A)^-1 and P as ``_gdn_intra``, every pair's decay exact.

    exp(cum_t - cum_j) per channel cannot be split as exp(cum_t) exp(-cum_j) (that overflows with
    strong decays), so each pair j < t is taken at the level H = the highest power of two at which
    t and j fall in neighbouring H-blocks of one 2H-block, and split at the token r - 1 between
    them (r: the first token of t's H-block): exp(cum_t - cum_{r-1}) exp(cum_{r-1} - cum_j), both
    factors <= 1. Levels H >= BC are [BT, BT] dots, the levels inside a sub-block batched
    [BC, BC] dots; the diagonal (decay 1) is q_t . k_t."""
    NB: tl.constexpr = BT // BC
    low = tl.zeros([BT, BT], dtype=tl.float32)
    p = tl.zeros([BT, BT], dtype=tl.float32)
    a_d = tl.zeros([NB, BC, BC], dtype=tl.float32)
    p_d = tl.zeros([NB, BC, BC], dtype=tl.float32)
    low, p, a_d, p_d = _kda_level(q, k, g, low, p, a_d, p_d, BT, BK, BC, PREC, 1)
    low, p, a_d, p_d = _kda_level(q, k, g, low, p, a_d, p_d, BT, BK, BC, PREC, 2)
    low, p, a_d, p_d = _kda_level(q, k, g, low, p, a_d, p_d, BT, BK, BC, PREC, 4)
    low, p, a_d, p_d = _kda_level(q, k, g, low, p, a_d, p_d, BT, BK, BC, PREC, 8)
    low, p, a_d, p_d = _kda_level(q, k, g, low, p, a_d, p_d, BT, BK, BC, PREC, 16)
    low, p, a_d, p_d = _kda_level(q, k, g, low, p, a_d, p_d, BT, BK, BC, PREC, 32)
    ri = tl.arange(0, BC)[None, :, None]
    ci = tl.arange(0, BC)[None, None, :]
    qk = tl.sum(tl.reshape(q * k, [NB, BC, BK]), axis=2)  # [NB, BC]: q_t . k_t
    p_d += tl.where(ri == ci, tl.expand_dims(qk, 2), 0.0)
    a_d = a_d * tl.expand_dims(tl.reshape(beta, [NB, BC]), 2)
    low = low * beta[:, None]
    return _wy_inverse(a_d, low, NB, BC, PREC, SOLVE_PREC), p + _block_diag(p_d, NB, BC)


@triton.jit
def _chunk_step(s, start, eos, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,
                sg_t, sg_h, sg_k, sbeta_t, sbeta_h, so_t, h, hk, keys, key_ok, cols, col_ok, scale, eps,
                L2NORM: tl.constexpr, G_PER_CHANNEL: tl.constexpr, PREC: tl.constexpr, SOLVE_PREC: tl.constexpr,
                BT: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    """One chunk of BT tokens from ``start``: writes its outputs, returns the state after it."""
    t = tl.arange(0, BT)
    rows = (start + t).to(tl.int64)
    row_ok = rows < eos
    kq_mask = row_ok[:, None] & key_ok[None, :]
    q = tl.load(q_ptr + rows[:, None] * sq_t + hk * sq_h + keys[None, :], mask=kq_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + rows[:, None] * sk_t + hk * sk_h + keys[None, :], mask=kq_mask, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, axis=1) + eps)[:, None]
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + eps)[:, None]
    q = q * scale
    beta = tl.load(beta_ptr + rows * sbeta_t + h * sbeta_h, mask=row_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + rows[:, None] * sv_t + h * sv_h + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                other=0.0).to(tl.float32)
    # rows past the end: k, q, beta, g zero, so they add nothing and decay nothing
    if G_PER_CHANNEL:
        g = tl.load(g_ptr + rows[:, None] * sg_t + h * sg_h + keys[None, :] * sg_k, mask=kq_mask,
                    other=0.0).to(tl.float32)
        tinv, p = _kda_intra(q, k, g, beta, BT, BK, BC, PREC, SOLVE_PREC)
        cum = tl.cumsum(g, axis=0)  # [BT, BK]
        last = tl.sum(tl.where(t[:, None] == BT - 1, cum, 0.0), axis=0)  # [BK]
        ec = tl.exp(cum)
        qe, ke = q * ec, k * ec
        kl = k * tl.exp(last[None, :] - cum)
        s_decay = tl.exp(last)[:, None]
    else:
        g = tl.load(g_ptr + rows * sg_t + h * sg_h, mask=row_ok, other=0.0).to(tl.float32)
        cum = tl.cumsum(g, axis=0)  # [BT]
        tinv, p = _gdn_intra(q, k, cum, beta, BT, BC, PREC, SOLVE_PREC)
        last = tl.sum(tl.where(t == BT - 1, cum, 0.0), axis=0)
        ec = tl.exp(cum)[:, None]
        qe, ke = q * ec, k * ec
        kl = k * tl.exp(last - cum)[:, None]
        s_decay = tl.exp(last)
    # the chunk's corrected values: (I + A) y = beta (v - exp(cum) k S)
    y = tl.dot(tinv, beta[:, None] * (v - tl.dot(ke, s, input_precision=PREC)), input_precision=PREC)  # [BT, BV]
    o = tl.dot(qe, s, input_precision=PREC) + tl.dot(p, y, input_precision=PREC)
    tl.store(out + rows[:, None] * so_t, o.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    s = s * s_decay + tl.dot(tl.trans(kl), y, input_precision=PREC)
    return s


@triton.jit
def _delta_rule_prefill_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr,
                               out_ptr, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sg_k, sbeta_t, sbeta_h,
                               ss_n, ss_h, ss_k, ss_v, so_t, so_h, group, dk, dv, scale, eps,
                               L2NORM: tl.constexpr, G_PER_CHANNEL: tl.constexpr, PREC: tl.constexpr,
                               SOLVE_PREC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                               BC: tl.constexpr, INTERPRET: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    col_ok = cols < dv
    bos = tl.load(qsl_ptr + b).to(tl.int64)
    eos = tl.load(qsl_ptr + b + 1).to(tl.int64)
    slot = tl.load(idx_ptr + b).to(tl.int64)
    t = tl.arange(0, BT)
    out = out_ptr + h * so_h + cols[None, :]
    if slot < 0:  # a padded sequence: no state; its outputs are zeros
        zeros = tl.zeros([BT, BV], dtype=out_ptr.dtype.element_ty)
        start = bos
        while start < eos:
            rows = (start + t).to(tl.int64)
            tl.store(out + rows[:, None] * so_t, zeros, mask=(rows < eos)[:, None] & col_ok[None, :])
            start += BT
        return
    keys = tl.arange(0, BK)
    key_ok = keys < dk
    hk = h // group  # the key head this value head reads
    s_mask = key_ok[:, None] & col_ok[None, :]
    s_ptrs = state_ptr + slot * ss_n + h * ss_h + keys[:, None].to(tl.int64) * ss_k + cols[None, :] * ss_v
    init = tl.load(init_ptr + b).to(tl.int32) != 0
    s = tl.load(s_ptrs, mask=s_mask & init, other=0.0).to(tl.float32)  # [BK, BV]
    if INTERPRET:  # the interpreter's range() cannot take a loaded bound
        start = bos
        while start < eos:
            s = _chunk_step(s, start, eos, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out, sq_t, sq_h, sk_t, sk_h, sv_t,
                            sv_h, sg_t, sg_h, sg_k, sbeta_t, sbeta_h, so_t, h, hk, keys, key_ok, cols, col_ok, scale,
                            eps, L2NORM, G_PER_CHANNEL, PREC, SOLVE_PREC, BT, BK, BC)
            start += BT
    else:
        for start in range(bos, eos, BT):
            s = _chunk_step(s, start, eos, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out, sq_t, sq_h, sk_t, sk_h, sv_t,
                            sv_h, sg_t, sg_h, sg_k, sbeta_t, sbeta_h, so_t, h, hk, keys, key_ok, cols, col_ok, scale,
                            eps, L2NORM, G_PER_CHANNEL, PREC, SOLVE_PREC, BT, BK, BC)
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=s_mask)
# fmt: on


def _chunk(chunk_size: int) -> int:
    """Tokens per kernel chunk: the power of two in [16, 64] covering ``chunk_size``."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return min(MAX_CHUNK, max(SUB, triton.next_power_of_2(chunk_size)))


def _config(dv: int, block_v: int | None, num_warps: int | None) -> tuple[int, int]:
    """(value columns per program, warps): the whole head in the interpreter, else pinned."""
    if block_v is None:
        block_v = triton.next_power_of_2(dv) if env.triton_interpret() else min(64, triton.next_power_of_2(dv))
    if block_v & (block_v - 1) or block_v < 16:
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    return block_v, num_warps or 8


def _check(q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"want q, k [T, Hk, dk] and v [T, Hv, dv]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    t, hk, dk = q.shape
    _, hv, dv = v.shape
    if hv % hk:
        raise ValueError(f"{hv} value heads cannot share {hk} key heads")
    if g.shape not in ((t, hv), (t, hv, 1), (t, hv, dk)):
        raise ValueError(f"g must be [T, Hv], [T, Hv, 1] or [T, Hv, dk] = [{t}, {hv}, {dk}]; got {tuple(g.shape)}")
    if beta.shape != (t, hv):
        raise ValueError(f"beta must be [T, Hv] = [{t}, {hv}], got {tuple(beta.shape)}")
    if state.dim() != 4 or state.shape[1:] != (hv, dk, dv):
        raise ValueError(f"state must be [pool, {hv}, {dk}, {dv}], got {tuple(state.shape)}")
    if dk > MAX_HEAD_K:
        raise ValueError(f"head_k_dim {dk} > {MAX_HEAD_K}: the kernel keeps a whole key column in registers")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    n = query_start_loc.shape[0] - 1 if query_start_loc.dim() == 1 else -1
    if n < 0 or query_start_loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"query_start_loc must be [B+1] int32, got {tuple(query_start_loc.shape)} "
                         f"{query_start_loc.dtype}")
    if state_indices.shape != (n,) or has_initial_state.shape != (n,):
        raise ValueError(f"state_indices and has_initial_state must be [B] = [{n}]; got "
                         f"{tuple(state_indices.shape)} and {tuple(has_initial_state.shape)}")
    devices = {x.device for x in (q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state)}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def fused_delta_rule_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Chunked gated delta rule over several sequences in one launch; ``delta_rule_prefill``'s twin.

    Args:
        q, k: [T, Hk, dk] (dk <= 256); v: [T, Hv, dv], Hk divides Hv and value head j reads key
            head ``j // (Hv // Hk)``; float32, float16 or bfloat16.
        g: [T, Hv] or [T, Hv, 1] log decay per head, or [T, Hv, dk] per key channel (<= 0).
        beta: [T, Hv] write strength.
        state: [pool, Hv, dk, dv], any float dtype and strides; rows ``state_indices`` are read
            (zeros where ``has_initial_state`` is False) and overwritten with the final state.
        query_start_loc: [B+1] int32 cumulative token counts, on the device (read there).
        state_indices: [B] int64, distinct; a negative row skips its sequence (state untouched,
            outputs zero). has_initial_state: [B] bool.
        use_qk_l2norm: l2-normalise q and k (eps 1e-6 inside the root) before use.
        chunk_size: tokens per chunk, rounded to a power of two in [16, 64]; it changes the
            rounding only, never the result.
        block_v: value columns per program (a power of two >= 16); None: the pinned choice.
        num_warps: warps per program; None: the pinned choice (block_v and num_warps are for
            tuning; the result does not depend on them).

    Returns:
        [T, Hv, dv] in the dtype of ``v``.
    """
    _check(q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state)
    t, hk, dk = q.shape
    _, hv, dv = v.shape
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    per_channel = g.dim() == 3 and g.shape[-1] == dk and dk > 1
    g3 = g if g.dim() == 3 else g[..., None]  # [T, Hv, 1 or dk]
    out = torch.empty(t, hv, dv, dtype=v.dtype, device=v.device)
    n = state_indices.shape[0]
    if t == 0 or n == 0:
        return out
    bv, warps = _config(dv, block_v, num_warps)
    exact = all(x.dtype == torch.float32 for x in (q, k, v))
    # fmt: off
    _delta_rule_prefill_kernel[(n, hv, triton.cdiv(dv, bv))](
        q, k, v, g3, beta, state, query_start_loc, state_indices, has_initial_state, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g3.stride(0), g3.stride(1), g3.stride(2), beta.stride(0), beta.stride(1),
        state.stride(0), state.stride(1), state.stride(2), state.stride(3), out.stride(0), out.stride(1),
        hv // hk, dk, dv, dk ** -0.5, 1e-6, L2NORM=use_qk_l2norm, G_PER_CHANNEL=per_channel,
        PREC="ieee" if exact else "tf32", SOLVE_PREC="ieee" if exact else "tf32x3", BT=_chunk(chunk_size),
        BK=max(16, triton.next_power_of_2(dk)), BV=bv, BC=SUB, INTERPRET=env.triton_interpret(), num_warps=warps)
    # fmt: on
    return out


def fused_gated_delta_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Gated DeltaNet prefill (one log decay per head); ``gated_delta_prefill``'s twin.

    Args:
        q, k: [T, Hk, dk]; v: [T, Hv, dv]; g: [T, Hv] log decay; beta: [T, Hv]. The rest as in
            ``fused_delta_rule_prefill``.

    Returns:
        [T, Hv, dv] in the dtype of ``v``.
    """
    if v.dim() != 3 or g.shape != v.shape[:2]:
        raise ValueError(f"Gated DeltaNet wants g [T, Hv]; got g {tuple(g.shape)}, v {tuple(v.shape)}")
    return fused_delta_rule_prefill(q, k, v, g, beta, state, query_start_loc=query_start_loc,
                                    state_indices=state_indices, has_initial_state=has_initial_state,
                                    use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)


def fused_kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> torch.Tensor:
    """KDA prefill (one log decay per key channel); ``kda_prefill``'s twin.

    Args:
        q, k: [T, H, dk]; v: [T, H, dv]; g: [T, H, dk] per-channel log decay (<= 0);
            beta: [T, H]. The rest as in ``fused_delta_rule_prefill``.

    Returns:
        [T, H, dv] in the dtype of ``v``.
    """
    if q.dim() != 3 or v.dim() != 3 or q.shape[-2] != v.shape[-2] or g.shape != q.shape:
        raise ValueError(f"KDA wants q, k, g [T, H, dk] and v [T, H, dv]; got q {tuple(q.shape)}, "
                         f"v {tuple(v.shape)}, g {tuple(g.shape)}")
    return fused_delta_rule_prefill(q, k, v, g, beta, state, query_start_loc=query_start_loc,
                                    state_indices=state_indices, has_initial_state=has_initial_state,
                                    use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
