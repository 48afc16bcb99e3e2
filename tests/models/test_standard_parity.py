"""Parity with transformers for the standard-attention families, on every engine path.

For each family: a tiny random model (float32), a batch of prompts of different lengths, and
four runs through attnserve: plain; chunked prefill forced small; a shared prefix served from
the prefix cache; preemption forced by a tiny block budget. Each must give transformers'
greedy tokens and its log-probabilities within 1e-4, with the block pool intact after every step.
"""

from __future__ import annotations

import pytest

from attnserve import LLM, SamplingParams
from tests.models.parity import (
    VOCAB,
    build_hf_model,
    check_chunked_prefill,
    check_plain,
    check_preemption,
    check_prefix_hits,
    hf_reference,
    make_prompts,
    run_engine,
)

DENSE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

FAMILIES = {
    "llama_mha": ("llama", dict(DENSE, num_key_value_heads=4)),
    "llama3_gqa": ("llama", dict(DENSE, rope_parameters=LLAMA3_ROPE)),
    "qwen2": ("qwen2", dict(DENSE)),
    "qwen3": ("qwen3", dict(DENSE, head_dim=32)),
    "mistral_window": ("mistral", dict(DENSE, sliding_window=8)),
    "phi3_window": ("phi3", dict(DENSE, num_key_value_heads=4, sliding_window=8, pad_token_id=0, bos_token_id=1,
                                 eos_token_id=2)),
    "starcoder2": ("starcoder2", dict(DENSE, sliding_window=8, residual_dropout=0.0, embedding_dropout=0.0,
                                      bos_token_id=1, eos_token_id=2)),
}

LENGTHS = [5, 12, 19, 27]
MAX_TOKENS = 16


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    model_type, kwargs = FAMILIES[request.param]
    out = tmp_path_factory.mktemp(request.param)
    model = build_hf_model(model_type, kwargs, out)
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
    # a sliding window bounds each sequence's blocks, so those families need a smaller pool
    if "sliding_window" in FAMILIES[family[0]][1]:
        check_preemption(family, num_blocks=8, max_num_batched_tokens=8)
    else:
        check_preemption(family)


def test_window_is_exercised():
    """Widening the window of a sliding-window model changes attnserve's output: the mask is real."""
    model_type, kwargs = FAMILIES["mistral_window"]
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        build_hf_model(model_type, kwargs, Path(d1))
        build_hf_model(model_type, dict(kwargs, sliding_window=1000), Path(d2))
        prompt = make_prompts([30])
        a = run_engine(LLM(d1, dtype="float32"), prompt, params(prompt_logprobs=1))[0]
        b = run_engine(LLM(d2, dtype="float32"), prompt, params(prompt_logprobs=1))[0]
        last_a = a.prompt_logprobs[-1][prompt[0][-1]].logprob
        last_b = b.prompt_logprobs[-1][prompt[0][-1]].logprob
        assert abs(last_a - last_b) > 1e-3
