"""``tool_choice`` "auto" with ``--enable-auto-tool-choice --tool-call-parser NAME`` (issues #23,
#38): the Hermes parser as a unit (whole outputs, and streamed in every split of the text), each
other format's parser (llama3_json, mistral, pythonic, deepseek_v3, qwen3_coder, openai) on
outputs of its models' shapes, whole and streamed in random pieces (a stream sends what the whole
output gives); then end to end through the ``openai`` client, the model's output forced to a
Hermes tool call by a ``guided_choice`` (the model has random weights), whole and streamed; "auto"
without the flags is a 400 naming them."""

from __future__ import annotations

import json
import random

import openai
import pytest

from attnserve.entrypoints.cli import main
from attnserve.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
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


def _stream(text: str, cuts: list[int], parser=P, tools=None) -> tuple[list[str], list, str]:
    """The contents, calls and reasoning that ``parser``'s stream sends for ``text`` fed in the
    pieces ``cuts`` make."""
    s = parser.stream(tools)
    contents, calls, reasoning = [], [], ""
    for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(text)])):
        out = s.step(text[a:b], finished=b == len(text) and i == len(cuts))
        contents.append(out.content)
        calls += out.tool_calls
        reasoning += out.reasoning
    return contents, calls, reasoning


def _splits(text: str, seed: int = 0, random_splits: int = 50) -> list[list[int]]:
    """Every cut into two, random cuts into several pieces, and one character at a time."""
    rng = random.Random(seed)
    cuts = range(1, len(text))
    return ([[i] for i in cuts] + [sorted(rng.sample(cuts, min(len(cuts), rng.randint(2, 12))))
                                   for _ in range(random_splits)] + [list(cuts)])


@pytest.mark.parametrize("text", ["Sure, <tool_call is not a tag> here: <tool_cal", "Let me look.\n" + CALL,
                                  "ab<" + CALL + "\n" + CALL2, '<tool_call>{"name": "get_time"}'])
def test_streamed_in_every_split(text):
    whole = P.extract(text)
    assert isinstance(P.stream(), ToolCallStream)
    for cuts in _splits(text):
        contents, calls, _ = _stream(text, cuts)
        # content once sent stays: a piece of a tag sent as text would show in the join
        assert "".join(contents) == (whole.content or "") and _calls(calls) == _calls(whole.tool_calls), cuts


def test_a_streamed_block_that_is_no_call_goes_out_as_text():
    contents, calls, _ = _stream("hi <tool_call>{oops}</tool_call>", [5, 20])
    assert "".join(contents) == "hi <tool_call>{oops}</tool_call>" and calls == []


# --- the other formats ----------------------------------------------------------------------------
DS_CALL = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\",\n \"days\": 2}\n```"
           "<｜tool▁call▁end｜>")
Q_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hot": {"type": "boolean"},
    "temp": {"type": "number"}, "opts": {"type": "object"}, "tags": {"type": ["array", "null"]}}}}}]
Q_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
          "</parameter>\n<parameter=hot>\nFalse\n</parameter>\n<parameter=temp>\n21.5\n</parameter>\n<parameter=opts>\n"
          '{"unit": "C"}\n</parameter>\n<parameter=tags>\n["a", 1]\n</parameter>\n<parameter=note>\n 7 \n</parameter>\n'
          "</function>\n</tool_call>")
Q_ARGS = {"city": "Paris", "days": 2, "hot": False, "temp": 21.5, "opts": {"unit": "C"}, "tags": ["a", 1], "note": " 7 "}
H_CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
          '{"city":"Paris","days":2}<|call|>')
WEATHER, TIME = ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})

