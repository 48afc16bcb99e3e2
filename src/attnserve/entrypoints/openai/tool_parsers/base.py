"""What every tool-call parser shares: the parsed message, the streamed delta, the parser's
contract and the stream that runs any parser over text as it comes.

A parser knows where its calls start in the model's text (``section_start``: the first of its
markers, or the output's start for formats that are nothing but calls) and which calls a piece
of text from there holds (``section_calls``). From those two, the same for every format:

- whole outputs (``ToolParser.extract``): the content is the text before the calls (None when
  empty); when the calls' section holds no call (it is not the format), there are none and the
  whole text is the content, as vLLM's parsers fall back;
- streams (``ToolCallStream``): text before the calls goes out as content as it comes, holding
  back a tail that may start a marker; each call goes out whole (id, type, name, arguments) once
  the parser finds it complete, at the latest when the output ends; a section that ends with no
  call goes out as content, as written. Fed in any pieces, a stream sends what ``extract`` gives
  for the whole text, but for a section that turns out not to be calls after some calls went out.

Not here: the formats (one module each beside this one), reasoning (``reasoning_parsers.py``).
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field
from typing import Any, ClassVar

from attnserve.entrypoints.openai.protocol import FunctionCall, ToolCall

__all__ = ["ParsedToolCalls", "StreamDelta", "ToolCallStream", "ToolParser", "call", "mistral_call_id",
           "partial_suffix", "tool_schemas"]


@dataclass(slots=True)
class ParsedToolCalls:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None  # formats that carry it (harmony's analysis channel)


@dataclass(slots=True)
class StreamDelta:
    """What one step of a stream lets out: content text, calls that completed, reasoning text."""

    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""


class ToolParser:
    """A model's tool-call format. Subclasses set ``name`` and ``markers`` (or override
    ``section_start``) and implement ``section_calls``."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()  # texts that open the calls' section, wherever they are
    # the section is re-read while streaming only after a delta with one of these (a call can
    # only complete with one); empty: after every delta
    closers: ClassVar[str] = ""
    # the format's markers are special tokens: requests it parses are detokenised with them
    keeps_special_tokens: ClassVar[bool] = False
    handles_reasoning: ClassVar[bool] = False  # it splits reasoning off itself (harmony)

    def section_start(self, text: str, at_output_start: bool) -> int | None:
        """Where the calls' section starts in ``text`` (the output's not yet sent tail; at its
        start when ``at_output_start``), or None."""
        found = [at for m in self.markers if (at := text.find(m)) >= 0]
        return min(found) if found else None

    def start_holdback(self, text: str, at_output_start: bool) -> int:
        """How many characters at the end of ``text`` (no section in it) may still become the
        start of one."""
        return max((partial_suffix(text, m) for m in self.markers), default=0)

    def section_calls(self, section: str, tools: dict[str, dict] | None, finished: bool) -> list[ToolCall] | None:
        """The calls that ``section`` (from its start to the output's end so far) holds complete.

        Args:
            tools: the request's functions by name (their parameter schemas), for formats that
                type their arguments from them.
            finished: the output ended: a call left open counts if the format allows it.
        Returns:
            The calls, in order; while not ``finished``, a prefix of those the finished text
            will give. None or [] when finished: the section is not calls.
        """
        raise NotImplementedError

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedToolCalls:
        """The message a whole output makes (non-streaming)."""
        start = self.section_start(text, True)
        calls = None if start is None else self.section_calls(text[start:], tool_schemas(tools), True)
        if not calls:
            return ParsedToolCalls(content=text)
        return ParsedToolCalls(content=text[:start] or None, tool_calls=calls)

    def stream(self, tools: list[dict[str, Any]] | None = None) -> ToolCallStream:
        """A stream of one choice's text through this parser."""
        return ToolCallStream(self, tool_schemas(tools))


@dataclass(slots=True)
class ToolCallStream:
    """One streamed choice's text through a parser: ``step`` takes the new text and returns the
    content to send and the calls that completed."""

    parser: ToolParser
    tools: dict[str, dict] | None = None
    pending: str = ""  # received before the section, not yet sent
    section: str | None = None  # from the section's start on, once it started
    sent_any: bool = False  # some text went out or was held as the section (not the output's start)
    num_calls: int = 0

    def step(self, delta: str, finished: bool) -> StreamDelta:
        out = StreamDelta()
        fresh = self.section is None
        if self.section is None:
            self.pending += delta
            at_start = not self.sent_any
            at = self.parser.section_start(self.pending, at_start)
            if at is None:
                keep = 0 if finished else self.parser.start_holdback(self.pending, at_start)
                out.content, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
                self.sent_any = self.sent_any or bool(out.content)
                return out
            out.content, self.section, self.pending, self.sent_any = self.pending[:at], self.pending[at:], "", True
        else:
            self.section += delta
        closers = self.parser.closers
        if fresh or finished or not closers or any(ch in delta for ch in closers):
            calls = self.parser.section_calls(self.section, self.tools, finished) or []
            out.tool_calls = calls[self.num_calls:]
            self.num_calls = max(self.num_calls, len(calls))
        if finished and self.num_calls == 0:  # not calls after all: the section as written
            out.content += self.section
        return out


def call(name: str, arguments: Any, call_id: str | None = None) -> ToolCall:
    """A function call; ``arguments`` as JSON text (a string is taken as it is)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    fn = FunctionCall(name=name, arguments=args)
    return ToolCall(function=fn) if call_id is None else ToolCall(id=call_id, function=fn)


_ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Mistral's tool call ids: 9 letters and digits (its templates refuse others)."""
    return "".join(random.choices(_ALPHANUMERIC, k=9))


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict]:
    """The request's function tools' parameter schemas by name (checked by the request)."""
    out = {}
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters") or {}
    return out


def partial_suffix(text: str, token: str) -> int:
    """The length of the longest tail of ``text`` that ``token`` starts with (it may be completed
    by the next text)."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0
