"""The OpenAI wire format: pydantic request models, errors, the request checks; the response
models and server-sent events are in ``responses.py`` and re-exported here.

Requests are parsed strictly (no string-to-number coercion). Fields this server does not know
are ignored, as vLLM ignores them: ``ignored_fields`` names them for the server's warning (the
OpenAI SDKs send ``store``, ``metadata``, ``service_tier``, ... which change nothing here). A
field that would change the result if it were ignored is refused by name instead, when it
carries other than its default (``_REFUSED_UNLESS``), as are parameters that OpenAI defines and
this server does not implement (``check_supported``). ``to_sampling_params`` turns a request
into ``SamplingParams``; its validation messages become 400 errors.

Not here: tokenising, talking to the engine, building responses from engine outputs
(``serving_completion.py``, ``serving_chat.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from attnserve.engine.engine import PromptError, check_params_for_model
from attnserve.entrypoints.openai.responses import (  # noqa: F401 - re-exported: the wire format's names live here
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    ResponseMessage,
    TokenizeResponse,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    UsageInfo,
    completion_chunk_head,
    completion_chunk_sse,
    random_id,
    sse,
)
from attnserve.sampling_params import SamplingParams, StructuredOutputsParams
from attnserve.template_sandbox import TemplateBounds

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorInfo",
    "ErrorResponse",
    "FunctionCall",
    "OpenAIError",
    "StreamOptions",
    "StrictRequest",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "TokenizeResponse",
    "ToolCall",
    "UsageInfo",
    "ServerLimits",
    "check_context",
    "check_for_model",
    "check_prompt_chars",
    "openapi_body",
    "check_logprobs",
    "random_id",
    "sse",
    "validation_error",
]


class OpenAIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def validation_error(exc: ValidationError) -> OpenAIError:
    """The first problem pydantic found, as OpenAI words it."""
    errors = exc.errors()
    err = errors[0]
    loc = [str(x) for x in err["loc"]]
    param = loc[0] if loc else None
    if err["type"] == "missing":
        return OpenAIError(f"Missing required parameter: '{'.'.join(loc)}'", param=param)
    if sum(1 for e in errors if e["loc"][:1] == err["loc"][:1]) > 1:  # no member of a union fit
        return OpenAIError(f"Invalid type for '{param}'", param=param, code="invalid_type")
    return OpenAIError(
        f"Invalid value for '{'.'.join(loc)}': {err['msg']}",
        param=param,
        code="invalid_type" if err["type"].endswith("_type") else None,
    )


# --- requests -------------------------------------------------------------------------------
# Fields this server does not implement whose neglect would change what comes back, with the
# values that are safe to ignore (their defaults): another value is a 400 naming the field.
# Any other field it does not know (``store``, ``metadata``, ``service_tier``, ``user``-like
# bookkeeping, vLLM's ``priority``, ``request_id``, ``cache_salt``...) is ignored with a warning.
# A name here that a later version implements as a field is no longer extra, so never refused.
_REFUSED_UNLESS: dict[str, tuple[Any, ...]] = {
    "modalities": (None, ["text"]),
    "audio": (None,),
    "web_search_options": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "use_beam_search": (False,),
    "echo": (False,),  # in chat (vLLM's extension); the completions endpoint implements it
    "return_token_ids": (None, False),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "continue_final_message": (False,),
    "documents": (None,),
    "chat_template": (None,),
    "stream_options.continuous_usage_stats": (None, False),
    "conversation": (None,),  # /v1/responses: OpenAI's stored conversations (this server has none)
}


class StrictRequest(BaseModel):
    """The base of the request models (``responses_api.py``'s too): strictly typed; fields it
    does not declare are kept aside (``model_extra``) so that ``ignored_fields`` can name them,
    and are otherwise ignored."""

    model_config = ConfigDict(extra="allow", strict=True)

    def ignored_fields(self) -> list[str]:
        """The fields of the request (nested ones dotted) that this server ignores.

        Raises:
            OpenAIError: a field of ``_REFUSED_UNLESS`` carries other than its default.
        """
        ignored = []
        for path, value in _extras(self, ""):
            if path in _REFUSED_UNLESS and value not in _REFUSED_UNLESS[path]:
                raise OpenAIError(f"{path} is not supported by this server", param=path.split(".")[0],
                                  code="unsupported_parameter")
            ignored.append(path)
        return ignored


def _extras(model: BaseModel, prefix: str) -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every undeclared field of the ``StrictRequest`` models in ``model``
    (messages' own extra fields are not among them: they reach the chat template)."""
    if isinstance(model, StrictRequest):
        for name, value in (model.model_extra or {}).items():
            yield prefix + name, value
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, list) and not (value and isinstance(value[0], BaseModel)):
            continue  # a list's items are all models or none (millions of token ids are not walked)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                yield from _extras(item, f"{prefix}{name}.")


