"""Triton kernels that store new K/V rows into the paged cache at their slots.

``write_kv_cache``: one program per (token, group of KV heads): read the token's K and V,
divide by the cache scales (fp8 caches), convert to the cache dtype and write them at
``slot = block * block_size + offset``. Slot ``-1`` (padding, or a token whose layer keeps no
cache entry) is skipped. ``rope_write_kv_cache`` does the same with RoPE fused in, one launch
instead of two: programs for q's heads write rotated q to a new tensor, programs for the KV
heads rotate k on the way into the cache (rounded as the unfused rotation then write round
it, so the cache holds the same bits), after a per-head q/k RMSNorm where one is given (Qwen3;
rounded as ``RMSNorm``). Not here: choosing slots (the block manager and the
model runner do that) and reading the cache (``ops/attention/paged_triton.py``). The PyTorch
twins are ``attention.reference.write_kv`` and, with RoPE, ``layers.fused.rotary_ref`` then
``write_kv`` (``rms_norm_ref`` on q and k first, with the q/k norm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve.ops.dense.fused_triton import (
    block_elems,
    head_inv_rms,
    rope_cos_sin,
    rope_pairs,
    rotate_heads,
    store_rope,
    warps,
)

__all__ = ["rope_write_kv_cache", "write_kv_cache"]


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    PAGE: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HEAD_V: tl.constexpr,
    HEAD_V_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // PAGE
    offset = slot % PAGE
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    d = tl.arange(0, HEAD_PAD)
    dv = tl.arange(0, HEAD_V_PAD)
    k_mask = (h[:, None] < num_kv_heads) & (d[None, :] < HEAD)
    v_mask = (h[:, None] < num_kv_heads) & (dv[None, :] < HEAD_V)
    k = tl.load(k_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=k_mask)
    v = tl.load(v_ptr + token * stride_vt + h[:, None] * stride_vh + dv[None, :], mask=v_mask)
    k = k.to(tl.float32) / k_scale  # fp32 first: the interpreter cannot do bf16 arithmetic
    v = v.to(tl.float32) / v_scale
    k_dst = key_cache_ptr + block * stride_kcb + offset * stride_kcs + h[:, None] * stride_kch
    v_dst = value_cache_ptr + block * stride_vcb + offset * stride_vcs + h[:, None] * stride_vch
    tl.store(k_dst + d[None, :], k.to(key_cache_ptr.dtype.element_ty), mask=k_mask)
    tl.store(v_dst + dv[None, :], v.to(value_cache_ptr.dtype.element_ty), mask=v_mask)


# fmt: off
@triton.jit(do_not_specialize=("num_slots",))
def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, key_cache_ptr, value_cache_ptr, table_ptr,
                          pos_ptr, slot_ptr, qw_ptr, kw_ptr, q_eps, k_eps, k_scale, v_scale,
                          num_slots, num_q_heads, num_kv_heads, sq_t, sq_h, sk_t, sk_h, sv_t,
                          sv_h, sqo_t, sqo_h, s_table, stride_kcb, stride_kcs, stride_kch,
                          stride_vcb, stride_vcs, stride_vch,
                          PAGE: tl.constexpr, HEAD: tl.constexpr, HEAD_V: tl.constexpr,
                          HEAD_V_PAD: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr,
                          BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HALF_PAD: tl.constexpr,
                          TAIL_PAD: tl.constexpr, NUM_Q_BLOCKS: tl.constexpr,
                          HAS_QK_NORM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Programs (t, b): b < NUM_Q_BLOCKS rotates a block of q's heads into qo; the others
    rotate a block of k's heads into the cache and store the same heads of v there. With
    HAS_QK_NORM q's and k's heads are RMS-normalised first (weights qw, kw; q_eps, k_eps)."""
    t = tl.program_id(0)
    blk = tl.program_id(1)
    cos, sin = rope_cos_sin(table_ptr, pos_ptr, t, s_table, ROT, HALF_PAD)
    if blk < NUM_Q_BLOCKS:
        rotate_heads(q_ptr, qo_ptr, sq_t, sq_h, sqo_t, sqo_h, t, blk * BLOCK_HQ, num_q_heads,
                      cos, sin, qw_ptr, q_eps, HEAD, ROT, INTERLEAVED, BLOCK_HQ, HALF_PAD,
                      TAIL_PAD, HAS_QK_NORM, HEAD_PAD)
    else:
        slot = tl.load(slot_ptr + t, mask=t < num_slots, other=-1).to(tl.int64)
        if slot >= 0:
            block = slot // PAGE
            offset = slot % PAGE
            h = (blk - NUM_Q_BLOCKS) * BLOCK_HK + tl.arange(0, BLOCK_HK)
            h_ok = h < num_kv_heads
            t64 = t.to(tl.int64)
            k_row = k_ptr + t64 * sk_t + h[:, None] * sk_h  # [BLOCK_HK, 1]
            kc_row = key_cache_ptr + block * stride_kcb + offset * stride_kcs + h[:, None] * stride_kch
            inv = 1.0
            if HAS_QK_NORM:
                inv = head_inv_rms(k_row, h_ok, k_eps, HEAD, HEAD_PAD)
            o1, o2 = rope_pairs(k_row, h_ok, cos, sin, inv, kw_ptr, ROT, INTERLEAVED, BLOCK_HK,
                                 HALF_PAD, HAS_QK_NORM)
            store_rope(k_row, kc_row, h_ok, o1, o2, k_scale, inv, kw_ptr, HEAD, ROT, INTERLEAVED,
                        BLOCK_HK, HALF_PAD, TAIL_PAD, HAS_QK_NORM)
            dv = tl.arange(0, HEAD_V_PAD)
            v_mask = h_ok[:, None] & (dv[None, :] < HEAD_V)
            v = tl.load(v_ptr + t64 * sv_t + h[:, None] * sv_h + dv[None, :], mask=v_mask)
            v = v.to(tl.float32) / v_scale
            v_dst = value_cache_ptr + block * stride_vcb + offset * stride_vcs + h[:, None] * stride_vch
            tl.store(v_dst + dv[None, :], v.to(value_cache_ptr.dtype.element_ty), mask=v_mask)
