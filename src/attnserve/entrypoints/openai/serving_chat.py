"""``POST /v1/chat/completions``: messages through the model's chat template, one engine request.

The conversation is rendered with the tokenizer's chat template and encoded without adding
special tokens (the template writes them), as ``LLM.chat`` does. Streams start with the
assistant role, then send text deltas, then each choice's finish reason.

Tool calls: with ``tool_choice`` "required" or a named function the output is forced, through
structured output, to match the tools' parameter schemas, and comes back as ``tool_calls``
(a stream sends them whole with the choice's last chunk). "auto" (the default with tools) is
served when the server has a tool-call parser (``--enable-auto-tool-choice --tool-call-parser``):
the output is free, the parser finds the calls in the model's own format, and the choice ends
with finish reason "tool_calls" when it found any; a stream sends the text before the calls as
it comes and each call as it completes. Without a parser "auto" is a 400 naming the flags.

Reasoning: with a reasoning parser (``--reasoning-parser``) the model's thinking comes back as
``reasoning_content`` (and ``reasoning``, vLLM's newer name), the rest as the content, in which
"auto" finds the calls; a stream sends reasoning deltas, then content deltas. Not for outputs
a grammar forces from the first token (forced tool calls, ``response_format``, ``guided_*``):
they hold no reasoning. Formats whose markers are special tokens (``mistral``, ``openai``,
``openai_gptoss``) have them kept in the text (``skip_special_tokens`` off), as vLLM's parsers ask.

Not here: the parsers (``tool_parsers/``, ``reasoning_parsers.py``), images; the HTTP layer
(``api_server.py``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnserve.detokenizer import decode_token
from attnserve.engine.engine import truncate_prompt_ids
from attnserve.engine.engine_client import EngineClient
from attnserve.entrypoints.openai.metrics import ServerMetrics
from attnserve.entrypoints.openai.prompt_logprobs import (
    ChatChunkWithPromptLogprobs,
    check_prompt_logprobs,
    render_prompt_logprobs,
)
from attnserve.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    OpenAIError,
    ResponseMessage,
    ServerLimits,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    UsageInfo,
    check_context,
    check_for_model,
    check_logprobs,
    check_prompt_chars,
    random_id,
    sse,
)
from attnserve.entrypoints.openai.reasoning_parsers import ReasoningParser
from attnserve.entrypoints.openai.serving_completion import (
    StreamProgress,
    check_constraints,
    raise_if_failed,
    stop_holdback,
)
from attnserve.entrypoints.openai.tool_parsers import StreamDelta, ToolParser
from attnserve.outputs import Logprob, RequestOutput

if TYPE_CHECKING:
    from attnserve.entrypoints.openai.reasoning_parsers import (
        HarmonyReasoningStream,
        ReasoningStream,
    )
    from attnserve.entrypoints.openai.tool_parsers import HarmonyStream, ToolCallStream
    from attnserve.sampling_params import SamplingParams

__all__ = ["OpenAIServingChat"]


class OpenAIServingChat:
    def __init__(self, engine: EngineClient, model_name: str, metrics: ServerMetrics,
                 limits: ServerLimits | None = None, chat_template: str | None = None,
                 tool_parser: ToolParser | None = None, reasoning_parser: ReasoningParser | None = None):
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.limits = limits or ServerLimits()
        self.chat_template = chat_template  # --chat-template: instead of the model's own
        self.tool_parser = tool_parser  # --enable-auto-tool-choice --tool-call-parser: "auto" served
        self.reasoning_parser = reasoning_parser  # --reasoning-parser: reasoning_content split off

    async def create(
        self, req: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """Check, submit and answer a chat request (an SSE stream when ``stream``).

        Raises:
            OpenAIError: the request cannot be served (nothing was submitted).
        """
        arrival = time.perf_counter()
        req.check_supported()
        if req.tool_call_mode()[0] == "auto" and self.tool_parser is None:
            raise OpenAIError('tool_choice "auto" (the default with tools) needs the server started with '
                              '--enable-auto-tool-choice and --tool-call-parser (the model\'s tool-call format, '
                              'e.g. hermes); or send "required", a named function or "none"', param="tool_choice")
        check_logprobs(req.top_logprobs, self.engine.max_logprobs, "top_logprobs")
        prompt_logprobs = check_prompt_logprobs(req.prompt_logprobs, self.engine.vocab_size, self.engine.max_logprobs)
        self.limits.check(req.n, stop=req.stop)
        # rendering and tokenising are the client's work: off the event loop
        ids = await asyncio.to_thread(self._prompt_ids, req)
        ids = truncate_prompt_ids(ids, req.truncate_prompt_tokens, self.engine.max_model_len)
        max_tokens = check_context(
            len(ids), req.requested_max_tokens, self.engine.max_model_len, prompt_param="messages"
        )
        # the model's generation_config.json defaults for the fields the request leaves out
        params = self.engine.generation_config.apply(req.to_sampling_params(max_tokens, prompt_logprobs),
                                                    req.model_fields_set)
        params = check_for_model(params, self.engine.vocab_size, self.engine.max_logprobs)
        await check_constraints(self.engine, req, params)
        parsing = self.output_parsing(req, params, ids)
        rid = random_id("chatcmpl")
        stream = self.metrics.track(
            self.engine.generate(rid, {"prompt_token_ids": ids}, params), arrival, params
        )
        if req.stream:
            return self._stream(rid, req, stream, parsing)
        final: RequestOutput | None = None
        async with aclosing(stream):
            async for out in stream:
                raise_if_failed(out)
                final = out
        if final is None or not final.finished:
            raise OpenAIError("the request was aborted", status=500)
        choices = []
        for c in final.outputs:
            message = _message(req, c.text, parsing)
            auto_called = req.tool_call_mode()[0] == "auto" and bool(message.tool_calls)
            choices.append(ChatChoice(index=c.index, message=message,
                                      logprobs=self._logprobs(req, c.token_ids, c.logprobs),
                                      # vLLM's: a reply whose calls the parser found ends in them
                                      finish_reason="tool_calls" if auto_called else c.finish_reason,
                                      stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=rid, model=self.model_name, choices=choices, usage=_usage(final),
                                      prompt_logprobs=render_prompt_logprobs(final.prompt_logprobs))

    def output_parsing(self, req: ChatCompletionRequest, params: SamplingParams,
                        ids: list[int]) -> OutputParsing | None:
        """How the request's outputs are read (None: as they are, or as forced tool calls): the
        tool-call parser for "auto", the reasoning parser unless a grammar forces the output from
        its first token (it holds no reasoning then) or the tool parser splits reasoning itself.
        Formats whose markers are special tokens keep them in the text, as vLLM's parsers ask.
        ``/v1/responses`` reads its outputs the same way (``serving_responses.py``)."""
        mode = req.tool_call_mode()[0]
        tools = self.tool_parser if mode == "auto" else None
        reasoning = self.reasoning_parser
        if mode in ("named", "required") or params.structured_outputs is not None or (tools and tools.handles_reasoning):
            reasoning = None
        if tools is None and reasoning is None:
            return None
        if any(p is not None and p.keeps_special_tokens for p in (tools, reasoning)):
            params.skip_special_tokens = False
        # the prompt's end says whether the template opened (or closed) the thinking
        tail = self.engine.tokenizer.decode(ids[-8:], False) if reasoning is not None else ""
        return OutputParsing(reasoning, tail, tools, req.tools)

    def prompt_ids(self, req: ChatCompletionRequest, fit: bool = False) -> list[int]:
        """The conversation's prompt token ids, rendered and checked as for a chat request
        (``/tokenize`` of messages, so that its count is the chat's ``usage.prompt_tokens``; as
        vLLM's, it counts a conversation longer than the model too, unless ``fit``: then one
        whose text is too long for the model is refused before it is tokenised, as a chat's is)."""
        return self._prompt_ids(req, fit=fit)

    def _prompt_ids(self, req: ChatCompletionRequest, fit: bool = True) -> list[int]:
        """``fit``: refuse a rendered conversation too long for the model before tokenising it."""
        tok = self.engine.tokenizer
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        # a template the request sends (vLLM's field, or inside chat_template_kwargs), if trusted
        sent = [(name, t) for name, t in (("chat_template", req.chat_template),
                                          ("chat_template_kwargs", kwargs.pop("chat_template", None)))
                if t is not None]
        if sent and not self.limits.trust_request_chat_template:
            raise OpenAIError(
                "chat templates sent in a request are not rendered by this server (start it with "
                "--trust-request-chat-template to allow them)",
                param=sent[0][0],
            )
        if sent:
            if not isinstance(sent[0][1], str):
                raise OpenAIError("a chat template is a string (Jinja source)", param=sent[0][0])
            self.limits.check_chat_template(sent[0][1], sent[0][0])
        template = sent[0][1] if sent else self.chat_template
        if tok is None or (template is None and not tok.has_chat_template):
            raise OpenAIError(
                "this model has no chat template: start the server with --chat-template (a file or "
                "a template), send chat_template (with --trust-request-chat-template), or use "
                "/v1/completions",
                param="messages",
            )
        from jinja2 import TemplateError

        try:
            text = tok.apply_chat_template(
                [m.for_template() for m in req.messages],
                add_generation_prompt=req.add_generation_prompt,
                chat_template=template,
                tools=req.tools,
                bounds=self.limits.template_bounds if sent else None,  # nobody vetted it
                **kwargs,
            )
        except (ValueError, TypeError, TemplateError) as e:
            raise OpenAIError(f"the chat template failed: {e}", param=sent[0][0] if sent else "messages") from e
        if fit and req.truncate_prompt_tokens is None:  # with truncation a longer prompt is fine
            check_prompt_chars(len(text), tok.max_chars_per_token, self.engine.max_model_len, "messages")
        ids = tok.encode(text, add_special_tokens=req.add_special_tokens)
        if not ids:
            raise OpenAIError("the rendered conversation is empty", param="messages")
        return ids

    def token_logprobs(self, req: ChatCompletionRequest, ids: Sequence[int],
                       entries: Sequence[dict[int, Logprob]] | None) -> list[TokenLogprob]:
        """The logprob entries of tokens ``ids`` as a chat reply shows them (none unless
        ``req.logprobs``): ``/v1/responses`` shows them so too."""
        logprobs = self._logprobs(req, ids, entries)
        return logprobs.content if logprobs is not None and logprobs.content is not None else []

    def _logprobs(
        self,
        req: ChatCompletionRequest,
        ids: Sequence[int],
        entries: Sequence[dict[int, Logprob]] | None,
    ) -> ChatLogprobs | None:
        if not req.logprobs:
            return None
        k = req.top_logprobs or 0
        content = []
        for tid, entry in zip(ids, entries or []):
            top = sorted(
                ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k),
                key=lambda x: x[1].rank,
            )
            content.append(
                TokenLogprob(
                    **self._token(tid, entry[tid], req.return_tokens_as_token_ids),
                    top_logprobs=[TopLogprob(**self._token(t, lp, req.return_tokens_as_token_ids))
                                  for t, lp in top],
                )
            )
        return ChatLogprobs(content=content)

    def _token(self, tid: int, lp: Logprob, as_id: bool | None = False) -> dict:
        """``as_id`` (``return_tokens_as_token_ids``): the token as "token_id:N", its bytes
        those of that string, as vLLM's."""
        text = (
            f"token_id:{tid}"
            if as_id
            else lp.decoded_token
            if lp.decoded_token is not None
            else decode_token(self.engine.tokenizer, tid)
        )
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}

    async def _stream(
        self, rid: str, req: ChatCompletionRequest, stream: AsyncIterator[RequestOutput],
        output_parsing: OutputParsing | None = None,
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None, prompt_logprobs=None) -> str:
            if prompt_logprobs is not None:
                return sse(ChatChunkWithPromptLogprobs(id=rid, created=created, model=self.model_name,
                                                       choices=choices, prompt_logprobs=prompt_logprobs))
            return sse(
                ChatCompletionChunk(
                    id=rid, created=created, model=self.model_name, choices=choices, usage=usage
                )
            )

        progress = [StreamProgress() for _ in range(req.n)]
        hold = stop_holdback(req.stop)
        tool_mode, _ = req.tool_call_mode()
        parsing = [output_parsing.stream() for _ in range(req.n)] if output_parsing is not None else None
        final = None
        prompt_logprobs_sent = False  # they go with the first chunk that carries generated tokens
        try:
            yield chunk(
                [
                    ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                    for i in range(req.n)
                ]
            )
            async with aclosing(stream):
                async for final in stream:
                    raise_if_failed(final)  # an error event, then [DONE]
                    choices = []
                    for c in final.outputs:
                        p = progress[c.index]
                        if p.done:
                            continue
                        if tool_mode in ("named", "required") and not c.finished:
                            continue  # forced tool calls go out whole, with the choice's last chunk
                        text, t0, t1 = p.advance(c, hold)
                        finish_reason = c.finish_reason
                        if parsing is not None:  # the parsers split reasoning and calls off the content
                            delta = _parsed_delta(parsing[c.index], text, c.finished)
                            if c.finished and parsing[c.index].num_calls:
                                finish_reason = "tool_calls"
                        else:
                            delta = DeltaMessage(content=text) if tool_mode is None else _tool_delta(req, c.text)
                        if text or t1 > t0 or c.finished:
                            choices.append(
                                ChatStreamChoice(
                                    index=c.index,
                                    delta=delta,
                                    logprobs=self._logprobs(
                                        req, c.token_ids[t0:t1], (c.logprobs or [])[t0:t1]
                                    ),
                                    finish_reason=finish_reason,
                                )
                            )
                    if choices:
                        entries = None if prompt_logprobs_sent else render_prompt_logprobs(final.prompt_logprobs)
                        prompt_logprobs_sent = True
                        yield chunk(choices, prompt_logprobs=entries)
            if req.include_usage and final is not None:
                yield chunk([], _usage(final))
        except Exception as e:  # noqa: BLE001 - the stream has started: report inside it
            err = e if isinstance(e, OpenAIError) else OpenAIError(str(e), status=500)
            yield sse(err.to_response())
        yield sse("[DONE]")


