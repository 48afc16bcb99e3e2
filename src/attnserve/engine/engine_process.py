"""The engine in a process of its own, behind a frontend client: ``EngineProcessClient``.

A server's HTTP work (FastAPI, JSON, server-sent events) and the engine's host work (schedule,
prepare inputs, sample, detokenise, stop strings) do not both fit on one core under one GIL at a
GPU's token rate, so ``attnserve serve`` runs the engine in a child process (as vLLM's
EngineCore) and keeps only HTTP in the server's process.

The child (``multiprocessing`` "spawn": CUDA cannot be forked) builds ``LLMEngine(config)`` and
sends ``EngineFacts`` once ready, or its start-up error (raised by the frontend, same type and
message). Then its main thread runs ``AsyncLLMEngine``'s own loop (``_EngineLoop``: drain
commands, step while there is work); a reader thread queues the frontend's commands for that
loop (``commands.py``, the loop's own; an add's or a call's reply, the frontend's number for it,
bound to the outbox first), and a sender thread pickles and sends what the loop hands it: one
``StepMessage`` per step (errors; call results; the step's ``EngineStats``; the step's
outputs as deltas, ``output_deltas.py``, which the engine makes from its request state on the
loop's thread, ``LLMEngine.step(deltas=True)``: no cumulative output is built in the child). The
loop never waits for the frontend: while the sender is blocked on a full pipe, steps pile up in
its outbox and go as one message, each request's deltas merged into one. The child ignores SIGINT (the frontend stops it),
and stops when the command pipe closes (the frontend died).

The frontend's reader thread rebuilds each request's cumulative ``RequestOutput`` from its
deltas and hands a message's outputs to their event loops with one wake-up per loop
(``engine_client.put_all``). If the child dies, every request ends with ``EngineDeadError``.
The frontend loads its own tokenizer (chat templates, ``/tokenize``) from the directory the
engine loaded it from, and its own ``StructuredOutputManager`` (compiles constraints to check
them early); it never initialises CUDA.

Not here: the step loop itself (``async_engine.py``), the commands (``commands.py``), what the
server sees (``engine_client.py``).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from attnserve import env
from attnserve.config import EngineConfig
from attnserve.engine.async_engine import AsyncLLMEngine
from attnserve.engine.commands import AbortRequest, AddRequest, Command, EngineCall, Stop
from attnserve.engine.engine_client import (
    END,
    EngineDeadError,
    EngineFacts,
    EngineStats,
    OutputSink,
    put_all,
    stream_outputs,
)
from attnserve.engine.output_deltas import OutputAssembler, RequestDelta, merge_deltas
from attnserve.engine.structured_output import StructuredOutputManager
from attnserve.engine.warm_up import warm_up
from attnserve.logger import AttnserveHandler, capture_warnings
from attnserve.outputs import RequestOutput
from attnserve.sampling_params import SamplingParams
from attnserve.tokenizer import load_tokenizer

__all__ = ["EngineProcessClient", "Outbox", "StepMessage"]

logger = logging.getLogger(__name__)


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(_dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(exc).__name__}: {exc}")


# --- messages: engine process -> frontend --------------------------------------------------------
# (the frontend sends commands.py's commands; an add's reply is the frontend's number for the
# request, its key, as ids may be reused once one is aborted; a call's reply is the call's id)
@dataclass(slots=True)
class _Ready:
    facts: EngineFacts


@dataclass(slots=True)
class _StartupFailed:
    error: BaseException
    traceback: str


@dataclass(slots=True)
class StepMessage:
    """One message to the frontend: the deltas since the last one (merged per request), events, stats."""

    deltas: list[RequestDelta]
    errors: list[tuple[int, BaseException]] = field(default_factory=list)  # (key, why it ended)
    results: list[tuple[int, bool, Any]] = field(default_factory=list)  # (call id, ok, value or error)
    stats: EngineStats | None = None
    dead: str | None = None  # the loop stopped: why (the EngineDeadError's message)
    error: BaseException | None = None  # ... what failed it (None: a shutdown)


# --- the engine process ------------------------------------------------------------------------------
class _RemoteSink:
    """Stands in the loop for a request whose consumer is in the frontend."""

    loop = None

    def __init__(self, key: int, outbox: Outbox):
        self.key, self.outbox = key, outbox

    def put(self, item: Any) -> None:
        if item is END:  # aborted: the frontend ended the stream itself
            self.outbox.add_event(("forget", self.key))
        else:
            self.outbox.add_event(("error", self.key, _portable(item)))


class Outbox:
    """What the loop hands the sender thread: each request's deltas since the last message,
    merged into one (``merge_deltas``), and the events (a request refused or aborted, a call's
    result) in order. While the frontend is behind, the deltas of later steps merge into the
    waiting ones, so memory stays bounded by the running requests' outputs however long it
    stalls. ``flush`` (once per step, and after each batch of commands) wakes the sender. The
    loop never blocks here."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._deltas: dict[int, RequestDelta] = {}  # key -> what it has not sent yet
        self._events: list[tuple] = []  # ("forget", key) | ("error", key, exc) | ("result", id, ok, value)
        self._stats: EngineStats | None = None
        self._sent_stats: EngineStats | None = None
        self._ready = False
        self._dead: tuple[str, BaseException | None] | None = None
        self.seconds = {"pickle": 0.0, "send": 0.0}  # the sender thread's, per phase

    def add_deltas(self, deltas: list[RequestDelta]) -> None:
        with self._cond:
            waiting = self._deltas
            for delta in deltas:
                key = delta[0]
                old = waiting.get(key)
                waiting[key] = delta if old is None else merge_deltas(old, delta)

    def add_event(self, event: tuple) -> None:
        with self._cond:
            if event[0] != "result":  # the request ended: its deltas still waiting are moot
                self._deltas.pop(event[1], None)
            self._events.append(event)

    def flush(self, stats: EngineStats) -> None:
        with self._cond:
            if self._deltas or self._events or stats != self._sent_stats:
                self._stats = self._sent_stats = stats
                self._ready = True
                self._cond.notify()

    def close(self, message: str, error: BaseException | None) -> None:
        with self._cond:
            self._dead = (message, error)
            self._ready = True
            self._cond.notify()

    def take(self) -> StepMessage:
        """What is waiting, as one message (the sender thread's, once woken)."""
        with self._cond:
            while not self._ready:
                self._cond.wait()
            deltas, events, stats, dead = self._deltas, self._events, self._stats, self._dead
            self._deltas, self._events, self._stats, self._ready = {}, [], None, False
        msg = StepMessage(list(deltas.values()), stats=stats)
        for event in events:
            if event[0] == "result":
                msg.results.append(event[1:])
            elif event[0] == "error":  # refused, or the loop stopped ("forget": aborted, sends nothing)
                msg.errors.append((event[1], event[2]))
        if dead is not None:
            msg.dead, msg.error = dead
        return msg

    def send_loop(self, conn: Any) -> None:
        """The sender thread: one message per wake-up, until the loop's last one."""
        while True:
            msg = self.take()
            t0 = time.perf_counter()
            try:
                data = _dumps(msg)
            except Exception:  # a bug: die loudly (the frontend sees EOF) rather than leave it waiting
                logger.exception("the engine process cannot send its outputs")
                os._exit(1)
            t1 = time.perf_counter()
            try:
                conn.send_bytes(data)
            except OSError:  # the frontend is gone; the reader thread stops the loop
                return
            self.seconds["pickle"] += t1 - t0
            self.seconds["send"] += time.perf_counter() - t1
            if msg.dead is not None:
                return


