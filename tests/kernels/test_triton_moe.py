"""ops/triton_moe.py under Triton's interpreter: the pair alignment's invariants, and the two
grouped expert kernels against FusedExperts' PyTorch path (SwiGLU, GPT-OSS's clamped form with
biases, experts without tokens, pairs of other ranks' experts dropped), float32 and float16."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from attnserve.layers.fused import override_impl  # noqa: E402
from attnserve.layers.moe import FusedExperts  # noqa: E402
from attnserve.ops.triton_moe import align_pairs, fused_experts  # noqa: E402
from tests.unit.test_moe import _randomise  # noqa: E402


@pytest.mark.parametrize("block_m", [16, 32])
def test_align_pairs_groups_every_pair_once_in_tiles_of_one_expert(block_m):
    g = torch.Generator().manual_seed(0)
    num_experts = 6
    ids = torch.randint(-2, num_experts + 2, (53,), generator=g)  # some ids belong to other ranks
    pairs, tile_expert = align_pairs(ids, num_experts, block_m)
    p = ids.shape[0]
    assert pairs.shape[0] % block_m == 0 and pairs.shape[0] == tile_expert.shape[0] * block_m
    valid = [i for i in range(p) if 0 <= ids[i] < num_experts]
    placed = [int(x) for x in pairs if x < p]
    assert sorted(placed) == valid  # each kept pair once, the others dropped
    for tile, e in enumerate(tile_expert.tolist()):
        rows = [int(x) for x in pairs[tile * block_m:(tile + 1) * block_m] if x < p]
        if e < 0:
            assert not rows
        else:
            assert rows and all(int(ids[r]) == e for r in rows)
    used = [e for e in tile_expert.tolist() if e >= 0]
    assert used == sorted(used)  # experts in order, each run contiguous


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("clamped", [False, True])
@pytest.mark.parametrize("tokens", [1, 19])
def test_kernels_match_the_torch_path(dtype, clamped, tokens):
    g = torch.Generator().manual_seed(tokens)
    ex = FusedExperts(6, 48, 40, bias=clamped, swiglu_limit=7.0 if clamped else None,
                      swiglu_alpha=1.702 if clamped else None)
    _randomise(ex, 3, std=1.0 if clamped else 0.3)
    ex = ex.to(dtype)
    x = torch.randn(tokens, 48, generator=g).to(dtype)
    ids = torch.randint(0, 4, (tokens, 2), generator=g)  # experts 4 and 5 get no tokens
    ids[:, 1] = (ids[:, 0] + 1 + torch.randint(0, 3, (tokens,), generator=g)) % 4
    weights = torch.rand(tokens, 2, generator=g)
    want = ex._forward_torch(x, weights, ids).float()
    with override_impl("triton"):
        got = ex(x, weights, ids).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_pairs_of_other_ranks_are_dropped():
    """A tensor-parallel rank holding experts 2..5 of 8: pairs routed elsewhere contribute 0."""
    g = torch.Generator().manual_seed(5)
    ex = FusedExperts(4, 32, 32)
    _randomise(ex, 4, std=0.3)
    ex.first_expert = 2
    x = torch.randn(9, 32, generator=g)
    ids = torch.randint(0, 8, (9, 3), generator=g)
    weights = torch.rand(9, 3, generator=g)
    mine = (ids >= 2) & (ids < 6)
    got = fused_experts(x, ex.w13, ex.w2, weights, ids - 2)
    ref = ex._forward_torch(x, torch.where(mine, weights, 0.0), torch.where(mine, ids, 2)).float()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert mine.any() and (~mine).any()


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_engine_with_the_moe_kernels_matches_the_torch_path(family, tmp_path):
    """A tiny MoE model end to end, every fused op on its Triton kernel (interpreter) against
    the PyTorch path: the same greedy tokens, logprobs within 1e-4."""
    from attnserve import LLM, SamplingParams
    from tests.models.parity import build_hf_model, make_prompts
    from tests.models.test_parity_moe import FAMILIES

    model_type, kwargs = FAMILIES[family]
    build_hf_model(model_type, kwargs, tmp_path)
    prompts = [{"prompt_token_ids": p} for p in make_prompts([5, 13])]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    llm = LLM(str(tmp_path), dtype="float32")
    want = llm.generate(prompts, params)
    with override_impl("triton"):
        got = llm.generate(prompts, params)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tid, lp in lb.items():
                assert abs(la[tid].logprob - lp.logprob) < 1e-4


def test_long_prefill_chunks_keep_the_loop():
    from attnserve.layers.moe import KERNEL_MAX_TOKENS

    ex = FusedExperts(4, 16, 16)
    with override_impl("triton"):
        assert ex._use_kernel(torch.zeros(KERNEL_MAX_TOKENS, 16))
        assert not ex._use_kernel(torch.zeros(KERNEL_MAX_TOKENS + 1, 16))
    assert not ex._use_kernel(torch.zeros(4, 16))  # CPU tensors: the loop
    gelu = FusedExperts(4, 16, 16, act="gelu")
    with override_impl("triton"):
        assert not gelu._use_kernel(torch.zeros(4, 16))  # no kernel for this activation
