"""Property-based fuzzing of the server's request bodies (issue #24, point 5).

A hypothesis strategy over the bodies of ``/v1/completions`` and ``/v1/chat/completions``:
a valid body (text or token prompt, chat messages) with fields of the protocol models
(``CompletionRequest`` / ``ChatCompletionRequest``'s ``model_fields``, so that a new field is
fuzzed as soon as it exists) replaced by values of their own type near the edges or by any JSON
(NaN and infinities included, which Python's JSON parser reads), keys dropped, unknown keys
added; and raw bodies that are not JSON objects at all. Each is posted in-process to the app
(httpx's ASGI transport) over a real engine thread. Whatever the body: never a 5xx, every
error in OpenAI's shape, no choice that failed inside the engine, the engine holds nothing
once the response is in, ``/health`` answers 200 within a second; after the run a fixed
greedy request still gets its exact output. Derandomized, so that CI is reproducible.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from attnserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ServerLimits,
)
from tests.server.conftest import MODEL_NAME
from tests.server.inprocess import InProcessServer

FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
VOCAB = 2048
MSG = [{"role": "user", "content": "hi"}]
REFERENCE = {"model": MODEL_NAME, "prompt": [17, 400, 93, 1200, 5], "max_tokens": 8, "temperature": 0}

ints = st.one_of(st.integers(-3, 40), st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 10**19, 10**30]))
floats = st.one_of(st.floats(-3, 3), st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0]))
odd_text = st.one_of(st.text(max_size=12), st.sampled_from(
    ["", " ", "\x00", "\ud800", "a\udfff", "\U0010ffff", "é" * 40, "<|im_start|>", "{{ x }}", "\u202e"]))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, st.integers(), floats, odd_text),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(odd_text, inner, max_size=3)),
    max_leaves=10)
token_ids = st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(-2, VOCAB + 2), ints), max_size=12)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "robot"])},
    optional={"content": st.one_of(odd_text, st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": odd_text}), max_size=2), json_values),
        "name": json_values}), max_size=3)
TYPED = {  # values of a field's own type; fields not named here get any JSON
    "n": st.integers(-1, 10), "max_tokens": st.one_of(st.none(), st.integers(-1, 6), ints),
    "max_completion_tokens": st.one_of(st.none(), st.integers(-1, 6)), "min_tokens": st.integers(-1, 8),
    "temperature": floats, "top_p": floats, "top_k": ints, "min_p": floats, "seed": ints,
    "presence_penalty": floats, "frequency_penalty": floats, "repetition_penalty": floats,
    "logprobs": st.one_of(st.booleans(), ints), "top_logprobs": ints, "prompt_logprobs": ints,
    "stop": st.one_of(odd_text, st.lists(odd_text, max_size=3)), "stop_token_ids": token_ids,
    "allowed_token_ids": token_ids, "bad_words": st.lists(odd_text, max_size=3),
    "logit_bias": st.dictionaries(st.one_of(st.integers(-3, VOCAB + 3).map(str), odd_text), floats, max_size=3),
    "truncate_prompt_tokens": ints, "stream": st.booleans(), "echo": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({}, optional={"include_usage": json_values})),
    "prompt": st.one_of(odd_text, token_ids, st.lists(odd_text, max_size=3), st.lists(token_ids, max_size=3)),
    "messages": messages,
    "response_format": st.one_of(st.none(), st.fixed_dictionaries({"type": st.sampled_from(
        ["text", "json_object", "json_schema", "xml"])}, optional={"json_schema": json_values})),
    "guided_choice": st.lists(odd_text, max_size=3), "guided_regex": odd_text, "guided_json": json_values,
    "chat_template_kwargs": st.one_of(st.none(), st.dictionaries(st.sampled_from(
        ["chat_template", "enable_thinking", "x"]), odd_text, max_size=2)),
    "chat_template": odd_text, "tools": st.lists(json_values, max_size=2), "tool_choice": json_values,
}


def bodies(model) -> st.SearchStrategy[dict]:
    """A valid body of ``model``'s endpoint, then mutated field by field."""
    fields = sorted(model.model_fields)
    base = (st.fixed_dictionaries({"model": st.just(MODEL_NAME), "prompt": st.one_of(
        st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=8), st.text(min_size=1, max_size=10)),
        "max_tokens": st.integers(1, 6)}) if model is CompletionRequest else st.fixed_dictionaries(
        {"model": st.just(MODEL_NAME), "messages": st.just([{"role": "user", "content": "hi"}]),
         "max_tokens": st.integers(1, 6)}))

    @st.composite
    def mutate(draw) -> dict:
        body = draw(base)
        for name in draw(st.lists(st.sampled_from(fields + ["unknown_field"]), unique=True, max_size=4)):
            how = draw(st.sampled_from(["typed", "typed", "json", "drop"]))
            if how == "drop":
                body.pop(name, None)
            else:
                body[name] = draw(TYPED.get(name, json_values) if how == "typed" else json_values)
        if body.get("max_tokens") is None and "max_completion_tokens" not in body:
            body["max_completion_tokens"] = 6  # keeps chat's "up to the context" short
        return body

    return mutate()


