"""DSA lightning-indexer decode logits over fp8 keys as a Gluon (``triton.experimental.gluon``)
Hopper kernel.

The contract of the streaming path of ``ops/indexer/logits_triton.indexer_logits`` for an fp8 cache
(one query token per request), restricted to DeepSeek-V3.2's shape: 64 heads x 128, pages of 64
keys, q as e4m3 values (``float8_e4m3fn``, rotated and quantised by ``lightning_indexer_topk``).
``I[t, s] = scale[s] * sum_h w[t, h] * relu(dot_scale * q[t, h] . k[s])`` for ``s < limit``
(``limit = min(pos(t) + 1, seq_len)``), -inf over the rest of the last visible page; with
``fill_hidden`` -inf over the columns after it too, without them unwritten (as the Triton kernel).

Why: a key is a 132-byte row (128 e4m3 bytes, then its fp32 scale), only 4-byte aligned, so the
Triton kernel's loads are 4 bytes wide and no TMA box can describe the rows. A whole page (64 x
132 = 8448 bytes) is contiguous and 16-byte aligned, so a program copies whole pages with 16-byte
``cp.async`` into a ring of ``STAGES`` page stages, ``STAGES - 1`` pages in flight. The ring has
two views of the same bytes, whose stages are both 8448 bytes apart: a flat one of 256-byte rows
(a page is 33; Gluon's async copy takes no padded layout, and a slice must start at a multiple of
its power-of-two length, so a stage's rows go as up to 7 aligned pieces, ``row_pieces``; the
stage of a page is therefore static: the page loop is unrolled ``STAGES`` times), and a padded one
that reads them as [64 keys, 128] e4m3 (128 values, then 4 bytes skipped: the scale). The 64
scales come by 4-byte ``cp.async`` (into a [64] fp32 stage, same commit group) from the same
lines. sm_90 compile at ``STAGES`` 3: 111 registers, no spills, 49.9 KB of shared memory (a 32 KB
ring, the wgmma's two 8 KB tiles, the scales), so four programs an SM, 2 x 8448 bytes in flight
each (~68 KB an SM). Per page:

1. wait for the page's copies (``wait_group``) and meet the other warps: the page is in its
   stage and every warp is done with the previous page;
2. issue the copies of the page ``STAGES - 1`` ahead into the stage the previous page used (its
   block-table entry was loaded one page before);
3. repack the page's 64 x 128 e4m3 values into the 128-byte-swizzled tile the wgmma reads
   (through registers) and read its scales;
4. wgmma e4m3 with keys as M: A = keys [64, 128] K-major, B = q [64 heads, 128] K-major (stored
   once), acc [64 keys, 64 heads] fp32 (one warp group, 32 registers a thread); ReLU, times
   ``w[t, h]`` and the sum over heads is a reduction along N (within a thread, then the quad's
   shuffles: no cross-warp step), times the key's scale, -inf past the limit, fp32 stores.

Variant "regs" (``variant=``; ``pick_variant`` takes it from 2^18 keys a launch, "tile" above
below that): step 3 loads the page's keys from
the padded view straight into the wgmma's A fragment (registers, ``k_width`` 4), so no tile, no
fence and one barrier a page. The view reads a row's 32 4-byte words in a permuted order (bank
conflict-free 4-byte loads at the 33-word row stride) and q is stored with the same column
permutation, so only the order of the wgmma's K sum changes ("regs_inorder": no permutation,
the loads 4-way bank conflicted). sm_90 compile: 115 registers, no spills, 41.7 KB (no key
tile), A from registers.

The grid is (requests, chunks): each request's visible pages split evenly over its chunks, about
``waves`` x SMs programs in all, at least ``MIN_PAGES`` pages each. Keys past the limit inside
the last page may be stale or NaN bytes: their scores are replaced by -inf (a select).

Not here: bf16 caches, other head counts, dims or pages, prefill (the Triton kernels). No
interpreter runs Gluon: CPU tests compile it for sm_90; ``benchmarks/gpu_indexer_gluon.py``
checks and times it on a Hopper GPU. The PyTorch twin is ``attention.reference_mla``'s indexer
(``indexer_topk``; the scores by ``backends.torch_mla_sparse.index_scores``).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.runtime.jit import constexpr_function

from attnserve.kvcache.fp8 import indexer_fp8_views
from attnserve.ops import launch as launch_helpers
from attnserve.ops.launch import num_sms

__all__ = ["check_indexer_gluon_inputs", "indexer_logits_gluon", "pick_variant", "row_pieces"]

HEADS, DIM, PAGE = 64, 128, 64  # DeepSeek-V3.2 / GLM-5 indexer heads, head dim; keys a page
ROW_BYTES = DIM + 4  # e4m3 values, then the fp32 scale
STAGES = 3  # page stages: STAGES - 1 pages in flight a program (a 32 KB ring)
MIN_PAGES = 2  # least pages a program (as the Triton kernel's MIN_TILES)
WAVES = 4  # programs: about WAVES x SMs
_MAX_GRID_Y = 65535  # chunks are the grid's second dimension

# the stages: a flat view of 256-byte rows (a page is 33, copied by 16-byte cp.async) and a
# padded one of the same bytes as [64, 128] e4m3 rows of 132 bytes (4 skipped after every 128:
# the scale), whose buffers are a page (8448 bytes) apart too
_FLAT_SMEM = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
_PAGE_SMEM = gl.PaddedSharedLayout.with_identity_for([[DIM, 4]], [PAGE, DIM], [1, 0])
_SCALE_SMEM = gl.SwizzledSharedLayout(1, 1, 1, [0])
_TILE_SMEM = gl.NVMMASharedLayout.get_default_for([PAGE, DIM], gl.float8e4nv)  # 128-byte swizzle
# variant "regs": the padded view with the 32 4-byte words of a row permuted along K (column
# word 8s + 4h + t is byte word 8t + 2s + h), so a quad's 4-byte loads of the wgmma's register
# A fragment (rows g, words t + const) hit 32 banks (row stride 33 words); q is stored with the
# same permutation, so the dot products are unchanged. Bases: offset bit -> [row, column].
_PAGE_SMEM_REGS = gl.PaddedSharedLayout(
    [[DIM, 4]],
    [[0, 1], [0, 2], [0, 16], [0, 32], [0, 64], [0, 4], [0, 8]] + [[1 << b, 0] for b in range(6)],
    [],
    [PAGE, DIM],
)
# keys through the swizzled tile (the default) / as a register A, K permuted / in order
VARIANTS = ("tile", "regs", "regs_inorder")
# keys (requests x width) from which "regs" is faster than "tile" (H200, gpu_indexer_gluon.py:
# 1.05-1.23x at 8 x 32K up to 32 x 128K, 86% of the copy bandwidth there; but 0.80-0.96x at
# batch 1 and at 8 x 8K, where one barrier less does not pay for its longer loads)
REGS_FROM_KEYS = 1 << 18


def pick_variant(num_requests: int, width: int) -> str:
    """The variant a launch of ``num_requests`` rows over ``width`` key columns takes (host-side:
    the bounds, not the lengths)."""
    return "regs" if num_requests * width >= REGS_FROM_KEYS else "tile"


@constexpr_function
def _pow2_at_least(n):
    return 1 << (n - 1).bit_length()


@constexpr_function
def row_pieces(first, count):
    """Rows [first, first + count) of the flat view as slices it can take (a slice's start is a
    multiple of its power-of-two length): ((start, length), ...), small to large to small."""
    pieces, cur, end = [], first, first + count
    for bit in range(6):  # up to alignment
        if cur & (1 << bit) and cur + (1 << bit) <= end:
            pieces.append((cur, 1 << bit))
            cur += 1 << bit
    for bit in range(5, -1, -1):  # the rest, largest first
        if cur + (1 << bit) <= end:
            pieces.append((cur, 1 << bit))
            cur += 1 << bit
    assert cur == end, (first, count, pieces)
    return tuple(pieces)


# Kernels keep their dense argument lists: one argument per line would triple their length.
# fmt: off
@gluon.jit
def _copy_piece(flat, src, START: gl.constexpr, LEN: gl.constexpr, FIRST: gl.constexpr,
                COPY: gl.constexpr):
    """16-byte cp.async of rows [START, START + LEN) of the flat view, from row START - FIRST of
    the page at ``src`` (COPY: 16 bytes a thread, a warp two 256-byte rows)."""
    ROW: gl.constexpr = flat.shape[1]
    r = gl.arange(0, LEN, layout=gl.SliceLayout(1, COPY))
    c = gl.arange(0, ROW, layout=gl.SliceLayout(0, COPY))
    async_copy.async_copy_global_to_shared(flat.slice(START, LEN),
                                           src + (START - FIRST) * ROW + r[:, None] * ROW + c[None, :])


@gluon.jit
def _copy_page(cache_ptr, ks_ptr, blk, flat, scales, STAGE: gl.constexpr, COPY: gl.constexpr,
               SC: gl.constexpr):
    """cp.async of page ``blk`` (8448 contiguous bytes: 33 rows of 256) into stage STAGE of the
    flat view (rows 33 STAGE..), and of its 64 scales into ``scales`` [64] by 4-byte copies."""
    ROWS: gl.constexpr = 33
    PAGE_BYTES: gl.constexpr = ROWS * flat.shape[1]
    KEYS: gl.constexpr = scales.shape[0]
    PIECES: gl.constexpr = row_pieces(ROWS * STAGE, ROWS)
    src = cache_ptr + blk.to(gl.int64) * PAGE_BYTES
    for i in gl.static_range(len(PIECES)):
        _copy_piece(flat, src, PIECES[i][0], PIECES[i][1], ROWS * STAGE, COPY)
    k = gl.arange(0, KEYS, layout=SC)
    RB: gl.constexpr = PAGE_BYTES // KEYS  # 132 bytes a key row
    async_copy.async_copy_global_to_shared(
        scales, ks_ptr + blk.to(gl.int64) * (PAGE_BYTES // 4) + k * (RB // 4))


@gluon.jit
def _fill_hidden(out_row, start, width, chunk, num_chunks, LAYOUT: gl.constexpr):
    """-inf over this program's share of the columns [start, width), in pages."""
    P: gl.constexpr = 64
    tiles = gl.cdiv(gl.maximum(width - start, 0), P)
    per = gl.cdiv(tiles, num_chunks)
    end = gl.minimum(chunk * per + per, tiles)
    for t in range(chunk * per, end):
        cols = start + t * P + gl.arange(0, P, layout=LAYOUT)
        gl.store(out_row + cols, gl.full([P], float("-inf"), gl.float32, LAYOUT), mask=cols < width)


