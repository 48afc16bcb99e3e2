"""``qwen3_coder``: Qwen3-Coder's (and Qwen3.5's) XML-like calls::

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

As vLLM's parser: the calls are the ``<function=...>`` blocks inside ``<tool_call>`` blocks (a
last block left open counts), or, with no ``<tool_call>``, the bare ``<function=...>`` blocks;
content is the text before the first of them (None when empty). A value loses one leading and
one trailing newline and is typed by the tool's parameter schema: strings stay text; integer,
number and boolean types are converted (a value that does not convert stays text; a boolean
other than true/false is false); objects and arrays are read as JSON, then as a Python literal,
else kept as text; "null" is null whatever the type; a parameter the schema does not name
stays text. A ``</parameter>`` left out ends at the next ``<parameter=`` or ``</function>``.
With no function block at all the whole text is content. Streamed, each call goes out when its
``</function>`` closes it (or when the output ends). One deviation: content is the text before
whichever of ``<tool_call>`` and ``<function=`` comes first (vLLM prefers ``<tool_call>``
anywhere), so that a stream can decide at once.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from attnserve.entrypoints.openai.protocol import ToolCall
from attnserve.entrypoints.openai.tool_parsers.base import ToolParser, call

__all__ = ["Qwen3CoderToolParser", "convert_param"]

_PARAM = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    block_start, block_end = "<tool_call>", "</tool_call>"
    fn_start, fn_end = "<function=", "</function>"
    markers = (block_start, fn_start)
    closers = ">"

    def section_calls(self, section: str, tools: dict[str, dict] | None, finished: bool) -> list[ToolCall] | None:
        if section.startswith(self.block_start):
            regions = []
            for block in section.split(self.block_start)[1:]:
                body, closed, _ = block.partition(self.block_end)
                regions.append((body, bool(closed)))
        else:
            regions = [(section, False)]
        calls = []
        for i, (body, closed) in enumerate(regions):
            ends = closed or finished or i < len(regions) - 1  # no more text comes into it
            for fn in body.split(self.fn_start)[1:]:
                fn_body, fn_closed, _ = fn.partition(self.fn_end)
                if not (fn_closed or ends):
                    break
                c = self._call(fn_body, tools or {})
                if c is not None:
                    calls.append(c)
        return calls

    def _call(self, body: str, tools: dict[str, dict]) -> ToolCall | None:
        name, found, params = body.partition(">")
        name = name.strip()
        if not found or not name:
            return None
        schema = tools.get(name) or {}
        props = schema.get("properties", schema) if isinstance(schema, dict) else {}
        args = {}
        for match in _PARAM.findall(params):
            key, found, value = match.partition(">")
            if not found:
                continue
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[key.strip()] = convert_param(value, props.get(key.strip()) if isinstance(props, dict) else None)
        return call(name, args)


def convert_param(value: str, spec: Any) -> Any:
    """A parameter's text as the type its schema ``spec`` gives (None: no schema, text)."""
    if value.lower() == "null":
        return None
    if not isinstance(spec, dict):
        return value
    kind = spec.get("type", "string")
    if isinstance(kind, list):  # ["integer", "null"]: the first that is not null
        kind = next((k for k in kind if k != "null"), "string")
    kind = str(kind).strip().lower()
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if kind.startswith(("num", "float")):
            number = float(value)
            if not math.isfinite(number):
                return value
            return int(number) if number.is_integer() else number
    except (ValueError, OverflowError):
        return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        parsed = ast.literal_eval(value)
        json.dumps(parsed, allow_nan=False)
        return parsed
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return value
