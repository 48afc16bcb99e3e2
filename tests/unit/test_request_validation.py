"""Requests are checked completely where they enter, so nothing a request carries fails inside a step.

Each case here was a probe that got past the checks (issue #24): ``top_k`` or a stop token id
beyond int64 overflowed the sampler's tensors inside the step and killed the engine thread;
``logprobs`` / ``prompt_logprobs`` beyond the vocabulary failed inside the step and left the
engine unable to run anything again (or spinning); NaN sampling floats were accepted; wrong
types raised raw TypeErrors. Now ``SamplingParams`` refuses them with a ValueError that names
the field, ``LLM.generate`` refuses what only the model bounds before anything is queued, and
the engine afterwards serves a normal request exactly as a fresh one does.
"""

from __future__ import annotations

import math

import pytest

from attnserve import LLM, SamplingParams
from attnserve.sampling_params import INT64_MAX
from tests.models.parity import build_hf_model

VOCAB = 256
BAD_PARAMS = [  # (fields, the field the error names)
    ({"top_k": 10**19}, "top_k"),
    ({"stop_token_ids": [10**19], "min_tokens": 2}, "stop_token_ids"),
    ({"seed": 10**30}, "seed"),
    ({"seed": -1}, "seed"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"top_p": math.nan}, "top_p"),
    ({"min_p": math.nan}, "min_p"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"n": 2.0}, "n"),
    ({"n": True}, "n"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 10**20}, "max_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": 10**19}, "prompt_logprobs"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"detokenize": None}, "detokenize"),
    ({"stop": 5}, "stop"),
    ({"stop": {"a": 1}}, "stop"),
    ({"stop_token_ids": ["7"]}, "stop_token_ids"),
    ({"stop_token_ids": 3.0}, "stop_token_ids"),
]


@pytest.mark.parametrize("fields,name", BAD_PARAMS, ids=[f"{n}={v!r}"[:40] for (v, n) in
                                                         [(list(f.values())[0], n) for f, n in BAD_PARAMS]])
def test_sampling_params_refuse_what_a_step_cannot_run(fields, name):
    with pytest.raises(ValueError) as err:
        SamplingParams(**fields)
    assert str(err.value).startswith(name), err.value  # the server maps the first word to `param`


def test_edges_that_are_valid():
    assert SamplingParams(top_k=INT64_MAX).top_k == INT64_MAX  # above the vocabulary: no limit
    assert SamplingParams(stop=".", stop_token_ids=7).stop_token_ids == [7]
    p = SamplingParams(seed=INT64_MAX, n=3)
    assert [p.child_seed(i) for i in range(3)] == [INT64_MAX, 0, 1]  # wraps within int64
    assert SamplingParams(temperature=0, top_p=1).greedy  # integers are numbers


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_hf_model("llama", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128), path)
    return LLM(str(path), dtype="float32", max_model_len=64, max_num_seqs=8)


PROMPTS = [{"prompt_token_ids": [5, 9, 12, 40]}, {"prompt_token_ids": [7, 1, 99]}]
GOOD = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True, logprobs=2)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _assert_idle(llm):
    engine = llm.llm_engine
    assert not engine.states and not engine.scheduler.requests


MODEL_BOUNDED = [  # only the model bounds these: refused by the engine before anything is queued
    SamplingParams(logprobs=10**6),
    SamplingParams(prompt_logprobs=10**6),
    SamplingParams(logprobs=VOCAB + 1),
    SamplingParams(min_tokens=2, stop_token_ids=[VOCAB + 5]),
]


@pytest.mark.parametrize("bad", MODEL_BOUNDED, ids=["logprobs", "prompt_logprobs", "logprobs_vocab", "stop_id"])
def test_model_bounded_params_are_refused_and_the_engine_goes_on(llm, bad):
    before = _tokens(llm.generate(PROMPTS, GOOD))
    with pytest.raises(ValueError):
        llm.generate(PROMPTS, [GOOD, bad])  # the bad one second: the good first is not queued either
    _assert_idle(llm)
    assert _tokens(llm.generate(PROMPTS, GOOD)) == before


def test_bad_prompts_leave_nothing_queued(llm):
    before = _tokens(llm.generate(PROMPTS, GOOD))
    for bad in (None, 5, {"text": "x"}, [1.5, 2], [VOCAB + 1]):
        with pytest.raises(ValueError):
            llm.generate([PROMPTS[0], bad], GOOD)
        _assert_idle(llm)
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(PROMPTS, [GOOD, {"temperature": 0.5}])
    _assert_idle(llm)
    assert _tokens(llm.generate(PROMPTS, GOOD)) == before


def test_top_k_above_the_vocabulary_means_no_limit(llm):
    seeded = dict(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    off = _tokens(llm.generate(PROMPTS, SamplingParams(top_k=0, **seeded)))
    assert _tokens(llm.generate(PROMPTS, SamplingParams(top_k=10**12, **seeded))) == off
