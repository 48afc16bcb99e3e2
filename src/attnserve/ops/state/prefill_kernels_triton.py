"""The Triton kernels of the state prefills: the Mamba-1 scan (and the carry across its pieces),
lightning attention block by block, the short causal conv's prefill, state write and decode step.

``prefill_triton.py`` launches them and its docstring describes them: the algorithms, the
layouts, the choices measured on the H200. Not here: the launch wrappers, their input checks and
pinned tiles (``prefill_triton.py``), the PyTorch twins (``attention/state``).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["conv_prefill_kernel", "conv_state_kernel", "conv_update_kernel", "lightning_prefill_kernel",
           "scan_carry_kernel", "selective_scan_prefill_kernel"]

LOG2E = tl.constexpr(1.4426950408889634)  # exp(u) = exp2(u log2(e))


# Kernels keep dense argument lists, as in ops/attention/paged_triton.py. Values that change from step
# to step (token and sequence counts, pieces; the per-sequence rows, slices that move with the
# number of decodes) are not specialised on: a new class would compile a variant inside a step.
# fmt: off
@triton.jit
def _scan_token(h, sdt, a, skip, x_nxt, dt_nxt, b_nxt, c_nxt, z_nxt, t, end, x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr,
                out_ptr, sx_t, sdt_t, sb_t, sc_t, sz_t, dim, chans, chan_ok, cols, col_ok, HAS_Z: tl.constexpr,
                OUTPUT: tl.constexpr):
    """Token t of the scan (its inputs loaded a step earlier); issues the loads of token t + 1."""
    x = x_nxt.to(tl.float32)
    dt = dt_nxt.to(tl.float32)
    bb = b_nxt.to(tl.float32)
    ahead = t + 1 < end
    x_nxt = tl.load(x_ptr + (t + 1) * sx_t + chans, mask=chan_ok & ahead, other=0.0)
    dt_nxt = tl.load(dt_ptr + (t + 1) * sdt_t + chans, mask=chan_ok & ahead, other=0.0)
    b_nxt = tl.load(b_ptr + (t + 1) * sb_t + cols, mask=col_ok & ahead, other=0.0)
    h = h * tl.exp2(dt[:, None] * a) + (dt * x)[:, None] * bb[None, :]
    if OUTPUT:
        cc = c_nxt.to(tl.float32)
        z = z_nxt.to(tl.float32)
        c_nxt = tl.load(c_ptr + (t + 1) * sc_t + cols, mask=col_ok & ahead, other=0.0)
        if HAS_Z:
            z_nxt = tl.load(z_ptr + (t + 1) * sz_t + chans, mask=chan_ok & ahead, other=0.0)
        y = tl.sum(h * cc[None, :], axis=1) + skip * x
        if HAS_Z:
            y = y * (z * tl.sigmoid(z))
        tl.store(out_ptr + t * dim + chans, y.to(out_ptr.dtype.element_ty), mask=chan_ok)  # out is [T, D]
    else:
        sdt += dt
    return h, sdt, x_nxt, dt_nxt, b_nxt, c_nxt, z_nxt


@triton.jit(do_not_specialize=("pieces",), do_not_specialize_on_alignment=("idx_ptr", "init_ptr"))
def selective_scan_prefill_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, state_ptr, qsl_ptr, idx_ptr,
                                   init_ptr, out_ptr, ws_ptr, sum_ptr, sx_t, sdt_t, sa_d, sa_n, sb_t, sc_t, sz_t,
                                   ss_p, ss_d, ss_n, dim, n, pieces, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                                   MODE: tl.constexpr, UNROLL: tl.constexpr, INTERPRET: tl.constexpr,
                                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    # MODE 0: whole sequences, state in and out. With the sequences cut into ``pieces``, MODE 1:
    # each piece from zeros, its end state and dt sum to the workspace; MODE 2: each piece from
    # its entering state (the workspace, filled by the carry kernel), outputs only.
    prog = tl.program_id(0)
    seq = prog // pieces
    chans = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    chan_ok = chans < dim
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n
    mask = chan_ok[:, None] & col_ok[None, :]
    start = tl.load(qsl_ptr + seq).to(tl.int64)
    end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
    span = tl.cdiv(end - start, pieces)
    start = tl.minimum(start + (prog % pieces) * span, end)
    end = tl.minimum(start + span, end)
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    keep = (tl.load(init_ptr + seq) != 0) & (slot >= 0)
    a = tl.load(a_ptr + chans[:, None] * sa_d + cols[None, :] * sa_n, mask=mask, other=0.0).to(tl.float32) * LOG2E
    h_ptrs = state_ptr + slot * ss_p + chans[:, None].to(tl.int64) * ss_d + cols[None, :] * ss_n
    ws_ptrs = ws_ptr + (prog * dim + chans[:, None]).to(tl.int64) * BLOCK_N + cols[None, :]
    if MODE == 0:
        h = tl.load(h_ptrs, mask=mask & keep, other=0.0).to(tl.float32)  # [BLOCK_D, BLOCK_N]
    elif MODE == 1:
        h = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
    else:
        h = tl.load(ws_ptrs, mask=mask, other=0.0)
    skip = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_D:
        skip = tl.load(d_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)
    sdt = tl.zeros([BLOCK_D], dtype=tl.float32)
    # Token t's loads are issued during token t - 1: h depends on the previous token through one
    # FMA only, so they need not wait for it.
    first = start < end
    x_nxt = tl.load(x_ptr + start * sx_t + chans, mask=chan_ok & first, other=0.0)
    dt_nxt = tl.load(dt_ptr + start * sdt_t + chans, mask=chan_ok & first, other=0.0)
    b_nxt = tl.load(b_ptr + start * sb_t + cols, mask=col_ok & first, other=0.0)
    c_nxt = tl.load(c_ptr + start * sc_t + cols, mask=col_ok & first, other=0.0)
    z_nxt = x_nxt
    if HAS_Z:
        z_nxt = tl.load(z_ptr + start * sz_t + chans, mask=chan_ok & first, other=0.0)
    if INTERPRET:  # the interpreter's range() cannot take a loaded bound
        t = start
        while t < end:
            h, sdt, x_nxt, dt_nxt, b_nxt, c_nxt, z_nxt = _scan_token(
                h, sdt, a, skip, x_nxt, dt_nxt, b_nxt, c_nxt, z_nxt, t, end, x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr,
                out_ptr, sx_t, sdt_t, sb_t, sc_t, sz_t, dim, chans, chan_ok, cols, col_ok, HAS_Z, MODE != 1)
            t += 1
    else:
        for t in tl.range(start, end, loop_unroll_factor=UNROLL):
            h, sdt, x_nxt, dt_nxt, b_nxt, c_nxt, z_nxt = _scan_token(
                h, sdt, a, skip, x_nxt, dt_nxt, b_nxt, c_nxt, z_nxt, t, end, x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr,
                out_ptr, sx_t, sdt_t, sb_t, sc_t, sz_t, dim, chans, chan_ok, cols, col_ok, HAS_Z, MODE != 1)
    if MODE == 0:
        if slot >= 0:
            tl.store(h_ptrs, h.to(state_ptr.dtype.element_ty), mask=mask)
    elif MODE == 1:
        tl.store(ws_ptrs, h, mask=mask)
        tl.store(sum_ptr + prog.to(tl.int64) * dim + chans, sdt, mask=chan_ok)


@triton.jit(do_not_specialize=("pieces",), do_not_specialize_on_alignment=("idx_ptr", "init_ptr"))
def scan_carry_kernel(a_ptr, state_ptr, idx_ptr, init_ptr, ws_ptr, sum_ptr, sa_d, sa_n, ss_p, ss_d, ss_n, dim, n,
                       pieces, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    # Across a sequence's pieces: each piece's entering state to the workspace (over its end
    # state), h <- exp(A sum(dt)) h + end state; the last h to the state row.
    seq = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    chan_ok = chans < dim
    cols = tl.arange(0, BLOCK_N)
    mask = chan_ok[:, None] & (cols < n)[None, :]
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    keep = (tl.load(init_ptr + seq) != 0) & (slot >= 0)
    a = tl.load(a_ptr + chans[:, None] * sa_d + cols[None, :] * sa_n, mask=mask, other=0.0).to(tl.float32) * LOG2E
    h_ptrs = state_ptr + slot * ss_p + chans[:, None].to(tl.int64) * ss_d + cols[None, :] * ss_n
    h = tl.load(h_ptrs, mask=mask & keep, other=0.0).to(tl.float32)
    prog = seq * pieces
    while prog < (seq + 1) * pieces:  # a while: the interpreter's range() cannot take a scalar argument
        ws_ptrs = ws_ptr + (prog * dim + chans[:, None]).to(tl.int64) * BLOCK_N + cols[None, :]
        piece_end = tl.load(ws_ptrs, mask=mask, other=0.0)
        sdt = tl.load(sum_ptr + prog.to(tl.int64) * dim + chans, mask=chan_ok, other=0.0)
        tl.store(ws_ptrs, h, mask=mask)
        h = h * tl.exp2(sdt[:, None] * a) + piece_end
        prog += 1
    if slot >= 0:
        tl.store(h_ptrs, h.to(state_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lightning_block(s, q_decay, pair, blk, end, q_ptr, k_ptr, v_ptr, out_ptr, sq_t, sk_t, sv_t, head_q, head_k,
                     head_v, head_o, rate, rows, keys, key_ok, vcols, col_ok, num_heads, dv,
                     PRECISION: tl.constexpr, BF16_DOTS: tl.constexpr, BLOCK_T: tl.constexpr):
    """The block of tokens [blk, min(blk + BLOCK_T, end)): writes its outputs, returns the new S."""
    n = tl.minimum(end - blk, BLOCK_T)
    ok = rows < n
    toks = blk + rows
    q = tl.load(q_ptr + toks[:, None] * sq_t + head_q + keys[None, :], mask=ok[:, None] & key_ok[None, :], other=0.0)
    k = tl.load(k_ptr + toks[:, None] * sk_t + head_k + keys[None, :], mask=ok[:, None] & key_ok[None, :], other=0.0)
    v = tl.load(v_ptr + toks[:, None] * sv_t + head_v + vcols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * pair  # [BLOCK_T, BLOCK_T]
    pos = rows.to(tl.float32)
    k_decay = tl.exp(tl.where(ok, -rate * ((n - 1).to(tl.float32) - pos), float("-inf")))  # lambda^(n-1-j)
    kd = tl.trans(k.to(tl.float32) * k_decay[:, None])  # [BLOCK_K, BLOCK_T]
    qd = q.to(tl.float32) * q_decay
    s_decay = tl.exp(-rate * n.to(tl.float32))  # lambda^n
    if BF16_DOTS:  # bf16 operands for the float32 factors
        o = tl.dot(scores.to(tl.bfloat16), v.to(tl.bfloat16))
        o = tl.dot(qd.to(tl.bfloat16), s.to(tl.bfloat16), acc=o)
        s = tl.dot(kd.to(tl.bfloat16), v.to(tl.bfloat16), acc=s * s_decay)
    else:
        o = tl.dot(scores, v.to(tl.float32), input_precision=PRECISION)
        o = tl.dot(qd, s, acc=o, input_precision=PRECISION)
        s = tl.dot(kd, v.to(tl.float32), acc=s * s_decay, input_precision=PRECISION)
    out = out_ptr + toks[:, None] * (num_heads * dv) + head_o + vcols[None, :]  # out is [T, H, dv]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=ok[:, None] & col_ok[None, :])
    return s


@triton.jit(do_not_specialize_on_alignment=("idx_ptr", "init_ptr"))
def lightning_prefill_kernel(q_ptr, k_ptr, v_ptr, rate_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr, out_ptr,
                              sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, ss_p, ss_h, ss_k, ss_v, num_heads, dk, dv,
                              PRECISION: tl.constexpr, BF16_DOTS: tl.constexpr, INTERPRET: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    vcols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = vcols < dv
    keys = tl.arange(0, BLOCK_K)
    key_ok = keys < dk
    rows = tl.arange(0, BLOCK_T)
    start = tl.load(qsl_ptr + seq).to(tl.int64)
    end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    keep = (tl.load(init_ptr + seq) != 0) & (slot >= 0)
    rate = tl.load(rate_ptr + head).to(tl.float32)  # lambda = exp(-rate)
    s_mask = key_ok[:, None] & col_ok[None, :]
    s_ptrs = state_ptr + slot * ss_p + head * ss_h + keys[:, None] * ss_k + vcols[None, :] * ss_v
    s = tl.load(s_ptrs, mask=s_mask & keep, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    pos = rows.to(tl.float32)
    q_decay = tl.exp(-rate * (pos + 1.0))[:, None]  # lambda^(t+1)
    gap = pos[:, None] - pos[None, :]
    pair = tl.exp(tl.where(gap >= 0, -rate * gap, float("-inf")))  # lambda^(t-j), 0 above the diagonal
    if INTERPRET:  # the interpreter's range() cannot take a loaded bound
        blk = start
        while blk < end:
            s = _lightning_block(s, q_decay, pair, blk, end, q_ptr, k_ptr, v_ptr, out_ptr, sq_t, sk_t, sv_t,
                                 head * sq_h, head * sk_h, head * sv_h, head * dv, rate, rows, keys, key_ok, vcols,
                                 col_ok, num_heads, dv, PRECISION, BF16_DOTS, BLOCK_T)
            blk += BLOCK_T
    else:
        for blk in range(start, end, BLOCK_T):
            s = _lightning_block(s, q_decay, pair, blk, end, q_ptr, k_ptr, v_ptr, out_ptr, sq_t, sk_t, sv_t,
                                 head * sq_h, head * sk_h, head * sv_h, head * dv, rate, rows, keys, key_ok, vcols,
                                 col_ok, num_heads, dv, PRECISION, BF16_DOTS, BLOCK_T)
    if slot >= 0:
        tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=s_mask)


@triton.jit(do_not_specialize=("num_tokens", "num_seqs", "search_steps"),
            do_not_specialize_on_alignment=("idx_ptr", "init_ptr"))
def conv_prefill_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr, out_ptr,
                         sx_t, sw_c, sw_k, ss_p, ss_c, ss_k, num_tokens, num_seqs, search_steps, channels,
                         K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    # Index math in int64 throughout (also spares the interpreter its int32 overflow checks).
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    tok_ok = toks < num_tokens
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    chan_ok = chans < channels
    # Each token's sequence: lo with qsl[lo] <= tok < qsl[lo + 1], by binary search.
    lo = tl.zeros([BLOCK_T], dtype=tl.int64)
    hi = tl.full([BLOCK_T], num_seqs, dtype=tl.int64)
    step = 0
    while step < search_steps:
        step += 1
        mid = (lo + hi) // 2
        right = tl.load(qsl_ptr + mid) <= toks
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    seq_start = tl.load(qsl_ptr + lo).to(tl.int64)
    slot = tl.load(idx_ptr + lo).to(tl.int64)
    keep = (tl.load(init_ptr + lo) != 0) & (slot >= 0) & tok_ok
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(K):  # tap j reads the input K-1-j tokens back
        w = tl.load(w_ptr + chans * sw_c + j * sw_k, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
        src = toks - (K - 1 - j)
        # Loaded whatever sequence src is in (the load need not wait for the search), kept if its own.
        val = tl.load(x_ptr + src[:, None] * sx_t + chans[None, :],
                      mask=((src >= 0) & tok_ok)[:, None] & chan_ok[None, :], other=0.0).to(tl.float32)
        if j < K - 1:  # before the sequence's first token: its conv state, column K-1 + (src - start)
            own = src >= seq_start
            col = (K - 1) + src - seq_start
            old = tl.load(state_ptr + slot[:, None] * ss_p + chans[None, :] * ss_c + col[:, None] * ss_k,
                          mask=(keep & ~own)[:, None] & chan_ok[None, :], other=0.0).to(tl.float32)
            val = tl.where(own[:, None], val, old)
        acc += val * w
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + toks[:, None] * channels + chans[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tok_ok[:, None] & chan_ok[None, :])


@triton.jit(do_not_specialize_on_alignment=("idx_ptr", "init_ptr"))
def conv_state_kernel(x_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr, sx_t, ss_p, ss_c, ss_k, channels,
                       K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
    seq = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    if slot < 0:
        return
    start = tl.load(qsl_ptr + seq).to(tl.int64)
    length = tl.load(qsl_ptr + seq + 1).to(tl.int64) - start
    keep = tl.load(init_ptr + seq) != 0
    cols = tl.arange(0, BLOCK_W).to(tl.int64)
    mask = (chans < channels)[:, None] & (cols < K - 1)[None, :]
    # New column j is input length - (K-1) + j of [old state | new tokens], in the tokens when >= 0.
    pos = length - (K - 1) + cols  # [BLOCK_W]
    new = tl.load(x_ptr + (start + pos)[None, :] * sx_t + chans[:, None], mask=mask & (pos >= 0)[None, :], other=0.0)
    row = state_ptr + slot * ss_p + chans[:, None] * ss_c
    old = tl.load(row + ((K - 1) + pos)[None, :] * ss_k, mask=mask & (pos < 0)[None, :] & keep, other=0.0)
    new = new.to(tl.float32) + old.to(tl.float32)
    tl.debug_barrier()  # every old column is read before any is overwritten
    tl.store(row + cols[None, :] * ss_k, new.to(state_ptr.dtype.element_ty), mask=mask)


@triton.jit
def conv_update_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, idx_ptr, out_ptr, sx_b, sw_c, sw_k, ss_p, ss_c, ss_k,
                        channels, K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                        BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    chan_ok = chans < channels
    out = out_ptr + b * channels + chans  # out is [B, C]
    slot = tl.load(idx_ptr + b).to(tl.int64)
    if slot < 0:  # a padded sequence: no state to advance
        tl.store(out, tl.zeros([BLOCK_C], dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=chan_ok)
        return
    x = tl.load(x_ptr + b * sx_b + chans, mask=chan_ok, other=0.0).to(tl.float32)
    cols = tl.arange(0, BLOCK_W).to(tl.int64)
    row = state_ptr + slot * ss_p + chans[:, None] * ss_c
    mask = chan_ok[:, None] & (cols < K - 1)[None, :]
    old = tl.load(row + cols[None, :] * ss_k, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_C, BLOCK_W]
    w = tl.load(w_ptr + chans[:, None] * sw_c + cols[None, :] * sw_k, mask=mask, other=0.0).to(tl.float32)
    w_new = tl.load(w_ptr + chans * sw_c + (K - 1) * sw_k, mask=chan_ok, other=0.0).to(tl.float32)
    y = tl.sum(old * w, axis=1) + x * w_new
    if HAS_BIAS:
        y += tl.load(bias_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=chan_ok)
    # The new row is [old[1:] | x]: column j takes old column j + 1, the last one x.
    shifted = tl.load(row + (cols + 1)[None, :] * ss_k, mask=mask & (cols + 1 < K - 1)[None, :], other=0.0)
    new = tl.where((cols == K - 2)[None, :], x[:, None], shifted.to(tl.float32))
    tl.debug_barrier()  # every old column is read before any is overwritten
    tl.store(row + cols[None, :] * ss_k, new.to(state_ptr.dtype.element_ty), mask=mask)
# fmt: on
