"""The OpenAI wire format's responses: pydantic models of what the server sends, and the
server-sent events of a stream (``completion_chunk_sse`` writes a text chunk's JSON directly).

Requests, errors and their checks are in ``protocol.py``, which re-exports these names.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializeAsAny

__all__ = [
    "random_id",
    "ChatChoice",
    "ChatCompletionChunk",
    "ChatCompletionResponse",
    "ChatLogprobs",
    "ChatStreamChoice",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionResponse",
    "DeltaMessage",
    "DeltaToolCall",
    "DetokenizeResponse",
    "FunctionCall",
    "ModelCard",
    "ModelList",
    "ResponseMessage",
    "TokenLogprob",
    "TokenizeResponse",
    "ToolCall",
    "TopLogprob",
    "UsageInfo",
    "completion_chunk_head",
    "completion_chunk_sse",
    "sse",
]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: BaseModel | str) -> str:
    """One server-sent event (``data: [DONE]`` ends a stream)."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


def completion_chunk_sse(head: str, choices: list[CompletionChoice]) -> str:
    """``sse(CompletionResponse(..., choices=choices))`` for choices without logprobs, written
    directly: a stream sends one per token, and pydantic's model and dump cost five times
    more. ``head`` is ``completion_chunk_head(...)``."""
    parts = [
        f'{{"index":{c.index},"text":{_json_str(c.text)},"logprobs":null,"finish_reason":'
        f"{_json_opt(c.finish_reason)},\"stop_reason\":{_json_opt(c.stop_reason)}}}"
        for c in choices
    ]
    return f"data: {head}{','.join(parts)}],\"usage\":null}}\n\n"


def completion_chunk_head(rid: str, created: int, model: str) -> str:
    """The JSON of a completion chunk up to its choices' list (see ``completion_chunk_sse``)."""
    return (f'{{"id":{_json_str(rid)},"object":"text_completion","created":{int(created)},'
            f'"model":{_json_str(model)},"choices":[')


def _json_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json_opt(value: int | str | None) -> str:
    return "null" if value is None else json.dumps(value, ensure_ascii=False)


# --- responses ------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[SerializeAsAny[CompletionChoice]]  # with prompt_logprobs (prompt_logprobs.py)
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # the server's reasoning parser's (--reasoning-parser); ``reasoning`` is vLLM's newer name
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's (prompt_logprobs.py)


class DeltaToolCall(ToolCall):
    index: int


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # as ResponseMessage's
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "attnserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- /tokenize, /detokenize (vLLM's shapes) -----------------------------------------------------

class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None

class DetokenizeResponse(BaseModel):
    prompt: str