class StreamOptions(StrictRequest):
    include_usage: bool = False


class _SamplingFields(StrictRequest):
    """Fields both endpoints share (OpenAI's, then vLLM's extensions)."""

    model: str | None = None  # None: the served model, as vLLM takes a request without one
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, Any] | None = None
    # vLLM's extensions (the openai client sends them through ``extra_body``)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # changes no text with this server's tokenizers
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens as "token_id:N"
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None  # -1: the whole vocabulary (prompt_logprobs.py checks it)
    # structured output: OpenAI's response_format, vLLM's structured_outputs, and the guided_*
    # fields vLLM had before it (one of them per request)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_supported(self) -> None:
        self.output_constraint()  # one, well formed
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )

    def _constraints(self) -> list[tuple[str, dict[str, Any]]]:
        """(field, ``StructuredOutputsParams`` keywords) for each field that constrains the output."""
        found = []
        if self.structured_outputs is not None:
            found.append(("structured_outputs", dict(self.structured_outputs)))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                found.append((f"guided_{kind}", {kind: value}))
        fmt = self.response_format
        if fmt is not None and fmt.get("type", "text") != "text":
            found.append(("response_format", _response_format(fmt)))
        return found

    def output_constraint(self) -> tuple[str | None, StructuredOutputsParams | None]:
        """The request's structured-output constraint and the field it came from (a 400 when
        several fields ask for one, or it is malformed)."""
        found = self._constraints()
        if not found:
            return None, None
        if len(found) > 1:
            raise OpenAIError(f"a request takes one output constraint, got {[f for f, _ in found]}",
                              param=found[1][0])
        field, spec = found[0]
        try:
            return field, StructuredOutputsParams(**spec)
        except (TypeError, ValueError) as e:
            raise OpenAIError(f"{field}: {e}", param=field) from e

    def _sampling(self, max_tokens: int, logprobs: int | None, **extra: Any) -> SamplingParams:
        _, constraint = self.output_constraint()
        try:
            return SamplingParams(
                n=self.n,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                logit_bias=self.logit_bias,
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                structured_outputs=constraint,
                **extra,
            )
        except ValueError as e:  # SamplingParams names the field first: "top_p must be ..."
            msg = str(e)
            field = msg.split()[0]
            raise OpenAIError(msg, param=field if field in type(self).model_fields else None) from e

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's bos/eos around a text prompt

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError("best_of other than n is not supported", param="best_of")
        if self.logprobs is not None and self.logprobs < 0:
            raise OpenAIError("logprobs must be at least 0", param="logprobs")
        if isinstance(self.prompt, list) and not self.prompt:
            raise OpenAIError("prompt must not be an empty list", param="prompt")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one text or token list each."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def to_sampling_params(self, max_tokens: int, prompt_logprobs: int | None = None) -> SamplingParams:
        """``prompt_logprobs``: the request's, checked (``check_prompt_logprobs``); echo without
        it asks for ``logprobs`` of the prompt, as in vLLM."""
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        return self._sampling(max_tokens, self.logprobs, prompt_logprobs=prompt_logprobs)


