"""Triton absorbed ("MQA") MLA decode over the paged latent cache, and the pieces it shares.

``mla_decode`` attends one absorbed query per request, ``[W_UK^T q_nope ; q_pe]`` for every
head (``kv_lora_rank + rope`` wide, 576 for DeepSeek), over the request's latent rows
``[c_kv ; k_pe]``: a single KV head whose value is the first ``kv_lora_rank`` dims of the same
row, so each row is read once for its key and its value. A program owns ``block_h`` query
heads of one request (stacked as the rows of ``tl.dot``, so 128 heads run on tensor cores) and
walks the block table; long contexts are split over several programs (split-KV) whose partial
results ``merge_splits`` combines by log-sum-exp. Rows are read in the model dtype or as the
656-byte fp8 rows of ``kvcache/fp8.py`` (e4m3 values times their 128-tile scale, bf16 rope),
dequantised in registers.

The result is ``u`` [B, H, kv_lora_rank]; ``W_UV`` and ``o_proj`` are the caller's. The jit
helpers below (query and row loads, the online-softmax tile, the row store) are shared with
``ops/triton_mla_sparse.py``. A query row need not be a decode: the TRITON_MLA backend also
runs each token of a short prefill as a row of its own, with its request's block table row and
its causal key count. Not here: long prefills (the backend's expanded PyTorch path), writing
the cache (``backends/torch_mla.write_latent_rows``), the indexer (``ops/triton_indexer.py``). The PyTorch twin is
``attention.reference_mla.mla_decode_absorbed``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnserve import env
from attnserve.kvcache.fp8 import FP8_TILE, mla_fp8_views
from attnserve.ops.triton_mla_tma import mla_decode_tma_kernel, tma_descriptors, tma_fits
from attnserve.ops.triton_softmax import softmax_step

__all__ = [
    "LOG2E",
    "LatentLaunch",
    "MLAConfig",
    "attend_latent_tile",
    "compute_dtype",
    "latent_cache_views",
    "load_absorbed_q",
    "load_latent_rows",
    "merge_splits",
    "mla_decode",
    "num_sms",
    "pick_mla_config",
    "pick_mla_splits",
    "prepare_latent_launch",
    "store_latent_rows",
]

LOG2E = 1.4426950408889634  # scores are kept in log2 units: exp2 is cheaper


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Launch shape: block_h query heads of one query row per program, block_n keys per tile;
    ``tma``: whole-page key tiles by tensor descriptor (``ops/triton_mla_tma``) where the cache
    allows it (dense decode only)."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False

    def __post_init__(self):
        if self.block_h < 16 or self.block_n < 16:
            raise ValueError(f"tl.dot needs blocks of at least 16, got {self}")


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


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
    block_h = min(64, _pow2(num_heads, 16))
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
        # dense bf16 rows in 64-row pages: each tile one TMA load (ops/triton_mla_tma), 235
        # registers, no spills; H200 (2026-12-03): 64 x 8K keys 683 -> 528 us, 8 x 32K 341 -> 273,
        # 32 x 64K 2557 -> 2127, 1 x 16K 52.6 -> 42.9 (214 -> 277 TFLOP/s). Smaller pages take
        # the pointer kernel with the same tiles
        return MLAConfig(block_h, 64, 8, 2, tma=True)
    return MLAConfig(block_h, 32, 4, 2)


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


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


@functools.lru_cache(maxsize=8)
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def _has_tma(device: torch.device) -> bool:
    """Tensor-descriptor loads: Hopper and later, or Triton's interpreter (which emulates them)."""
    if env.triton_interpret():
        return True
    if device.type != "cuda":
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


def compute_dtype(dtype: torch.dtype, interpret: bool):
    """Dtype of tl.dot inputs: q's dtype, or fp32 where the interpreter cannot do bf16."""
    if dtype == torch.float32 or (interpret and dtype == torch.bfloat16):
        return tl.float32
    return tl.float16 if dtype == torch.float16 else tl.bfloat16


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


