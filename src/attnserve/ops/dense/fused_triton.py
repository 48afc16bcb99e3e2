"""Fused Triton kernels for the per-layer elementwise work: RMSNorm (+ residual), RoPE, act-and-mul.

Each kernel reads every input element once and writes every output element once; one program
owns a block of rows (RMSNorm), one token's block of heads (RoPE) or a block of one token's
columns (act-and-mul). Arithmetic is fp32; where the PyTorch path rounds an intermediate to the
tensor's dtype (a cast before the weight multiply, each product of the rotation), the kernel
rounds at the same place, so fp16/bf16 results match it to the bit except where fp32 math
functions (rsqrt, exp, erf) or the reduction order differ.

It is not the dispatch: ``layers/fused.py`` chooses between these kernels and their PyTorch
twins, which live there too. All wrappers are out of place: inputs are never written. Configs
are pinned per shape (no autotune); under ``TRITON_INTERPRET=1`` blocks are larger, since the
interpreter pays per program. bf16 is loaded and converted to fp32 before any arithmetic (the
interpreter cannot compute in bf16). No autograd: inference only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve import env

# the RoPE and norm pieces are shared with the cache write that rotates k on the way
# (ops/attention/kv_write_triton.py)
__all__ = ["ACT_IDS", "FUSED_ACTS", "act_and_mul", "block_elems", "gated_product", "head_inv_rms",
           "rms_norm", "rope_cos_sin", "rope_pairs", "rotary", "rotate_heads", "store_rope", "warps"]

FUSED_ACTS = ("silu", "gelu", "gelu_pytorch_tanh")
ACT_IDS = {name: i for i, name in enumerate(FUSED_ACTS)}
_SQRT_HALF = tl.constexpr(0.7071067811865476)
_TANH_BETA = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)


def block_elems() -> int:
    """Elements one program holds: small on GPU (registers), large in the interpreter."""
    return 16384 if env.triton_interpret() else 2048


def warps(elems: int, per_thread: int = 8) -> int:
    return min(8, max(1, elems // (32 * per_thread)))


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x [..., D] as rows addressed ``(row // heads) * stride_t + (row % heads) * stride_h``.

    Two leading dims ([T, H, D], e.g. a q/k view of a fused QKV output) need no copy; more are
    flattened (a copy only where torch cannot view them).
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        x = x.unsqueeze(0)  # [D] -> [1, D]
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    if x.dim() > 3:
        x = x.reshape(-1, x.shape[-2], x.shape[-1])  # [..., H, D] -> [N, H, D]
    return x, x.shape[1], x.stride(0), x.stride(1)


# Kernels keep dense argument lists, as in ops/attention/paged_triton.py.
# fmt: off
@triton.jit(do_not_specialize=("n_rows",))  # rows vary per step: no variant per size class
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_rows, heads, sx_t, sx_h,
                     sr_t, sr_h, dim, eps, HAS_RES: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < dim)
    rows64 = rows.to(tl.int64)
    x_off = (rows64 // heads) * sx_t + (rows64 % heads) * sx_h  # [BLOCK_R]
    o_off = rows64[:, None] * dim + cols[None, :]  # outputs are contiguous [n_rows, dim]
    x = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0)
    in_ty = x.dtype
    x = x.to(tl.float32)
    if HAS_RES:  # r = x + residual, rounded to the input dtype, is what gets normalised
        r_off = (rows64 // heads) * sr_t + (rows64 % heads) * sr_h
        res = tl.load(res_ptr + r_off[:, None] + cols[None, :], mask=mask, other=0.0)
        r = (x + res.to(tl.float32)).to(in_ty)
        tl.store(res_out_ptr + o_off, r, mask=mask)
        x = r.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)  # [BLOCK_R]
    h = x * inv[:, None]
    w = tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        out = h * (1.0 + w[None, :])
    else:  # as layers/norm.py: cast to the input dtype first, then multiply by the weight
        out = w[None, :] * h.to(in_ty).to(tl.float32)
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def head_inv_rms(x_row, h_ok, eps, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr):
    """1 / rms [BLOCK_H, 1] of each whole head at ``x_row`` [BLOCK_H, 1] (a per-head q/k norm),
    summed over a [BLOCK_H, HEAD_PAD] tile as ``_rms_norm_kernel`` sums its [rows, dim] tile."""
    j = tl.arange(0, HEAD_PAD)
    x = tl.load(x_row + j[None, :], mask=h_ok[:, None] & (j[None, :] < HEAD), other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, axis=1) / HEAD + eps)[:, None]


@triton.jit
def _normed(x, idx, inv, w_ptr, ty, NORM: tl.constexpr):
    """fp32 x [BLOCK_H, N] (dims ``idx`` [N] of its heads) after the per-head RMSNorm, rounded
    as ``layers/norm.py`` rounds: ``x * inv`` cast to the dtype, times the weight, cast again.
    Unchanged without NORM."""
    if NORM:
        w = tl.load(w_ptr + idx).to(tl.float32)[None, :]
        x = (w * (x * inv).to(ty).to(tl.float32)).to(ty).to(tl.float32)
    return x


@triton.jit
def rope_pairs(x_row, h_ok, cos, sin, inv, w_ptr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr,
                BLOCK_H: tl.constexpr, HALF_PAD: tl.constexpr, NORM: tl.constexpr):
    """The rotated pairs (o1, o2) [BLOCK_H, HALF_PAD] of the heads at ``x_row`` [BLOCK_H, 1],
    fp32 values rounded to x's dtype where the PyTorch path rounds them; with NORM the heads
    are RMS-normalised first (``inv`` from ``head_inv_rms``, weight at ``w_ptr``)."""
    d = tl.arange(0, HALF_PAD)
    ty = x_row.dtype.element_ty
    if INTERLEAVED:  # pairs (x0, x1), (x2, x3), ...: one contiguous load, split in registers
        e = tl.arange(0, 2 * HALF_PAD)
        e_ok = e < ROT
        x = tl.load(x_row + e[None, :], mask=h_ok[:, None] & e_ok[None, :], other=0.0)
        x = _normed(x.to(tl.float32), tl.where(e_ok, e, 0), inv, w_ptr, ty, NORM)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_H, HALF_PAD, 2)))
    else:  # NeoX: pairs (x_i, x_{i + ROT/2})
        d_ok = d < ROT // 2
        mask = h_ok[:, None] & d_ok[None, :]
        x1 = tl.load(x_row + d[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + ROT // 2 + d[None, :], mask=mask, other=0.0).to(tl.float32)
        d = tl.where(d_ok, d, 0)
        x1 = _normed(x1, d, inv, w_ptr, ty, NORM)
        x2 = _normed(x2, ROT // 2 + d, inv, w_ptr, ty, NORM)
    # the PyTorch path casts cos/sin to the dtype and rounds each product and each sum there
    c = cos.to(ty).to(tl.float32)[None, :]
    s = sin.to(ty).to(tl.float32)[None, :]
    o1 = ((x1 * c).to(ty).to(tl.float32) - (x2 * s).to(ty).to(tl.float32)).to(ty)
    o2 = ((x2 * c).to(ty).to(tl.float32) + (x1 * s).to(ty).to(tl.float32)).to(ty)
    return o1, o2


@triton.jit
def store_rope(x_row, o_row, h_ok, o1, o2, scale, inv, w_ptr, HEAD: tl.constexpr,
                ROT: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr,
                HALF_PAD: tl.constexpr, TAIL_PAD: tl.constexpr, NORM: tl.constexpr):
    """Store the rotated pairs and the unrotated dims past ROT (read from ``x_row``, normalised
    with NORM) at ``o_row`` [BLOCK_H, 1], divided by ``scale`` (an fp8 cache's; 1.0: unchanged)
    in o's dtype."""
    ty = o_row.dtype.element_ty
    d = tl.arange(0, HALF_PAD)
    if INTERLEAVED:
        e = tl.arange(0, 2 * HALF_PAD)
        out = tl.reshape(tl.join(o1, o2), (BLOCK_H, 2 * HALF_PAD))  # pairs back in place
        out = (out.to(tl.float32) / scale).to(ty)
        tl.store(o_row + e[None, :], out, mask=h_ok[:, None] & (e[None, :] < ROT))
    else:
        mask = h_ok[:, None] & (d[None, :] < ROT // 2)
        tl.store(o_row + d[None, :], (o1.to(tl.float32) / scale).to(ty), mask=mask)
        tl.store(o_row + ROT // 2 + d[None, :], (o2.to(tl.float32) / scale).to(ty), mask=mask)
    if ROT < HEAD:  # partial rotary: the rest of the head passes through
        j = ROT + tl.arange(0, TAIL_PAD)
        j_ok = j < HEAD
        tail_mask = h_ok[:, None] & j_ok[None, :]
        tail = tl.load(x_row + j[None, :], mask=tail_mask, other=0.0).to(tl.float32)
        tail = _normed(tail, tl.where(j_ok, j, 0), inv, w_ptr, x_row.dtype.element_ty, NORM)
        tl.store(o_row + j[None, :], (tail / scale).to(ty), mask=tail_mask)


@triton.jit
def rope_cos_sin(table_ptr, pos_ptr, t, s_table, ROT: tl.constexpr, HALF_PAD: tl.constexpr):
    """Token t's cos and sin rows [HALF_PAD], fp32, from the [max_pos, ROT] table."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    d_ok = d < ROT // 2
    cos = tl.load(table_ptr + pos * s_table + d, mask=d_ok, other=0.0)
    sin = tl.load(table_ptr + pos * s_table + ROT // 2 + d, mask=d_ok, other=0.0)
    return cos, sin


@triton.jit
def rotate_heads(x_ptr, o_ptr, sx_t, sx_h, so_t, so_h, t, h0, num_heads, cos, sin, w_ptr, eps,
                  HEAD: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr,
                  BLOCK_H: tl.constexpr, HALF_PAD: tl.constexpr, TAIL_PAD: tl.constexpr,
                  NORM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Rotate heads [h0, h0 + BLOCK_H) of token t; copy dims past ROT unchanged. With NORM each
    head is RMS-normalised first (weight at ``w_ptr``, ``eps``)."""
    h = h0 + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    x_row = x_ptr + t.to(tl.int64) * sx_t + h[:, None].to(tl.int64) * sx_h  # [BLOCK_H, 1]
    o_row = o_ptr + t.to(tl.int64) * so_t + h[:, None].to(tl.int64) * so_h
    inv = 1.0
    if NORM:
        inv = head_inv_rms(x_row, h_ok, eps, HEAD, HEAD_PAD)
    o1, o2 = rope_pairs(x_row, h_ok, cos, sin, inv, w_ptr, ROT, INTERLEAVED, BLOCK_H, HALF_PAD, NORM)
    store_rope(x_row, o_row, h_ok, o1, o2, 1.0, inv, w_ptr, HEAD, ROT, INTERLEAVED, BLOCK_H,
                HALF_PAD, TAIL_PAD, NORM)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, table_ptr, pos_ptr, sq_t, sq_h, sk_t, sk_h,
                   sqo_t, sqo_h, sko_t, sko_h, s_table, num_q_heads, num_k_heads,
                   HEAD: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr,
                   BLOCK_H: tl.constexpr, HALF_PAD: tl.constexpr, TAIL_PAD: tl.constexpr,
                   NUM_Q_BLOCKS: tl.constexpr):
    t = tl.program_id(0)
    blk = tl.program_id(1)  # head blocks of q first, then of k
    cos, sin = rope_cos_sin(table_ptr, pos_ptr, t, s_table, ROT, HALF_PAD)
    if blk < NUM_Q_BLOCKS:
        rotate_heads(q_ptr, qo_ptr, sq_t, sq_h, sqo_t, sqo_h, t, blk * BLOCK_H, num_q_heads,
                      cos, sin, q_ptr, 0.0, HEAD, ROT, INTERLEAVED, BLOCK_H, HALF_PAD, TAIL_PAD,
                      False, 1)
    else:
        rotate_heads(k_ptr, ko_ptr, sk_t, sk_h, sko_t, sko_h, t, (blk - NUM_Q_BLOCKS) * BLOCK_H,
                      num_k_heads, cos, sin, k_ptr, 0.0, HEAD, ROT, INTERLEAVED, BLOCK_H, HALF_PAD,
                      TAIL_PAD, False, 1)


@triton.jit
def gated_product(gate, up, ACT: tl.constexpr):
    """``act(gate) * up`` in gate's dtype, rounded as torch rounds it: the activation (fp32
    math, ``ACT`` an index into ``FUSED_ACTS``) is cast to the dtype before the product.
    ``up`` may be of any float dtype (it is up-cast)."""
    ty = gate.dtype
    g = gate.to(tl.float32)
    if ACT == 0:  # silu
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:  # gelu, exact (erf)
        a = 0.5 * g * (1.0 + tl.math.erf(g * _SQRT_HALF))
    else:  # gelu, tanh approximation; tanh(y) = 1 - 2 / (1 + exp(2y)), saturating at +-1
        y2 = 2.0 * _TANH_BETA * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (2.0 - 2.0 / (1.0 + tl.exp(tl.minimum(y2, 40.0))))  # tanh(20) == 1 in fp32
    return (a.to(ty).to(tl.float32) * up.to(tl.float32)).to(ty)


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, inter, s_x, ACT: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + t * s_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * s_x + inter + cols, mask=mask, other=0.0)
    tl.store(out_ptr + t * inter + cols, gated_product(gate, up, ACT), mask=mask)
# fmt: on


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    zero_centered: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, optionally after adding a residual (vLLM's fused_add_rms_norm).

    Args:
        x: [..., D], any float dtype (up to two leading dims are addressed by strides).
        weight: [D]; stored as ``w - 1`` when ``zero_centered``.
        eps: added to the mean square.
        residual: same shape and dtype as ``x``, or None.
        zero_centered: Gemma's ``x / rms(x) * (1 + w)``.
    Returns:
        ``out``, or ``(out, r)`` with ``r = x + residual`` in x's dtype and ``out = rmsnorm(r)``.
        ``out`` has x's dtype, or the promotion of x's and the weight's without ``zero_centered``
        (as ``layers/norm.py``). New contiguous tensors.
    """
    dim = x.shape[-1]
    out_dtype = x.dtype if zero_centered else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res_out = torch.empty_like(out, dtype=x.dtype) if residual is not None else None
    rows_x, heads, sx_t, sx_h = _as_rows(x)
    sr_t, sr_h = sx_t, sx_h
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                f"{tuple(x.shape)} {x.dtype}"
            )
        residual, _, sr_t, sr_h = _as_rows(residual)
    n_rows = out.numel() // dim if dim else 0
    if n_rows:
        block_d = triton.next_power_of_2(dim)
        block_r = min(triton.next_power_of_2(n_rows), max(1, block_elems() // block_d))
        grid = (triton.cdiv(n_rows, block_r),)
        _rms_norm_kernel[grid](
            rows_x, residual if residual is not None else rows_x, weight.contiguous(), out,
            res_out if res_out is not None else out, n_rows, heads, sx_t, sx_h, sr_t, sr_h,
            dim, float(eps), HAS_RES=residual is not None, ZERO_CENTERED=zero_centered,
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps(block_r * block_d, 16),
        )  # fmt: skip
    return out if res_out is None else (out, res_out)


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_table: torch.Tensor,
    positions: torch.Tensor,
    rotary_dim: int,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``rotary_dim`` dims of every q and k head by its token's position.

    Args:
        q: [T, Hq, D]; any strides with the last dim contiguous (views of a fused QKV are fine).
        k: [T, Hk, D].
        cos_sin_table: [max_pos, rotary_dim] float32, cos in the first half of each row and sin
            in the second (as ``RotaryEmbedding._table`` builds it); must cover every position.
        positions: [T] int32 or int64.
        rotary_dim: even, at most D; the dims past it are copied unchanged.
        interleaved: GPT-J adjacent pairs if True, else NeoX halves.
    Returns:
        (q_out, k_out): new contiguous tensors of q's and k's shapes and dtypes. Out of place,
        so q and k are never written (callers may pass views they still use).
    """
    t, num_q_heads, head = q.shape
    num_k_heads = k.shape[1]
    if k.shape[0] != t or k.shape[2] != head or positions.shape != (t,):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, positions mismatch")
    if rotary_dim % 2 or rotary_dim > head or cos_sin_table.shape[-1] != rotary_dim:
        raise ValueError(f"rotary_dim {rotary_dim} vs head {head}, table {cos_sin_table.shape}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    table = cos_sin_table.float().contiguous()
    positions = positions.contiguous()
    half_pad = triton.next_power_of_2(max(rotary_dim // 2, 1))
    tail_pad = triton.next_power_of_2(max(head - rotary_dim, 1))
    most_heads = triton.next_power_of_2(max(num_q_heads, num_k_heads))
    block_h = min(most_heads, max(1, block_elems() // half_pad))
    num_q_blocks = triton.cdiv(num_q_heads, block_h)
    grid = (t, num_q_blocks + triton.cdiv(num_k_heads, block_h))
    # no FMA contraction: x1 * c - x2 * s must round like the two products of the torch path
    _rotary_kernel[grid](
        q, k, q_out, k_out, table, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), table.stride(0),
        num_q_heads, num_k_heads, HEAD=head, ROT=rotary_dim, INTERLEAVED=bool(interleaved),
        BLOCK_H=block_h, HALF_PAD=half_pad, TAIL_PAD=tail_pad, NUM_Q_BLOCKS=num_q_blocks,
        num_warps=warps(block_h * half_pad, 4), enable_fp_fusion=False,
    )  # fmt: skip
    return q_out, k_out


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` for gate_up [..., 2I] laid out [gate | up].

    Args:
        gate_up: [..., 2I], any float dtype.
        act: one of ``FUSED_ACTS`` (HF names; "gelu" is the exact, erf form).
    Returns:
        [..., I] in gate_up's dtype, a new contiguous tensor.
    """
    if act not in ACT_IDS:
        raise ValueError(f"unsupported fused activation '{act}' (supported: {FUSED_ACTS})")
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up last dim {gate_up.shape[-1]} is odd")
    inter = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    rows = gate_up.reshape(-1, 2 * inter)  # [..., 2I] -> [N, 2I], a view when possible
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.shape[0] == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), block_elems() // 2)
    grid = (rows.shape[0], triton.cdiv(inter, block))
    _act_and_mul_kernel[grid](
        rows, out, inter, rows.stride(0), ACT=ACT_IDS[act], BLOCK=block, num_warps=warps(block)
    )
    return out
