"""Every RoPE scaling type through a family transformers supports with it, past the original
context length: prompts of up to 27 tokens plus 16 generated against an original maximum of 16.

Static scalings (linear, yarn, llama3, partial rotary) must match on all four engine paths.
Length-dependent ones change the rotation with the sequence length a forward pass sees. The
engine gives every token of a request that request's whole known length, so chunked prefill
equals transformers' one-shot prompt forward; for longrope it recomputes a sequence once it
outgrows the original context, as transformers' Phi-3 ``generate`` does, so preemption is
exact too. Dynamic NTK keys are rotated with the length at the time they were computed, so a
recompute after preemption legitimately differs; its preemption path is not compared. Both
bypass the prefix cache (a cached block's rotation depends on the length it was computed at).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest

from attnserve import LLM, SamplingParams
from attnserve.arch import read_arch
from tests.models.parity import (
    VOCAB,
    assert_parity,
    build_hf_model,
    hf_reference,
    make_prompts,
    run_engine,
)

ORIG = 16
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)

CASES = {
    "linear": ("llama", dict(BASE, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}), True),
    "yarn": ("llama", dict(BASE, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                  "original_max_position_embeddings": ORIG}), True),
    "llama3": ("llama", dict(BASE, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": ORIG}), True),
    "partial_rotary": ("phi3", dict(BASE, num_key_value_heads=4, partial_rotary_factor=0.5, bos_token_id=1,
                                    eos_token_id=2, pad_token_id=0), True),
    "dynamic": ("llama", dict(BASE, max_position_embeddings=ORIG,
                              rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}), False),
    # longrope is exact on every path (see the module docstring): True
    "longrope": ("phi3", dict(BASE, num_key_value_heads=4, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                              original_max_position_embeddings=ORIG, max_position_embeddings=128,
                              rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                               "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                               "long_factor": [2.0 + 0.5 * i for i in range(8)]}), True),
}
LENGTHS = [9, 17, 27, 21]


@functools.cache
def built(name: str):
    model_type, kwargs, _ = CASES[name]
    out = Path(tempfile.mkdtemp(prefix=f"rope_{name}_"))
    model = build_hf_model(model_type, kwargs, out)
    prompts = make_prompts(LENGTHS, seed=3)
    return name, out, CASES[name][2], prompts, hf_reference(model, prompts, 16), model


@pytest.fixture(params=sorted(CASES))
def case(request):
    return built(request.param)


def params(**kw):
    return SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2, **kw)


def test_plain(case):
    _, path, _, prompts, ref, _ = case
    outs = run_engine(LLM(str(path), dtype="float32", block_size=4, max_model_len=64), prompts,
                      params(prompt_logprobs=2))
    assert_parity(ref, outs)


def test_chunked_prefill(case):
    _, path, _, prompts, ref, _ = case
    chunked = LLM(str(path), dtype="float32", block_size=4, max_model_len=64, max_num_batched_tokens=5)
    assert_parity(ref, run_engine(chunked, prompts, params(prompt_logprobs=2)))


def test_prefix_hits(case):
    _, path, _, _, _, model = case
    base = make_prompts([20], seed=11)[0]
    later = [base[:12] + [5, 6, 7]]
    llm = LLM(str(path), dtype="float32", block_size=4, max_model_len=64)
    run_engine(llm, [base], params())
    out = run_engine(llm, later, params())
    rope = llm.llm_engine.arch.layers[0].rope
    length_dependent = rope.rope_type in ("dynamic", "longrope")
    assert out[0].num_cached_tokens == (0 if length_dependent else 12)
    assert_parity(hf_reference(model, later, 16), out, prompt_logprobs=False)


@pytest.mark.parametrize("name", sorted(k for k, v in CASES.items() if v[2]))
def test_preemption(name):
    _, path, _, prompts, ref, _ = built(name)
    tight = LLM(str(path), dtype="float32", block_size=4, max_model_len=64, num_gpu_blocks_override=20)
    assert_parity(ref, run_engine(tight, prompts, params(prompt_logprobs=2)))
    assert tight.llm_engine.scheduler.stats.num_preemptions > 0


def test_scaling_is_exercised(case):
    """The scaled rotation differs from plain RoPE at these positions (the test is not vacuous)."""
    name = case[0]

    model_type, kwargs, _ = CASES[name]
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type](**kwargs).to_dict()
    arch = read_arch(cfg)
    rope = arch.layers[0].rope
    assert rope.rope_type != "default" or rope.rotary_dim < arch.layers[0].head_size


def test_dynamic_ntk_at_the_original_length(tmp_path):
    """Dynamic NTK with max_position_embeddings 32 and factor 2 (issue #23): the default
    max_model_len is 64, as vLLM derives it (before, 32 refused a 33-token prompt), and prompts
    of 32 tokens (the last unscaled length) and 33 (the first scaled one) match transformers
    run fresh for each prompt. transformers' module keeps frequencies grown by a longer earlier
    call until a sequence is shorter than 32, so a 33-token prompt after a 41-token one differs
    there by ~0.2 in logprobs: ``hf_reference`` resets it, as a fresh model would be."""
    model = build_hf_model("llama", dict(BASE, max_position_embeddings=32, rope_parameters=CASES["dynamic"][1][
        "rope_parameters"]), tmp_path)
    prompts = make_prompts([32, 33], seed=5)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4)
    assert llm.llm_engine.max_model_len == 64
    few = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    assert_parity(hf_reference(model, prompts, 4), run_engine(llm, prompts, few))
