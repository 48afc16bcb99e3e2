"""Server metrics through ``prometheus_client`` (``GET /metrics``), with vLLM's names.

Request-level figures are measured where the client sees them, on the server's event loop:
``ServerMetrics.track`` wraps a request's output stream and records time to first token,
inter-token latency, time per output token, end-to-end latency, prompt and generation tokens,
and how the request ended. The phases of a finished request (queue, prefill, decode, inference
time) come from the engine's own timestamps in ``RequestOutput.metrics``: arrival, first
scheduled (set by the scheduler), first and last token. Engine-level figures (running and waiting requests, KV cache usage,
prefix-cache and offload hits, preemptions) are read from the engine thread's latest
``EngineStats`` snapshot when the page is scraped (``_EngineCollector``), among them
``vllm:iteration_tokens_total``, the engine's own count of its steps by the tokens each added to
the prompt and generation token counts (``LLMEngine.iteration_token_counts``). The request
parameters ``n`` and ``max_tokens`` (the number the engine was given: the request's, or what the
context leaves) are observed once a request finishes, as vLLM observes them.

Names are vLLM's (``vllm:...``, every sample labelled ``model_name``) where the meaning is the
same, so its dashboards work unchanged; figures vLLM has no name for are ``attnserve:...``
(offload tier traffic, engine steps, requests refused by HTTP status). A request that ends
without finishing (the client left, it was cancelled) counts as
``vllm:request_success_total{finished_reason="abort"}``, as in vLLM.

Each app has a registry of its own (several servers may live in one process, as in the tests).
Not here: computing the engine's figures (``engine/async_engine.py``, ``engine/engine_process.py``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.utils import floatToGoString

from attnserve.engine.engine import ITERATION_TOKEN_BUCKETS
from attnserve.engine.engine_client import EngineStats
from attnserve.outputs import RequestOutput

if TYPE_CHECKING:
    from attnserve.sampling_params import SamplingParams

__all__ = ["CONTENT_TYPE", "ServerMetrics", "token_buckets"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
# vLLM's buckets for time to first token, and for the per-token latencies
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                          5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                            50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's, for vllm:request_params_n


def token_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (the buckets of token-count histograms)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class ServerMetrics:
    """The server's Prometheus registry: request histograms and counters, and the engine's
    figures read at scrape time.

    Args:
        model_name: the ``model_name`` label of every sample (the served model name).
        engine_stats: returns the engine's latest snapshot (None: no engine figures).
        max_model_len: the top of the token-count histograms' buckets.
        cache_info: labels of ``vllm:cache_config_info`` (block size, blocks, cache dtype, ...).
    """

    def __init__(self, model_name: str = "", engine_stats: Callable[[], EngineStats] | None = None,
                 max_model_len: int = 1 << 20, cache_info: dict[str, str] | None = None):
        disable_created_metrics()  # as vLLM: no `_created` series beside each counter and histogram
        self.registry = reg = CollectorRegistry()
        self.model_name = model_name
        m = ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", m,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         m, registry=reg).labels(model_name)
        self.request_success = Counter("vllm:request_success", "Count of processed requests, by finish reason "
                                       "('abort': ended before finishing).", [*m, "finished_reason"],
                                       registry=reg)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              m, registry=reg, buckets=_TTFT_BUCKETS).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             m, registry=reg, buckets=_TOKEN_LATENCY_BUCKETS).labels(model_name)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", m, registry=reg,
                              buckets=_TOKEN_LATENCY_BUCKETS).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             m, registry=reg, buckets=_REQUEST_LATENCY_BUCKETS).labels(model_name)
        # the phases of a request, from the engine's timestamps (RequestOutput.metrics), as vLLM
        # has them: queue = arrival -> first scheduled, prefill = first scheduled -> first token,
        # decode = first -> last token, inference = first scheduled -> last token
        self.phases = {
            phase: Histogram(f"vllm:request_{phase}_time_seconds", help_text, m, registry=reg,
                             buckets=_REQUEST_LATENCY_BUCKETS).labels(model_name)
            for phase, help_text in (
                ("queue", "Histogram of time spent in WAITING phase for request."),
                ("prefill", "Histogram of time spent in PREFILL phase for request."),
                ("decode", "Histogram of time spent in DECODE phase for request."),
                ("inference", "Histogram of time spent in RUNNING phase for request."),
            )
        }
        buckets = token_buckets(max_model_len)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               m, registry=reg, buckets=buckets).labels(model_name)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", m, registry=reg,
                                                   buckets=buckets).labels(model_name)
        self.request_max_generation_tokens = Histogram(
            "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            m, registry=reg, buckets=buckets).labels(model_name)
        self.request_params_n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", m,
                                          registry=reg, buckets=_N_BUCKETS).labels(model_name)
        self.request_params_max_tokens = Histogram("vllm:request_params_max_tokens",
                                                   "Histogram of the max_tokens request parameter.", m,
                                                   registry=reg, buckets=buckets).labels(model_name)
        self.errors = Counter("attnserve:request_errors", "Requests answered with an error, by HTTP status.",
                              [*m, "status"], registry=reg)
        if engine_stats is not None:
            reg.register(_EngineCollector(engine_stats, model_name, cache_info or {}))
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=reg)

    def record_error(self, status: int) -> None:
        self.errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        """The page in the Prometheus text format."""
        return generate_latest(self.registry)

    async def track(
        self, stream: AsyncIterator[RequestOutput], arrival: float, params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Pass ``stream`` through, recording its timings; ``arrival`` is a perf_counter time,
        ``params`` what the request was submitted with (its ``n`` and ``max_tokens`` observed
        when it finishes; None: not observed)."""
        seen, first, last, finished = 0, arrival, arrival, False
        try:
            async with aclosing(stream):
                async for out in stream:
                    now = time.perf_counter()
                    num = sum(len(c.token_ids) for c in out.outputs)
                    if num > seen:
                        # a late consumer sees several tokens at once: they share the gap since
                        # the last it saw (those that came with the first token, none)
                        if seen == 0:
                            self.ttft.observe(now - arrival)
                            self.prompt_tokens.inc(len(out.prompt_token_ids))
                            self.request_prompt_tokens.observe(len(out.prompt_token_ids))
                            first, gap, gaps = now, 0.0, num - 1
                        else:
                            gap, gaps = (now - last) / (num - seen), num - seen
                        for _ in range(gaps):
                            self.itl.observe(gap)
                        self.generation_tokens.inc(num - seen)
                        seen, last = num, now
                    if out.finished:
                        finished = True
                        reason = out.outputs[0].finish_reason or "stop"
                        self.request_success.labels(self.model_name, reason).inc()
                        self.e2e.observe(now - arrival)
                        self.request_generation_tokens.observe(num)
                        self.request_max_generation_tokens.observe(max(len(c.token_ids) for c in out.outputs))
                        if params is not None:
                            self.request_params_n.observe(params.n)
                            if params.max_tokens is not None:
                                self.request_params_max_tokens.observe(params.max_tokens)
                        if num > 1:
                            self.tpot.observe((now - first) / (num - 1))
                        self._observe_phases(out.metrics)
                    yield out
        finally:
            if not finished:
                self.request_success.labels(self.model_name, "abort").inc()


    def _observe_phases(self, times: dict[str, float]) -> None:
        """The phase histograms of a finished request, from the engine's timestamps (none for
        a request that never got a token)."""
        try:
            arrival, scheduled = times["arrival_time"], times["scheduled_time"]
            first, last = times["first_token_time"], times["last_token_time"]
        except KeyError:
            return
        self.phases["queue"].observe(scheduled - arrival)
        self.phases["prefill"].observe(first - scheduled)
        self.phases["decode"].observe(last - first)
        self.phases["inference"].observe(last - scheduled)


