"""The real server through the official ``openai`` client: completions and chat, streamed and
not, against ``LLM.generate`` / ``LLM.chat`` on the same model.

Greedy token choices must be identical to the offline engine's, so texts are compared exactly;
logprobs are compared within 1e-4 (same kernels, different batch composition).
"""

from __future__ import annotations

import httpx
import pytest

from attnserve.sampling_params import SamplingParams
from tests.server.conftest import API_KEY, MODEL_NAME, metric_value

PROMPTS = ["def fibonacci(n):", "The capital of France is", "hello world hello world", "a"]
TOL = 1e-4


def _stream_text(stream) -> tuple[dict[int, str], dict[int, str], object]:
    """Concatenated text and finish reason per choice index, and the usage, of a stream."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            piece = ch.text if hasattr(ch, "text") else (ch.delta.content or "")
            texts[ch.index] = texts.get(ch.index, "") + piece
            if ch.finish_reason is not None:
                assert ch.index not in finish, "a choice finished twice"
                finish[ch.index] = ch.finish_reason
    return texts, finish, usage


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert httpx.get(server.base_url + "/health").status_code == 200
    # one model by its id (vLLM's /v1/models/{id}), and an OpenAI 404 for another
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.model_dump() == models.data[0].model_dump()
    r = httpx.get(server.base_url + "/v1/models/org/other", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # a request without "model" is for the served model, as in vLLM
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})):
        r = httpx.post(server.base_url + path, json=body, headers=auth, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == MODEL_NAME, r.text


def test_completions_match_offline(client, reference):
    refs = reference.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    for prompt, ref in zip(PROMPTS, refs):
        resp = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0.0
        )
        assert resp.choices[0].text == ref.outputs[0].text
        assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason
        assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_token_id_prompts_and_batches(client, reference):
    ids = [[5, 17, 300, 42], [1000, 7, 8, 9, 10, 11], [77]]
    refs = reference.generate(ids, SamplingParams(temperature=0.0, max_tokens=8))
    resp = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0.0, n=2
    )
    assert sorted(c.index for c in resp.choices) == list(range(6))
    for c in resp.choices:
        assert c.text == refs[c.index // 2].outputs[0].text
    single = client.completions.create(
        model=MODEL_NAME, prompt=ids[1], max_tokens=8, temperature=0.0
    )
    assert single.choices[0].text == refs[1].outputs[0].text


def test_streamed_completions_equal_whole(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[:3], max_tokens=10, temperature=0.0)
    whole = client.completions.create(**kw)
    texts, finish, usage = _stream_text(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_matches_offline(client, reference):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime number."},
    ]
    ref = reference.chat(messages, SamplingParams(temperature=0.0, max_tokens=10))[0]
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0.0
    )
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    texts, finish, _ = _stream_text(
        client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0.0, stream=True
        )
    )
    assert texts == {0: ref.outputs[0].text}
    assert finish == {0: ref.outputs[0].finish_reason}


def test_logprobs_match_offline(client, reference):
    ref = reference.generate(
        [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)
    )[0].outputs[0]
    resp = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0.0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(ref.token_ids) == 6
    for i, (tid, entry) in enumerate(zip(ref.token_ids, ref.logprobs)):
        assert lp.token_logprobs[i] == pytest.approx(entry[tid].logprob, abs=TOL)
        assert len(lp.top_logprobs[i]) >= 3
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for tok in content:
        assert len(tok.top_logprobs) == 2
        # greedy: the chosen token is the most likely one
        assert tok.logprob == pytest.approx(tok.top_logprobs[0].logprob, abs=TOL)
        assert bytes(tok.bytes).decode("utf-8", "replace") == tok.token


def test_echo(client):
    plain = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=5, temperature=0.0
    )
    echo = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=5, temperature=0.0, echo=True, logprobs=1
    )
    assert echo.choices[0].text == PROMPTS[1] + plain.choices[0].text
    lp = echo.choices[0].logprobs
    n_prompt = echo.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 5
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == echo.choices[0].text
    texts, _, _ = _stream_text(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[1],
            max_tokens=5,
            temperature=0.0,
            echo=True,
            stream=True,
        )
    )
    assert texts == {0: echo.choices[0].text}


def test_stop_string_streamed_equals_whole(client):
    full = (
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0.0
        )
        .choices[0]
        .text
    )
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0.0, stop=[stop])
    whole = client.completions.create(**kw).choices[0]
    assert whole.finish_reason == "stop" and whole.text == full[: full.index(stop)]
    texts, finish, _ = _stream_text(client.completions.create(**kw, stream=True))
    assert texts == {0: whole.text} and finish == {0: "stop"}


def test_seeded_sampling_is_reproducible(client, reference):
    kw = dict(
        model=MODEL_NAME,
        prompt=PROMPTS[2],
        max_tokens=12,
        temperature=1.0,
        top_p=0.9,
        seed=1234,
        extra_body={"top_k": 50, "min_p": 0.01},
    )
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    texts, _, _ = _stream_text(client.completions.create(**kw, stream=True))
    ref = reference.generate(
        [PROMPTS[2]],
        SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=1234, max_tokens=12),
    )[0]
    assert a == b == texts[0] == ref.outputs[0].text


def test_penalties_and_stop_token_ids(client, reference):
    params = dict(temperature=0.0, max_tokens=12, presence_penalty=1.5, frequency_penalty=0.5)
    ref = reference.generate([PROMPTS[2]], SamplingParams(**params))[0].outputs[0]
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], **params)
    assert resp.choices[0].text == ref.text
    stop_id = ref.token_ids[3]
    resp = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[2], **params, extra_body={"stop_token_ids": [stop_id]}
    )
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].stop_reason == stop_id
    assert resp.usage.completion_tokens == ref.token_ids.index(stop_id) + 1


def test_metrics_count_requests_and_prefix_hits(client, server):
    """``/metrics`` read with prometheus_client's parser: vLLM's names and types, every sample
    labelled with the served model's name, and the figures of two requests."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> str:
        r = httpx.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return r.text

    before = scrape()
    assert "_created" not in before  # as vLLM: no creation-time series beside the counters
    prompt = list(range(100, 164))  # four full blocks: the second request hits the cache
    for _ in range(2):
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0.0)
    after = scrape()

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("vllm:request_success_total") == 2
    assert delta("vllm:prompt_tokens_total", model_name=MODEL_NAME) == 128
    assert delta("vllm:generation_tokens_total") == 6
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == 4
    assert delta("vllm:request_time_per_output_token_seconds_count") == 2
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert delta("vllm:request_prompt_tokens_sum") == 128
    assert delta("vllm:request_generation_tokens_bucket", le="5.0") == 2
    assert delta("vllm:prefix_cache_queries_total") >= 128
    assert delta("vllm:prefix_cache_hits_total") >= 48
    assert metric_value(after, "attnserve:offload_hits_total") == 0
    families = {f.name: f for f in text_string_to_metric_families(after)}
    for name, kind in (
        ("vllm:num_requests_running", "gauge"),
        ("vllm:num_requests_waiting", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"),
        ("vllm:prompt_tokens", "counter"),
        ("vllm:generation_tokens", "counter"),
        ("vllm:request_success", "counter"),
        ("vllm:prefix_cache_queries", "counter"),
        ("vllm:prefix_cache_hits", "counter"),
        ("vllm:num_preemptions", "counter"),
        ("vllm:time_to_first_token_seconds", "histogram"),
        ("vllm:inter_token_latency_seconds", "histogram"),
        ("vllm:e2e_request_latency_seconds", "histogram"),
        ("attnserve:offload_bytes_stored", "counter"),
        ("attnserve:offload_transfer_seconds", "counter"),
        ("attnserve:engine_steps", "counter"),
    ):
        assert families[name].type == kind, name
        assert all(s.labels["model_name"] == MODEL_NAME for s in families[name].samples), name
    usage = families["vllm:kv_cache_usage_perc"].samples[0].value
    assert 0.0 <= usage <= 1.0
    (info,) = families["vllm:cache_config_info"].samples
    assert info.labels["block_size"] == "16" and info.labels["enable_prefix_caching"] == "True"
    blocks = server.engine.call(lambda e: e.kv_manager.pool.num_blocks).result(10)
    assert int(info.labels["num_gpu_blocks"]) == blocks
