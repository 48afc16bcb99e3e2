"""The per-step cost of the engine process's IPC (``engine/engine_process.py``), on the CPU.

A step of ``--num-requests`` running requests, each ``--context`` output tokens in, each getting
one token (and a few characters of text, and ``--logprobs`` entries when asked): what the engine
process and its frontend pay to move that step's outputs. The engine's request states
(``RequestState``) are real, their requests stand-ins. Each phase is timed alone, as the code
runs it. In the engine process, two ways:

- now: ``RequestState.to_delta`` per request (the loop thread, ``LLMEngine.step(deltas=True)``),
  keyed for the frontend, then pickling (the sender thread);
- before (issue #21): ``RequestState.to_output`` (a cumulative output per request and step),
  ``OutputEncoder.encode`` (diffing it against what was sent), then pickling.

Then the pipe (a real one, to a reader thread), unpickling, and rebuilding the cumulative
outputs (the frontend's reader thread, the same for both). The last line pickles whole
cumulative outputs instead, for comparison (what deltas avoid: its cost grows with the context).

    PYTHONPATH=src python benchmarks/cpu_engine_ipc.py [--num-requests 256] [--context 500] [--logprobs 0]

Measured (a shared 2-core VM, about 2.5x slower than a current server core on a pure-Python loop;
medians): see the numbers at the end of docs/performance.md's engine-process section (issue #21).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import pickle
import statistics
import threading
import time
from types import SimpleNamespace

from attnserve.engine.engine_process import StepMessage
from attnserve.engine.output_deltas import OutputAssembler, OutputEncoder
from attnserve.engine.output_processor import CompletionState, RequestState
from attnserve.outputs import Logprob


def _states(n: int, context: int, num_logprobs: int) -> list[RequestState]:
    """``n`` running requests, ``context`` output tokens each (what the engine holds of them)."""
    states = []
    for i in range(n):
        request = SimpleNamespace(output_token_ids=[(7 * i + j) % 30000 for j in range(context)],
                                  num_cached_tokens=16, first_scheduled_time=1.1)
        c = CompletionState(request, 0, None, text="abcd" * context)
        if num_logprobs:
            c.logprobs = [_entry(t, num_logprobs) for t in request.output_token_ids]
            c.cumulative_logprob = -1.5 * context
        state = RequestState(f"r{i}", None, list(range(100, 612)), [c], None, arrival_time=1.0,
                             first_token_time=1.2, last_token_time=2.0)
        states.append(state)
    return states


def _entry(t: int, num_logprobs: int) -> dict[int, Logprob]:
    return {t: Logprob(-0.5, 1, "tok")} | {t + k: Logprob(-2.0 - k, k + 1, "x") for k in range(1, num_logprobs)}


def _advance(states: list[RequestState], step: int, num_logprobs: int) -> None:
    """Each request gets a token, its text and its logprob entry (the engine's own work: untimed)."""
    for state in states:
        c = state.completions[0]
        c.request.output_token_ids.append(step)
        c.text += " wxy"
        if num_logprobs:
            c.logprobs.append(_entry(step, num_logprobs))
        state.last_token_time += 0.01


def _new_path(states: list[RequestState]) -> StepMessage:
    # as _EngineLoop._step: the engine's deltas, keyed by the frontend's number for the request
    return StepMessage([(key, *state.to_delta()[1:]) for key, state in enumerate(states)])


def _old_path(states: list[RequestState], encoder: OutputEncoder) -> StepMessage:
    outs = [state.to_output() for state in states]
    return StepMessage([encoder.encode(key, out) for key, out in enumerate(outs)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--context", type=int, default=500, help="output tokens each request has so far")
    ap.add_argument("--logprobs", type=int, default=0, help="logprob entries per token (0: none)")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    n = args.num_requests
    states = _states(n, args.context, args.logprobs)
    gc.collect()
    gc.freeze()  # the synthetic history above is no part of the cost (nor of a frontend's heap)
    encoder, assemblers = OutputEncoder(), {}
    _old_path(states, encoder)
    for d in _new_path(states).deltas:  # the prompts, sent once, are not part of a steady step
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
    phases = ("new: to_delta", "new: pickle", "pipe", "unpickle", "rebuild", "old: to_output", "old: encode",
              "old: pickle")
    t: dict[str, list[float]] = {k: [] for k in phases}
    size = 0
    for step in range(args.steps):
        _advance(states, step, args.logprobs)
        t0 = time.perf_counter()
        msg = _new_path(states)
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
        outs = [state.to_output() for state in states]
        t6 = time.perf_counter()
        old = StepMessage([encoder.encode(key, out) for key, out in enumerate(outs)])
        t7 = time.perf_counter()
        pickle.dumps(old, protocol=5)
        t8 = time.perf_counter()
        assert msg.deltas == old.deltas
        ts = (t0, t1, t2, t3, t4, t5, t6, t7, t8)
        for k, a, b in zip(phases, ts, ts[1:]):
            t[k].append(b - a)
        size += len(data)
        del outs, old, msg  # the old path's garbage is no part of the next step's new path
        gc.collect(0)
    writer_conn.send_bytes(b"")
    med = {k: statistics.median(v) for k, v in t.items()}
    print(f"{n} requests, {args.context} output tokens each, logprobs {args.logprobs}: "
          f"{size / args.steps / 1024:.1f} KiB per step; median of {args.steps} steps (the machine may be shared)")
    for k, v in med.items():
        print(f"  {k:15s} {v * 1e6:8.0f} us per step  {v / n * 1e6:6.2f} us per request")
    old_engine = med["old: to_output"] + med["old: encode"] + med["old: pickle"]
    new_engine = med["new: to_delta"] + med["new: pickle"]
    print(f"  engine process, per request per step: before {old_engine / n * 1e6:.2f} us (to_output + encode + "
          f"pickle), now {new_engine / n * 1e6:.2f} us (to_delta + pickle)")
    print(f"  frontend, per request per step: {(med['unpickle'] + med['rebuild']) / n * 1e6:.2f} us")
    some = [[state.to_output() for state in states] for _ in range(3)]
    t0 = time.perf_counter()
    whole = sum(len(pickle.dumps(outs, protocol=5)) for outs in some)
    dt = (time.perf_counter() - t0) / len(some)
    print(f"  whole cumulative outputs instead: pickling alone {dt * 1e6:.0f} us per step, "
          f"{whole / len(some) / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