@gluon.jit
def _page_step(j, n, blk_next, cache_ptr, ks_ptr, bt_row, flat, pages, scales, k_smem, q_smem, w,
               keys0, limit, width, out_row, dot_scale, STAGE: gl.constexpr, STAGES_: gl.constexpr,
               COPY: gl.constexpr, SC: gl.constexpr, RD: gl.constexpr, ACC: gl.constexpr,
               A_REGS: gl.constexpr):
    """Page j (of n) of the program, in stage STAGE: steps 1-4 of the module doc (A_REGS: the
    keys go to the wgmma from registers, step 3 without the tile). Returns the block of page
    j + STAGES (the next copy's)."""
    async_copy.wait_group(STAGES_ - 2)  # page j's copies (this thread's)
    gl.thread_barrier()  # everyone's; every warp is done with page j - 1 and its stage
    REFILL: gl.constexpr = (STAGE + STAGES_ - 1) % STAGES_  # the stage page j - 1 used
    ahead = j + STAGES_ - 1
    if ahead < n:
        _copy_page(cache_ptr, ks_ptr, blk_next, flat, scales.index(REFILL), REFILL, COPY, SC)
    async_copy.commit_group()
    P: gl.constexpr = k_smem.shape[0]
    H: gl.constexpr = q_smem.shape[0]
    if A_REGS:  # the page's keys straight into the wgmma's A fragment (k_width 4: 8-bit)
        a = pages.index(STAGE).load(gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=4))
        k_scale = scales.index(STAGE).load(gl.SliceLayout(1, ACC))
        acc = warpgroup_mma(a, q_smem.permute((1, 0)), gl.zeros([P, H], gl.float32, ACC),
                            use_acc=False, is_async=True)
        blk_next = gl.load(bt_row + gl.minimum(ahead + 1, n - 1))  # while the wgmma runs
        acc = warpgroup_mma_wait(0, deps=(acc,))  # (8-bit deps fail to lower)
    else:
        k_smem.store(pages.index(STAGE).load(RD))  # 132-byte rows -> the swizzled tile
        k_scale = scales.index(STAGE).load(gl.SliceLayout(1, ACC))
        fence_async_shared()  # the tile (and q) for the wgmma, of every warp
        gl.thread_barrier()
        acc = warpgroup_mma(k_smem, q_smem.permute((1, 0)), gl.zeros([P, H], gl.float32, ACC),
                            use_acc=False, is_async=True)
        blk_next = gl.load(bt_row + gl.minimum(ahead + 1, n - 1))  # while the wgmma runs
        acc = warpgroup_mma_wait(0, deps=(acc,))
    total = gl.sum(gl.maximum(acc * dot_scale, 0.0) * w[None, :], axis=1) * k_scale
    keys = keys0 + j * P
    gl.store(out_row + keys, gl.where(keys < limit, total, float("-inf")), mask=keys < width)
    return blk_next


