"""Tool-call parsers for ``tool_choice`` "auto": the model writes tool calls in its own format,
in plain text, and the server turns them into ``tool_calls`` (vLLM's ``--enable-auto-tool-choice
--tool-call-parser NAME``).

``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call, as
Hermes 2 Pro / 3, Qwen2.5 and Qwen3 write them (their chat templates describe the format to the
model). As vLLM's parser does: the message's content is the text before the first block (None
when empty); each block's JSON gives a call whose ``arguments`` is its ``arguments`` object as
JSON text; a last block left open at the end of the output still counts; when any block is not
such JSON, there are no calls and the whole text is the content.

Streaming (``ToolCallStream``): text before the first block goes out as content as it comes,
holding back a tail that may be the start of ``<tool_call>``; each call goes out whole, as one
``tool_calls`` delta with its id, type, name and arguments, once its block closes (or the output
ends). A block that is not a call goes out as content, as written.

Not here: which requests use a parser (``serving_chat.py``); formats other than Hermes'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from attnserve.entrypoints.openai.protocol import FunctionCall, ToolCall

__all__ = ["TOOL_PARSERS", "HermesToolParser", "ParsedToolCalls", "ToolCallStream", "get_tool_parser"]


@dataclass(slots=True)
class ParsedToolCalls:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


class HermesToolParser:
    start = "<tool_call>"
    end = "</tool_call>"

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
        return ToolCall(function=FunctionCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False)))

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

    def extract(self, text: str) -> ParsedToolCalls:
        """The message a whole output makes (non-streaming)."""
        head, bodies = self.blocks(text)
        calls = [self.parse_call(b) for b in bodies]
        if not calls or any(c is None for c in calls):
            return ParsedToolCalls(content=text)
        return ParsedToolCalls(content=head or None, tool_calls=calls)


TOOL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}


def get_tool_parser(name: str) -> HermesToolParser:
    """The parser named ``name`` (``--tool-call-parser``); a ValueError naming the known ones."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


@dataclass(slots=True)
class ToolCallStream:
    """One streamed choice's text through a parser: ``step`` takes the new text and returns the
    content to send and the calls that completed."""

    parser: HermesToolParser
    buffer: str = ""  # received, not yet sent or parsed
    in_block: bool = False
    seen_block: bool = False  # content is only the text before the first block
    num_calls: int = 0

    def step(self, delta: str, finished: bool) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        content, calls = [], []
        start, end = self.parser.start, self.parser.end
        while self.buffer or (finished and self.in_block):
            if not self.in_block:
                at = self.buffer.find(start)
                if at < 0:
                    keep = 0 if finished else _partial_suffix(self.buffer, start)
                    if not self.seen_block:
                        content.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                if not self.seen_block:
                    content.append(self.buffer[:at])
                self.buffer, self.in_block, self.seen_block = self.buffer[at + len(start):], True, True
                continue
            at = self.buffer.find(end)
            if at < 0 and not finished:
                break
            body = self.buffer if at < 0 else self.buffer[:at]
            self.buffer = "" if at < 0 else self.buffer[at + len(end):]
            self.in_block = False
            call = self.parser.parse_call(body)
            if call is None:  # not a call: the block as it was written
                content.append(start + body + ("" if at < 0 else end))
            else:
                calls.append(call)
        self.num_calls += len(calls)
        return "".join(content), calls


def _partial_suffix(text: str, token: str) -> int:
    """The length of the longest tail of ``text`` that ``token`` starts with (it may be completed
    by the next text)."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0
