"""The wire format of ``/v1/responses`` (OpenAI's Responses API, the subset vLLM serves for
models without gpt-oss's harmony format): ``ResponsesRequest``, the response object and the
typed events of its stream.

A request is text in and one assistant message out. ``input`` is a string (one user message)
or a list of message items (``{"role", "content"}``, content a string or a list of
``input_text``/``output_text`` parts, as the client passes a previous response's output
back); ``instructions`` is a system message put first. ``to_chat_request`` turns the request into
the ``ChatCompletionRequest`` that ``serving_responses.py`` serves on the chat path:
``max_output_tokens`` is ``max_tokens``, ``text.format`` is ``response_format``, ``include``
"message.output_text.logprobs" with ``top_logprobs`` asks for logprobs, ``truncation`` "auto"
keeps the end of a conversation too long for the model, ``reasoning.effort`` reaches the chat
template as ``reasoning_effort``, and vLLM's sampling extensions pass through by name. Refused
with a 400 naming the field: tools (vLLM serves them only with harmony; use
``/v1/chat/completions``), input items other than messages (function calls and their outputs,
reasoning, item references), parts other than text (images, files), ``background``, and
OpenAI's stored ``prompt`` templates and conversations (``conversation``). Other ``include``
values name outputs this server never produces and are accepted.

Not here: the conversation a ``previous_response_id`` continues, the response store, running
the request (``serving_responses.py``); the other routes' wire models (``protocol.py``,
``responses.py``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from attnserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    OpenAIError,
    StrictRequest,
    validation_error,
)
from attnserve.entrypoints.openai.responses import TokenLogprob

__all__ = [
    "ResponseDeleted",
    "ResponseError",
    "ResponseOutputMessage",
    "ResponseOutputText",
    "ResponseReasoningItem",
    "ResponseReasoningText",
    "ResponseUsage",
    "ResponsesRequest",
    "ResponsesResponse",
    "response_event",
    "response_id",
]

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text")  # output_text: a previous response's output passed back
_MAX_METADATA = (16, 64, 512)  # OpenAI's bounds on metadata: pairs, key and value characters
# vLLM's sampling extensions of its ResponsesRequest, passed to the chat request as they are
_PASSED_THROUGH = ("top_k", "repetition_penalty", "seed", "stop", "ignore_eos", "skip_special_tokens",
                   "include_stop_str_in_output", "logit_bias", "structured_outputs", "user")


def response_id(prefix: str) -> str:
    """An id as OpenAI writes them: ``resp_...``, ``msg_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseTextConfig(StrictRequest):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}