def _message(req: ChatCompletionRequest, text: str, parsing: OutputParsing | None = None) -> ResponseMessage:
    """The assistant's message: its text, or the tool calls its forced JSON holds (the text
    itself when generation stopped before the JSON was complete), or what ``parsing`` reads in
    it (reasoning, and with "auto" the calls and the text before them)."""
    mode, function = req.tool_call_mode()
    if parsing is not None:
        return parsing.message(text)
    if mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return ResponseMessage(content=text)
        return ResponseMessage(content="", tool_calls=[
            ToolCall(function=FunctionCall(name=function["name"], arguments=text))])
    if mode == "required":
        try:
            calls = json.loads(text)
        except ValueError:
            return ResponseMessage(content=text)
        return ResponseMessage(content="", tool_calls=[
            ToolCall(function=FunctionCall(name=call["name"], arguments=json.dumps(call["parameters"])))
            for call in calls])
    return ResponseMessage(content=text)


def _tool_delta(req: ChatCompletionRequest, text: str) -> DeltaMessage:
    message = _message(req, text)
    calls = [DeltaToolCall(index=i, **call.model_dump()) for i, call in enumerate(message.tool_calls)]
    return DeltaMessage(content=message.content, tool_calls=calls or None)


def _parsed_delta(parsing: ChoiceStream, text: str, finished: bool) -> DeltaMessage:
    """New text of a parsed choice as a delta: the reasoning and content the parsers let out,
    and each call completed (whole: id, type, name and arguments)."""
    first = parsing.num_calls
    out = parsing.step(text, finished)
    deltas = [DeltaToolCall(index=first + i, **call.model_dump()) for i, call in enumerate(out.tool_calls)]
    reasoning = out.reasoning or None
    content = out.content if out.content or not (deltas or reasoning) else None
    return DeltaMessage(content=content, reasoning_content=reasoning, reasoning=reasoning, tool_calls=deltas or None)


