"""Structured output, tool calls and the token-level sampling fields through the official
``openai`` client, as a vLLM user writes them: ``response_format`` (json_schema, json_object),
vLLM's ``structured_outputs`` and ``guided_*`` extras, ``tools`` with ``tool_choice``
"required" or a named function (whole and streamed), ``logit_bias``, ``allowed_token_ids``,
``bad_words``, ``truncate_prompt_tokens``.

The model has random weights: its text is junk, so what is valid comes from the grammar.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.server.conftest import MODEL_NAME

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
                   "temp": {"type": "integer", "minimum": -50, "maximum": 50}},
    "required": ["city", "temp"],
}
TIME = {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
MSGS = [{"role": "user", "content": "What is the weather?"}]


def test_response_format_json_schema_and_object(client):
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, max_tokens=200, seed=0, temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}})
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].message.content), SCHEMA)
    # vLLM's per-request option for compact JSON, on the completions endpoint
    resp = client.completions.create(
        model=MODEL_NAME, prompt="weather:", max_tokens=60, seed=1, n=2,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    for choice in resp.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)


def test_regex_and_choice_extras(client):
    resp = client.completions.create(model=MODEL_NAME, prompt=["a", "b"], max_tokens=20, seed=2,
                                      extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}})
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", c.text) for c in resp.choices)
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=20, n=3, seed=3,
                                          extra_body={"guided_choice": ["sunny", "rain", "snow and ice"]})
    assert all(c.message.content in ("sunny", "rain", "snow and ice") for c in resp.choices)
    streamed = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=20, stream=True,
                                         extra_body={"guided_regex": "(ab|cd){2}"})
    assert re.fullmatch("(ab|cd){2}", "".join(ch.choices[0].text for ch in streamed if ch.choices))


def _whitespace_ids() -> list[int]:
    """This tokenizer's tokens of whitespace only (the server's model has the preset's)."""
    from attnserve.presets import resolve_model_preset
    from attnserve.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_preset("attnserve-tiny-llama"))
    return [i for i in range(tok.vocab_size) if (s := tok.decode([i])) and not s.strip()]


def test_named_and_required_tool_calls(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=200, seed=1,
                                          tools=TOOLS, tool_choice=named)
    (call,) = resp.choices[0].message.tool_calls
    assert call.function.name == "get_time" and call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), TIME)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=200, seed=1,
                                            tools=TOOLS, tool_choice=named, stream=True)
    deltas = [ch.choices[0].delta for ch in stream if ch.choices and ch.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0].tool_calls[0].function.arguments == call.function.arguments
    # "required": one or more calls of any tool (compact JSON keeps this model's output short)
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, max_tokens=150, seed=5, tools=TOOLS, tool_choice="required",
        logit_bias={str(t): -100 for t in _whitespace_ids()})
    calls = resp.choices[0].message.tool_calls
    assert calls, resp.choices[0].message.content
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments),
                            SCHEMA if call.function.name == "get_weather" else TIME)


def test_token_fields_match_offline(client, reference):
    """logit_bias, allowed_token_ids and bad_words give the server the offline engine's tokens,
    and those tokens obey them."""
    from attnserve.sampling_params import SamplingParams

    tok = reference.get_tokenizer()
    base = reference.generate("hello", SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0]
    word = tok.decode(base.token_ids[:2]).strip() or tok.decode(base.token_ids[:3])
    cases = [({"logit_bias": {"77": 100}}, {"logit_bias": {77: 100}}),
             ({"extra_body": {"allowed_token_ids": [100, 200, 300]}}, {"allowed_token_ids": [100, 200, 300]}),
             ({"extra_body": {"bad_words": [word]}}, {"bad_words": [word]})]
    for sent, fields in cases:
        resp = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=6, temperature=0.8,
                                          seed=9, **sent)
        ref = reference.generate("hello", SamplingParams(temperature=0.8, seed=9, max_tokens=6, **fields))
        assert resp.choices[0].text == ref[0].outputs[0].text
        ids = ref[0].outputs[0].token_ids
        if "logit_bias" in fields:
            assert ids == [77] * 6
        if "allowed_token_ids" in fields:
            assert set(ids) <= {100, 200, 300}
        if "bad_words" in fields:
            banned = tok.encode(word, add_special_tokens=False)
            assert all(ids[i:i + len(banned)] != banned for i in range(len(ids)))


def test_truncate_prompt_tokens(client, reference):
    tok = reference.get_tokenizer()
    long = "one two three four five six seven eight"
    resp = client.completions.create(model=MODEL_NAME, prompt=long, max_tokens=3, temperature=0.0, echo=True,
                                      extra_body={"truncate_prompt_tokens": 3})
    kept = tok.encode(long)[-3:]
    assert resp.usage.prompt_tokens == 3 and resp.choices[0].text.startswith(tok.decode(kept))
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