class _EngineCollector:
    """The engine's figures, read from its latest ``EngineStats`` at each scrape."""

    # (name, kind, help, EngineStats field); counters get "_total" on the page
    _FIGURES = (
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", "num_running"),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", "num_waiting"),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
        ("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.",
         "prefix_cache_queries"),
        ("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.",
         "prefix_cache_hits"),
        ("vllm:num_preemptions", "counter", "Cumulative number of preemptions from the engine.",
         "num_preemptions"),
        ("attnserve:offload_hits", "counter", "Prompt tokens loaded back from the KV offload tier.",
         "offload_hits"),
        ("attnserve:offload_bytes_stored", "counter", "Bytes copied to the KV offload tier.",
         "offload_bytes_stored"),
        ("attnserve:offload_bytes_loaded", "counter", "Bytes copied back from the KV offload tier.",
         "offload_bytes_loaded"),
        ("attnserve:offload_transfer_seconds", "counter", "Time spent copying to and from the offload tier.",
         "offload_seconds"),
        ("attnserve:offload_failed_stores", "counter",
         "Blocks the KV offload tier could not keep (a full or unwritable disk); they are recomputed.",
         "offload_failed_stores"),
        ("attnserve:engine_steps", "counter", "Engine steps run.", "num_steps"),
    )

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, cache_info: dict[str, str]):
        self.stats = stats
        self.model_name = model_name
        self.cache_info = cache_info

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        for name, kind, help_text, field in self._FIGURES:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], float(getattr(stats, field)))
            yield family
        yield self._iteration_tokens(stats)
        if self.cache_info:
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache config.",
                                     labels=["model_name", *self.cache_info])
            info.add_metric([self.model_name, *self.cache_info.values()], 1.0)
            yield info

    def _iteration_tokens(self, stats: EngineStats) -> Metric:
        """vLLM's histogram of tokens per engine step, from the engine's counts per bucket (its
        sum: every step's tokens, which are the prompt and generation tokens counted)."""
        counts = stats.iteration_tokens or (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
        family = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                       labels=["model_name"])
        bounds = [floatToGoString(b) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
        cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
        family.add_metric([self.model_name], list(zip(bounds, cumulative)),
                          sum_value=float(stats.prompt_tokens + stats.generation_tokens))
        return family
