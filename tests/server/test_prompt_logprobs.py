"""vLLM's ``prompt_logprobs`` through the official ``openai`` client (issue #23): the shape (one
entry per prompt token, the first None, then token id -> logprob, rank, decoded token), the
values (those of ``LLM.generate``), a one-token prompt's ``[None]``, the bound by
``max_logprobs`` and -1, and streams (the first chunk with text carries them)."""

from __future__ import annotations

import math

import openai
import pytest

from attnserve.entrypoints.openai.prompt_logprobs import (
    check_prompt_logprobs,
    render_prompt_logprobs,
)
from attnserve.entrypoints.openai.protocol import OpenAIError
from attnserve.outputs import Logprob
from attnserve.sampling_params import SamplingParams
from tests.server.conftest import MODEL_NAME

PROMPT = [5, 17, 300, 42, 9]
MSG = [{"role": "user", "content": "What is a list?"}]


def _check_against(entries, out) -> None:
    """``entries`` (the server's JSON) hold what ``out.prompt_logprobs`` (the engine's) hold."""
    assert entries[0] is None and len(entries) == len(out.prompt_logprobs)
    for got, want in zip(entries[1:], out.prompt_logprobs[1:]):
        assert set(got) == {str(t) for t in want}
        for tid, lp in want.items():
            e = got[str(tid)]
            assert math.isclose(e["logprob"], lp.logprob, abs_tol=1e-4)
            assert e["rank"] == lp.rank and e["decoded_token"] == lp.decoded_token


def test_completions_prompt_logprobs_match_the_engine(client, reference):
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0.0,
                                     extra_body={"prompt_logprobs": 2})
    want = reference.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))[0]
    entries = resp.choices[0].prompt_logprobs
    _check_against(entries, want)
    for tid, e in zip(PROMPT[1:], entries[1:]):
        assert str(tid) in e and 1 <= len(e) <= 3  # the prompt token, and the top 2
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1).choices[0].prompt_logprobs is None


def test_a_one_token_prompt_gives_none_first(client):
    resp = client.completions.create(model=MODEL_NAME, prompt=[5], max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert resp.choices[0].prompt_logprobs == [None]


def test_chat_prompt_logprobs_at_the_top_level(client, reference):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=2, temperature=0.0,
                                          extra_body={"prompt_logprobs": 1})
    ids = reference.get_tokenizer().encode(reference.get_tokenizer().apply_chat_template(MSG),
                                           add_special_tokens=False)
    want = reference.generate([ids], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))[0]
    assert len(resp.prompt_logprobs) == resp.usage.prompt_tokens == len(ids)
    _check_against(resp.prompt_logprobs, want)


@pytest.mark.parametrize("value, words", [(21, "limit of 20"), (-1, "limit of 20"), (-2, "or -1")])
def test_bounds_are_400s_naming_the_field(client, value, words):
    for call in (lambda: client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1,
                                                   extra_body={"prompt_logprobs": value}),
                 lambda: client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=1,
                                                        extra_body={"prompt_logprobs": value})):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.body["param"] == "prompt_logprobs" and words in info.value.body["message"]


def test_minus_one_is_the_whole_vocabulary():
    assert check_prompt_logprobs(-1, 2048, -1) == 2048  # --max-logprobs -1: no bound
    assert check_prompt_logprobs(-1, 2048, 4096) == 2048
    assert check_prompt_logprobs(None, 2048, 20) is None and check_prompt_logprobs(0, 2048, 20) == 0
    with pytest.raises(OpenAIError, match="limit of 2000"):
        check_prompt_logprobs(-1, 2048, 2000)


def test_minus_infinity_is_clamped_as_vllm_does():
    out = render_prompt_logprobs([None, {3: Logprob(-math.inf, 7, "a"), 4: Logprob(-0.5, 1, None)}])
    assert out == [None, {"3": {"logprob": -9999.0, "rank": 7, "decoded_token": "a"},
                          "4": {"logprob": -0.5, "rank": 1, "decoded_token": None}}]


def test_streams_send_them_with_the_first_text(client, reference):
    want = reference.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2))[0]
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0.0,
                                            stream=True, extra_body={"prompt_logprobs": 2}))
    carrying = [c for c in chunks if c.choices and getattr(c.choices[0], "prompt_logprobs", None) is not None]
    assert len(carrying) == 1 and carrying[0] is chunks[0]
    _check_against(carrying[0].choices[0].prompt_logprobs, want)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.outputs[0].text

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=3, temperature=0.0,
                                                 stream=True, extra_body={"prompt_logprobs": 1}))
    carrying = [i for i, c in enumerate(chunks) if getattr(c, "prompt_logprobs", None) is not None]
    assert carrying == [1]  # after the role chunk, with the first text
    assert chunks[1].prompt_logprobs[0] is None and len(chunks[1].prompt_logprobs) > 1
