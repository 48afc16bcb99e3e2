"""The graceful drain: what ends the requests still running at the shutdown deadline.

When the server is told to stop (SIGTERM, SIGINT), ``connections.Server`` stops accepting;
running requests go on for ``--shutdown-timeout`` seconds, then ``DrainingEngine.expire`` aborts
those still in the engine. Each one's output stream then raises a 503
``OpenAIError``, which the serving code already turns into what a client expects of a failure:
a stream sends it as an error event followed by ``data: [DONE]``, a whole response is the JSON
error. A request that reaches the engine after the deadline gets the same error at once.

Not here: stopping the HTTP server (``connections.py``), the engine's own shutdown (the app's
lifespan, after the drain).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from attnserve.engine.engine_client import EngineClient
from attnserve.entrypoints.openai.protocol import OpenAIError
from attnserve.outputs import RequestOutput
from attnserve.sampling_params import SamplingParams

__all__ = ["DrainingEngine"]

logger = logging.getLogger(__name__)


class DrainingEngine:
    """An ``EngineClient`` that is ``engine`` (every attribute but ``generate`` passes through)
    and knows which requests are generating, so that the drain can end them."""

    def __init__(self, engine: EngineClient):
        self.engine = engine
        self.expired = False  # the server was told to stop, and the shutdown timeout has passed
        self._running: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    @property
    def num_running(self) -> int:
        """Requests generating now."""
        return len(self._running)

    def expire(self) -> int:
        """The shutdown timeout passed: abort every running request (each stream then raises a
        503); return how many there were."""
        self.expired = True
        running = list(self._running)
        for request_id in running:
            self.engine.abort(request_id)
        if running:
            logger.warning("shutdown timeout: ending %d running request(s) with an error", len(running))
        return len(running)

    def _error(self) -> OpenAIError:
        return OpenAIError("the server is shutting down: the request did not finish within its "
                           "shutdown timeout (--shutdown-timeout)", status=503, code="server_shutting_down")

    async def generate(self, request_id: str, prompt: str | list[int] | dict[str, Any],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """``engine.generate``, ending with a 503 ``OpenAIError`` if the drain aborted it."""
        if self.expired:
            raise self._error()
        finished = False
        self._running.add(request_id)
        try:
            async with aclosing(self.engine.generate(request_id, prompt, params)) as stream:
                async for out in stream:
                    finished = out.finished
                    yield out
        finally:
            self._running.discard(request_id)
        if not finished and self.expired:  # the stream ended unfinished: the drain aborted it
            raise self._error()
