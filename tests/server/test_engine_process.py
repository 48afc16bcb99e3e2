"""The engine in its own process (``EngineProcessClient``) against the engine on a thread.

The server must see exactly what it sees from ``AsyncLLMEngine``: every output rebuilt from
deltas equals the engine's, field by field, and the same requests give the same final outputs
and the same HTTP responses. Then the process's own failure modes: an abort frees the request
in the child, a bad prompt fails alone, a killed child fails every running request and turns
``/health`` to 503, shutdown leaves no process, a start-up error arrives with its message, and
the child exits when its frontend dies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from attnserve.engine.async_engine import AsyncLLMEngine
from attnserve.engine.engine import PromptError
from attnserve.engine.engine_client import EngineDeadError
from attnserve.engine.engine_process import EngineProcessClient, Outbox
from attnserve.engine.output_deltas import OutputAssembler, OutputEncoder
from attnserve.entrypoints.openai.api_server import build_app
from attnserve.outputs import CompletionOutput, RequestOutput
from attnserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.server.conftest import ENGINE_KWARGS, MODEL_NAME
from tests.server.inprocess import engine_holdings, wait_engine_idle

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def proc(model_dir):
    client = EngineProcessClient.from_kwargs(str(model_dir), **ENGINE_KWARGS)
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def thread_engine(model_dir):
    engine = AsyncLLMEngine.from_kwargs(str(model_dir), **ENGINE_KWARGS)
    yield engine
    engine.shutdown()


def _requests(stop: str | None = None) -> list[tuple[str, object, SamplingParams]]:
    reqs = [
        ("greedy", {"prompt_token_ids": [5, 17, 301, 44]}, SamplingParams(temperature=0.0, max_tokens=12)),
        ("text", "hello world", SamplingParams(temperature=0.0, max_tokens=9)),
        ("logprobs", [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)),
        ("prompt-logprobs", [11, 12, 13, 14, 15], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)),
        ("n2", [20, 21], SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=5, logprobs=1)),
        ("choice", [30, 31], SamplingParams(temperature=1.0, seed=3, max_tokens=8, structured_outputs=
                                            StructuredOutputsParams(choice=["yes", "no way"]))),
    ]
    if stop is not None:
        reqs.append(("stop", "hello world", SamplingParams(temperature=0.0, max_tokens=9, stop=[stop])))
    return reqs


async def _collect(engine, rid: str, prompt, params) -> list[RequestOutput]:
    return [out async for out in engine.generate(rid, prompt, params)]


def _run_all(engine, reqs) -> list[list[RequestOutput]]:
    async def main():
        return await asyncio.gather(*[_collect(engine, *r) for r in reqs])

    return asyncio.run(main())


def _approx(x):
    """``x`` with its floats (logprobs) compared to 4 digits: a batch split differently between
    steps moves them in the 7th."""
    if isinstance(x, float):
        return pytest.approx(x, rel=1e-4, abs=1e-6)
    if isinstance(x, dict):
        return {k: _approx(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_approx(v) for v in x]
    return x


def _comparable(out: RequestOutput):
    """``out`` as plain data, the timestamps' names only."""
    return _approx({**dataclasses.asdict(out), "metrics": sorted(out.metrics)})


