"""AsyncLLMEngine: the ``LLMEngine`` on a background thread, for asyncio servers.

One thread owns the engine and is the only one that touches it. Callers reach it through a
thread-safe queue of commands (``commands.py``: add, abort, call, stop) and get each request's
outputs back on an ``asyncio.Queue`` of their own event loop. When nothing is running the
thread sleeps on the queue; while requests run it drains the queue between steps, so new
requests join the running batch as they arrive and aborts free their blocks before the next step.

Outputs are cumulative (each ``RequestOutput`` holds everything so far), so a consumer that
falls behind gets only the latest one: nothing is lost, the stream just gets coarser.

The same loop runs inside an engine process (``engine_process.py``), where its two hooks,
``_step`` (a step and its outputs: there deltas) and ``_publish_stats`` (after every step and
every batch of commands), send to the frontend instead of to event loops.

Not here: what the server sees of an engine (``engine_client.py``), HTTP, wire formats,
tokenising chat messages, metrics text (``entrypoints/openai``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from attnserve.engine.commands import AbortRequest, AddRequest, Command, EngineCall, Stop
from attnserve.engine.engine import LLMEngine
from attnserve.engine.engine_client import (
    END,
    EngineDeadError,
    EngineFacts,
    EngineStats,
    OutputSink,
    put_all,
    stream_outputs,
)
from attnserve.engine.warm_up import warm_up as warm_up_engine
from attnserve.outputs import RequestOutput
from attnserve.sampling_params import SamplingParams

__all__ = ["AsyncLLMEngine", "EngineDeadError", "EngineStats", "ThroughputLogger"]

logger = logging.getLogger(__name__)


class ThroughputLogger:
    """The periodic throughput line of a serving engine (as vLLM logs it): prompt and generation
    tokens per second over the last interval, running and waiting requests, KV cache usage,
    prefix-cache hit rate. A line is due every ``interval`` seconds while there is work, and once
    more after it stops (the quiet interval); none while idle."""

    def __init__(self, interval: float):
        if not interval > 0:
            raise ValueError(f"the throughput log interval must be positive seconds, got {interval}")
        self.interval = interval
        self.last = EngineStats()
        self.last_time: float | None = None
        self.reported_busy = False  # the last line covered an interval with work

    def _busy(self, stats: EngineStats) -> bool:
        return bool(stats.num_running or stats.num_waiting or stats.num_steps != self.last.num_steps)

    def rebase(self, stats: EngineStats, now: float) -> None:
        """Start the interval at ``now`` (after idling: the idle time is no part of a rate)."""
        self.last, self.last_time = stats, now

    def next_due(self, stats: EngineStats) -> float | None:
        """When the next line is due (a ``time.monotonic`` time); None: nothing to report."""
        if self.last_time is None or not (self.reported_busy or self._busy(stats)):
            return None
        return self.last_time + self.interval

    def observe(self, stats: EngineStats, now: float) -> str | None:
        """The line to log at ``now``, if one is due."""
        if self.last_time is None:
            self.rebase(stats, now)
            return None
        elapsed = now - self.last_time
        if elapsed < self.interval:
            return None
        busy, last = self._busy(stats), self.last
        line = None
        if busy or self.reported_busy:
            queries = stats.prefix_cache_queries - last.prefix_cache_queries
            hits = stats.prefix_cache_hits - last.prefix_cache_hits
            line = (f"prompt throughput {(stats.prompt_tokens - last.prompt_tokens) / elapsed:.1f} tokens/s, "
                    f"generation throughput {(stats.generation_tokens - last.generation_tokens) / elapsed:.1f} "
                    f"tokens/s, requests running {stats.num_running}, waiting {stats.num_waiting}, "
                    f"KV cache usage {stats.kv_cache_usage:.1%}, prefix cache hit rate "
                    f"{hits / queries if queries else 0.0:.1%}")
            steps = stats.num_steps - last.num_steps
            if steps:
                line += f", {steps} steps of {(stats.step_seconds - last.step_seconds) / steps * 1e3:.2f} ms"
                waited = stats.device_wait_seconds - last.device_wait_seconds
                if waited > 0:  # CUDA: the share of the steps' time the host waited for the device
                    line += f" ({waited / max(stats.step_seconds - last.step_seconds, 1e-9):.0%} waiting on the device)"
            if stats.num_preemptions != last.num_preemptions:
                line += f", {stats.num_preemptions - last.num_preemptions} preemptions"
        self.rebase(stats, now)
        self.reported_busy = busy
        return line


def cuda_index(device: torch.device) -> int | None:
    """The CUDA device a thread must make current to run on ``device`` (None: not CUDA). A bare
    ``cuda`` (no index, which ``torch.cuda.set_device`` refuses) means the device current on the
    calling thread, so call this where the engine was built."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


