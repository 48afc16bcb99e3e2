"""Triton kernels of DSA's lightning indexer (DeepSeek-V3.2, GLM-5): index scores and top-k.

- ``indexer_logits``: ``I[t, s] = sum_h w[t, h] * relu(c * q[t, h] . k[s])`` over the paged
  indexer cache, -inf where ``s > pos(t)`` or ``s >= seq_len``. Keys are read in the model
  dtype or as the 132-byte fp8 rows (e4m3 values, then the fp32 scale applied per key, after
  the sum over heads). Two kernels:
  - tiled (prefill, any batch): a program stacks ``block_t`` tokens x all heads as the rows of
    one ``tl.dot`` against a tile of keys and reduces over heads;
  - streaming (decode: one token per request): a program owns a contiguous chunk of one
    request's key tiles and loops over them with nothing but masks around the loads, so
    Triton's pipeliner overlaps the next tiles' loads with this tile's dot. Keys are the dot's
    rows ([block_s, D] x [D, heads]) and the head-weighted sum is a row reduction; on a GPU
    fp8 keys go to the tensor cores as e4m3 (``IndexerConfig.fp8_dot``). On Hopper, fp8
    decode has a Gluon twin with the same call (``ops/indexer/logits_gluon``, whole pages by
    16-byte cp.async); which one runs is the kernel table's choice (``attention/kernels.py``).
- ``lightning_indexer_topk``: prepares the head weights (and, for an fp8 cache, the Hadamard
  rotation and per-(token, head) fp8 quantisation of q, in PyTorch), runs the given logits
  launch (``indexer_logits`` by default) and keeps the best ``topk`` per row: decode rows with
  the given select (``ops/indexer/topk_triton.topk_rows`` by default: radix select reading each
  row only up to its length, so a CUDA graph's ``max_model_len`` columns cost nothing past it),
  prefill rows with ``torch.topk`` (faster over many full-width rows: H200, 512 rows of 32K,
  260 us against 470); unused slots are -1. When no row can see more than ``topk`` keys, every
  visible key is selected and nothing is scored.

Not here: writing the cache (``backends/torch_mla_sparse``), the projections and RoPE. The
PyTorch twin is ``attention.reference_mla.indexer_topk``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnserve import env
from attnserve.kvcache.fp8 import hadamard, indexer_fp8_views, quantize_act_fp8
from attnserve.ops.indexer.topk_triton import topk_rows
from attnserve.ops.launch import compute_dtype, num_sms, pow2

__all__ = [
    "IndexerConfig",
    "indexer_logits",
    "lightning_indexer_topk",
    "pick_indexer_config",
    "row_align",
    "topk_from_logits",
]

MIN_TILES = 2  # streaming kernel: least key tiles per program (q is loaded once per program)


@dataclass(frozen=True, slots=True)
class IndexerConfig:
    """Launch shape of ``indexer_logits``.

    Tiled kernel: ``block_t`` tokens x padded heads rows against ``block_s`` keys per dot,
    ``key_tiles`` tiles per program (None: by size). Streaming kernel (``stream``, decode
    batches only; ``block_t`` 1): ``block_s`` keys per dot, about ``waves`` x SMs programs
    (each request's visible tiles split evenly over its programs, at least ``MIN_TILES``
    each); ``fp8_dot``: e4m3 keys and queries straight into the dot on a GPU (wgmma e4m3:
    products exact, but Hopper's fp8 accumulation keeps fewer bits than fp32, about 14 by the
    DeepSeek-V3 report), else converted to fp16 first (fp32 sums), in either kernel.
    """

    block_t: int
    block_s: int
    num_warps: int
    num_stages: int
    key_tiles: int | None = None
    stream: bool = False
    waves: int = 4
    fp8_dot: bool = True

    def __post_init__(self):
        if self.block_s < 16 or self.block_s & (self.block_s - 1):
            raise ValueError(f"block_s must be a power of two >= 16, got {self.block_s}")
        if self.stream and self.block_t != 1:
            raise ValueError(f"the streaming kernel takes block_t 1, got {self.block_t}")
        if self.waves < 1:
            raise ValueError(f"waves must be >= 1, got {self.waves}")


STREAM_MIN_SEQS_BF16 = 8  # decode batches with fewer requests take the tiled kernel (bf16 keys)


def pick_indexer_config(
    num_heads: int,
    max_query_len: int,
    dtype: torch.dtype = torch.bfloat16,
    interpret: bool | None = None,
    *,
    fp8: bool = True,
    num_seqs: int | None = None,
) -> IndexerConfig:
    """Decode (one token per request): the streaming kernel, 64 keys per dot (float32: 32),
    five stages; bf16 keys of fewer than ``STREAM_MIN_SEQS_BF16`` requests take the tiled one. The block-table load and the key load it addresses are a two-level chain, over
    which Triton's pipeliner splits ``num_stages - 1``: five keep two key tiles in flight (three
    and four keep one). H200, 64 x 128 heads, sm_90 compile: 72 registers and 34 KB of shared
    memory (fp8 rows), 78 and 66 KB (bf16). Prefill: tokens of one request share each key tile,
    128 rows per ``tl.dot`` (64 under the interpreter). GPU values are first guesses, to be
    checked with ``benchmarks/gpu_mla.py`` (its sweep)."""
    if interpret is None:
        interpret = env.triton_interpret()
    heads_pad = pow2(num_heads, 16)
    small = interpret or dtype == torch.float32
    if max_query_len == 1:
        if interpret:
            return IndexerConfig(1, 64, 4, 1, stream=True)
        if not fp8 and not small and num_seqs is not None and num_seqs < STREAM_MIN_SEQS_BF16:
            # H200 (gpu_mla.py, 2026-12-03): bf16 keys at batch 1 the tiled kernel is ahead
            # (8K-128K: 6.0 / 7.7 / 10.9 / 18.5 us against 6.4 / 7.9 / 13.3 / 19.5), at batch 32
            # the streaming one (32.8 / 114 / 213 / 391 against 32.5 / 107 / 199 / 377); fp8
            # keys stream at every batch (batch 1, 128K: 54.1 -> 14.1 us). Batches of 2-31 are
            # not measured; 8 is a guess between
            return IndexerConfig(1, 128, 4, 3)
        return IndexerConfig(1, 32 if small else 64, 4, 5, stream=True)
    block_t = max(1, (64 if small else 128) // heads_pad)
    block_t = min(block_t, pow2(max_query_len))
    return IndexerConfig(block_t, 64, 4 if small else 8, 1 if interpret else 2, fp8_dot=False)


# fmt: off
@triton.jit
def _load_keys(k_ptr, blk, s_pos, key_ok, s_kb, s_ks, D: tl.constexpr, D_PAD: tl.constexpr,
               PAGE: tl.constexpr, ALIGN: tl.constexpr):
    """[BLOCK_S, D_PAD] keys at positions ``s_pos`` of blocks ``blk`` (0 where not key_ok).
    Rows start at multiples of ALIGN elements (132-byte fp8 rows: 4), which lets the loads be
    vectorised (unknown, the compiler reads fp8 rows a byte at a time)."""
    row = tl.multiple_of(blk * s_kb + (s_pos % PAGE) * s_ks, ALIGN)
    d = tl.arange(0, D_PAD)
    return tl.load(k_ptr + row[:, None] + d[None, :],
                   mask=key_ok[:, None] & (d[None, :] < D), other=0.0)


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
                  BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, ALIGN: tl.constexpr,
                  FP8: tl.constexpr, DT: tl.constexpr, PRECISION: tl.constexpr,
                  FILL_HIDDEN: tl.constexpr):
    """Scores of BLOCK_T tokens over key tile ``key_tile``, stored (-inf where not visible);
    a tile no token sees is stored as -inf only when FILL_HIDDEN."""
    s_pos = key_tile * BLOCK_S + tl.arange(0, BLOCK_S)
    visible = (s_pos[None, :] <= q_pos[:, None]) & (s_pos[None, :] < seq_len)  # [BLOCK_T, BLOCK_S]
    logits = tl.full([BLOCK_T, BLOCK_S], float("-inf"), dtype=tl.float32)
    seen = key_tile * BLOCK_S <= tl.minimum(tl.max(q_pos, 0), seq_len - 1)  # some key is visible
    if seen:
        key_ok = s_pos < seq_len
        blk = tl.load(bt_row + s_pos // PAGE, mask=key_ok, other=0).to(tl.int64)
        k = _load_keys(k_ptr, blk, s_pos, key_ok, s_kb, s_ks, D, D_PAD, PAGE, ALIGN).to(DT)
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
                    ALIGN: tl.constexpr, FP8: tl.constexpr, DT: tl.constexpr,
                    PRECISION: tl.constexpr, DECODE_ONLY: tl.constexpr,
                    FILL_HIDDEN: tl.constexpr):
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
                      s_ks, s_sb, s_ss, H_PAD, D, D_PAD, PAGE, BLOCK_T, BLOCK_S, ALIGN, FP8, DT,
                      PRECISION, FILL_HIDDEN)


@triton.jit
def _stream_tile(qt, w, t, limit, width, bt_row, k_ptr, ks_ptr, out_row, dot_scale, s_kb, s_ks,
                 s_sb, s_ss, D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
                 BLOCK_S: tl.constexpr, ALIGN: tl.constexpr, FP8: tl.constexpr,
                 DT: tl.constexpr, PRECISION: tl.constexpr):
    """Scores of one request's key tile ``t`` (keys [0, limit) visible, -inf after), stored."""
    s_pos = t * BLOCK_S + tl.arange(0, BLOCK_S)
    key_ok = s_pos < limit
    blk = tl.load(bt_row + s_pos // PAGE, mask=key_ok, other=0).to(tl.int64)
    k = _load_keys(k_ptr, blk, s_pos, key_ok, s_kb, s_ks, D, D_PAD, PAGE, ALIGN).to(DT)
    if FP8:  # a plain load (the pipeliner takes only the dot's inputs), issued before the dot
        k_scale = tl.load(ks_ptr + blk * s_sb + (s_pos % PAGE) * s_ss, mask=key_ok, other=0.0)
    s = tl.dot(k, qt, input_precision=PRECISION)  # [BLOCK_S, H_PAD]
    total = tl.sum(tl.maximum(s * dot_scale, 0.0) * w[None, :], 1)  # [BLOCK_S]
    if FP8:  # the key's scale, after the sum over heads
        total = total * k_scale
    tl.store(out_row + s_pos, tl.where(key_ok, total, float("-inf")), mask=s_pos < width)


@triton.jit
def _fill_hidden(out_row, start, width, chunk, num_chunks, BLOCK_S: tl.constexpr):
    """-inf over this program's share of the columns [start, width)."""
    tiles = tl.cdiv(tl.maximum(width - start, 0), BLOCK_S)
    per = tl.cdiv(tiles, num_chunks)
    t = chunk * per
    end = tl.minimum(t + per, tiles)
    while t < end:
        cols = start + t * BLOCK_S + tl.arange(0, BLOCK_S)
        tl.store(out_row + cols, tl.full([BLOCK_S], float("-inf"), tl.float32), mask=cols < width)
        t += 1


@triton.jit(do_not_specialize=("width", "stride_bt"),  # per step
            do_not_specialize_on_alignment=("bt_ptr", "qsl_ptr", "seq_lens_ptr", "pos_ptr"))
def _indexer_stream_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, out_ptr, bt_ptr, qsl_ptr, seq_lens_ptr,
                           pos_ptr, dot_scale, width, stride_qt, stride_qh, stride_wt, stride_ot,
                           stride_bt, s_kb, s_ks, s_sb, s_ss, H: tl.constexpr,
                           H_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                           PAGE: tl.constexpr, BLOCK_S: tl.constexpr, MIN_TILES: tl.constexpr,
                           ALIGN: tl.constexpr, FP8: tl.constexpr, DT: tl.constexpr,
                           PRECISION: tl.constexpr, FILL_HIDDEN: tl.constexpr,
                           INTERPRET: tl.constexpr):
    seq = tl.program_id(0)  # request seq's one token is row qsl[seq]
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    row = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) <= row:  # no token this step
        return
    limit = tl.minimum(tl.load(pos_ptr + row) + 1, tl.load(seq_lens_ptr + seq)).to(tl.int32)
    tiles = tl.cdiv(tl.maximum(limit, 0), BLOCK_S)  # tiles holding a visible key
    per = tl.maximum(tl.cdiv(tiles, num_chunks), MIN_TILES)
    lo = chunk * per
    hi = tl.minimum(lo + per, tiles)
    out_row = out_ptr + row.to(tl.int64) * stride_ot
    if FILL_HIDDEN:
        _fill_hidden(out_row, tiles * BLOCK_S, width, chunk, num_chunks, BLOCK_S)
    if lo >= hi:  # a short sequence: fewer chunks than programs
        return
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    q = tl.load(q_ptr + row.to(tl.int64) * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=(h[:, None] < H) & (d[None, :] < D), other=0.0).to(DT)
    qt = tl.trans(q)  # [D_PAD, H_PAD]
    w = tl.load(w_ptr + row.to(tl.int64) * stride_wt + h, mask=h < H, other=0.0)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    if INTERPRET:  # the interpreter's range() cannot take a loaded bound
        t = lo
        while t < hi:
            _stream_tile(qt, w, t, limit, width, bt_row, k_ptr, ks_ptr, out_row, dot_scale, s_kb,
                         s_ks, s_sb, s_ss, D, D_PAD, PAGE, BLOCK_S, ALIGN, FP8, DT, PRECISION)
            t += 1
    else:  # pipelined: the loads of the next tiles are in flight during this tile's dot
        for t in range(lo, hi):
            _stream_tile(qt, w, t, limit, width, bt_row, k_ptr, ks_ptr, out_row, dot_scale, s_kb,
                         s_ks, s_sb, s_ss, D, D_PAD, PAGE, BLOCK_S, ALIGN, FP8, DT, PRECISION)
