"""``--reasoning-parser NAME`` (issue #38): ``deepseek_r1``, ``qwen3`` and ``openai_gptoss`` as
units (whole outputs, and streamed in random pieces: a stream sends what the whole output
gives, reasoning before content), then end to end through the ``openai`` client: the model
(random weights) runs, and its outputs' text is replaced by a script that grows with its tokens,
so that what is tested is the server's reading of them: ``reasoning_content`` (and
``reasoning``) whole and streamed, with ``n`` 2, with "auto" tool calls read from the content
after the reasoning, not for outputs a grammar forces, and GPT-OSS's harmony with its special
tokens kept."""

from __future__ import annotations

import dataclasses
import json
import random

import openai
import pytest

from attnserve.entrypoints.cli import main
from attnserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from tests.server.conftest import API_KEY, ENGINE_KWARGS, MODEL_NAME, ServerThread

CHATML = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
OPENED, CLOSED = CHATML + "<think>\n", CHATML + "<think>\n\n</think>\n\n"

# (parser, the prompt's end, output, expected reasoning, expected content)
CASES = [
    ("deepseek_r1", CHATML, "<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n", "\n\nIt is 4."),
    ("deepseek_r1", CHATML, "Let me see.</think>It is 4.", "Let me see.", "It is 4."),  # <think> in the prompt
    ("deepseek_r1", OPENED, "Let me see.</think>", "Let me see.", None),
    ("deepseek_r1", CHATML, "Still thinking when cut", "Still thinking when cut", None),
    ("deepseek_r1", CLOSED, "It is 4.", None, "It is 4."),  # the template closed the thinking
    ("deepseek_r1", CLOSED, "<think>Hm.</think>4", "Hm.", "4"),
    ("deepseek_r1", CHATML, "a <thin b</think> c </think>", "a <thin b", " c </think>"),
    ("qwen3", CHATML, "<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n", "\n\nIt is 4."),
    ("qwen3", CHATML, "  <think>Hm.</think>4", "Hm.", "4"),
    ("qwen3", CHATML, "It is 4.", None, "It is 4."),  # no thinking: all content
    ("qwen3", CHATML, "It is 4.</think> really", None, "It is 4.</think> really"),
    ("qwen3", CLOSED, "It is 4.", None, "It is 4."),  # enable_thinking false
    ("qwen3", OPENED, "Let me see.</think>\n\nIt is 4.", "Let me see.", "\n\nIt is 4."),  # Qwen3-Thinking, 3.5
    ("qwen3", OPENED, "Cut short", "Cut short", None),
    ("qwen3", OPENED, "Call it.\n<tool_call>\n<function=f>\n</function>\n</tool_call>", "Call it.\n",
     "<tool_call>\n<function=f>\n</function>\n</tool_call>"),  # a call ends the reasoning (Qwen3.5)
    ("qwen3", OPENED, "Use <tool_call> later.</think>Done", "Use <tool_call> later.", "Done"),
    ("openai_gptoss", "", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
     "<|message|>It is 4.<|return|>", "Easy.", "It is 4."),
    ("openai_gptoss", "", "It is 4.", None, "It is 4."),
]


def _stream(parser, prompt: str, text: str, cuts: list[int]) -> tuple[list[str], list[str]]:
    s = parser.stream(prompt)
    reasoning, content = [], []
    for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(text)])):
        r, c = s.step(text[a:b], finished=i == len(cuts))
        reasoning.append(r)
        content.append(c)
    return reasoning, content


@pytest.mark.parametrize("name,prompt,text,reasoning,content", CASES)
def test_whole_and_streamed(name, prompt, text, reasoning, content):
    parser = get_reasoning_parser(name)
    assert parser.extract(text, prompt) == (reasoning, content)
    rng = random.Random(0)
    cuts = range(1, len(text))
    splits = [[i] for i in cuts] + [sorted(rng.sample(cuts, min(len(cuts), rng.randint(2, 10)))) for _ in range(40)]
    splits.append(list(cuts))
    for split in splits:
        r, c = _stream(parser, prompt, text, split)
        assert ("".join(r), "".join(c)) == (reasoning or "", content or ""), split
        # reasoning first: no reasoning after the first content
        first = next((i for i, piece in enumerate(c) if piece), len(c))
        assert not any(r[first + 1:]), split