@gluon.jit(do_not_specialize=("width", "stride_bt"),  # per step
           do_not_specialize_on_alignment=("bt_ptr", "qsl_ptr", "seq_lens_ptr", "pos_ptr"))
def _indexer_gluon_kernel(q_ptr, w_ptr, cache_ptr, ks_ptr, out_ptr, bt_ptr, qsl_ptr, seq_lens_ptr,
                          pos_ptr, dot_scale, width, stride_qt, stride_qh, stride_wt, stride_ot,
                          stride_bt, STAGES_: gl.constexpr, MIN_PAGES_: gl.constexpr,
                          FILL_HIDDEN: gl.constexpr, FLAT_SMEM: gl.constexpr,
                          PAGE_SMEM: gl.constexpr, SCALE_SMEM: gl.constexpr,
                          TILE_SMEM: gl.constexpr, A_REGS: gl.constexpr = False,
                          PERM_K: gl.constexpr = False):
    P: gl.constexpr = 64  # keys a page: the M of the wgmma
    H: gl.constexpr = 64  # heads: its N
    D: gl.constexpr = 128  # head dim: its K
    FLAT_ROWS: gl.constexpr = _pow2_at_least(33 * STAGES_)  # 33 rows of 256 bytes a page
    # one warp group; acc [64 keys, 64 heads]: a quad of threads shares a key row
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, H, 32])
    COPY: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [4, 1], [1, 0])  # 16 bytes a thread
    SC: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    RD: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])  # a warp reads a row
    QL: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    FILL: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])

    seq = gl.program_id(0)  # request seq's one token is row qsl[seq]
    chunk = gl.program_id(1)
    num_chunks = gl.num_programs(1)
    row = gl.load(qsl_ptr + seq)
    if gl.load(qsl_ptr + seq + 1) > row:  # a token this step
        limit = gl.minimum(gl.load(pos_ptr + row) + 1, gl.load(seq_lens_ptr + seq)).to(gl.int32)
        tiles = gl.cdiv(gl.maximum(limit, 0), P)  # pages holding a visible key
        per = gl.maximum(gl.cdiv(tiles, num_chunks), MIN_PAGES_)
        lo = chunk * per
        n = gl.minimum(lo + per, tiles) - lo  # this program's pages (none: n <= 0)
        out_row = out_ptr + row.to(gl.int64) * stride_ot
        if FILL_HIDDEN:
            _fill_hidden(out_row, tiles * P, width, chunk, num_chunks, FILL)
        if n > 0:
            bt_row = bt_ptr + seq.to(gl.int64) * stride_bt + lo
            # the stages: 33 rows of 256 bytes each (one page), read as [64, 128] e4m3 rows of
            # 132 bytes through the padded view (its stages are 8448 bytes apart too)
            flat = gl.allocate_shared_memory(gl.float8e4nv, [FLAT_ROWS, 256], FLAT_SMEM)
            pages = flat._reinterpret(gl.float8e4nv, [_pow2_at_least(STAGES_), P, D], PAGE_SMEM)
            scales = gl.allocate_shared_memory(gl.float32, [STAGES_, P], SCALE_SMEM)
            k_smem = gl.allocate_shared_memory(gl.float8e4nv, [P, D], TILE_SMEM)
            q_smem = gl.allocate_shared_memory(gl.float8e4nv, [H, D], TILE_SMEM)
            # the first STAGES - 1 pages in flight, then q and w by plain loads meanwhile
            for i in gl.static_range(STAGES_ - 1):
                if i < n:
                    _copy_page(cache_ptr, ks_ptr, gl.load(bt_row + i), flat, scales.index(i), i,
                               COPY, SC)
                async_copy.commit_group()
            blk_next = gl.load(bt_row + gl.minimum(STAGES_ - 1, n - 1))
            h = gl.arange(0, H, layout=gl.SliceLayout(1, QL))
            d = gl.arange(0, D, layout=gl.SliceLayout(0, QL))
            q_row = q_ptr + row.to(gl.int64) * stride_qt
            if PERM_K:  # q's columns permuted as the keys' (PAGE_SMEM is _PAGE_SMEM_REGS)
                d = (d & 3) | ((d & 12) << 3) | ((d & 112) >> 2)
            q_smem.store(gl.load(q_row + h[:, None] * stride_qh + d[None, :]))
            if A_REGS:
                fence_async_shared()  # q for the wgmma (the first page's barrier follows)
            heads = gl.arange(0, H, layout=gl.SliceLayout(0, ACC))
            w = gl.load(w_ptr + row.to(gl.int64) * stride_wt + heads)
            keys0 = lo * P + gl.arange(0, P, layout=gl.SliceLayout(1, ACC))
            for base in range(0, n, STAGES_):  # STAGES_ pages a trip: each page's stage static
                for s in gl.static_range(STAGES_):
                    if base + s < n:
                        blk_next = _page_step(base + s, n, blk_next, cache_ptr, ks_ptr, bt_row,
                                              flat, pages, scales, k_smem, q_smem, w, keys0,
                                              limit, width, out_row, dot_scale, s, STAGES_, COPY,
                                              SC, RD, ACC, A_REGS)
