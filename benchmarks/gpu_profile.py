"""Where a step's time goes on the GPU: scheduler, runner (GPU work included), output
processing, per step; the kernels of one eager decode step (count and top self times); and,
with ``--parts nano``, the nano-vllm workload step by step (each phase synchronised, so the
sum is a little above the unprofiled run), split into decode-only and mixed steps.

    python benchmarks/gpu_profile.py [--parts 8b small nano] [--old-small-kernels]

``--old-small-kernels``: TRITON_ATTN as before issue #21's fusions (RoPE, then the KV write;
split-KV decode merged by a second kernel), to time the engine both ways on one branch.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from attnserve import LLM, SamplingParams  # noqa: E402
from attnserve.presets import resolve_config_path  # noqa: E402


def model_dir(name: str) -> str:
    d = tempfile.mkdtemp()
    shutil.copy(resolve_config_path(name), Path(d) / "config.json")
    return d


def phases(llm: LLM, batch: int, prompt_len: int, steps: int = 20) -> dict:
    eng = llm.llm_engine
    rng = random.Random(0)
    for _ in range(batch):
        eng.add_request(None, {"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(prompt_len)]},
                        SamplingParams(temperature=0.0, max_tokens=steps + 50, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()
    acc = {"schedule": 0.0, "execute": 0.0, "update": 0.0}
    sched, runner = eng.scheduler, eng.runner
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        res = runner.execute(out)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        sched.update(out, res.sampled)
        t3 = time.perf_counter()
        acc["schedule"] += t1 - t0
        acc["execute"] += t2 - t1
        acc["update"] += t3 - t2
    eng.abort_request(list(eng.states))
    return {k: 1e3 * v / steps for k, v in acc.items()}


def kernels_per_step(llm: LLM, prompt_len: int = 128) -> None:
    from torch.profiler import ProfilerActivity, profile

    eng = llm.llm_engine
    eng.add_request("p", {"prompt_token_ids": list(range(1000, 1000 + prompt_len))},
                    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for _ in range(5):
        eng.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            eng.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.count for e in events) / 3
    print(f"kernels per eager decode step: {total:.0f}")
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60)
    print(table)
    eng.abort_request(list(eng.states))


class PhaseTimer:
    """Wraps methods so each call's time (device synchronised before and after) adds to a phase."""

    def __init__(self) -> None:
        self.times: dict[str, float] = collections.defaultdict(float)
        self.last_schedule = None

    def wrap(self, obj, attr: str, phase: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            torch.cuda.synchronize()
            t = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                torch.cuda.synchronize()
                self.times[phase] += time.perf_counter() - t
            if phase == "schedule":
                self.last_schedule = out
            return out

        setattr(obj, attr, timed)


def nano_phases(llm: LLM, reqs, top: int = 12) -> dict:
    """Run the nano-vllm workload one engine step at a time with every phase timed."""
    eng = llm.llm_engine
    runner = eng.runner
    timer = PhaseTimer()
    timer.wrap(eng.scheduler, "schedule", "schedule")
    timer.wrap(runner, "_prepare", "prepare")
    if runner.graphs is not None:
        timer.wrap(runner.graphs, "run", "graph_replay")
    timer.wrap(runner.model, "forward", "eager_forward")
    timer.wrap(runner.model, "compute_logits", "logits")
    timer.wrap(runner, "_sample", "sample")
    timer.wrap(runner, "collect", "collect")
    timer.wrap(eng.scheduler, "update", "update")
    compiled: list[str] = []  # Triton kernels compiled during the run (each costs ~1 s there)
    try:
        from triton import knobs

        def on_compile(*, fn, **_):
            compiled.append(fn.name)

        knobs.runtime.jit_post_compile_hook = on_compile
    except ImportError:
        pass
    for p, o in reqs:
        eng.add_request(None, {"prompt_token_ids": p},
                        SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=False))
    per_kind: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    steps = []
    start = time.perf_counter()
    while eng.has_unfinished_requests():
        before = dict(timer.times)
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step(final_only=True)
        torch.cuda.synchronize()
        total = time.perf_counter() - t
        out = timer.last_schedule
        n_req = len(out.scheduled)
        n_tok = out.num_tokens
        kind = "decode" if n_tok == n_req else "mixed"
        k = per_kind[kind]
        k["steps"] += 1
        k["total"] += total
        inner = 0.0
        for phase, v in timer.times.items():
            d = v - before.get(phase, 0.0)
            k[phase] += d
            inner += d
        k["other"] += total - inner
        steps.append((total, kind, n_req, n_tok))
    elapsed = time.perf_counter() - start
    print(f"nano workload, profiled: {elapsed:.2f} s, {len(steps)} steps; Triton compiles during it: "
          f"{len(compiled)} {sorted(set(compiled))}", flush=True)
    phases_order = ["schedule", "prepare", "graph_replay", "eager_forward", "logits", "sample", "collect", "update",
                    "other"]
    print("| kind | steps | total s | " + " | ".join(f"{p} ms/step" for p in phases_order) + " |")
    for kind, k in per_kind.items():
        n = k["steps"]
        print(f"| {kind} | {n:.0f} | {k['total']:.2f} | "
              + " | ".join(f"{1e3 * k[p] / n:.2f}" for p in phases_order) + " |")
    by_batch = collections.defaultdict(list)
    for total, kind, n_req, _ in steps:
        if kind == "decode":
            by_batch[min(256, 32 * (1 + (n_req - 1) // 32))].append(total)
    print("decode step ms by batch (<= bucket):",
          {b: round(1e3 * sum(v) / len(v), 2) for b, v in sorted(by_batch.items())})
    print("slowest steps (ms, kind, requests, tokens):",
          [(round(1e3 * t, 1), kind, r, n) for t, kind, r, n in sorted(steps, reverse=True)[:top]])
    return {"elapsed_s": elapsed, "steps": len(steps),
            "per_kind": {k: dict(v) for k, v in per_kind.items()}}


def graph_kernels(llm: LLM, batch: int, prompt_len: int, steps: int = 3) -> None:
    """The kernels inside decode-graph replays at this batch (torch.profiler), by CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    eng = llm.llm_engine
    rng = random.Random(1)
    for _ in range(batch):
        eng.add_request(None, {"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(prompt_len)]},
                        SamplingParams(temperature=0.0, max_tokens=steps + 20, ignore_eos=True, detokenize=False))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()
    for _ in range(3):
        eng.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    print(f"batch {batch}, context ~{prompt_len}: kernels in {steps} decode steps")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=70))
    eng.abort_request(list(eng.states))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="+", default=["8b", "small"], choices=["8b", "small", "nano"])
    ap.add_argument("--old-small-kernels", action="store_true",
                    help="TRITON_ATTN without the fused RoPE write (RoPE, then the cache write)")
    ap.add_argument("--split-merge", choices=("kernel", "last_split"), default=None,
                    help="TRITON_ATTN's split merge (default: the backend's)")
    args = ap.parse_args()
    from attnserve.attention.backends.triton_attn import TritonAttentionBackend

    if args.old_small_kernels:  # a benchmark's switch: class attributes the backend reads
        TritonAttentionBackend.fuses_rope = False
    if args.split_merge:
        TritonAttentionBackend.split_merge = args.split_merge
    print("TRITON_ATTN small kernels:", "RoPE then write" if args.old_small_kernels else "RoPE in the write",
          f"split merge: {TritonAttentionBackend.split_merge}", flush=True)
    if "nano" in args.parts:
        import gpu_engine

        q = model_dir("Qwen/Qwen3-0.6B")
        # the phases are timed one after another: async scheduling off (its overlap is what
        # gpu_engine.py measures)
        llm = LLM(q, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=256,
                  max_num_batched_tokens=16384, gpu_memory_utilization=0.85, async_scheduling=False)
        reqs = gpu_engine.workload()
        warm = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=False) for _, o in reqs[:8]]
        llm.generate([{"prompt_token_ids": p} for p, _ in reqs[:8]], warm)
        nano_phases(llm, reqs)
        graph_kernels(llm, 256, 700)
        del llm
        torch.cuda.empty_cache()
    if "8b" in args.parts:
        _main_8b()
    if "small" in args.parts:
        _main_small()


def _main_8b() -> None:
    d8 = model_dir("meta-llama/Llama-3.1-8B-Instruct")
    llm = LLM(d8, load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=8,
              gpu_memory_utilization=0.8, async_scheduling=False)
    print("8B batch 1, graphs:", phases(llm, 1, 128), flush=True)
    graph_kernels(llm, 1, 128)
    del llm
    torch.cuda.empty_cache()
    eager = LLM(d8, load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=8,
                gpu_memory_utilization=0.8, enforce_eager=True, async_scheduling=False)
    print("8B batch 1, eager:", phases(eager, 1, 128), flush=True)
    kernels_per_step(eager)
    del eager
    torch.cuda.empty_cache()


def _main_small() -> None:
    q = model_dir("Qwen/Qwen3-0.6B")
    small = LLM(q, load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=256,
                max_num_batched_tokens=16384, gpu_memory_utilization=0.8, async_scheduling=False)
    for b in (1, 64, 256):
        print(f"Qwen3-0.6B batch {b}, graphs:", phases(small, b, 512), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
