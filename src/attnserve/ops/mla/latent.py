"""What the MLA kernels over the paged latent cache share: launch shapes, splits and buffers,
the Triton tile helpers, and the merge of split-KV partials.

A latent row is ``[c_kv ; k_pe]`` (``kv_lora_rank + rope`` wide, 576 for DeepSeek), in the model
dtype or as the 656-byte fp8 rows of ``kvcache/fp8.py`` (e4m3 values times their 128-tile scale,
bf16 rope), dequantised in registers. An absorbed query row ``[W_UK^T q_nope ; q_pe]`` attends
it as a single KV head whose value is the row's first ``kv_lora_rank`` dims. Long contexts are
split over several programs (split-KV), whose partials [rows, heads, splits, L] fp32 with their
lse (log2 units) ``merge_splits`` combines.

Here: ``MLAConfig`` and ``pick_mla_config`` (tiles), ``pick_mla_splits``, ``prepare_latent_launch``
(views, output and partial buffers, grid, constexprs) and ``LatentLaunch.finish``, and the JIT
helpers (query and row loads, the online-softmax tile, the row store) of the dense decode
(``decode_triton.py``, ``decode_triton_tma.py``) and sparse (``sparse_triton.py``) kernels; the
Gluon kernels take the buffers and the merge. Not here: any kernel's main loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnserve import env
from attnserve.kvcache.fp8 import FP8_TILE, mla_fp8_views
from attnserve.ops.launch import compute_dtype, num_sms, pow2
from attnserve.ops.tiles import softmax_step

__all__ = [
    "LOG2E",
    "LatentLaunch",
    "MLAConfig",
    "attend_latent_tile",
    "latent_cache_views",
    "load_absorbed_q",
    "load_latent_rows",
    "merge_splits",
    "pick_mla_config",
    "pick_mla_splits",
    "prepare_latent_launch",
    "store_latent_rows",
]

LOG2E = 1.4426950408889634  # scores are kept in log2 units: exp2 is cheaper


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Launch shape: block_h query heads of one query row per program, block_n keys per tile."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        if self.block_h < 16 or self.block_n < 16:
            raise ValueError(f"tl.dot needs blocks of at least 16, got {self}")


def pick_mla_config(
    num_heads: int,
    dtype: torch.dtype = torch.bfloat16,
    interpret: bool | None = None,
    fp8: bool = False,
    sparse: bool = False,
) -> MLAConfig:
    """One pinned config per shape class (no autotuning; the interpreter takes one config).

    Few heads (16: DeepSeek-V2-Lite, TP8 shards) are memory-bound: 16-row programs, long key
    tiles. Many heads (128) are compute-bound: 64 heads share each key tile. float32 tiles are
    kept small enough for shared memory. The GPU values are the best of ``benchmarks/gpu_mla.py``'s
    sweep on the H200.
    """
    if interpret is None:
        interpret = env.triton_interpret()
    block_h = min(64, pow2(num_heads, 16))
    if interpret:  # few, large programs: the interpreter pays per program and per op
        return MLAConfig(block_h, 64, 4, 1)
    if dtype == torch.float32:
        return MLAConfig(16, 32, 4, 1)
    # measured on the H200 (benchmarks/gpu_mla.py sweep): 16 heads x 64 requests x 16K keys,
    # 404 us with (16, 128, 4, 3) against 527 with (16, 64, 4, 2); 128 heads x 64 x 8K, 883 us
    # with (64, 64, 8, 1) against 924 with (64, 32, 8, 2), and sparse fp8 decode 182 against 311
    if block_h <= 16:  # fp8 rows: 128-key tiles need 277 KB of shared memory to apply the scales
        return MLAConfig(16, 64, 4, 2) if fp8 else MLAConfig(16, 128, 4, 3)
    if block_h >= 64:
        # two stages (cp.async loads of the next 64-key tile, 221 KB of shared memory) take the
        # one-stage kernel's 78 spilled registers to none: 128 heads, 64 x 8K keys 823 -> 674 us,
        # 8 x 32K 437 -> 345 us (H200, 2026-12-03; outputs bit-identical). fp8 rows keep one stage
        # (their scales would not fit), and so does sparse MLA, whose gathered rows gained nothing
        # (batch 32, top-k 2048: 201 against 196 us)
        if fp8 or sparse:
            return MLAConfig(block_h, 64, 8, 1)
        # dense bf16 rows: the same tiles for gathered rows and for 64-row pages by TMA
        # (ops/mla/decode_triton_tma: 235 registers, no spills; H200, 2026-12-03: 64 x 8K keys
        # 683 -> 528 us, 8 x 32K 341 -> 273, 32 x 64K 2557 -> 2127, 1 x 16K 52.6 -> 42.9, 214 ->
        # 277 TFLOP/s, against the gathered rows)
        return MLAConfig(block_h, 64, 8, 2)
    return MLAConfig(block_h, 32, 4, 2)


def pick_mla_splits(
    num_programs: int,
    num_keys: int,
    device: torch.device,
    min_keys: int = 256,
    *,
    one_wave: bool = False,
    max_splits: int = 256,
) -> int:
    """Key splits per program, a power of two (few merge kernels get compiled), each split at
    least ``min_keys`` keys; 1 off CUDA. Memory-bound launches (few heads) aim at about four
    waves of SMs; compute-bound ones (``one_wave``: 64+ heads per program) at one wave, since
    every extra split writes a [heads, L] fp32 partial."""
    if device.type != "cuda" or env.triton_interpret():
        return 1
    programs = max(num_programs, 1)
    want = num_sms(device) // programs if one_wave else triton.cdiv(4 * num_sms(device), programs)
    splits = min(want, num_keys // min_keys, max_splits)
    return 1 if splits < 2 else 1 << (splits.bit_length() - 1)


def latent_cache_views(
    cache: torch.Tensor, kv_lora_rank: int, rope_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(c_kv values, rope, tile scales, is_fp8) typed views of a latent cache, no copies.

    A model-dtype cache [num_blocks, block_size, L + R] gives its two column ranges (scales:
    the cache itself, unused); a uint8 fp8 cache gives e4m3 values, bf16 rope and fp32 scales.
    """
    if cache.dtype != torch.uint8:
        if cache.shape[-1] != kv_lora_rank + rope_dim:
            raise ValueError(f"latent rows of {cache.shape[-1]}, not {kv_lora_rank}+{rope_dim}")
        return cache[..., :kv_lora_rank], cache[..., kv_lora_rank:], cache, False
    values, scales, rope = mla_fp8_views(cache, kv_lora_rank, rope_dim)
    return values, rope, scales, True


