"""The gated delta rule's chunked prefill (Gated DeltaNet, KDA) in two Triton launches.

Per value head, state S [dk, dv], log decay g_t <= 0 per head (Gated DeltaNet) or per key
channel (KDA), the twins ``gated_delta_prefill`` / ``kda_prefill`` (``attention/state``)::

    S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t

with q and k those of the head's key head (value head h reads key head ``h // (Hv // Hk)``),
l2-normalised (eps inside the root) if asked, and q scaled by ``dk^-0.5``. Varlen: the sequences
are packed ([T, H, d]) and delimited by ``query_start_loc``, read on the device: no padding and
no host synchronisation (the launch sizes come from T and B alone). Chunks of BT tokens (64 for
GDN, 32 for KDA, or the power of two >= 16 covering a smaller ``chunk_size``), with cum = the
cumulative log decay inside the chunk, A = strictly_lower(beta_t <k_t, k_j> exp(cum_t - cum_j)) and
P = lower_inclusive(<q_t, k_j> exp(cum_t - cum_j)) (decays per channel inside the products for
KDA):

1. ``_intra_kernel``, one program per (chunk, value head), all chunks of all sequences at once
   (the grid is ceil(T / BT) + B, an upper bound; chunk -> sequence is a ``searchsorted`` over
   the cumulative chunk counts, on the device): A, (I + A)^-1 and P, each row stored at its
   token ([T, Hv, BT]; float32 for float32 inputs, else the inputs' half dtype).
   The inverse: the 16 x 16 diagonal blocks by doubling (X_2b = X_b - X_b L_b X_b, the block
   formula for the two halves of each 2b-block), then (I + A)^-1 = (I - N + N^2 - N^3) D^-1
   with D^-1 those blocks and N = D^-1 (A below them), nilpotent. Every term is a product of
   bounded factors, as in block forward substitution; the product form prod (I + (-A)^(2^j))
   is not used, since powers of A can grow like binomials before cancelling.
   KDA: exp(cum_t - cum_j) per channel cannot be split as exp(cum_t) exp(-cum_j) (decays of
   tens of nats per chunk overflow that), so each pair is taken at the level H (a power of two)
   where t and j fall in neighbouring H-blocks of one 2H-block and split at the last token
   before t's block: both factors are <= 1 and the product exact, whatever the decay. Levels
   H >= 16 are [BT, BT] dots, those inside a 16-block batched [16, 16] dots; 2 log2(BT)
   exponentials of [BT, dk] per chunk.
2. ``_state_kernel``, one program per (sequence, value head, tile of BV value columns), S
   [dk, BV] float32 in registers through the sequence's chunks: the corrected values
   y = (I + A)^-1 beta (v - exp(cum) k S); o = exp(cum) q S + P y;
   S <- exp(cum_last) S + (exp(cum_last - cum) k)^T y. Per-head decays and l2 norms scale rows,
   so they are applied to the dots' results and q, k enter the dots as loaded.

Why two launches: a first version ran both in one program per (sequence, head, tile) and, on
the H200, used 255 registers and 500+ spills per thread (Qwen3-Next GDN, bf16: 12.4 ms for
64 x 1024 tokens, 4.8 times the PyTorch twin; KDA 51 ms at chunk 32), and float32 and KDA
variants did not fit in shared memory. The intra-chunk part is the register-heavy, fully
parallel one and is now computed once per chunk and head (not once per value tile, and not on
the sequential path); the state kernel carries only S. The split costs a write and reads of
2 BT values per token and head. Not yet timed on the GPU: ``benchmarks/gpu_delta_prefill.py``.

Precision: float32 inputs run every dot as three-pass tf32 ("tf32x3": float32's accuracy on the
tensor cores; "ieee" dots lower to scalar FMAs that spill kilobytes per thread on sm_90). Half
inputs: tf32 dots in the intra kernel (tf32x3 for the 16 x 16 inverses), the inputs' dtype
(bf16/fp16) as the state kernel's dot operands with float32 sums, and (I + A)^-1 and P stored in
it, as fla does. States are float32 in registers and stored in their own dtype; the output in
v's. FLOPs per token and head (chunk C): 4 C dk + 4 C dv + 6 dk dv for the products of the
algorithm (k k^T, q k^T, the solve's and P's products, k S, q S, the state update), plus the
inverse (~C^2 per token) and, for KDA, the levels' extra 2 C dk per level.

Configs are pinned (no autotune), chosen from sm_90 compiles (registers, spills, shared memory)
and the one-kernel version's timings, not yet from timings of these kernels: the intra kernel 4
warps (8 with a per-channel decay); the state kernel 64 value columns and 8 warps for half
inputs, 32 and 4 for float32; under ``TRITON_INTERPRET=1`` the value tile covers the whole head,
since the interpreter pays per program. A sequence whose state row is negative is skipped (state
untouched, outputs zero); two sequences must not share a row. Not here: the short convs, the
gates that make g and beta, the decode step (``delta_decode_triton.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve import env

__all__ = ["MAX_HEAD_K", "fused_delta_rule_prefill", "fused_gated_delta_prefill", "fused_kda_prefill"]

MAX_HEAD_K = 256  # a whole key column of the state tile lives in registers
MAX_CHUNK = 64  # tokens per chunk: up to four sub-blocks (the inverse's series stops at N^3)
# KDA's chunk: its per-channel [BT, dk] factors at 64 spill in the intra kernel and overflow shared
# memory in the float32 state kernel (sm_90 compile); the one-kernel version took a third of the
# time at chunk 32 (value tile 64) than at 64 (value tile 32) on the H200
MAX_CHUNK_PER_CHANNEL = 32
SUB = 16  # tokens per sub-block of the triangular solve (the smallest tl.dot)


# Kernels keep dense argument lists, as in ops/attention/paged_triton.py.
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
def _load_qk(q_ptr, k_ptr, rows, row_ok, hk, keys, key_ok, sq_t, sq_h, sk_t, sk_h, scale, eps, L2NORM: tl.constexpr):
    """q (l2-normalised if asked, times scale) and k of one chunk, float32 [BT, BK]; zero past the end."""
    mask = row_ok[:, None] & key_ok[None, :]
    q = tl.load(q_ptr + rows[:, None] * sq_t + hk * sq_h + keys[None, :], mask=mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + rows[:, None] * sk_t + hk * sk_h + keys[None, :], mask=mask, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, axis=1) + eps)[:, None]
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + eps)[:, None]
    return q * scale, k


@triton.jit(do_not_specialize=("num_seqs",),  # per step: no variant per size class or alignment
            do_not_specialize_on_alignment=("qsl_ptr", "seq_ptr", "first_ptr"))
def _intra_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, qsl_ptr, seq_ptr, first_ptr, tinv_ptr, p_ptr, sq_t, sq_h, sk_t, sk_h,
                  sg_t, sg_h, sg_k, sbeta_t, sbeta_h, group, dk, num_seqs, scale, eps, L2NORM: tl.constexpr,
                  G_PER_CHANNEL: tl.constexpr, PREC: tl.constexpr, SOLVE_PREC: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, BC: tl.constexpr):
    """One program per (chunk, value head): the chunk's (I + A)^-1 and P, row t stored at token t."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(seq_ptr + c)
    if seq >= num_seqs:  # past the last chunk (the grid is an upper bound)
        return
    start = tl.load(qsl_ptr + seq).to(tl.int64) + (c - tl.load(first_ptr + seq)).to(tl.int64) * BT
    t = tl.arange(0, BT)
    rows = start + t
    row_ok = rows < tl.load(qsl_ptr + seq + 1)
    keys = tl.arange(0, BK)
    key_ok = keys < dk
    q, k = _load_qk(q_ptr, k_ptr, rows, row_ok, h // group, keys, key_ok, sq_t, sq_h, sk_t, sk_h, scale, eps, L2NORM)
    beta = tl.load(beta_ptr + rows * sbeta_t + h * sbeta_h, mask=row_ok, other=0.0).to(tl.float32)
    # rows past the end: k, q, beta, g zero, so they add nothing and decay nothing
    if G_PER_CHANNEL:
        g = tl.load(g_ptr + rows[:, None] * sg_t + h * sg_h + keys[None, :] * sg_k,
                    mask=row_ok[:, None] & key_ok[None, :], other=0.0).to(tl.float32)
        tinv, p = _kda_intra(q, k, g, beta, BT, BK, BC, PREC, SOLVE_PREC)
    else:
        g = tl.load(g_ptr + rows * sg_t + h * sg_h, mask=row_ok, other=0.0).to(tl.float32)
        tinv, p = _gdn_intra(q, k, tl.cumsum(g, axis=0), beta, BT, BC, PREC, SOLVE_PREC)
    offs = rows[:, None] * (tl.num_programs(1) * BT) + h * BT + t[None, :]
    tl.store(tinv_ptr + offs, tinv.to(tinv_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _chunk_step(s, start, eos, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tinv_ptr, p_ptr, out_ptr, sq_t, sq_h, sk_t, sk_h,
                sv_t, sv_h, sg_t, sg_h, sg_k, sbeta_t, sbeta_h, so_t, so_h, h, hk, dk, dv, col0, scale, eps,
                L2NORM: tl.constexpr, G_PER_CHANNEL: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
                BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """One chunk of BT tokens from ``start``: writes its outputs, returns the state after it.

    With the chunk's y = (I + A)^-1 beta (v - exp(cum) k S) (the corrected values):
    o = exp(cum) q S + P y and S <- exp(cum_last) S + (exp(cum_last - cum) k)^T y. Dot operands
    are DT (float32 for float32 inputs, else the inputs' half dtype), sums float32. Per-head
    decays and the l2 norms scale rows, so they are applied to the dots' results, and q and k
    enter the dots as loaded."""
    # block pointers whose row bound is the sequence's end: rows past it load as zeros (a
    # tensor of per-element offsets instead would be loop-invariant, hoisted, and spill)
    q = tl.load(tl.make_block_ptr(q_ptr + hk * sq_h, (eos, dk), (sq_t, 1), (start, 0), (BT, BK), (1, 0)),
                boundary_check=(0, 1), padding_option="zero")
    k = tl.load(tl.make_block_ptr(k_ptr + hk * sk_h, (eos, dk), (sk_t, 1), (start, 0), (BT, BK), (1, 0)),
                boundary_check=(0, 1), padding_option="zero")
    rq = tl.full([BT], 1.0, dtype=tl.float32) * scale
    rk = tl.full([BT], 1.0, dtype=tl.float32)
    if L2NORM:
        rq = rq * tl.rsqrt(tl.sum(q.to(tl.float32) * q.to(tl.float32), axis=1) + eps)
        rk = tl.rsqrt(tl.sum(k.to(tl.float32) * k.to(tl.float32), axis=1) + eps)
    beta = tl.load(tl.make_block_ptr(beta_ptr + h * sbeta_h, (eos,), (sbeta_t,), (start,), (BT,), (0,)),
                   boundary_check=(0,), padding_option="zero").to(tl.float32)
    v = tl.load(tl.make_block_ptr(v_ptr + h * sv_h, (eos, dv), (sv_t, 1), (start, col0), (BT, BV), (1, 0)),
                boundary_check=(0, 1), padding_option="zero").to(tl.float32)
    hv = tl.num_programs(1)
    tinv_blk = tl.make_block_ptr(tinv_ptr + h * BT, (eos, BT), (hv * BT, 1), (start, 0), (BT, BT), (1, 0))
    p_blk = tl.make_block_ptr(p_ptr + h * BT, (eos, BT), (hv * BT, 1), (start, 0), (BT, BT), (1, 0))
    sd = s.to(DT)
    # rows past the end: k, q, beta, g zero, so they add nothing and decay nothing
    if G_PER_CHANNEL:
        g = tl.load(tl.make_block_ptr(g_ptr + h * sg_h, (eos, dk), (sg_t, sg_k), (start, 0), (BT, BK), (1, 0)),
                    boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        cum = tl.cumsum(g, axis=0)  # [BT, BK]
        last = tl.sum(g, axis=0)  # [BK]: cum at the chunk's last row
        ec = tl.exp(cum)
        kn = k.to(tl.float32) * rk[:, None]
        ks = tl.dot((kn * ec).to(DT), sd, input_precision=PREC)
        qs = tl.dot((q.to(tl.float32) * rq[:, None] * ec).to(DT), sd, input_precision=PREC)
        kl = (kn * tl.exp(last[None, :] - cum)).to(DT)
        s = s * tl.exp(last)[:, None]
        y = tl.dot(tl.load(tinv_blk, boundary_check=(0,), padding_option="zero").to(DT),
                   (beta[:, None] * (v - ks)).to(DT), input_precision=PREC).to(DT)  # [BT, BV]
        s = tl.dot(tl.trans(kl), y, acc=s, input_precision=PREC)
    else:
        g = tl.load(tl.make_block_ptr(g_ptr + h * sg_h, (eos,), (sg_t,), (start,), (BT,), (0,)),
                    boundary_check=(0,), padding_option="zero").to(tl.float32)
        cum = tl.cumsum(g, axis=0)  # [BT]
        last = tl.sum(g, axis=0)
        ec = tl.exp(cum)
        kd = k.to(DT)
        ks = tl.dot(kd, sd, input_precision=PREC) * (rk * ec)[:, None]
        qs = tl.dot(q.to(DT), sd, input_precision=PREC) * (rq * ec)[:, None]
        yf = tl.dot(tl.load(tinv_blk, boundary_check=(0,), padding_option="zero").to(DT),
                    (beta[:, None] * (v - ks)).to(DT), input_precision=PREC)
        y = yf.to(DT)
        s = tl.dot(tl.trans(kd), (yf * (rk * tl.exp(last - cum))[:, None]).to(DT), acc=s * tl.exp(last),
                   input_precision=PREC)
    o = tl.dot(tl.load(p_blk, boundary_check=(0,), padding_option="zero").to(DT), y, acc=qs, input_precision=PREC)
    tl.store(tl.make_block_ptr(out_ptr + h * so_h, (eos, dv), (so_t, 1), (start, col0), (BT, BV), (1, 0)),
             o.to(out_ptr.dtype.element_ty), boundary_check=(0, 1))
    return s


@triton.jit(do_not_specialize_on_alignment=("qsl_ptr", "idx_ptr", "init_ptr"))
def _state_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tinv_ptr, p_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr, out_ptr,
                  sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sg_k, sbeta_t, sbeta_h, ss_n, ss_h, ss_k, ss_v,
                  so_t, so_h, group, dk, dv, scale, eps, L2NORM: tl.constexpr, G_PER_CHANNEL: tl.constexpr,
                  PREC: tl.constexpr, DT: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """One program per (sequence, value head, value tile): the state tile through the sequence's chunks."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    col0 = tl.program_id(2) * BV
    cols = col0 + tl.arange(0, BV)
    col_ok = cols < dv
    bos = tl.load(qsl_ptr + b).to(tl.int32)  # token indices fit 32 bits (block pointer offsets must)
    eos = tl.load(qsl_ptr + b + 1).to(tl.int32)
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
            s = _chunk_step(s, start, eos, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tinv_ptr, p_ptr, out_ptr, sq_t, sq_h,
                            sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sg_k, sbeta_t, sbeta_h, so_t, so_h, h, hk, dk, dv,
                            col0, scale, eps, L2NORM, G_PER_CHANNEL, PREC, DT, BT, BK, BV)
            start += BT
    else:
        for start in range(bos, eos, BT):
            s = _chunk_step(s, start, eos, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tinv_ptr, p_ptr, out_ptr, sq_t, sq_h,
                            sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sg_k, sbeta_t, sbeta_h, so_t, so_h, h, hk, dk, dv,
                            col0, scale, eps, L2NORM, G_PER_CHANNEL, PREC, DT, BT, BK, BV)
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=s_mask)
# fmt: on


def _chunk(chunk_size: int, per_channel: bool) -> int:
    """Tokens per kernel chunk: the power of two in [16, 64] covering ``chunk_size``, at most
    32 with a decay per key channel."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return min(MAX_CHUNK_PER_CHANNEL if per_channel else MAX_CHUNK, max(SUB, triton.next_power_of_2(chunk_size)))


def _config(dv: int, exact: bool, block_v: int | None, num_warps: int | None) -> tuple[int, int]:
    """(value columns per program, warps) of the state kernel: the whole head in the interpreter,
    else pinned (float32 operands take twice the shared memory: half the tile)."""
    if block_v is None:
        whole = triton.next_power_of_2(dv)
        block_v = whole if env.triton_interpret() else min(32 if exact else 64, whole)
    if block_v & (block_v - 1) or block_v < 16:
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    return block_v, num_warps or (4 if exact else 8)


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
        chunk_size: tokens per chunk, rounded to a power of two in [16, 64] (at most 32 with a
            decay per key channel); it changes the rounding only, never the result.
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
    exact = all(x.dtype == torch.float32 for x in (q, k, v))
    bv, warps = _config(dv, exact, block_v, num_warps)
    # float32 inputs: three-pass tf32 (float32's accuracy on the tensor cores; "ieee" dots lower
    # to scalar FMAs that spill kilobytes per thread on sm_90); half inputs: tf32
    prec, solve_prec = ("tf32x3", "tf32x3") if exact else ("tf32", "tf32x3")
    bt, bk = _chunk(chunk_size, per_channel), max(16, triton.next_power_of_2(dk))
    # chunk c of the packed batch -> its sequence, on the device (no host synchronisation): the
    # grid is an upper bound on the chunk count (each sequence adds at most one partial chunk)
    qsl = query_start_loc
    num_chunks = (qsl[1:] - qsl[:-1] + bt - 1) // bt
    ends = num_chunks.cumsum(0)
    grid_chunks = triton.cdiv(t, bt) + n
    seq_of = torch.searchsorted(ends, torch.arange(grid_chunks, device=ends.device), right=True).to(torch.int32)
    first = (ends - num_chunks).to(torch.int32)
    # the chunks' (I + A)^-1 and P, row t at token t, in the state kernel's operand dtype
    buf_dtype = torch.float32 if exact else next(x.dtype for x in (v, q, k) if x.dtype != torch.float32)
    dot_dtype = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[buf_dtype]
    tinv, p = (torch.empty(t, hv, bt, dtype=buf_dtype, device=v.device) for _ in range(2))
    # fmt: off
    _intra_kernel[(grid_chunks, hv)](
        q, k, g3, beta, qsl, seq_of, first, tinv, p, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        g3.stride(0), g3.stride(1), g3.stride(2), beta.stride(0), beta.stride(1), hv // hk, dk, n, dk ** -0.5, 1e-6,
        L2NORM=use_qk_l2norm, G_PER_CHANNEL=per_channel, PREC=prec, SOLVE_PREC=solve_prec, BT=bt, BK=bk, BC=SUB,
        num_warps=8 if per_channel else 4)
    _state_kernel[(n, hv, triton.cdiv(dv, bv))](
        q, k, v, g3, beta, tinv, p, state, qsl, state_indices, has_initial_state, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g3.stride(0), g3.stride(1), g3.stride(2), beta.stride(0), beta.stride(1),
        state.stride(0), state.stride(1), state.stride(2), state.stride(3), out.stride(0), out.stride(1),
        hv // hk, dk, dv, dk ** -0.5, 1e-6, L2NORM=use_qk_l2norm, G_PER_CHANNEL=per_channel, PREC=prec, DT=dot_dtype,
        BT=bt, BK=bk, BV=bv, INTERPRET=env.triton_interpret(), num_warps=warps)
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