def test_a_partial_tag_is_held_back():
    s = get_reasoning_parser("deepseek_r1").stream(CHATML)
    assert s.step("<thi", False) == ("", "")
    assert s.step("nk>Hm. </thi", False) == ("Hm. ", "")
    assert s.step("nk>Yes", False) == ("", "Yes")
    s = get_reasoning_parser("qwen3").stream(OPENED)
    assert s.step("Now <tool_call>\n<func", False) == ("Now ", "")  # may yet be a call
    assert s.step("tion=f>", False) == ("", "<tool_call>\n<function=f>")


def test_names_and_flag(capsys):
    with pytest.raises(ValueError, match="known: deepseek_r1, openai_gptoss, qwen3"):
        get_reasoning_parser("r1")
    with pytest.raises(SystemExit):
        main(["serve", "--reasoning-parser", "r1"])
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr()
    assert "must be one of deepseek_r1, openai_gptoss, qwen3" in out.err
    assert "--reasoning-parser NAME" in out.out and all(name in out.out for name in REASONING_PARSERS)


# --- end to end -----------------------------------------------------------------------------------
class ScriptedText:
    """Replaces the text of an engine's outputs with ``text`` (the part of it as long as the
    share of ``max_tokens`` generated so far; all of it when the output ends), keeping the
    model's token count: the request runs ``max_tokens`` long (``ignore_eos``). Records each
    request's sampling parameters."""

    def __init__(self, engine):
        self.text: str | None = None
        self.params = []
        self._generate = engine.generate
        engine.generate = self.generate

    async def generate(self, request_id, prompt, params):
        self.params.append(params)
        params.ignore_eos = True
        async for out in self._generate(request_id, prompt, params):
            if self.text is not None:
                text = self.text
                out = dataclasses.replace(out, outputs=[dataclasses.replace(
                    c, text=text if c.finished else text[: len(text) * len(c.token_ids) // params.max_tokens])
                    for c in out.outputs])
            yield out


@pytest.fixture(scope="module")
def scripted(model_dir):
    srv = ServerThread(model_dir, app_kwargs={"tool_call_parser": "hermes", "reasoning_parser": "deepseek_r1"},
                       **ENGINE_KWARGS)
    script = ScriptedText(srv.engine)
    with openai.OpenAI(api_key=API_KEY, base_url=srv.base_url + "/v1", max_retries=0, timeout=60) as c:
        yield c, script
    srv.stop()


MSGS = [{"role": "user", "content": "What is 2 + 2?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _streamed(client, **kwargs) -> tuple[list, list]:
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MSGS, stream=True, **kwargs))
    return chunks, [c for c in chunks if c.choices]


def test_reasoning_content(scripted):
    client, script = scripted
    script.text = "<think>Two and two.</think>It is 4."
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=12)
    msg = resp.choices[0].message
    assert (msg.reasoning_content, msg.reasoning, msg.content) == ("Two and two.", "Two and two.", "It is 4.")
    assert resp.choices[0].finish_reason == "length" and script.params[-1].skip_special_tokens
    script.text = "Cut short while thinking"
    msg = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=6).choices[0].message
    assert (msg.reasoning_content, msg.content) == ("Cut short while thinking", None)


def test_reasoning_streamed(scripted):
    client, script = scripted
    script.text = "<think>Two and two.</think>It is 4."
    _, chunks = _streamed(client, max_tokens=20, n=2)
    for index in (0, 1):
        deltas = [choice.delta for c in chunks for choice in c.choices if choice.index == index]
        reasoning = [d.reasoning_content or "" for d in deltas]
        content = [d.content or "" for d in deltas]
        assert "".join(reasoning) == "Two and two." and "".join(content) == "It is 4."
        assert [d.reasoning for d in deltas] == [d.reasoning_content for d in deltas]
        first = next(i for i, piece in enumerate(content) if piece)
        assert not any(reasoning[first:]) and sum(map(bool, reasoning)) > 1  # in pieces, then content


def test_tool_calls_after_reasoning(scripted):
    client, script = scripted
    script.text = "Weather is a tool's. <tool_call>{not this}</tool_call></think>Checking." + CALL
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, tools=TOOLS, max_tokens=30)
    choice = resp.choices[0]
    assert choice.message.reasoning_content == "Weather is a tool's. <tool_call>{not this}</tool_call>"
    assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    _, chunks = _streamed(client, tools=TOOLS, max_tokens=30)
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.reasoning_content or "" for d in deltas) == choice.message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == "Checking."
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert [(t.index, t.function.name) for t in calls] == [(0, "get_weather")]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_no_reasoning_in_forced_output(scripted):
    """A grammar forces the output from its first token: it holds no reasoning to split off."""
    pytest.importorskip("xgrammar")
    client, script = scripted
    script.text = None
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=8,
                                          extra_body={"guided_choice": ["four"]})
    msg = resp.choices[0].message
    assert (msg.content, msg.reasoning_content) == ("four", None)


