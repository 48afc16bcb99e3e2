"""``POST /v1/completions``: prompts in, text completions out, whole or as server-sent events.

A request may carry several prompts (texts or token-id lists); each is one engine request and
its ``n`` completions are choices ``prompt_index * n + i``. Every prompt is checked before any
is submitted, so a bad one leaves nothing running. Also the pieces both endpoints share:
``StreamProgress`` (what a stream has sent of one completion) and ``merge`` (several output
streams as one).

Not here: the HTTP layer and error rendering (``api_server.py``), the wire models
(``protocol.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from attnserve.detokenizer import decode_token
from attnserve.engine.engine import PromptError, truncate_prompt_ids
from attnserve.engine.engine_client import EngineClient
from attnserve.entrypoints.openai.metrics import ServerMetrics
from attnserve.entrypoints.openai.prompt_logprobs import (
    CompletionChoiceWithPromptLogprobs,
    check_prompt_logprobs,
    render_prompt_logprobs,
)
from attnserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    OpenAIError,
    ServerLimits,
    UsageInfo,
    check_context,
    check_for_model,
    check_logprobs,
    check_prompt_chars,
    completion_chunk_head,
    completion_chunk_sse,
    random_id,
    sse,
)
from attnserve.layers.sampler import unpack_bitmask
from attnserve.outputs import CompletionOutput, Logprob, RequestOutput
from attnserve.sampling_params import SamplingParams
from attnserve.tokenizer import Tokenizer

__all__ = ["OpenAIServingCompletion", "StreamProgress", "check_constraints", "compile_constraint",
           "first_token_bans", "first_token_conflict", "merge", "raise_if_failed", "stop_holdback"]

T = TypeVar("T")
_DONE = object()


@dataclass(slots=True)
class StreamProgress:
    """What a stream has sent of one completion: characters, tokens, and whether it ended."""

    num_chars: int = 0
    num_tokens: int = 0
    text_offset: int = 0  # for completions-style logprobs
    done: bool = False
    prefix: str = ""  # sent before the first new text (the prompt, when echoing)

    def advance(self, c: CompletionOutput, holdback: int) -> tuple[str, int, int]:
        """New text and the range of new tokens of ``c`` since the last call.

        While unfinished, the last ``holdback`` characters are kept back: they may be the start
        of a stop string that the engine will cut from the text.
        """
        end = len(c.text) if c.finished else max(len(c.text) - holdback, self.num_chars)
        text = c.text[self.num_chars : end]
        start = self.num_tokens
        self.num_chars = max(end, self.num_chars)
        self.num_tokens = len(c.token_ids)
        self.done = c.finished
        return text, start, self.num_tokens


def stop_holdback(stop: str | list[str] | None) -> int:
    stops = [stop] if isinstance(stop, str) else (stop or [])
    return max((len(s) for s in stops), default=1) - 1


def raise_if_failed(out: RequestOutput) -> None:
    """An ``OpenAIError`` when a completion of ``out`` failed inside the engine (finish reason
    "error": a step or its output processing raised on this request alone, or its grammar
    refused a token; the message is in ``stop_reason``). A ``PromptError`` (a request the engine
    found it cannot serve) is the client's fault, a 400; anything else is the server's, a 500.
    Clients thus see a failure, not a choice cut short: the whole response fails, as vLLM's does,
    and the request's other completions are aborted when its stream closes."""
    for c in out.outputs:
        if c.finish_reason != "error":
            continue
        reason = str(c.stop_reason or "unknown error")
        if reason.startswith(f"{PromptError.__name__}: "):
            raise OpenAIError(f"the request cannot be served: {reason.partition(': ')[2]}")
        raise OpenAIError(f"the request failed in the engine: {reason}", status=500)


async def compile_constraint(engine: EngineClient, req: CompletionRequest | ChatCompletionRequest,
                             params: SamplingParams) -> None:
    """Compile the request's structured-output grammar on a worker thread (the engine thread
    then finds it in the cache): one that does not compile is a 400 before anything runs."""
    if params.structured_outputs is None:
        return
    try:
        await asyncio.to_thread(engine.structured.compile, params.structured_outputs)
    except ValueError as e:
        raise OpenAIError(str(e), param=req.output_constraint()[0]) from e


