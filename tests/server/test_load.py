"""Bounded load tests: hundreds of requests from 96 concurrent clients (the official async client).

Mixed completions and chat, streamed and not, prompts of 1 to 64 tokens, 1 to 16 new tokens;
one streamed request in ten is abandoned after its first chunk. Every other request must come
back exactly once with the greedy output of ``LLM.generate`` on the same prompt (token for
token: same text, token count and finish reason), the server's counters must agree, and the
engine must end holding no request and no block. Once with a roomy KV cache, once with one so
small that requests queue and are preempted. The figures are printed with the results.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass

import openai
import pytest

from attnserve.sampling_params import SamplingParams
from tests.server.conftest import API_KEY, MODEL_NAME, ServerThread

NUM_REQUESTS = 512
NUM_CLIENTS = 96
WORDS = (
    "alpha beta gamma delta river stone cloud paper light night green seven ocean "
    "market engine garden window silver forest yellow"
).split()


@dataclass
class Spec:
    kind: str  # cmpl | chat
    stream: bool
    abort: bool
    prompt: list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int = 16


@dataclass
class Result:
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    response_id: str = ""
    latency: float = 0.0
    aborted: bool = False


def _plan(num: int, seed: int) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for _ in range(num):
        kind, stream = rng.choice(["cmpl", "chat"]), rng.random() < 0.5
        abort = stream and rng.random() < 0.2
        spec = Spec(kind, stream, abort, max_tokens=300 if abort else rng.randint(1, 16))
        if kind == "cmpl":
            spec.prompt = [rng.randrange(3, 2048) for _ in range(rng.randint(1, 64))]
        else:
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
            spec.messages = [{"role": "user", "content": words}]
        specs.append(spec)
    return specs


async def _run(client: openai.AsyncOpenAI, spec: Spec) -> Result:
    res = Result()
    start = time.perf_counter()
    kw = dict(model=MODEL_NAME, max_tokens=spec.max_tokens, temperature=0.0)
    if spec.abort:
        kw["extra_body"] = {"ignore_eos": True}
    if spec.stream:
        kw.update(stream=True, stream_options={"include_usage": True})
    if spec.kind == "cmpl":
        resp = await client.completions.create(prompt=spec.prompt, **kw)
    else:
        resp = await client.chat.completions.create(messages=spec.messages, **kw)
    if not spec.stream:
        choice = resp.choices[0]
        res.text = choice.text if spec.kind == "cmpl" else choice.message.content
        res.finish_reason, res.response_id = choice.finish_reason, resp.id
        res.completion_tokens = resp.usage.completion_tokens
    else:
        async for chunk in resp:
            res.response_id = chunk.id
            if chunk.usage is not None:
                res.completion_tokens = chunk.usage.completion_tokens
            for ch in chunk.choices:
                res.text += ch.text if spec.kind == "cmpl" else (ch.delta.content or "")
                if ch.finish_reason is not None:
                    assert res.finish_reason is None, "a choice finished twice"
                    res.finish_reason = ch.finish_reason
            if spec.abort and res.text:
                await resp.close()
                res.aborted = True
                break
    res.latency = time.perf_counter() - start
    return res


async def _drive(server, specs: list[Spec]) -> tuple[list[Result | None], float]:
    results: list[Result | None] = [None] * len(specs)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(specs)):
        queue.put_nowait(i)
    async with openai.AsyncOpenAI(
        api_key=API_KEY, base_url=server.base_url + "/v1", max_retries=0, timeout=120
    ) as client:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                assert results[i] is None
                results[i] = await _run(client, specs[i])

        start = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(NUM_CLIENTS)])
    return results, time.perf_counter() - start


def _references(reference, specs: list[Spec]) -> dict[int, object]:
    tok = reference.get_tokenizer()
    todo = {i: s for i, s in enumerate(specs) if not s.abort}
    prompts = [
        s.prompt
        if s.kind == "cmpl"
        else tok.encode(tok.apply_chat_template(s.messages), add_special_tokens=False)
        for s in todo.values()
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=s.max_tokens) for s in todo.values()]
    return dict(zip(todo, reference.generate(prompts, params)))


def _check_load(server, reference, capsys, specs: list[Spec], label: str) -> None:
    refs = _references(reference, specs)
    server.wait_idle()
    aborted_before = server.engine.stats().num_aborted
    results, elapsed = asyncio.run(_drive(server, specs))

    assert all(r is not None for r in results), "a request was lost"
    num_aborted = sum(r.aborted for r in results)
    assert num_aborted == sum(s.abort for s in specs) > 0
    done = [(i, r) for i, r in enumerate(results) if not r.aborted]
    ids = [r.response_id for _, r in done]
    assert len(set(ids)) == len(ids), "a response id was given twice"
    for i, r in done:
        ref = refs[i].outputs[0]
        got = (r.text, r.completion_tokens, r.finish_reason)
        assert got == (ref.text, len(ref.token_ids), ref.finish_reason), f"request {i}: {specs[i]}"

    state = server.wait_idle(timeout=10)
    assert state == {"unfinished": False, "scheduler_requests": 0, "blocks_held": 0}
    assert server.engine.stats().num_aborted - aborted_before == num_aborted
    assert elapsed < 120

    latencies = sorted(r.latency for _, r in done)
    tokens = sum(r.completion_tokens for _, r in done)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    with capsys.disabled():
        print(
            f"\n[load, {label}] {len(specs)} requests ({num_aborted} aborted) from "
            f"{NUM_CLIENTS} clients in {elapsed:.2f} s: {len(specs) / elapsed:.1f} requests/s, "
            f"{tokens / elapsed:.1f} generated tokens/s, latency p50 "
            f"{statistics.median(latencies) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, "
            f"{server.engine.stats().num_preemptions} preemptions so far"
        )


@pytest.mark.slow
def test_load_many_clients_mixed_requests_with_aborts(server, reference, capsys):
    _check_load(server, reference, capsys, _plan(NUM_REQUESTS, seed=0), "roomy cache")


@pytest.mark.slow
def test_load_with_a_small_cache_preempts_and_leaks_nothing(model_dir, reference, capsys):
    """40 blocks of 16 tokens for 64 clients: requests queue, are preempted and resumed."""
    srv = ServerThread(model_dir, num_gpu_blocks_override=40, max_num_seqs=32)
    try:
        _check_load(srv, reference, capsys, _plan(192, seed=1), "40-block cache")
        assert srv.engine.stats().num_preemptions > 0
    finally:
        srv.stop()
