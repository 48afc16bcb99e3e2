"""The OpenAI-compatible HTTP server: FastAPI routes, errors, the API key, and ``attnserve serve``.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` (JSON or server-sent
events; ``GET`` and ``DELETE /v1/responses/{id}`` of a stored response),
``/v1/models`` and ``/v1/models/{id}``, ``/tokenize`` and ``/detokenize`` (vLLM's shapes), ``/version``, ``/metrics``
(Prometheus), and the probes ``/health`` (GET or HEAD) and ``/ping`` (GET, POST or HEAD, as
vLLM and SageMaker have it), the only routes the API key does not guard. Request fields the
server does not know are ignored with a warning naming them (``protocol.py`` says which are
refused instead). CORS headers only with ``--allowed-origins`` (starlette's ``CORSMiddleware``);
one log line per request with ``--enable-log-requests`` (``_RequestLog``).
Every error leaves as OpenAI words it,
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status. A client that goes
away is noticed: a streamed request ends when its stream is cancelled, a whole-response request
races its generation against the connection's ``http.disconnect``; either way the engine
aborts the request and frees its blocks.

The engine is an ``EngineClient`` (``engine/engine_client.py``): by default its own process
(``engine/engine_process.py``), so HTTP and the engine's host work do not share a GIL; with
``--disable-frontend-multiprocessing`` a thread of this process (``engine/async_engine.py``).
``run_server`` serves the app with ``connections.build_server``: a connection cap and header,
body and keep-alive timeouts, and a drain on SIGTERM (``drain.py``).

Not here: running the engine, building responses from outputs (``serving_*.py``), the wire
models (``protocol.py``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

from attnserve import __version__
from attnserve.engine.engine import PromptError
from attnserve.engine.engine_client import EngineClient, EngineDeadError
from attnserve.entrypoints.openai.connections import (
    BodyTimeout,
    ConnectionLimits,
    build_server,
    raise_fd_limit,
)
from attnserve.entrypoints.openai.drain import DrainingEngine
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
    openapi_body,
    validation_error,
)
from attnserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from attnserve.entrypoints.openai.responses_api import ResponsesRequest
from attnserve.entrypoints.openai.serving_chat import OpenAIServingChat
from attnserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from attnserve.entrypoints.openai.serving_responses import OpenAIServingResponses
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


async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
    """The client left before its body was whole: nobody reads an answer, and the server did
    nothing wrong (no error in the metrics, no traceback in the log)."""
    logger.debug("%s: the client disconnected while sending its request", request.url.path)
    return Response(status_code=499)


def _printable(text: str, limit: int = 100) -> str:
    """``text`` as one safe log line: at most ``limit`` characters, and newlines, ANSI escapes,
    bidirectional controls and every other unprintable character escaped (``\\n``, ``\\x1b``)."""
    cut = text[:limit]
    if not cut.isprintable():
        cut = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in cut)
    return cut if len(text) <= limit else f"{cut}... ({len(text)} characters)"


_LARGE_BODY = 1 << 20  # bytes: parsed and validated on a worker thread


async def _json_body(request: Request, limits: ServerLimits) -> dict[str, Any]:
    raw = await _read_body(request, limits.max_request_body_bytes)
    request.state.body_bytes = len(raw)
    try:  # a large body parses off the event loop
        body = json.loads(raw) if len(raw) < _LARGE_BODY else await asyncio.to_thread(json.loads, raw)
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
    """The request model of ``body``; fields the server ignores are logged by name (escaped:
    the names are the client's)."""
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from e
    ignored = req.ignored_fields()
    if ignored:
        names = ", ".join(_printable(name) for name in ignored[:16])
        more = f" and {len(ignored) - 16} more" if len(ignored) > 16 else ""
        logger.warning("%s: ignoring request fields this server does not support: %s%s",
                       request.url.path, names, more)
    return req


async def _validated(request: Request, body: dict[str, Any], model: type[M]) -> M:
    """``_validate``, on a worker thread for a large body (megabytes of token ids take a while)."""
    if getattr(request.state, "body_bytes", 0) < _LARGE_BODY:
        return _validate(request, body, model)
    return await asyncio.to_thread(_validate, request, body, model)


async def _parse(request: Request, model: type[M], limits: ServerLimits) -> M:
    return await _validated(request, await _json_body(request, limits), model)


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


def _check_model(name: str | None, served: str | Sequence[str]) -> None:
    """A request's ``model`` must name the served model (one of its names); None (left out)
    means it, as in vLLM."""
    if name is not None and name not in ((served,) if isinstance(served, str) else served):
        raise OpenAIError(
            f"The model `{name}` does not exist.", status=404, param="model", code="model_not_found"
        )


def _internal_error(exc: Exception) -> OpenAIError:
    logger.error("unhandled error: %s", _escaped_traceback(exc))
    return OpenAIError(f"internal error: {exc!r}", status=500)


def _escaped_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` and the exceptions it chains, each message escaped (a message
    may quote what a client sent; the frames are this server's code)."""
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    parts = []
    for e in reversed(chain):
        parts += traceback.format_tb(e.__traceback__)
        parts.append(f"{type(e).__qualname__}: {_printable(str(e), 1000)}\n")
    return "".join(parts).rstrip()


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error leaves in OpenAI's shape, whatever raised it."""
    to_openai: dict[type[Exception], Callable[[Any], OpenAIError]] = {
        OpenAIError: lambda e: e,
        StarletteHTTPException: lambda e: OpenAIError(str(e.detail), status=e.status_code),
        RequestValidationError: lambda e: OpenAIError(str(e)),
        EngineDeadError: lambda e: OpenAIError(str(e), status=503),
        BodyTimeout: lambda e: OpenAIError(str(e), status=408, code="request_timeout"),
        PromptError: lambda e: OpenAIError(str(e)),  # the engine refused the request: a 400
        Exception: _internal_error,
    }
    for exc_type, convert in to_openai.items():

        async def handler(request: Request, exc: Exception, convert=convert) -> Response:
            response = _error(convert(exc), metrics)
            if isinstance(exc, BodyTimeout):  # the rest of the body is not read: nor is the connection
                response.headers["connection"] = "close"
            return response

        app.add_exception_handler(exc_type, handler)


class _RequestLog:
    """``engine`` with one INFO line per request it starts: its id, prompt length and sampling
    params, as vLLM's ``--enable-log-requests`` (the prompt itself stays out of the log)."""

    def __init__(self, engine: EngineClient):
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(self, request_id: str, prompt: str | list[int] | dict[str, Any],
                 params: Any) -> AsyncIterator[Any]:
        ids, text = (prompt.get("prompt_token_ids"), prompt.get("prompt")) if isinstance(prompt, dict) else \
            (prompt, None) if isinstance(prompt, list) else (None, prompt)
        length = f"{len(ids)} tokens" if ids is not None else f"{len(text or '')} characters"
        logger.info("Received request %s: prompt %s, params: %s", _printable(request_id), length,
                    _printable(repr(params), 2000))
        return self.engine.generate(request_id, prompt, params)


def build_app(
    engine: EngineClient,
    served_model_name: str | Sequence[str],
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
    cors: dict[str, Any] | None = None,
    log_requests: bool = False,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The FastAPI app over a running (or startable) engine; its lifespan stops the engine.

    Args:
        engine: the engine; ``start`` is called when the app starts.
        served_model_name: the model name requests may ask for, or several (vLLM's
            ``--served-model-name A B``): the first is the one responses and metrics report.
        api_key: when given, every route but ``/health`` requires it as a bearer token.
        limits: body size, ``n``, prompts per request, request-sent chat templates.
        chat_template: a template's source, used instead of the model's own (``--chat-template``).
        tool_call_parser: the parser of the model's tool calls (``tool_parsers.TOOL_PARSERS``)
            that serves ``tool_choice`` "auto"; None refuses "auto" (``--enable-auto-tool-choice``).
        reasoning_parser: the parser that splits the model's reasoning off chat outputs into
            ``reasoning_content`` (``reasoning_parsers.REASONING_PARSERS``, ``--reasoning-parser``).
        cors: ``CORSMiddleware``'s keywords (``--allowed-origins``, ...); None: no CORS headers.
        log_requests: one log line per request (``--enable-log-requests``).
    """
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
    served_model_name = names[0]
    limits = limits or ServerLimits()
    metrics = ServerMetrics(served_model_name, engine.stats, engine.max_model_len, engine.cache_info)
    # requests generate through the drain, so that it can end them
    drain = DrainingEngine(_RequestLog(engine) if log_requests else engine)
    completion = OpenAIServingCompletion(drain, served_model_name, metrics, limits)
    parser = get_tool_parser(tool_call_parser) if tool_call_parser is not None else None
    reasoning = get_reasoning_parser(reasoning_parser) if reasoning_parser is not None else None
    chat = OpenAIServingChat(drain, served_model_name, metrics, limits, chat_template, parser, reasoning)
    responses = OpenAIServingResponses(drain, served_model_name, metrics, chat, limits)  # on the chat path

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        # structured output's import (seconds) now, not on a worker thread at the first request,
        # where it would hold the interpreter and stall every other client
        await asyncio.to_thread(engine.structured.warm_up)
        # then every step shape and sampling path once (engine/warm_up.py): the first requests
        # are as fast as the tenth
        await asyncio.to_thread(engine.warm_up)
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="attnserve", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.drain = drain
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key, metrics=metrics)
    if cors is not None:  # added last, so outermost: preflights and 401s get their CORS headers too
        app.add_middleware(CORSMiddleware, **cors)

    _add_error_handlers(app, metrics)
    app.add_exception_handler(ClientDisconnect, _client_gone)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive else 503)

    # /ping answers GET and POST (SageMaker's probe); each method its own operation id, and HEAD
    # as load balancers send it, left out of the schema
    app.add_api_route("/ping", health, methods=["GET"], operation_id="ping_get")
    app.add_api_route("/ping", health, methods=["POST"], operation_id="ping_post")
    for path in _PROBES:
        app.add_api_route(path, health, methods=["HEAD"], include_in_schema=False)

    @app.get("/version")
    async def version() -> Response:
        return Response(json.dumps({"version": __version__}), media_type="application/json")

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, root=engine.model, max_model_len=engine.max_model_len)

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(ModelList(data=[card(name) for name in names]))

    @app.get("/v1/models/{model_id:path}")  # :path: served names may hold a slash (org/name)
    async def model(model_id: str) -> Response:
        _check_model(model_id, names)
        return _json(card(model_id))

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest, limits)
        _check_model(req.model, names)
        return await _respond(request, completion.create(req))

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest, limits)
        _check_model(req.model, names)
        return await _respond(request, chat.create(req))

    @app.post("/v1/responses", openapi_extra=openapi_body(ResponsesRequest))
    async def create_response(request: Request) -> Response:
        req = await _parse(request, ResponsesRequest, limits)
        _check_model(req.model, names)
        return await _respond(request, responses.create(req))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return _json(responses.retrieve(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return _json(responses.delete(response_id))

    @app.post("/tokenize", openapi_extra=openapi_body(TokenizeCompletionRequest, TokenizeChatRequest))
    async def tokenize(request: Request) -> Response:
        body = await _json_body(request, limits)
        req = await _validated(request, body, TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest)
        _check_model(req.model, names)
        tok = engine.tokenizer
        if tok is None and not isinstance(req, TokenizeChatRequest):
            raise OpenAIError("this model has no tokenizer", param="prompt")

        def answer() -> Response:  # on a worker thread: a long text has millions of tokens
            ids = chat.prompt_ids(req) if isinstance(req, TokenizeChatRequest) else \
                tok.encode(req.prompt, req.add_special_tokens)
            strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
            return _json(TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids,
                                          token_strs=strs))

        return await asyncio.to_thread(answer)

    @app.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        req = await _parse(request, DetokenizeRequest, limits)
        _check_model(req.model, names)
        if engine.tokenizer is None:
            raise OpenAIError("this model has no tokenizer", param="tokens")

        def answer() -> Response:  # on a worker thread: the ids may be millions
            bad = [t for t in req.tokens if not 0 <= t < engine.vocab_size]
            if bad:
                raise OpenAIError(f"token ids out of range [0, {engine.vocab_size}): {bad[:5]}", param="tokens")
            return _json(DetokenizeResponse(prompt=engine.tokenizer.decode(req.tokens, False)))

        return await asyncio.to_thread(answer)

    return app


def run_server(
    model: str,
    engine_kwargs: dict[str, Any],
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | Sequence[str] | None = None,
    log_level: str = "info",
    limits: ServerLimits | None = None,
    log_stats_interval: float | None = None,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
    frontend_multiprocessing: bool = True,
    connection_limits: ConnectionLimits | None = None,
    cors: dict[str, Any] | None = None,
    log_requests: bool = False,
    reasoning_parser: str | None = None,
) -> None:
    """Build the engine and serve it with uvicorn until interrupted (``attnserve serve``).

    ``log_stats_interval``: seconds between throughput lines in the log (None: none);
    ``chat_template``: a template, or the path of a file holding one (``--chat-template``);
    ``tool_call_parser``: serves ``tool_choice`` "auto" (``--enable-auto-tool-choice``);
    ``frontend_multiprocessing``: the engine in its own process (False: on a thread of this
    one, ``--disable-frontend-multiprocessing``); ``connection_limits``: the connection cap,
    the header, body and keep-alive timeouts and the shutdown timeout (``connections.py``);
    ``served_model_name``, ``cors``, ``log_requests``, ``reasoning_parser``: as ``build_app``'s."""
    from attnserve.engine.async_engine import AsyncLLMEngine
    from attnserve.engine.engine_process import EngineProcessClient
    from attnserve.tokenizer import load_chat_template

    template = load_chat_template(chat_template)  # a bad path fails before the model loads
    if tool_call_parser is not None:
        get_tool_parser(tool_call_parser)  # an unknown name, too
    if reasoning_parser is not None:
        get_reasoning_parser(reasoning_parser)
    raise_fd_limit()  # before the engine process starts, so that it inherits the limit too
    engine_class = EngineProcessClient if frontend_multiprocessing else AsyncLLMEngine
    engine = engine_class.from_kwargs(model, log_stats_interval=log_stats_interval, **engine_kwargs)
    try:
        app = build_app(engine, served_model_name or model, api_key, limits, template, tool_call_parser,
                        cors=cors, log_requests=log_requests, reasoning_parser=reasoning_parser)
        server = build_server(app, connection_limits, host, port, log_level, drain=app.state.drain)
        try:
            server.run()
        except KeyboardInterrupt:  # as uvicorn.run: Ctrl-C, re-raised once the server has stopped
            pass
        if not server.started:  # as uvicorn.run: a start-up that failed is an error
            raise SystemExit(3)
    finally:  # also when uvicorn fails (a port in use): no engine process is left behind
        engine.shutdown()