async def check_constraints(engine: EngineClient, req: CompletionRequest | ChatCompletionRequest,
                            params: SamplingParams) -> None:
    """``compile_constraint``, then a 400 for constraints that contradict each other from the
    first token on: nothing the grammar, ``allowed_token_ids``, ``bad_words`` and ``min_tokens``
    leave could be sampled (the sampler would pick a token they all forbid). Only the first
    token is checked: constraints that first meet after some tokens (a grammar that needs, a
    few tokens in, a token the request disallows) are not found here; the sampler, left with
    no token there, takes one the constraints forbid, as vLLM's does."""
    await compile_constraint(engine, req, params)
    if params.allowed_token_ids is None and not params.bad_words and params.min_tokens == 0:
        return  # nothing that bans tokens: a grammar alone always allows a first one
    conflict = await asyncio.to_thread(first_token_conflict, engine, params, req.output_constraint()[0])
    if conflict is not None:
        field, message = conflict
        raise OpenAIError(f"no token can be generated: {message}", param=field, code="conflicting_constraints")


def first_token_conflict(engine: EngineClient, params: SamplingParams,
                         constraint: str | None = None) -> tuple[str, str] | None:
    """(the field to name, why) when no token is left to sample first, else None
    (``constraint``: the request field the output constraint came from)."""
    vocab, grammar, allowed = engine.vocab_size, params.structured_outputs, params.allowed_token_ids
    tok = engine.tokenizer
    bans = [t for t in first_token_bans(tok, params.bad_words or []) if t < vocab] if tok is not None else []
    min_bans: list[int] = []
    if params.min_tokens > 0 and grammar is None:  # a grammar decides where the output ends
        eos = () if params.ignore_eos else (*engine.structured.stop_token_ids,
                                            *engine.generation_config.eos_token_ids)
        min_bans = [t for t in (*params.stop_token_ids, *eos) if t < vocab]
    if allowed is None and not bans and not min_bans:
        return None  # a grammar alone always allows a first token
    said = []
    if grammar is not None:
        bitmask = engine.structured.fill_bitmask([engine.structured.grammar_for(grammar)])
        left = unpack_bitmask(bitmask, vocab)[0]
        said.append(f"{constraint or 'the output constraint'} allows {int(left.sum())} tokens first")
    else:
        left = torch.ones(vocab, dtype=torch.bool)
    if allowed is not None:
        only = torch.zeros(vocab, dtype=torch.bool)
        only[allowed] = True
        left &= only
        said.append(f"allowed_token_ids allows only {sorted(set(allowed))[:8]}")
    for ids, why in ((bans, "bad_words bans"), (min_bans, f"min_tokens ({params.min_tokens}) bans the end and stop "
                                                             "tokens")):
        if ids:
            left[ids] = False
            said.append(f"{why} {sorted(set(ids))[:8]}")
    if bool(left.any()):
        return None
    field = "allowed_token_ids" if allowed is not None else "bad_words" if bans else "min_tokens"
    return field, "; ".join(said)


