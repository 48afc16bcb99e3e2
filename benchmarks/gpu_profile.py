"""Where a decode step's time goes on the GPU: scheduler, runner (GPU work included), output
processing, per step; and the kernels of one eager decode step (count and top self times).

    python benchmarks/gpu_profile.py
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

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


def main() -> None:
    d8 = model_dir("meta-llama/Llama-3.1-8B-Instruct")
    llm = LLM(d8, load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=8,
              gpu_memory_utilization=0.8)
    print("8B batch 1, graphs:", phases(llm, 1, 128), flush=True)
    del llm
    torch.cuda.empty_cache()
    eager = LLM(d8, load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=8,
                gpu_memory_utilization=0.8, enforce_eager=True)
    print("8B batch 1, eager:", phases(eager, 1, 128), flush=True)
    kernels_per_step(eager)
    del eager
    torch.cuda.empty_cache()
    q = model_dir("Qwen/Qwen3-0.6B")
    small = LLM(q, load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=256,
                max_num_batched_tokens=16384, gpu_memory_utilization=0.8)
    for b in (1, 64, 256):
        print(f"Qwen3-0.6B batch {b}, graphs:", phases(small, b, 512), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
