"""ops/state/decode_triton.py (the fused Mamba-1 and lightning decode steps), TRITON_MAMBA and
TRITON_LIGHTNING under Triton's interpreter, against the PyTorch twins ``selective_scan_decode``
and ``lightning_attention_decode`` (``attention/state``).

Kernels: several shapes (channel, state and head dims not powers of two, odd batches, several
channel or value tiles with the last one partial, Mamba without D skip or z gate), three steps in
a row, state rows in random order in a larger pool. Tolerances: float32 outputs and states within
1e-5 (abs and rel; sums in another order, exp and sigmoid differ by an ulp); fp16 inputs with a
float32 state: the state within 1e-5, the fp16 output within 1e-3 (one fp16 ulp, where the
float32 results round to either side). Rows the step does not own are bit-identical afterwards; a
negative row is skipped (state untouched, output zeros); bad shapes are refused.

The engine-level runs (a tiny jamba with ``attention_backend="TRITON_MAMBA"``, a tiny minimax with
``"TRITON_LIGHTNING"``, against the torch backends) are cases of
``test_triton_gdn.py::test_engine_with_the_fused_decode_matches_torch``. And the kernels' GPU
launches (bf16 inputs, fp32 and bf16 states) compile for sm_90 (no GPU needed).
"""

from __future__ import annotations

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from attnserve.attention.state import lightning_attention_decode, selective_scan_decode  # noqa: E402
from attnserve.ops.state.decode_triton import (  # noqa: E402
    fused_lightning_decode,
    fused_selective_scan_decode,
)
from tests.kernels.sm90 import compile_for_sm90  # noqa: E402

# (batch, channels D, d_state N, with D skip and z gate, block_d)
MAMBA_SHAPES = {
    "jamba_like": (2, 32, 16, True, None),
    "odd_sizes": (5, 40, 12, True, None),  # D and N not powers of two
    "tiled_d": (3, 72, 8, True, 16),  # five channel tiles, the last one partial
    "no_skip_no_gate": (3, 24, 6, False, None),
}
# (batch, heads, dk, dv, block_v)
LIGHTNING_SHAPES = {
    "minimax_like": (2, 4, 16, 16, None),
    "odd_sizes": (5, 3, 24, 40, None),  # dk and dv not powers of two
    "tiled_v": (3, 2, 20, 48, 16),  # three value tiles per head, the last one partial
}


def mamba_step(shape, dtype, gen):
    b, d, n, gated, _ = shape
    x = torch.randn(b, d, generator=gen).to(dtype)
    dt = torch.nn.functional.softplus(torch.randn(b, d, generator=gen))  # float32, as ssm_params gives it
    a = -torch.rand(d, n, generator=gen) * 2 - 0.1  # negative
    bb, cc = (torch.randn(b, n, generator=gen).to(dtype) for _ in range(2))
    skip = torch.randn(d, generator=gen) if gated else None
    z = torch.randn(b, d, generator=gen).to(dtype) if gated else None
    return x, dt, a, bb, cc, skip, z


