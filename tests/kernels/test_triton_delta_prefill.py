"""ops/state/delta_prefill_triton.py (the chunked gated-delta-rule prefill) under Triton's interpreter,
against the PyTorch twins ``gated_delta_prefill`` and ``kda_prefill`` (``attention/state``).

Kernels: varlen batches whose lengths sit on the chunk boundaries (1, BT-1, BT, BT+1, several
chunks, and an empty sequence), at chunk 16 (one sub-block: the doubling inverse alone), 32 and
64 (two and four sub-blocks: the N, N^2, N^3 terms; KDA runs at 64 only when its cap is lifted);
grouped heads (Hv = 2 Hk), dk and dv not powers of two, state rows in random order in a larger
pool, every other sequence with a (nonzero) initial state. KDA with weak decays (g in
(-0.05, 0]) and strong ones (g in (-20, -5] per token and channel, tens of nats per sub-block:
a factored exp(cum_t) exp(-cum_j) would overflow), and once against the plain token-by-token
recurrence. Tolerances: float32 outputs and states within 1e-5 (abs and rel; sums run in
another order); fp16 inputs within 2e-3 (the state kernel's dot operands are fp16: a few fp16
ulps). Rows the call does not own are bit-identical afterwards; a negative row is skipped
(state untouched, outputs zero); the chunk size changes rounding only.

Engine: ``tests/kernels/test_triton_gdn.py::test_engine_with_the_fused_decode_matches_torch``
runs TRITON_GDN (qwen3_next) and TRITON_KDA (kimi_linear), whose prefills go through these
kernels (chunked, so later chunks start from a state), against TORCH_GDN / TORCH_KDA within
1e-4; here only that the two backends name the kernels. And the kernels' GPU launches compile
for sm_90 within its shared memory (no GPU needed).
"""

from __future__ import annotations

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from attnserve.attention.state import gated_delta_prefill  # noqa: E402
from attnserve.attention.state.kda import kda_prefill  # noqa: E402
from attnserve.attention.state.triton_backends import TritonGDNBackend, TritonKDABackend  # noqa: E402
from attnserve.ops.state import delta_prefill_triton as prefill_ops  # noqa: E402
from attnserve.ops.state.delta_prefill_triton import (  # noqa: E402
    fused_delta_rule_prefill,
    fused_gated_delta_prefill,
    fused_kda_prefill,
)
from tests.kernels.sm90 import compile_for_sm90  # noqa: E402

# name -> (sequence lengths, Hk, Hv, dk, dv, chunk_size)
GDN_CASES = {
    "chunk16": ([1, 15, 16, 17, 33], 1, 2, 24, 20, 16),
    "chunk64": ([65, 0, 3], 1, 2, 16, 16, 64),  # an empty sequence: its state is still (re)written
}
KDA_CASES = {
    "chunk16": ([1, 15, 16, 17, 33], 1, 1, 20, 16, 16),
    "chunk32": ([33, 2], 1, 1, 16, 16, 32),  # KDA's largest chunk (MAX_CHUNK_PER_CHANNEL)
    "chunk64": ([66], 1, 1, 16, 16, 64),  # run at 64 here, to cover the [64, 64] levels
}
DECAYS = {"weak": (0.0, 0.05), "strong": (5.0, 15.0)}  # g = -(low + span * U[0, 1))