_STALL_POLL_S = 0.005  # how long the thread waits for commands when no request can run


class AsyncLLMEngine:
    """An ``LLMEngine`` served by its own thread; ``generate`` is an async iterator of outputs."""

    def __init__(self, engine: LLMEngine, start: bool = True, log_stats_interval: float | None = None):
        """``log_stats_interval``: log a throughput line every that many seconds while serving
        (``ThroughputLogger``); None: none."""
        self._engine = engine
        self._cuda_index = cuda_index(engine.parts.device)  # resolved here, on the building thread
        # read-only facts about the model, safe to read from any thread
        facts = EngineFacts.of(engine)
        self.tokenizer = engine.tokenizer
        self.structured = engine.structured  # compile() is thread-safe (the server compiles ahead)
        self.model, self.max_model_len, self.vocab_size = facts.model, facts.max_model_len, facts.vocab_size
        self.max_logprobs, self.cache_info = facts.max_logprobs, facts.cache_info
        self.generation_config = facts.generation_config  # the model's sampling defaults
        self._throughput = ThroughputLogger(log_stats_interval) if log_stats_interval is not None else None
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._stats = EngineStats()
        self._num_aborted = 0
        self._error: BaseException | None = None
        self._dead = False  # set, under the lock, once the thread takes no more commands
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    @classmethod
    def from_kwargs(cls, model: str | None = None, log_stats_interval: float | None = None,
                    **kwargs: Any) -> AsyncLLMEngine:
        """Build the engine from ``LLM(...)``-style keywords and start its thread; its batch
        limits default to the server's (``usage_context="server"``)."""
        from attnserve.config import EngineConfig
        from attnserve.presets import DEFAULT_MODEL

        kwargs.setdefault("usage_context", "server")
        return cls(LLMEngine(EngineConfig.from_kwargs(model or DEFAULT_MODEL, **kwargs)),
                   log_stats_interval=log_stats_interval)

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="attnserve-engine", daemon=True)
        self._thread.start()

    def warm_up(self) -> None:
        """Run the warm-up (``warm_up.py``: every step shape and sampling path once, no trace
        left) on the engine thread, started if it is not, and wait for it: a server's start-up
        does this before it answers ``/health``."""
        self.start()
        self.call(warm_up_engine).result()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still running end with ``EngineDeadError``."""
        if self._thread is None:
            return
        self._commands.put(Stop())
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and not self._dead

    @property
    def error(self) -> BaseException | None:
        """What killed the engine thread, if something did."""
        return self._error

    def _submit(self, cmd: Command) -> None:
        with self._lock:
            if not self.is_alive:
                raise EngineDeadError("the engine is not running")
            self._commands.put(cmd)

    def stats(self) -> EngineStats:
        return self._stats

    # --- requests --------------------------------------------------------------------------
    def generate(
        self, request_id: str, prompt: str | list[int] | dict[str, Any], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its cumulative outputs until it finishes.

        Args:
            request_id: unique among running requests.
            prompt: as ``LLMEngine.add_request`` takes it.
            params: sampling parameters.

        Returns:
            An async iterator of ``RequestOutput``; the last one has ``finished`` set. If the
            consumer stops early (closes the iterator, is cancelled), the request is aborted
            and its blocks freed. Engine-side errors (a bad prompt) are raised from it.
        """
        return stream_outputs(lambda sink: self._submit(AddRequest(request_id, prompt, params, sink)),
                              lambda: self.abort(request_id))

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (from any thread); unknown ids are ignored."""
        self._commands.put(AbortRequest(request_id))

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread, between steps (for checks and tests)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._submit(EngineCall(fn, future))
        except EngineDeadError as e:
            future.set_exception(e)
        return future

    # --- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        sinks: dict[str, OutputSink] = {}
        engine = self._engine
        try:
            if self._cuda_index is not None:  # the current CUDA device is per thread (Triton uses it)
                torch.cuda.set_device(self._cuda_index)
            stalled = False
            throughput = self._throughput
            if throughput is not None:
                throughput.rebase(self._stats, time.monotonic())
            while True:
                # idle: sleep until a command comes (or the throughput line is due); stalled
                # (nothing could be scheduled, e.g. the cache is full of waiting work): poll;
                # otherwise: only take what is queued
                busy = engine.has_unfinished_requests()
                timeout = None if not busy else (_STALL_POLL_S if stalled else 0.0)
                due = throughput.next_due(self._stats) if throughput is not None else None
                if timeout is None and due is not None:
                    timeout = max(due - time.monotonic(), 0.0)
                if not self._handle_commands(sinks, timeout):
                    break
                if timeout is None and throughput is not None:  # woken from idling
                    throughput.rebase(self._stats, time.monotonic())
                if engine.has_unfinished_requests():
                    stalled = not self._step(sinks) and not engine.scheduler.running
                    self._publish_stats()
                if throughput is not None and (line := throughput.observe(self._stats, time.monotonic())):
                    logger.info("%s", line)
            error: BaseException = EngineDeadError("the engine was shut down")
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine, loudly
            logger.exception("engine thread failed")
            self._error = e
            error = EngineDeadError(f"the engine failed: {e!r}")
        with self._lock:
            self._dead = True
        for sink in sinks.values():
            sink.put(error)
        self._fail_pending(error)
        engine.close()  # tensor-parallel workers stop with the engine thread that drove them

    def _handle_commands(self, sinks: dict[str, OutputSink], timeout: float | None) -> bool:
        """Apply every queued command, first waiting up to ``timeout`` seconds (None: for ever)
        for one; False on stop."""
        try:
            cmd = (
                self._commands.get(timeout=timeout) if timeout != 0 else self._commands.get_nowait()
            )
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, Stop):
                return False
            self._apply(cmd, sinks)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                self._publish_stats()
                return True

    def _step(self, sinks: dict[str, OutputSink]) -> bool:
        """Run one engine step and hand its outputs to their requests' sinks (a hook: an engine
        process sends deltas instead); False if the step had no output."""
        outputs = self._engine.step()
        batch = []
        for out in outputs:
            sink = sinks.pop(out.request_id) if out.finished else sinks.get(out.request_id)
            if sink is not None:
                batch.append((sink, out))
        put_all(batch)
        return bool(outputs)

    def _apply(self, cmd: Command, sinks: dict[str, OutputSink]) -> None:
        engine = self._engine
        if isinstance(cmd, AddRequest):
            try:
                engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
            except (ValueError, TypeError) as e:  # PromptError, a duplicate id: the request's fault
                cmd.reply.put(e)
                return
            sinks[cmd.request_id] = cmd.reply
        elif isinstance(cmd, AbortRequest):
            sink = sinks.pop(cmd.request_id, None)
            if sink is not None:
                engine.abort_request(cmd.request_id)
                self._num_aborted += 1
                sink.put(END)
        elif isinstance(cmd, EngineCall):
            if cmd.reply.set_running_or_notify_cancel():
                try:
                    cmd.reply.set_result(cmd.fn(engine))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    cmd.reply.set_exception(e)

    def _publish_stats(self) -> None:
        engine = self._engine
        sched = engine.scheduler
        offload = sched.offload.stats if sched.offload is not None else None
        self._stats = EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            kv_cache_usage=engine.kv_manager.usage,
            prefix_cache_queries=sched.stats.prompt_tokens,
            prefix_cache_hits=sched.stats.prefix_hit_tokens,
            offload_hits=sched.stats.offload_hit_tokens,
            offload_bytes_stored=offload.bytes_stored if offload else 0,
            offload_bytes_loaded=offload.bytes_loaded if offload else 0,
            offload_seconds=(offload.store_seconds + offload.load_seconds) if offload else 0.0,
            offload_failed_stores=offload.failed_stores if offload else 0,
            num_preemptions=sched.stats.num_preemptions,
            num_steps=sched.stats.steps,
            num_aborted=self._num_aborted,
            prompt_tokens=engine.num_prompt_tokens,
            generation_tokens=engine.num_generation_tokens,
            step_seconds=engine.step_seconds,
            device_wait_seconds=engine.runner.device_wait_seconds,
            iteration_tokens=tuple(engine.iteration_token_counts),
        )

    def _fail_pending(self, error: BaseException) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, AddRequest):
                cmd.reply.put(error)
            elif isinstance(cmd, EngineCall) and cmd.reply.set_running_or_notify_cancel():
                cmd.reply.set_exception(error)