def lightning_step(shape, dtype, gen):
    b, h, dk, dv, _ = shape
    q, k = (torch.randn(b, h, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(b, h, dv, generator=gen).to(dtype)
    rates = torch.rand(h, generator=gen)  # decay exp(-s_h) in (0.37, 1]
    return q, k, v, rates


def run_three_steps(state, rows, dtype, step, ours_fn, twin_fn):
    ours, twin = state.clone(), state.clone()
    out_tol = 1e-5 if dtype == torch.float32 else 1e-3
    for _ in range(3):
        inputs = step()
        got = ours_fn(*inputs, ours, rows)
        want = twin_fn(*inputs, twin, rows)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=out_tol, atol=out_tol)
        torch.testing.assert_close(ours, twin, rtol=1e-5, atol=1e-5)
    unused = torch.ones(state.shape[0], dtype=torch.bool)
    unused[rows] = False
    assert torch.equal(ours[unused], state[unused]), "rows outside state_indices changed"
    assert not torch.equal(ours[rows], state[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(MAMBA_SHAPES))
def test_mamba_kernel_matches_the_twin(name, dtype):
    shape = MAMBA_SHAPES[name]
    b, d, n, _, block_d = shape
    gen = torch.Generator().manual_seed(len(name))
    pool = 2 * b + 3
    state = torch.randn(pool, d, n, generator=gen)
    rows = torch.randperm(pool, generator=gen)[:b]  # random order, some rows unused
    run_three_steps(
        state, rows, dtype, lambda: mamba_step(shape, dtype, gen),
        lambda *a: fused_selective_scan_decode(*a[:-1], state_indices=a[-1], block_d=block_d),
        lambda *a: selective_scan_decode(*a[:-1], state_indices=a[-1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(LIGHTNING_SHAPES))
def test_lightning_kernel_matches_the_twin(name, dtype):
    shape = LIGHTNING_SHAPES[name]
    b, h, dk, dv, block_v = shape
    gen = torch.Generator().manual_seed(len(name) + 7)
    pool = 2 * b + 3
    state = torch.randn(pool, h, dk, dv, generator=gen)
    rows = torch.randperm(pool, generator=gen)[:b]
    run_three_steps(
        state, rows, dtype, lambda: lightning_step(shape, dtype, gen),
        lambda *a: fused_lightning_decode(*a[:-1], state_indices=a[-1], block_v=block_v),
        lambda *a: lightning_attention_decode(*a[:-1], state_indices=a[-1]))


def test_negative_rows_are_skipped():
    gen = torch.Generator().manual_seed(5)
    rows = torch.tensor([4, -1, 0, -1, 2])
    live = rows >= 0
    for kind in ("mamba", "lightning"):
        if kind == "mamba":
            x, dt, a, bb, cc, skip, z = mamba_step(MAMBA_SHAPES["odd_sizes"], torch.float32, gen)
            state = torch.randn(6, 40, 12, generator=gen)
            ours, twin = state.clone(), state.clone()
            got = fused_selective_scan_decode(x, dt, a, bb, cc, skip, z, ours, state_indices=rows)
            want = selective_scan_decode(x[live], dt[live], a, bb[live], cc[live], skip, z[live], twin,
                                         state_indices=rows[live])
        else:
            q, k, v, rates = lightning_step(LIGHTNING_SHAPES["odd_sizes"], torch.float32, gen)
            state = torch.randn(6, 3, 24, 40, generator=gen)
            ours, twin = state.clone(), state.clone()
            got = fused_lightning_decode(q, k, v, rates, ours, state_indices=rows)
            want = lightning_attention_decode(q[live], k[live], v[live], rates, twin, state_indices=rows[live])
        torch.testing.assert_close(got[live], want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[~live], torch.zeros_like(got[~live])), kind
        for row in (1, 3, 5):  # nobody's row: bit-identical
            assert torch.equal(ours[row], state[row]), kind
        torch.testing.assert_close(ours, twin, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused():
    x, rows = torch.zeros(2, 8), torch.tensor([0, 1])
    a, bc = torch.zeros(8, 4), torch.zeros(2, 4)
    with pytest.raises(ValueError, match="ssm_state must be"):
        fused_selective_scan_decode(x, x, a, bc, bc, None, x, torch.zeros(3, 8, 5), state_indices=rows)
    with pytest.raises(ValueError, match="want B, C"):
        fused_selective_scan_decode(x, x, a, torch.zeros(2, 5), bc, None, x, torch.zeros(3, 8, 4), state_indices=rows)
    with pytest.raises(ValueError, match="state_indices must be"):
        fused_selective_scan_decode(x, x, a, bc, bc, None, x, torch.zeros(3, 8, 4), state_indices=rows[:1])
    q, v = torch.zeros(2, 3, 8), torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="decay_rates"):
        fused_lightning_decode(q, q, v, torch.zeros(4), torch.zeros(3, 3, 8, 4), state_indices=rows)
    with pytest.raises(ValueError, match="state must be"):
        fused_lightning_decode(q, q, v, torch.zeros(3), torch.zeros(3, 3, 4, 8), state_indices=rows)
    with pytest.raises(ValueError, match="power of two"):
        fused_lightning_decode(q, q, v, torch.zeros(3), torch.zeros(3, 3, 8, 4), state_indices=rows, block_v=3)


# The kernels' GPU launches (bf16 inputs, fp32 and bf16 states, several tiles), compiled for
# sm_90 (``sm90.py``).
_LAUNCHES = r"""
from attnserve.ops.state import decode_triton as S

record(S, "_selective_scan_decode_kernel", "_lightning_decode_kernel")
bf = torch.bfloat16
for state_dtype, gated, block_d in [(torch.float32, True, None), (torch.float32, False, 32), (bf, True, 128)]:
    x = torch.zeros(4, 8192, dtype=bf)
    S.fused_selective_scan_decode(x, torch.zeros(4, 8192), torch.zeros(8192, 16), torch.zeros(4, 16, dtype=bf),
                                  torch.zeros(4, 16, dtype=bf), torch.zeros(8192) if gated else None,
                                  x.clone() if gated else None, torch.zeros(9, 8192, 16, dtype=state_dtype),
                                  state_indices=torch.arange(4), block_d=block_d)
for state_dtype, block_v in [(torch.float32, None), (torch.float32, 64), (bf, 16)]:
    q = torch.zeros(4, 64, 128, dtype=bf)
    S.fused_lightning_decode(q, q.clone(), q.clone(), torch.zeros(64), torch.zeros(9, 64, 128, 128, dtype=state_dtype),
                             state_indices=torch.arange(4), block_v=block_v)
"""


def test_kernels_compile_for_sm90():
    assert len(compile_for_sm90(_LAUNCHES)) == 6