@triton.jit
def _decode_tile(acc, m_i, l_i, q_nope, q_pe, t, bt_row, seq_len, qk_scale, kv_ptr, pe_ptr,
                 sc_ptr, s_kvb, s_kvs, s_peb, s_pes, s_scb, s_scs, PAGE: tl.constexpr,
                 BLOCK_N: tl.constexpr, L: tl.constexpr, L_PAD: tl.constexpr, R: tl.constexpr,
                 R_PAD: tl.constexpr, FP8: tl.constexpr, TILE: tl.constexpr, DT: tl.constexpr,
                 PRECISION: tl.constexpr):
    k_pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = k_pos < seq_len
    blk = tl.load(bt_row + k_pos // PAGE, mask=valid, other=0).to(tl.int64)
    kv, pe = load_latent_rows(kv_ptr, pe_ptr, sc_ptr, blk, k_pos % PAGE, valid, s_kvb, s_kvs,
                              s_peb, s_pes, s_scb, s_scs, L, L_PAD, R, R_PAD, FP8, TILE, DT)
    return attend_latent_tile(acc, m_i, l_i, q_nope, q_pe, kv, pe, valid, qk_scale, PRECISION)


@triton.jit(do_not_specialize=("num_splits", "stride_bt"),  # per step: no variant per class
            do_not_specialize_on_alignment=("bt_ptr", "seq_lens_ptr"))
def _mla_decode_kernel(q_ptr, kv_ptr, pe_ptr, sc_ptr, out_ptr, part_out_ptr, part_lse_ptr, bt_ptr,
                       seq_lens_ptr, qk_scale, num_heads, num_splits, stride_qt, stride_qh,
                       stride_ot, stride_oh, stride_bt, s_kvb, s_kvs, s_peb, s_pes, s_scb, s_scs,
                       PAGE: tl.constexpr, L: tl.constexpr, L_PAD: tl.constexpr, R: tl.constexpr,
                       R_PAD: tl.constexpr, FP8: tl.constexpr, TILE: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr,
                       PRECISION: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    seq = tl.program_id(0)
    split = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    seq_len = tl.load(seq_lens_ptr + seq)
    q_nope, q_pe = load_absorbed_q(q_ptr, seq, heads, head_ok, stride_qt, stride_qh, L, L_PAD, R,
                                   R_PAD, DT)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(num_tiles, num_splits)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, num_tiles)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_H], -1e30, dtype=tl.float32)  # finite: no inf - inf
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, L_PAD], dtype=tl.float32)
    if INTERPRET:  # the interpreter's range() cannot take a loaded bound
        t = lo
        while t < hi:
            acc, m_i, l_i = _decode_tile(
                acc, m_i, l_i, q_nope, q_pe, t, bt_row, seq_len, qk_scale, kv_ptr, pe_ptr, sc_ptr,
                s_kvb, s_kvs, s_peb, s_pes, s_scb, s_scs, PAGE, BLOCK_N, L, L_PAD, R, R_PAD, FP8,
                TILE, DT, PRECISION)
            t += 1
    else:
        for t in range(lo, hi):
            acc, m_i, l_i = _decode_tile(
                acc, m_i, l_i, q_nope, q_pe, t, bt_row, seq_len, qk_scale, kv_ptr, pe_ptr, sc_ptr,
                s_kvb, s_kvs, s_peb, s_pes, s_scb, s_scs, PAGE, BLOCK_N, L, L_PAD, R, R_PAD, FP8,
                TILE, DT, PRECISION)
    if SPLIT:  # partial rows [seq, head, split], merged by _merge_kernel
        row = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
        store_latent_rows(part_out_ptr + row * L, part_lse_ptr + row, acc, m_i, l_i, head_ok,
                          True, L, L_PAD)
    else:
        out_rows = out_ptr + seq.to(tl.int64) * stride_ot + heads * stride_oh
        store_latent_rows(out_rows, part_lse_ptr, acc, m_i, l_i, head_ok, False, L, L_PAD)


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
            SPLITS_PAD=_pow2(splits, 2), L=width, L_PAD=_pow2(width, 16), num_warps=4,
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
    (dense ``mla_decode`` here, ``sparse`` rows in ``ops/triton_mla_sparse``)."""
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
        PAGE=latent_cache.shape[1], L=kv_lora_rank, L_PAD=_pow2(kv_lora_rank, 16), R=rope_dim,
        R_PAD=_pow2(rope_dim, 16), FP8=fp8, TILE=FP8_TILE, BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n, DT=dt, PRECISION="ieee" if dt == tl.float32 else "tf32",
        SPLIT=num_splits > 1, INTERPRET=interpret, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    # fmt: on
    cache_args = (kv, pe, sc, *kv.stride()[:2], *pe.stride()[:2], *sc.stride()[:2])
    grid = (rows, head_blocks, num_splits)
    return LatentLaunch(out, part_out, part_lse, cache_args, grid, meta, num_splits, cfg)


def mla_decode(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: MLAConfig | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode: one query row per request over all its cached latent rows.

    Args:
        q: [B, H, L + R] absorbed queries ``[W_UK^T q_nope ; q_pe]``, last dim contiguous.
        latent_cache: [num_blocks, block_size, L + R] in a float dtype, or uint8 fp8 rows
            (``kvcache/fp8.py``); block 0 is the null block.
        block_table: [B, max_blocks] int32; seq_lens: [B] int32 keys of each request (0: the
            row's output is 0).
        kv_lora_rank: L; scale: softmax scale (pass it explicitly, e.g. 0.1352 for V3).
        max_seq_len: host-side bound of ``seq_lens`` (no device sync is made).
        out: [B, H, L] written in place; default a new tensor in q's dtype.
        num_splits: key splits per (request, head block); default ``pick_mla_splits``.
        config: launch shape; default ``pick_mla_config``.
    Returns:
        ``out``: u = softmax(scale * q . rows) @ c_kv per head (apply W_UV for the values).
    """
    launch = prepare_latent_launch(
        q, latent_cache, kv_lora_rank, max_seq_len, out, num_splits, config
    )
    if q.shape[0] == 0:
        return launch.out
    o = launch.out
    cfg = launch.config
    if cfg.tma and _has_tma(q.device) and tma_fits(latent_cache, kv_lora_rank, cfg.block_n):
        meta = {k: launch.meta[k] for k in ("PAGE", "L", "R", "BLOCK_H", "BLOCK_N", "DT",
                                            "PRECISION", "SPLIT", "INTERPRET", "num_warps",
                                            "num_stages")}  # fmt: skip
        rows = latent_cache.view(-1, latent_cache.shape[-1])
        # fmt: off
        mla_decode_tma_kernel[launch.grid](
            q, *tma_descriptors(latent_cache, kv_lora_rank, cfg.block_n), rows, o,
            launch.part_out, launch.part_lse, block_table, seq_lens, scale * LOG2E, q.shape[1],
            launch.num_splits, q.stride(0), q.stride(1), o.stride(0), o.stride(1),
            block_table.stride(0), rows.stride(0), **meta,
        )
        # fmt: on
        return launch.finish()
    # fmt: off
    _mla_decode_kernel[launch.grid](
        q, *launch.cache_args[:3], o, launch.part_out, launch.part_lse, block_table, seq_lens,
        scale * LOG2E, q.shape[1], launch.num_splits, q.stride(0), q.stride(1), o.stride(0),
        o.stride(1), block_table.stride(0), *launch.cache_args[3:], **launch.meta,
    )
    # fmt: on
    return launch.finish()