# fmt: on


def _class_problem(q: torch.Tensor, head_weights: torch.Tensor, index_cache: torch.Tensor,
                   max_query_len: int) -> str | None:  # fmt: skip
    """What puts the inputs outside the kernel's class, or None."""
    if max_query_len != 1:
        return f"decode batches only (one token a request), got {max_query_len=}"
    if q.dim() != 3 or tuple(q.shape[1:]) != (HEADS, DIM):
        return f"q must be [tokens, {HEADS}, {DIM}], got {tuple(q.shape)}"
    if q.dtype != torch.float8_e4m3fn:
        return f"q must be float8_e4m3fn (the quantised, rotated queries), got {q.dtype}"
    if q.stride(2) != 1:
        return "q must be contiguous in its last dimension"
    if head_weights.dtype != torch.float32 or tuple(head_weights.shape) != (q.shape[0], HEADS):
        return (f"head_weights must be float32 [{q.shape[0]}, {HEADS}], got "
                f"{head_weights.dtype} {tuple(head_weights.shape)}")  # fmt: skip
    if head_weights.stride(1) != 1:
        return "head_weights must be contiguous in its last dimension"
    if index_cache.dtype != torch.uint8 or index_cache.dim() != 3:
        return f"fp8 indexer cache rows (uint8, 3-D) only, got {index_cache.dtype}"
    if tuple(index_cache.shape[1:]) != (PAGE, ROW_BYTES):
        return f"index cache must be [blocks, {PAGE}, {ROW_BYTES}], got {tuple(index_cache.shape)}"
    if not index_cache.is_contiguous() or index_cache.data_ptr() % 16:
        return "the index cache must be contiguous and 16-byte aligned (16-byte cp.async)"
    return None


