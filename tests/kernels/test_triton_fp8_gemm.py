"""``ops/dense/fp8_gemm_triton``: the block-scaled FP8 GEMM and the activation quantiser against
their PyTorch twins, under Triton's interpreter (one pinned config; fp8 operands, as on the GPU).

Shapes with edge blocks (K and N not multiples of the block, M not of the tile), scales far from
1, an all-zero group; the quantiser equal to the bit (values and scales); the GEMM within float32
summation-order error of the twin, and the twin itself against a plain dequantise-then-matmul of
``models/quantized.dequantize_fp8_blocks``. Bad shapes, dtypes and blocks name the problem.
"""

from __future__ import annotations

import pytest
import torch

from attnserve.models.quantized import dequantize_fp8_blocks
from attnserve.ops.dense.fp8_gemm_triton import (
    fp8_block_matmul,
    fp8_block_matmul_torch,
    quantize_act_fp8_groups,
    quantize_act_fp8_groups_torch,
)


def _weight(n: int, k: int, block: tuple[int, int], gen: torch.Generator):
    """A block-fp8 weight as a checkpoint stores it: e4m3 values and float32 block scales."""
    bn, bk = block
    w = (torch.randn(n, k, generator=gen) * 200).to(torch.float8_e4m3fn)
    scale = torch.exp2(torch.randint(-12, -4, (-(-n // bn), -(-k // bk)), generator=gen).float())
    return w, scale * (1 + torch.rand(scale.shape, generator=gen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "group"), [(5, 200, 128), (67, 256, 64), (1, 48, 16)])
def test_quantiser_equals_its_twin(dtype, m, k, group):
    gen = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, k)).to(dtype)
    x[0, :group] = 0  # an all-zero group
    q, s = quantize_act_fp8_groups(x, group)
    q_ref, s_ref = quantize_act_fp8_groups_torch(x, group)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (m, -(-k // group))
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert s[0, 0] > 0 and not q[0, :group].float().any()
    # the round trip is within half a step of e4m3: 2^-4 relative, or half the subnormal step
    # (2^-10 of the group's scale) for values far below the group's amax
    per_value = s.repeat_interleave(group, dim=1)[:, :k]
    err = (q.float() * per_value - x.float()).abs()
    assert (err <= (2**-4 * x.float().abs()).maximum(2**-10 * per_value) * 1.0001).all()


@pytest.mark.parametrize(("m", "n", "k", "block"), [(5, 72, 200, (16, 64)), (70, 130, 256, (128, 128)),
                                                    (1, 40, 96, (32, 32))])
def test_matmul_equals_its_twin(m, n, k, block):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(m, k, generator=gen) * 3
    a, a_scale = quantize_act_fp8_groups_torch(x, block[1])
    w, w_scale = _weight(n, k, block, gen)
    got = fp8_block_matmul(a, a_scale, w, w_scale, block, out_dtype=torch.float32)
    want = fp8_block_matmul_torch(a, a_scale, w, w_scale, block, out_dtype=torch.float32)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # the twin is the dequantised weight's matmul
    dense = dequantize_fp8_blocks(w, w_scale, block, torch.float32)
    a_deq = a.float() * a_scale.repeat_interleave(block[1], dim=1)[:, :k]
    torch.testing.assert_close(want, a_deq @ dense.T, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    bf16 = fp8_block_matmul(a, a_scale, w, w_scale, block)
    # within one bf16 step (the interpreter's bf16 conversion truncates; the GPU's rounds)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), got, rtol=2**-7, atol=1e-6 * want.abs().max().item())


def test_empty_batch():
    w, w_scale = _weight(8, 32, (16, 16), torch.Generator().manual_seed(0))
    a, a_scale = quantize_act_fp8_groups(torch.zeros(0, 32), 16)
    assert fp8_block_matmul(a, a_scale, w, w_scale, (16, 16)).shape == (0, 8)


def test_bad_inputs_are_named():
    gen = torch.Generator().manual_seed(1)
    w, w_scale = _weight(40, 64, (16, 32), gen)
    a, a_scale = quantize_act_fp8_groups_torch(torch.randn(3, 64), 32)
    with pytest.raises(ValueError, match=r"w_scale has shape \(3, 2\), but w \(40, 64\) in blocks of \[32, 32\] needs \(2, 2\)"):
        fp8_block_matmul(a, a_scale, w, w_scale, (32, 32))
    with pytest.raises(ValueError, match="a has 64 columns but w has 48"):
        fp8_block_matmul(a, a_scale, w[:, :48], w_scale, (16, 32))
    with pytest.raises(ValueError, match="a_scale has shape"):
        fp8_block_matmul(a, a_scale[:, :1], w, w_scale, (16, 32))
    with pytest.raises(ValueError, match="w must be a 2-d float8_e4m3fn tensor"):
        fp8_block_matmul(a, a_scale, w.float(), w_scale, (16, 32))
    with pytest.raises(ValueError, match="power of two"):
        fp8_block_matmul(a, a_scale, w, w_scale, (16, 24))
    with pytest.raises(ValueError, match="activations must be"):
        quantize_act_fp8_groups(torch.randn(2, 3, 4), 16)