@dataclass(frozen=True, slots=True)
class OutputParsing:
    """How a request's outputs are read: reasoning split off first (``prompt_tail``, the
    prompt's end, says whether the template opened the thinking), then, for tool_choice "auto",
    the calls found in the content (``tool_specs``: the request's tools)."""

    reasoning: ReasoningParser | None
    prompt_tail: str
    tools: ToolParser | None
    tool_specs: list[dict[str, Any]] | None

    def message(self, text: str) -> ResponseMessage:
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.extract(text, self.prompt_tail)
        calls = []
        if self.tools is not None and content is not None:
            parsed = self.tools.extract(content, self.tool_specs)
            content, calls, reasoning = parsed.content, parsed.tool_calls, parsed.reasoning or reasoning
        return ResponseMessage(content=content, tool_calls=calls, reasoning_content=reasoning, reasoning=reasoning)

    def stream(self) -> ChoiceStream:
        return ChoiceStream(None if self.reasoning is None else self.reasoning.stream(self.prompt_tail),
                            None if self.tools is None else self.tools.stream(self.tool_specs))


@dataclass(slots=True)
class ChoiceStream:
    """One streamed choice through ``OutputParsing``'s parsers: the reasoning stream's content
    feeds the tool-call stream."""

    reasoning: ReasoningStream | HarmonyReasoningStream | None
    tools: ToolCallStream | HarmonyStream | None
    num_calls: int = 0

    def step(self, delta: str, finished: bool) -> StreamDelta:
        reasoning, content = ("", delta) if self.reasoning is None else self.reasoning.step(delta, finished)
        if self.tools is None:
            return StreamDelta(content=content, reasoning=reasoning)
        out = self.tools.step(content, finished)
        out.reasoning = reasoning + out.reasoning
        self.num_calls += len(out.tool_calls)
        return out


def _usage(out: RequestOutput) -> UsageInfo:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )
