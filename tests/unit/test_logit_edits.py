"""The sampler's logit edits: ``logit_bias``, ``allowed_token_ids``, ``bad_words`` bans and a
structured-output bitmask, against hand computations and per-element references; their checks
where they enter (``SamplingParams``, ``check_params_for_model``); and that a batch using none
of them builds no tensor for them and samples exactly as before.
"""

from __future__ import annotations

import pytest
import torch

from attnserve.engine.engine import PromptError, check_params_for_model
from attnserve.layers.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    apply_token_bitmask,
    bad_words_bans,
    unpack_bitmask,
)
from attnserve.sampling_params import SamplingParams, StructuredOutputsParams

V = 70  # not a multiple of 32: the last bitmask word is partly padding


def batch(params, *, outputs=None, bitmask=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.from_params(params, [None] * n, outputs or [[] for _ in range(n)],
                                     [[] for _ in range(n)], None, "cpu", token_bitmask=bitmask)


def test_unused_edits_build_nothing_and_change_nothing():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5)]
    b = batch(params)
    assert b.logit_bias is None and b.allowed_token_ids is None and b.token_bitmask is None
    logits = torch.randn(2, V)
    assert apply_token_bitmask(logits, b) is logits  # no copy
    assert torch.equal(apply_penalties(logits, b), logits)


def test_logit_bias_and_allowed_token_ids_against_hand_computation():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0, logit_bias={"3": 100, 7: -2.5}),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, allowed_token_ids=[5, 60, 5], logit_bias={60: 1.0})]
    out = apply_penalties(logits, batch(params))
    want = logits.clone()
    want[0, 3] += 100.0
    want[0, 7] -= 2.5
    want[2] = float("-inf")
    want[2, 5] = logits[2, 5]
    want[2, 60] = logits[2, 60] + 1.0
    assert torch.equal(out, want)
    sampled = Sampler()(logits, batch(params)).sampled_token_ids.tolist()
    assert sampled[0] == 3 and sampled[1] == int(logits[1].argmax())
    assert sampled[2] == (60 if want[2, 60] > want[2, 5] else 5)


def test_allowed_token_ids_hold_for_random_draws():
    allowed = [2, 33, 64, 69]
    params = [SamplingParams(temperature=1.5, allowed_token_ids=allowed)] * 64
    draws = Sampler()(torch.randn(64, V), batch(params)).sampled_token_ids.tolist()
    assert set(draws) <= set(allowed) and len(set(draws)) > 1


def test_bad_words_bans_follow_the_output_tail():
    words = [[9], [4, 5], [1, 2, 3]]
    assert bad_words_bans(words, []) == [9]
    assert bad_words_bans(words, [7, 4]) == [9, 5]
    assert bad_words_bans(words, [4, 1, 2]) == [9, 3]
    assert bad_words_bans(words, [1, 2, 4]) == [9, 5]
    assert bad_words_bans(words, [2]) == [9]


def _reference_unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.tensor([[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)]
                         for r in range(bitmask.shape[0])])


def test_bitmask_unpacking_and_masking_against_references():
    gen = torch.Generator().manual_seed(1)
    words = (V + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # every token
    assert torch.equal(unpack_bitmask(bitmask, V), _reference_unpack(bitmask, V))
    logits = torch.randn(4, V, generator=gen)
    b = batch([SamplingParams()] * 4, bitmask=([0, 1, 3], bitmask))
    out = apply_token_bitmask(logits, b)
    want = logits.clone()
    for row, allowed in zip([0, 1, 3], _reference_unpack(bitmask, V)):
        want[row, ~allowed] = float("-inf")
    assert torch.equal(out, want)
    xgr = pytest.importorskip("xgrammar")  # its own CPU kernel agrees
    theirs = logits[[0, 1, 3]].clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=V)
    assert torch.equal(theirs, out[[0, 1, 3]])


def test_sampler_draws_only_what_the_bitmask_allows_and_logprobs_see_it():
    allowed = torch.zeros(2, V, dtype=torch.bool)
    allowed[0, [1, 40, 69]] = True
    allowed[1, 0] = True
    bits = torch.zeros(2, 96, dtype=torch.int64)
    bits[:, :V] = allowed.long()
    words = (bits.view(2, 3, 32) << torch.arange(32)).sum(-1)  # [2, 3], bit j of word i
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    params = [SamplingParams(temperature=1.0, logprobs=2), SamplingParams(temperature=0.0, logprobs=2)]
    for _ in range(5):
        out = Sampler()(torch.randn(2, V), batch(params, bitmask=([0, 1], bitmask)))
        tokens = out.sampled_token_ids.tolist()
        assert tokens[0] in (1, 40, 69) and tokens[1] == 0
        assert out.logprobs.logprobs[1, 0] == 0.0  # the only allowed token has all the mass


@pytest.mark.parametrize("fields,name", [
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {1: 100.5}}, "logit_bias"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"bad_words": ["  "]}, "bad_words"),
    ({"bad_words": ["w"] * 129}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"structured_outputs": {"json": "{", "regex": None}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"a": {1, 2}}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "frob": 1}}, "structured_outputs"),
    ({"structured_outputs": "json"}, "structured_outputs"),
])
def test_params_refuse_bad_edits(fields, name):
    with pytest.raises(ValueError) as err:
        SamplingParams(**fields)
    assert str(err.value).startswith(name), err.value


def test_token_ids_are_bounded_by_the_vocabulary():
    check_params_for_model(SamplingParams(logit_bias={V - 1: 1.0}, allowed_token_ids=[0, V - 1]), V)
    for fields in ({"logit_bias": {V: 1.0}}, {"allowed_token_ids": [3, V]}):
        with pytest.raises(PromptError, match=next(iter(fields))):
            check_params_for_model(SamplingParams(**fields), V)


def test_structured_outputs_params_keys():
    a = StructuredOutputsParams(json='{"type": "object",  "properties": {"b": {}, "a": {}}}')
    b = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    c = StructuredOutputsParams(json={"type": "object", "properties": {"a": {}, "b": {}}})
    assert a.cache_key() == b.cache_key() != c.cache_key()  # spacing no, property order yes
    assert StructuredOutputsParams(choice=("x", "y")).kind == "choice"
    p = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert p.structured_outputs.regex == "[0-9]+"
