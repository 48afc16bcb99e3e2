"""A load test with injected faults (issue #24's done-when), on the in-process server.

Concurrent clients send good greedy completions (token prompts over a few shared prefixes, so
the prefix cache and the disk tier are used; some streamed) mixed with bad requests: bodies
the server must refuse (types, ranges, NaN, ids outside the vocabulary, nesting deeper than the
JSON parser's stack, lone surrogates) and poisoned prompts whose steps raise inside the runner.
Meanwhile the disk tier's directory is "full" (half of its writes fail with ENOSPC) and a thread
overwrites its files with garbage while they are read. Every good request must finish with
exactly the output of a fault-free ``LLM.generate``; a refused one gets a 4xx; a poisoned one an
error status or a choice with ``finish_reason`` "error"; the engine ends holding nothing (no
request, every block free, no state slot, no tier hold or reservation) and serves on.

Size: ``ATTNSERVE_LOAD_FAULTS=good,bad,clients`` (CI's default 64,16,16; the issue's size is
500,64,64).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import random
import threading
import time

import pytest

from attnserve.sampling_params import SamplingParams
from tests.server.conftest import MODEL_NAME
from tests.server.inprocess import InProcessServer

GOOD, BAD, CLIENTS = (int(x) for x in os.environ.get("ATTNSERVE_LOAD_FAULTS", "64,16,16").split(","))
POISON = 13  # a prompt starting with this token fails every step it is in
BAD_BODIES = [  # refused at entry: a 4xx
    {"model": MODEL_NAME, "prompt": [5, 6], "top_k": 10**19},
    {"model": MODEL_NAME, "prompt": [5, 6], "stop_token_ids": [10**19], "min_tokens": 2},
    {"model": MODEL_NAME, "prompt": [5, 99999]},
    {"model": MODEL_NAME, "prompt": [5, 6], "logprobs": 10**6},
    {"model": MODEL_NAME, "prompt": [5, 6], "n": 0},
    {"model": MODEL_NAME, "prompt": [7] * 600},
    {"model": MODEL_NAME, "prompt": [5, 6], "seed": 10**30},
    {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
]
BAD_RAW = ['{"model": "tiny", "prompt": "x", "temperature": NaN}', "[" * 50_000 + "]" * 50_000,
           '{"model": "tiny", "prompt": "a\\ud800"}', "not json"]


def _plan(seed: int) -> list[dict]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(20, 2048) for _ in range(rng.choice([16, 32, 48]))] for _ in range(6)]
    plan = []
    for _ in range(GOOD):
        prompt = rng.choice(prefixes) + [rng.randrange(20, 2048) for _ in range(rng.randint(1, 20))]
        plan.append({"kind": "good", "body": {"model": MODEL_NAME, "prompt": prompt, "temperature": 0,
                                              "max_tokens": rng.randint(1, 8), "stream": rng.random() < 0.3}})
    for i in range(BAD):
        if i % 3 == 0:
            prompt = [POISON] + rng.choice(prefixes)[:8] + [rng.randrange(20, 2048)]
            plan.append({"kind": "poison", "body": {"model": MODEL_NAME, "prompt": prompt, "temperature": 0,
                                                    "max_tokens": 4, "stream": i % 2 == 0}})
        elif i % 3 == 1:
            plan.append({"kind": "bad", "body": BAD_BODIES[i % len(BAD_BODIES)]})
        else:
            plan.append({"kind": "bad", "raw": BAD_RAW[i % len(BAD_RAW)]})
    rng.shuffle(plan)
    return plan


FAULTS = [0]


def _poison_the_runner(engine) -> None:
    """``execute`` and ``launch`` raise for any step holding a poisoned prompt."""
    runner = engine.runner
    for method in ("launch",):  # execute launches
        real = getattr(runner, method)

        def wrapped(sched_out, *a, real=real, **kw):
            if any(s.request.prompt_token_ids[:1] == [POISON] for s in sched_out.scheduled):
                FAULTS[0] += 1
                raise RuntimeError("injected fault: a poisoned request is in this step")
            return real(sched_out, *a, **kw)

        setattr(runner, method, wrapped)


class _FullDisk:
    """``os.open`` refuses (ENOSPC) half of the files created under the tier's directory."""

    def __init__(self, directory: str, seed: int):
        self.directory, self.rng, self.lock, self.refused = directory, random.Random(seed), threading.Lock(), 0
        self.real = os.open

    def __call__(self, path, flags, *a, **kw):
        # the tier creates its files relative to a descriptor of their fan-out folder (dir_fd)
        if flags & os.O_CREAT and (kw.get("dir_fd") is not None or str(path).startswith(self.directory)):
            with self.lock:
                refuse = self.rng.random() < 0.5
                self.refused += refuse
            if refuse:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return self.real(path, flags, *a, **kw)