class _EngineLoop(AsyncLLMEngine):
    """``AsyncLLMEngine``'s loop with its two hooks sending to the outbox."""

    def __init__(self, engine: Any, log_stats_interval: float | None, outbox: Outbox):
        super().__init__(engine, start=False, log_stats_interval=log_stats_interval)
        self.outbox = outbox

    def _step(self, sinks: dict[str, _RemoteSink]) -> bool:
        """The engine's step in its deltas mode: no cumulative output is built here."""
        deltas = self._engine.step(deltas=True)
        keyed = []
        for delta in deltas:
            rid = delta[0]
            sink = sinks.pop(rid) if delta[4] else sinks.get(rid)
            if sink is not None:  # keyed by the frontend's number for the request
                keyed.append((sink.key, *delta[1:]))
        self.outbox.add_deltas(keyed)
        return bool(deltas)

    def _publish_stats(self) -> None:
        super()._publish_stats()
        self.outbox.flush(self._stats)

    def read_commands(self, conn: Any) -> None:
        """The reader thread: the frontend's commands into the loop's queue; a closed pipe (the
        frontend died) stops the loop."""
        while True:
            try:
                cmd: Command = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                cmd = Stop()
            if isinstance(cmd, AddRequest):  # reply: the frontend's key for the request
                self._compile(cmd.params)
                self._commands.put(AddRequest(cmd.request_id, cmd.prompt, cmd.params, _RemoteSink(cmd.reply, self.outbox)))
            elif isinstance(cmd, AbortRequest):
                self._commands.put(cmd)
            elif isinstance(cmd, EngineCall):  # reply: the frontend's id for the call
                future: concurrent.futures.Future = concurrent.futures.Future()
                future.add_done_callback(lambda f, cid=cmd.reply: self.outbox.add_event(("result", cid, *_outcome(f))))
                self._commands.put(EngineCall(cmd.fn, future))
            else:
                self._commands.put(Stop())
                return


    def _compile(self, params: Any) -> None:
        """Compile a request's constraint here, off the loop (the frontend compiled it too, in
        its own process): the loop's own compile is then a cache hit, as in one process."""
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            try:
                self._engine.structured.compile(params.structured_outputs)
            except Exception:  # noqa: BLE001 - the loop refuses the request, with the reason
                pass


