"""vLLM's request fields ``return_tokens_as_token_ids`` and ``spaces_between_special_tokens`` on
the completions and chat routes (issue 38, point 8).

``return_tokens_as_token_ids`` writes every logprob's token as "token_id:N" (vLLM's form, for
tokens that do not decode to text on their own): the ids decode back to the text, the top
logprobs are keyed the same way, and completions' ``text_offset`` still counts the text's
characters. ``spaces_between_special_tokens`` is accepted either way and changes no text: the
tokenizers here decode as transformers' fast ones, which ignore it.
"""

from __future__ import annotations

import re

import httpx
import pytest

from attnserve.sampling_params import SamplingParams
from tests.server.conftest import API_KEY, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOKEN_ID = re.compile(r"token_id:(\d+)")


def _ids(tokens: list[str]) -> list[int]:
    matches = [TOKEN_ID.fullmatch(t) for t in tokens]
    assert all(matches), tokens
    return [int(m.group(1)) for m in matches]


def _decode(server, ids: list[int]) -> str:
    r = httpx.post(server.base_url + "/detokenize", json={"tokens": ids}, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_completion_tokens_as_ids(client, server):
    kwargs = dict(model=MODEL_NAME, prompt="The capital of France is", max_tokens=6, temperature=0.0, logprobs=2,
                  echo=True)
    plain = client.completions.create(**kwargs).choices[0]
    as_ids = client.completions.create(**kwargs, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert as_ids.text == plain.text
    ids = _ids(as_ids.logprobs.tokens)
    prompt_ids = httpx.post(server.base_url + "/tokenize", json={"prompt": kwargs["prompt"]},
                            headers=AUTH).json()["tokens"]
    assert ids[: len(prompt_ids)] == prompt_ids  # echo: the prompt's tokens too
    assert _decode(server, ids) == as_ids.text
    assert as_ids.logprobs.token_logprobs == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    assert as_ids.logprobs.text_offset == plain.logprobs.text_offset  # offsets into the text, as without
    for token, top in zip(as_ids.logprobs.tokens[len(prompt_ids):], as_ids.logprobs.top_logprobs[len(prompt_ids):]):
        _ids(list(top))
        assert token in top  # the sampled token among the top ones (greedy)


def test_chat_tokens_as_ids(client, server):
    messages = [{"role": "user", "content": "Say something."}]
    for stream in (False, True):
        reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0.0,
                                               logprobs=True, top_logprobs=2, stream=stream,
                                               extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
        if stream:
            chunks = [c for c in reply if c.choices]
            content = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            content, text = reply.choices[0].logprobs.content, reply.choices[0].message.content
        assert _decode(server, _ids([t.token for t in content])) == text and len(content) == 5
        for t in content:
            assert t.bytes == list(t.token.encode())  # the bytes of "token_id:N", as vLLM's
            assert _ids([top.token for top in t.top_logprobs]) and t.top_logprobs[0].token == t.token


def test_spaces_between_special_tokens_changes_no_text(client, server):
    texts = []
    for spaces in (True, False):
        r = client.completions.create(model=MODEL_NAME, prompt="a b c", max_tokens=8, temperature=0.0,
                                      extra_body={"skip_special_tokens": False, "ignore_eos": True,
                                                  "spaces_between_special_tokens": spaces})
        texts.append(r.choices[0].text)
    assert texts[0] == texts[1]
    r = httpx.post(server.base_url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "spaces_between_special_tokens": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "spaces_between_special_tokens"
    with pytest.raises(ValueError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens=1)