def check_indexer_gluon_inputs(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    max_query_len: int = 1,
) -> None:
    """ValueError unless the inputs are in the class the kernel takes (see the module doc)."""
    problem = _class_problem(q, head_weights, index_cache, max_query_len)
    if problem:
        raise ValueError(problem)
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"block_table must be 2-D int32, got {block_table.dtype}")
    reqs = block_table.shape[0]
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (reqs,):
        raise ValueError(f"seq_lens must be int32 [{reqs}] (one per block-table row), got "
                         f"{seq_lens.dtype} {tuple(seq_lens.shape)}")  # fmt: skip
    if query_start_loc.dtype != torch.int32 or tuple(query_start_loc.shape) != (reqs + 1,):
        raise ValueError(f"query_start_loc must be int32 [{reqs + 1}], got "
                         f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")  # fmt: skip
    if positions.dtype not in (torch.int32, torch.int64) or tuple(positions.shape) != q.shape[:1]:
        raise ValueError(f"positions must be int32 or int64 [{q.shape[0]}], got "
                         f"{positions.dtype} {tuple(positions.shape)}")  # fmt: skip
    tensors = (q, head_weights, index_cache, block_table, query_start_loc, seq_lens, positions)
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"inputs on several devices: {sorted(map(str, devices))}")
    launch_helpers.require_hopper(q.device, "indexer_logits_gluon")