# fmt: on


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
        config: launch shape; default ``pick_indexer_config``. A streaming config needs
            ``max_query_len`` 1.
        fill_hidden: write -inf over key tiles no token of a block sees (past a sequence's
            length or every token's position); False leaves them unwritten, for a reader that
            stops at each row's visible length (``topk_rows``), which saves the writes of a
            width much larger than the sequences (a CUDA graph's ``max_model_len``).
    Returns:
        [T, width] float32 logits.
    """
    interpret = env.triton_interpret()
    num_tokens, heads, dim = q.shape
    fp8 = index_cache.dtype == torch.uint8
    keys, k_scale = indexer_fp8_views(index_cache) if fp8 else (index_cache, index_cache)
    if keys.shape[-1] != dim or head_weights.shape != (num_tokens, heads):
        raise ValueError(f"q {tuple(q.shape)}, head_weights {tuple(head_weights.shape)} and "
                         f"keys {tuple(keys.shape)} disagree")  # fmt: skip
    cfg = config or pick_indexer_config(heads, max_query_len, q.dtype, interpret, fp8=fp8,
                                        num_seqs=seq_lens.shape[0])
    if cfg.stream and max_query_len != 1:
        raise ValueError(f"the streaming indexer kernel takes decode batches, got {max_query_len=}")
    out = torch.empty(num_tokens, width, dtype=torch.float32, device=q.device)
    if num_tokens == 0 or width == 0:
        return out
    fp8_dot = fp8 and cfg.fp8_dot and not interpret
    if fp8:  # e4m3 values are exact in fp16 (a native conversion, unlike bf16): products exact, sums fp32
        dt = tl.float8e4nv if fp8_dot else tl.float32 if interpret else tl.float16
    else:
        dt = compute_dtype(q.dtype, interpret)
    # fmt: off
    args = (q, head_weights, keys, k_scale, out, block_table, query_start_loc, seq_lens, positions,
            dot_scale)
    strides = (q.stride(0), q.stride(1), head_weights.stride(0), out.stride(0),
               block_table.stride(0), *keys.stride()[:2], *k_scale.stride()[:2])
    meta = dict(H=heads, D=dim, D_PAD=pow2(dim, 16), PAGE=index_cache.shape[1],
                BLOCK_S=cfg.block_s, ALIGN=row_align(keys), FP8=fp8, DT=dt,
                PRECISION="ieee" if dt == tl.float32 else "tf32", FILL_HIDDEN=fill_hidden,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    total_tiles = triton.cdiv(width, cfg.block_s)
    num_seqs = seq_lens.shape[0]
    if cfg.stream:
        chunks = _stream_chunks(num_seqs, total_tiles, cfg.waves, q.device, interpret)
        _indexer_stream_kernel[(num_seqs, chunks)](
            *args, width, *strides, H_PAD=pow2(heads, 16), MIN_TILES=MIN_TILES,
            INTERPRET=interpret, **meta)
        return out
    decode_only = max_query_len == 1
    num_q_blocks = num_seqs if decode_only else num_tokens // cfg.block_t + num_seqs
    key_tiles = cfg.key_tiles or _key_tiles(num_q_blocks, total_tiles, q.device, interpret)
    _indexer_kernel[(num_q_blocks, triton.cdiv(total_tiles, key_tiles))](
        *args, num_seqs, width, *strides, H_PAD=pow2(heads, max(1, 16 // cfg.block_t)),
        BLOCK_T=cfg.block_t, KEY_TILES=key_tiles, DECODE_ONLY=decode_only, **meta)
    # fmt: on
    return out


def row_align(keys: torch.Tensor) -> int:
    """The largest power of two, up to 16 bytes' worth of elements, dividing every key row's
    offset (the block and row strides)."""
    stride = math.gcd(keys.stride(0), keys.stride(1))
    return min(stride & -stride if stride else 16, max(1, 16 // keys.element_size()))


def _stream_chunks(
    num_seqs: int, total_tiles: int, waves: int, device: torch.device, interpret: bool
) -> int:
    """Programs per request of the streaming kernel: about ``waves`` x SMs in all (one SM
    under the interpreter), at most one per ``MIN_TILES`` of the width's tiles."""
    sms = 1 if interpret or device.type != "cuda" else num_sms(device)
    return max(1, min(waves * sms // max(1, num_seqs), triton.cdiv(total_tiles, MIN_TILES)))


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
    logits: Callable[..., torch.Tensor] | None = None,
    select: Callable[..., torch.Tensor] | None = None,
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
        config: launch shape of ``indexer_logits`` (only with the default ``logits``).
        logits: the scores' launch, ``indexer_logits``' call (the plan's ``indexer.decode`` or
            ``indexer.prefill`` variant); default ``indexer_logits``.
        select: the rows' top-k, ``topk_rows``' contract (``indexer.topk_decode``, or
            ``indexer.topk_prefill``'s Triton variant); default ``topk_rows`` for a decode batch,
            ``torch.topk`` over the full-width rows for a prefill. A prefill row's length is
            its position + 1 (causal).
    Returns:
        [T, topk] int32 absolute positions, -1 in unused slots; a set: rows that ``select``
        picks come in increasing order, prefill rows without it best first (``torch.topk``);
        when ``max_seq_len <= topk`` every visible key is selected without scoring. No host
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
    extra = {}
    if logits is None:
        logits, extra = indexer_logits, {"config": config}
    scores = logits(
        q_in, head_weights.contiguous(), index_cache, block_table, query_start_loc, seq_lens,
        positions, width=max_seq_len, max_query_len=max_query_len, dot_scale=dot_scale,
        fill_hidden=not decode, **extra,
    )
    # fmt: on
    if not decode:
        if select is None:  # many full-width rows: torch.topk's multi-block select (H200-timed)
            return topk_from_logits(scores, topk)
        return select(scores, positions + 1, topk)  # causal: a row reads only up to its own position
    # decode rows read only up to their own length (a CUDA graph's width is max_model_len);
    # one request per row, and a decode token is its request's last position
    return (select or topk_rows)(scores, torch.minimum(positions + 1, seq_lens.to(positions.dtype)), topk)
