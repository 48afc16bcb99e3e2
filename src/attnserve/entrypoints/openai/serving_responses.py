"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API on the
chat path, whole or as typed server-sent events.

A request becomes a chat request (``ResponsesRequest.to_chat_request``) and is checked, rendered
with the chat template and sampled as ``/v1/chat/completions`` does (``OpenAIServingChat``), so
its errors are the chat's, named by the Responses API's fields (``max_output_tokens``, ``input``,
``text``). The reply is one assistant message of one ``output_text`` part; a reply cut by the
token limit is "incomplete" (``incomplete_details.reason`` "max_output_tokens"). ``usage``
counts input, output and prefix-cached tokens.

A stream sends OpenAI's events, each with its ``sequence_number``: ``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``, a
``response.output_text.delta`` per piece of text, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, then ``response.completed`` (or
``response.incomplete``). A failure once it has started is an ``error`` event, then
``response.failed``.

With a reasoning parser (``--reasoning-parser``, read as chat's ``output_parsing`` reads it), an
output that holds reasoning gets a ``reasoning`` item (``reasoning_text`` content) before the
message; a stream opens it at its first text and sends ``response.reasoning_text.delta``
events, then ``response.reasoning_text.done`` and its ``output_item.done`` before the message is
added. A later turn continues from the message alone.

``store`` (true by default, as OpenAI's) keeps the finished response and its conversation in a
bounded in-memory store (``ResponseStore``: the oldest go first), for ``GET`` and for a later
request's ``previous_response_id``, which continues that conversation (its messages, then its
reply; its ``instructions`` are not carried over, as OpenAI has it). An id the store does not
hold (never stored, deleted or evicted) is an OpenAI-shaped 404. vLLM keeps no store unless
told (``VLLM_ENABLE_RESPONSES_API_STORE``), and then an unbounded one.

Not here: the wire format (``responses_api.py``), the HTTP layer (``api_server.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from attnserve.engine.engine import truncate_prompt_ids
from attnserve.engine.engine_client import EngineClient
from attnserve.entrypoints.openai.metrics import ServerMetrics
from attnserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    OpenAIError,
    ServerLimits,
    check_context,
    check_for_model,
    check_logprobs,
)
from attnserve.entrypoints.openai.responses_api import (
    IncompleteDetails,
    InputTokensDetails,
    ResponseDeleted,
    ResponseError,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
    response_event,
    response_id,
)
from attnserve.entrypoints.openai.serving_chat import OpenAIServingChat, OutputParsing
from attnserve.entrypoints.openai.serving_completion import (
    StreamProgress,
    check_constraints,
    raise_if_failed,
    stop_holdback,
)
from attnserve.outputs import RequestOutput
from attnserve.sampling_params import SamplingParams

__all__ = ["OpenAIServingResponses", "ResponseStore"]

# chat's field names in its errors -> the Responses API's
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text", "logprobs": "include", "truncate_prompt_tokens": "truncation",
           "reasoning_effort": "reasoning"}


@dataclass(slots=True)
class _Stored:
    response: ResponsesResponse
    messages: list[ChatMessage]  # the conversation it answered, without its instructions
    num_chars: int


class ResponseStore:
    """Finished responses by id, with the conversations they answered, in memory: at most
    ``max_responses`` of them and ``max_chars`` characters of text; the oldest go first (one
    larger than ``max_chars`` alone is not kept)."""

    def __init__(self, max_responses: int = 1024, max_chars: int = 16 << 20):
        self.max_responses, self.max_chars = max_responses, max_chars
        self._items: OrderedDict[str, _Stored] = OrderedDict()
        self._num_chars = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: ResponsesResponse, messages: list[ChatMessage]) -> bool:
        """Keep ``response``; False when it is too large to keep."""
        size = sum(len(m.content or "") for m in messages) + sum(
            len(part.text) for item in response.output for part in item.content)
        if size > self.max_chars:
            return False
        self.delete(response.id)
        self._items[response.id] = _Stored(response, messages, size)
        self._num_chars += size
        while len(self._items) > self.max_responses or self._num_chars > self.max_chars:
            self._num_chars -= self._items.popitem(last=False)[1].num_chars
        return True

    def get(self, rid: str) -> _Stored | None:
        return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        item = self._items.pop(rid, None)
        if item is not None:
            self._num_chars -= item.num_chars
        return item is not None


def _not_found(rid: str, param: str | None = None, what: str = "Response") -> OpenAIError:
    return OpenAIError(f"{what} with id '{rid}' not found.", status=404, param=param)


