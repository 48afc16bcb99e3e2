"""The OpenAI-compatible HTTP server: FastAPI routes, errors, the API key, and ``attnserve serve``.

Routes: ``/v1/completions``, ``/v1/chat/completions`` (JSON or server-sent events),
``/v1/models``, ``/tokenize`` and ``/detokenize`` (vLLM's shapes), ``/version``, ``/metrics``
(Prometheus), and the probes ``/health`` and ``/ping`` (GET or POST, as vLLM and SageMaker
have it), the only routes the API key does not guard. Request fields the server does not know
are ignored with a warning naming them (``protocol.py`` says which are refused instead).
Every error leaves as OpenAI words it,
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status. A client that goes
away is noticed: a streamed request ends when its stream is cancelled, a whole-response request
races its generation against the connection's ``http.disconnect``; either way the engine
aborts the request and frees its blocks.

The engine is an ``EngineClient`` (``engine/engine_client.py``): by default its own process
(``engine/engine_process.py``), so HTTP and the engine's host work do not share a GIL; with
``--disable-frontend-multiprocessing`` a thread of this process (``engine/async_engine.py``).

Not here: running the engine, building responses from outputs (``serving_*.py``), the wire
models (``protocol.py``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse

from attnserve import __version__
from attnserve.engine.engine import PromptError
from attnserve.engine.engine_client import EngineClient, EngineDeadError
from attnserve.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from attnserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    OpenAIError,
    ServerLimits,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    validation_error,
)
from attnserve.entrypoints.openai.serving_chat import OpenAIServingChat
from attnserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from attnserve.entrypoints.openai.tool_parsers import get_tool_parser

__all__ = ["build_app", "run_server"]

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def _error(err: OpenAIError, metrics: ServerMetrics) -> Response:
    metrics.record_error(err.status)
    return _json(err.to_response(), err.status)


_PROBES = ("/health", "/ping")  # answered without the API key: load balancers send none


class _ApiKeyMiddleware:
    """Every route but the probes needs ``Authorization: Bearer KEY`` (a plain ASGI wrapper,
    so streaming and disconnects pass through untouched)."""

    def __init__(self, app: Any, api_key: str, metrics: ServerMetrics):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in _PROBES:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = OpenAIError("Incorrect API key provided.", status=401, code="invalid_api_key")
                await _error(err, self.metrics)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 once it is larger than ``limit`` bytes (declared or sent)."""
    too_large = OpenAIError(f"the request body is larger than this server's limit of {limit} bytes",
                            status=413, code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _json_body(request: Request, limits: ServerLimits) -> dict[str, Any]:
    raw = await _read_body(request, limits.max_request_body_bytes)
    try:  # a large body parses off the event loop
        body = json.loads(raw) if len(raw) < 1 << 20 else await asyncio.to_thread(json.loads, raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, nesting too deep
        raise OpenAIError(f"We could not parse the JSON body of your request: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIError("The request body must be a JSON object.")
    if b"\\ud" in raw.lower():  # an escaped surrogate: Python's parser lets a lone one through
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError as e:
            raise OpenAIError(f"The JSON body of your request holds a lone surrogate "
                              f"({e.object[e.start:e.end]!a}): strings must be valid Unicode.") from None
    return body


def _validate(request: Request, body: dict[str, Any], model: type[M]) -> M:
    """The request model of ``body``; fields the server ignores are logged by name."""
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from e
    ignored = req.ignored_fields()
    if ignored:
        logger.warning("%s: ignoring request fields this server does not support: %s",
                       request.url.path, ", ".join(ignored))
    return req


async def _parse(request: Request, model: type[M], limits: ServerLimits) -> M:
    return _validate(request, await _json_body(request, limits), model)


async def _disconnected(request: Request) -> None:
    # after the body is read, the next ASGI message is the disconnect (or the response's end)
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _respond(request: Request, work: Awaitable[BaseModel | AsyncIterator[str]]) -> Response:
    """Await ``work`` unless the client leaves first (then cancel it: the engine aborts)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # nobody is there to read it
    result = task.result()
    if isinstance(result, BaseModel):
        return _json(result)
    return StreamingResponse(
        result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def _check_model(name: str, served: str) -> None:
    if name != served:
        raise OpenAIError(
            f"The model `{name}` does not exist.", status=404, param="model", code="model_not_found"
        )


def _internal_error(exc: Exception) -> OpenAIError:
    logger.error("unhandled error", exc_info=exc)
    return OpenAIError(f"internal error: {exc!r}", status=500)


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error leaves in OpenAI's shape, whatever raised it."""
    to_openai: dict[type[Exception], Callable[[Any], OpenAIError]] = {
        OpenAIError: lambda e: e,
        StarletteHTTPException: lambda e: OpenAIError(str(e.detail), status=e.status_code),
        RequestValidationError: lambda e: OpenAIError(str(e)),
        EngineDeadError: lambda e: OpenAIError(str(e), status=503),
        PromptError: lambda e: OpenAIError(str(e)),  # the engine refused the request: a 400
        Exception: _internal_error,
    }
    for exc_type, convert in to_openai.items():

        async def handler(request: Request, exc: Exception, convert=convert) -> Response:
            return _error(convert(exc), metrics)

        app.add_exception_handler(exc_type, handler)


def build_app(
    engine: EngineClient,
    served_model_name: str,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The FastAPI app over a running (or startable) engine; its lifespan stops the engine.

    Args:
        engine: the engine; ``start`` is called when the app starts.
        served_model_name: the only model name requests may ask for.
        api_key: when given, every route but ``/health`` requires it as a bearer token.
        limits: body size, ``n``, prompts per request, request-sent chat templates.
        chat_template: a template's source, used instead of the model's own (``--chat-template``).
        tool_call_parser: the parser of the model's tool calls (``tool_parsers.TOOL_PARSERS``)
            that serves ``tool_choice`` "auto"; None refuses "auto" (``--enable-auto-tool-choice``).
    """
    limits = limits or ServerLimits()
    metrics = ServerMetrics(served_model_name, engine.stats, engine.max_model_len, engine.cache_info)
    completion = OpenAIServingCompletion(engine, served_model_name, metrics, limits)
    parser = get_tool_parser(tool_call_parser) if tool_call_parser is not None else None
    chat = OpenAIServingChat(engine, served_model_name, metrics, limits, chat_template, parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        # structured output's import (seconds) now, not on a worker thread at the first request,
        # where it would hold the interpreter and stall every other client
        await asyncio.to_thread(engine.structured.warm_up)
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="attnserve", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key, metrics=metrics)

    _add_error_handlers(app, metrics)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive else 503)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> Response:
        return Response(json.dumps({"version": __version__}), media_type="application/json")

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(
            id=served_model_name, root=engine.model, max_model_len=engine.max_model_len
        )
        return _json(ModelList(data=[card]))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest, limits)
        _check_model(req.model, served_model_name)
        return await _respond(request, completion.create(req))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest, limits)
        _check_model(req.model, served_model_name)
        return await _respond(request, chat.create(req))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await _json_body(request, limits)
        req = _validate(request, body, TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest)
        if req.model is not None:
            _check_model(req.model, served_model_name)
        tok = engine.tokenizer
        if isinstance(req, TokenizeChatRequest):
            ids = await asyncio.to_thread(chat.prompt_ids, req)
        elif tok is None:
            raise OpenAIError("this model has no tokenizer", param="prompt")
        else:
            ids = await asyncio.to_thread(tok.encode, req.prompt, req.add_special_tokens)
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return _json(TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids,
                                      token_strs=strs))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await _parse(request, DetokenizeRequest, limits)
        if req.model is not None:
            _check_model(req.model, served_model_name)
        bad = [t for t in req.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise OpenAIError(f"token ids out of range [0, {engine.vocab_size}): {bad[:5]}", param="tokens")
        if engine.tokenizer is None:
            raise OpenAIError("this model has no tokenizer", param="tokens")
        text = await asyncio.to_thread(engine.tokenizer.decode, req.tokens, False)
        return _json(DetokenizeResponse(prompt=text))

    return app


def run_server(
    model: str,
    engine_kwargs: dict[str, Any],
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    log_level: str = "info",
    limits: ServerLimits | None = None,
    log_stats_interval: float | None = None,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
    frontend_multiprocessing: bool = True,
) -> None:
    """Build the engine and serve it with uvicorn until interrupted (``attnserve serve``).

    ``log_stats_interval``: seconds between throughput lines in the log (None: none);
    ``chat_template``: a template, or the path of a file holding one (``--chat-template``);
    ``tool_call_parser``: serves ``tool_choice`` "auto" (``--enable-auto-tool-choice``);
    ``frontend_multiprocessing``: the engine in its own process (False: on a thread of this
    one, ``--disable-frontend-multiprocessing``)."""
    import uvicorn

    from attnserve.engine.async_engine import AsyncLLMEngine
    from attnserve.engine.engine_process import EngineProcessClient
    from attnserve.tokenizer import load_chat_template

    template = load_chat_template(chat_template)  # a bad path fails before the model loads
    if tool_call_parser is not None:
        get_tool_parser(tool_call_parser)  # an unknown name, too
    engine_class = EngineProcessClient if frontend_multiprocessing else AsyncLLMEngine
    engine = engine_class.from_kwargs(model, log_stats_interval=log_stats_interval, **engine_kwargs)
    try:
        app = build_app(engine, served_model_name or model, api_key, limits, template, tool_call_parser)
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:  # also when uvicorn fails (a port in use): no engine process is left behind
        engine.shutdown()
