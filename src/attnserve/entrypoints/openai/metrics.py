"""Server metrics in the Prometheus text format (``GET /metrics``).

Request-level figures are measured where the client sees them, on the server's event loop:
``ServerMetrics.track`` wraps a request's output stream and records time to first token,
inter-token latency, end-to-end latency, prompt and generation tokens, and how the request
ended. Engine-level figures (running and waiting requests, KV cache usage, prefix-cache and
offload hits, preemptions) come from the engine thread's latest ``EngineStats`` snapshot.

Everything here runs on the event loop thread, so plain counters suffice. Not here: a general
metrics library (no registry, no labels beyond the few used below).
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import aclosing

from attnserve.engine.async_engine import EngineStats
from attnserve.outputs import RequestOutput

__all__ = ["CONTENT_TYPE", "Histogram", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_PREFIX = "attnserve_"
_LATENCY_BUCKETS = tuple(
    float(x)
    for x in "0.001 0.0025 0.005 0.01 0.025 0.05 0.075 0.1 0.25 0.5 0.75 1 2.5 5 7.5 "
    "10 20 40 80".split()
)


class Histogram:
    """Cumulative-bucket histogram as Prometheus exposes it."""

    def __init__(self, buckets: tuple[float, ...] = _LATENCY_BUCKETS):
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += n
        self.sum += value * n
        self.count += n

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        total = 0
        for le, c in zip((*map(repr, self.buckets), "+Inf"), self.counts):
            total += c
            lines.append(f'{name}_bucket{{le="{le}"}} {total}')
        lines += [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]
        return lines


class ServerMetrics:
    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = Counter()  # by finish reason
        self.unfinished = 0
        self.errors = Counter()  # by HTTP status
        self.ttft = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram()

    def record_error(self, status: int) -> None:
        self.errors[status] += 1

    async def track(
        self, stream: AsyncIterator[RequestOutput], arrival: float
    ) -> AsyncIterator[RequestOutput]:
        """Pass ``stream`` through, recording its timings; ``arrival`` is a perf_counter time."""
        seen, last, finished = 0, arrival, False
        try:
            async with aclosing(stream):
                async for out in stream:
                    now = time.perf_counter()
                    num = sum(len(c.token_ids) for c in out.outputs)
                    if num > seen:
                        if seen == 0:
                            self.ttft.observe(now - arrival)
                            self.prompt_tokens += len(out.prompt_token_ids)
                        else:  # a late consumer sees several tokens at once: share the gap
                            self.itl.observe((now - last) / (num - seen), num - seen)
                        self.generation_tokens += num - seen
                        seen, last = num, now
                    if out.finished:
                        finished = True
                        self.finished[out.outputs[0].finish_reason or "stop"] += 1
                        self.e2e.observe(now - arrival)
                    yield out
        finally:
            if not finished:
                self.unfinished += 1

    def render(self, stats: EngineStats) -> str:
        """The Prometheus text page: engine gauges and counters, then the server's own."""
        lines: list[str] = []
        for name, kind, help_text, field in _ENGINE_METRICS:
            lines += _header(name, kind, help_text) + [f"{_PREFIX}{name} {getattr(stats, field)}"]
        for name, help_text, value in (
            ("prompt_tokens_total", "Prompt tokens of requests that started.", self.prompt_tokens),
            ("generation_tokens_total", "Generated tokens delivered.", self.generation_tokens),
            (
                "request_aborted_total",
                "Requests that ended before finishing (client gone, cancelled, failed).",
                self.unfinished,
            ),
        ):
            lines += _header(name, "counter", help_text) + [f"{_PREFIX}{name} {value}"]
        for name, help_text, label, values in (
            (
                "request_success_total",
                "Requests that finished, by finish reason.",
                "finished_reason",
                self.finished,
            ),
            (
                "request_errors_total",
                "Requests refused with an error, by HTTP status.",
                "status",
                self.errors,
            ),
        ):
            lines += _header(name, "counter", help_text)
            lines += [f'{_PREFIX}{name}{{{label}="{k}"}} {v}' for k, v in sorted(values.items())]
        for hist, name, help_text in (
            (self.ttft, "time_to_first_token_seconds", "Time from arrival to the first token."),
            (self.itl, "inter_token_latency_seconds", "Time between successive tokens."),
            (self.e2e, "e2e_request_latency_seconds", "Time from arrival to the last token."),
        ):
            lines += hist.render(_PREFIX + name, help_text)
        return "\n".join(lines) + "\n"


_ENGINE_METRICS = (  # (name, type, help, EngineStats field)
    ("num_requests_running", "gauge", "Requests in the running batch.", "num_running"),
    ("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", "num_waiting"),
    (
        "kv_cache_usage_perc",
        "gauge",
        "Fraction of KV cache blocks in use (0 to 1).",
        "kv_cache_usage",
    ),
    (
        "prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
        "prefix_cache_queries",
    ),
    (
        "prefix_cache_hits_total",
        "counter",
        "Prompt tokens found in the prefix cache.",
        "prefix_cache_hits",
    ),
    (
        "offload_hits_total",
        "counter",
        "Tokens loaded back from the KV offload tier.",
        "offload_hits",
    ),
    ("offload_bytes_stored_total", "counter", "Bytes copied to the KV offload tier.", "offload_bytes_stored"),
    ("offload_bytes_loaded_total", "counter", "Bytes copied back from the KV offload tier.", "offload_bytes_loaded"),
    ("offload_transfer_seconds_total", "counter", "Time spent copying to and from the offload tier.",
     "offload_seconds"),
    ("num_preemptions_total", "counter", "Requests preempted by recompute.", "num_preemptions"),
    ("engine_steps_total", "counter", "Engine steps run.", "num_steps"),
)


def _header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {_PREFIX}{name} {help_text}", f"# TYPE {_PREFIX}{name} {kind}"]
