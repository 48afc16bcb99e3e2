"""Where the GPU time of the nano-vllm workload goes: the whole run under ``torch.profiler``,
kernels summed by name and by kind, against the wall time.

The workload and engine options are ``gpu_engine.py``'s (Qwen3-0.6B shape, dummy bf16
weights, 256 requests, lengths uniform in 100..1024, the platform's default batch limits,
async scheduling). The run is timed once unprofiled, then once profiled (CUDA activity
only), which says:

- the GPU busy time (kernels and copies, overlaps merged) over the wall time: how far the
  run is from GPU-bound;
- the kernels by kind (decode / prefill attention, GEMMs, RoPE + KV write, norms, the
  activation, sampling, copies, the rest) and the top kernels by total time.

    python benchmarks/gpu_nano_kernels.py [--top 25] [--json out.json]
    python benchmarks/gpu_nano_kernels.py --min-splits 1 2 4 --no-profile   # split-KV decode A/B

Writes gpu_nano_kernels.json under $OUT when set. Not here: the host's phases
(``gpu_profile.py --parts nano``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gpu_engine import model_dir, workload  # noqa: E402

from attnserve import LLM, SamplingParams  # noqa: E402

# (kind, substrings of the kernel name, lower case); the first match wins
KINDS = (
    ("copy/memset", ("memcpy", "memset")),
    ("attention decode", ("_paged_decode", "decode_kernel", "split_merge", "_merge")),
    ("attention prefill", ("prefill", "_fwd_kernel", "flash", "fmha", "attention")),
    ("rope+kv write", ("rope", "kv_write", "reshape_and_cache", "rotary")),
    ("gemm", ("gemm", "cutlass", "sm90_xmma", "cublas", "splitk", "matmul", "nvjet")),
    ("norm", ("rms", "norm")),
    ("activation", ("act_and_mul", "silu", "gelu")),
    ("sampling", ("argmax", "sample", "topk", "softmax", "max_", "reduce")),
    ("elementwise", ("elementwise", "vectorized", "index", "gather", "scatter", "cat", "fill")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (us)."""
    total, end = 0.0, -1.0
    for s, e in sorted(intervals):
        if s >= end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def force_min_splits(n: int) -> None:
    """Decode launches split the KV of each (request, KV head) at least ``n`` ways (a power of
    two, at least one 64-key tile a split): the splits a CUDA graph bakes in at capture follow."""
    from attnserve.ops.attention import paged_triton as tpa

    base = getattr(tpa, "_nano_base_pick", tpa.pick_num_splits)
    tpa._nano_base_pick = base

    def pick(num_seqs, num_kv_heads, max_query_len, max_seq_len, device):
        splits = base(num_seqs, num_kv_heads, max_query_len, max_seq_len, device)
        if max_query_len != 1 or n <= 1:
            return splits
        forced = min(n, max(1, max_seq_len // 64))
        return max(splits, 1 << (forced.bit_length() - 1))

    tpa.pick_num_splits = pick


def timed_run(reqs) -> tuple[LLM, float, int]:
    """A fresh engine (graphs captured now), warmed up; the workload's wall time and tokens."""
    llm = LLM(model_dir("Qwen/Qwen3-0.6B"), load_format="dummy", dtype="bfloat16", max_model_len=4096)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=False) for _, o in reqs]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return llm, time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-splits", type=int, nargs="+", default=[],
                    help="also time the workload with decode KV split at least N ways, a fresh engine each")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    reqs = workload(args.num_requests, 100, 1024, 151936)
    split_rows = []
    for n in args.min_splits:
        force_min_splits(n)
        llm, secs, toks = timed_run(reqs)
        split_rows.append({"min_splits": n, "s": secs, "tokens": toks, "tok_s": toks / secs})
        print(f"min splits {n}: {toks / secs:,.0f} tok/s ({secs:.2f} s)", flush=True)
        del llm
        torch.cuda.empty_cache()
    if args.no_profile:
        out = args.json or (os.path.join(os.environ["OUT"], "gpu_nano_kernels.json") if os.environ.get("OUT") else None)
        if out:
            Path(out).write_text(json.dumps({"min_splits": split_rows}, indent=1))
        return
    force_min_splits(1)
    llm, plain_s, tokens = timed_run(reqs)
    stats = llm.llm_engine.scheduler.stats
    steps0 = stats.steps
    from torch.profiler import ProfilerActivity, profile

    # a second draw of the same mix, so that the prefix cache does not skip its prefill
    reqs2 = workload(args.num_requests, 100, 1024, 151936, seed=1)
    prompts2 = [{"prompt_token_ids": p} for p, _ in reqs2]
    params2 = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=False) for _, o in reqs2]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        outs2 = llm.generate(prompts2, params2, use_tqdm=False)
        torch.cuda.synchronize()
        prof_s = time.perf_counter() - t
    steps = stats.steps - steps0
    tokens2 = sum(len(o.outputs[0].token_ids) for o in outs2)
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    intervals = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        dur = ev.time_range.end - ev.time_range.start
        intervals.append((ev.time_range.start, ev.time_range.end))
        rec = by_name[ev.name]
        rec[0] += dur
        rec[1] += 1
    gpu_us = busy_us(intervals)
    kernel_us = sum(v[0] for v in by_name.values())
    by_kind: dict[str, float] = collections.defaultdict(float)
    for name, (us, _) in by_name.items():
        by_kind[kind_of(name)] += us
    print(f"\nnano workload: {tokens} output tokens; unprofiled {plain_s:.2f} s = {tokens / plain_s:,.0f} tok/s; "
          f"profiled (another draw, {tokens2} tokens) {prof_s:.2f} s = {tokens2 / prof_s:,.0f} tok/s, {steps} steps")
    print(f"GPU busy (union) {gpu_us / 1e6:.2f} s = {gpu_us / 1e6 / prof_s:.1%} of the profiled wall time; "
          f"kernel time summed {kernel_us / 1e6:.2f} s; per step {gpu_us / max(steps, 1):.0f} us busy, "
          f"{prof_s * 1e6 / max(steps, 1):.0f} us wall")
    print("\n| kind | s | % of kernel time |\n| --- | ---: | ---: |")
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {us / 1e6:.3f} | {us / kernel_us:.1%} |")
    print("\n| kernel | kind | calls | total ms | avg us | % |\n| --- | --- | ---: | ---: | ---: | ---: |")
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[: args.top]
    for name, (us, n) in top:
        print(f"| {name[:90]} | {kind_of(name)} | {n} | {us / 1e3:.1f} | {us / n:.1f} | {us / kernel_us:.1%} |")
    result = {"min_splits": split_rows, "tokens": tokens, "plain_s": plain_s, "tok_s": tokens / plain_s, "profiled_s": prof_s,
              "steps": steps, "gpu_busy_s": gpu_us / 1e6, "kernel_s": kernel_us / 1e6,
              "by_kind_s": {k: v / 1e6 for k, v in by_kind.items()},
              "top": [{"name": n, "total_ms": us / 1e3, "calls": c} for n, (us, c) in top]}
    out = args.json or (os.path.join(os.environ["OUT"], "gpu_nano_kernels.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
