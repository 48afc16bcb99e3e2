"""AsyncLLMEngine without HTTP: outputs, joining a running batch, cancellation, errors, shutdown.

Each test builds its own engine on the tiny model (float32, CPU) so that engine-side state
(aborts, failures) cannot leak between tests. Greedy outputs are compared with ``LLM.generate``
on the same model: token ids must be identical.
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from attnserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from attnserve.sampling_params import SamplingParams
from tests.server.conftest import ENGINE_KWARGS


@pytest.fixture()
def engine(model_dir):
    eng = AsyncLLMEngine.from_kwargs(str(model_dir), **ENGINE_KWARGS)
    yield eng
    eng.shutdown()


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(rng.randint(2, 40))] for _ in range(n)]


async def _final(engine: AsyncLLMEngine, rid: str, prompt, params):
    last = None
    async for out in engine.generate(rid, {"prompt_token_ids": prompt}, params):
        last = out
    return last


def _held(engine: AsyncLLMEngine) -> tuple[bool, int]:
    def check(e):
        e.kv_manager.check_integrity()
        pool = e.kv_manager.pool
        return e.has_unfinished_requests(), pool.num_blocks - 1 - pool.num_free_blocks

    return engine.call(check).result(timeout=10)


def test_concurrent_generate_matches_offline(engine, reference):
    prompts = _prompts(12)
    params = [SamplingParams(temperature=0.0, max_tokens=1 + i % 7) for i in range(len(prompts))]

    async def main():
        return await asyncio.gather(
            *[_final(engine, f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        )

    outs = asyncio.run(main())
    refs = reference.generate(prompts, params)
    for out, ref in zip(outs, refs):
        assert out.finished
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].text == ref.outputs[0].text
    assert _held(engine) == (False, 0)


def test_outputs_are_cumulative_and_stream_every_token(engine):
    async def main():
        seen = []
        async for out in engine.generate(
            "a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=6)
        ):
            seen.append(list(out.outputs[0].token_ids))
        return seen

    seen = asyncio.run(main())
    # each output extends the previous one; the last holds all six tokens
    assert len(seen[-1]) == 6
    for a, b in zip(seen, seen[1:]):
        assert len(b) > len(a) and b[: len(a)] == a


def test_request_joins_running_batch(engine):
    """A request submitted while another runs is served alongside it, not after it."""

    async def main():
        long = asyncio.create_task(
            _final(
                engine,
                "long",
                [5, 6, 7],
                SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True),
            )
        )
        while engine.stats().num_running == 0:
            await asyncio.sleep(0.005)
        short = await _final(
            engine, "short", [9, 10], SamplingParams(temperature=0.0, max_tokens=3)
        )
        return short, long.done(), await long

    short, long_done_first, long = asyncio.run(main())
    assert len(short.outputs[0].token_ids) == 3
    assert not long_done_first
    assert len(long.outputs[0].token_ids) == 300


def test_cancelled_consumer_aborts_and_frees_blocks(engine):
    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(
                "c",
                {"prompt_token_ids": list(range(3, 40))},
                SamplingParams(max_tokens=400, ignore_eos=True),
            ):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    unfinished, held = _held(engine)
    assert not unfinished and held == 0
    assert engine.stats().num_aborted == 1


def test_closing_the_iterator_aborts(engine):
    async def main():
        stream = engine.generate(
            "x", {"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=400, ignore_eos=True)
        )
        first = await stream.__anext__()
        await stream.aclose()
        return first

    first = asyncio.run(main())
    assert not first.finished
    assert _held(engine) == (False, 0)
    assert engine.stats().num_aborted == 1


def test_abort_from_elsewhere_ends_the_stream(engine):
    async def main():
        n, last = 0, None
        async for out in engine.generate(
            "y", {"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=400, ignore_eos=True)
        ):
            n, last = n + 1, out
            if n == 2:
                engine.abort("y")
        return n, last

    n, last = asyncio.run(main())
    assert not last.finished and n < 400
    assert _held(engine) == (False, 0)


def test_bad_request_raises_and_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(ValueError, match="out of range"):
            await _final(engine, "bad", [5, 10**6], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="max_model_len"):
            await _final(engine, "long", [5] * 600, SamplingParams(max_tokens=2))
        return await _final(engine, "good", [5, 6], SamplingParams(temperature=0.0, max_tokens=2))

    good = asyncio.run(main())
    assert len(good.outputs[0].token_ids) == 2 and engine.is_alive


def test_duplicate_running_id_is_refused(engine):
    async def main():
        first = engine.generate(
            "dup", {"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=400, ignore_eos=True)
        )
        await first.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await _final(engine, "dup", [3, 4], SamplingParams(max_tokens=2))
        await first.aclose()

    asyncio.run(main())
    assert _held(engine) == (False, 0)


def test_call_runs_on_the_engine_thread(engine):
    name = engine.call(lambda e: threading.current_thread().name).result(timeout=10)
    assert name == "attnserve-engine" != threading.current_thread().name
    with pytest.raises(ZeroDivisionError):
        engine.call(lambda e: 1 / 0).result(timeout=10)
    assert engine.is_alive


def test_shutdown_fails_new_requests(engine):
    engine.shutdown()
    assert not engine.is_alive

    async def main():
        await _final(engine, "late", [3, 4], SamplingParams(max_tokens=2))

    with pytest.raises(EngineDeadError):
        asyncio.run(main())
    with pytest.raises(EngineDeadError):
        engine.call(lambda e: None).result(timeout=1)


def test_a_failed_step_fails_its_request_and_the_engine_goes_on(engine):
    """The runner raising (say a kernel) fails the request of that step alone (issue #24): its
    stream ends with finish_reason "error", the engine stays alive and serves the next one."""
    saved = {}

    def break_runner(e):
        def boom(*args, **kwargs):
            raise RuntimeError("kernel exploded")

        saved.update(execute=e.runner.execute, launch=e.runner.launch)
        e.runner.execute = e.runner.launch = boom  # the plain and the async step

    def mend_runner(e):
        e.runner.execute, e.runner.launch = saved["execute"], saved["launch"]

    engine.call(break_runner).result(timeout=10)
    failed = asyncio.run(_final(engine, "z", [3, 4], SamplingParams(max_tokens=2)))
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert "kernel exploded" in failed.outputs[0].stop_reason
    assert engine.is_alive and engine.error is None
    engine.call(mend_runner).result(timeout=10)
    ok = asyncio.run(_final(engine, "y", [3, 4], SamplingParams(max_tokens=2, ignore_eos=True)))
    assert ok.outputs[0].finish_reason == "length" and len(ok.outputs[0].token_ids) == 2
    assert _held(engine) == (False, 0)


def test_an_engine_failure_outside_a_step_kills_engine_and_fails_streams(engine):
    """What the engine cannot contain (here the scheduler itself raising) still ends it: every
    stream gets EngineDeadError, and the engine reports the error."""

    def break_scheduler(e):
        def boom(*args, **kwargs):
            raise RuntimeError("scheduler exploded")

        e.scheduler.schedule = boom

    engine.call(break_scheduler).result(timeout=10)

    async def main():
        await _final(engine, "z", [3, 4], SamplingParams(max_tokens=2))

    with pytest.raises(EngineDeadError, match="scheduler exploded"):
        asyncio.run(main())
    assert not engine.is_alive and isinstance(engine.error, RuntimeError)


def test_cuda_index_of_a_bare_cuda_device(monkeypatch):
    """The engine thread selects its GPU by index: ``torch.cuda.set_device`` refuses a bare
    ``cuda`` device (the server's engine thread died on it at start-up on every GPU), so a bare
    one resolves to the device current where the engine was built."""
    import torch

    from attnserve.engine.async_engine import cuda_index

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert cuda_index(torch.device("cuda")) == 3
    assert cuda_index(torch.device("cuda:1")) == 1
    assert cuda_index(torch.device("cpu")) is None