# fmt: on


def _check_kv(k, v, key_cache, value_cache, num_tokens: int) -> None:
    num_kv_heads, head, head_v = key_cache.shape[2], key_cache.shape[3], value_cache.shape[3]
    if k.shape[1:] != (num_kv_heads, head) or v.shape[1:] != (num_kv_heads, head_v):
        raise ValueError(
            f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit the caches "
            f"{tuple(key_cache.shape)} / {tuple(value_cache.shape)}"
        )
    if min(k.shape[0], v.shape[0]) < num_tokens:
        raise ValueError(f"{num_tokens} slots but only {min(k.shape[0], v.shape[0])} K/V rows")
    for name, t in (("k", k), ("v", v), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")


def _check_qk_norm(qk_norm, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    q_w, k_w, q_eps, k_eps = qk_norm
    head = q.shape[-1]
    for name, w, x in (("q", q_w, q), ("k", k_w, k)):
        if w.shape != (head,) or w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"qk_norm: the {name} weight {tuple(w.shape)} {w.dtype} must be [{head}] "
                             f"in {name}'s dtype {x.dtype} on its device")
    return q_w.contiguous(), k_w.contiguous(), float(q_eps), float(k_eps)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store K/V rows at their cache slots, in place.

    Args:
        k: [num_tokens, num_kv_heads, head_size]; v: [num_tokens, num_kv_heads, head_size_v].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size(_v)]; any
            float dtype or ``torch.float8_e4m3fn`` (values are divided by the scales first;
            on GPU out-of-range values saturate to +-448 where torch would give NaN).
        slot_mapping: [num_tokens] int32/int64; ``-1`` skips the token. Only the first
            ``len(slot_mapping)`` rows of k and v are read.
        k_scale, v_scale: quantisation scales (1.0 for a cache in the model's dtype).
    """
    num_tokens = slot_mapping.shape[0]
    _check_kv(k, v, key_cache, value_cache, num_tokens)
    if num_tokens == 0:
        return
    num_kv_heads, head, head_v = key_cache.shape[2], key_cache.shape[3], value_cache.shape[3]
    head_pad = max(16, triton.next_power_of_2(max(head, head_v)))
    heads = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // head_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, heads))
    _write_kv_kernel[grid](
        k,
        v,
        key_cache,
        value_cache,
        slot_mapping,
        float(k_scale),
        float(v_scale),
        num_kv_heads,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        PAGE=key_cache.shape[1],
        HEADS=heads,
        HEAD=head,
        HEAD_PAD=triton.next_power_of_2(head),
        HEAD_V=head_v,
        HEAD_V_PAD=triton.next_power_of_2(head_v),
        num_warps=4,
    )


def rope_write_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_table: torch.Tensor,
    positions: torch.Tensor,
    rotary_dim: int,
    interleaved: bool,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float, float] | None = None,
) -> torch.Tensor:
    """RoPE on q and k, and rotated k with v stored at their cache slots, in one launch.

    Equal to the unfused ``triton_fused.rotary`` then ``write_kv_cache`` (the same bits in the
    cache and in q). With ``qk_norm`` q's and k's heads are first RMS-normalised over the
    whole head, as ``layers.norm.RMSNorm`` (``triton_fused.rms_norm``) then the rotation: the
    same roundings, the sum of squares over the same padded tile.

    Args:
        q: [T, num_heads, head_size]; k: [>= S, num_kv_heads, head_size]; v: [>= S,
            num_kv_heads, head_size_v]; any strides with the last dim contiguous (views of a
            fused QKV projection are fine). Not written.
        key_cache, value_cache, slot_mapping [S], k_scale, v_scale: as ``write_kv_cache``.
        cos_sin_table: [max_pos, rotary_dim] float32, cos | sin halves of each row
            (``RotaryEmbedding``'s table); positions: [T] int32/int64, each below max_pos.
        rotary_dim: even, at most head_size; the dims past it are not rotated.
        interleaved: GPT-J adjacent pairs if True, else NeoX halves.
        qk_norm: ``(q_weight, k_weight, q_eps, k_eps)``, weights [head_size] in q's (and k's)
            dtype (a plain RMSNorm, not zero-centred), or None: no norm.
    Returns:
        The rotated q: a new contiguous [T, num_heads, head_size] tensor of q's dtype.
    """
    t, num_q_heads, head = q.shape
    num_slots = slot_mapping.shape[0]
    _check_kv(k, v, key_cache, value_cache, num_slots)
    if positions.shape != (t,) or num_slots > t or head != key_cache.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, positions {tuple(positions.shape)}, {num_slots} slots "
                         f"and key_cache {tuple(key_cache.shape)} do not fit together")
    if rotary_dim % 2 or not 0 < rotary_dim <= head or cos_sin_table.shape[-1] != rotary_dim:
        raise ValueError(f"rotary_dim {rotary_dim} vs head {head}, table {tuple(cos_sin_table.shape)}")
    if q.stride(-1) != 1 or cos_sin_table.dtype != torch.float32:
        raise ValueError("q must be contiguous in its last dimension and the table float32")
    q_w, k_w, q_eps, k_eps = _check_qk_norm(qk_norm, q, k) if qk_norm is not None else (q, k, 0.0, 0.0)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    table = cos_sin_table.contiguous()
    num_kv_heads, head_v = key_cache.shape[2], value_cache.shape[3]
    half_pad = triton.next_power_of_2(max(rotary_dim // 2, 1))
    head_v_pad = triton.next_power_of_2(head_v)
    # a q/k norm holds whole heads (its sum of squares): blocks are sized by the head then
    head_pad = triton.next_power_of_2(head) if qk_norm is not None else 1
    q_elems = max(half_pad, head_pad)
    block_hq = min(triton.next_power_of_2(num_q_heads), max(1, block_elems() // q_elems))
    block_hk = min(triton.next_power_of_2(num_kv_heads), max(1, block_elems() // max(q_elems, head_v_pad)))
    num_q_blocks = triton.cdiv(num_q_heads, block_hq)
    grid = (t, num_q_blocks + triton.cdiv(num_kv_heads, block_hk))
    # no FMA contraction: x1 * c - x2 * s must round like the two products of the torch path
    _rope_write_kv_kernel[grid](
        q, k, v, q_out, key_cache, value_cache, table, positions.contiguous(), slot_mapping,
        q_w, k_w, q_eps, k_eps, float(k_scale), float(v_scale), num_slots, num_q_heads, num_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), table.stride(0), *key_cache.stride()[:3],
        *value_cache.stride()[:3], PAGE=key_cache.shape[1], HEAD=head, HEAD_V=head_v,
        HEAD_V_PAD=head_v_pad, ROT=rotary_dim, INTERLEAVED=bool(interleaved), BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk, HALF_PAD=half_pad,
        TAIL_PAD=triton.next_power_of_2(max(head - rotary_dim, 1)), NUM_Q_BLOCKS=num_q_blocks,
        HAS_QK_NORM=qk_norm is not None, HEAD_PAD=head_pad,
        num_warps=warps(max(block_hq * q_elems, block_hk * max(head_pad, head_v_pad)), 4),
        enable_fp_fusion=False,
    )  # fmt: skip
    return q_out
