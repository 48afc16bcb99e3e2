"""Cumulative outputs as deltas, for sending them between processes: the format, merging, rebuilding.

The engine's ``RequestOutput`` is cumulative (all tokens, the whole text, every logprob entry so
far). Sending it whole each step costs O(tokens so far) per request and step, O(n^2) over a
request. A ``RequestDelta`` holds what is new since the request's last delta: new token ids and
logprob entries, the text as (characters kept, characters added) (a stop string can cut text
already sent), the scalars, and what is set once (the prompt, its token ids) in the first delta
only. The engine process makes them from the engine's request state
(``LLMEngine.step(deltas=True)``, ``RequestState.to_delta``); ``OutputEncoder`` makes the same
from cumulative outputs (the reference twin, for tests and benchmarks). ``merge_deltas`` joins
two consecutive deltas of a request into one (the engine process's outbox, while the frontend
is behind). ``OutputAssembler`` (the frontend's side, one per request) applies the deltas in
order and returns ``RequestOutput`` objects equal, field by field, to the engine's.

Token ids and logprob entries are append-only in the engine (a preempted or rerun request keeps
its output tokens); prompt logprobs grow as prefill chunks run. Deltas and logprob entries are
plain tuples, their layout named by the aliases below: named tuples and dataclasses pickle and
unpickle through Python code, 3-6 times slower, and a step moves a few hundred deltas.

Not here: the pipe, the messages around the deltas (``engine_process.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attnserve.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["CompletionDelta", "OutputAssembler", "OutputEncoder", "RequestDelta", "encode_entry", "merge_deltas",
           "text_delta"]

# one logprob entry (a position's {token id: Logprob}): ((token id, logprob, rank, text), ...)
_Entry = tuple[tuple[int, float, int | None, str | None], ...]

# (index, new token ids, characters of the text sent before that stay, characters appended after
# them, new logprob entries (None: the completion has none), cumulative logprob, finish reason,
# stop reason)
CompletionDelta = tuple[int, list[int], int, str, list[_Entry] | None, float | None, str | None,
                        int | str | None]

# (key: the frontend's number for the request (ids may be reused), (prompt text, prompt token ids)
# in the first delta only (else None), new prompt logprob entries (None: none asked), the
# completions' deltas, finished, num_cached_tokens, metrics)
RequestDelta = tuple[int, tuple[str | None, list[int]] | None, list[_Entry | None] | None,
                     list[CompletionDelta], bool, int, dict[str, float]]


def encode_entry(entry: dict[int, Logprob] | None) -> _Entry | None:
    """One logprob entry as the wire carries it."""
    if entry is None:
        return None
    return tuple((tid, lp.logprob, lp.rank, lp.decoded_token) for tid, lp in entry.items())


def text_delta(old: str, text: str) -> tuple[int, str]:
    """``text`` as (characters of ``old`` that stay, characters appended after them)."""
    if text is old:  # nothing new
        return len(old), ""
    if text.startswith(old):  # the usual case: text only grows
        return len(old), text[len(old):]
    keep = 0  # a stop string cut text sent before
    while keep < min(len(old), len(text)) and old[keep] == text[keep]:
        keep += 1
    return keep, text[keep:]


def merge_deltas(old: RequestDelta, new: RequestDelta) -> RequestDelta:
    """One delta that does what ``old`` then ``new`` (of the same request) do. The lists of
    ``old`` are extended in place (a long stall stays linear): it must not be used again."""
    key, prompt, prompt_logprobs, completions, _, _, _ = old
    if prompt_logprobs is not None:
        prompt_logprobs.extend(new[2])
    merged = []
    for c_old, c_new in zip(completions, new[3]):
        index, tokens, keep, added, logprobs, _, _, _ = c_old
        tokens.extend(c_new[1])
        if c_new[2] >= keep + len(added):  # the usual case: new text only appends
            added += c_new[3]
        elif c_new[2] >= keep:  # new cut some of what old added
            added = added[:c_new[2] - keep] + c_new[3]
        else:  # new cut text from before old
            keep, added = c_new[2], c_new[3]
        if logprobs is not None:
            logprobs.extend(c_new[4])
        merged.append((index, tokens, keep, added, logprobs, *c_new[5:]))
    return (key, prompt, prompt_logprobs, merged, *new[4:])


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
            plp = [encode_entry(e) for e in out.prompt_logprobs[sent.num_prompt_logprobs:end]]
            sent.num_prompt_logprobs = end
        completions = [self._encode_completion(c, s) for c, s in zip(out.outputs, sent.completions)]
        if out.finished:
            del self._sent[key]
        return (key, (out.prompt, out.prompt_token_ids) if first else None, plp, completions, out.finished,
                out.num_cached_tokens, out.metrics)

    @staticmethod
    def _encode_completion(c: CompletionOutput, sent: _SentCompletion) -> CompletionDelta:
        tokens = c.token_ids[sent.num_tokens:]
        sent.num_tokens = len(c.token_ids)
        keep, added = text_delta(sent.text, c.text)
        sent.text = c.text
        logprobs = None
        if c.logprobs is not None:
            logprobs = [encode_entry(e) for e in c.logprobs[sent.num_logprobs:]]
            sent.num_logprobs = len(c.logprobs)
        return c.index, tokens, keep, added, logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason


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
        _, prompt, prompt_logprobs, completions, finished, num_cached_tokens, metrics = delta
        if prompt is not None:
            self.prompt, self.prompt_token_ids = prompt
            self.completions = [_Completion(d[0]) for d in completions]
        if prompt_logprobs is not None:
            if self.prompt_logprobs is None:
                self.prompt_logprobs = []
            self.prompt_logprobs.extend(_decode_entry(e) for e in prompt_logprobs)
        outputs = []
        for (index, tokens, keep, text, logprobs, cumulative, finish, stop), c in zip(completions, self.completions):
            c.token_ids.extend(tokens)
            c.text = c.text[:keep] + text if keep < len(c.text) else c.text + text
            if logprobs is not None:
                if c.logprobs is None:
                    c.logprobs = []
                c.logprobs.extend(_decode_entry(e) for e in logprobs)
            # copies, as the engine makes: an output handed out never changes afterwards
            outputs.append(CompletionOutput(index, c.text, list(c.token_ids), cumulative,
                                            list(c.logprobs) if c.logprobs is not None else None, finish, stop))
        # the prompt logprobs list is shared between outputs, as the engine shares it
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.prompt_logprobs, outputs,
                             finished, num_cached_tokens, metrics)
