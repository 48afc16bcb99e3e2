"""ops/moe/experts_triton.py under Triton's interpreter: the pair alignment's invariants, and the two
grouped expert kernels against FusedExperts' PyTorch path (SwiGLU, GPT-OSS's clamped form with
biases, experts without tokens, pairs of other ranks' experts dropped), float32 and float16, with
the decode tiles and the prefill tiles (tall tiles, several per expert, grouped launch order);
the tile config chosen per batch size."""

from __future__ import annotations

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from attnserve.layers.fused import override_impl  # noqa: E402
from attnserve.layers.moe import FusedExperts  # noqa: E402
from attnserve.ops.moe.experts_triton import (  # noqa: E402
    CONFIGS,
    MoEConfig,
    align_pairs,
    fused_experts,
    moe_config,
)
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
    ref = ex._forward_torch(x, torch.where(mine, weights, 0.0), torch.where(mine, ids, 2)).float()
    for num_global in (None, 8):  # the tiles sized by this rank's experts or by all of them
        got = fused_experts(x, ex.w13, ex.w2, weights, ids - 2, num_global_experts=num_global)
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


def test_every_chunk_size_runs_the_kernels():
    ex = FusedExperts(4, 16, 16)
    with override_impl("triton"):
        assert ex._use_kernel(torch.zeros(1, 16))
        assert ex._use_kernel(torch.zeros(16384, 16))  # long prefill chunks too: no loop
    assert not ex._use_kernel(torch.zeros(4, 16))  # CPU tensors: the loop
    gelu = FusedExperts(4, 16, 16, act="gelu")
    with override_impl("triton"):
        assert not gelu._use_kernel(torch.zeros(4, 16))  # no kernel for this activation


def test_tile_config_grows_with_the_pairs_per_expert():
    """Decode batches keep the 16- and 32-row tiles; prefill-sized batches get 64 and 128 rows
    in grouped launch order; float32 (outside the interpreter) stays at most 64 x 32 x 32."""
    assert moe_config(torch.float16, 1.0) == MoEConfig(16, 64, 64, 64)  # decode: one short tile
    assert moe_config(torch.float16, 32.0) == MoEConfig(32, 64, 64, 64)
    assert moe_config(torch.float16, 33.0).block_m == 64 and moe_config(torch.float16, 192.0).block_m == 64
    assert moe_config(torch.float16, 8192 * 8 / 256).block_m == 128  # DeepSeek-V3, an 8K-token chunk
    big = moe_config(torch.float16, 16384 * 8 / 128)  # Qwen3-30B-A3B, a 16K-token chunk
    assert big.block_m == 128 and big.block_n_down >= 128 and big.group_m > 0
    sizes = [moe_config(torch.float16, m) for m in (1, 16, 17, 64, 65, 192, 193, 256, 1e6)]
    assert [c.block_m for c in sizes] == sorted(c.block_m for c in sizes)
    assert [b for b, _ in CONFIGS] == sorted(b for b, _ in CONFIGS) and CONFIGS[-1][0] == float("inf")
    for _, cfg in CONFIGS:  # every block a power of two (tl.arange)
        for v in (cfg.block_m, cfg.block_n_up, cfg.block_n_down, cfg.block_k, cfg.num_warps):
            assert v & (v - 1) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_tiles_match_the_torch_path(dtype):
    """A batch big enough per expert for the largest tiles (128 rows): several tiles per expert,
    more tiles than one launch group (8) and a short last group, two N blocks of gate/up, partial
    last K steps, an expert without pairs; the config is the one the batch selects."""
    g = torch.Generator().manual_seed(11)
    e, hidden, inter, tokens = 3, 96, 160, 800
    ex = FusedExperts(e, hidden, inter)
    _randomise(ex, 12, std=0.2)
    ex = ex.to(dtype)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.randint(0, 2, (tokens, 1), generator=g)  # expert 2 gets no pairs
    weights = torch.rand(tokens, 1, generator=g)
    cfg = moe_config(dtype, tokens / e)
    assert cfg == CONFIGS[-1][1]  # the prefill tiles (the interpreter runs the 16-bit table)
    num_tiles = align_pairs(ids.reshape(-1), e, cfg.block_m)[1].shape[0]
    assert num_tiles > cfg.group_m and num_tiles % cfg.group_m and (ids.reshape(-1).bincount() > cfg.block_m).all()
    assert hidden % cfg.block_k and inter % cfg.block_k and inter > cfg.block_n_up
    want = ex._forward_torch(x, weights, ids).float()
    with override_impl("triton"):
        got = ex(x, weights, ids).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_every_config_gives_the_same_result():
    """The pinned configs (tile rows, N and K blocks, launch order) differ only in speed."""
    g = torch.Generator().manual_seed(3)
    ex = FusedExperts(3, 40, 72, bias=True, swiglu_limit=7.0, swiglu_alpha=1.702)
    _randomise(ex, 4, std=0.5)
    x = torch.randn(100, 40, generator=g)
    ids = torch.randint(0, 3, (100, 1), generator=g)
    weights = torch.rand(100, 1, generator=g)
    want = ex._forward_torch(x, weights, ids).float()
    for _, cfg in CONFIGS + ((0, MoEConfig(64, 32, 32, 32, group_m=3)),):
        got = fused_experts(x, ex.w13, ex.w2, weights, ids, act="swiglu_clamped", w13_bias=ex.w13_bias,
                            w2_bias=ex.w2_bias, swiglu_limit=7.0, swiglu_alpha=1.702, config=cfg)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_bad_shapes_are_refused():
    ex = FusedExperts(2, 16, 8)
    with pytest.raises(ValueError, match="do not fit"):
        fused_experts(torch.zeros(3, 12), ex.w13, ex.w2, torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.long))
