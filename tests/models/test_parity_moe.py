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

from attnserve import SamplingParams
from tests.models.parity import (
    VOCAB,
    build_hf_model,
    check_chunked_prefill,
    check_plain,
    check_preemption,
    check_prefix_hits,
    hf_reference,
    make_prompts,
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
    check_plain(family)


def test_chunked_prefill(family):
    check_chunked_prefill(family)


def test_prefix_cache_hits(family):
    check_prefix_hits(family)


def test_preemption(family):
    check_preemption(family)


