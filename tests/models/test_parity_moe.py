"""Parity with transformers for the MoE families (mixtral, qwen3_moe, glm4_moe, gpt_oss).

Same protocol as ``test_standard_parity.py``: a tiny random float32 model, four engine paths
(plain, chunked prefill forced small, prefix-cache hits, preemption forced by a tiny block
budget), greedy tokens identical and log-probabilities within 1e-4, block pool checked after
every step. Before saving, parameters that transformers initialises to zero or to tiny values
(router and expert biases, GLM's score-correction bias, GPT-OSS sinks) are drawn at random so
that their loading and use are tested, and GPT-OSS's gate/up weights are scaled so that the
SwiGLU clamp (limit 7) is active. Prompts are longer than GPT-OSS's sliding window (8).
"""

from __future__ import annotations

import pytest
import torch

from attnserve import LLM, SamplingParams
from tests.models.parity import (
    VOCAB,
    assert_parity,
    build_hf_model,
    hf_reference,
    make_prompts,
    run_engine,
)

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
# gpt-oss's YaRN (beta 32/1, no truncation), scaled down so that max positions = factor * original
GPT_OSS_YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}

FAMILIES = {
    "mixtral": ("mixtral", dict(BASE, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            BASE,
            num_hidden_layers=3,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            head_dim=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "glm4_moe": (
        "glm4_moe",
        dict(
            BASE,
            num_hidden_layers=3,
            n_routed_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            use_qk_norm=True,
            attention_bias=True,
        ),
    ),
    "gpt_oss": (
        "gpt_oss",
        dict(
            BASE,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=64,
            head_dim=16,
            sliding_window=8,
            rope_parameters=GPT_OSS_YARN,
        ),
    ),
}

LENGTHS = [5, 12, 19, 27]
MAX_TOKENS = 16


def _randomise(model, name: str) -> None:
    """Give zero-initialised routing/bias parameters random values (seeded)."""
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if name == "gpt_oss" and pname.endswith(("_bias", "router.bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name == "gpt_oss" and pname.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name == "gpt_oss" and pname.endswith("experts.gate_up_proj"):
                p.mul_(8.0)  # gate/up values beyond the clamp limit of 7
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=g) * 0.3)


def build_family(name: str, out):
    model_type, kwargs = FAMILIES[name]
    model = build_hf_model(model_type, kwargs, out)
    _randomise(model, name)
    model.save_pretrained(out)  # transformers 5 spells qwen3_moe's expert count num_local_experts
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    model = build_family(request.param, out)
    prompts = make_prompts(LENGTHS)
    return request.param, out, model, prompts, hf_reference(model, prompts, MAX_TOKENS)


def params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3, **kw)


def test_plain(family):
    _, path, _, prompts, ref = family
    llm = LLM(str(path), dtype="float32", block_size=4)
    outs = run_engine(llm, prompts, params(prompt_logprobs=3))
    assert_parity(ref, outs)


def test_chunked_prefill(family):
    _, path, _, prompts, ref = family
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=7)
    outs = run_engine(llm, prompts, params(prompt_logprobs=3))
    assert_parity(ref, outs)


def test_prefix_cache_hits(family):
    _, path, model, _, _ = family
    base = make_prompts([24], seed=7)[0]
    first = [base]
    later = [
        base[:16] + make_prompts([5], seed=8)[0],
        base[:12] + make_prompts([9], seed=9)[0],
        base + [7, 8],
    ]
    ref = hf_reference(model, later, MAX_TOKENS)
    llm = LLM(str(path), dtype="float32", block_size=4)
    run_engine(llm, first, params())
    outs = run_engine(llm, later, params())
    assert [o.num_cached_tokens for o in outs] == [16, 12, 24]
    assert_parity(ref, outs, prompt_logprobs=False)


def test_preemption(family):
    _, path, _, prompts, ref = family
    llm = LLM(
        str(path), dtype="float32", block_size=4, max_model_len=64, num_gpu_blocks_override=22
    )
    outs = run_engine(llm, prompts, params(prompt_logprobs=3))
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0, (
        "the budget did not force a preemption"
    )
    assert_parity(ref, outs)