def first_token_bans(tokenizer: Tokenizer, bad_words: Sequence[str]) -> list[int]:
    """The tokens ``bad_words`` ban from the first generated token on: the one-token words, as
    the engine tokenises them (``LLMEngine.bad_words_token_ids``: the word without its leading
    spaces, and with one space before it)."""
    bans = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if len(plain) == 1:
            bans.append(plain[0])
            if len(spaced) == 1 and spaced[0] != plain[0]:
                bans.append(spaced[0])
    return bans


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, tagged with the stream's index.

    Closing the merged stream (or cancelling its consumer) closes every source stream.
    """
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    queue.put_nowait((i, item))
            queue.put_nowait((i, _DONE))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((i, e))

    if len(streams) == 1:  # the common case, without a task and a queue hop per item
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is _DONE:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class OpenAIServingCompletion:
    def __init__(self, engine: EngineClient, model_name: str, metrics: ServerMetrics,
                 limits: ServerLimits | None = None):
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.limits = limits or ServerLimits()

    async def create(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """Check, submit and answer a completion request (an SSE stream when ``stream``).

        Raises:
            OpenAIError: the request cannot be served (nothing was submitted).
        """
        arrival = time.perf_counter()
        texts = req.prompts()
        self.limits.check(req.n, len(texts), req.stop, req.best_of)
        req.check_supported()
        check_logprobs(req.logprobs, self.engine.max_logprobs, "logprobs")
        prompt_logprobs = check_prompt_logprobs(req.prompt_logprobs, self.engine.vocab_size, self.engine.max_logprobs)
        # tokenising is the client's work: off the event loop, which serves every other client
        prompts = await asyncio.to_thread(
            lambda: [self._prompt_ids(p, req.add_special_tokens, req.truncate_prompt_tokens) for p in texts]
        )
        defaults = self.engine.generation_config  # the model's, for the fields the request leaves out
        params = [
            check_for_model(
                defaults.apply(
                    req.to_sampling_params(
                        check_context(len(ids), req.max_tokens, self.engine.max_model_len), prompt_logprobs
                    ),
                    req.model_fields_set,
                ),
                self.engine.vocab_size,
                self.engine.max_logprobs,
            )
            for _, ids in prompts
        ]
        await check_constraints(self.engine, req, params[0])
        rid = random_id("cmpl")
        streams = [
            self.metrics.track(
                self.engine.generate(f"{rid}-{i}", {"prompt_token_ids": ids}, p), arrival, p
            )
            for i, ((_, ids), p) in enumerate(zip(prompts, params))
        ]
        if req.stream:
            return self._stream(rid, req, prompts, streams)
        finals: list[RequestOutput | None] = [None] * len(prompts)
        async with aclosing(merge(streams)) as merged:
            async for i, out in merged:
                raise_if_failed(out)
                finals[i] = out
        if any(f is None or not f.finished for f in finals):
            raise OpenAIError("the request was aborted", status=500)
        choices = [
            self._chunk_choice(
                req, i * req.n + c.index, StreamProgress(prefix=text if req.echo else ""), c, out, whole=True
            )
            for i, ((text, _), out) in enumerate(zip(prompts, finals))
            for c in out.outputs
        ]
        return CompletionResponse(
            id=rid, model=self.model_name, choices=choices, usage=_usage(finals)
        )

    def _prompt_ids(self, prompt: str | list[int], add_special_tokens: bool = True,
                    keep: int | None = None) -> tuple[str, list[int]]:
        """(prompt text, token ids), checked as the engine would check them; the last ``keep``
        tokens only (``truncate_prompt_tokens``), their text then decoded from them. A prompt
        that cannot fit the model is refused before the work that grows with it: a text from
        its length in characters, before it is tokenised; token ids before they are decoded."""
        tok, max_model_len = self.engine.tokenizer, self.engine.max_model_len
        if isinstance(prompt, str):
            if tok is None:
                raise OpenAIError("this model has no tokenizer: send token ids", param="prompt")
            if keep is None:  # with truncate_prompt_tokens a longer prompt is fine
                check_prompt_chars(len(prompt), tok.max_chars_per_token, max_model_len)
            ids = tok.encode(prompt, add_special_tokens=add_special_tokens)
            text = prompt
        else:
            ids = list(prompt)
            vocab = self.engine.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise OpenAIError(
                    f"prompt token ids out of range [0, {vocab}): {bad[:5]}", param="prompt"
                )
            text = None
        if not ids:
            raise OpenAIError("the prompt is empty", param="prompt")
        kept = truncate_prompt_ids(ids, keep, max_model_len)
        if len(kept) >= max_model_len:
            check_context(len(kept), None, max_model_len)  # refused here, before decoding it
        if text is None or len(kept) < len(ids):
            text = tok.decode(kept, skip_special_tokens=False) if tok is not None else ""
        return text, kept

    def _add_logprobs(
        self,
        into: CompletionLogprobs,
        p: StreamProgress,
        ids: Sequence[int],
        entries: Sequence[dict[int, Logprob] | None],
        as_ids: bool | None = False,
    ) -> None:
        """``as_ids`` (``return_tokens_as_token_ids``): tokens are "token_id:N", as vLLM's;
        ``text_offset`` still counts the characters of the text."""
        tok = self.engine.tokenizer
        for tid, entry in zip(ids, entries):
            text = (
                entry[tid].decoded_token
                if entry and entry[tid].decoded_token is not None
                else decode_token(tok, tid)
                if tok is not None
                else ""
            )
            into.tokens.append(f"token_id:{tid}" if as_ids else text)
            into.text_offset.append(p.text_offset)
            p.text_offset += len(text)
            into.token_logprobs.append(entry[tid].logprob if entry else None)
            into.top_logprobs.append(
                None
                if not entry
                else {
                    (f"token_id:{t}" if as_ids else lp.decoded_token if lp.decoded_token is not None
                     else str(t)): lp.logprob
                    for t, lp in entry.items()
                }
            )

    async def _stream(
        self,
        rid: str,
        req: CompletionRequest,
        prompts: list[tuple[str, list[int]]],
        streams: list[AsyncIterator[RequestOutput]],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        n = req.n
        progress = [
            StreamProgress(prefix=prompts[k // n][0] if req.echo else "")
            for k in range(len(prompts) * n)
        ]
        finals: list[RequestOutput | None] = [None] * len(prompts)
        head = completion_chunk_head(rid, created, self.model_name)
        try:
            async with aclosing(merge(streams)) as merged:
                async for i, out in merged:
                    raise_if_failed(out)  # an error event, then [DONE]
                    finals[i] = out
                    choices = []
                    for c in out.outputs:
                        k = i * n + c.index
                        choice = self._chunk_choice(req, k, progress[k], c, out)
                        if choice is not None:
                            choices.append(choice)
                    if choices and req.logprobs is None and not any(
                            isinstance(c, CompletionChoiceWithPromptLogprobs) for c in choices):
                        yield completion_chunk_sse(head, choices)
                    elif choices:
                        yield sse(
                            CompletionResponse(
                                id=rid, created=created, model=self.model_name, choices=choices
                            )
                        )
            if req.include_usage:
                yield sse(
                    CompletionResponse(
                        id=rid,
                        created=created,
                        model=self.model_name,
                        choices=[],
                        usage=_usage(finals),
                    )
                )
        except Exception as e:  # noqa: BLE001 - the stream has started: report inside it
            err = e if isinstance(e, OpenAIError) else OpenAIError(str(e), status=500)
            yield sse(err.to_response())
        yield sse("[DONE]")

    def _chunk_choice(
        self,
        req: CompletionRequest,
        index: int,
        p: StreamProgress,
        c: CompletionOutput,
        out: RequestOutput,
        whole: bool = False,
    ) -> CompletionChoice | None:
        """What completion ``c`` adds since ``p``; None when nothing (or it already ended).

        With a fresh ``p`` and a finished ``c`` this is the whole choice (``whole``: it always
        has the field ``prompt_logprobs``, null when not asked for, as vLLM's has)."""
        if p.done:
            return None
        first = p.num_tokens == 0
        text, t0, t1 = p.advance(c, stop_holdback(req.stop))
        if not text and t0 == t1 and not c.finished:
            return None
        prefix, p.prefix = p.prefix, ""
        logprobs = None
        if req.logprobs is not None:
            logprobs = CompletionLogprobs()
            if req.echo and first:
                self._add_logprobs(logprobs, p, out.prompt_token_ids, out.prompt_logprobs or [],
                                   req.return_tokens_as_token_ids)
            self._add_logprobs(logprobs, p, c.token_ids[t0:t1], (c.logprobs or [])[t0:t1],
                               req.return_tokens_as_token_ids)
        fields = dict(index=index, text=prefix + text, logprobs=logprobs, finish_reason=c.finish_reason,
                      stop_reason=c.stop_reason)
        if first and (whole or out.prompt_logprobs is not None):
            # vLLM's: on the choice, whenever computed (asked for, or echo with logprobs); a
            # stream sends them once, with the choice's first chunk
            return CompletionChoiceWithPromptLogprobs(**fields, prompt_logprobs=render_prompt_logprobs(
                out.prompt_logprobs))
        return CompletionChoice(**fields)


def _usage(finals: Sequence[RequestOutput | None]) -> UsageInfo:
    prompt = sum(len(f.prompt_token_ids) for f in finals if f is not None)
    completion = sum(len(c.token_ids) for f in finals if f is not None for c in f.outputs)
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )
