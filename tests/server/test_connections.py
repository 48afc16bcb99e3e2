"""The server under hostile connections, and its drain on SIGTERM (issue 39, points 1 and 4).

In a thread, a server with a small cap and short timeouts (``connections.build_server``): idle
connections and slow request heads are closed after the header timeout, a slow body gets a 408,
a kept-alive connection closes after its keep-alive timeout, idle connections give way at the
cap while busy ones keep it, and ``HEAD /health`` answers. As a real ``attnserve serve``
process, with its open-file limit lowered to 512: 2,000 idle sockets leave ``/health``
answering within a second and the log quiet, and SIGTERM lets running requests go on for
``--shutdown-timeout``, then ends a stream with an error event and ``[DONE]`` and a whole
response with an OpenAI JSON 503, before the process exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ENGINE_KWARGS, MODEL_NAME

LIMITS = dict(max_connections=8, header_timeout=1.0, body_timeout=1.5, keep_alive_timeout=1.0,
              shutdown_timeout=1.0)


# --- raw sockets --------------------------------------------------------------------------------
def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _closed_after(sock: socket.socket, timeout: float = 5.0) -> tuple[float, bytes]:
    """Seconds until the server closed ``sock`` (EOF or reset), and what it sent before; the
    seconds are inf if it stayed open ``timeout`` seconds."""
    start, got = time.monotonic(), b""
    sock.settimeout(timeout)
    try:
        while chunk := sock.recv(65536):
            got += chunk
            sock.settimeout(max(timeout - (time.monotonic() - start), 0.01))
    except ConnectionResetError:
        pass
    except TimeoutError:
        return float("inf"), got
    return time.monotonic() - start, got


# --- a guarded server in a thread ---------------------------------------------------------------
class GuardedServer:
    """``build_server`` over ``build_app`` in a daemon thread, on a free loopback port."""

    def __init__(self, model_dir: Path, **limits):
        from attnserve.engine.async_engine import AsyncLLMEngine
        from attnserve.entrypoints.openai.api_server import build_app
        from attnserve.entrypoints.openai.connections import ConnectionLimits, build_server

        self.engine = AsyncLLMEngine.from_kwargs(str(model_dir), **ENGINE_KWARGS)
        self.app = build_app(self.engine, MODEL_NAME)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = build_server(self.app, ConnectionLimits(**limits), log_level="warning", access_log=False,
                                   drain=self.app.state.drain)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def guarded(model_dir):
    srv = GuardedServer(model_dir, **LIMITS)
    yield srv
    srv.stop()


def test_head_health_answers_like_get(guarded, model_dir):
    from attnserve.engine.async_engine import AsyncLLMEngine
    from attnserve.entrypoints.openai.api_server import build_app

    for path in ("/health", "/ping"):
        resp = httpx.head(guarded.url + path)
        assert (resp.status_code, resp.content) == (200, b"")
    engine = AsyncLLMEngine.from_kwargs(str(model_dir), **ENGINE_KWARGS)
    engine.shutdown()
    stopped = build_app(engine, MODEL_NAME)

    async def probe() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=stopped), base_url="http://t") as c:
            return [(await c.request(m, "/health")).status_code for m in ("HEAD", "GET")]

    assert asyncio.run(probe()) == [503, 503]


def test_idle_and_slow_header_connections_close_after_the_header_timeout(guarded):
    silent = _connect(guarded.port)
    slow = _connect(guarded.port)
    slow.sendall(b"GET /health HTTP/1.1\r\n")

    def dribble() -> None:  # a header line every 0.2 s: the head never completes
        for i in range(25):
            time.sleep(0.2)
            try:
                slow.sendall(b"x-%d: y\r\n" % i)
            except OSError:
                return

    threading.Thread(target=dribble, daemon=True).start()
    waited, got = _closed_after(silent)
    assert 0.8 < waited < 4 and got == b"", waited
    waited, got = _closed_after(slow)
    assert waited < 4 and got == b"", waited
    # the first bytes of a request on a kept-alive connection start the same clock
    kept = _connect(guarded.port)
    kept.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")
    time.sleep(0.3)
    assert kept.recv(4096).startswith(b"HTTP/1.1 200")
    kept.sendall(b"GET /health HTTP/1.1\r\n")
    waited, got = _closed_after(kept)
    assert waited < 4 and got == b"", waited


def test_a_slow_body_gets_a_408_and_the_connection_closes(guarded):
    sock = _connect(guarded.port)
    body = json.dumps({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % len(body) + body[:10])
    waited, got = _closed_after(sock)
    head, _, payload = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), got
    assert 1.2 < waited < 5, waited
    err = json.loads(payload)["error"]
    assert err["code"] == "request_timeout" and "--body-timeout" in err["message"], err
    # a body that arrives in time is served as usual
    resp = httpx.post(guarded.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text


def test_a_kept_alive_connection_closes_after_the_keep_alive_timeout(guarded):
    sock = _connect(guarded.port)
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")
    waited, got = _closed_after(sock)
    assert got.startswith(b"HTTP/1.1 200") and 0.8 < waited < 4, (waited, got)


def test_idle_connections_give_way_at_the_cap_busy_ones_keep_it(guarded):
    cap = LIMITS["max_connections"]
    idle = [_connect(guarded.port) for _ in range(3 * cap)]
    time.sleep(0.2)  # all accepted: the oldest were closed to admit the newest
    start = time.monotonic()
    assert httpx.get(guarded.url + "/health", timeout=5).status_code == 200
    assert time.monotonic() - start < 1.0
    closed = [s for s in idle if _closed_after(s, timeout=0.05)[0] < float("inf")]
    assert len(closed) >= 2 * cap, len(closed)  # the oldest ones went
    for s in idle:
        s.close()
    time.sleep(0.1)
    # every connection busy (its request's head in, its body still coming): a new one is refused
    busy = []
    for _ in range(cap):
        s = _connect(guarded.port)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\n{")
        busy.append(s)
    time.sleep(0.2)
    waited, got = _closed_after(_connect(guarded.port), timeout=1.0)
    assert waited < 1.0 and got == b"", waited  # closed at once, no 408
    for s in busy:  # each still open: it gets its own 408 at the body timeout
        waited, got = _closed_after(s)
        assert got.startswith(b"HTTP/1.1 408"), got
    assert httpx.get(guarded.url + "/health", timeout=5).status_code == 200


# --- flags, budget, log -------------------------------------------------------------------------
def test_bad_flags_are_refused_with_the_flag_named(capsys):
    from attnserve.entrypoints.cli import main
    from attnserve.entrypoints.openai.connections import ConnectionLimits

    for flag, value in (("--max-connections", "0"), ("--header-timeout", "-1"), ("--body-timeout", "nan"),
                        ("--timeout-keep-alive", "0"), ("--shutdown-timeout", "-0.5"),
                        ("--shutdown-timeout", "inf")):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", flag, value])
        assert exit_.value.code == 2
        assert f"error: argument {flag}: must be" in capsys.readouterr().err.strip().splitlines()[-1]
    # the same limits given in code name the flag too
    for field, value, flag in (("max_connections", 0, "--max-connections"), ("header_timeout", -1.0, "--header-timeout"),
                               ("body_timeout", math.nan, "--body-timeout"), ("keep_alive_timeout", 0, "--timeout-keep-alive"),
                               ("shutdown_timeout", math.inf, "--shutdown-timeout")):
        with pytest.raises(ValueError, match=f"^{flag} must be"):
            ConnectionLimits(**{field: value})
    assert ConnectionLimits(shutdown_timeout=0).shutdown_timeout == 0  # 0: end running requests at once


def test_the_connection_budget_fits_the_open_file_limit():
    from attnserve.entrypoints.openai.connections import fd_budget

    for soft in (256, 512, 1024, 65536, 1 << 20):
        room, backlog = fd_budget(soft)
        assert 0 < room and 16 <= backlog <= 1024 and room + 3 * backlog + 64 <= soft, soft
    assert fd_budget(1024) == (768, 64)


def test_repeated_loop_errors_are_logged_at_a_bounded_rate(caplog, monkeypatch):
    """The accept loop's "Too many open files" goes through asyncio's exception handler: one
    record, then a count of those left out."""
    from attnserve.entrypoints.openai import connections

    asyncio_log = logging.getLogger("asyncio")
    monkeypatch.setattr(asyncio_log, "filters", [])  # not the thread server's limiter: only this one
    loop = asyncio.new_event_loop()
    context = {"message": "socket.accept() out of system resource",
               "exception": OSError(24, "Too many open files")}
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"), connections._rate_limited_logs("asyncio"):
            for _ in range(1000):
                loop.call_exception_handler(context)
            assert len(caplog.records) == 1
            (limiter,) = asyncio_log.filters
            for seen in limiter.kinds.values():
                seen[0] -= connections._LOG_EVERY_S  # the window passes
            loop.call_exception_handler(context)
    finally:
        loop.close()
    assert len(caplog.records) == 2 and "999 more like this" in caplog.records[1].getMessage()
    assert not asyncio_log.filters  # removed with the server


# --- a real server process ----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lower_fd_limit() -> None:  # in the server process, before it starts
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))


class ServeProcess:
    """``attnserve serve`` with at most 512 open files, on a model with room for 16k tokens."""

    def __init__(self, model_dir: Path, log: Path, *flags: str):
        self.port = _free_port()
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "attnserve", "serve", str(model_dir), "--port", str(self.port),
             "--served-model-name", MODEL_NAME, "--kv-cache-memory", "0.01", "--uvicorn-log-level", "warning",
             *flags],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, preexec_fn=_lower_fd_limit,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, log.read_text()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def long_model_dir(model_dir, tmp_path_factory) -> Path:
    """The tiny model with room for 16k positions: a request of 8k tokens outlasts any drain here."""
    out = tmp_path_factory.mktemp("tiny-long")
    for f in model_dir.iterdir():
        shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 16384}))
    return out


@pytest.fixture(scope="module")
def serve_process(long_model_dir, tmp_path_factory):
    """A running server process: the one the last test left, or a new one (a start costs seconds,
    so the tests below share one until the SIGTERM test stops it)."""
    procs: list[ServeProcess] = []

    def live() -> ServeProcess:
        if not procs or procs[-1].proc.poll() is not None:
            log = tmp_path_factory.mktemp("serve") / "serve.log"
            procs.append(ServeProcess(long_model_dir, log, "--shutdown-timeout", "1.5"))
        return procs[-1]

    yield live
    for srv in procs:
        srv.stop()


def test_thousands_of_idle_connections_leave_the_server_answering(serve_process):
    served = serve_process()
    count = 2000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 200:
        if hard != resource.RLIM_INFINITY and hard < count + 200:
            pytest.skip(f"this process may open only {hard} files")
        resource.setrlimit(resource.RLIMIT_NOFILE, (count + 200, hard))
    log_before = served.log.stat().st_size
    sockets = []
    try:
        for _ in range(count):  # each connects without waiting: the server's 512 files are the limit
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", served.port))
            sockets.append(s)
        time.sleep(1.0)
        worst = 0.0
        for _ in range(5):
            start = time.monotonic()
            assert httpx.get(served.url + "/health", timeout=5).status_code == 200
            worst = max(worst, time.monotonic() - start)
        assert worst < 1.0, f"/health took {worst:.2f} s under {count} idle connections"
    finally:
        for s in sockets:
            s.close()
        if soft < count + 200:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    time.sleep(0.2)
    grown = served.log.read_bytes()[log_before:].decode(errors="replace")
    assert "Too many open files" not in grown and "Traceback" not in grown, grown[:3000]
    assert len(grown) < 2000, grown[:3000]  # one report of the connection cap at most


def test_sigterm_drains_then_ends_running_requests_with_errors(serve_process):
    served = serve_process()
    body = {"model": MODEL_NAME, "prompt": "tell me a story", "max_tokens": 8000, "ignore_eos": True}
    whole: dict = {}

    def post_whole() -> None:
        try:
            whole["resp"] = httpx.post(served.url + "/v1/completions", json=body, timeout=60)
        except httpx.HTTPError as e:
            whole["resp"] = e

    waiter = threading.Thread(target=post_whole, daemon=True)
    waiter.start()
    events: list[tuple[float, str]] = []
    with httpx.stream("POST", served.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break  # generating
        time.sleep(0.3)  # the whole-response request is running too
        signalled = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        events = [(time.monotonic() - signalled, line[6:]) for line in lines if line.startswith("data: ")]
    waiter.join(30)
    rc = served.proc.wait(30)
    exited = time.monotonic() - signalled
    log = served.log.read_text()
    # the stream ran on through the drain, then ended with an error event and [DONE]
    assert events[-1][1] == "[DONE]", events[-3:]
    err = json.loads(events[-2][1])["error"]
    assert err["code"] == "server_shutting_down" and err["type"] == "server_error", err
    during = [t for t, data in events[:-2] if t < 1.4]
    assert len(during) > 5, f"{len(during)} chunks during the drain"
    assert 1.4 < events[-2][0] < 5, events[-2][0]
    # the whole-response request: an OpenAI-shaped JSON 503
    resp = whole["resp"]
    assert isinstance(resp, httpx.Response) and resp.status_code == 503, resp
    assert resp.json()["error"]["code"] == "server_shutting_down", resp.text
    # the process exits soon after, with no traceback per request
    assert exited < 1.5 + 8, exited
    assert rc in (0, -signal.SIGTERM), (rc, log[-3000:])
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    assert "ending 2 running request(s) with an error" in log, log[-3000:]
    with pytest.raises(httpx.TransportError):  # nothing listens any more
        httpx.get(served.url + "/health", timeout=1)