class TextPart(StrictRequest):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message of the conversation; fields beyond these reach the chat template as given."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "".join(part.text for part in self.content)
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None  # vLLM's: rendered only by a server that trusts request templates
    chat_template_kwargs: dict[str, Any] | None = None
    # reaches the chat template as the variable ``reasoning_effort`` (as vLLM passes it);
    # templates that do not read it ignore it
    reasoning_effort: str | None = None
    add_special_tokens: bool = False  # vLLM's: the template writes the special tokens

    def check_supported(self) -> None:
        super().check_supported()
        self.tool_call_mode()  # tools and tool_choice are checked here
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise OpenAIError("top_logprobs needs logprobs set to true", param="top_logprobs")
            if self.top_logprobs < 0:
                raise OpenAIError("top_logprobs must be at least 0", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def to_sampling_params(self, max_tokens: int, prompt_logprobs: int | None = None) -> SamplingParams:
        return self._sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None,
                              prompt_logprobs=prompt_logprobs)

    def tool_call_mode(self) -> tuple[str | None, dict[str, Any] | None]:
        """("required", None), ("named", that function), ("auto", None), or (None, None) when
        the output is text.

        A named function or "required" forces output that matches the tools' parameter schemas
        (structured output); "auto" leaves the output free and needs the server's tool-call
        parser for the model's own format (``serving_chat.py`` refuses it without one)."""
        choice = self.tool_choice
        functions = _functions(self.tools or [])
        if choice is None:
            choice = "auto" if functions else "none"
        if choice == "none":
            return None, None
        if not functions:
            raise OpenAIError("tool_choice needs tools", param="tool_choice")
        if choice == "required":
            return "required", None
        if choice == "auto":
            return "auto", None
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
            raise OpenAIError('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}', param="tool_choice")
        if name not in functions:
            raise OpenAIError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return "named", functions[name]

    def _constraints(self) -> list[tuple[str, dict[str, Any]]]:
        found = super()._constraints()
        mode, function = self.tool_call_mode()
        if mode == "named":
            found.append(("tool_choice", {"json": function.get("parameters") or _EMPTY_OBJECT}))
        elif mode == "required":
            found.append(("tool_choice", {"json": _tool_calls_schema(_functions(self.tools))}))
        return found