def _outcome(future: concurrent.futures.Future) -> tuple[bool, Any]:
    if future.exception() is not None:
        return False, _portable(future.exception())
    try:
        value = future.result()
        _dumps(value)
        return True, value
    except Exception as e:  # noqa: BLE001 - an unpicklable result
        return False, _portable(e)


@dataclass(frozen=True, slots=True)
class _LogSetup:
    """The frontend's ``attnserve`` logger, for the engine process to log as it does (its import
    configured the logger from the same environment, but the frontend may have changed it since)."""

    level: int
    propagate: bool
    handler: bool  # attnserve's own stderr handler (logger.py) is on
    formats: list[tuple[str | None, str | None]]  # other stderr handlers' (format, date format)
    warnings: bool  # Python's warnings go through logging (logger.capture_warnings)


def _configure_logging(setup: _LogSetup) -> None:
    """Log as the frontend does: attnserve's level, handlers and propagation, and its warnings."""
    log = logging.getLogger("attnserve")
    log.handlers[:] = [h for h in log.handlers if not isinstance(h, AttnserveHandler)]
    if setup.handler:
        log.addHandler(AttnserveHandler())
    log.setLevel(setup.level)
    log.propagate = setup.propagate
    for fmt, datefmt in setup.formats:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(fmt, datefmt))
        log.addHandler(handler)
    if setup.warnings:
        capture_warnings()


def _logging_setup() -> _LogSetup:
    log = logging.getLogger("attnserve")
    formats = [(h.formatter._fmt if h.formatter else None, h.formatter.datefmt if h.formatter else None)
               for h in log.handlers if isinstance(h, logging.StreamHandler) and h.stream is sys.stderr
               and not isinstance(h, AttnserveHandler)]
    ours = any(isinstance(h, AttnserveHandler) for h in log.handlers)
    warnings = any(isinstance(h, AttnserveHandler) for h in logging.getLogger("py.warnings").handlers)
    return _LogSetup(log.getEffectiveLevel(), log.propagate, ours, formats, warnings)


def run_engine_process(config: EngineConfig, log_stats_interval: float | None, log_setup: _LogSetup,
                       commands: Any, outputs: Any) -> None:
    """The engine process's main: build, report ready (or why not), serve until stopped."""
    from attnserve.engine.engine import LLMEngine

    # Ctrl-C and a SIGTERM sent to the whole process group (systemd's default) reach the frontend,
    # which drains its requests and then stops us (a stuck engine still gets terminate, then kill)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _configure_logging(log_setup)
    try:
        engine = LLMEngine(config)
        engine.structured.warm_up()  # as a server does before its first request (xgrammar's import)
    except BaseException as e:  # noqa: BLE001 - any start-up failure goes to the frontend
        outputs.send_bytes(_dumps(_StartupFailed(_portable(e), traceback.format_exc())))
        return
    outbox = Outbox()
    loop = _EngineLoop(engine, log_stats_interval, outbox)
    outputs.send_bytes(_dumps(_Ready(EngineFacts.of(engine))))
    sender = threading.Thread(target=outbox.send_loop, args=(outputs,), name="attnserve-engine-sender",
                              daemon=True)
    sender.start()
    threading.Thread(target=loop.read_commands, args=(commands,), name="attnserve-engine-reader",
                     daemon=True).start()
    profile_path = env.engine_profile()
    if profile_path is None:
        loop._run()  # returns once stopped or failed; the requests it held got EngineDeadError
    else:
        import cProfile

        profiler = cProfile.Profile()
        profiler.runcall(loop._run)
        try:  # a debug switch: a bad path costs the profile, not the engine's last message
            profiler.dump_stats(profile_path)
            logger.info("engine process: loop profile in %s; sender thread seconds %s", profile_path,
                        {k: round(v, 3) for k, v in outbox.seconds.items()})
        except OSError as e:
            logger.error("engine process: cannot write the loop profile to %s: %s", profile_path, e)
    error = loop.error
    outbox.close(f"the engine failed: {error!r}" if error is not None else "the engine was shut down",
                 _portable(error) if error is not None else None)
    sender.join(10)