# Kernels keep their dense argument lists: one argument per line would triple their length.
# fmt: off
@triton.jit
def load_absorbed_q(q_ptr, row, heads, head_ok, stride_qt, stride_qh, L: tl.constexpr,
                    L_PAD: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr, DT: tl.constexpr):
    """Query row ``row`` of heads [BLOCK_H]: (latent part [BLOCK_H, L_PAD], rope [BLOCK_H, R_PAD])."""
    d = tl.arange(0, L_PAD)
    r = tl.arange(0, R_PAD)
    base = q_ptr + row.to(tl.int64) * stride_qt + heads * stride_qh  # [BLOCK_H]
    q_nope = tl.load(base[:, None] + d[None, :], mask=head_ok[:, None] & (d[None, :] < L), other=0.0)
    q_pe = tl.load(base[:, None] + L + r[None, :], mask=head_ok[:, None] & (r[None, :] < R), other=0.0)
    return q_nope.to(DT), q_pe.to(DT)


@triton.jit
def load_latent_rows(kv_ptr, pe_ptr, sc_ptr, blk, off, valid, s_kvb, s_kvs, s_peb, s_pes, s_scb,
                     s_scs, L: tl.constexpr, L_PAD: tl.constexpr, R: tl.constexpr,
                     R_PAD: tl.constexpr, FP8: tl.constexpr, TILE: tl.constexpr,
                     DT: tl.constexpr):
    """Rows at (block, offset) [BLOCK_N]: c_kv [BLOCK_N, L_PAD] and k_pe [BLOCK_N, R_PAD] in DT.
    Rows that are not ``valid`` read nothing and hold 0 (never NaN from unused slots)."""
    d = tl.arange(0, L_PAD)
    r = tl.arange(0, R_PAD)
    kv_mask = valid[:, None] & (d[None, :] < L)
    kv_rows = kv_ptr + (blk * s_kvb + off * s_kvs)[:, None]
    pe_rows = pe_ptr + (blk * s_peb + off * s_pes)[:, None]
    pe = tl.load(pe_rows + r[None, :], mask=valid[:, None] & (r[None, :] < R), other=0.0)
    kv = tl.load(kv_rows + d[None, :], mask=kv_mask, other=0.0)
    if FP8:  # e4m3 value times its tile's power-of-two scale: exact in bf16 and fp32
        if L == L_PAD and L % TILE == 0:  # one scale load per tile, broadcast over its values
            t = tl.arange(0, L // TILE)
            sc = tl.load(sc_ptr + (blk * s_scb + off * s_scs)[:, None] + t[None, :],
                         mask=valid[:, None], other=0.0)
            kv = tl.reshape(tl.reshape(kv.to(tl.float32), [kv.shape[0], L // TILE, TILE])
                            * sc[:, :, None], [kv.shape[0], L])
        else:
            sc = tl.load(sc_ptr + (blk * s_scb + off * s_scs)[:, None] + (d // TILE)[None, :],
                         mask=kv_mask, other=0.0)
            kv = kv.to(tl.float32) * sc
        pe = pe.to(tl.float32)  # bf16 rope: through fp32, as the interpreter needs
    return kv.to(DT), pe.to(DT)


@triton.jit
def attend_latent_tile(acc, m_i, l_i, q_nope, q_pe, kv, pe, valid, qk_scale,
                       PRECISION: tl.constexpr):
    """Online-softmax update with one key tile; qk_scale includes log2(e)."""
    s = tl.dot(q_nope, tl.trans(kv), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N]
    s = tl.dot(q_pe, tl.trans(pe), s, input_precision=PRECISION)
    p, m_new, l_i, alpha = softmax_step(s, m_i, l_i, valid, qk_scale)
    acc = tl.dot(p.to(kv.dtype), kv, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def store_latent_rows(out_rows, lse_rows, acc, m_i, l_i, head_ok, PARTIAL: tl.constexpr,
                      L: tl.constexpr, L_PAD: tl.constexpr):
    """Normalised rows to ``out_rows`` [BLOCK_H] pointers (0 where no key was seen); PARTIAL
    rows also store their lse (log2 units, -inf when empty) for ``merge_splits``."""
    d = tl.arange(0, L_PAD)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(out_rows[:, None] + d[None, :], o.to(out_rows.dtype.element_ty),
             mask=head_ok[:, None] & (d[None, :] < L))
    if PARTIAL:
        tl.store(lse_rows, tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf")), mask=head_ok)


@triton.jit(do_not_specialize=("num_splits",))
def _merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_heads, num_splits, stride_ot,
                  stride_oh, SPLITS_PAD: tl.constexpr, L: tl.constexpr, L_PAD: tl.constexpr):
    """out[t, h] = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M); 0 when every split is empty."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, L_PAD)
    part = (row.to(tl.int64) * num_heads + head) * num_splits + s  # [SPLITS_PAD]
    lse = tl.load(part_lse_ptr + part, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)  # every split empty: no -inf - -inf
    w = tl.where(lse > float("-inf"), tl.exp2(lse - m), 0.0)
    denom = tl.sum(w, 0)
    o = tl.load(part_out_ptr + part[:, None] * L + d[None, :],
                mask=(w[:, None] > 0.0) & (d[None, :] < L), other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    out = out_ptr + row.to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out + d, o.to(out_ptr.dtype.element_ty), mask=d < L)
# fmt: on


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Combine split-KV partials: part_out [N, H, S, L] fp32, part_lse [N, H, S] (log2) -> out
    [N, H, L] (written in place and returned)."""
    n, heads, splits, width = part_out.shape
    if n:
        # fmt: off
        _merge_kernel[(n, heads)](
            part_out, part_lse, out, heads, splits, out.stride(0), out.stride(1),
            SPLITS_PAD=pow2(splits, 2), L=width, L_PAD=pow2(width, 16), num_warps=4,
        )
        # fmt: on
    return out


@dataclass(frozen=True, slots=True)
class LatentLaunch:
    """What one launch over the latent cache needs besides the kernel's own inputs."""

    out: torch.Tensor  # [N, H, L], the result
    part_out: torch.Tensor  # [N, H, splits, L] fp32 partials (``out`` when not split)
    part_lse: torch.Tensor  # [N, H, splits] fp32 (``out`` when not split)
    cache_args: tuple  # (values, rope, scales, their block and slot strides)
    grid: tuple[int, int, int]  # (rows, head blocks, splits)
    meta: dict  # constexprs and launch options
    num_splits: int
    config: MLAConfig

    def finish(self) -> torch.Tensor:
        if self.num_splits > 1:
            merge_splits(self.part_out, self.part_lse, self.out)
        return self.out


def prepare_latent_launch(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_lora_rank: int,
    num_keys: int,
    out: torch.Tensor | None,
    num_splits: int | None,
    config: MLAConfig | None,
    *,
    sparse: bool = False,
) -> LatentLaunch:
    """Views, output and partial buffers, grid and constexprs of one latent-attention launch
    (dense ``mla_decode`` here, ``sparse`` rows in ``ops/mla/sparse_triton``)."""
    interpret = env.triton_interpret()
    rows, num_heads = q.shape[0], q.shape[1]
    rope_dim = q.shape[2] - kv_lora_rank
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in its last dimension")
    kv, pe, sc, fp8 = latent_cache_views(latent_cache, kv_lora_rank, rope_dim)
    cfg = config or pick_mla_config(num_heads, q.dtype, interpret, fp8, sparse)
    head_blocks = triton.cdiv(num_heads, cfg.block_h)
    if out is None:
        out = q.new_empty(rows, num_heads, kv_lora_rank)
    if num_splits is None:
        if cfg.block_h >= 64:
            # many heads, compute-bound: one wave of programs, splits down to one 64-key tile,
            # at most 32 (benchmarks/gpu_dsa_probe.py micro; H200, 128 heads, bf16): sparse
            # decode of 2,048 keys at batch 1 / 8 / 32 / 64 took 224 / 229 / 261 / 269 us
            # unsplit, 19 / 48 / 144 / 269 at 32 / 8 / 2 / 1 splits; dense batch 1 over 8K
            # keys 726 -> 35 us at 32 splits
            num_splits = pick_mla_splits(rows * head_blocks, num_keys, q.device, min_keys=64,
                                         one_wave=True, max_splits=32)  # fmt: skip
        else:
            # each split writes [heads, L] fp32 partials and reads keys of L + R values: at
            # least 16 keys per head keeps the partials under ~1/8 of the keys' bytes
            num_splits = pick_mla_splits(rows * head_blocks, num_keys, q.device,
                                         min_keys=max(256, 16 * num_heads))  # fmt: skip
    part_out = part_lse = out  # unused unless split
    if num_splits > 1:  # [rows, H, splits, L] partial outputs and their lse
        part_out = q.new_empty(rows, num_heads, num_splits, kv_lora_rank, dtype=torch.float32)
        part_lse = q.new_empty(rows, num_heads, num_splits, dtype=torch.float32)
    dt = compute_dtype(q.dtype, interpret)
    # fmt: off
    meta = dict(
        PAGE=latent_cache.shape[1], L=kv_lora_rank, L_PAD=pow2(kv_lora_rank, 16), R=rope_dim,
        R_PAD=pow2(rope_dim, 16), FP8=fp8, TILE=FP8_TILE, BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n, DT=dt, PRECISION="ieee" if dt == tl.float32 else "tf32",
        SPLIT=num_splits > 1, INTERPRET=interpret, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    # fmt: on
    cache_args = (kv, pe, sc, *kv.stride()[:2], *pe.stride()[:2], *sc.stride()[:2])
    grid = (rows, head_blocks, num_splits)
    return LatentLaunch(out, part_out, part_lse, cache_args, grid, meta, num_splits, cfg)