def test_no_reasoning_fields_without_a_parser(client):
    msg = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=4).choices[0].message
    assert msg.content and msg.reasoning_content is None


@pytest.fixture(scope="module")
def harmony(model_dir):
    srv = ServerThread(model_dir, app_kwargs={"tool_call_parser": "openai", "reasoning_parser": "openai_gptoss"},
                       **ENGINE_KWARGS)
    script = ScriptedText(srv.engine)
    with openai.OpenAI(api_key=API_KEY, base_url=srv.base_url + "/v1", max_retries=0, timeout=60) as c:
        yield c, script
    srv.stop()


def test_harmony(harmony):
    client, script = harmony
    script.text = ("<|channel|>analysis<|message|>Needs the weather.<|end|><|start|>assistant<|channel|>commentary "
                   'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
    for stream in (False, True):
        if stream:
            _, chunks = _streamed(client, tools=TOOLS, max_tokens=30)
            deltas = [c.choices[0].delta for c in chunks]
            reasoning = "".join(d.reasoning_content or "" for d in deltas)
            content = "".join(d.content or "" for d in deltas) or None
            calls, finish = [t for d in deltas for t in d.tool_calls or []], chunks[-1].choices[0].finish_reason
        else:
            choice = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, tools=TOOLS,
                                                    max_tokens=30).choices[0]
            reasoning, content = choice.message.reasoning_content, choice.message.content
            calls, finish = choice.message.tool_calls, choice.finish_reason
        assert (reasoning, content, finish) == ("Needs the weather.", None, "tool_calls")
        assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("get_weather", {"city": "Paris"})]
        assert script.params[-1].skip_special_tokens is False  # harmony's markers are special tokens
    # without tools, the reasoning parser reads the channels
    script.text = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>"
    msg = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=20).choices[0].message
    assert (msg.reasoning_content, msg.content) == ("Easy.", "4") and script.params[-1].skip_special_tokens is False


# --- /v1/responses: a reasoning item before the message ------------------------------------------
def _response_events(client, **kwargs) -> list:
    return list(client.responses.create(model=MODEL_NAME, input="What is 2 + 2?", stream=True, **kwargs))


def test_responses_reasoning_item(scripted):
    client, script = scripted
    script.text = "<think>Two and two.</think>It is 4."
    resp = client.responses.create(model=MODEL_NAME, input="What is 2 + 2?", max_output_tokens=12)
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "Two and two." and resp.output_text == "It is 4."
    assert resp.status == "incomplete" and resp.output[0].status == resp.output[1].status == "incomplete"
    # the next turn continues from the reply alone, not the reasoning
    script.text = "Fine.</think>Yes."
    follow = client.responses.create(model=MODEL_NAME, input="Sure?", previous_response_id=resp.id,
                                     max_output_tokens=6)
    assert follow.output_text == "Yes."
    # cut short while thinking: a reasoning item and an empty message
    script.text = "Cut short while thinking"
    resp = client.responses.create(model=MODEL_NAME, input="What is 2 + 2?", max_output_tokens=6)
    assert [item.type for item in resp.output] == ["reasoning", "message"] and resp.output_text == ""


@pytest.mark.parametrize("text", ["<think>Two and two.</think>It is 4.", "Cut short while thinking"])
def test_responses_reasoning_streamed(scripted, text):
    client, script = scripted
    script.text = text
    events = _response_events(client, max_output_tokens=20)
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    content = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    want_reasoning, _, want_content = text.removeprefix("<think>").partition("</think>")
    assert (reasoning, content) == (want_reasoning, want_content)
    assert sum(k == "response.reasoning_text.delta" for k in kinds) > 1  # in pieces
    # the reasoning item is added, streamed and done before the message is added
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert added == done == ["reasoning", "message"]
    assert kinds.index("response.output_item.done") < [i for i, k in enumerate(kinds)
                                                       if k == "response.output_item.added"][1]
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == want_reasoning and final.output_text == want_content
    assert final.output[0].id == next(e.item_id for e in events if e.type == "response.reasoning_text.delta")