_EMPTY_OBJECT = {"type": "object", "properties": {}}


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``response_format`` as ``StructuredOutputsParams`` keywords."""
    kind = fmt.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise OpenAIError("response_format json_schema needs json_schema.schema, a JSON schema",
                              param="response_format")
        return {"json": spec["schema"]}
    raise OpenAIError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                      param="response_format")


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The request's function tools by name (a 400 for anything else)."""
    out = {}
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise OpenAIError('each tool must be {"type": "function", "function": {"name": ..., '
                              '"parameters": {...}}}', param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise OpenAIError(f"tool {fn['name']!r}: parameters must be a JSON schema", param="tools")
        out[fn["name"]] = fn
    return out


def _tool_calls_schema(functions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A JSON array of one or more calls, each ``{"name": ..., "parameters": {...}}`` of a tool."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]},
                             "parameters": fn.get("parameters") or _EMPTY_OBJECT},
              "required": ["name", "parameters"]}
             for name, fn in functions.items()]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one request may ask of the server (``attnserve serve`` flags of the same names)."""

    max_request_body_bytes: int = 16 << 20
    max_n: int = 128  # completions per prompt (and best_of)
    max_prompts: int = 1024  # prompts per completion request
    trust_request_chat_template: bool = False  # a template sent in the request may be rendered
    # a template sent in the request (when trusted): its size, and bounds on rendering it
    # (template_sandbox.TemplateBounds: time, and the characters of any value and the output)
    max_chat_template_bytes: int = 64 << 10
    chat_template_timeout_s: float = 2.0
    max_chat_template_output_chars: int = 16 << 20
    # what one request costs every step: its sequences (prompts x n, or x best_of), and its stop
    # strings (each is searched for in every new piece of text); vLLM caps neither, so these
    # are far above what a client asks for in earnest
    max_sequences_per_request: int = 4096
    max_stop_strings: int = 256
    max_stop_chars: int = 16 << 10  # all stop strings together

    def __post_init__(self) -> None:
        for name in ("max_request_body_bytes", "max_n", "max_prompts", "max_chat_template_bytes",
                     "max_chat_template_output_chars", "max_sequences_per_request", "max_stop_strings",
                     "max_stop_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        t = self.chat_template_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"chat_template_timeout_s must be positive seconds, got {t!r}")

    @property
    def template_bounds(self) -> TemplateBounds:
        """How a template sent in a request renders."""
        return TemplateBounds(self.max_chat_template_output_chars, self.chat_template_timeout_s)

    def check_chat_template(self, template: str, param: str) -> None:
        """A 400 naming ``param`` for a request-sent template above the size limit."""
        size = len(template.encode("utf-8", "surrogatepass"))
        if size > self.max_chat_template_bytes:
            raise OpenAIError(f"the chat template is {size} bytes, above this server's limit of "
                              f"{self.max_chat_template_bytes} (--max-chat-template-bytes)", param=param)

    def check(self, n: Any, num_prompts: int = 1, stop: Any = None, best_of: Any = None) -> None:
        """A 400 naming the field, the limit and the flag that raises it when a request asks for
        more than these limits allow (values of the wrong type are left to the later checks)."""
        for field, value in (("n", n), ("best_of", best_of)):
            if _is_int(value) and value > self.max_n:
                raise OpenAIError(f"{field} is {value}, above this server's limit of {self.max_n} (--max-n)",
                                  param=field)
        if num_prompts > self.max_prompts:
            raise OpenAIError(f"{num_prompts} prompts, above this server's limit of {self.max_prompts} "
                              "(--max-prompts)", param="prompt")
        per_prompt = max(v for v in (n, best_of, 1) if _is_int(v))
        if num_prompts * per_prompt > self.max_sequences_per_request:
            field = "n" if per_prompt == n else "best_of"
            raise OpenAIError(f"the request asks for {num_prompts * per_prompt} sequences ({num_prompts} prompts x "
                              f"{field} {per_prompt}), above this server's limit of {self.max_sequences_per_request} "
                              "per request (--max-sequences-per-request)", param=field)
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        if len(stops) > self.max_stop_strings:
            raise OpenAIError(f"stop has {len(stops)} strings, above this server's limit of "
                              f"{self.max_stop_strings} (--max-stop-strings)", param="stop")
        chars = sum(len(s) for s in stops if isinstance(s, str))
        if chars > self.max_stop_chars:
            raise OpenAIError(f"the stop strings have {chars} characters in all, above this server's limit of "
                              f"{self.max_stop_chars} (--max-stop-chars)", param="stop")


def check_logprobs(value: int | None, max_logprobs: int, param: str) -> None:
    """A 400 naming ``param`` when it asks for more logprobs than the engine's ``max_logprobs``
    (-1: no cap)."""
    if value is not None and 0 <= max_logprobs < value:
        raise OpenAIError(f"{param} is {value}, above this server's limit of {max_logprobs} (max_logprobs; "
                          "start the server with a larger --max-logprobs to allow more)", param=param)


def check_for_model(params: SamplingParams, vocab_size: int, max_logprobs: int = -1) -> SamplingParams:
    """``params``, or a 400 naming the field when this model cannot honour them (``logprobs``
    beyond ``max_logprobs`` or the vocabulary, stop token ids outside it): checked before
    anything is submitted."""
    try:
        check_params_for_model(params, vocab_size, max_logprobs)
    except PromptError as e:
        raise OpenAIError(str(e), param=str(e).split()[0]) from e
    return params


def check_prompt_chars(num_chars: int, max_chars_per_token: int | None, max_model_len: int,
                       prompt_param: str = "prompt") -> None:
    """A 400 before tokenising, for a text that cannot fit the model: with at most
    ``max_chars_per_token`` characters a token (``Tokenizer.max_chars_per_token``; None: no
    bound is known, nothing is checked), more than ``max_model_len`` times that many characters
    are more than ``max_model_len`` tokens, and ``check_context`` would refuse them anyway."""
    if max_chars_per_token is None or num_chars <= max_model_len * max_chars_per_token:
        return
    raise OpenAIError(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
        f"{num_chars} characters, more than {max_model_len} tokens can hold ({max_model_len * max_chars_per_token} "
        f"characters, at most {max_chars_per_token} a token with this tokenizer); it was not tokenised. "
        "Please reduce the length of the prompt (or start the server with a larger --max-model-len).",
        param=prompt_param,
        code="context_length_exceeded",
    )


def check_context(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, prompt_param: str = "prompt"
) -> int:
    """The number of tokens to generate, or a 400 when the prompt and the completion do not fit.

    ``max_tokens`` None means as many as the context leaves.
    """
    if max_tokens is not None and (isinstance(max_tokens, bool) or max_tokens < 1):
        raise OpenAIError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if num_prompt_tokens >= max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {num_prompt_tokens} tokens, which leaves no room for a completion. "
            "Please reduce the length of the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} in the completion). Please reduce the length of the prompt "
            "or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def openapi_body(*models: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route that reads its JSON body itself: the body is one of
    ``models``, their references inlined (an OpenAPI document cannot reach a schema's
    ``$defs``), so that clients and fuzzers (schemathesis) see what the route takes."""
    schemas = [_inline_refs(m.model_json_schema()) for m in models]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, list):
            return [inline(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: inline(v) for k, v in node.items() if k != "$ref"}
        if "$ref" in node:  # "#/$defs/Name"; the request models nest without recursion
            out = {**inline(defs[node["$ref"].rsplit("/", 1)[-1]]), **out}
        return out

    return inline(schema)


class TokenizeCompletionRequest(StrictRequest):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """Messages rendered exactly as ``/v1/chat/completions`` renders them (sampling fields are
    accepted and unused)."""

    model: str | None = None
    return_token_strs: bool = False


class DetokenizeRequest(StrictRequest):
    model: str | None = None
    tokens: list[int]
