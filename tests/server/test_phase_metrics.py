"""vLLM's request-phase histograms in ``/metrics`` (issue #23): ``vllm:request_queue_time_seconds``
(arrival -> first scheduled), ``..._prefill_time_seconds`` (first scheduled -> first token),
``..._decode_time_seconds`` (first -> last token) and ``..._inference_time_seconds`` (first
scheduled -> last token), from the engine's timestamps in ``RequestOutput.metrics``."""

from __future__ import annotations

import asyncio
import math

import httpx

from attnserve.entrypoints.openai.metrics import ServerMetrics
from attnserve.outputs import CompletionOutput, RequestOutput
from attnserve.sampling_params import SamplingParams
from tests.server.conftest import API_KEY, MODEL_NAME, metric_value

PHASES = ("queue", "prefill", "decode", "inference")


def test_the_engine_stamps_each_phase(reference):
    for n in (1, 2):
        out = reference.generate([[5, 6, 7]], SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=4,
                                                             ignore_eos=True), use_tqdm=False)[0]
        m = out.metrics
        assert m["arrival_time"] <= m["scheduled_time"] <= m["first_token_time"] <= m["last_token_time"], m
        assert m["last_token_time"] > m["first_token_time"]  # four tokens: decode steps ran
        assert math.isclose(m["time_to_first_token"], m["first_token_time"] - m["arrival_time"])


def _output(finished: bool, num_tokens: int, times: dict[str, float]) -> RequestOutput:
    c = CompletionOutput(0, "x" * num_tokens, list(range(num_tokens)), finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1, 2], None, [c], finished, metrics=times)


def test_each_phase_is_observed_once_with_its_meaning():
    metrics = ServerMetrics(MODEL_NAME)
    times = {"arrival_time": 10.0, "scheduled_time": 10.5, "first_token_time": 11.25, "last_token_time": 14.0}

    async def stream():
        yield _output(False, 1, {"arrival_time": 10.0, "scheduled_time": 10.5, "first_token_time": 11.25,
                                 "last_token_time": 11.25})
        yield _output(True, 3, times)

    async def consume():
        return [o async for o in metrics.track(stream(), 0.0)]

    asyncio.run(consume())
    page = metrics.render().decode()
    want = {"queue": 0.5, "prefill": 0.75, "decode": 2.75, "inference": 3.5}
    for phase in PHASES:
        name = f"vllm:request_{phase}_time_seconds"
        assert metric_value(page, name + "_count", model_name=MODEL_NAME) == 1
        assert metric_value(page, name + "_sum") == want[phase]
        assert metric_value(page, name + "_bucket", le="0.3") == 0  # vLLM's request-latency buckets
        assert metric_value(page, name + "_bucket", le="7680.0") == 1


def test_a_served_request_observes_each_phase_once(client, server):
    def scrape() -> str:
        return httpx.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text

    before = scrape()
    client.completions.create(model=MODEL_NAME, prompt=[9, 8, 7, 6], max_tokens=5, temperature=0.0,
                              extra_body={"ignore_eos": True})
    after = scrape()

    def delta(name: str) -> float:
        return metric_value(after, name) - metric_value(before, name)

    got = {phase: delta(f"vllm:request_{phase}_time_seconds_sum") for phase in PHASES}
    assert all(delta(f"vllm:request_{phase}_time_seconds_count") == 1 for phase in PHASES)
    assert all(v >= 0 for v in got.values()) and got["decode"] > 0, got
    assert math.isclose(got["inference"], got["prefill"] + got["decode"], rel_tol=1e-6, abs_tol=1e-9)
    assert got["queue"] + got["inference"] <= delta("vllm:e2e_request_latency_seconds_sum")
