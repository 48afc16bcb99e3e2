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
    assert_parity,
    build_hf_model,
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
    later = [base[:16] + make_prompts([5], seed=8)[0], base[:12] + make_prompts([9], seed=9)[0], base + [7, 8]]
    ref = hf_reference(model, later, MAX_TOKENS)
    llm = LLM(str(path), dtype="float32", block_size=4)
    run_engine(llm, first, params())
    outs = run_engine(llm, later, params())
    assert [o.num_cached_tokens for o in outs] == [16, 12, 24]
    assert_parity(ref, outs, prompt_logprobs=False)


def test_preemption(family):
    name, path, _, prompts, ref = family
    # a sliding window bounds each sequence's blocks, so those families need a smaller pool
    windowed = "sliding_window" in FAMILIES[name][1]
    llm = LLM(str(path), dtype="float32", block_size=4, max_model_len=64,
              num_gpu_blocks_override=8 if windowed else 22, max_num_batched_tokens=8 if windowed else 2048)
    outs = run_engine(llm, prompts, params(prompt_logprobs=3))
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0, "the budget did not force a preemption"
    assert_parity(ref, outs)


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
