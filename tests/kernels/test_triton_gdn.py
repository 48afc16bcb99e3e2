"""ops/state/delta_decode_triton.py (the fused gated-delta-rule decode step) and TRITON_GDN under Triton's
interpreter, against the PyTorch twin ``delta_rule_decode`` (``attention/state``).

Kernel: several shapes (Hk < Hv grouping with groups of 2 and 3, dk and dv not powers of two,
odd batches, several value tiles per head, per-key-channel decay as KDA), three steps in a row,
state rows in random order in a larger pool. Tolerances: float32 outputs and states within
1e-5 (abs and rel; the sums run in another order and exp/rsqrt differ by an ulp); fp16 q/k/v
with a float32 state: the state within 1e-5, the fp16 output within 1e-3 (one fp16 ulp, where
the float32 results round to either side). Rows the step does not own are bit-identical
afterwards; a negative row is skipped (state untouched, output zeros).

Engine: a tiny qwen3_next (3 GDN layers, Hk 2 < Hv 4) with ``attention_backend="TRITON_GDN"``
gives TORCH_GDN's greedy tokens (and a tiny kimi_linear with TRITON_KDA, the per-channel decay,
TORCH_KDA's; and jamba with TRITON_MAMBA, minimax with TRITON_LIGHTNING, the kernels of
``test_triton_state_decode.py``), and prompt and output logprobs within 1e-4, over two prompts
of different lengths, chunked so that decodes and prefills share steps. Also: the CPU default
stays TORCH_GDN, and a state-layer backend named by the user applies to its layers only. And the
kernel's GPU launches (bf16 inputs, fp32 and bf16 states) compile for sm_90 (no GPU needed).
"""

from __future__ import annotations

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from attnserve.arch import LayerKind  # noqa: E402
from attnserve.attention.registry import BackendSelectionError, override_for  # noqa: E402
from attnserve.attention.state import delta_rule_decode  # noqa: E402
from attnserve.ops.state.delta_decode_triton import fused_delta_rule_decode  # noqa: E402
from tests.kernels.sm90 import compile_for_sm90  # noqa: E402

# (batch, Hk, Hv, dk, dv, decay per key channel, block_v)
SHAPES = {
    "grouped": (1, 2, 4, 16, 16, False, None),
    "odd_sizes": (5, 1, 3, 24, 40, False, None),  # group of 3, dk and dv not powers of two
    "tiled_v": (3, 2, 4, 32, 48, False, 16),  # three value tiles per head, the last one partial
    "per_channel": (3, 4, 4, 20, 24, True, None),  # KDA: one decay per key channel
}


