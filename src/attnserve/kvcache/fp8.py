"""FP8 byte formats of the MLA latent cache and the DSA indexer key cache, in plain PyTorch.

Defines, byte for byte, what a fast cache-write kernel must produce and a fast reader must
accept. Rows are per token (one row per cache slot), little-endian:

- MLA latent (FlashMLA "V32_FP8Sparse", 656 bytes for kv_lora_rank 512 and rope 64):
  ``kv_lora_rank`` e4m3 bytes | one fp32 scale per 128-value tile | ``rope_dim`` bf16 values.
- Indexer key: ``head_dim`` e4m3 bytes | one fp32 scale, quantised *after* the orthonormal
  Hadamard rotation, so dequantised keys live in the rotated space.

Every scale is a power of two, ``2^ceil(log2(max(amax, 1e-4) / 448))``, computed exactly from
the float32 quotient's exponent bits (no ``log2``). Values are ``e4m3(clamp(x / s, +-448))``
with round-to-nearest-even. This file is not a kernel and knows nothing of paging: see
``attention/reference_mla.py`` for paged reads and writes.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "AMAX_FLOOR",
    "E4M3_MAX",
    "FP8_TILE",
    "dequantize_indexer_fp8",
    "dequantize_mla_fp8",
    "hadamard",
    "indexer_fp8_views",
    "mla_fp8_row_bytes",
    "mla_fp8_views",
    "pow2_scale",
    "quantize_act_fp8",
    "quantize_indexer_fp8",
    "quantize_mla_fp8",
]

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4  # amax is floored here before the scale is taken (DeepSeek act_quant)
FP8_TILE = 128  # one scale per 128 latent values


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """Power-of-two scale ``2^ceil(log2(max(amax, 1e-4) / 448))`` as float32, exactly.

    ``ceil(log2(r))`` is read off the float32 ``r``: frexp gives ``r = m * 2^e`` with
    ``m in [0.5, 1)``, so the answer is ``e``, or ``e - 1`` when ``r`` is a power of two
    (the same result as the exponent/mantissa bit trick of DeepSeek's ``fast_round_scale``).
    """
    ratio = amax.float().clamp_min(AMAX_FLOOR) / E4M3_MAX
    mantissa, exponent = torch.frexp(ratio)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    return torch.exp2(exponent.float())


def _quantize_vectors(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power-of-two scale per vector along the last dim: (e4m3 values, scale [...])."""
    x = x.float()
    scale = pow2_scale(x.abs().amax(dim=-1))
    values = (x / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values, scale


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-vector fp8 quantisation of activations (indexer queries), no rotation.

    Args:
        x: [..., D]; one scale per vector along the last dim.
    Returns:
        (values, scale): values [..., D] float32 holding the e4m3 numbers (not yet multiplied
        by the scale), scale [...] float32 powers of two; ``values * scale[..., None]`` is the
        dequantised vector.
    """
    values, scale = _quantize_vectors(x)
    return values.float(), scale


@functools.lru_cache(maxsize=16)
def _sylvester(n: int, device: torch.device) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix of +-1 (n a power of two), float32, one copy per
    device (no host-to-device copy per call, so the fp8 indexer can be graph-captured)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h.to(device)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard rotation of the last dim: ``x @ H / sqrt(n)``.

    Computed in float32 and returned in x's dtype (a bf16 input is rounded back to bf16, as
    DeepSeek's ``rotate_activation`` does before quantising).

    Args:
        x: [..., n] with n a power of two (128 for the DSA indexer).
    Returns:
        [..., n] in x's dtype.
    """
    n = x.shape[-1]
    if n <= 0 or n & (n - 1):
        raise ValueError(f"hadamard needs a power-of-two last dim, got {n}")
    h = _sylvester(n, x.device)
    return (torch.matmul(x.float(), h) * n**-0.5).to(x.dtype)


def mla_fp8_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one fp8 latent row: values, fp32 tile scales, bf16 rope (656 for 512/64)."""
    return kv_lora_rank + 4 * (kv_lora_rank // FP8_TILE) + 2 * rope_dim


def _check_mla_dims(kv_lora_rank: int, rope_dim: int) -> None:
    if kv_lora_rank <= 0 or kv_lora_rank % FP8_TILE:
        raise ValueError(f"fp8 MLA needs kv_lora_rank a multiple of {FP8_TILE}, got {kv_lora_rank}")
    if rope_dim < 0 or rope_dim % 2:
        raise ValueError(f"fp8 MLA needs an even rope dim, got {rope_dim}")


def quantize_mla_fp8(c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Pack latent rows into the fp8 layout.

    Args:
        c_kv: [..., kv_lora_rank] (after kv_a_layernorm), kv_lora_rank a multiple of 128.
        k_pe: [..., rope_dim] (after RoPE); stored as bf16, not quantised.
    Returns:
        [..., mla_fp8_row_bytes(kv_lora_rank, rope_dim)] uint8.
    """
    kv_lora_rank, rope_dim = c_kv.shape[-1], k_pe.shape[-1]
    _check_mla_dims(kv_lora_rank, rope_dim)
    lead = c_kv.shape[:-1]
    tiles = c_kv.reshape(*lead, kv_lora_rank // FP8_TILE, FP8_TILE)  # [..., n_tiles, 128]
    values, scale = _quantize_vectors(tiles)
    values = values.reshape(*lead, kv_lora_rank)  # [..., kv_lora_rank]
    rope = k_pe.to(torch.bfloat16).contiguous()
    return torch.cat(
        [values.view(torch.uint8), scale.contiguous().view(torch.uint8), rope.view(torch.uint8)],
        dim=-1,
    )


def mla_fp8_views(
    rows: torch.Tensor, kv_lora_rank: int, rope_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Typed views (no copy when rows are contiguous, e.g. a whole cache) into fp8 latent rows.

    Args:
        rows: [..., row_bytes] uint8 with ``row_bytes == mla_fp8_row_bytes(...)``.
    Returns:
        (values [..., kv_lora_rank] float8_e4m3fn, scales [..., kv_lora_rank // 128] float32,
        rope [..., rope_dim] bfloat16); writing into them writes the rows.
    """
    _check_mla_dims(kv_lora_rank, rope_dim)
    row_bytes = mla_fp8_row_bytes(kv_lora_rank, rope_dim)
    if rows.dtype != torch.uint8 or rows.shape[-1] != row_bytes:
        raise ValueError(
            f"expected uint8 rows of {row_bytes} bytes, got {rows.dtype} {tuple(rows.shape)}"
        )
    scale_end = kv_lora_rank + 4 * (kv_lora_rank // FP8_TILE)
    return (
        rows[..., :kv_lora_rank].view(torch.float8_e4m3fn),
        rows[..., kv_lora_rank:scale_end].view(torch.float32),
        rows[..., scale_end:].view(torch.bfloat16),
    )


def dequantize_mla_fp8(
    rows: torch.Tensor, kv_lora_rank: int, rope_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack fp8 latent rows.

    Args:
        rows: [..., row_bytes] uint8.
    Returns:
        (c_kv [..., kv_lora_rank] float32 = e4m3 value * tile scale, k_pe [..., rope_dim]
        float32 from the stored bf16).
    """
    values, scales, rope = mla_fp8_views(rows.contiguous(), kv_lora_rank, rope_dim)
    lead = rows.shape[:-1]
    tiles = values.float().reshape(*lead, kv_lora_rank // FP8_TILE, FP8_TILE)
    c_kv = (tiles * scales.unsqueeze(-1)).reshape(*lead, kv_lora_rank)  # [..., kv_lora_rank]
    return c_kv, rope.float()


def quantize_indexer_fp8(k: torch.Tensor) -> torch.Tensor:
    """Rotate indexer keys with ``hadamard`` and pack them as fp8 rows.

    Args:
        k: [..., head_dim] un-rotated keys (after k_norm and RoPE), head_dim a power of two.
    Returns:
        [..., head_dim + 4] uint8: e4m3 values of ``hadamard(k) / s``, then the fp32 scale s.
    """
    values, scale = _quantize_vectors(hadamard(k))
    return torch.cat([values.view(torch.uint8), scale.unsqueeze(-1).view(torch.uint8)], dim=-1)


def indexer_fp8_views(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Typed views into fp8 indexer rows: (values [..., D] float8_e4m3fn, scale [...] float32)."""
    head_dim = rows.shape[-1] - 4
    if rows.dtype != torch.uint8 or head_dim <= 0 or head_dim % 4:
        raise ValueError(
            f"expected uint8 rows of head_dim + 4 bytes, got {rows.dtype} {tuple(rows.shape)}"
        )
    scale = rows[..., head_dim:].view(torch.float32)  # [..., 1]
    return rows[..., :head_dim].view(torch.float8_e4m3fn), scale.squeeze(-1)


def dequantize_indexer_fp8(rows: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float32 keys, in the Hadamard-rotated space (``hadamard`` undoes it:
    the rotation is symmetric and orthonormal, so it is its own inverse)."""
    values, scale = indexer_fp8_views(rows.contiguous())
    return values.float() * scale.unsqueeze(-1)
