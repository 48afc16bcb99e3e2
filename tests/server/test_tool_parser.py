"""``tool_choice`` "auto" with ``--enable-auto-tool-choice --tool-call-parser hermes`` (issue #23):
the Hermes parser as a unit (whole outputs, and streamed in every split of the text), then end to
end through the ``openai`` client, the model's output forced to a Hermes tool call by a
``guided_choice`` (the model has random weights), whole and streamed; "auto" without the flags
is a 400 naming them."""

from __future__ import annotations

import json
import random

import openai
import pytest

from attnserve.entrypoints.cli import main
from attnserve.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    ToolCallStream,
    get_tool_parser,
)
from tests.server.conftest import API_KEY, ENGINE_KWARGS, MODEL_NAME, ServerThread

P = HermesToolParser()
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
CALL2 = '<tool_call>{"name": "get_time", "arguments": {"tz": "utc"}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_whole_outputs():
    assert P.extract("just text <tool").content == "just text <tool" and not P.extract("x").tool_calls
    got = P.extract("Let me look.\n" + CALL)
    assert got.content == "Let me look.\n"
    assert _calls(got.tool_calls) == [("get_weather", {"city": "Paris", "days": 2})]
    assert got.tool_calls[0].type == "function" and got.tool_calls[0].id.startswith("chatcmpl-tool")
    got = P.extract(CALL + "\n" + CALL2)  # two calls, no text before them
    assert got.content is None and [n for n, _ in _calls(got.tool_calls)] == ["get_weather", "get_time"]
    got = P.extract('<tool_call>{"name": "get_time", "arguments": {"tz": "cet"}}')  # left open at the end
    assert _calls(got.tool_calls) == [("get_time", {"tz": "cet"})]
    assert P.extract('<tool_call>{"name": "f"}</tool_call>').tool_calls[0].function.arguments == "{}"
    for bad in ("<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                '<tool_call>["get_time"]</tool_call>', CALL + '<tool_call>{"name": 3}</tool_call>'):
        assert P.extract(bad).content == bad and P.extract(bad).tool_calls == []  # vLLM: all text


def _stream(text: str, cuts: list[int]) -> tuple[list[str], list]:
    s = ToolCallStream(P)
    contents, calls = [], []
    for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(text)])):
        content, done = s.step(text[a:b], finished=b == len(text) and i == len(cuts))
        contents.append(content)
        calls += done
    return contents, calls


@pytest.mark.parametrize("text", ["Sure, <tool_call is not a tag> here: <tool_cal", "Let me look.\n" + CALL,
                                  "ab<" + CALL + "\n" + CALL2, '<tool_call>{"name": "get_time"}'])
def test_streamed_in_every_split(text):
    whole = P.extract(text)
    rng = random.Random(0)
    splits = [[i] for i in range(1, len(text))] + [sorted(rng.sample(range(1, len(text)), 5)) for _ in range(50)]
    for cuts in splits + [list(range(1, len(text)))]:  # and one character at a time
        contents, calls = _stream(text, cuts)
        # content once sent stays: a piece of a tag sent as text would show in the join
        assert "".join(contents) == (whole.content or "") and _calls(calls) == _calls(whole.tool_calls), cuts


def test_a_streamed_block_that_is_no_call_goes_out_as_text():
    contents, calls = _stream("hi <tool_call>{oops}</tool_call>", [5, 20])
    assert "".join(contents) == "hi <tool_call>{oops}</tool_call>" and calls == []


def test_parser_names_and_flags(capsys):
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="known: hermes"):
        get_tool_parser("mistral-ish")
    with pytest.raises(SystemExit, match="--tool-call-parser"):
        main(["serve", "--enable-auto-tool-choice"])
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--enable-auto-tool-choice" in out and "--tool-call-parser NAME" in out and "hermes" in out


# --- end to end ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tool_client(model_dir):
    pytest.importorskip("xgrammar")
    srv = ServerThread(model_dir, app_kwargs={"tool_call_parser": "hermes"}, **ENGINE_KWARGS)
    with openai.OpenAI(api_key=API_KEY, base_url=srv.base_url + "/v1", max_retries=0, timeout=60) as c:
        yield c
    srv.stop()


FORCED = "Checking." + CALL


def test_auto_through_the_openai_client(tool_client):
    resp = tool_client.chat.completions.create(model=MODEL_NAME, messages=MSGS, tools=TOOLS, max_tokens=200,
                                               seed=0, extra_body={"guided_choice": [FORCED]})
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert _calls(choice.message.tool_calls) == [("get_weather", {"city": "Paris", "days": 2})]
    # no call in the text: plain content, the model's own finish reason
    plain = tool_client.chat.completions.create(model=MODEL_NAME, messages=MSGS, tools=TOOLS, tool_choice="auto",
                                                max_tokens=20, extra_body={"guided_choice": ["No tools."]})
    assert plain.choices[0].message.content == "No tools." and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"


def test_auto_streamed(tool_client):
    chunks = list(tool_client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, tools=TOOLS, max_tokens=200, stream=True, seed=0,
        extra_body={"guided_choice": [FORCED]}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Checking."
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id and calls[0].type == "function"
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 2}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_without_the_flags_names_them(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MSGS, tools=TOOLS, max_tokens=4)
    assert info.value.body["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in info.value.body["message"]
    assert "--tool-call-parser" in info.value.body["message"]