def make_step(shape, dtype, gen):
    b, hk, hv, dk, dv, per_channel, _ = shape
    q = torch.randn(b, hk, dk, generator=gen).to(dtype)
    k = torch.randn(b, hk, dk, generator=gen).to(dtype)
    v = torch.randn(b, hv, dv, generator=gen).to(dtype)
    g = -torch.rand(b, hv, dk if per_channel else 1, generator=gen)  # log decay in (-1, 0]
    beta = torch.rand(b, hv, generator=gen).to(dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_kernel_matches_the_twin(name, dtype):
    shape = SHAPES[name]
    b, _, hv, dk, dv, _, block_v = shape
    gen = torch.Generator().manual_seed(len(name))
    pool = 2 * b + 3
    state = torch.randn(pool, hv, dk, dv, generator=gen)
    rows = torch.randperm(pool, generator=gen)[:b]  # random order, some rows unused
    ours, twin = state.clone(), state.clone()
    out_tol = 1e-5 if dtype == torch.float32 else 1e-3
    for step in range(3):
        q, k, v, g, beta = make_step(shape, dtype, gen)
        l2 = step != 1  # the twin's use_qk_l2norm=False too, once
        got = fused_delta_rule_decode(q, k, v, g, beta, ours, state_indices=rows, use_qk_l2norm=l2,
                                      block_v=block_v)
        want = delta_rule_decode(q, k, v, g, beta, twin, state_indices=rows, use_qk_l2norm=l2)
        assert got.dtype == dtype and got.shape == (b, hv, dv)
        torch.testing.assert_close(got, want, rtol=out_tol, atol=out_tol)
        torch.testing.assert_close(ours, twin, rtol=1e-5, atol=1e-5)
    unused = torch.ones(pool, dtype=torch.bool)
    unused[rows] = False
    assert torch.equal(ours[unused], state[unused]), "rows outside state_indices changed"
    assert not torch.equal(ours[rows], state[rows])


def test_per_head_decay_given_as_b_hv():
    """``g`` [B, Hv] (as the GDN layer gives it) is the same as [B, Hv, 1]."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = make_step(SHAPES["grouped"], torch.float32, gen)
    state = torch.randn(4, 4, 16, 16, generator=gen)
    a, c = state.clone(), state.clone()
    rows = torch.tensor([2])
    out_a = fused_delta_rule_decode(q, k, v, g[..., 0], beta, a, state_indices=rows, use_qk_l2norm=True)
    out_c = fused_delta_rule_decode(q, k, v, g, beta, c, state_indices=rows, use_qk_l2norm=True)
    assert torch.equal(out_a, out_c) and torch.equal(a, c)


def test_negative_rows_are_skipped():
    gen = torch.Generator().manual_seed(5)
    shape = SHAPES["odd_sizes"]
    q, k, v, g, beta = make_step(shape, torch.float32, gen)
    state = torch.randn(6, 3, 24, 40, generator=gen)
    rows = torch.tensor([4, -1, 0, -1, 2])
    ours, twin = state.clone(), state.clone()
    got = fused_delta_rule_decode(q, k, v, g, beta, ours, state_indices=rows, use_qk_l2norm=True)
    live = rows >= 0
    want = delta_rule_decode(q[live], k[live], v[live], g[live], beta[live], twin, state_indices=rows[live],
                             use_qk_l2norm=True)
    torch.testing.assert_close(got[live], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[~live], torch.zeros_like(got[~live]))
    for row in (1, 3, 5):  # nobody's row: bit-identical
        assert torch.equal(ours[row], state[row])
    torch.testing.assert_close(ours, twin, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused():
    q, k = torch.zeros(2, 3, 8), torch.zeros(2, 3, 8)
    v, beta, g = torch.zeros(2, 4, 8), torch.zeros(2, 4), torch.zeros(2, 4)
    with pytest.raises(ValueError, match="cannot share"):
        fused_delta_rule_decode(q, k, v, g, beta, torch.zeros(3, 4, 8, 8), state_indices=torch.tensor([0, 1]))
    q, k = torch.zeros(2, 2, 8), torch.zeros(2, 2, 8)
    with pytest.raises(ValueError, match="g must be"):
        fused_delta_rule_decode(q, k, v, torch.zeros(2, 4, 3), beta, torch.zeros(3, 4, 8, 8),
                                state_indices=torch.tensor([0, 1]))
    big = torch.zeros(1, 1, 512)
    with pytest.raises(ValueError, match="head_k_dim 512"):
        fused_delta_rule_decode(big, big, torch.zeros(1, 1, 8), torch.zeros(1, 1), torch.zeros(1, 1),
                                torch.zeros(1, 1, 512, 8), state_indices=torch.tensor([0]))


def test_a_state_backend_override_applies_to_its_layers_only():
    hybrid = {LayerKind.GDN, LayerKind.FULL}
    assert override_for("TRITON_GDN", LayerKind.GDN, hybrid) == "TRITON_GDN"
    assert override_for("TRITON_GDN", LayerKind.FULL, hybrid) is None
    assert override_for("TORCH_SDPA", LayerKind.FULL, hybrid) == "TORCH_SDPA"
    assert override_for("TORCH_SDPA", LayerKind.GDN, hybrid) is None
    # a model without GDN layers: the choice goes to the attention layers, where it fails
    assert override_for("triton_gdn", LayerKind.FULL, {LayerKind.FULL}) == "triton_gdn"
    assert override_for(None, LayerKind.GDN, hybrid) is None
    with pytest.raises(BackendSelectionError, match="unknown"):
        override_for("NOPE", LayerKind.FULL, hybrid)


@pytest.mark.parametrize(("model", "torch_name", "triton_name"),
                         [("qwen3_next", "TORCH_GDN", "TRITON_GDN"), ("kimi_linear", "TORCH_KDA", "TRITON_KDA"),
                          ("jamba", "TORCH_MAMBA", "TRITON_MAMBA"),  # ops/state/decode_triton.py
                          ("minimax", "TORCH_LIGHTNING", "TRITON_LIGHTNING")])
def test_engine_with_the_fused_decode_matches_torch(model, torch_name, triton_name, tmp_path):
    from attnserve import LLM, SamplingParams
    from tests.models.parity import make_prompts, run_engine
    from tests.models.test_parity_hybrid import build_hybrid

    build_hybrid(model, tmp_path)
    prompts = make_prompts([13, 6], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    outs = {}
    for name in (None, triton_name):  # None: the CPU default
        llm = LLM(str(tmp_path), dtype="float32", block_size=4, attention_backend=name, max_num_batched_tokens=8)
        names = llm.llm_engine.parts.backend_names
        assert (name or torch_name) in names and (torch_name if name else triton_name) not in names
        outs[name] = run_engine(llm, prompts, params)
    for a, b in zip(outs[None], outs[triton_name]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        steps = list(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]))
        steps += list(zip(a.outputs[0].logprobs, b.outputs[0].logprobs))
        assert len(steps) == len(a.prompt_token_ids) - 1 + 5
        for ea, eb in steps:
            assert ea.keys() == eb.keys()
            for tid in ea:
                assert abs(ea[tid].logprob - eb[tid].logprob) < 1e-4, (tid, ea[tid], eb[tid])


# The kernel's GPU launches (bf16 inputs, fp32 and bf16 states), compiled for sm_90 (``sm90.py``).
_LAUNCHES = r"""
from attnserve.ops.state import delta_decode_triton as G

record(G, "_delta_rule_decode_kernel")
bf = torch.bfloat16
for state_dtype, per_channel, block_v in [(torch.float32, False, None), (torch.float32, True, 8),
                                          (torch.float32, False, 64), (bf, False, 16)]:
    q = torch.zeros(4, 16, 128, dtype=bf)
    g = torch.zeros(4, 32, *((128,) if per_channel else ()))
    G.fused_delta_rule_decode(q, q.clone(), torch.zeros(4, 32, 128, dtype=bf), g, torch.zeros(4, 32, dtype=bf),
                              torch.zeros(9, 32, 128, 128, dtype=state_dtype), state_indices=torch.arange(4),
                              use_qk_l2norm=True, block_v=block_v)
"""


def test_kernel_compiles_for_sm90():
    assert len(compile_for_sm90(_LAUNCHES)) == 4
