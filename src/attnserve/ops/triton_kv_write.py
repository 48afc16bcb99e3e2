"""Triton kernel that stores new K/V rows into the paged cache at their slots.

One program per (token, group of KV heads): read the token's K and V, divide by the cache
scales (fp8 caches), convert to the cache dtype and write them at
``slot = block * block_size + offset``. Slot ``-1`` (padding, or a token whose layer keeps no
cache entry) is skipped. Not here: choosing slots (the block manager and the model runner do
that) and reading the cache (``ops/triton_paged_attention.py``). The PyTorch twin is
``attention.reference.write_kv``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["write_kv_cache"]


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
    if num_tokens == 0:
        return
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
