"""The per-step cost of the engine process's IPC (``engine/engine_process.py``), on the CPU.

A step of ``--num-requests`` running requests, each ``--context`` output tokens in, each getting
one token (and a few characters of text, and ``--logprobs`` entries when asked): what the engine
process and its frontend pay to move that step's outputs. Each phase is timed alone, as the
code runs it: delta encoding (the child's sender thread), pickling, the pipe (a real one, to a
reader thread), unpickling, and rebuilding the cumulative outputs (the frontend's reader
thread). The last line pickles whole cumulative outputs instead, for comparison (what deltas
avoid: its cost grows with the context).

    PYTHONPATH=src python benchmarks/cpu_engine_ipc.py [--num-requests 256] [--context 500] [--logprobs 0]

Measured (a shared 2-core VM, about 2.5x slower than a current server core on a pure-Python loop;
medians): 256 requests at 500 tokens, no logprobs: 24 KiB per step; encode 1.8 ms, pickle 0.55,
pipe 0.45, unpickle 0.6, rebuild 2.0: 5.4 ms per step (21 us per request), about 2.4 ms of it in
the engine process's sender thread and 2.7 ms in the frontend's reader thread. With 5 logprobs:
50 KiB, 13.7 ms (53 us per request). Pickling the whole cumulative outputs instead: 14 ms per
step without logprobs (1.3 MiB), 4.5 s with 5 (24 MiB).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import pickle
import statistics
import threading
import time

from attnserve.engine.engine_process import _build_message
from attnserve.engine.output_deltas import OutputAssembler, OutputEncoder
from attnserve.outputs import CompletionOutput, Logprob, RequestOutput


def _output(rid: str, prompt: list[int], tokens: list[int], text: str, logprobs: list | None) -> RequestOutput:
    c = CompletionOutput(0, text, list(tokens), -1.5 * len(tokens) if logprobs is not None else None,
                         list(logprobs) if logprobs is not None else None)
    metrics = {"arrival_time": 1.0, "scheduled_time": 1.1, "time_to_first_token": 0.2,
               "first_token_time": 1.2, "last_token_time": 2.0}
    return RequestOutput(rid, None, prompt, None, [c], False, 16, metrics)


def _steps(n: int, context: int, num_logprobs: int, num_steps: int) -> list[list[RequestOutput]]:
    """Each step's outputs, as the engine makes them: fresh cumulative objects every step."""
    prompts = [list(range(100, 612)) for _ in range(n)]
    tokens = [[(7 * i + j) % 30000 for j in range(context)] for i in range(n)]
    texts = ["abcd" * context for _ in range(n)]
    entry = lambda t: {t: Logprob(-0.5, 1, "tok")} | {t + k: Logprob(-2.0 - k, k + 1, "x") for k in range(1, num_logprobs)}  # noqa: E731
    logprobs = [[entry(t) for t in toks] if num_logprobs else None for toks in tokens]
    steps = []
    for s in range(num_steps):
        outs = []
        for i in range(n):
            tokens[i].append(s)
            texts[i] += " wxy"
            if logprobs[i] is not None:
                logprobs[i].append(entry(s))
            outs.append(_output(f"r{i}", prompts[i], tokens[i], texts[i], logprobs[i]))
        steps.append(outs)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--context", type=int, default=500, help="output tokens each request has so far")
    ap.add_argument("--logprobs", type=int, default=0, help="logprob entries per token (0: none)")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    steps = _steps(args.num_requests, args.context, args.logprobs, args.steps + 1)
    gc.collect()
    gc.freeze()  # the millions of synthetic objects above are no part of the cost (nor of a frontend's heap)
    encoder, assemblers = OutputEncoder(), {}
    first = _build_message(encoder, {i: (o, None) for i, o in enumerate(steps[0])}, [], None)
    for d in first.deltas:  # the prompts, sent once, are not part of a steady step
        assemblers.setdefault(d[0], OutputAssembler(f"r{d[0]}")).apply(d)

    reader_conn, writer_conn = multiprocessing.Pipe(duplex=False)
    received: list[bytes] = []
    got = threading.Semaphore(0)

    def read() -> None:
        while True:
            data = reader_conn.recv_bytes()
            if not data:
                return
            received.append(data)
            got.release()

    threading.Thread(target=read, daemon=True).start()
    t: dict[str, list[float]] = {k: [] for k in ("encode", "pickle", "pipe", "unpickle", "rebuild", "total")}
    size = 0
    for outs in steps[1:]:
        t0 = time.perf_counter()
        msg = _build_message(encoder, {i: (o, None) for i, o in enumerate(outs)}, [], None)
        t1 = time.perf_counter()
        data = pickle.dumps(msg, protocol=5)
        t2 = time.perf_counter()
        writer_conn.send_bytes(data)
        got.acquire()
        t3 = time.perf_counter()
        msg = pickle.loads(received.pop())
        t4 = time.perf_counter()
        for d in msg.deltas:
            assemblers[d[0]].apply(d)
        t5 = time.perf_counter()
        for k, dt in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0)):
            t[k].append(dt)
        size += len(data)
    writer_conn.send_bytes(b"")
    n = args.steps
    print(f"{args.num_requests} requests, {args.context} output tokens each, logprobs {args.logprobs}: "
          f"{size / n / 1024:.1f} KiB per step; median of {n} steps (the machine may be shared)")
    for k, v in t.items():
        print(f"  {k:9s} {statistics.median(v) * 1e6:8.0f} us per step")
    print(f"  per request: {statistics.median(t['total']) / args.num_requests * 1e6:.2f} us")
    some = steps[1:4]
    t0 = time.perf_counter()
    whole = sum(len(pickle.dumps(outs, protocol=5)) for outs in some)
    dt = (time.perf_counter() - t0) / len(some)
    print(f"  whole cumulative outputs instead: pickling alone {dt * 1e6:.0f} us per step, "
          f"{whole / len(some) / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
