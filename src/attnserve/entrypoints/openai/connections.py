"""How the HTTP server holds its connections: a cap, timeouts, bounded logs, and a drain on stop.

``build_server`` returns the uvicorn server ``attnserve serve`` runs, with:

- a cap on open connections (``--max-connections``), never more than the process's file
  descriptor limit leaves room for (``fd_budget``). A connection past the cap takes the place of
  the oldest *idle* one (no request in flight: it has sent no complete request head yet, or it
  waits between requests); when every connection has a request in flight it is closed at once.
  So idle sockets, however many, cannot exhaust descriptors, and the accept loop never spins
  on "Too many open files";
- a header timeout (``--header-timeout``): a connection that has not sent a whole request head
  this long after it opened (or after the first byte of its next request) is closed;
- a body timeout (``--body-timeout``): a body not received whole this long after its head is
  answered 408 (``BodyTimeout``, in OpenAI's error shape) and the connection closed;
- uvicorn's keep-alive timeout (``--timeout-keep-alive``) between requests;
- at most one log record per kind every ``_LOG_EVERY_S`` seconds from uvicorn and asyncio (the
  accept loop, protocol warnings, per-task errors), with a count of those left out;
- on SIGTERM or SIGINT: no new connections, and the running requests get ``--shutdown-timeout``
  seconds before the drain (``drain.DrainingEngine``) ends them with an error.

The guard wraps uvicorn's own HTTP protocol (h11 or httptools) and reads two of its attributes,
``cycle`` (the request in flight) and ``on_response_complete``, which both have kept since
uvicorn 0.2x. WebSocket upgrades are off (no route uses them): an upgraded connection would
leave the guard.

Not here: the routes and their errors (``api_server.py``), what a request may ask
(``protocol.ServerLimits``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import uvicorn

if TYPE_CHECKING:
    from attnserve.entrypoints.openai.drain import DrainingEngine

__all__ = ["BodyTimeout", "ConnectionLimits", "Server", "build_server", "fd_budget", "raise_fd_limit"]

logger = logging.getLogger(__name__)

_LOG_EVERY_S = 10.0  # at most one record of a kind this often (uvicorn, asyncio, the cap)
_FD_HEADROOM = 64  # descriptors the process needs besides connections (engine pipes, logs, ...)
_DRAIN_MARGIN_S = 2.0  # after the drain ends requests, this long to write their errors out
_FD_TARGET = 65536  # the soft RLIMIT_NOFILE the server raises itself to (as vLLM), within the hard one


_FLAGS = {"max_connections": "--max-connections", "header_timeout": "--header-timeout",
          "body_timeout": "--body-timeout", "keep_alive_timeout": "--timeout-keep-alive",
          "shutdown_timeout": "--shutdown-timeout"}


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """How the server holds connections (``attnserve serve`` flags named in ``_FLAGS``)."""

    max_connections: int = 4096
    header_timeout: float = 10.0  # seconds from open (or a request's first byte) to a whole head
    body_timeout: float = 60.0  # seconds from a request's head to its whole body
    keep_alive_timeout: float = 5.0  # seconds an idle connection waits for its next request
    shutdown_timeout: float = 5.0  # seconds running requests get once the server is told to stop

    def __post_init__(self) -> None:
        n = self.max_connections
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"--max-connections must be a positive integer, got {n!r}")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout", "shutdown_timeout"):
            t = getattr(self, name)
            least = 0.0 if name == "shutdown_timeout" else None  # 0: end running requests at once
            if (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)
                    or (t < least if least is not None else t <= 0)):
                what = "a number of seconds >= 0" if least is not None else "a positive number of seconds"
                raise ValueError(f"{_FLAGS[name]} must be {what}, got {t!r}")


# --- file descriptors ---------------------------------------------------------------------------
def raise_fd_limit(target: int = _FD_TARGET) -> int | None:
    """Raise the soft RLIMIT_NOFILE towards ``target`` (never above the hard limit); return the
    soft limit now (None where there is no such limit, e.g. Windows)."""
    try:
        import resource
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(hard, target)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:  # a sandbox may refuse: the budget follows the old one
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, want, e)
    return None if soft == resource.RLIM_INFINITY else soft


def _soft_fd_limit() -> int | None:
    try:
        import resource
    except ImportError:
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def fd_budget(soft_limit: int | None) -> tuple[int, int]:
    """``(connections, backlog)`` that fit in ``soft_limit`` file descriptors.

    The accept loop takes up to ``backlog`` sockets at a time before the guard sees them (asyncio
    accepts that many per wake-up, and a few wake-ups may pass before their ``connection_made``),
    so the cap leaves three backlogs and ``_FD_HEADROOM`` for the process's own files."""
    if soft_limit is None:
        return 1 << 30, 2048  # uvicorn's backlog
    backlog = min(max(soft_limit // 16, 16), 1024)
    return max(soft_limit - _FD_HEADROOM - 3 * backlog, 1), backlog


# --- bounded logs -------------------------------------------------------------------------------
class _RateLimitFilter(logging.Filter):
    """Lets through one record of each kind (logger, first line of the message, exception type)
    every ``every`` seconds; the next one that passes says how many were left out meanwhile."""

    def __init__(self, every: float = _LOG_EVERY_S):
        super().__init__()
        self.every = every
        self.kinds: dict[tuple, list] = {}  # kind -> [last time let through, left out since]

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else None
        kind = (record.name, str(record.msg).partition("\n")[0], exc)
        now = time.monotonic()
        seen = self.kinds.get(kind)
        if seen is not None and now - seen[0] < self.every:
            seen[1] += 1
            return False
        if len(self.kinds) >= 1024:  # many kinds: forget them rather than grow
            self.kinds.clear()
        if seen is not None and seen[1]:
            record.msg = f"{record.msg} ({seen[1]} more like this in the last {now - seen[0]:.0f} s not logged)"
        self.kinds[kind] = [now, 0]
        return True


@contextmanager
def _rate_limited_logs(*names: str) -> Iterator[None]:
    limiter = _RateLimitFilter()
    loggers = [logging.getLogger(name) for name in names]
    for log in loggers:
        log.addFilter(limiter)
    try:
        yield
    finally:
        for log in loggers:
            log.removeFilter(limiter)


# --- the connection guard -----------------------------------------------------------------------
class _ConnectionGuard:
    """What a server's connections share: the cap, the idle ones (oldest first), the counts of
    those closed by the guard. Called by uvicorn as its HTTP protocol class."""

    def __init__(self, inner_class: Any, max_connections: int, header_timeout: float):
        self.inner_class = inner_class
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.open: set[_GuardedProtocol] = set()
        self.idle: dict[_GuardedProtocol, None] = {}  # insertion order: the oldest idle first
        self.evicted = self.refused = self.timed_out = 0  # since the last report
        self.last_report = -math.inf
        self.flush: asyncio.TimerHandle | None = None  # the report due at the end of this window

    def __call__(self, config: Any, server_state: Any, app_state: dict,
                 _loop: asyncio.AbstractEventLoop | None = None) -> _GuardedProtocol:
        inner = self.inner_class(config=config, server_state=server_state, app_state=app_state, _loop=_loop)
        return _GuardedProtocol(self, inner, _loop or asyncio.get_running_loop())

    def admit(self, conn: _GuardedProtocol) -> bool:
        """Make room for ``conn`` (closing the oldest idle connection at the cap); False when
        every open connection has a request in flight."""
        if len(self.open) >= self.max_connections:
            victim = next(iter(self.idle), None)
            if victim is None:
                self.refused += 1
                self._report()
                return False
            victim.close()
            self.evicted += 1
            self._report()
        self.open.add(conn)
        self.idle[conn] = None
        return True

    def forget(self, conn: _GuardedProtocol) -> None:
        self.open.discard(conn)
        self.idle.pop(conn, None)

    def _report(self) -> None:
        """Log what the guard closed, at most once every ``_LOG_EVERY_S`` seconds (what comes
        in between is logged at the end of that window)."""
        wait = self.last_report + _LOG_EVERY_S - time.monotonic()
        if wait > 0:
            if self.flush is None:
                self.flush = asyncio.get_running_loop().call_later(wait, self._report)
            return
        self.flush = None
        if not (self.evicted or self.refused):
            return
        logger.warning("the connection limit (%d: --max-connections, or what RLIMIT_NOFILE leaves room for) "
                       "was reached: %d idle connection(s) closed to admit new ones, %d refused while every "
                       "connection was busy, %d closed without a request head within --header-timeout, since "
                       "the last report", self.max_connections, self.evicted, self.refused, self.timed_out)
        self.evicted = self.refused = self.timed_out = 0
        self.last_report = time.monotonic()


class _GuardedProtocol(asyncio.Protocol):
    """One connection: uvicorn's protocol inside, admitted by the guard, timed until its heads."""

    def __init__(self, guard: _ConnectionGuard, inner: Any, loop: asyncio.AbstractEventLoop):
        self.guard, self.inner, self.loop = guard, inner, loop
        self.transport: asyncio.Transport | None = None
        self.admitted = False
        self.header_timer: asyncio.TimerHandle | None = None
        # uvicorn's cycles call back the protocol's on_response_complete (looked up when each
        # cycle is made): ours runs theirs, then marks the connection idle
        self._inner_response_complete = inner.on_response_complete
        inner.on_response_complete = self._response_complete

    def _in_flight(self) -> bool:
        cycle = self.inner.cycle
        return cycle is not None and not cycle.response_complete

    def _arm_header_timer(self) -> None:
        self.header_timer = self.loop.call_later(self.guard.header_timeout, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _header_timed_out(self) -> None:
        self.header_timer = None
        if not self._in_flight():
            self.guard.timed_out += 1
            self.close()

    def close(self) -> None:
        self._disarm_header_timer()
        self.guard.forget(self)
        if self.transport is not None:
            self.transport.close()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.guard.admit(self):
            transport.close()
            return
        self.admitted = True
        self.inner.connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        before = self.inner.cycle
        if self.header_timer is None and not self._in_flight():
            self._arm_header_timer()  # the first bytes of the next request on a kept-alive connection
        self.inner.data_received(data)
        if self.inner.cycle is not before:  # a whole request head: it runs until its response ends
            self._disarm_header_timer()
            self.guard.idle.pop(self, None)

    def _response_complete(self) -> None:
        self._inner_response_complete()
        if self.admitted and not self._in_flight() and self in self.guard.open:
            self.guard.idle.pop(self, None)
            self.guard.idle[self] = None  # idle from now: the newest idle

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self.guard.forget(self)
        if self.admitted:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()


# --- the body timeout ---------------------------------------------------------------------------
class BodyTimeout(Exception):
    """A request's body did not arrive whole within ``--body-timeout`` of its head (a 408)."""


class _BodyDeadline:
    """ASGI middleware: ``receive`` raises ``BodyTimeout`` once the body is late (the route's
    error handler answers it); after the body, ``receive`` passes through untimed."""

    def __init__(self, app: Any, timeout: float):
        self.app, self.timeout = app, timeout

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        body_done = False

        async def timed_receive() -> dict:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise BodyTimeout(f"the request body did not arrive within {self.timeout:g} s "
                                  f"(--body-timeout)") from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)


# --- the server ---------------------------------------------------------------------------------
class Server(uvicorn.Server):
    """uvicorn's server with bounded logs and a drain: on stop, running requests get
    ``shutdown_timeout`` seconds, then ``drain.expire()`` ends them (uvicorn's own deadline,
    ``_DRAIN_MARGIN_S`` later, is only a backstop)."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float, drain: DrainingEngine | None):
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self.drain = drain

    async def serve(self, sockets: list | None = None) -> None:
        with _rate_limited_logs("uvicorn.error", "asyncio"):
            await super().serve(sockets)

    async def shutdown(self, sockets: list | None = None) -> None:
        timer = None
        if self.drain is not None:
            running = self.drain.num_running
            if running:
                logger.info("shutting down: %d running request(s) get %g s to finish (--shutdown-timeout)",
                            running, self.shutdown_timeout)
            timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self.drain.expire)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


def build_server(app: Any, limits: ConnectionLimits | None = None, host: str = "127.0.0.1", port: int = 8000,
                 log_level: str = "info", drain: DrainingEngine | None = None, access_log: bool = True) -> Server:
    """The uvicorn server for ``app`` with ``limits`` applied (``Server.run()`` serves it).

    Args:
        app: the ASGI app (``api_server.build_app``).
        limits: the cap and timeouts (default: ``ConnectionLimits()``).
        drain: what ends running requests at the shutdown deadline (``app.state.drain``).
    """
    from uvicorn.protocols.http.auto import AutoHTTPProtocol  # h11, or httptools when installed

    limits = limits or ConnectionLimits()
    soft = _soft_fd_limit()
    room, backlog = fd_budget(soft)
    max_connections = min(limits.max_connections, room)
    if max_connections < limits.max_connections:
        logger.warning("--max-connections %d lowered to %d: the open-file limit (RLIMIT_NOFILE) is %d",
                       limits.max_connections, max_connections, soft)
    guard = _ConnectionGuard(AutoHTTPProtocol, max_connections, limits.header_timeout)
    config = uvicorn.Config(
        _BodyDeadline(app, limits.body_timeout), host=host, port=port, log_level=log_level,
        access_log=access_log, http=guard, ws="none", backlog=backlog,
        timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type] - a float works
        timeout_graceful_shutdown=limits.shutdown_timeout + _DRAIN_MARGIN_S,  # type: ignore[arg-type]
    )
    return Server(config, limits.shutdown_timeout, drain)
