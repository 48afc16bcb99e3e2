"""What the Gluon MLA kernels share: the DeepSeek latent shape, the score MMAs of a page, the
online softmax, the query loads and the output store (``decode_gluon.py``, ``sparse_gluon.py``,
``sparse_gluon_fp8.py``), and the gathered tiles of the two sparse kernels.

The shape is DeepSeek's: ``kv_lora_rank`` 512 + rope 64, 64 heads a program, scores in log2 units;
outputs are stored normalised, or as split-KV partials in ``latent.prepare_latent_launch``'s layout
for ``latent.merge_splits``. What it is not: a kernel, or host code beyond the sparse kernels'
shared class check (``sparse_class_problem``).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma

from attnserve.kvcache.fp8 import mla_fp8_row_bytes
from attnserve.ops.mla.latent import MLAConfig

__all__ = ["HEADS_PER_PROGRAM", "KV_LORA_RANK", "KV_SMEM", "MAX_GRID_Y", "PAGE", "PE_SMEM", "ROPE",
           "SHAPE", "TILE", "issue_scores", "load_q", "load_q_heads", "softmax_page", "softmax_tile",
           "sparse_class_problem", "store_out", "tile_positions", "tile_slots"]  # fmt: skip

KV_LORA_RANK, ROPE, PAGE, HEADS_PER_PROGRAM = 512, 64, 64, 64
# what prepare_latent_launch sizes the partials and the default splits by: 64 heads a program,
# 64-key tiles, 8 warps (it launches nothing with it)
SHAPE = MLAConfig(HEADS_PER_PROGRAM, PAGE, 8, 1)
MAX_GRID_Y = 65535  # query rows are the grid's second dimension
TILE = gl.constexpr(64)  # selected rows a key tile of the sparse kernels (a constexpr: kernels read it)
# 128-byte-swizzled shared tiles as the wgmma reads them: value halves [64, 256], rope and P [64, 64]
KV_SMEM = gl.NVMMASharedLayout.get_default_for([TILE.value, KV_LORA_RANK // 2], gl.bfloat16)
PE_SMEM = gl.NVMMASharedLayout.get_default_for([TILE.value, ROPE], gl.bfloat16)


# Kernels keep their dense argument lists: one argument per line would triple their length.
# fmt: off
@gluon.jit
def issue_scores(q0_smem, q1_smem, qpe_smem, kv0, kv1, pe, S_LAYOUT: gl.constexpr):
    """Async S = Q K^T over the page's three column ranges: three wgmma groups, one result."""
    M: gl.constexpr = q0_smem.shape[0]
    N: gl.constexpr = kv0.shape[0]
    s = gl.zeros([M, N], gl.float32, S_LAYOUT)
    s = warpgroup_mma(q0_smem, kv0.permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma(q1_smem, kv1.permute((1, 0)), s, is_async=True)
    return warpgroup_mma(qpe_smem, pe.permute((1, 0)), s, is_async=True)


@gluon.jit
def softmax_page(s, m_i, l_part, k0, seq_len, qk_scale, S_LAYOUT: gl.constexpr):
    """Online-softmax step (log2 units) over keys k0..k0+PAGE: P, new max, the per-column row
    sums (reduced over columns only at the end), and the rescale of the old accumulator."""
    keys = k0 + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, S_LAYOUT))
    s = gl.where((keys < seq_len)[None, :], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    return p, m_new, l_part * alpha[:, None] + p, alpha


@gluon.jit
def load_q_heads(q_ptr, q0_smem, q1_smem, qpe_smem, seq, head0, num_heads, stride_qt, stride_qh,
                  LAYOUT: gl.constexpr):
    """The program's 64 absorbed query rows [c ; rope] into shared memory, by plain loads; rows
    of heads past ``num_heads`` (fewer than 64 heads: padding rows) are 0."""
    HALF: gl.constexpr = q0_smem.shape[1]
    heads = head0 + gl.arange(0, q0_smem.shape[0], layout=gl.SliceLayout(1, LAYOUT))
    rows = q_ptr + seq.to(gl.int64) * stride_qt + heads * stride_qh  # [64] row pointers
    dh = gl.arange(0, HALF, layout=gl.SliceLayout(0, LAYOUT))
    dr = gl.arange(0, qpe_smem.shape[1], layout=gl.SliceLayout(0, LAYOUT))
    mh = (heads < num_heads)[:, None] & (dh < HALF)[None, :]
    mr = (heads < num_heads)[:, None] & (dr < qpe_smem.shape[1])[None, :]
    q0_smem.store(gl.load(rows[:, None] + dh[None, :], mask=mh, other=0.0))
    q1_smem.store(gl.load(rows[:, None] + HALF + dh[None, :], mask=mh, other=0.0))
    qpe_smem.store(gl.load(rows[:, None] + 2 * HALF + dr[None, :], mask=mr, other=0.0))


@gluon.jit
def load_q(q_ptr, q0_smem, q1_smem, qpe_smem, seq, head0, stride_qt, stride_qh,
            LAYOUT: gl.constexpr):
    """The program's 64 absorbed query rows, all of them heads (64+ heads, a multiple of 64)."""
    load_q_heads(q_ptr, q0_smem, q1_smem, qpe_smem, seq, head0, head0 + q0_smem.shape[0],
                  stride_qt, stride_qh, LAYOUT)


@gluon.jit
def store_out(out_ptr, part_out_ptr, part_lse_ptr, acc0, acc1, m_i, l_part, seq, head0, split,
               num_heads, num_splits, stride_ot, stride_oh, SPLIT: gl.constexpr,
               S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr):
    """Normalised rows (0 where no key was seen) to ``out``, or with SPLIT to the fp32 partials
    [row, head, split, L] and their lse (log2 units, -inf when empty)."""
    HALF: gl.constexpr = acc0.shape[1]
    l_sum = gl.sum(l_part, axis=1)
    l_o = gl.convert_layout(l_sum, gl.SliceLayout(1, O_LAYOUT), assert_trivial=True)
    inv = gl.where(l_o > 0.0, 1.0 / gl.where(l_o > 0.0, l_o, 1.0), 0.0)[:, None]
    heads = head0 + gl.arange(0, acc0.shape[0], layout=gl.SliceLayout(1, O_LAYOUT))
    cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, O_LAYOUT))
    keep = (heads < num_heads)[:, None] & (cols < HALF)[None, :]  # padding rows are not stored
    if SPLIT:
        part = (seq.to(gl.int64) * num_heads + heads) * num_splits + split
        dst = part_out_ptr + part[:, None] * (2 * HALF) + cols[None, :]
        gl.store(dst, acc0 * inv, mask=keep)
        gl.store(dst + HALF, acc1 * inv, mask=keep)
        heads_s = head0 + gl.arange(0, acc0.shape[0], layout=gl.SliceLayout(1, S_LAYOUT))
        part_s = (seq.to(gl.int64) * num_heads + heads_s) * num_splits + split
        lse = gl.where(l_sum > 0.0, m_i + gl.log2(gl.where(l_sum > 0.0, l_sum, 1.0)), float("-inf"))
        gl.store(part_lse_ptr + part_s, lse, mask=heads_s < num_heads)
    else:
        dst = out_ptr + seq.to(gl.int64) * stride_ot + heads[:, None] * stride_oh + cols[None, :]
        dt: gl.constexpr = out_ptr.dtype.element_ty
        gl.store(dst, (acc0 * inv).to(dt), mask=keep)
        gl.store(dst + HALF, (acc1 * inv).to(dt), mask=keep)


