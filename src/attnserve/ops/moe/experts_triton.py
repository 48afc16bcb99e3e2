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

Empty tiles exit at once, so the padding costs a launch slot, not work. The same two kernels run
every batch, from one-token decode to prefill chunks of 16K tokens (P up to a few 100K pairs: the
slot, token and pair offsets are int64; an expert's weights must stay under 2^31 elements).

Tile configs (``MoEConfig``, chosen by ``moe_config`` from the mean pairs per expert m = P / E,
E over all tensor-parallel ranks: a host number from shapes only, so decode stays graphable).
Decode batches keep short tiles (m <= 16: 16 rows, m <= 32: 32 rows; N and K blocks of 64, 4
warps, 3 stages, tiles first in launch order). Larger runs take 64-row (m <= 192) or 128-row
tiles, 8 warps and a grouped launch order: ``group_m`` tiles' N blocks run together, so a group's
token rows and its experts' weight blocks are reused from L2. Tall tiles use the tensor cores
better but pad each expert's run by about ``block_m / 2`` rows. The tiers were swept on the H200
(``benchmarks/gpu_moe.py --sweep``: Qwen3-30B-A3B, Mixtral, Qwen3-Next and DeepSeek-V3 shapes at 2K-16K
tokens).
float32 keeps tiles of at most 64 x 32 x 32 (IEEE dot products); the interpreter runs the 16-bit
table for every dtype (it ignores warps and stages).

The PyTorch twin is ``FusedExperts._forward_torch``. Not here: quantised experts, expert
parallelism, autotuning (configs are pinned per size class).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnserve import env

__all__ = ["MOE_ACTS", "MoEConfig", "align_pairs", "fused_experts", "moe_config"]

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


@dataclass(frozen=True)
class MoEConfig:
    """Tiles and launch of the two kernels; ``block_m`` is also ``align_pairs``' padding."""

    block_m: int  # pairs per tile (one expert per tile)
    block_n_up: int  # gate/up columns per program (each of the two accumulators)
    block_n_down: int  # hidden columns per program of the down kernel
    block_k: int  # reduction step of both kernels
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 0  # tiles whose N blocks run together; 0: every tile's first N block first


# the 16-bit table: (largest mean pairs per expert, config), first match
CONFIGS = (
    (16.0, MoEConfig(16, 64, 64, 64)),  # decode (as before prefill got its own tiles)
    (32.0, MoEConfig(32, 64, 64, 64)),
    # H200 sweep (benchmarks/gpu_moe.py --sweep, 2026-12-02): Qwen3-Next at 40 and 160 pairs
    # per expert, Qwen3-30B-A3B at 128 (0.77 ms against 0.92 for the 4-warp tiles)
    # (DeepSeek-V3 at 8K tokens, 256 pairs per expert, ran 128-row tiles faster: 15.4 against
    # 18.7 ms, so this tier stops at 192)
    (192.0, MoEConfig(64, 64, 128, 64, num_warps=8, num_stages=3, group_m=8)),
    # the same sweeps: best, or within 2% of it, from 512 to 4,096 pairs per expert (Mixtral
    # 67% of the FLOP peak, Qwen3-30B-A3B 41-46%)
    (float("inf"), MoEConfig(128, 128, 256, 64, num_warps=8, num_stages=3, group_m=8)),
)


def moe_config(dtype: torch.dtype, pairs_per_expert: float) -> MoEConfig:
    """The tile config for a batch with ``pairs_per_expert`` (P / E) pairs per expert on average.

    Tiles of ``block_m`` pairs read their expert's weights once each, so bigger batches take
    taller tiles: decode one 16-row tile per expert touched, prefill 64 or 128 rows (see the
    module docstring)."""
    cfg = next(c for bound, c in CONFIGS if pairs_per_expert <= bound)
    if dtype == torch.float32 and not env.triton_interpret():  # IEEE fp32 dots: small tiles
        return MoEConfig(min(cfg.block_m, 64), 32, 32, 32, num_warps=4, num_stages=3, group_m=cfg.group_m)
    return cfg


# fmt: off
@triton.jit
def _tile_and_block(num_tiles, n_blocks: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (tile, N block): tiles first (GROUP_M 0), or GROUP_M tiles at a time with
    their N blocks (all N blocks of a group run before the next group starts)."""
    pid = tl.program_id(0)
    if GROUP_M == 0:
        tile = pid % num_tiles
        nb = pid // num_tiles
    else:
        width = GROUP_M * n_blocks
        first = pid // width * GROUP_M
        size = tl.minimum(num_tiles - first, GROUP_M)  # the last group may be short
        tile = first + pid % width % size
        nb = pid % width // size
    return tile, nb


@triton.jit(do_not_specialize=("num_pairs", "num_tiles"))  # vary per step: no variant per size class
def _gate_up_kernel(x_ptr, w_ptr, b_ptr, out_ptr, pairs_ptr, tile_expert_ptr, num_pairs, num_tiles,
                    stride_xt, stride_we, stride_wn, stride_be, stride_os, limit, alpha,
                    hidden: tl.constexpr, inter: tl.constexpr, PRECISION: tl.constexpr, TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    tile, nb = _tile_and_block(num_tiles, tl.cdiv(inter, BLOCK_N), GROUP_M)
    e = tl.load(tile_expert_ptr + tile)
    if e < 0:
        return
    slot = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair = tl.load(pairs_ptr + slot)  # int64
    row_ok = pair < num_pairs
    token = pair // TOP_K
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    w_expert = w_ptr + e.to(tl.int64) * stride_we  # within an expert: int32 (< 2^31 elements)
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
    tl.store(out_ptr + slot[:, None] * stride_os + n[None, :], h.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=("num_pairs", "num_tiles"))
def _down_kernel(h_ptr, w_ptr, b_ptr, rw_ptr, out_ptr, pairs_ptr, tile_expert_ptr, num_pairs, num_tiles,
                 stride_hs, stride_we, stride_wn, stride_be, stride_op,
                 hidden: tl.constexpr, inter: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    tile, nb = _tile_and_block(num_tiles, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    e = tl.load(tile_expert_ptr + tile)
    if e < 0:
        return
    slot = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair = tl.load(pairs_ptr + slot)  # int64
    row_ok = pair < num_pairs
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
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
    tl.store(out_ptr + pair[:, None] * stride_op + n[None, :], acc * weight[:, None],
             mask=row_ok[:, None] & n_ok[None, :])
# fmt: on


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
    num_global_experts: int | None = None,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """sum over a token's k pairs of weight * expert(x), as float32 [T, H] (before any all-reduce).

    Args:
        x: [T, H] in the model dtype (fp32, fp16 or bf16; the interpreter: fp32 or fp16).
        w13, w2: [E, 2I, H] and [E, H, I], contiguous in their last dim.
        topk_weights: [T, k] routing weights; local_ids: [T, k] this rank's expert ids (others
            are dropped).
        act: one of ``MOE_ACTS``; swiglu_limit / swiglu_alpha: GPT-OSS's clamp and slope.
        w13_bias, w2_bias: [E, 2I] and [E, H] or None.
        num_global_experts: the experts over all tensor-parallel ranks (None: E), so that the
            tile config sees the pairs an expert gets, T k / num_global_experts.
        config: the tile config; None: ``moe_config`` for this batch (tests and sweeps pass one).
    """
    if act not in MOE_ACTS:
        raise ValueError(f"unsupported MoE kernel activation '{act}' (supported: {MOE_ACTS})")
    t, k = local_ids.shape
    e, two_i, hidden = w13.shape
    inter = two_i // 2
    if x.shape != (t, hidden) or w2.shape != (e, hidden, inter) or topk_weights.shape != (t, k):
        raise ValueError(f"fused_experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
                         f"topk_weights {tuple(topk_weights.shape)}, ids {tuple(local_ids.shape)} do not fit")
    if max(two_i * w13.stride(1), hidden * w2.stride(1)) >= 2**31 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_experts: expert weights must be contiguous in their last dim and span fewer than "
                         "2^31 elements per expert (int32 offsets)")
    cfg = config or moe_config(x.dtype, t * k / (num_global_experts or e))
    bm = cfg.block_m
    x = x.contiguous()
    pairs, tile_expert = align_pairs(local_ids.reshape(-1), e, bm)  # padded to the kernels' BLOCK_M
    h = torch.empty(pairs.shape[0], inter, dtype=x.dtype, device=x.device)
    num_tiles = tile_expert.shape[0]
    has_bias = w13_bias is not None
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 stays float32 (no TF32)
    launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    # fmt: off
    _gate_up_kernel[(num_tiles * triton.cdiv(inter, cfg.block_n_up),)](
        x, w13, w13_bias if has_bias else w13, h, pairs, tile_expert, t * k, num_tiles,
        x.stride(0), w13.stride(0), w13.stride(1), w13_bias.stride(0) if has_bias else 0, h.stride(0),
        float(swiglu_limit), float(swiglu_alpha), hidden=hidden, inter=inter, PRECISION=precision, TOP_K=k, HAS_BIAS=has_bias, ACT=MOE_ACTS.index(act),
        BLOCK_M=bm, BLOCK_N=cfg.block_n_up, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, **launch)
    # the down kernel stores every pair's row unless pairs may be dropped (experts of other
    # tensor-parallel ranks, or ids not known to be local): only then must the rows start at 0
    # (DeepSeek-V3 at 8K tokens: a 1.9 GB memset saved)
    all_local = num_global_experts == e
    per_pair = (torch.empty if all_local else torch.zeros)(t * k, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _down_kernel[(num_tiles * triton.cdiv(hidden, cfg.block_n_down),)](
        h, w2, w2_bias if has_bias else w2, weights, per_pair, pairs, tile_expert, t * k, num_tiles,
        h.stride(0), w2.stride(0), w2.stride(1), w2_bias.stride(0) if has_bias else 0, per_pair.stride(0),
        hidden=hidden, inter=inter, PRECISION=precision, HAS_BIAS=has_bias, BLOCK_M=bm, BLOCK_N=cfg.block_n_down,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, **launch)
    # fmt: on
    return per_pair.view(t, k, hidden).sum(dim=1)