raw_bodies = st.one_of(
    st.binary(max_size=40),
    json_values.map(json.dumps),
    st.integers(1, 100_000).map(lambda n: "[" * n + "]" * n),  # deeper than a parser's stack
    st.integers(1, 100_000).map(lambda n: '{"a":' * n + "1" + "}" * n),
    st.tuples(st.sampled_from(["logit_bias", "guided_json", "response_format", "stream_options", "messages"]),
              st.integers(1, 990)).map(lambda f: f'{{"model": "{MODEL_NAME}", "prompt": "x", "max_tokens": 2, '
                                               f'"{f[0]}": ' + '{"a": ' * f[1] + "{}" + "}" * f[1] + "}"),
)  # the last: nested as deep as JSON parses, for the protocol models and what reads them after


@pytest.fixture(scope="module")
def fuzz_server(model_dir):
    srv = InProcessServer(model_dir, app_kwargs={"limits": ServerLimits(max_n=8, max_prompts=8)},
                          kv_cache_memory=0.01, max_num_seqs=32, max_model_len=96)
    loop = asyncio.new_event_loop()
    client = srv.client()
    srv.post = lambda path, content: loop.run_until_complete(client.post(
        path, content=content, headers={"Content-Type": "application/json"}))
    srv.get = lambda path: loop.run_until_complete(client.get(path))
    yield srv
    loop.run_until_complete(client.aclose())
    loop.close()
    srv.stop()


def _check_response(srv, resp, body) -> None:
    assert resp.status_code < 500, f"{resp.status_code} for {body!r}: {resp.text[:300]}"
    if resp.status_code != 200:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    elif resp.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", resp.text[-300:]
        for event in map(json.loads, events[:-1]):
            assert "error" not in event, event
            assert all(c.get("finish_reason") != "error" for c in event["choices"]), event
    else:
        assert all(c["finish_reason"] != "error" for c in resp.json().get("choices", [])), resp.text[:300]
    srv.wait_idle(timeout=5)
    start = time.perf_counter()
    assert srv.get("/health").status_code == 200
    assert time.perf_counter() - start < 1.0


def _reference(srv) -> dict:
    resp = srv.post("/v1/completions", json.dumps(REFERENCE))
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return {"text": choice["text"], "finish_reason": choice["finish_reason"]}


@pytest.mark.parametrize("path,model", [("/v1/completions", CompletionRequest),
                                        ("/v1/chat/completions", ChatCompletionRequest)],
                         ids=["completions", "chat"])
def test_fuzzed_bodies_never_hurt_the_server(fuzz_server, path, model):
    before = _reference(fuzz_server)

    @settings(FUZZ, max_examples=120)
    @given(bodies(model))
    @example({"model": MODEL_NAME, "prompt": "a\ud800", "messages": [{"role": "user", "content": "\udfff"}]})
    @example({"model": MODEL_NAME, "prompt": "hi", "messages": MSG, "bad_words": ["\ud800"], "max_tokens": 2})
    def post(body):
        _check_response(fuzz_server, fuzz_server.post(path, json.dumps(body)), body)

    post()
    assert _reference(fuzz_server) == before


def test_raw_bodies_never_hurt_the_server(fuzz_server):
    before = _reference(fuzz_server)

    @settings(FUZZ, max_examples=40)
    @given(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]), raw_bodies)
    @example("/v1/completions", "[" * 100_000 + "]" * 100_000)  # a RecursionError in json.loads was a 500
    @example("/v1/chat/completions", json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
                                                 "guided_json": "[" * 100_000}))
    def post(path, raw):
        _check_response(fuzz_server, fuzz_server.post(path, raw), raw[:200])

    post()
    assert _reference(fuzz_server) == before