def _chunks(num_seqs: int, width: int, waves: int, device: torch.device) -> int:
    """Programs per request: about ``waves`` x SMs in all (one SM off the GPU), at most one per
    ``MIN_PAGES`` of the width's pages."""
    sms = num_sms(device) if device.type == "cuda" else 1
    pages = triton.cdiv(width, PAGE)
    return max(1, min(waves * sms // max(1, num_seqs), triton.cdiv(pages, MIN_PAGES), _MAX_GRID_Y))


def _launch(q, head_weights, index_cache, block_table, query_start_loc, seq_lens, positions,
            width, dot_scale, fill_hidden, waves, stages=None, variant="tile"):  # fmt: skip
    """The launch itself, for inputs ``check_indexer_gluon_inputs`` passed (the sm_90 compile
    test records it on CPU tensors)."""
    out = torch.empty(q.shape[0], width, dtype=torch.float32, device=q.device)
    num_seqs = seq_lens.shape[0]
    if q.shape[0] == 0 or width == 0 or num_seqs == 0:
        return out
    k_scale = indexer_fp8_views(index_cache)[1]  # [blocks, 64] fp32, 33 apart
    chunks = _chunks(num_seqs, width, waves, q.device)
    # fmt: off
    _indexer_gluon_kernel[(num_seqs, chunks)](
        q, head_weights, index_cache.view(torch.float8_e4m3fn), k_scale, out, block_table, query_start_loc, seq_lens,
        positions, dot_scale, width, q.stride(0), q.stride(1), head_weights.stride(0),
        out.stride(0), block_table.stride(0), STAGES_=stages or STAGES, MIN_PAGES_=MIN_PAGES,
        FILL_HIDDEN=fill_hidden, FLAT_SMEM=_FLAT_SMEM,
        PAGE_SMEM=_PAGE_SMEM_REGS if variant == "regs" else _PAGE_SMEM, SCALE_SMEM=_SCALE_SMEM,
        TILE_SMEM=_TILE_SMEM, A_REGS=variant != "tile", PERM_K=variant == "regs", num_warps=4,
    )
    # fmt: on
    return out


def indexer_logits_gluon(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    *,
    width: int,
    dot_scale: float = 1.0,
    fill_hidden: bool = True,
    max_query_len: int = 1,
    waves: int = WAVES,
    stages: int = STAGES,
    variant: str | None = None,
) -> torch.Tensor:
    """Decode index scores over an fp8 cache by the Gluon kernel (the streaming fp8 path of
    ``indexer_logits``: same arguments, one token per request).

    Args:
        q: [T, 64, 128] float8_e4m3fn, the rotated, quantised queries; unit last stride.
        head_weights: [T, 64] float32, every scaling but ``dot_scale`` folded in.
        index_cache: [num_blocks, 64, 132] uint8 fp8 rows, contiguous; block 0 is the null block.
        block_table: [B, max_blocks] int32; query_start_loc: [B + 1] int32 (request i's token
            is row ``qsl[i]``, none when ``qsl[i + 1] == qsl[i]``); seq_lens: [B] int32;
            positions: [T] int32 or int64.
        width: columns of the result (>= every visible key); dot_scale: before the ReLU.
        fill_hidden: -inf over the columns past each row's last visible page; False leaves
            them unwritten (for ``topk_rows``, which stops at each row's length).
        max_query_len: must be 1 (``indexer_logits``' argument, so that both take one call).
        waves: programs, about ``waves`` x SMs.
        stages: page stages a program, 2..7 (``stages - 1`` pages in flight; 7: a 64 KB ring,
            two programs an SM).
        variant: None (``pick_variant``: "regs" for large batches, "tile" for small ones),
            "tile" (the keys repacked into the swizzled tile the wgmma reads) or "regs" (the keys loaded into the wgmma's A fragment from the padded view,
            their columns and q's in the same permuted order; no tile, no fence, one barrier a
            page; the fp32 sums may differ from "tile"'s in the last bits: another K order),
            or "regs_inorder" (the same in K order: 4-way bank conflicts on the loads).
    Returns:
        [T, width] float32 logits.
    Raises:
        ValueError: inputs outside that class, or not on a Hopper GPU.
    """
    if not 2 <= stages <= 7 or waves < 1:
        raise ValueError(f"stages must be 2..7 and waves >= 1, got {stages=} {waves=}")
    if variant is None:
        variant = pick_variant(seq_lens.shape[0], width)
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    check_indexer_gluon_inputs(q, head_weights, index_cache, block_table, query_start_loc,
                               seq_lens, positions, max_query_len)  # fmt: skip
    return _launch(q, head_weights, index_cache, block_table, query_start_loc, seq_lens,
                   positions, width, dot_scale, fill_hidden, waves, stages, variant)  # fmt: skip
