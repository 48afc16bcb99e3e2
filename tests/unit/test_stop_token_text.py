"""A stop token's text (EOS or ``stop_token_ids``) is not part of the output text, as vLLM: the
token is among ``token_ids``, its text only with ``include_stop_str_in_output``, whatever
``skip_special_tokens`` says."""

from __future__ import annotations

import pytest

from attnserve import LLM, SamplingParams
from attnserve.presets import DEFAULT_MODEL


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT_MODEL, dtype="float32")


def _greedy(llm, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, **kw)
    return llm.generate(["def fibonacci(n):"], params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stop_token_text_is_left_out(llm, skip_special_tokens):
    free = _greedy(llm)
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)  # the first time the model writes it
    tok = llm.get_tokenizer()
    out = _greedy(llm, stop_token_ids=[stop], skip_special_tokens=skip_special_tokens)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.text == tok.decode(free.token_ids[:first], skip_special_tokens=skip_special_tokens)
    kept = _greedy(llm, stop_token_ids=[stop], include_stop_str_in_output=True,
                   skip_special_tokens=skip_special_tokens)
    assert kept.text == tok.decode(free.token_ids[: first + 1], skip_special_tokens=skip_special_tokens)
    assert kept.text != out.text
