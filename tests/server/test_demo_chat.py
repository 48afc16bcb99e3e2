"""The shipped demo models chat through the ``openai`` client with no template flag (issue 38).

Each demo model (GQA, MLA, DSA) ships a ChatML ``chat_template.jinja`` that renders tools as
Qwen's templates do (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the hermes
parser's format). Against a server of each, with the shipped weights on CPU: a plain chat,
a JSON-schema ``response_format`` answered with parseable JSON within 40 tokens at
temperature 0 (JSON whitespace is bounded by default), ``disable_any_whitespace`` giving
one-line JSON, and ``tool_choice: "required"`` giving parseable tool calls. The README's
``openai`` example runs as written against the default demo model's server.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
from openai import OpenAI  # noqa: E402

from attnserve.engine.structured_output import MAX_JSON_WHITESPACE  # noqa: E402
from attnserve.presets import resolve_model_preset  # noqa: E402
from attnserve.tokenizer import load_tokenizer  # noqa: E402

from .conftest import ServerThread  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"
DEMOS = ["attnserve-demo-gqa", "attnserve-demo-mla", "attnserve-demo-dsa"]
# dtype "auto", as `attnserve serve` runs: bfloat16 on a CPU with AVX512_BF16, else float32
# (both measured to pass)
ENGINE_KWARGS = {"kv_cache_memory": 0.05, "max_num_seqs": 8, "max_model_len": 1024, "dtype": "auto"}
MESSAGES = [{"role": "user", "content": "Name a city."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def servers():
    """One server per demo model (started when a test first asks), with the hermes tool
    parser, no API key and no chat-template flag."""
    started: dict[str, ServerThread] = {}

    def get(name: str) -> ServerThread:
        if name not in started:
            started[name] = ServerThread(resolve_model_preset(name), api_key=None,
                                         app_kwargs={"tool_call_parser": "hermes"}, **ENGINE_KWARGS)
        return started[name]

    yield get
    for srv in started.values():
        srv.stop()


def _client(srv: ServerThread) -> OpenAI:
    return OpenAI(api_key="EMPTY", base_url=srv.base_url + "/v1", max_retries=0, timeout=120)


def _gaps(text: str) -> list[str]:
    """The runs of whitespace outside JSON strings."""
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    return re.findall(r"\s+", outside)


@pytest.mark.parametrize("name", DEMOS)
def test_template_ships_with_each_demo_model(name):
    tok = load_tokenizer(resolve_model_preset(name))
    assert tok.has_chat_template
    tools = [WEATHER]
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *MESSAGES,
         {"role": "assistant", "content": None, "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], tools=tools)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text  # as Qwen's tojson writes it
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call><|im_end|>\n') in text
    assert text.endswith("<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert tok.apply_chat_template(MESSAGES) == "<|im_start|>user\nName a city.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("name", DEMOS)
def test_demo_model_chat_json_and_tool_calls(servers, name):
    with _client(servers(name)) as client:
        model = client.models.list().data[0].id  # ServerThread's served name
        chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content and chat.usage.completion_tokens == 8

        fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
        reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40,
                                               temperature=0, response_format=fmt)
        text = reply.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)  # parseable within 40 tokens
        assert reply.choices[0].finish_reason == "stop", text
        assert all(len(gap) <= MAX_JSON_WHITESPACE for gap in _gaps(text)), text

        compact = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=40, temperature=0,
            extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
        text = compact.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)
        assert not [gap for gap in _gaps(text) if gap != " "], text  # one line: ", " and ": " only

        forced = client.chat.completions.create(model=model, messages=MESSAGES, tools=[WEATHER],
                                                tool_choice="required", max_tokens=200, temperature=0)
        choice = forced.choices[0]
        # the grammar ended (not max_tokens); "stop", as vLLM answers a forced call
        assert choice.finish_reason == "stop" and choice.message.tool_calls, choice.message
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def _readme_openai_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    [block] = [b for b in blocks if "from openai import OpenAI" in b]
    return block


def test_readme_openai_example_runs_as_written(servers):
    """The README's chat, structured-output and tools example, against the server its first
    line starts (the default demo model with the hermes parser), only the address changed."""
    code = _readme_openai_example()
    assert code.startswith("# attnserve serve attnserve-demo-gqa --enable-auto-tool-choice "
                           "--tool-call-parser hermes\n")
    srv = servers("attnserve-demo-gqa")
    assert code.count("http://127.0.0.1:8000") == 1
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace("http://127.0.0.1:8000", srv.base_url), str(README), "exec"), {})
    lines = out.getvalue().splitlines()
    assert any(line.startswith("{'city': ") for line in lines), lines  # the parsed JSON
    assert any(line.startswith("get_weather {'city': ") for line in lines), lines  # the forced call
    assert lines[-1].split()[0] in ("stop", "length", "tool_calls"), lines
