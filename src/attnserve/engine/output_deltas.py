"""Cumulative outputs as deltas, for sending them between processes: encode, then rebuild.

The engine's ``RequestOutput`` is cumulative (all tokens, the whole text, every logprob entry so
far). Sending it whole each step costs O(tokens so far) per request and step, O(n^2) over a
request. ``OutputEncoder`` (the engine process's side) sends what is new since the last output
it encoded for a request: new token ids and logprob entries, the text as (characters kept,
characters added) (a stop string can cut text already sent), the scalars, and what is set once
(the prompt, its token ids) in the first delta only. ``OutputAssembler`` (the frontend's side,
one per request) applies the deltas in order and returns ``RequestOutput`` objects equal, field
by field, to the engine's.

Token ids and logprob entries are append-only in the engine (a preempted or rerun request keeps
its output tokens); prompt logprobs grow as prefill chunks run. Logprob entries travel as tuples
(``Logprob`` dataclasses pickle several times slower).

Not here: the pipe, the messages around the deltas (``engine_process.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from attnserve.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["CompletionDelta", "OutputAssembler", "OutputEncoder", "RequestDelta"]

# one logprob entry (a position's {token id: Logprob}) as tuples: ((id, logprob, rank, text), ...)
_Entry = tuple[tuple[int, float, "int | None", "str | None"], ...]


class CompletionDelta(NamedTuple):
    index: int
    token_ids: list[int]  # new since the last delta
    text_keep: int  # characters of the text sent before that stay
    text: str  # characters appended after them
    logprobs: list[_Entry] | None  # new entries; None: the completion has no logprobs
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


class RequestDelta(NamedTuple):
    key: int  # the frontend's number for the request (request ids may be reused)
    prompt: tuple[str | None, list[int]] | None  # (text, token ids): in the first delta only
    prompt_logprobs: list[_Entry | None] | None  # new entries; None: none requested
    completions: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int
    metrics: dict[str, float]


def _encode_entry(entry: dict[int, Logprob] | None) -> _Entry | None:
    if entry is None:
        return None
    return tuple((tid, lp.logprob, lp.rank, lp.decoded_token) for tid, lp in entry.items())


def _decode_entry(entry: _Entry | None) -> dict[int, Logprob] | None:
    if entry is None:
        return None
    return {tid: Logprob(lp, rank, text) for tid, lp, rank, text in entry}


@dataclass(slots=True)
class _SentCompletion:
    num_tokens: int = 0
    text: str = ""
    num_logprobs: int = 0


@dataclass(slots=True)
class _Sent:
    num_prompt_logprobs: int = 0
    completions: list[_SentCompletion] = field(default_factory=list)


class OutputEncoder:
    """Turns each request's cumulative outputs into deltas; remembers what it sent per request."""

    def __init__(self) -> None:
        self._sent: dict[int, _Sent] = {}

    def __len__(self) -> int:
        return len(self._sent)

    def forget(self, key: int) -> None:
        """The request ended without a finished output (aborted, or refused)."""
        self._sent.pop(key, None)

    def encode(self, key: int, out: RequestOutput, num_prompt_logprobs: int | None = None) -> RequestDelta:
        """The delta from the last output of request ``key`` to ``out``. ``num_prompt_logprobs``:
        how many prompt logprob entries ``out`` had when it was made (the engine extends that
        list in place; None: all it has now). A finished output ends the request here."""
        sent = self._sent.get(key)
        first = sent is None
        if first:
            sent = self._sent[key] = _Sent(completions=[_SentCompletion() for _ in out.outputs])
        plp = None
        if out.prompt_logprobs is not None:
            end = len(out.prompt_logprobs) if num_prompt_logprobs is None else num_prompt_logprobs
            plp = [_encode_entry(e) for e in out.prompt_logprobs[sent.num_prompt_logprobs:end]]
            sent.num_prompt_logprobs = end
        completions = [self._encode_completion(c, s) for c, s in zip(out.outputs, sent.completions)]
        if out.finished:
            del self._sent[key]
        return RequestDelta(key, (out.prompt, out.prompt_token_ids) if first else None, plp, completions,
                            out.finished, out.num_cached_tokens, out.metrics)

    @staticmethod
    def _encode_completion(c: CompletionOutput, sent: _SentCompletion) -> CompletionDelta:
        tokens = c.token_ids[sent.num_tokens:]
        sent.num_tokens = len(c.token_ids)
        text, old = c.text, sent.text
        if text.startswith(old):  # the usual case: text only grows
            keep, added = len(old), text[len(old):]
        else:  # a stop string cut text sent before
            keep = 0
            while keep < min(len(old), len(text)) and old[keep] == text[keep]:
                keep += 1
            added = text[keep:]
        sent.text = text
        logprobs = None
        if c.logprobs is not None:
            logprobs = [_encode_entry(e) for e in c.logprobs[sent.num_logprobs:]]
            sent.num_logprobs = len(c.logprobs)
        return CompletionDelta(c.index, tokens, keep, added, logprobs, c.cumulative_logprob, c.finish_reason,
                               c.stop_reason)


@dataclass(slots=True)
class _Completion:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None


class OutputAssembler:
    """One request's cumulative outputs, rebuilt from its deltas (applied in order)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.completions: list[_Completion] = []

    def apply(self, delta: RequestDelta) -> RequestOutput:
        if delta.prompt is not None:
            self.prompt, self.prompt_token_ids = delta.prompt
            self.completions = [_Completion(c.index) for c in delta.completions]
        if delta.prompt_logprobs is not None:
            if self.prompt_logprobs is None:
                self.prompt_logprobs = []
            self.prompt_logprobs.extend(_decode_entry(e) for e in delta.prompt_logprobs)
        outputs = []
        for d, c in zip(delta.completions, self.completions):
            c.token_ids.extend(d.token_ids)
            c.text = c.text[:d.text_keep] + d.text if d.text_keep < len(c.text) else c.text + d.text
            if d.logprobs is not None:
                if c.logprobs is None:
                    c.logprobs = []
                c.logprobs.extend(_decode_entry(e) for e in d.logprobs)
            # copies, as the engine makes: an output handed out never changes afterwards
            outputs.append(CompletionOutput(c.index, c.text, list(c.token_ids), d.cumulative_logprob,
                                            list(c.logprobs) if c.logprobs is not None else None,
                                            d.finish_reason, d.stop_reason))
        # the prompt logprobs list is shared between outputs, as the engine shares it
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.prompt_logprobs, outputs,
                             delta.finished, delta.num_cached_tokens, delta.metrics)
