"""From engine tokens to user outputs: detokenisation, stop strings, logprobs, ``n`` children.

One ``RequestState`` per user request accumulates text and logprobs per completion and builds
cumulative ``RequestOutput`` objects (``to_output``), or what is new since its last delta
(``to_delta``: the engine process's, ``output_deltas.py``). Stop strings are found here, on the text; the engine then
finishes the request in the scheduler. This file knows tokens and text, not blocks or tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from attnserve.core.request import Request, RequestStatus
from attnserve.core.step import TokenLogprobs
from attnserve.detokenizer import IncrementalDetokenizer, decode_token
from attnserve.engine.output_deltas import CompletionDelta, RequestDelta, encode_entry, text_delta
from attnserve.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["CompletionState", "RequestState"]


@dataclass(slots=True)
class CompletionState:
    request: Request
    index: int
    detok: IncrementalDetokenizer | None
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    _scan_from: int = 0  # where the stop-string search resumes
    # what the deltas have carried so far (to_delta)
    _sent_tokens: int = 0
    _sent_text: str = ""
    _sent_logprobs: int = 0

    def to_delta(self) -> CompletionDelta:
        """What is new since the last call (the first: everything)."""
        token_ids = self.request.output_token_ids
        tokens, self._sent_tokens = token_ids[self._sent_tokens:], len(token_ids)
        keep, added = text_delta(self._sent_text, self.text)
        self._sent_text = self.text
        logprobs = None
        if self.logprobs is not None:
            logprobs = [encode_entry(e) for e in self.logprobs[self._sent_logprobs:]]
            self._sent_logprobs = len(self.logprobs)
        return (self.index, tokens, keep, added, logprobs, self.cumulative_logprob, self.finish_reason,
                self.stop_reason)


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[CompletionState]
    tokenizer: object
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    _sent_prompt_logprobs: int = -1  # prompt logprob entries the deltas have carried (-1: no delta yet)

    @property
    def finished(self) -> bool:
        for c in self.completions:  # not all(...): a generator costs a microsecond, per request and step
            if c.finish_reason is None:
                return False
        return True

    def add_prompt_logprobs(self, entries: list[TokenLogprobs]) -> None:
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        self.prompt_logprobs.extend(self._to_dict(e) for e in entries)

    def _to_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        ids, lps, rank = entry
        out: dict[int, Logprob] = {}
        for j, (tid, lp) in enumerate(zip(ids, lps)):
            if tid in out:
                continue
            # entry 0 is the chosen token with its own rank; the others are the top-k in order
            out[tid] = Logprob(lp, rank if j == 0 else j, decode_token(self.tokenizer, tid) if self.tokenizer else None)
        return out

    def add_token(self, c: CompletionState, token_logprobs: TokenLogprobs | None) -> str | None:
        """Account for a new token of completion ``c``; returns a stop string it completed."""
        self.last_token_time = now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        token = c.request.output_token_ids[-1]
        if token_logprobs is not None:
            c.logprobs = c.logprobs or []
            c.logprobs.append(self._to_dict(token_logprobs))
            c.cumulative_logprob = (c.cumulative_logprob or 0.0) + token_logprobs[1][0]
        if c.detok is None:
            return None
        if c.request.status is RequestStatus.FINISHED_STOPPED \
                and not c.request.sampling_params.include_stop_str_in_output:
            # the scheduler stopped on this token (EOS or stop_token_ids): as vLLM, its text is
            # not part of the output (it is among token_ids), whatever skip_special_tokens says
            return None
        c.text += c.detok.step([token])
        return self._check_stop_strings(c)

    def _check_stop_strings(self, c: CompletionState) -> str | None:
        params = c.request.sampling_params
        if not params.stop:
            return None
        longest = max(len(s) for s in params.stop)
        start = max(c._scan_from - longest + 1, 0)
        best: tuple[int, str] | None = None
        for s in params.stop:
            at = c.text.find(s, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        c._scan_from = len(c.text)
        if best is None:
            return None
        at, s = best
        c.text = c.text[: at + len(s)] if params.include_stop_str_in_output else c.text[:at]
        return s

    def finish(self, c: CompletionState) -> None:
        if c.finish_reason is None:
            c.finish_reason = c.request.status.value
            c.stop_reason = c.request.stop_reason
            if c.detok is not None and c.finish_reason != "stop":
                c.text += c.detok.flush()

    def to_output(self) -> RequestOutput:
        outs = [CompletionOutput(index=c.index, text=c.text, token_ids=list(c.request.output_token_ids),
                                 cumulative_logprob=c.cumulative_logprob,
                                 logprobs=list(c.logprobs) if c.logprobs is not None else None,
                                 finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                for c in self.completions]
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             prompt_logprobs=self.prompt_logprobs, outputs=outs, finished=self.finished,
                             num_cached_tokens=self.num_cached_tokens, metrics=self.metrics())

    def to_delta(self) -> RequestDelta:
        """What is new since the last call, as ``output_deltas.RequestDelta`` with the request id as
        its key (the first call: everything, and the prompt): applied in order by an
        ``OutputAssembler``, the deltas give ``to_output``'s outputs."""
        first = self._sent_prompt_logprobs < 0
        sent_prompt_logprobs = max(self._sent_prompt_logprobs, 0)
        prompt_logprobs = None
        if self.prompt_logprobs is not None:
            prompt_logprobs = [encode_entry(e) for e in self.prompt_logprobs[sent_prompt_logprobs:]]
            sent_prompt_logprobs = len(self.prompt_logprobs)
        self._sent_prompt_logprobs = sent_prompt_logprobs
        return (self.request_id, (self.prompt, self.prompt_token_ids) if first else None, prompt_logprobs,
                [c.to_delta() for c in self.completions], self.finished, self.num_cached_tokens, self.metrics())

    @property
    def num_cached_tokens(self) -> int:
        return max(self.completions[0].request.num_cached_tokens, 0)

    def metrics(self) -> dict[str, float]:
        """vLLM's RequestStateStats, on time.monotonic(): arrival, first scheduled (of any of the
        n completions), first and last token; ServerMetrics turns them into the phase histograms."""
        metrics = {"arrival_time": self.arrival_time}
        scheduled = [c.request.first_scheduled_time for c in self.completions
                     if c.request.first_scheduled_time is not None]
        if scheduled:
            metrics["scheduled_time"] = min(scheduled)
        if self.first_token_time is not None:
            metrics["time_to_first_token"] = self.first_token_time - self.arrival_time
            metrics["first_token_time"] = self.first_token_time
            metrics["last_token_time"] = self.last_token_time
        return metrics

def make_detokenizer(tokenizer, request: Request) -> IncrementalDetokenizer | None:
    if tokenizer is None or not request.sampling_params.detokenize:
        return None
    return IncrementalDetokenizer(tokenizer, request.prompt_token_ids,
                                  skip_special_tokens=request.sampling_params.skip_special_tokens)