def make_inputs(lens, hk, hv, dk, dv, dtype, gen, per_channel=False, decay=(0.0, 1.0)):
    t = sum(lens)
    q, k = (torch.randn(t, hk, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=gen).to(dtype)
    low, span = decay
    g = -(low + span * torch.rand(t, hv, *((dk,) if per_channel else ()), generator=gen))
    beta = torch.rand(t, hv, generator=gen).to(dtype)
    return q, k, v, g, beta


def batch(lens, gen, pool_extra=3):
    """query_start_loc, rows in random order in a larger pool, every other sequence with a state."""
    b = len(lens)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    pool = b + pool_extra
    rows = torch.randperm(pool, generator=gen)[:b]
    init = torch.arange(b) % 2 == 0
    return qsl, rows, init, pool


def check(fused, twin, inputs, state, qsl, rows, init, dtype, chunk_size, l2=True):
    ours, ref = state.clone(), state.clone()
    kw = dict(query_start_loc=qsl, state_indices=rows, has_initial_state=init, use_qk_l2norm=l2)
    got = fused(*inputs, ours, **kw, chunk_size=chunk_size)
    want = twin(*inputs, ref, **kw, chunk_size=chunk_size)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # half inputs: half dot operands (four ulps)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)
    unused = torch.ones(state.shape[0], dtype=torch.bool)
    unused[rows] = False
    assert torch.equal(ours[unused], state[unused]), "rows outside state_indices changed"
    return got, ours


@pytest.mark.parametrize(("name", "dtype"), [("chunk16", torch.float32), ("chunk64", torch.float32),
                                             ("chunk64", torch.float16)])
def test_gdn_matches_the_twin(name, dtype):
    lens, hk, hv, dk, dv, chunk = GDN_CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    l2 = name != "chunk64"  # use_qk_l2norm=False there, with keys of norm about 1 (else the rule diverges)
    q, k, v, g, beta = make_inputs(lens, hk, hv, dk, dv, dtype, gen)
    if not l2:
        q, k = (x / (dk**0.5) for x in (q, k))
    qsl, rows, init, pool = batch(lens, gen)
    state = torch.randn(pool, hv, dk, dv, generator=gen)
    check(fused_gated_delta_prefill, gated_delta_prefill, (q, k, v, g, beta), state, qsl, rows, init, dtype, chunk,
          l2=l2)


@pytest.mark.parametrize(("name", "dtype", "decay"), [
    ("chunk16", torch.float32, "strong"), ("chunk16", torch.float16, "weak"), ("chunk32", torch.float32, "weak"),
    ("chunk64", torch.float32, "strong")])
def test_kda_matches_the_twin(name, dtype, decay, monkeypatch):
    lens, hk, hv, dk, dv, chunk = KDA_CASES[name]
    monkeypatch.setattr(prefill_ops, "MAX_CHUNK_PER_CHANNEL", 64)
    gen = torch.Generator().manual_seed(len(name) + len(decay))
    inputs = make_inputs(lens, hk, hv, dk, dv, dtype, gen, per_channel=True, decay=DECAYS[decay])
    qsl, rows, init, pool = batch(lens, gen)
    state = torch.randn(pool, hv, dk, dv, generator=gen)
    check(fused_kda_prefill, kda_prefill, inputs, state, qsl, rows, init, dtype, chunk)


def test_strong_decays_match_the_recurrence():
    """With g in (-20, -5] per channel the twin's chunked form and the kernel both equal the plain
    token-by-token recurrence (the state forgets most of the past within a token)."""
    gen = torch.Generator().manual_seed(7)
    lens, dk, dv = [21], 16, 16
    q, k, v, g, beta = make_inputs(lens, 1, 1, dk, dv, torch.float32, gen, per_channel=True, decay=DECAYS["strong"])
    state = torch.randn(1, 1, dk, dv, generator=gen)
    s = state[0, 0].clone()
    qn = q[:, 0] * torch.rsqrt((q[:, 0] ** 2).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
    kn = k[:, 0] * torch.rsqrt((k[:, 0] ** 2).sum(-1, keepdim=True) + 1e-6)
    want = []
    for i in range(lens[0]):
        s = s * g[i, 0].exp()[:, None]
        s = s + kn[i][:, None] * (beta[i, 0] * (v[i, 0] - kn[i] @ s))[None, :]
        want.append(qn[i] @ s)
    got = fused_kda_prefill(q, k, v, g, beta, state, query_start_loc=torch.tensor([0, 21], dtype=torch.int32),
                            state_indices=torch.tensor([0]), has_initial_state=torch.tensor([True]),
                            use_qk_l2norm=True, chunk_size=16)
    torch.testing.assert_close(got[:, 0], torch.stack(want), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[0, 0], s, rtol=1e-5, atol=1e-5)


def test_chunk_size_changes_rounding_only():
    gen = torch.Generator().manual_seed(11)
    lens = [21, 5]
    inputs = make_inputs(lens, 1, 2, 16, 16, torch.float32, gen)
    qsl, rows, init, pool = batch(lens, gen)
    state = torch.randn(pool, 2, 16, 16, generator=gen)
    outs = []
    for chunk in (8, 32):  # 8 runs as 16, the smallest chunk
        s = state.clone()
        outs.append((fused_gated_delta_prefill(*inputs, s, query_start_loc=qsl, state_indices=rows,
                                               has_initial_state=init, chunk_size=chunk), s))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)


def test_negative_rows_are_skipped():
    gen = torch.Generator().manual_seed(5)
    lens = [3, 17, 2]
    q, k, v, g, beta = make_inputs(lens, 1, 2, 16, 16, torch.float32, gen)
    qsl = torch.tensor([0, 3, 20, 22], dtype=torch.int32)
    state = torch.randn(4, 2, 16, 16, generator=gen)
    rows = torch.tensor([2, -1, 0])
    init = torch.tensor([True, True, False])
    ours, twin = state.clone(), state.clone()
    got = fused_gated_delta_prefill(q, k, v, g, beta, ours, query_start_loc=qsl, state_indices=rows,
                                    has_initial_state=init, use_qk_l2norm=True, chunk_size=16)
    live = torch.tensor([True] * 3 + [False] * 17 + [True] * 2)
    want = gated_delta_prefill(q[live], k[live], v[live], g[live], beta[live], twin,
                               query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32),
                               state_indices=rows[[0, 2]], has_initial_state=init[[0, 2]], use_qk_l2norm=True)
    torch.testing.assert_close(got[live], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[~live], torch.zeros_like(got[~live]))
    for row in (1, 3):  # nobody's row, the skipped sequence's included: bit-identical
        assert torch.equal(ours[row], state[row])
    torch.testing.assert_close(ours, twin, rtol=1e-5, atol=1e-5)