def _corrupt_while_running(directory: str, stop: threading.Event, seed: int) -> list[int]:
    """Overwrite bytes of the tier's files, or truncate them, every few milliseconds."""
    rng, count = random.Random(seed), [0]

    def run():
        while not stop.wait(0.005):
            files = [os.path.join(root, f) for root, _, names in os.walk(directory) for f in names
                     if f.endswith(".kvb")]  # in the tier's fan-out folders; not its temporary files
            if not files:
                continue
            path = rng.choice(files)
            try:
                with open(path, "r+b") as f:
                    if rng.random() < 0.3:
                        f.truncate(rng.randrange(0, 64))
                    else:
                        f.seek(rng.randrange(0, max(1, os.path.getsize(path))))
                        f.write(rng.randbytes(16))
                count[0] += 1
            except OSError:  # replaced or removed meanwhile
                pass

    threading.Thread(target=run, daemon=True).start()
    return count


async def _send(client, item: dict) -> tuple[int, dict | list | None]:
    content = item.get("raw") or json.dumps(item["body"])
    resp = await client.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    if resp.status_code != 200:
        return resp.status_code, resp.json()
    if not resp.headers["content-type"].startswith("text/event-stream"):
        return 200, resp.json()
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", resp.text[-200:]
    return 200, [json.loads(e) for e in events[:-1]]


def _choice(result) -> tuple[str, str | None]:
    """(text, finish_reason) of a whole or streamed response; an error event gives ("", "error")."""
    if isinstance(result, dict):
        c = result["choices"][0]
        return c["text"], c["finish_reason"]
    text, reason = "", None
    for event in result:
        if "error" in event:
            return "", "error"
        for c in event["choices"]:
            text += c["text"]
            reason = c["finish_reason"] or reason
    return text, reason


@pytest.mark.slow
def test_load_with_bad_requests_a_full_disk_and_corrupt_tier_files(model_dir, reference, tmp_path, monkeypatch,
                                                                    capsys):
    plan = _plan(seed=0)
    good = [i for i, p in enumerate(plan) if p["kind"] == "good"]
    refs = reference.generate([plan[i]["body"]["prompt"] for i in good],
                              [SamplingParams(temperature=0.0, max_tokens=plan[i]["body"]["max_tokens"])
                               for i in good], use_tqdm=False)
    expected = {i: (r.outputs[0].text, r.outputs[0].finish_reason) for i, r in zip(good, refs)}

    tier_dir = str(tmp_path / "tier")
    srv = InProcessServer(model_dir, max_num_seqs=16, num_gpu_blocks_override=32, max_model_len=256,
                          kv_offloading_size=1e-3, kv_offloading_backend="disk", kv_offloading_dir=tier_dir)
    stop = threading.Event()
    try:
        srv.engine.call(_poison_the_runner).result(timeout=10)
        disk = _FullDisk(tier_dir, seed=1)
        monkeypatch.setattr(os, "open", disk)
        corrupted = _corrupt_while_running(tier_dir, stop, seed=2)

        async def drive():
            results: list = [None] * len(plan)
            queue = list(range(len(plan)))
            async with srv.client(timeout=300) as client:
                async def worker():
                    while queue:
                        i = queue.pop()
                        results[i] = await _send(client, plan[i])
                start = time.perf_counter()
                await asyncio.gather(*[worker() for _ in range(CLIENTS)])
                return results, time.perf_counter() - start

        try:
            results, elapsed = asyncio.run(asyncio.wait_for(drive(), float(os.environ.get("ATTNSERVE_LOAD_TIMEOUT", 120))))
        except TimeoutError:
            def describe(e):
                s = e.scheduler
                return {"steps": srv.engine.stats().num_steps, "waiting": len(s.waiting), "running": len(s.running),
                        "suspects": list(s.suspects)[:4], "free_blocks": e.kv_manager.pool.num_free_blocks,
                        "faults": FAULTS[0]}
            raise AssertionError(f"the load did not finish: {srv.engine.call(describe).result(timeout=10)}") from None
        stop.set()
        monkeypatch.undo()

        for i, (item, (status, result)) in enumerate(zip(plan, results)):
            if item["kind"] == "good":
                assert status == 200, f"good request {i}: {status} {result}"
                assert _choice(result) == expected[i], f"good request {i} changed: {item['body']}"
            elif item["kind"] == "bad":
                assert 400 <= status < 500, f"bad request {i}: {status} {result}"
                assert set(result["error"]) == {"message", "type", "param", "code"}
            else:  # poisoned: an error status, or a choice that failed
                assert status != 200 and status != 503 or _choice(result)[1] == "error", (status, result)
        state = srv.wait_idle(timeout=10)
        assert state == srv.IDLE
        assert srv.engine.is_alive
        tier = srv.engine.call(lambda e: e.runner.offload.tier).result(timeout=10)
        assert disk.refused > 0 and tier.failures > 0, "no fault reached the tier"
        stats = srv.engine.stats()
        with capsys.disabled():
            print(f"\n[load with faults] {GOOD} good + {BAD} bad requests from {CLIENTS} clients in "
                  f"{elapsed:.2f} s; {disk.refused} tier writes refused, {corrupted[0]} tier files corrupted, "
                  f"{tier.failures} tier failures, {stats.offload_hits} tokens loaded from the tier, "
                  f"{stats.num_preemptions} preemptions")
        # and it serves on, exactly
        i = good[0]
        status, result = asyncio.run(_once(srv, plan[i]))
        assert status == 200 and _choice(result) == expected[i]
    finally:
        stop.set()
        srv.stop()


async def _once(srv, item):
    async with srv.client() as client:
        return await _send(client, item)