# (parser, output, expected content, expected calls, expected reasoning); the request's tools: Q_TOOLS
CASES = [
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', None,
     [WEATHER], None),
    ("llama3_json", ' {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}; {"name": "get_time", '
     '"parameters": {}}<|eom_id|>', None, [WEATHER, TIME], None),  # text after the calls is dropped
    ("llama3_json", 'I think {"name": "get_time", "parameters": {}}', 'I think {"name": "get_time", "parameters": {}}',
     [], None),  # calls only at the start
    ("llama3_json", '{"name": "get_time"}', '{"name": "get_time"}', [], None),  # no parameters: not a call
    ("llama3_json", '{"name": "get_time", "parameters": {', '{"name": "get_time", "parameters": {', [], None),
    ("mistral", 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
     '{"name": "get_time", "arguments": {}}]</s>', "Let me check.", [WEATHER, TIME], None),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e'
     '[ARGS]{}</s>', None, [WEATHER, TIME], None),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris", "days": 2}', None, [WEATHER], None),  # v11, no [ARGS]
    ("mistral", "Sure [TOOL_CALLS] not json", "Sure [TOOL_CALLS] not json", [], None),
    ("mistral", "no call [TOOL_CALL", "no call [TOOL_CALL", [], None),
    ("pythonic", '[get_weather(city="Paris", days=2), get_time()]\n', None, [WEATHER, TIME], None),
    ("pythonic", "[get_weather(city='Paris]', days=2, extra=[-1.5, None, True, {'k': (1, 2)}])]", None,
     [("get_weather", {"city": "Paris]", "days": 2, "extra": [-1.5, None, True, {"k": [1, 2]}]})], None),
    ("pythonic", "[get_weather(city=paris)]", "[get_weather(city=paris)]", [], None),  # a name: not a literal
    ("pythonic", "[get_time()] and then", "[get_time()] and then", [], None),  # not the whole output
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", [], None),
    ("deepseek_v3", "Checking.<｜tool▁calls▁begin｜>" + DS_CALL + "\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
     "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>", "Checking.", [WEATHER, TIME], None),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>" + DS_CALL + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}",
     None, [WEATHER], None),  # a call left open is skipped
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>oops", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>oops",
     [], None),
    ("qwen3_coder", "Let me look.\n" + Q_CALL + "\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     "Let me look.\n", [("get_weather", Q_ARGS), TIME], None),
    ("qwen3_coder", "<function=get_weather>\n<parameter=days>\nmany\n<parameter=city>\nnull\n</function>", None,
     [("get_weather", {"days": "many", "city": None})], None),  # bare function; open parameters
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n", None, [TIME], None),  # left open at the end
    ("qwen3_coder", "<tool_call>no function</tool_call>", "<tool_call>no function</tool_call>", [], None),
    ("openai", "<|channel|>analysis<|message|>The user wants the weather.<|end|>" + H_CALL, None, [WEATHER],
     "The user wants the weather."),
    ("openai", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>",
     "Hi!", [], "Easy."),
    ("openai", '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>', None,
     [TIME], None),  # the recipient before the channel
    ("openai", "<|channel|>commentary<|message|>Checking now.<|end|>" + H_CALL + H_CALL, "Checking now.",
     [WEATHER, WEATHER], None),  # a preamble is content
    ("openai", "<|channel|>analysis<|message|>cut sh", None, [], "cut sh"),
    ("openai", "Not harmony at all.", "Not harmony at all.", [], None),
]


def _json_calls(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("name,text,content,calls,reasoning", CASES)
def test_formats_whole_and_streamed(name, text, content, calls, reasoning):
    parser = get_tool_parser(name)
    whole = parser.extract(text, Q_TOOLS)
    assert (whole.content, _json_calls(whole.tool_calls), whole.reasoning) == (content, calls, reasoning)
    assert all(c.type == "function" and c.id for c in whole.tool_calls)
    for cuts in _splits(text, random_splits=30):
        contents, got, got_reasoning = _stream(text, cuts, parser, Q_TOOLS)
        assert ("".join(contents), _json_calls(got), got_reasoning) == (content or "", calls, reasoning or ""), cuts


def test_each_call_streams_when_it_closes():
    """A call goes out as soon as its block closes, before the output ends."""
    for name, text, closing in [
        ("deepseek_v3", "<｜tool▁calls▁begin｜>" + DS_CALL, "<｜tool▁call▁end｜>"),
        ("qwen3_coder", Q_CALL, "</function>"),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}', "}"),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', "}"),
        ("openai", H_CALL, "<|call|>"),
    ]:
        s = get_tool_parser(name).stream(Q_TOOLS)
        cut = text.rindex(closing) + len(closing)
        assert not s.step(text[: cut - 1], finished=False).tool_calls, name
        assert [c.function.name for c in s.step(text[cut - 1: cut], finished=False).tool_calls] == ["get_weather"], name


def test_mistral_ids_and_special_tokens():
    parser = get_tool_parser("mistral")
    calls = parser.extract('[TOOL_CALLS][{"name": "get_time", "arguments": {}}]').tool_calls
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()
    # formats whose markers are special tokens ask the server to keep them in the text
    assert {n for n, cls in TOOL_PARSERS.items() if cls.keeps_special_tokens} == {"mistral", "openai"}


def test_parser_names_and_flags(capsys):
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="known: deepseek_v3, hermes, llama3_json"):
        get_tool_parser("mistral-ish")
    with pytest.raises(SystemExit, match="--tool-call-parser"):
        main(["serve", "--enable-auto-tool-choice"])
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--enable-auto-tool-choice" in out and "--tool-call-parser NAME" in out
    assert all(name in out.replace("\n", " ").replace(" ", "") for name in TOOL_PARSERS)


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