class OpenAIServingResponses:
    def __init__(self, engine: EngineClient, model_name: str, metrics: ServerMetrics, chat: OpenAIServingChat,
                 limits: ServerLimits | None = None, store: ResponseStore | None = None):
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.chat = chat  # renders the conversation, and shows logprobs, as a chat request
        self.limits = limits or ServerLimits()
        self.store = store if store is not None else ResponseStore()

    async def create(self, req: ResponsesRequest) -> ResponsesResponse | AsyncIterator[str]:
        """Check, submit and answer a request (an event stream when ``stream``).

        Raises:
            OpenAIError: the request cannot be served (nothing was submitted).
        """
        arrival = time.perf_counter()
        try:
            messages = self._conversation(req)
            chat_req = req.to_chat_request(messages)
            ids, params = await self._prepare(chat_req)
        except OpenAIError as e:
            e.param = _PARAMS.get(e.param, e.param)
            raise
        parsing = self.chat.output_parsing(chat_req, params, ids)  # the reasoning parser, as chat's
        split = parsing if parsing is not None and parsing.reasoning is not None else None
        rid = response_id("resp")
        stream = self.metrics.track(self.engine.generate(rid, {"prompt_token_ids": ids}, params), arrival, params)
        base = self._base(rid, req, params)
        if req.stream:
            return self._stream(base, req, chat_req, messages, stream, split)
        final: RequestOutput | None = None
        async with aclosing(stream):
            async for final in stream:
                raise_if_failed(final)
        if final is None or not final.finished:
            raise OpenAIError("the request was aborted", status=500)
        return self._finish(base, req, chat_req, messages, final, split=split)

    def retrieve(self, rid: str) -> ResponsesResponse:
        stored = self.store.get(rid)
        if stored is None:
            raise _not_found(rid)
        return stored.response

    def delete(self, rid: str) -> ResponseDeleted:
        if not self.store.delete(rid):
            raise _not_found(rid)
        return ResponseDeleted(id=rid)

    def _conversation(self, req: ResponsesRequest) -> list[ChatMessage]:
        """The messages the request answers (without its instructions): the previous response's
        conversation and reply first, when it continues one."""
        req.check_supported()
        history: list[ChatMessage] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise _not_found(req.previous_response_id, "previous_response_id", "Previous response")
            reply = "".join(part.text for item in previous.response.output if item.type == "message"
                            for part in item.content)
            history = [*previous.messages, ChatMessage(role="assistant", content=reply)]
        return history + req.input_messages()

    async def _prepare(self, chat_req: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the sampling parameters, checked as a chat request's."""
        engine = self.engine
        chat_req.check_supported()
        check_logprobs(chat_req.top_logprobs, engine.max_logprobs, "top_logprobs")
        self.limits.check(1, stop=chat_req.stop)
        ids = await asyncio.to_thread(self.chat.prompt_ids, chat_req, True)  # off the event loop
        ids = truncate_prompt_ids(ids, chat_req.truncate_prompt_tokens, engine.max_model_len)
        max_tokens = check_context(len(ids), chat_req.requested_max_tokens, engine.max_model_len,
                                   prompt_param="messages")
        params = engine.generation_config.apply(chat_req.to_sampling_params(max_tokens), chat_req.model_fields_set)
        params = check_for_model(params, engine.vocab_size, engine.max_logprobs)
        await check_constraints(engine, chat_req, params)
        return ids, params

    def _base(self, rid: str, req: ResponsesRequest, params: SamplingParams) -> ResponsesResponse:
        """The response in progress: the request's fields echoed, nothing generated yet."""
        return ResponsesResponse(
            id=rid, status="in_progress", model=self.model_name, instructions=req.instructions,
            max_output_tokens=params.max_tokens, metadata=req.metadata or {}, parallel_tool_calls=req.parallel_tool_calls,
            previous_response_id=req.previous_response_id, reasoning=req.reasoning, store=req.store,
            temperature=params.temperature, text={"format": (req.text and req.text.format) or {"type": "text"}},
            tool_choice=req.tool_choice or "auto", top_logprobs=req.top_logprobs, top_p=params.top_p,
            truncation=req.truncation or "disabled", user=req.user)

    def _finish(self, base: ResponsesResponse, req: ResponsesRequest, chat_req: ChatCompletionRequest,
                messages: list[ChatMessage], final: RequestOutput, message_id: str | None = None,
                split: OutputParsing | None = None, reasoning_id: str | None = None) -> ResponsesResponse:
        """The finished response of ``final`` (kept in the store when ``store``): with a reasoning
        parser (``split``), a reasoning item before the message when the output held reasoning."""
        c = final.outputs[0]
        incomplete = c.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        # logprobs cover every output token, the reasoning's too (one token may hold both)
        logprobs = self.chat.token_logprobs(chat_req, c.token_ids, c.logprobs) if req.wants_logprobs else None
        items: list[ResponseReasoningItem | ResponseOutputMessage] = []
        text = c.text
        if split is not None:
            reasoning, content = split.reasoning.extract(c.text, split.prompt_tail)
            if reasoning is not None:
                items.append(ResponseReasoningItem(id=reasoning_id or response_id("rs"), status=status,
                                                   content=[ResponseReasoningText(text=reasoning)]))
            text = content or ""
        message = ResponseOutputMessage(id=message_id or response_id("msg"), status=status,
                                        content=[ResponseOutputText(text=text, logprobs=logprobs)])
        num_in, num_out = len(final.prompt_token_ids), len(c.token_ids)
        usage = ResponseUsage(input_tokens=num_in, output_tokens=num_out, total_tokens=num_in + num_out,
                              input_tokens_details=InputTokensDetails(cached_tokens=final.num_cached_tokens))
        response = base.model_copy(update={
            "status": status, "output": [*items, message], "usage": usage,
            "incomplete_details": IncompleteDetails() if incomplete else None})
        if req.store and not self.store.put(response, messages):
            response.store = False  # too large to keep
        return response

    async def _stream(self, base: ResponsesResponse, req: ResponsesRequest, chat_req: ChatCompletionRequest,
                      messages: list[ChatMessage], stream: AsyncIterator[RequestOutput],
                      split: OutputParsing | None = None) -> AsyncIterator[str]:
        """The events of one response. With a reasoning parser (``split``) the reasoning item
        comes first, opened at its first text (``response.reasoning_text.delta`` events), and the
        message is opened when the content starts (or at the end, empty); logprobs then come
        with the final ``response.output_text.done`` only (a token may hold both)."""
        numbers = itertools.count()

        def event(kind: str, **fields) -> str:
            return response_event(kind, next(numbers), **fields)

        rs_id, mid = response_id("rs"), response_id("msg")
        opened: list[str] = []  # item ids in output order
        reasoning_text: list[str] = []
        want_logprobs = req.wants_logprobs and split is None

        def where(item_id: str) -> dict:
            return {"item_id": item_id, "output_index": opened.index(item_id), "content_index": 0}

        def open_message() -> list[str]:
            opened.append(mid)
            return [event("response.output_item.added", output_index=opened.index(mid),
                          item=ResponseOutputMessage(id=mid, status="in_progress", content=[])),
                    event("response.content_part.added", **where(mid),
                          part=ResponseOutputText(text="", logprobs=[] if req.wants_logprobs else None))]

        def close_reasoning(status: str) -> list[str]:
            item = ResponseReasoningItem(id=rs_id, status=status,
                                         content=[ResponseReasoningText(text="".join(reasoning_text))])
            return [event("response.reasoning_text.done", **where(rs_id), text=item.content[0].text),
                    event("response.output_item.done", output_index=opened.index(rs_id), item=item)]

        try:
            yield event("response.created", response=base)
            yield event("response.in_progress", response=base)
            reasoning_stream = None if split is None else split.reasoning.stream(split.prompt_tail)
            if reasoning_stream is None:
                for line in open_message():
                    yield line
            progress, hold, final = StreamProgress(), stop_holdback(chat_req.stop), None
            async with aclosing(stream):
                async for final in stream:
                    raise_if_failed(final)  # an error event, then response.failed
                    c = final.outputs[0]
                    text, t0, t1 = progress.advance(c, hold)
                    logprobs = self.chat.token_logprobs(chat_req, c.token_ids[t0:t1], (c.logprobs or [])[t0:t1]) \
                        if want_logprobs else None
                    thought, content = ("", text) if reasoning_stream is None else \
                        reasoning_stream.step(text, finished=final.finished)
                    if thought:
                        if rs_id not in opened:
                            opened.append(rs_id)
                            yield event("response.output_item.added", output_index=opened.index(rs_id),
                                        item=ResponseReasoningItem(id=rs_id, status="in_progress"))
                        reasoning_text.append(thought)
                        yield event("response.reasoning_text.delta", **where(rs_id), delta=thought)
                    if content and mid not in opened:
                        if rs_id in opened:
                            for line in close_reasoning("completed"):
                                yield line
                        for line in open_message():
                            yield line
                    if content or logprobs:
                        yield event("response.output_text.delta", **where(mid), delta=content, logprobs=logprobs)
            if final is None or not final.finished:
                raise OpenAIError("the request was aborted", status=500)
            response = self._finish(base, req, chat_req, messages, final, mid, split, rs_id)
            if rs_id in opened and mid not in opened:  # the output ended while reasoning
                for line in close_reasoning(response.status):
                    yield line
            if mid not in opened:
                for line in open_message():
                    yield line
            item = response.output[-1]
            part = item.content[0]
            yield event("response.output_text.done", **where(mid), text=part.text, logprobs=part.logprobs or [])
            yield event("response.content_part.done", **where(mid), part=part)
            yield event("response.output_item.done", output_index=opened.index(mid), item=item)
            yield event(f"response.{response.status}", response=response)
        except Exception as e:  # noqa: BLE001 - the stream has started: report inside it
            err = e if isinstance(e, OpenAIError) else OpenAIError(str(e), status=500)
            yield event("error", code=err.code, message=err.message, param=err.param)
            code = "server_error" if err.status >= 500 else "invalid_prompt"
            yield event("response.failed", response=base.model_copy(
                update={"status": "failed", "error": ResponseError(code=code, message=err.message)}))
