"""``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call,
as Hermes 2 Pro / 3, Qwen2.5 and Qwen3 write them (their chat templates describe the format to
the model).

As vLLM's parser does: the message's content is the text before the first block (None when
empty); each block's JSON gives a call whose ``arguments`` is its ``arguments`` object as JSON
text; a last block left open at the end of the output still counts; when any block is not such
JSON, there are no calls and the whole text is the content. Streamed, each call goes out when
its block closes.
"""

from __future__ import annotations

import json
from typing import Any

from attnserve.entrypoints.openai.protocol import ToolCall
from attnserve.entrypoints.openai.tool_parsers.base import ToolParser, call

__all__ = ["HermesToolParser"]


class HermesToolParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    markers = (start,)
    closers = ">"

    def parse_call(self, body: str) -> ToolCall | None:
        """The call a block's body holds, or None when it is not ``{"name": str, "arguments": {...}}``."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args: Any = obj.get("arguments", {})
        if not isinstance(args, dict):
            return None
        return call(obj["name"], args)

    def blocks(self, text: str) -> tuple[str, list[str]]:
        """The text before the first block, and each block's body (the last may be unclosed)."""
        head, _, rest = text.partition(self.start)
        if not _:
            return text, []
        bodies = []
        while True:
            body, closed, rest = rest.partition(self.end)
            bodies.append(body)
            if not closed:
                return head, bodies
            _, opened, rest = rest.partition(self.start)
            if not opened:
                return head, bodies

    def section_calls(self, section: str, tools: dict[str, dict] | None, finished: bool) -> list[ToolCall] | None:
        _, bodies = self.blocks(section)
        if not finished and self.end not in section[section.rfind(self.start):]:
            bodies = bodies[:-1]  # the last block is open: it may still grow
        calls = []
        for body in bodies:
            c = self.parse_call(body)
            if c is None:
                return None if finished else calls
            calls.append(c)
        return calls
