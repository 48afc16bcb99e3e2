"""``openai``: GPT-OSS's harmony format, read from the detokenised text. The output is messages::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the first message's ``<|start|>assistant`` is the prompt's last text). As vLLM reads them: the
analysis channel is reasoning, the final channel is the content, and a message to
``functions.NAME`` is a call of NAME whose arguments are its JSON text (normalised when it is
JSON, else as written). A commentary message to nobody (a preamble, which harmony shows the
user) is content too; messages to other recipients (built-in tools) are dropped. The recipient
may stand in the header before the channel or after it; a message ends with ``<|end|>``,
``<|call|>``, ``<|return|>``, the next ``<|start|>``, ``<|endoftext|>`` or the output's end. An
output that does not start as harmony (a header) is all content. These markers are special
tokens: requests this parser reads keep special tokens in their text.

Why not the openai-harmony library, as the issue suggested: it parses token ids of its own
encoding, and loads that encoding's vocabulary by downloading it at first use (it fails without
network, as in CI and on servers kept offline); the text format is small and read here instead,
with no dependency. ``HarmonyStream`` is the one reader: a whole output is a stream fed at once,
so streamed and whole outputs agree. Streamed, reasoning and content go out as they come
(holding back a tail that may start a marker), each call when its message ends.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from attnserve.entrypoints.openai.tool_parsers.base import (
    ParsedToolCalls,
    StreamDelta,
    ToolParser,
    call,
    partial_suffix,
)

__all__ = ["HarmonyStream", "OpenAIToolParser"]

_MESSAGE = "<|message|>"
_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|endoftext|>", "<|start|>")
_OPENERS = ("<|start|>", "<|channel|>", "<|constrain|>", "to=")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_CONSTRAIN = re.compile(r"<\|constrain\|>\s*([^\s<]+)")


class OpenAIToolParser(ToolParser):
    name = "openai"
    keeps_special_tokens = True
    handles_reasoning = True

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedToolCalls:
        out = HarmonyStream().step(text, finished=True)
        return ParsedToolCalls(content=out.content or None, tool_calls=out.tool_calls, reasoning=out.reasoning or None)

    def stream(self, tools: list[dict[str, Any]] | None = None) -> HarmonyStream:
        return HarmonyStream()


@dataclass(slots=True)
class HarmonyStream:
    """One choice's harmony text: ``step`` takes the new text and returns the reasoning and
    content it lets out and the calls that ended."""

    buffer: str = ""  # received, not yet read
    plain: bool | None = None  # the output is not harmony (None: not known yet)
    in_body: bool = False
    channel: str = ""
    recipient: str = ""
    content_type: str = ""
    body: str = ""  # a call's arguments so far
    num_calls: int = 0
    _out: StreamDelta = field(default_factory=StreamDelta)

    def step(self, delta: str, finished: bool) -> StreamDelta:
        self.buffer += delta
        self._out = StreamDelta()
        if self.plain is None:
            head = self.buffer.lstrip()
            undecided = not head or any(o.startswith(head) and o != head for o in _OPENERS)
            if undecided and not finished:
                return self._out
            self.plain = not head.startswith(_OPENERS)
        if self.plain:
            self._out.content, self.buffer = self.buffer, ""
            return self._out
        while self.buffer:
            if not self.in_body:
                at = self.buffer.find(_MESSAGE)
                if at < 0:  # a header still coming (or cut off: dropped)
                    self.buffer = "" if finished else self.buffer
                    break
                self._header(self.buffer[:at])
                self.buffer, self.in_body, self.body = self.buffer[at + len(_MESSAGE):], True, ""
            found = [(at, end) for end in _ENDS if (at := self.buffer.find(end)) >= 0]
            if not found:
                keep = 0 if finished else max(partial_suffix(self.buffer, end) for end in _ENDS)
                self._text(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                if finished:
                    self._close()
                break
            at, end = min(found)
            self._text(self.buffer[:at])
            self._close()
            self.buffer = self.buffer[at if end == "<|start|>" else at + len(end):]
        return self._out

    def _header(self, header: str) -> None:
        channel, recipient, constrain = _CHANNEL.search(header), _RECIPIENT.search(header), _CONSTRAIN.search(header)
        self.channel = channel.group(1) if channel else ""
        self.recipient = recipient.group(1) if recipient else ""
        words = header.replace("<|", " <|").split()
        self.content_type = constrain.group(1) if constrain else (words[-1] if words and words[-1] == "json" else "")

    def _text(self, text: str) -> None:
        if self.recipient.startswith("functions."):
            self.body += text
        elif self.recipient:
            return  # a built-in tool's input
        elif self.channel == "analysis":
            self._out.reasoning += text
        elif self.channel in ("final", "commentary"):
            self._out.content += text

    def _close(self) -> None:
        self.in_body = False
        if not self.recipient.startswith("functions."):
            return
        args = self.body.strip()
        if not self.content_type or "json" in self.content_type:
            try:
                args = json.dumps(json.loads(args), ensure_ascii=False)
            except ValueError:
                pass  # as the model wrote it
        self._out.tool_calls.append(call(self.recipient[len("functions."):], args))
        self.num_calls += 1
