"""Triton kernels of DSA (DeepSeek-V3.2, GLM-5): sparse MLA over top-k rows, and the indexer.

- ``sparse_mla``: absorbed MLA of each query row (a decode or a prefill token) over only its
  selected latent rows. Indices are absolute positions of the row's request, mapped to cache
  slots through the block table inside the kernel; -1 slots (and positions at or past the
  request's length) are skipped, and a row with none gets 0. The tiles, fp8 dequantisation and
  split-KV merge are ``ops/triton_mla.py``'s.
- ``indexer_logits``: the lightning indexer's scores ``I[t, s] = sum_h w[t, h] *
  relu(c * q[t, h] . k[s])`` over the paged indexer cache, in one kernel: a program stacks
  ``block_t`` tokens x all indexer heads as the rows of one ``tl.dot`` against a tile of keys,
  reduces over heads and writes -inf where ``s > pos(t)`` or ``s >= seq_len``. Keys are read in
  the model dtype or as the 132-byte fp8 rows (e4m3 values, then the fp32 scale applied per key).
- ``lightning_indexer_topk``: prepares the head weights (and, for an fp8 cache, the Hadamard
  rotation and per-(token, head) fp8 quantisation of q, in PyTorch), runs ``indexer_logits``
  and keeps the best ``topk`` per row: decode rows with ``ops/triton_topk.topk_rows`` (radix
  select reading each row only up to its length, so a CUDA graph's ``max_model_len`` columns
  cost nothing past it), prefill rows with ``torch.topk`` (faster over many full-width rows:
  H200, 512 rows of 32K, 260 us against 470); unused slots are -1. When no row can see more
  than ``topk`` keys, every visible key is selected and nothing is scored.

Not here: writing the caches (``backends/torch_mla_sparse``), projections and RoPE. The
PyTorch twins are ``attention.reference_mla.sparse_mla_attention`` and ``indexer_topk``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnserve import env
from attnserve.kvcache.fp8 import hadamard, indexer_fp8_views, quantize_act_fp8
from attnserve.ops.triton_mla import (
    LOG2E,
    MLAConfig,
    attend_latent_tile,
    compute_dtype,
    load_absorbed_q,
    load_latent_rows,
    num_sms,
    prepare_latent_launch,
    store_latent_rows,
)
from attnserve.ops.triton_topk import topk_rows

__all__ = [
    "IndexerConfig",
    "indexer_logits",
    "lightning_indexer_topk",
    "pick_indexer_config",
    "sparse_mla",
    "topk_from_logits",
]


@dataclass(frozen=True, slots=True)
class IndexerConfig:
    """Launch shape of ``indexer_logits``: block_t tokens x padded heads rows, block_s keys."""

    block_t: int
    block_s: int
    num_warps: int
    num_stages: int
    key_tiles: int | None = None  # key tiles per program (q is loaded once); None: by size


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def pick_indexer_config(
    num_heads: int,
    max_query_len: int,
    dtype: torch.dtype = torch.bfloat16,
    interpret: bool | None = None,
) -> IndexerConfig:
    """Decode (one token per request): one token per program. Prefill: tokens of one request
    share each key tile, 128 rows per ``tl.dot`` (64 under the interpreter). float32 tiles are
    kept small enough for shared memory. GPU values are first guesses, to be checked with
    ``benchmarks/gpu_mla.py`` (its sweep)."""
    if interpret is None:
        interpret = env.triton_interpret()
    heads_pad = _pow2(num_heads, 16)
    small = interpret or dtype == torch.float32
    if max_query_len == 1:
        return IndexerConfig(1, 64 if small else 128, 4, 1 if interpret else 2 if small else 3)
    block_t = max(1, (64 if small else 128) // heads_pad)
    block_t = min(block_t, _pow2(max_query_len))
    return IndexerConfig(block_t, 64, 4 if small else 8, 1 if interpret else 2)


# fmt: off
@triton.jit
def _sparse_tile(acc, m_i, l_i, q_nope, q_pe, t, idx_row, num_idx, bt_row, seq_len, qk_scale,
                 kv_ptr, pe_ptr, sc_ptr, s_kvb, s_kvs, s_peb, s_pes, s_scb, s_scs,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, L: tl.constexpr, L_PAD: tl.constexpr,
                 R: tl.constexpr, R_PAD: tl.constexpr, FP8: tl.constexpr, TILE: tl.constexpr,
                 DT: tl.constexpr, PRECISION: tl.constexpr):
    kk = t * BLOCK_N + tl.arange(0, BLOCK_N)
    pos = tl.load(idx_row + kk, mask=kk < num_idx, other=-1)
    valid = (pos >= 0) & (pos < seq_len)
    blk = tl.load(bt_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
    kv, pe = load_latent_rows(kv_ptr, pe_ptr, sc_ptr, blk, pos % PAGE, valid, s_kvb, s_kvs,
                              s_peb, s_pes, s_scb, s_scs, L, L_PAD, R, R_PAD, FP8, TILE, DT)
    return attend_latent_tile(acc, m_i, l_i, q_nope, q_pe, kv, pe, valid, qk_scale, PRECISION)


@triton.jit(do_not_specialize=("num_splits", "num_idx", "stride_bt"),  # per step
            do_not_specialize_on_alignment=("bt_ptr", "seq_lens_ptr", "req_ptr"))
def _sparse_mla_kernel(q_ptr, kv_ptr, pe_ptr, sc_ptr, out_ptr, part_out_ptr, part_lse_ptr, bt_ptr,
                       seq_lens_ptr, idx_ptr, req_ptr, qk_scale, num_heads, num_splits, num_idx,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_it, s_kvb,
                       s_kvs, s_peb, s_pes, s_scb, s_scs, PAGE: tl.constexpr, L: tl.constexpr,
                       L_PAD: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
                       FP8: tl.constexpr, TILE: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_N: tl.constexpr, DT: tl.constexpr, PRECISION: tl.constexpr,
                       SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    seq = tl.load(req_ptr + row).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_nope, q_pe = load_absorbed_q(q_ptr, row, heads, head_ok, stride_qt, stride_qh, L, L_PAD, R,
                                   R_PAD, DT)
    per_split = tl.cdiv(tl.cdiv(num_idx, BLOCK_N), num_splits)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, tl.cdiv(num_idx, BLOCK_N))
    idx_row = idx_ptr + row.to(tl.int64) * stride_it
    bt_row = bt_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_H], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, L_PAD], dtype=tl.float32)
    if INTERPRET:  # the interpreter's range() cannot take a loaded bound
        t = lo
        while t < hi:
            acc, m_i, l_i = _sparse_tile(
                acc, m_i, l_i, q_nope, q_pe, t, idx_row, num_idx, bt_row, seq_len, qk_scale,
                kv_ptr, pe_ptr, sc_ptr, s_kvb, s_kvs, s_peb, s_pes, s_scb, s_scs, PAGE, BLOCK_N,
                L, L_PAD, R, R_PAD, FP8, TILE, DT, PRECISION)
            t += 1
    else:
        for t in range(lo, hi):
            acc, m_i, l_i = _sparse_tile(
                acc, m_i, l_i, q_nope, q_pe, t, idx_row, num_idx, bt_row, seq_len, qk_scale,
                kv_ptr, pe_ptr, sc_ptr, s_kvb, s_kvs, s_peb, s_pes, s_scb, s_scs, PAGE, BLOCK_N,
                L, L_PAD, R, R_PAD, FP8, TILE, DT, PRECISION)
    if SPLIT:
        part = (row.to(tl.int64) * num_heads + heads) * num_splits + split
        store_latent_rows(part_out_ptr + part * L, part_lse_ptr + part, acc, m_i, l_i, head_ok,
                          True, L, L_PAD)
    else:
        out_rows = out_ptr + row.to(tl.int64) * stride_ot + heads * stride_oh
        store_latent_rows(out_rows, part_lse_ptr, acc, m_i, l_i, head_ok, False, L, L_PAD)


@triton.jit
def _find_seq(qsl_ptr, num_seqs, q_block_id, BLOCK_T: tl.constexpr):
    """Largest request i whose first token block id (qsl[i] // BLOCK_T + i) is <= q_block_id."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_T + mid
        if first <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _indexer_tile(q, w, key_tile, q_pos, tok, tok_ok, q_start, seq_len, width, bt_row, k_ptr,
                  ks_ptr, out_ptr, dot_scale, stride_ot, s_kb, s_ks, s_sb, s_ss,
                  H_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, FP8: tl.constexpr,
                  DT: tl.constexpr, PRECISION: tl.constexpr, FILL_HIDDEN: tl.constexpr):
    """Scores of BLOCK_T tokens over key tile ``key_tile``, stored (-inf where not visible);
    a tile no token sees is stored as -inf only when FILL_HIDDEN."""
    s_pos = key_tile * BLOCK_S + tl.arange(0, BLOCK_S)
    visible = (s_pos[None, :] <= q_pos[:, None]) & (s_pos[None, :] < seq_len)  # [BLOCK_T, BLOCK_S]
    logits = tl.full([BLOCK_T, BLOCK_S], float("-inf"), dtype=tl.float32)
    seen = key_tile * BLOCK_S <= tl.minimum(tl.max(q_pos, 0), seq_len - 1)  # some key is visible
    if seen:
        d = tl.arange(0, D_PAD)
        key_ok = s_pos < seq_len
        blk = tl.load(bt_row + s_pos // PAGE, mask=key_ok, other=0).to(tl.int64)
        k_off = blk * s_kb + (s_pos % PAGE) * s_ks
        k = tl.load(k_ptr + k_off[:, None] + d[None, :],
                    mask=key_ok[:, None] & (d[None, :] < D), other=0.0).to(DT)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_T * H_PAD, BLOCK_S]
        s = tl.maximum(s * dot_scale, 0.0) * w[:, None]
        total = tl.sum(tl.reshape(s, [BLOCK_T, H_PAD, BLOCK_S]), 1)  # [BLOCK_T, BLOCK_S]
        if FP8:  # the key's scale, after the sum over heads (DeepSeek's fp8_index order)
            k_scale = tl.load(ks_ptr + blk * s_sb + (s_pos % PAGE) * s_ss, mask=key_ok, other=0.0)
            total = total * k_scale[None, :]
        logits = tl.where(visible, total, float("-inf"))
    out = out_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_ot + s_pos[None, :]
    keep = tok_ok[:, None] & (s_pos[None, :] < width)
    if not FILL_HIDDEN:
        keep = keep & seen
    tl.store(out, logits, mask=keep)


@triton.jit(do_not_specialize=("num_seqs", "width", "stride_bt"),  # per step
            do_not_specialize_on_alignment=("bt_ptr", "qsl_ptr", "seq_lens_ptr", "pos_ptr"))
def _indexer_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, out_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, pos_ptr,
                    dot_scale, num_seqs, width, stride_qt, stride_qh, stride_wt, stride_ot,
                    stride_bt, s_kb, s_ks, s_sb, s_ss, H: tl.constexpr, H_PAD: tl.constexpr,
                    D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, KEY_TILES: tl.constexpr,
                    FP8: tl.constexpr, DT: tl.constexpr, PRECISION: tl.constexpr,
                    DECODE_ONLY: tl.constexpr, FILL_HIDDEN: tl.constexpr):
    q_block_id = tl.program_id(0)
    if DECODE_ONLY:  # one token per request: program i is request i
        seq = q_block_id
        q_block = 0
    else:
        seq = _find_seq(qsl_ptr, num_seqs, q_block_id, BLOCK_T)
        q_block = q_block_id - (tl.load(qsl_ptr + seq) // BLOCK_T + seq)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_block * BLOCK_T >= q_len:  # spare program
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    if not FILL_HIDDEN and tl.program_id(1) * BLOCK_S >= seq_len:  # its first tile is past the keys
        return
    tok = q_block * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] within the request
    tok_ok = tok < q_len
    q_pos = tl.load(pos_ptr + q_start + tok, mask=tok_ok, other=-1)
    # the query block, loaded once for KEY_TILES key tiles: row = token * H_PAD + head
    rows = tl.arange(0, BLOCK_T * H_PAD)
    head = rows % H_PAD
    row_ok = (q_block * BLOCK_T + rows // H_PAD < q_len) & (head < H)
    r_tok = (q_start + q_block * BLOCK_T + rows // H_PAD).to(tl.int64)
    d = tl.arange(0, D_PAD)
    q = tl.load(q_ptr + (r_tok * stride_qt + head * stride_qh)[:, None] + d[None, :],
                mask=row_ok[:, None] & (d[None, :] < D), other=0.0).to(DT)
    w = tl.load(w_ptr + r_tok * stride_wt + head, mask=row_ok, other=0.0)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for j in range(KEY_TILES):  # strided, so a short sequence in a wide grid spreads over programs
        _indexer_tile(q, w, tl.program_id(1) + j * tl.num_programs(1), q_pos, tok, tok_ok, q_start,
                      seq_len, width, bt_row, k_ptr, ks_ptr, out_ptr, dot_scale, stride_ot, s_kb,
                      s_ks, s_sb, s_ss, H_PAD, D, D_PAD, PAGE, BLOCK_T, BLOCK_S, FP8, DT,
                      PRECISION, FILL_HIDDEN)
# fmt: on


def sparse_mla(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    topk_indices: torch.Tensor,
    token_req: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: MLAConfig | None = None,
) -> torch.Tensor:
    """Absorbed MLA of each query row over its selected latent rows (FlashMLA sparse contract).

    Args:
        q: [T, H, L + R] absorbed queries ``[W_UK^T q_nope ; q_pe]`` (decode or prefill rows).
        latent_cache: model-dtype or fp8 latent cache, block 0 null (see ``mla_decode``).
        block_table: [B, max_blocks] int32; seq_lens: [B] int32.
        topk_indices: [T, K] int32 absolute positions of row t's request; -1 marks an unused
            slot, and positions >= the request's length are skipped too.
        token_req: [T] int32 or int64, the request (row of ``block_table``) of each query row.
        kv_lora_rank: L; scale: the softmax scale (the dense MLA one).
        out: [T, H, L], written in place; default new, in q's dtype.
        num_splits: splits of the K indices per row; default ``pick_mla_splits``.
        config: launch shape; default ``pick_mla_config``.
    Returns:
        ``out``: u per row and head; 0 for a row whose slots are all unused.
    """
    num_idx = topk_indices.shape[1]
    launch = prepare_latent_launch(q, latent_cache, kv_lora_rank, num_idx, out, num_splits, config,
                                   sparse=True)
    if q.shape[0] == 0 or num_idx == 0:
        return launch.out.zero_()
    o = launch.out
    # fmt: off
    _sparse_mla_kernel[launch.grid](
        q, *launch.cache_args[:3], o, launch.part_out, launch.part_lse, block_table, seq_lens,
        topk_indices, token_req, scale * LOG2E, q.shape[1], launch.num_splits, num_idx,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), block_table.stride(0),
        topk_indices.stride(0), *launch.cache_args[3:], **launch.meta,
    )
    # fmt: on
    return launch.finish()


def indexer_logits(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    *,
    width: int,
    max_query_len: int,
    dot_scale: float,
    config: IndexerConfig | None = None,
    fill_hidden: bool = True,
) -> torch.Tensor:
    """Index scores ``I[t, s] = sum_h head_weights[t, h] * relu(dot_scale * q[t, h] . k[s])``
    (times the key's scale for an fp8 cache), -inf where ``s > pos(t)`` or ``s >= seq_len``.

    Args:
        q: [T, H, D] queries: model dtype over a model-dtype cache; e4m3 values (any float
            dtype, float8_e4m3fn included) of the rotated queries over an fp8 cache.
        head_weights: [T, H] float32, every scaling but ``dot_scale`` folded in.
        index_cache: [num_blocks, block_size, D] float, or uint8 [.., D + 4] fp8 rows.
        block_table: [B, max_blocks] int32; query_start_loc: [B + 1] int32 (request i owns
            rows ``qsl[i]:qsl[i+1]``); seq_lens: [B] int32; positions: [T] int64.
        width: columns of the result (>= every visible key); max_query_len: host bound.
        dot_scale: multiplies q . k before the ReLU (D^-0.5 exact, 1 for fp8).
        config: launch shape; default ``pick_indexer_config``.
        fill_hidden: write -inf over key tiles no token of a block sees (past a sequence's
            length or every token's position); False leaves them unwritten, for a reader that
            stops at each row's visible length (``topk_rows``), which saves the writes of a
            width much larger than the sequences (a CUDA graph's ``max_model_len``).
    Returns:
        [T, width] float32 logits.
    """
    interpret = env.triton_interpret()
    num_tokens, heads, dim = q.shape
    num_seqs = seq_lens.shape[0]
    fp8 = index_cache.dtype == torch.uint8
    keys, k_scale = indexer_fp8_views(index_cache) if fp8 else (index_cache, index_cache)
    cfg = config or pick_indexer_config(heads, max_query_len, q.dtype, interpret)
    out = torch.empty(num_tokens, width, dtype=torch.float32, device=q.device)
    if num_tokens == 0 or width == 0:
        return out
    decode_only = max_query_len == 1
    num_q_blocks = num_seqs if decode_only else num_tokens // cfg.block_t + num_seqs
    total_tiles = triton.cdiv(width, cfg.block_s)
    key_tiles = cfg.key_tiles or _key_tiles(num_q_blocks, total_tiles, q.device, interpret)
    if fp8:  # e4m3 values are exact in fp16 (a native conversion, unlike bf16): products exact, sums fp32
        dt = tl.float32 if interpret else tl.float16
    else:
        dt = compute_dtype(q.dtype, interpret)
    ks_strides = k_scale.stride()[:2]
    # fmt: off
    _indexer_kernel[(num_q_blocks, triton.cdiv(total_tiles, key_tiles))](
        q, head_weights, keys, k_scale, out, block_table, query_start_loc, seq_lens, positions,
        dot_scale, num_seqs, width, q.stride(0), q.stride(1), head_weights.stride(0),
        out.stride(0), block_table.stride(0), *keys.stride()[:2], *ks_strides,
        H=heads, H_PAD=_pow2(heads, max(1, 16 // cfg.block_t)), D=dim, D_PAD=_pow2(dim, 16),
        PAGE=index_cache.shape[1], BLOCK_T=cfg.block_t, BLOCK_S=cfg.block_s,
        KEY_TILES=key_tiles, FP8=fp8, DT=dt, PRECISION="ieee" if dt == tl.float32 else "tf32",
        DECODE_ONLY=decode_only, FILL_HIDDEN=fill_hidden, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    # fmt: on
    return out


def _key_tiles(num_q_blocks: int, total_tiles: int, device: torch.device, interpret: bool) -> int:
    """Key tiles per program: as many as keep about four waves of programs on the GPU (at
    most 16, a power of two); under the interpreter up to 4 (fewer, larger programs)."""
    if interpret or device.type != "cuda":
        return max(1, min(4, total_tiles))
    per_program = num_q_blocks * total_tiles // (4 * num_sms(device))
    tiles = max(1, min(16, per_program))
    return 1 << (tiles.bit_length() - 1)


def topk_from_logits(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """[T, S] logits (-inf: not visible) -> [T, topk] int32 best positions, -1 past the valid."""
    k = min(topk, logits.shape[-1])
    best, idx = logits.topk(k, dim=-1)
    idx = torch.where(torch.isneginf(best), -1, idx).to(torch.int32)
    if k == topk:
        return idx
    return torch.cat([idx, idx.new_full((idx.shape[0], topk - k), -1)], dim=-1)


def lightning_indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    *,
    topk: int,
    max_query_len: int,
    max_seq_len: int,
    config: IndexerConfig | None = None,
) -> torch.Tensor:
    """The DSA indexer step: the ``topk`` best visible keys of every query token.

    Args:
        q: [T, H, D] indexer queries after RoPE (un-rotated), model dtype.
        weights: [T, H] raw ``weights_proj(x)``.
        index_cache: model-dtype cache (exact scores, transformers' formula) or uint8 fp8 rows
            (DeepSeek's fp8 scores: q is rotated and quantised per (token, head) here).
        block_table, query_start_loc, seq_lens, positions: as in ``indexer_logits``; every
            position must be below its request's length.
        topk: output width; max_query_len, max_seq_len: host-side bounds. ``max_query_len``
            1 means a decode batch: row i is request i's one token.
        config: launch shape of the logits kernel.
    Returns:
        [T, topk] int32 absolute positions, -1 in unused slots; a set: decode rows come in
        increasing order (``topk_rows``), prefill rows best first (``torch.topk``); when
        ``max_seq_len <= topk`` every visible key is selected without scoring. No host
        synchronisation: a decode batch can be captured in a CUDA graph.
    """
    if max_seq_len <= topk:  # every visible key makes the cut: no scores needed
        cols = torch.arange(topk, device=q.device)
        return torch.where(cols[None, :] <= positions[:, None], cols, -1).to(torch.int32)
    heads, dim = q.shape[1], q.shape[2]
    if index_cache.dtype == torch.uint8:
        q8, q_scale = quantize_act_fp8(hadamard(q))  # [T, H, D] e4m3 values, [T, H]
        q_in = q8.to(torch.float8_e4m3fn)
        head_weights = weights.float() * heads**-0.5 * q_scale * dim**-0.5
        dot_scale = 1.0
    else:
        q_in, head_weights, dot_scale = q, weights.float() * heads**-0.5, dim**-0.5
    decode = max_query_len == 1
    # fmt: off
    logits = indexer_logits(
        q_in, head_weights.contiguous(), index_cache, block_table, query_start_loc, seq_lens,
        positions, width=max_seq_len, max_query_len=max_query_len, dot_scale=dot_scale,
        config=config, fill_hidden=not decode,
    )
    # fmt: on
    if not decode:  # many full-width rows: torch.topk's multi-block select is faster there
        return topk_from_logits(logits, topk)
    # decode rows read only up to their own length (a CUDA graph's width is max_model_len);
    # one request per row, and a decode token is its request's last position
    return topk_rows(logits, torch.minimum(positions + 1, seq_lens.to(positions.dtype)), topk)
