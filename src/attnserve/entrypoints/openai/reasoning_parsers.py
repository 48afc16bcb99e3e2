"""Reasoning parsers (vLLM's ``--reasoning-parser NAME``): the model's thinking, split off its
output into the message's ``reasoning_content`` (and ``reasoning``, vLLM's newer name), the rest
being the content, which a tool-call parser then reads.

``deepseek_r1`` (DeepSeek R1 and its distills, QwQ): as vLLM's, the text up to the first
``</think>`` is reasoning and the rest content (None when empty); a ``<think>`` opening the
output is dropped (the template may have written it into the prompt, so it may be missing); an
output with no ``</think>`` is all reasoning (cut short while thinking). As vLLM's server, when
the prompt closed the thinking itself (it ends with ``</think>``, as templates write it with
thinking turned off), only an output that opens with ``<think>`` has reasoning.

``qwen3`` (Qwen3, Qwen3.5, Qwen3-*-Thinking): as ``deepseek_r1`` when the prompt opened the
thinking (it ends with ``<think>``: the Qwen3-Thinking-2507 and Qwen3.5 templates) or the
output opens with ``<think>`` (Qwen3's own); otherwise the output has no reasoning and is all
content (``enable_thinking: false`` in ``chat_template_kwargs``, or an instruct model). vLLM's current parser makes such an output reasoning unless the request turns
thinking off; its earlier ones made an output without both tags content; this is the reading
that serves both kinds of model. As vLLM's, a ``<tool_call>`` followed by ``<function=`` (Qwen3.5
and Qwen3-Coder's calls) also ends the reasoning, the content starting at it.

``openai_gptoss`` (GPT-OSS): harmony's analysis channel is the reasoning, its final channel (and
commentary to nobody) the content (``tool_parsers/harmony.py`` reads it; tool calls are the
``openai`` tool parser's, which splits reasoning itself when it serves a request).

Streams (``ReasoningStream``) send reasoning as it comes and content after it, holding back a
tail that may start a tag; a whole output is a stream fed at once, so both agree.

Not here: which requests use a parser (``serving_chat.py``: not those whose output a grammar
forces from the first token, which cannot hold reasoning).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from attnserve.entrypoints.openai.tool_parsers import HarmonyStream
from attnserve.entrypoints.openai.tool_parsers.base import partial_suffix

__all__ = ["REASONING_PARSERS", "HarmonyReasoningStream", "ReasoningParser", "ReasoningStream",
           "get_reasoning_parser"]


class ReasoningParser:
    """Splits reasoning off an output. ``stream(prompt)`` gives one choice's stream; the prompt
    (its end is enough) says whether the template opened or closed the thinking."""

    name: ClassVar[str]
    keeps_special_tokens: ClassVar[bool] = False  # its tags are special tokens (harmony)

    def stream(self, prompt: str = "") -> ReasoningStream | HarmonyReasoningStream:
        raise NotImplementedError

    def extract(self, text: str, prompt: str = "") -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; content is ``text`` itself when there is no
        reasoning, else None when empty."""
        stream = self.stream(prompt)
        reasoning, content = stream.step(text, finished=True)
        return (reasoning or None, content or None) if stream.reasoned else (None, text)


class ThinkReasoningParser(ReasoningParser):
    start, end = "<think>", "</think>"
    reasoning_by_default: ClassVar[bool]  # with no think tag in the prompt, an output without <think> reasons

    def stream(self, prompt: str = "") -> ReasoningStream:
        tail = prompt.rstrip()
        opened = tail.endswith(self.start) or (self.reasoning_by_default and not tail.endswith(self.end))
        return ReasoningStream(self, in_reasoning=opened)

    def reasoning_end(self, text: str) -> tuple[int, int] | None:
        """(where the reasoning ends, where the content starts) in ``text``, or None."""
        at = text.find(self.end)
        return None if at < 0 else (at, at + len(self.end))

    def end_holdback(self, text: str) -> int:
        """How many characters at the end of ``text`` may still become the end of the reasoning."""
        return partial_suffix(text, self.end)


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"
    reasoning_by_default = True


class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"
    reasoning_by_default = False
    tool_call = "<tool_call>"
    _implicit_end = re.compile(r"<tool_call>\s*<function[\s=]")

    def reasoning_end(self, text: str) -> tuple[int, int] | None:
        found = [f for f in (super().reasoning_end(text), self._call_start(text)) if f is not None]
        return min(found) if found else None

    def _call_start(self, text: str) -> tuple[int, int] | None:
        match = self._implicit_end.search(text)
        return None if match is None else (match.start(), match.start())

    def end_holdback(self, text: str) -> int:
        keep = max(super().end_holdback(text), partial_suffix(text, self.tool_call))
        at = text.rfind(self.tool_call)
        if at >= 0:
            after = text[at + len(self.tool_call):].lstrip()
            if "<function".startswith(after):  # white space, or a part of <function: may yet be a call
                keep = max(keep, len(text) - at)
        return keep


class HarmonyReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    keeps_special_tokens = True

    def stream(self, prompt: str = "") -> HarmonyReasoningStream:
        return HarmonyReasoningStream()


@dataclass(slots=True)
class ReasoningStream:
    """One choice's text through a think-tag parser: ``step`` takes the new text and returns the
    reasoning and the content it lets out."""

    parser: ThinkReasoningParser
    in_reasoning: bool  # before the output's first text: the prompt opened the thinking
    opening: bool = True  # the output may still open with <think>
    reasoned: bool = False  # some of the output was reasoning (or its tags)
    buffer: str = ""  # received, not yet sent

    def step(self, delta: str, finished: bool) -> tuple[str, str]:
        self.buffer += delta
        start = self.parser.start
        if self.opening:
            head = self.buffer.lstrip()
            if not finished and (not head or (start.startswith(head) and head != start)):
                return "", ""  # may still be <think>
            self.opening = False
            if head.startswith(start):
                self.buffer, self.in_reasoning = head[len(start):], True
            self.reasoned = self.in_reasoning
        reasoning = ""
        if self.in_reasoning:
            found = self.parser.reasoning_end(self.buffer)
            if found is None:
                keep = 0 if finished else self.parser.end_holdback(self.buffer)
                reasoning, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            reasoning, self.buffer, self.in_reasoning = self.buffer[: found[0]], self.buffer[found[1]:], False
        content, self.buffer = self.buffer, ""
        return reasoning, content


@dataclass(slots=True)
class HarmonyReasoningStream:
    """Harmony's channels as reasoning and content (calls are dropped: no tool parser asked)."""

    harmony: HarmonyStream | None = None
    reasoned: bool = False

    def step(self, delta: str, finished: bool) -> tuple[str, str]:
        self.harmony = self.harmony or HarmonyStream()
        out = self.harmony.step(delta, finished)
        self.reasoned = self.reasoned or self.harmony.plain is False
        return out.reasoning, out.content


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
    "openai_gptoss": HarmonyReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser named ``name`` (``--reasoning-parser``); a ValueError naming the known ones."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]()
