"""Formats whose calls are JSON after a marker: ``llama3_json`` and ``mistral``.

``llama3_json`` (Llama 3.1 / 3.2 / 3.3 and 4 with JSON tool templates; ``llama4_json`` is the
same): the output is the calls, ``{"name": ..., "parameters": {...}}`` objects (``arguments``
instead of ``parameters`` too) separated by ``;``, after an optional ``<|python_tag|>`` (a special
token: the detokeniser usually drops it). As vLLM's streaming parser: only an output that starts
with them (after white space) is calls; text after the last object is dropped; content is None
with calls. Any object that is not a call makes the whole text content. Streamed, each call goes
out when its object closes.

``mistral`` (Mistral 7B Instruct v0.3, Mistral Small / Nemo / Large, Devstral...): content, then
``[TOOL_CALLS]`` (a special token: requests it parses keep special tokens, as vLLM's parser asks)
and either a JSON list of ``{"name": ..., "arguments": {...}}`` (tokenizers before v11) or, from
v11, one ``[TOOL_CALLS]NAME[ARGS]{...}`` per call (``[CALL_ID]ID`` may sit before ``[ARGS]``;
``NAME{...}`` without ``[ARGS]`` too). Content is the text before the first ``[TOOL_CALLS]``
(None when only white space), text after the JSON (the end-of-sequence token) is dropped, and
call ids are 9 letters and digits, as Mistral's chat templates require. Streamed, the list's calls
go out when it closes, a v11 call when its arguments' object closes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from attnserve.entrypoints.openai.protocol import ToolCall
from attnserve.entrypoints.openai.tool_parsers.base import (
    ParsedToolCalls,
    ToolParser,
    call,
    mistral_call_id,
)

__all__ = ["Llama3JsonToolParser", "MistralToolParser"]

_DECODER = json.JSONDecoder()


def _decode(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value at ``text[pos:]`` (after white space) and where it ends, or None."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    python_tag = "<|python_tag|>"
    closers = "}"

    def section_start(self, text: str, at_output_start: bool) -> int | None:
        head = text.lstrip()
        if at_output_start and (head.startswith(self.python_tag) or head.startswith("{")):
            return 0
        return None

    def start_holdback(self, text: str, at_output_start: bool) -> int:
        head = text.lstrip()
        return len(text) if at_output_start and self.python_tag.startswith(head) else 0

    def section_calls(self, section: str, tools: dict[str, dict] | None, finished: bool) -> list[ToolCall] | None:
        text = section.lstrip()
        pos = len(self.python_tag) if text.startswith(self.python_tag) else 0
        calls = []
        while True:
            found = _decode(text, pos)
            if found is None:  # open, or not JSON: the calls before it stand
                return calls if calls or not finished else None
            obj, pos = found
            args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
            if not isinstance(obj.get("name") if isinstance(obj, dict) else None, str) or not isinstance(args, dict):
                return None if finished else calls
            calls.append(call(obj["name"], args))
            rest = text[pos:].lstrip()
            if not rest.startswith(";"):
                return calls  # the last one; what follows is dropped
            pos = len(text) - len(rest) + 1

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedToolCalls:
        parsed = super().extract(text, tools)
        return ParsedToolCalls(content=None, tool_calls=parsed.tool_calls) if parsed.tool_calls else parsed


class MistralToolParser(ToolParser):
    name = "mistral"
    bot = "[TOOL_CALLS]"
    markers = (bot,)
    closers = "}]"
    keeps_special_tokens = True
    _name = re.compile(r"[A-Za-z0-9_.\-]+")

    def section_calls(self, section: str, tools: dict[str, dict] | None, finished: bool) -> list[ToolCall] | None:
        body = section[len(self.bot):]
        if not finished and not body.strip():
            return []
        if body.lstrip().startswith("["):  # before v11: one JSON list of calls
            found = _decode(body, 0)
            if found is None:
                return None if finished else []
            items = found[0]
            if not isinstance(items, list) or not all(self._is_call(o) for o in items):
                return None
            return [call(o["name"], o.get("arguments", {}), mistral_call_id()) for o in items]
        calls = []
        segments = body.split(self.bot)
        for seg in segments:
            c = self._v11_call(seg)
            if c is None:  # still open, or not a call
                return None if finished else calls
            calls.append(c)
        return calls

    @staticmethod
    def _is_call(obj: Any) -> bool:
        return isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments", {}), dict)

    def _v11_call(self, seg: str) -> ToolCall | None:
        """``NAME[ARGS]{...}``, ``NAME[CALL_ID]ID[ARGS]{...}`` or ``NAME{...}``, or None."""
        if "[ARGS]" in seg:
            head, _, args_text = seg.partition("[ARGS]")
            name = head.partition("[CALL_ID]")[0].strip()
        else:
            brace = seg.find("{")
            if brace < 0:
                return None
            name, args_text = seg[:brace].strip(), seg[brace:]
        found = _decode(args_text, 0)
        if not self._name.fullmatch(name) or found is None or not isinstance(found[0], dict):
            return None
        return call(name, found[0], mistral_call_id())