def test_deltas_rebuild_every_output_exactly(reference):
    """Every output of every step, through encode, pickle and apply, equals the engine's."""
    engine = reference.llm_engine
    for rid, prompt, params in _requests():
        engine.add_request(rid, prompt, params)
    encoder, assemblers, n = OutputEncoder(), {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            key = hash(out.request_id)
            delta = pickle.loads(pickle.dumps(encoder.encode(key, out), protocol=5))
            rebuilt = assemblers.setdefault(key, OutputAssembler(out.request_id)).apply(delta)
            assert rebuilt == out
            n += 1
    assert n > 30 and len(encoder) == 0  # finished requests are forgotten


def test_a_stop_string_that_cuts_sent_text_is_rebuilt():
    """A stop string completed by a later token cuts text the frontend already has."""
    encoder, assembler = OutputEncoder(), OutputAssembler("r")

    def out(text: str, tokens: list[int], finished: bool) -> RequestOutput:
        c = CompletionOutput(0, text, tokens, finish_reason="stop" if finished else None,
                             stop_reason="ab" if finished else None)
        return RequestOutput("r", "p", [1, 2], None, [c], finished)

    for o in (out("xya", [5, 6], False), out("xy", [5, 6, 7], True)):
        assert assembler.apply(encoder.encode(0, o)) == o


def test_a_message_carries_each_request_s_deltas_merged():
    """Steps queued while the sender was blocked go as one message: each request's deltas
    merged into one, none for a request aborted meanwhile."""
    def out(rid: str, tokens: list[int]) -> RequestOutput:
        return RequestOutput(rid, None, [1], None, [CompletionOutput(0, "ab" * len(tokens), tokens)], False)

    outbox, encoder = Outbox(), OutputEncoder()
    outbox.add_deltas([encoder.encode(0, out("a", [5])), encoder.encode(1, out("b", [6]))])
    outbox.add_deltas([encoder.encode(0, out("a", [5, 7]))])
    for event in (("forget", 1), ("error", 2, PromptError("bad")), ("result", 9, True, 42)):
        outbox.add_event(event)
    outbox.flush(None)
    msg = outbox.take()
    assert [d[0] for d in msg.deltas] == [0] and [(k, str(e)) for k, e in msg.errors] == [(2, "bad")]
    assert OutputAssembler("a").apply(msg.deltas[0]) == out("a", [5, 7]) and msg.results == [(9, True, 42)]


def test_outputs_equal_the_engine_thread(proc, thread_engine):
    """The same requests through both: identical final outputs (timestamps aside), and each
    streamed output of the process is a prefix of its final one."""
    text = _run_all(thread_engine, [_requests()[1]])[0][-1].outputs[0].text
    reqs = _requests(stop=text[3:6])
    want = _run_all(thread_engine, reqs)
    got = _run_all(proc, reqs)
    for (rid, _, _), w, g in zip(reqs, want, got):
        assert _comparable(g[-1]) == _comparable(w[-1]), rid
        for partial in g:
            assert partial.request_id == rid
            for c, final in zip(partial.outputs, g[-1].outputs):
                assert final.token_ids[:len(c.token_ids)] == c.token_ids
    finals = {rid: g[-1] for (rid, _, _), g in zip(reqs, got)}
    assert finals["stop"].outputs[0].finish_reason == "stop" and finals["stop"].outputs[0].stop_reason == text[3:6]
    assert finals["choice"].outputs[0].text in ("yes", "no way")
    assert len(finals["prompt-logprobs"].prompt_logprobs) == 5 and len(finals["n2"].outputs) == 2
    wait_engine_idle(proc)


def test_http_responses_equal_the_engine_thread(proc, thread_engine):
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 6, "temperature": 0.0, "logprobs": 2}

    async def ask(engine) -> tuple[dict, list[str]]:
        app = build_app(engine, MODEL_NAME)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            whole = (await c.post("/v1/completions", json=body)).json()
            stream = await c.post("/v1/completions", json={**body, "stream": True})
            events = [json.loads(line[6:]) for line in stream.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        whole.pop("id"), whole.pop("created")
        # a stream's events may each carry several tokens (a consumer behind gets them at once)
        streamed = {"text": "", "tokens": [], "token_logprobs": [], "finish_reason": None}
        for choice in (c for e in events for c in e["choices"]):
            streamed["text"] += choice["text"]
            streamed["tokens"] += choice["logprobs"]["tokens"] if choice["logprobs"] else []
            streamed["token_logprobs"] += choice["logprobs"]["token_logprobs"] if choice["logprobs"] else []
            streamed["finish_reason"] = choice["finish_reason"] or streamed["finish_reason"]
        return whole, streamed

    (got_whole, got_streamed), (want_whole, want_streamed) = asyncio.run(ask(proc)), asyncio.run(ask(thread_engine))
    assert got_whole == _approx(want_whole) and got_streamed == _approx(want_streamed)
    assert got_streamed["text"] == got_whole["choices"][0]["text"] and got_streamed["finish_reason"] == "length"


def test_abort_frees_the_request_in_the_engine_process(proc):
    async def main():
        stream = proc.generate("long", [3, 4, 5], SamplingParams(max_tokens=400, ignore_eos=True))
        first = await stream.__anext__()
        await stream.aclose()
        return first

    aborted = proc.stats().num_aborted
    assert not asyncio.run(main()).finished
    wait_engine_idle(proc)
    deadline = time.monotonic() + 5
    while proc.stats().num_aborted != aborted + 1:
        assert time.monotonic() < deadline, proc.stats()
        time.sleep(0.01)


def test_a_bad_prompt_fails_alone(proc, thread_engine):
    bad = ("bad", [5, 10**6], SamplingParams(max_tokens=2))
    good = ("good", [5, 6], SamplingParams(temperature=0.0, max_tokens=4))

    async def main(engine):
        return await asyncio.gather(_collect(engine, *bad), _collect(engine, *good), return_exceptions=True)

    (want_error, want), (got_error, got) = asyncio.run(main(thread_engine)), asyncio.run(main(proc))
    assert type(got_error) is type(want_error) is PromptError and str(got_error) == str(want_error)
    assert _comparable(got[-1]) == _comparable(want[-1]) and got[-1].finished

    async def duplicate():
        first = proc.generate("dup", [3, 4], SamplingParams(max_tokens=400, ignore_eos=True))
        await first.__anext__()
        with pytest.raises(ValueError, match="request id 'dup' is already in use"):
            await _collect(proc, "dup", [3, 4], SamplingParams(max_tokens=2))
        await first.aclose()
        return await _collect(proc, "dup", [3, 4], SamplingParams(max_tokens=2))  # free again

    assert asyncio.run(duplicate())[-1].finished
    assert proc.is_alive
    wait_engine_idle(proc)


def test_call_takes_module_level_functions(proc):
    assert proc.call(engine_holdings).result(timeout=10)["blocks_held"] == 0
    with pytest.raises(Exception, match="pickle|Can't get local"):
        proc.call(lambda e: 1).result(timeout=10)
    with pytest.raises(ZeroDivisionError):
        proc.call(_divide_by_zero).result(timeout=10)


def _divide_by_zero(engine) -> float:
    return 1 / 0


def test_a_killed_engine_process_fails_requests_and_health(model_dir):
    client = EngineProcessClient.from_kwargs(str(model_dir), **ENGINE_KWARGS)
    app = build_app(client, MODEL_NAME)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert (await c.get("/health")).status_code == 200
            stream = client.generate("long", [3, 4, 5], SamplingParams(max_tokens=400, ignore_eos=True))
            await stream.__anext__()
            os.kill(client._process.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="died"):
                async for _ in stream:
                    pass
            assert (await c.get("/health")).status_code == 503
            late = await c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
            assert late.status_code == 503

    asyncio.run(asyncio.wait_for(main(), 30))
    assert not client.is_alive and isinstance(client.error, EngineDeadError)
    t = time.monotonic()
    client.shutdown()
    assert time.monotonic() - t < 5 and client._process.exitcode == -signal.SIGKILL


def test_shutdown_ends_running_requests_and_leaves_no_process(model_dir):
    client = EngineProcessClient.from_kwargs(str(model_dir), **ENGINE_KWARGS)

    async def main():
        stream = client.generate("long", [3, 4, 5], SamplingParams(max_tokens=400, ignore_eos=True))
        await stream.__anext__()
        await asyncio.to_thread(client.shutdown)
        with pytest.raises(EngineDeadError, match="the engine was shut down"):
            async for _ in stream:
                pass

    asyncio.run(asyncio.wait_for(main(), 30))
    assert client._process.exitcode == 0 and client._process not in multiprocessing.active_children()
    assert not client.is_alive and client.error is None
    client.shutdown()  # again: nothing happens


def _break_scheduler(engine) -> None:
    def boom(*args, **kwargs):
        raise RuntimeError("scheduler exploded")

    engine.scheduler.schedule = boom


def test_an_engine_failure_ends_requests_with_its_reason(model_dir):
    """The loop failing in the child (not a step it contains): streams get EngineDeadError
    naming the failure, ``error`` is the child's exception, the process exits."""
    client = EngineProcessClient.from_kwargs(str(model_dir), **ENGINE_KWARGS)
    client.call(_break_scheduler).result(timeout=10)
    with pytest.raises(EngineDeadError, match="scheduler exploded"):
        asyncio.run(asyncio.wait_for(_collect(client, "z", [3, 4], SamplingParams(max_tokens=2)), 30))
    assert not client.is_alive and isinstance(client.error, RuntimeError) and "exploded" in str(client.error)
    client.shutdown()
    assert client._process.exitcode == 0


def test_a_start_up_error_arrives_with_its_message(model_dir, tmp_path):
    with pytest.raises(TypeError, match="unknown engine option 'bogus'"):  # the config: checked here
        EngineProcessClient.from_kwargs(str(model_dir), bogus=1)
    kwargs = {**ENGINE_KWARGS, "max_model_len": 4096, "kv_cache_memory": 0.0001}  # the cache: in the child
    with pytest.raises(ValueError) as want:
        AsyncLLMEngine.from_kwargs(str(model_dir), **kwargs)
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError) as got:
        EngineProcessClient.from_kwargs(str(model_dir), **kwargs)
    assert str(got.value) == str(want.value) and type(got.value) is type(want.value)
    if sys.version_info >= (3, 11):  # the child's traceback comes as a note
        assert "(in the engine process)" in "".join(got.value.__notes__)
    assert set(multiprocessing.active_children()) <= before


def test_the_engine_process_exits_when_its_frontend_dies(model_dir):
    script = (f"import sys, time; sys.path[:0] = [{str(ROOT / 'src')!r}]\n"
              "from attnserve.engine.engine_process import EngineProcessClient\n"
              "if __name__ == '__main__':\n"
              f"    c = EngineProcessClient.from_kwargs({str(model_dir)!r}, kv_cache_memory=0.01)\n"
              "    print(c._process.pid, flush=True)\n"
              "    time.sleep(60)\n")
    frontend = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(frontend.stdout.readline())
        frontend.kill()
        frontend.wait()
        deadline = time.monotonic() + 15
        while _running(child):
            assert time.monotonic() < deadline, "the engine process outlived its frontend"
            time.sleep(0.05)
    finally:
        frontend.kill()


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
