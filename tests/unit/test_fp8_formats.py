"""The fp8 MLA latent row, the fp8 indexer key row and the Hadamard rotation, checked against a
hand-written reading of their definitions (an e4m3 encoder/decoder written from the bit
layout, not torch's cast), plus round-trip error bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attnserve.kvcache.fp8 import (
    dequantize_indexer_fp8,
    dequantize_mla_fp8,
    hadamard,
    indexer_fp8_views,
    mla_fp8_row_bytes,
    mla_fp8_views,
    pow2_scale,
    quantize_act_fp8,
    quantize_indexer_fp8,
    quantize_mla_fp8,
)
from attnserve.kvcache.spec import IndexerCacheSpec, MLAAttentionSpec

# ------------------------------------------------------------------ independent definitions


def expected_scale(amax: float) -> float:
    """2^ceil(log2(max(amax, 1e-4) / 448)), with the quotient rounded to float32 as stored."""
    ratio = float(np.float32(max(np.float32(amax), np.float32(1e-4))) / np.float32(448.0))
    return 2.0 ** math.ceil(math.log2(ratio))


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """Round float64 values (|v| <= 448) to e4m3fn, nearest-even: 3 mantissa bits per binade,
    binade exponents -6..8, subnormals on the 2^-9 grid."""
    a = v.abs()
    e = torch.floor(torch.log2(a.clamp_min(2.0**-6))).clamp(-6, 8)
    step = torch.exp2(e - 3)
    return torch.copysign(torch.round(a / step) * step, v)


def e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    """Bytes -> float64 from the e4m3fn bit layout: s eeee mmm, bias 7, exp 0 is subnormal."""
    b = b.long()
    sign, exp, man = (b >> 7) & 1, (b >> 3) & 0xF, b & 7
    normal = (1 + man / 8.0) * torch.exp2((exp - 7).double())
    sub = man / 8.0 * 2.0**-6
    val = torch.where(exp == 0, sub, normal)
    assert not ((exp == 15) & (man == 7)).any(), "NaN byte"
    return torch.where(sign == 1, -val, val)


def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bf16 bit pattern by integer round-to-nearest-even on the fp32 bits."""
    bits = x.float().contiguous().view(torch.int32).long() & 0xFFFFFFFF
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded & 0xFFFF


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Butterfly Walsh-Hadamard transform (natural / Sylvester order), orthonormal, float64."""
    x = x.double().clone()
    n, h = x.shape[-1], 1
    while h < n:
        x = x.view(*x.shape[:-1], n // (2 * h), 2, h)  # [..., blocks, pair, h]
        x = torch.stack([x[..., 0, :] + x[..., 1, :], x[..., 0, :] - x[..., 1, :]], dim=-2)
        x = x.reshape(*x.shape[:-3], n)
        h *= 2
    return x / math.sqrt(n)


def latent_inputs(gen: torch.Generator, n: int, rank: int, rope: int):
    """Tiles of very different magnitude, an all-zero tile, subnormal values, exact ties."""
    c_kv = torch.randn(n, rank, generator=gen)
    c_kv[0, :128] = 0.0
    c_kv[1, :128] *= 1e-6  # amax below the 1e-4 floor
    c_kv[2, :128] *= 1e-3
    c_kv[2, 5] = 100.0  # big scale: the small values become e4m3 subnormals
    c_kv[3, :128] = torch.tensor([448.0, 1.0625, 1.1875, -2.125, 3.0, 0.0] * 21 + [1.0, 1.0])
    c_kv[4] *= 3000.0
    return c_kv, torch.randn(n, rope, generator=gen) * 10


# ------------------------------------------------------------------ scale


def test_pow2_scale_matches_definition():
    gen = torch.Generator().manual_seed(0)
    amax = torch.cat(
        [
            torch.rand(2000, generator=gen) * 10.0 ** torch.randint(-7, 5, (2000,), generator=gen),
            torch.tensor([0.0, 1e-4, 448.0, 224.0, 896.0, 448.0 * 2**-20, 1.0, 3.5e4]),
            torch.tensor([448.0]).nextafter(torch.tensor([1e9])),
            torch.tensor([448.0]).nextafter(torch.tensor([0.0])),
        ]
    )
    got = pow2_scale(amax)
    want = torch.tensor([expected_scale(a) for a in amax.tolist()], dtype=torch.float32)
    assert torch.equal(got, want)
    mantissa, _ = torch.frexp(got)
    assert (mantissa == 0.5).all()  # powers of two
    special = got[-10:].tolist()  # 0, 1e-4, 448, 224, 896, 448/2^20, 1, 3.5e4, 448+, 448-
    assert special[:6] == [2.0**-22, 2.0**-22, 1.0, 0.5, 2.0, 2.0**-20]
    assert special[-2:] == [2.0, 1.0]


# ------------------------------------------------------------------ MLA latent rows


def test_mla_row_layout_and_spec_bytes():
    assert mla_fp8_row_bytes(512, 64) == 656
    assert (
        mla_fp8_row_bytes(512, 64) == MLAAttentionSpec(block_size=16, dtype="fp8").bytes_per_token
    )
    assert (
        mla_fp8_row_bytes(256, 16)
        == MLAAttentionSpec(
            block_size=4, dtype="fp8", kv_lora_rank=256, qk_rope_head_dim=16
        ).bytes_per_token
    )
    gen = torch.Generator().manual_seed(1)
    rows = quantize_mla_fp8(torch.randn(3, 512, generator=gen), torch.randn(3, 64, generator=gen))
    assert rows.dtype == torch.uint8 and rows.shape == (3, 656)
    with pytest.raises(ValueError):
        quantize_mla_fp8(torch.randn(2, 96), torch.randn(2, 8))


@pytest.mark.parametrize("rank,rope", [(512, 64), (256, 16)])
def test_mla_bytes_match_definition(rank, rope):
    gen = torch.Generator().manual_seed(2)
    c_kv, k_pe = latent_inputs(gen, 12, rank, rope)
    rows = quantize_mla_fp8(c_kv, k_pe)
    tiles = rank // 128
    assert rows.shape == (12, rank + 4 * tiles + 2 * rope)
    # scales: fp32 little-endian at [rank, rank + 4 * tiles)
    scales = torch.from_numpy(rows[:, rank : rank + 4 * tiles].numpy().copy().view("<f4"))
    amax = c_kv.view(12, tiles, 128).abs().amax(-1)
    want_scales = torch.tensor([[expected_scale(a) for a in r] for r in amax.tolist()])
    assert torch.equal(scales, want_scales.float())
    # values: e4m3(x / s), decoded from the raw bytes
    x_over_s = c_kv.double().view(12, tiles, 128) / want_scales.double().unsqueeze(-1)
    got = e4m3_decode(rows[:, :rank]).view(12, tiles, 128)
    assert torch.equal(got, e4m3_round(x_over_s))
    # ties round to even: 1.0625 -> 1.0, 1.1875 -> 1.25, -2.125 -> -2.0 (tile scale is 1)
    assert got[3, 0, :4].tolist() == [448.0, 1.0, 1.25, -2.0]
    assert (got[0, 0] == 0).all() and (got[2, 0].abs() < 2**-6).sum() > 100  # subnormals used
    # rope: bf16 bits, little-endian
    rope_bits = torch.from_numpy(rows[:, -2 * rope :].numpy().copy().view("<u2").astype(np.int64))
    assert torch.equal(rope_bits, bf16_bits(k_pe))


@pytest.mark.parametrize("rank,rope", [(512, 64), (128, 8)])
def test_mla_roundtrip_error_within_e4m3_bounds(rank, rope):
    gen = torch.Generator().manual_seed(3)
    c_kv, k_pe = latent_inputs(gen, 16, rank, rope)
    c_back, pe_back = dequantize_mla_fp8(quantize_mla_fp8(c_kv, k_pe), rank, rope)
    assert c_back.dtype == torch.float32 and pe_back.dtype == torch.float32
    s = pow2_scale(c_kv.view(16, -1, 128).abs().amax(-1)).repeat_interleave(128, dim=-1)
    # half an ulp: 2^-4 relative in a normal binade, s * 2^-10 among subnormals
    bound = torch.maximum(c_kv.abs() * 2.0**-4, s * 2.0**-10)
    assert ((c_back - c_kv).abs() <= bound).all()
    assert ((pe_back - k_pe).abs() <= k_pe.abs() * 2.0**-8).all()
    assert torch.equal(pe_back, k_pe.bfloat16().float())


def test_mla_views_write_through_a_cache():
    rank, rope = 256, 16
    cache = torch.zeros(3, 4, mla_fp8_row_bytes(rank, rope), dtype=torch.uint8)
    values, scales, pe = mla_fp8_views(cache, rank, rope)
    assert values.shape == (3, 4, rank) and scales.shape == (3, 4, 2) and pe.shape == (3, 4, rope)
    assert values.dtype == torch.float8_e4m3fn and pe.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    c_kv, k_pe = torch.randn(rank, generator=gen), torch.randn(rope, generator=gen)
    row = quantize_mla_fp8(c_kv, k_pe)
    cache[1, 2] = row
    assert scales[1, 2].tolist() == pow2_scale(c_kv.view(2, 128).abs().amax(-1)).tolist()
    assert torch.equal(pe[1, 2], k_pe.bfloat16())
    pe[2, 0] = 1.5  # views alias the cache bytes
    assert torch.equal(dequantize_mla_fp8(cache[2, 0], rank, rope)[1], torch.full((rope,), 1.5))


# ------------------------------------------------------------------ Hadamard


def test_hadamard_is_orthonormal_and_sylvester():
    for n in (4, 32, 128):
        eye = torch.eye(n, dtype=torch.float64)
        h = hadamard(eye)  # rows: the rotation applied to each basis vector
        assert torch.allclose(h @ h.T, eye, atol=1e-12)
        assert torch.allclose(h, h.T)  # symmetric, hence its own inverse
        assert torch.allclose(h[0], torch.full((n,), n**-0.5, dtype=torch.float64))
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(64, 128, generator=gen), torch.randn(64, 128, generator=gen)
    hx, hy = hadamard(x), hadamard(y)
    assert torch.allclose(hx.double(), fwht(x), atol=1e-5)
    assert torch.allclose((hx * hy).sum(-1), (x * y).sum(-1), rtol=1e-5, atol=1e-4)
    assert torch.allclose(hadamard(hx), x, atol=1e-5)
    assert hadamard(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        hadamard(torch.randn(3, 96))


# ------------------------------------------------------------------ indexer rows and activations


@pytest.mark.parametrize("head_dim", [128, 32])
def test_indexer_bytes_match_definition(head_dim):
    gen = torch.Generator().manual_seed(6)
    k = torch.randn(40, head_dim, generator=gen) * torch.logspace(-5, 3, 40).unsqueeze(-1)
    rows = quantize_indexer_fp8(k)
    assert rows.dtype == torch.uint8 and rows.shape == (40, head_dim + 4)
    if head_dim == 128:
        assert rows.shape[-1] == IndexerCacheSpec(block_size=64, dtype="fp8").bytes_per_token
    rotated = fwht(k)
    scale = torch.from_numpy(rows[:, head_dim:].numpy().copy().view("<f4")).squeeze(-1)
    want_scale = torch.tensor([expected_scale(a) for a in hadamard(k).abs().amax(-1).tolist()])
    assert torch.equal(scale, want_scale.float())
    got = e4m3_decode(rows[:, :head_dim])
    # compare against the float32 rotation actually quantised (fwht agrees to ~1e-7 relative)
    assert torch.equal(got, e4m3_round(hadamard(k).double() / want_scale.double().unsqueeze(-1)))
    assert (e4m3_round(rotated / want_scale.double().unsqueeze(-1)) != got).float().mean() < 0.01
    values, view_scale = indexer_fp8_views(rows)
    assert torch.equal(view_scale, scale) and values.dtype == torch.float8_e4m3fn
    back = dequantize_indexer_fp8(rows)  # rotated space
    bound = torch.maximum(rotated.abs() * 2.0**-4, want_scale.double().unsqueeze(-1) * 2.0**-10)
    assert ((back.double() - rotated).abs() <= bound + 1e-6 * rotated.abs()).all()
    rel = (hadamard(back) - k).norm(dim=-1) / k.norm(dim=-1)
    assert rel.max() < 0.05  # un-rotated, the whole vector is within a few percent


def test_quantize_act_fp8_per_vector():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 3, 64, generator=gen) * torch.rand(5, 3, 1, generator=gen) * 50
    values, scale = quantize_act_fp8(x)
    assert values.shape == x.shape and scale.shape == (5, 3) and values.dtype == torch.float32
    assert torch.equal(scale, pow2_scale(x.abs().amax(-1)))
    assert torch.equal(values.double(), e4m3_round(x.double() / scale.double().unsqueeze(-1)))
    assert torch.equal(values, values.to(torch.float8_e4m3fn).float())  # e4m3-representable
    assert values.abs().max() <= 448
    err = (values * scale.unsqueeze(-1) - x).abs()
    assert (err <= torch.maximum(x.abs() * 2.0**-4, scale.unsqueeze(-1) * 2.0**-10)).all()
