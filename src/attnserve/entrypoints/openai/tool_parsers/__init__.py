"""Tool-call parsers for ``tool_choice`` "auto": the model writes tool calls in its own format,
in plain text, and the server turns them into ``tool_calls`` (vLLM's ``--enable-auto-tool-choice
--tool-call-parser NAME``). One module per format, each following vLLM's parser of that name
(its docstring says how, and where it departs); ``base.py`` holds what they share: whole outputs
through ``ToolParser.extract``, streams through ``ToolParser.stream``.

==============  =====================================================================  =========
name            format                                                                 models
==============  =====================================================================  =========
hermes          ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``            Hermes 2 Pro / 3, Qwen2.5, Qwen3
llama3_json     ``{"name": ..., "parameters": {...}}; ...`` (after ``<|python_tag|>``)  Llama 3.1-3.3, 4 (``llama4_json``)
mistral         ``[TOOL_CALLS][{...}]`` or ``[TOOL_CALLS]NAME[ARGS]{...}``              Mistral, Devstral
pythonic        ``[f(a=1), g()]``                                                       Llama 3.2 / 4 pythonic, ToolACE
deepseek_v3     ``<｜tool▁calls▁begin｜>...<｜tool▁call▁end｜>...``                          DeepSeek V3, R1-0528
qwen3_coder     ``<tool_call><function=NAME><parameter=P>V</parameter>...``              Qwen3-Coder, Qwen3.5
openai          harmony: ``<|channel|>commentary to=functions.NAME ...<|message|>{...}``  GPT-OSS
==============  =====================================================================  =========

Not here: which requests use a parser (``serving_chat.py``), reasoning (``reasoning_parsers.py``).
"""

from __future__ import annotations

from attnserve.entrypoints.openai.tool_parsers.base import (
    ParsedToolCalls,
    StreamDelta,
    ToolCallStream,
    ToolParser,
)
from attnserve.entrypoints.openai.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from attnserve.entrypoints.openai.tool_parsers.harmony import HarmonyStream, OpenAIToolParser
from attnserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from attnserve.entrypoints.openai.tool_parsers.json_calls import (
    Llama3JsonToolParser,
    MistralToolParser,
)
from attnserve.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from attnserve.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

__all__ = [
    "TOOL_PARSERS",
    "DeepSeekV3ToolParser",
    "HarmonyStream",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "OpenAIToolParser",
    "ParsedToolCalls",
    "PythonicToolParser",
    "Qwen3CoderToolParser",
    "StreamDelta",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "openai": OpenAIToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser named ``name`` (``--tool-call-parser``); a ValueError naming the known ones."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()
