"""The server's warm-up: its first request is as fast as its tenth (issue 38, point 4).

Each measurement runs in a fresh interpreter (``first_and_later``, below, as a program): in the
test process earlier tests have met every shape already, and the old code's first request was
slow only in a fresh one, as in a fresh ``attnserve serve``. The program builds the engine (on a
thread, or in its own process as ``serve`` runs it), runs the app's start-up (the lifespan, as
uvicorn does: the warm-up is part of it), then sends ten identical ``/v1/completions`` through
the ASGI transport (no socket: no TCP timing in the numbers).

On this repository's CPU machine (2 shared cores, quiet; the tiny llama, float32, 4 tokens)
before the warm-up the first request took 10-11 ms against 5.0-5.4 ms for the later ones on an
engine thread (1.9-2.1x), 11.5-13 ms against 5.5-6.8 ms in an engine process (1.9-2.1x):
prefill and decode shapes met for the first time, the sampler's paths; on the loaded machine
13-16 ms. With it, 6.7-6.8 ms against 4.9-5.0 ms (1.33-1.38x) and 7-10 ms against 5.1-6.5 ms
(1.4-1.6x): what is left is what any request pays after an idle pause (one after a second's
pause is as slow), not a first call. The bound is ``first <= 1.5 x later + 1.5 ms``, "later" the
median of requests 6-10 (the tenth alone is one sample). A loaded machine makes one request slow
at random, so a failed measurement is taken again, up to three times.

Also here: the warm-up leaves no trace (no request, block, prefix-cache entry or count).
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BODY = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 4, "min_tokens": 4,
        "temperature": 0.7, "top_p": 0.9, "seed": 7, "logprobs": 2, "presence_penalty": 0.5,
        "stop": ["\n\n"]}
SLACK_S = 0.0015


def first_and_later(model_dir: str, mode: str) -> list[float]:
    """Seconds of ten identical completions on a server built and started here (a program of
    its own: see the module docstring)."""
    import asyncio
    import time

    import httpx

    from attnserve.entrypoints.openai.api_server import build_app

    if mode == "process":
        from attnserve.engine.engine_process import EngineProcessClient as Engine
    else:
        from attnserve.engine.async_engine import AsyncLLMEngine as Engine
    engine = Engine.from_kwargs(model_dir, dtype="float32", kv_cache_memory=0.01)
    app = build_app(engine, "tiny")

    async def run() -> list[float]:
        seconds = []
        async with app.router.lifespan_context(app):  # as uvicorn starts the app
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         timeout=60) as client:
                for _ in range(10):
                    start = time.perf_counter()
                    resp = await client.post("/v1/completions", json=BODY)
                    seconds.append(time.perf_counter() - start)
                    assert resp.status_code == 200, resp.text
        return seconds

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


def _measure(model_dir: Path, mode: str) -> list[float]:
    program = ("import json, sys\nfrom tests.server.test_warmup import first_and_later\n"
               f"print(json.dumps(first_and_later({str(model_dir)!r}, {mode!r})))\n")
    # one intra-op thread: on a shared 2-core machine OpenMP's spinning threads of the engine
    # process and the frontend starve each other (every request then takes ~200 ms, first or not)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
           "ATTNSERVE_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_the_first_request_is_as_fast_as_the_tenth(model_dir, mode):
    tries = []
    for _ in range(3):
        seconds = _measure(model_dir, mode)
        first, later = seconds[0], statistics.median(seconds[5:])
        tries.append((round(first * 1e3, 2), round(later * 1e3, 2)))
        if first <= 1.5 * later + SLACK_S:
            return
    pytest.fail(f"first request vs the median of requests 6-10, ms, in each try: {tries}")


def _holdings(engine) -> dict:
    """What the engine holds, and every count behind the stats it publishes (its number
    attributes, the scheduler's stats, the runner's device wait)."""
    pool = engine.kv_manager.pool
    engine.kv_manager.check_integrity()
    counts = {k: copy.copy(v) for k, v in vars(engine).items() if isinstance(v, (int, float, list)) and not isinstance(v, bool)
              and all(isinstance(x, (int, float)) for x in (v if isinstance(v, list) else [v]))}
    return {"requests": len(engine.states) + len(engine.scheduler.requests),
            "blocks_held": pool.num_blocks - 1 - pool.num_free_blocks, "prefix_cache": len(pool.cached),
            "counts": counts, "scheduler": repr(engine.scheduler.stats),
            "device_wait": engine.runner.device_wait_seconds}


def test_the_warm_up_leaves_no_trace(model_dir):
    """Its requests ran (the engine stepped through them), and afterwards the engine holds no
    request, block or prefix-cache entry, and its counts (what ``/metrics`` shows) are as before."""
    from attnserve.engine.async_engine import AsyncLLMEngine
    from attnserve.engine.warm_up import warm_up_plan

    engine = AsyncLLMEngine.from_kwargs(str(model_dir), dtype="float32", kv_cache_memory=0.01)
    try:
        before = engine.call(_holdings).result(timeout=10)
        assert (before["requests"], before["blocks_held"], before["prefix_cache"]) == (0, 0, 0)
        assert before["counts"]["num_generation_tokens"] == 0
        steps = []

        def count_steps(e) -> None:
            step = e.step
            e.step = lambda *a, **k: steps.append(1) or step(*a, **k)

        engine.call(count_steps).result(timeout=10)
        engine.warm_up()
        plan = engine.call(warm_up_plan).result(timeout=10)
        assert plan.prefills == [*range(1, 17), 32, 64, 128, 256] and len(plan.batch) == 16
        assert len(steps) >= len(plan.prefills) + max(p.max_tokens for p in plan.batch) + len(plan.paths)
        assert engine.call(_holdings).result(timeout=10) == before
    finally:
        engine.shutdown()