@gluon.jit
def tile_positions(idx_row, t, end, seq_len, LAYOUT: gl.constexpr):
    """Positions [TILE] (in LAYOUT) of key tile t's selected rows: -1 where the slot is unused,
    past the split's indices (``end``) or at / past the request's length."""
    kk = t * TILE + gl.arange(0, TILE, layout=LAYOUT)
    pos = gl.load(idx_row + kk, mask=kk < end, other=-1)
    return gl.where((pos >= 0) & (pos < seq_len), pos, -1)


@gluon.jit
def tile_slots(bt_row, pos, PAGE_SIZE: gl.constexpr):
    """Cache slots of the positions (-1 stays -1), through the request's block table."""
    ok = pos >= 0
    blk = gl.load(bt_row + pos // PAGE_SIZE, mask=ok, other=0)
    return gl.where(ok, blk * PAGE_SIZE + pos % PAGE_SIZE, -1)


@gluon.jit
def softmax_tile(s, m_i, l_part, pos, qk_scale, S_LAYOUT: gl.constexpr):
    """``softmax_page`` over a gathered tile: unused keys (pos -1) masked to -inf first (the
    page step's own position mask is then all true)."""
    s = gl.where((pos >= 0)[None, :], s, float("-inf"))
    return softmax_page(s, m_i, l_part, 0, s.shape[1], qk_scale, S_LAYOUT)
# fmt: on


def sparse_class_problem(
    q: torch.Tensor, latent_cache: torch.Tensor, kv_lora_rank: int, fp8: bool = False
) -> str | None:
    """What puts q and the cache outside the class of the sparse Gluon kernel
    (``sparse_gluon.py``; ``fp8``: of its fp8-row twin, ``sparse_gluon_fp8.py``), or None."""
    width = KV_LORA_RANK + ROPE
    row = mla_fp8_row_bytes(KV_LORA_RANK, ROPE) if fp8 else width  # 656 bytes or 576 bf16
    if kv_lora_rank != KV_LORA_RANK:
        name = "sparse_mla_gluon_fp8" if fp8 else "sparse_mla_gluon"
        return f"{name} takes kv_lora_rank {KV_LORA_RANK}, got {kv_lora_rank}"
    if q.dim() != 3 or q.shape[2] != width:
        return f"q must be [rows, heads, {width}], got {tuple(q.shape)}"
    if q.shape[1] == 0 or q.shape[1] % HEADS_PER_PROGRAM:
        return f"heads must be a multiple of {HEADS_PER_PROGRAM}, got {q.shape[1]}"
    if q.shape[0] > MAX_GRID_Y:
        return f"at most {MAX_GRID_Y} query rows a launch, got {q.shape[0]}"
    if latent_cache.dim() != 3 or latent_cache.shape[2] != row or latent_cache.shape[1] < 1:
        return f"latent cache must be [blocks, page, {row}], got {tuple(latent_cache.shape)}"
    if fp8 and (q.dtype != torch.bfloat16 or latent_cache.dtype != torch.uint8):
        return f"bf16 q and uint8 fp8 rows only, got {q.dtype} and {latent_cache.dtype}"
    if not fp8 and (q.dtype != torch.bfloat16 or latent_cache.dtype != torch.bfloat16):
        return f"bf16 q and cache only, got {q.dtype} and {latent_cache.dtype}"
    if q.stride(-1) != 1 or not latent_cache.is_contiguous():
        return "q must be contiguous in its last dimension and the cache contiguous"
    if latent_cache.data_ptr() % 16:
        return "the latent cache must be 16-byte aligned (16-byte cp.async)"
    return None
