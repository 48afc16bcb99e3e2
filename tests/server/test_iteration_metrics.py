"""vLLM's ``vllm:iteration_tokens_total``, ``vllm:request_params_n``,
``vllm:request_params_max_tokens`` and ``vllm:request_max_num_generation_tokens`` in ``/metrics``
(issue 38, point 8), with vLLM's buckets, counted exactly on a server of its own.

An engine step counts the prompt tokens of the requests that got their first token in it and
the tokens it sampled (vLLM's iteration tokens), so the histogram's sum is the prompt and
generation token counters' sum; a request's ``n`` and ``max_tokens`` (the number the engine was
given) are observed when it finishes.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.server.conftest import ENGINE_KWARGS, MODEL_NAME, ServerThread, metric_value

ITERATION_BUCKETS = ["1.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0", "512.0", "1024.0", "2048.0",
                     "4096.0", "8192.0", "16384.0", "+Inf"]


@pytest.fixture(scope="module")
def srv(model_dir):
    server = ServerThread(model_dir, api_key=None, **ENGINE_KWARGS)
    yield server
    server.stop()


def _scrape(srv, steps: int | None = None) -> str:
    """The page, once the engine's snapshot counts ``steps`` steps (it is published after a
    step's outputs are handed over, so a scrape right after a reply may precede it)."""
    deadline = time.monotonic() + 10
    while True:
        page = httpx.get(srv.base_url + "/metrics").text
        if steps is None or metric_value(page, "vllm:iteration_tokens_total_count") >= steps:
            return page
        assert time.monotonic() < deadline, "the engine's stats never counted the steps"
        time.sleep(0.02)


def _post(srv, path: str, body: dict) -> dict:
    r = httpx.post(srv.base_url + path, json={"temperature": 0.0, "ignore_eos": True, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_histograms_count_steps_and_params(srv):
    page = _scrape(srv)
    le = [s for s in page.splitlines() if s.startswith("vllm:iteration_tokens_total_bucket")]
    assert [s.split('le="')[1].split('"')[0] for s in le] == ITERATION_BUCKETS  # vLLM's buckets
    for name in ("vllm:iteration_tokens_total", "vllm:request_params_n", "vllm:request_params_max_tokens",
                 "vllm:request_max_num_generation_tokens"):
        assert metric_value(page, f"{name}_count", model_name=MODEL_NAME) == 0, name
    assert 'vllm:request_params_n_bucket{le="20.0"' in page  # vLLM's n buckets: 1, 2, 5, 10, 20

    # 20 prompt tokens, 4 generated: a step of 21 tokens (the prompt and the first token), then 3 of 1
    _post(srv, "/v1/completions", {"prompt": list(range(100, 120)), "max_tokens": 4})
    page = _scrape(srv, steps=4)
    counts = {b: metric_value(page, "vllm:iteration_tokens_total_bucket", le=b) for b in ("1.0", "16.0", "32.0")}
    assert counts == {"1.0": 3, "16.0": 3, "32.0": 4}
    assert metric_value(page, "vllm:iteration_tokens_total_count") == 4
    assert metric_value(page, "vllm:iteration_tokens_total_sum") == 24

    # chat with n=2 (3 steps of both completions), then /v1/responses (5 steps)
    chat = _post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                               "max_tokens": 3})
    resp = _post(srv, "/v1/responses", {"input": "hi", "max_output_tokens": 5})
    page = _scrape(srv, steps=12)
    assert metric_value(page, "vllm:iteration_tokens_total_count") == 12
    tokens = sum(metric_value(page, f"vllm:{name}_total") for name in ("prompt_tokens", "generation_tokens"))
    assert metric_value(page, "vllm:iteration_tokens_total_sum") == tokens == \
        24 + chat["usage"]["total_tokens"] + resp["usage"]["total_tokens"]
    n = {b: metric_value(page, "vllm:request_params_n_bucket", le=b) for b in ("1.0", "2.0", "+Inf")}
    assert n == {"1.0": 2, "2.0": 3, "+Inf": 3} and metric_value(page, "vllm:request_params_n_sum") == 4
    assert metric_value(page, "vllm:request_params_max_tokens_sum") == 4 + 3 + 5
    assert metric_value(page, "vllm:request_params_max_tokens_bucket", le="5.0") == 3
    assert metric_value(page, "vllm:request_max_num_generation_tokens_sum") == 4 + 3 + 5
