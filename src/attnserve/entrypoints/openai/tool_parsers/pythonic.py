"""``pythonic``: the output is a Python list of calls, ``[get_weather(city="Paris", days=2),
get_time()]``, as Llama 3.2 / 4 and ToolACE write them with pythonic tool templates.

As vLLM's parser: the whole output (white space around it aside) must be one list whose items
are calls of plain names with keyword arguments; it is read with ``ast`` and never run. Argument
values are literals (strings, numbers, booleans, None, lists, dicts, and tuples as lists; a
negative number too, which vLLM refuses); anything else (a name, a call, an expression) makes
the whole text content, as any other output does. With calls, content is None. Streamed, the
calls go out when the output ends (a list is only known to be all of the output then).
"""

from __future__ import annotations

import ast
import json
from typing import Any

from attnserve.entrypoints.openai.protocol import ToolCall
from attnserve.entrypoints.openai.tool_parsers.base import ParsedToolCalls, ToolParser, call

__all__ = ["PythonicToolParser"]


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def section_start(self, text: str, at_output_start: bool) -> int | None:
        return 0 if at_output_start and text.lstrip().startswith("[") else None

    def start_holdback(self, text: str, at_output_start: bool) -> int:
        return len(text) if at_output_start and not text.strip() else 0

    def section_calls(self, section: str, tools: dict[str, dict] | None, finished: bool) -> list[ToolCall] | None:
        if not finished:
            return []
        try:
            tree = ast.parse(section.strip(), mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):  # nested past the parser's depth
            return None
        if not isinstance(tree.body, ast.List):
            return None
        calls = []
        for item in tree.body.elts:
            c = _call(item)
            if c is None:
                return None
            calls.append(c)
        return calls

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedToolCalls:
        parsed = super().extract(text, tools)
        return ParsedToolCalls(content=None, tool_calls=parsed.tool_calls) if parsed.tool_calls else parsed


def _call(node: ast.expr) -> ToolCall | None:
    """``name(key=literal, ...)`` as a call, or None."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    args = {}
    for kw in node.keywords:
        if kw.arg is None:  # **spread
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
            json.dumps(args[kw.arg], allow_nan=False)  # sets, bytes, complex, 1e999: not JSON
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
    return call(node.func.id, args)