# --- the frontend --------------------------------------------------------------------------------
@dataclass(slots=True)
class _Stream:
    sink: OutputSink
    assembler: OutputAssembler
    request_id: str


class EngineProcessClient:
    """An ``EngineClient`` whose engine runs in a child process (see the module docstring).

    ``call(fn)`` runs ``fn(engine)`` in the child between steps, for checks and tests: ``fn``
    must be picklable (a module-level function) and so must its result."""

    def __init__(self, config: EngineConfig, log_stats_interval: float | None = None):
        """Start the engine process and wait until it is ready (model loaded, cache sized).

        Raises:
            What the engine's start-up raised (same type and message), or RuntimeError if the
            process died without saying why.
        """
        ctx = multiprocessing.get_context("spawn")
        commands_child, self._commands = ctx.Pipe(duplex=False)
        self._outputs, outputs_child = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=run_engine_process, name="attnserve-engine",
                                    args=(config, log_stats_interval, _logging_setup(), commands_child, outputs_child))
        self._process.start()
        commands_child.close()  # the child's ends: a dead child then reads as EOF here
        outputs_child.close()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._reap_lock = threading.Lock()  # one thread at a time waits on the child (waitpid)
        self._streams: dict[int, _Stream] = {}
        self._keys: dict[str, int] = {}  # request id -> key of the live request with it
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._stats = EngineStats()
        self._dead = False
        self._error: BaseException | None = None
        atexit.register(self.shutdown)
        try:
            facts = self._wait_ready()
            self.tokenizer = load_tokenizer(facts.tokenizer_dir)
            self.structured = StructuredOutputManager(self.tokenizer, facts.vocab_size, facts.stop_token_ids)
        except BaseException:
            self.shutdown(timeout=1.0)
            raise
        self.model, self.max_model_len, self.vocab_size = facts.model, facts.max_model_len, facts.vocab_size
        self.max_logprobs, self.cache_info = facts.max_logprobs, facts.cache_info
        self.generation_config = facts.generation_config
        self._reader = threading.Thread(target=self._read, name="attnserve-engine-client", daemon=True)
        self._reader.start()

    @classmethod
    def from_kwargs(cls, model: str | None = None, log_stats_interval: float | None = None,
                    **kwargs: Any) -> EngineProcessClient:
        """As ``AsyncLLMEngine.from_kwargs``: the config is built (and checked) here, the engine
        in the child."""
        from attnserve.presets import DEFAULT_MODEL

        kwargs.setdefault("usage_context", "server")
        return cls(EngineConfig.from_kwargs(model or DEFAULT_MODEL, **kwargs), log_stats_interval)

    def _wait_ready(self) -> EngineFacts:
        while not self._outputs.poll(0.5):
            if (code := self._join(0)) is not None:
                raise RuntimeError(f"the engine process exited (code {code}) before it was ready")
        try:
            msg = pickle.loads(self._outputs.recv_bytes())
        except (EOFError, OSError):
            raise RuntimeError(f"the engine process exited (code {self._join(5)}) before it was ready") from None
        if isinstance(msg, _StartupFailed):
            logger.debug("the engine process failed to start:\n%s", msg.traceback)
            if hasattr(msg.error, "add_note"):
                msg.error.add_note(f"(in the engine process)\n{msg.traceback}")
            raise msg.error
        return msg.facts

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Nothing to do: the engine process serves from the moment it is ready."""

    def warm_up(self) -> None:
        """Run the warm-up (``warm_up.py``) in the engine process, stepping as its loop does, and
        this process's tokenizer once; wait for it. A server's start-up does this last before it
        answers ``/health``: a warm-up before the frontend's own start-up (xgrammar's import, the
        app) left the engine's caches cold again by the first request."""
        done = self.call(functools.partial(warm_up, deltas=True))
        if self.tokenizer is not None:
            self.tokenizer.decode(self.tokenizer.encode("Hello, this is a warm-up."))
        done.result()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (terminated after ``timeout`` seconds) and wait for it;
        requests still running end with ``EngineDeadError``. Idempotent."""
        atexit.unregister(self.shutdown)
        try:
            self._send(Stop())
        except (OSError, EngineDeadError):
            pass
        if self._join(timeout) is None:
            for stop in (self._process.terminate, self._process.kill):
                if self._join(0) is None:
                    logger.warning("the engine process did not stop: %s", stop.__name__)
                    stop()
                    self._join(5)
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(5)
        self._commands.close()
        if reader is None:
            self._outputs.close()
            self._fail_all(EngineDeadError("the engine was shut down"))

    def _join(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for the engine process; its exit code (None: alive)."""
        with self._reap_lock:
            self._process.join(timeout)
            return self._process.exitcode

    @property
    def is_alive(self) -> bool:
        # its outputs pipe reads as closed the moment it exits: the reader thread sets _dead
        return not self._dead

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine process, if it failed or died."""
        return self._error

    def stats(self) -> EngineStats:
        return self._stats

    # --- requests --------------------------------------------------------------------------
    def generate(self, request_id: str, prompt: str | list[int] | dict[str, Any],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """As ``AsyncLLMEngine.generate``: the request's cumulative outputs until it finishes."""
        key = next(self._ids)

        def submit(sink: OutputSink) -> None:
            with self._lock:
                if self._dead:
                    raise EngineDeadError("the engine is not running")
                if request_id in self._keys:  # as the engine says it
                    sink.put_nowait(ValueError(f"request id '{request_id}' is already in use"))
                    return
                self._send(AddRequest(request_id, prompt, params, key))
                self._streams[key] = _Stream(sink, OutputAssembler(request_id), request_id)
                self._keys[request_id] = key

        return stream_outputs(submit, lambda: self._abort(key))

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (from any thread); unknown ids are ignored."""
        key = self._keys.get(request_id)
        if key is not None:
            self._abort(key)

    def _abort(self, key: int) -> None:
        with self._lock:
            stream = self._streams.pop(key, None)
            if stream is None:
                return
            self._forget(key, stream)
            try:
                self._send(AbortRequest(stream.request_id))
            except (OSError, EngineDeadError):
                pass
        stream.sink.put(END)

    def _forget(self, key: int, stream: _Stream) -> None:
        if self._keys.get(stream.request_id) == key:
            del self._keys[stream.request_id]

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` in the engine process between steps; ``fn`` and its result must be
        picklable (a module-level function)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._dead:
                future.set_exception(EngineDeadError("the engine is not running"))
                return future
            call_id = next(self._ids)
            self._calls[call_id] = future
            try:
                self._send(EngineCall(fn, call_id))
            except Exception as e:  # noqa: BLE001 - not picklable, or the process is gone
                del self._calls[call_id]
                future.set_exception(e)
        return future

    def _send(self, cmd: Command) -> None:
        data = _dumps(cmd)
        with self._send_lock:
            try:
                self._commands.send_bytes(data)
            except OSError as e:
                raise EngineDeadError(f"the engine process is gone: {e!r}") from None

    # --- the reader thread ---------------------------------------------------------------------
    def _read(self) -> None:
        error = None
        while error is None:
            try:
                msg: StepMessage = pickle.loads(self._outputs.recv_bytes())
            except (EOFError, OSError):  # the process died without a word
                self._error = error = EngineDeadError(f"the engine process died (exit code {self._join(1)})")
                logger.error("%s", error)
                break
            self._handle(msg)
            if msg.dead is not None:
                error = EngineDeadError(msg.dead)
        self._outputs.close()
        self._fail_all(error)

    def _handle(self, msg: StepMessage) -> None:
        batch: list[tuple[OutputSink, Any]] = []
        results = []
        with self._lock:
            if msg.dead is not None:  # dead before a stream hears of it (is_alive, error)
                self._dead, self._error = True, msg.error
            streams = self._streams
            for delta in msg.deltas:
                stream = streams.get(delta[0])
                if stream is None:  # aborted here while the step ran
                    continue
                out = stream.assembler.apply(delta)
                if out.finished:
                    del streams[delta[0]]
                    self._forget(delta[0], stream)
                batch.append((stream.sink, out))
            for key, exc in msg.errors:
                stream = streams.pop(key, None)
                if stream is not None:
                    self._forget(key, stream)
                    batch.append((stream.sink, exc))
            results = [(self._calls.pop(cid, None), ok, value) for cid, ok, value in msg.results]
            if msg.stats is not None:
                self._stats = msg.stats
        put_all(batch)
        for future, ok, value in results:
            if future is not None and future.set_running_or_notify_cancel():
                future.set_result(value) if ok else future.set_exception(value)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            self._dead = True
            streams, self._streams, self._keys = self._streams, {}, {}
            calls, self._calls = self._calls, {}
        put_all([(s.sink, error) for s in streams.values()])
        for future in calls.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
