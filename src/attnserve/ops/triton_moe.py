"""Grouped expert computation of a MoE layer in two Triton kernels, with no host synchronisation.

``FusedExperts`` (``layers/moe.py``) holds a layer's experts stacked: ``w13`` [E, 2I, H] ([gate |
up] per expert) and ``w2`` [E, H, I]. Its PyTorch path sorts the token-expert pairs by expert
and loops over the experts, sizing each slice from counts read on the host: one sync and 2E
launches per layer, and nothing a CUDA graph can replay. Here:

1. ``align_pairs`` (torch ops of fixed shapes, on the device): the pairs sorted by expert, each
   expert's run padded to a multiple of ``block_m``, so every ``block_m`` tile of the sorted list
   belongs to one expert (``tile_expert``; -1 for tiles past the end). Pairs routed to experts
   this rank does not hold (tensor parallelism) are dropped. The list has a fixed worst-case
   length, ``P + E (block_m - 1)``; the padding slots hold the index ``P`` (no pair).
2. ``_gate_up_kernel``: per (tile, block of I columns), the tile's token rows times the gate and
   up rows of its expert, bias, the gated activation in fp32, the result rounded to the model
   dtype (where the PyTorch path rounds the GEMM output; it then rounds the activation too).
3. ``_down_kernel``: per (tile, block of H columns), the activations times ``w2`` of the expert,
   bias, times the pair's routing weight, stored per pair in fp32; the k pairs of a token are
   then summed in a fixed order (no atomics: deterministic).

Empty tiles exit at once, so the padding costs a launch slot, not work. The PyTorch twin is
``FusedExperts._forward_torch``. Not here: quantised experts, expert parallelism, block-size
tuning (one pinned config per dtype; the interpreter gets larger blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve import env

__all__ = ["MOE_ACTS", "align_pairs", "fused_experts"]

MOE_ACTS = ("silu", "swiglu_clamped")  # SwiGLU, and GPT-OSS's clamped form


def align_pairs(flat_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert in ``block_m`` tiles of one expert each.

    Args:
        flat_ids: [P] local expert id of each token-expert pair (ids outside [0, E) are dropped).
        num_experts: E, the experts this rank holds.
        block_m: rows per tile.
    Returns:
        (sorted_pairs [P + E (block_m - 1), rounded up to block_m] int64, the pair index of each
        slot, P in padding slots; tile_expert [slots / block_m] int32, the expert of each tile,
        -1 past the last expert's run).
    """
    p, e, dev = flat_ids.shape[0], num_experts, flat_ids.device
    slots = triton.cdiv(p + e * (block_m - 1), block_m) * block_m
    ids = torch.where((flat_ids >= 0) & (flat_ids < e), flat_ids, e)  # e: dropped
    counts = torch.zeros(e + 1, dtype=torch.int64, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[e:].zero_()  # a kernel, not `padded[e] = 0`: a host scalar copy breaks graph capture
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    first = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    dest = starts[sorted_ids] + torch.arange(p, device=dev) - first[sorted_ids]
    dest = torch.where(sorted_ids < e, dest, slots)  # dropped pairs land in a spare slot
    sorted_pairs = torch.full((slots + 1,), p, dtype=torch.int64, device=dev)
    sorted_pairs.scatter_(0, dest, order)
    tile_start = torch.arange(0, slots, block_m, device=dev)
    tile_expert = torch.searchsorted(ends[:e], tile_start, right=True)
    tile_expert = torch.where(tile_expert < e, tile_expert, -1).to(torch.int32)
    return sorted_pairs[:slots], tile_expert


# fmt: off
@triton.jit(do_not_specialize=("num_pairs",))  # varies per step: no variant per size class
def _gate_up_kernel(x_ptr, w_ptr, b_ptr, out_ptr, pairs_ptr, tile_expert_ptr, num_pairs,
                    stride_xt, stride_we, stride_wn, stride_be, stride_os, limit, alpha,
                    hidden: tl.constexpr, inter: tl.constexpr, PRECISION: tl.constexpr, TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile)
    if e < 0:
        return
    slot = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + slot)
    row_ok = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    w_expert = w_ptr + e.to(tl.int64) * stride_we
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        a = tl.load(x_ptr + token[:, None] * stride_xt + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(w_expert + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        wu = tl.load(w_expert + (n + inter)[:, None] * stride_wn + k[None, :],
                     mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc_g = tl.dot(a, tl.trans(wg), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, tl.trans(wu), acc_u, input_precision=PRECISION)
    if HAS_BIAS:
        b = b_ptr + e.to(tl.int64) * stride_be
        acc_g += tl.load(b + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b + inter + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    # round where the PyTorch path's GEMM output is rounded to the model dtype
    g = acc_g.to(out_ptr.dtype.element_ty).to(tl.float32)
    u = acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
    if ACT == 0:  # silu(gate) * up
        h = g / (1.0 + tl.exp(-g)) * u
    else:  # GPT-OSS: clamp, gate * sigmoid(alpha gate) * (up + 1)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        h = g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0)
    tl.store(out_ptr + slot.to(tl.int64)[:, None] * stride_os + n[None, :], h.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=("num_pairs",))
def _down_kernel(h_ptr, w_ptr, b_ptr, rw_ptr, out_ptr, pairs_ptr, tile_expert_ptr, num_pairs,
                 stride_hs, stride_we, stride_wn, stride_be, stride_op,
                 hidden: tl.constexpr, inter: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile)
    if e < 0:
        return
    slot = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair = tl.load(pairs_ptr + slot)
    row_ok = pair < num_pairs
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    w_expert = w_ptr + e.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        a = tl.load(h_ptr + slot[:, None] * stride_hs + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_expert + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e.to(tl.int64) * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    # round where the PyTorch path's expert output is rounded to the model dtype
    acc = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(rw_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * stride_op + n[None, :], acc * weight[:, None],
             mask=row_ok[:, None] & n_ok[None, :])
# fmt: on


def _blocks(dtype: torch.dtype, pairs_per_expert: float) -> tuple[int, int, int]:
    """(block_m, block_n, block_k): tiles of ``block_m`` pairs read their expert's weights once
    each, so bigger batches take taller tiles (decode: one 16-row tile per expert touched)."""
    if env.triton_interpret():  # few, large programs: the interpreter pays per program
        return 16, 64, 64
    bm = 16 if pairs_per_expert <= 16 else 32 if pairs_per_expert <= 64 else 64
    if dtype == torch.float32:
        return bm, 32, 32
    return bm, 64, 64


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    local_ids: torch.Tensor,
    *,
    act: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_limit: float = 0.0,
    swiglu_alpha: float = 1.0,
) -> torch.Tensor:
    """sum over a token's k pairs of weight * expert(x), as float32 [T, H] (before any all-reduce).

    Args:
        x: [T, H] in the model dtype (fp32, fp16 or bf16; the interpreter: fp32 or fp16).
        w13, w2: [E, 2I, H] and [E, H, I], contiguous in their last dim.
        topk_weights: [T, k] routing weights; local_ids: [T, k] this rank's expert ids (others
            are dropped).
        act: one of ``MOE_ACTS``; swiglu_limit / swiglu_alpha: GPT-OSS's clamp and slope.
        w13_bias, w2_bias: [E, 2I] and [E, H] or None.
    """
    if act not in MOE_ACTS:
        raise ValueError(f"unsupported MoE kernel activation '{act}' (supported: {MOE_ACTS})")
    t, k = local_ids.shape
    e, two_i, hidden = w13.shape
    inter = two_i // 2
    bm, bn, bk = _blocks(x.dtype, t * k / e)
    x = x.contiguous()
    pairs, tile_expert = align_pairs(local_ids.reshape(-1), e, bm)
    h = torch.empty(pairs.shape[0], inter, dtype=x.dtype, device=x.device)
    num_tiles = tile_expert.shape[0]
    has_bias = w13_bias is not None
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 stays float32 (no TF32)
    # fmt: off
    _gate_up_kernel[(num_tiles, triton.cdiv(inter, bn))](
        x, w13, w13_bias if has_bias else w13, h, pairs, tile_expert, t * k,
        x.stride(0), w13.stride(0), w13.stride(1), w13_bias.stride(0) if has_bias else 0, h.stride(0),
        float(swiglu_limit), float(swiglu_alpha), hidden=hidden, inter=inter, PRECISION=precision, TOP_K=k, HAS_BIAS=has_bias, ACT=MOE_ACTS.index(act),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    per_pair = torch.zeros(t * k, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _down_kernel[(num_tiles, triton.cdiv(hidden, bn))](
        h, w2, w2_bias if has_bias else w2, weights, per_pair, pairs, tile_expert, t * k,
        h.stride(0), w2.stride(0), w2.stride(1), w2_bias.stride(0) if has_bias else 0, per_pair.stride(0),
        hidden=hidden, inter=inter, PRECISION=precision, HAS_BIAS=has_bias, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    # fmt: on
    return per_pair.view(t, k, hidden).sum(dim=1)