def test_empty_batch_and_bad_inputs():
    z = torch.zeros
    qsl, rows, init = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0]), torch.tensor([False])
    kw = dict(query_start_loc=qsl, state_indices=rows, has_initial_state=init)
    q, v, g, beta, state = z(2, 2, 8), z(2, 4, 8), z(2, 4), z(2, 4), z(1, 4, 8, 8)
    empty = fused_gated_delta_prefill(z(0, 2, 8), z(0, 2, 8), z(0, 4, 8), z(0, 4), z(0, 4), state,
                                      query_start_loc=torch.tensor([0], dtype=torch.int32),
                                      state_indices=torch.zeros(0, dtype=torch.long),
                                      has_initial_state=torch.zeros(0, dtype=torch.bool))
    assert empty.shape == (0, 4, 8)
    with pytest.raises(ValueError, match="cannot share"):
        fused_gated_delta_prefill(z(2, 3, 8), z(2, 3, 8), v, g, beta, state, **kw)
    with pytest.raises(ValueError, match="Gated DeltaNet wants g"):
        fused_gated_delta_prefill(q, q, v, z(2, 4, 8), beta, state, **kw)
    with pytest.raises(ValueError, match="KDA wants"):
        fused_kda_prefill(q, q, v, z(2, 4, 8), beta, state, **kw)
    with pytest.raises(ValueError, match="beta must be"):
        fused_gated_delta_prefill(q, q, v, g, z(2, 2), state, **kw)
    with pytest.raises(ValueError, match="state must be"):
        fused_gated_delta_prefill(q, q, v, g, beta, z(1, 4, 8, 4), **kw)
    with pytest.raises(ValueError, match="state_indices and has_initial_state"):
        fused_gated_delta_prefill(q, q, v, g, beta, state, query_start_loc=qsl, state_indices=torch.tensor([0, 1]),
                                  has_initial_state=init)
    with pytest.raises(ValueError, match="query_start_loc must be"):
        fused_gated_delta_prefill(q, q, v, g, beta, state, query_start_loc=qsl.float(), state_indices=rows,
                                  has_initial_state=init)
    with pytest.raises(ValueError, match="must be float32, float16 or bfloat16"):
        fused_gated_delta_prefill(q.double(), q, v, g, beta, state, **kw)
    with pytest.raises(ValueError, match="head_k_dim 512"):
        fused_gated_delta_prefill(z(2, 1, 512), z(2, 1, 512), z(2, 1, 8), z(2, 1), z(2, 1), z(1, 1, 512, 8), **kw)
    with pytest.raises(ValueError, match="block_v must be"):
        fused_delta_rule_prefill(q, q, v, g, beta, state, **kw, block_v=24)


def test_the_triton_backends_take_the_kernel():
    assert TritonGDNBackend.prefill is fused_gated_delta_prefill
    assert TritonKDABackend.prefill is fused_kda_prefill


# The kernels' GPU launches at their pinned configs (bf16 inputs, float32 state: GDN at chunk 64,
# KDA at 32), compiled for sm_90 (``sm90.py``); the float32 variants (three-pass tf32) compile too,
# but slowly, and are left to the GPU benchmark.
_LAUNCHES = r"""
from attnserve.ops.state import delta_prefill_triton as P

record(P, "_intra_kernel", "_state_kernel")
bf = torch.bfloat16
qsl, rows, init = torch.tensor([0, 100, 256], dtype=torch.int32), torch.arange(2), torch.ones(2, dtype=torch.bool)
for kda in (False, True):
    q = torch.zeros(256, 32 if kda else 16, 128, dtype=bf)
    g = torch.zeros(256, 32, *((128,) if kda else ()))
    fn = P.fused_kda_prefill if kda else P.fused_gated_delta_prefill
    fn(q, q.clone(), torch.zeros(256, 32, 128, dtype=bf), g, torch.zeros(256, 32, dtype=bf),
       torch.zeros(3, 32, 128, 128), query_start_loc=qsl, state_indices=rows, has_initial_state=init,
       use_qk_l2norm=True)
"""


def test_kernels_compile_for_sm90():
    assert len(compile_for_sm90(_LAUNCHES)) == 4
