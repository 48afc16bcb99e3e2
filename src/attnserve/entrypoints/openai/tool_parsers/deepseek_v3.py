"""``deepseek_v3``: DeepSeek V3 / R1-0528's tool calls, in its own tokens::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

As vLLM's parser: content is the text before ``<｜tool▁calls▁begin｜>`` (None when empty); each
complete ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`` gives a call whose arguments are the
fenced text as the model wrote it; a call that does not match the pattern, or is left open, is
skipped; with no call at all the whole text is content. The arguments may span lines (vLLM's
pattern takes one line only), and V3.1's ``NAME<｜tool▁sep｜>{...}`` (no type, no fence) is read
too. Streamed, each call goes out when ``<｜tool▁call▁end｜>`` closes it.
"""

from __future__ import annotations

from attnserve.entrypoints.openai.protocol import ToolCall
from attnserve.entrypoints.openai.tool_parsers.base import ToolParser, call

__all__ = ["DeepSeekV3ToolParser"]


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    calls_begin = "<｜tool▁calls▁begin｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"
    sep = "<｜tool▁sep｜>"
    markers = (calls_begin,)
    closers = ">"

    def section_calls(self, section: str, tools: dict[str, dict] | None, finished: bool) -> list[ToolCall] | None:
        calls = []
        for block in section.split(self.call_begin)[1:]:
            body, closed, _ = block.partition(self.call_end)
            c = self._call(body) if closed else None
            if c is not None:
                calls.append(c)
        return calls

    def _call(self, body: str) -> ToolCall | None:
        head, found, rest = body.partition(self.sep)
        if not found:
            return None
        if head.strip() in ("function", ""):  # V3: TYPE<sep>NAME\n```json\nARGS\n```
            name, newline, fenced = rest.partition("\n")
            fenced = fenced.strip()
            if not newline or not fenced.startswith("```json") or not fenced.endswith("```") or len(fenced) < 10:
                return None
            args = fenced[len("```json"):-3].strip()
        else:  # V3.1: NAME<sep>ARGS
            name, args = head, rest.strip()
        name = name.strip()
        return call(name, args) if name and args else None