class ResponsesRequest(StrictRequest):
    model: str | None = None  # None: the served model
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None  # None: the model's default (generation_config.json), else 1
    top_p: float | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    text: ResponseTextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    reasoning: dict[str, Any] | None = None
    background: bool = False
    prompt: dict[str, Any] | None = None  # OpenAI's stored prompt templates: refused
    # vLLM's extensions
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        """A 400 naming the field for what this server does not serve (nothing is submitted)."""
        if self.tools:
            raise OpenAIError("tools are not supported on /v1/responses by this server (vLLM serves them only "
                              "for gpt-oss models); use /v1/chat/completions for tool calls", param="tools",
                              code="unsupported_parameter")
        if self.tool_choice not in (None, "none", "auto"):
            raise OpenAIError("tool_choice needs tools, which /v1/responses does not support here",
                              param="tool_choice")
        for field, value, why in (("background", self.background, "background responses are not supported"),
                                  ("prompt", self.prompt is not None, "stored prompt templates are not supported")):
            if value:
                raise OpenAIError(why, param=field, code="unsupported_parameter")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise OpenAIError(f"max_output_tokens must be at least 1, got {self.max_output_tokens}",
                              param="max_output_tokens")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise OpenAIError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}", param="top_logprobs")
        if self.metadata is not None:
            pairs, key_chars, value_chars = _MAX_METADATA
            if len(self.metadata) > pairs or any(len(k) > key_chars or len(v) > value_chars
                                                 for k, v in self.metadata.items()):
                raise OpenAIError(f"metadata holds at most {pairs} pairs, keys of at most {key_chars} characters "
                                  f"and values of at most {value_chars}", param="metadata")
        if isinstance(self.input, list) and not self.input:
            raise OpenAIError("input must not be an empty list", param="input")
        self._response_format()

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    def input_messages(self) -> list[ChatMessage]:
        """``input`` as chat messages (a 400 naming the item for anything but a text message)."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        return [_message(item, i) for i, item in enumerate(self.input)]

    def to_chat_request(self, messages: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat request that serves this one, over ``messages`` (the conversation without
        ``instructions``, which this puts first). Only the fields the client set are set, so
        that the model's generation defaults fill the others as in chat."""
        if self.instructions is not None:
            messages = [ChatMessage(role="system", content=self.instructions), *messages]
        fields: dict[str, Any] = {"messages": messages, "stream": self.stream}
        for name in ("temperature", "top_p", *_PASSED_THROUGH):
            if name in self.model_fields_set and getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            fields["max_tokens"] = self.max_output_tokens
        fmt = self._response_format()
        if fmt is not None:
            fields["response_format"] = fmt
        if self.wants_logprobs:
            fields["logprobs"] = True
            if self.top_logprobs is not None:
                fields["top_logprobs"] = self.top_logprobs
        if self.truncation == "auto":
            fields["truncate_prompt_tokens"] = -1
        effort = (self.reasoning or {}).get("effort")
        if isinstance(effort, str):
            fields["reasoning_effort"] = effort
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as e:
            raise validation_error(e) from e

    def _response_format(self) -> dict[str, Any] | None:
        """``text.format`` as chat's ``response_format`` (None: free text)."""
        fmt = self.text.format if self.text is not None else None
        kind = fmt.get("type") if fmt is not None else "text"
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise OpenAIError("text.format json_schema needs schema, a JSON schema", param="text")
            return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"]}}
        raise OpenAIError(f"text.format type {kind!r} is not supported (text, json_object, json_schema)",
                          param="text")


def _message(item: Any, index: int) -> ChatMessage:
    where = f"input[{index}]"
    if not isinstance(item, dict):
        raise OpenAIError(f"{where} must be a message object", param="input")
    kind = item.get("type", "message")
    if kind != "message":
        raise OpenAIError(f"{where}: input items of type {kind!r} are not supported (only messages: tools, "
                          "reasoning and item references are not served on /v1/responses here)", param="input")
    role, content = item.get("role"), item.get("content")
    if role not in ("user", "assistant", "system", "developer"):
        raise OpenAIError(f"{where}.role must be user, assistant, system or developer", param="input")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(f"{where}.content: parts of type {kind!r} are not supported (input_text, "
                                  "output_text)", param="input")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise OpenAIError(f"{where}.content must be a string or a list of input_text parts", param="input")
    return ChatMessage(role=role, content=content)


# --- the response -------------------------------------------------------------------------
class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


class ResponseOutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponseOutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ResponseReasoningItem(BaseModel):
    """The model's reasoning, split off its output by the server's reasoning parser; it comes
    before the message, as OpenAI's and vLLM's reasoning items do."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ResponseReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ResponsesResponse(BaseModel):
    """The response object; the sampling fields echo what generation used (as vLLM's)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[ResponseReasoningItem | ResponseOutputMessage] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False
    temperature: float
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    background: bool = False
    service_tier: str = "auto"


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


_EVENT = TypeAdapter(dict)


def response_event(kind: str, sequence_number: int, **fields: Any) -> str:
    """One server-sent event of a ``/v1/responses`` stream: its ``event:`` line is ``kind``, its
    data ``{"type": kind, "sequence_number": ..., **fields}`` (models in ``fields`` dumped, a
    non-finite logprob as null)."""
    data = _EVENT.dump_json({"type": kind, "sequence_number": sequence_number, **fields}).decode()
    return f"event: {kind}\ndata: {data}\n\n"
