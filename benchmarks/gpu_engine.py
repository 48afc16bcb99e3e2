"""Engine benchmarks on one GPU: Llama-3.1-8B-shaped latency at batch 1, and the nano-vllm
throughput workload (Qwen3-0.6B shape, 256 requests, input and output lengths uniform in
100..1024, random token ids, EOS ignored) against transformers ``generate`` in the same run.

Both models use random (dummy) weights in bfloat16. The latency figure is compared with the
bandwidth floor of the bytes a decode step must read (weights without the input embedding,
plus the KV cache), at the measured 4.25 TB/s copy bandwidth (``ceilings.NOMINAL_BW``).

The throughput run uses the engine's platform defaults for the batch limits (what ``LLM(model)``
gets, issue #21's "no tuning flags"); ``--max-num-seqs`` / ``--max-num-batched-tokens`` set
them instead (the earlier tuned figures: 256 and 16384).

    python benchmarks/gpu_engine.py [--skip-hf] [--max-num-seqs N] [--max-num-batched-tokens N] [--json out.json]

``--small-m-gemv on,off`` runs the latency rows once per setting of the fused small-M linears
(``disabled_kernels=("triton_gemv",)`` for off, read when each ``LLM`` is built), as ``latency_8b_gemv_on`` /
``latency_8b_gemv_off`` (a single setting keeps the plain row names):

    python benchmarks/gpu_engine.py --skip-nano --skip-sync --small-m-gemv on,off
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from ceilings import NOMINAL_BW

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from attnserve import LLM, SamplingParams  # noqa: E402
from attnserve.presets import resolve_config_path  # noqa: E402


def small_m_gemv(setting: str | None) -> tuple[str, ...]:
    """The engine's ``disabled_kernels`` for a setting of the fused small-M linears ("off": the
    ``triton_gemv`` variant of ``dense.small_m`` turned off; "on" or None: the plan's choice)."""
    return ("triton_gemv",) if setting == "off" else ()


def model_dir(name: str) -> str:
    d = tempfile.mkdtemp(prefix="attnserve_bench_")
    shutil.copy(resolve_config_path(name), Path(d) / "config.json")
    return d


def latency_8b(input_len: int = 128, output_len: int = 256, async_scheduling: bool | None = None,
               gemv: str | None = None) -> dict:
    """``gemv``: "off" builds the engine with ``disabled_kernels=("triton_gemv",)`` (None, "on": the plan's choice)."""
    d = model_dir("meta-llama/Llama-3.1-8B-Instruct")
    llm = LLM(d, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=8, gpu_memory_utilization=0.85,
              async_scheduling=async_scheduling, disabled_kernels=small_m_gemv(gemv))
    cfg = json.loads((Path(d) / "config.json").read_text())
    params = sum(p.numel() for p in llm.llm_engine.runner.model.parameters())
    weight_bytes = (params - cfg["vocab_size"] * cfg["hidden_size"]) * 2  # the input embedding is not read
    prompt = {"prompt_token_ids": random.Random(0).choices(range(1000, 100000), k=input_len)}
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))  # warm-up
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompt, sp)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    elapsed = sorted(times)[1]
    # decode tokens/s: subtract one prefill (measured separately)
    t = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    torch.cuda.synchronize()
    prefill = time.perf_counter() - t
    decode_tps = (output_len - 1) / (elapsed - prefill)
    kv_bytes = (input_len + output_len / 2) * 32 * 8 * 128 * 2 * 2
    floor_s = (weight_bytes + kv_bytes) / NOMINAL_BW
    async_scheduling = llm.llm_engine.async_scheduling
    del llm
    torch.cuda.empty_cache()
    return {"params": params, "weight_bytes": weight_bytes, "request_s": elapsed, "prefill_s": prefill,
            "decode_tok_s": decode_tps, "floor_tok_s": 1 / floor_s, "fraction_of_floor": decode_tps * floor_s,
            "async_scheduling": async_scheduling, "small_m_gemv": gemv or "default"}


def _count_compiles(stop: bool = False) -> list[str]:
    """Names of the Triton kernels compiled from now on (a compile inside a timed run costs
    about a second on the H200); ``stop`` removes the hook."""
    from triton import knobs

    if stop:
        knobs.runtime.jit_post_compile_hook = None
        return []
    names: list[str] = []
    knobs.runtime.jit_post_compile_hook = lambda *, fn, **_: names.append(fn.name)
    return names


def workload(n: int = 256, lo: int = 100, hi: int = 1024, vocab: int = 151936, seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(1000, vocab - 1000) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi))
            for _ in range(n)]


def throughput_attnserve(reqs, async_scheduling: bool | None = None, max_num_seqs: int | None = None,
                         max_num_batched_tokens: int | None = None) -> dict:
    """The workload through ``LLM.generate``; the batch limits are the engine's defaults unless
    given (the figure a user gets with no flags)."""
    d = model_dir("Qwen/Qwen3-0.6B")
    llm = LLM(d, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens, async_scheduling=async_scheduling)
    sched = llm.llm_engine.config.scheduler
    batch_limits = llm.llm_engine.parts.batch_limits.describe()
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    # token ids out, as nano-vllm's benchmark counts them: with dummy weights and the byte
    # tokenizer nearly every id is U+FFFD, which incremental detokenisation re-decodes per step
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=False) for _, o in reqs]
    llm.generate(prompts[:8], params[:8])  # warm-up
    stats = llm.llm_engine.scheduler.stats
    steps0, preempt0 = stats.steps, stats.num_preemptions  # the warm-up's, left out below
    compiled = _count_compiles()
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    _count_compiles(stop=True)
    llm_async = llm.llm_engine.async_scheduling
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm
    torch.cuda.empty_cache()
    return {"elapsed_s": elapsed, "output_tokens": out_tokens, "tok_s": out_tokens / elapsed,
            "steps": stats.steps - steps0, "preemptions": stats.num_preemptions - preempt0,
            "async_scheduling": llm_async, "triton_compiles_in_run": compiled,
            "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
            "batch_limits": batch_limits}


def throughput_hf_continuous(reqs, budget_s: float = 200.0) -> dict:
    """transformers' continuous batching (``ContinuousBatchingManager``, what ``generate_batch``
    runs) on the same workload, each request with its own ``max_new_tokens``, EOS disabled, SDPA
    attention. Stopped after ``budget_s``: the rate then counts finished requests only."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    cfg = AutoConfig.from_pretrained(str(Path(model_dir("Qwen/Qwen3-0.6B"))))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    gen = GenerationConfig(max_new_tokens=max(o for _, o in reqs), do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    useful, done = 0, 0
    try:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for p, o in reqs:
            manager.add_request(p, max_new_tokens=o)
        while done < len(reqs) and time.perf_counter() - t < budget_s:
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                useful += len(r.generated_tokens)
                done += 1
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
    finally:
        manager.stop(block=True, timeout=30)
    del model
    return {"elapsed_s": elapsed, "useful_output_tokens": useful, "tok_s": useful / elapsed,
            "finished": done, "complete": done == len(reqs),
            "note": None if done == len(reqs) else f"stopped after {budget_s:.0f} s ({done} finished)"}


def throughput_hf(reqs, batch: int = 256, budget_s: float = 150.0) -> dict:
    """transformers ``generate`` on the same workload, batched and left-padded; each batch runs
    to its longest output. Stopped after ``budget_s``: the useful tokens are then those of the
    steps that ran (a row is useful while it is within its own output length), which leaves
    out the batch's tail, where few rows are still useful: the rate is an upper bound."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        StoppingCriteria,
        StoppingCriteriaList,
    )

    class Deadline(StoppingCriteria):
        def __init__(self, t_end: float):
            self.t_end, self.steps = t_end, 0

        def __call__(self, input_ids, scores, **kwargs):
            self.steps += 1
            done = time.perf_counter() > self.t_end
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    cfg = AutoConfig.from_pretrained(str(Path(model_dir("Qwen/Qwen3-0.6B"))))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    useful, complete = 0, True
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):  # left padding
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        new = max(o for _, o in chunk)
        deadline = Deadline(t + budget_s)
        with torch.inference_mode():
            out = model.generate(ids.cuda(), attention_mask=mask.cuda(), do_sample=False, max_new_tokens=new,
                                 min_new_tokens=new, stopping_criteria=StoppingCriteriaList([deadline]))
        steps = out.shape[1] - width
        useful += sum(min(o, steps) for _, o in chunk)
        if steps < new:
            complete = False
            break
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    return {"elapsed_s": elapsed, "useful_output_tokens": useful, "tok_s": useful / elapsed, "batch": batch,
            "complete": complete, "note": None if complete else f"stopped after {budget_s:.0f} s (upper bound)"}


def latency_steps(args) -> list:
    """(name, fn) of the latency rows: async, and sync unless --skip-sync; once per
    --small-m-gemv setting (suffixed ``_gemv_on`` / ``_gemv_off`` when there are several)."""
    settings = args.small_m_gemv.split(",") if args.small_m_gemv else [None]
    if any(g not in (None, "on", "off") for g in settings):
        raise SystemExit(f"--small-m-gemv takes on, off or on,off; got {args.small_m_gemv}")
    steps = []
    for g in settings:
        tag = f"_gemv_{g}" if len(settings) > 1 else ""
        steps.append((f"latency_8b{tag}", lambda g=g: latency_8b(gemv=g)))
        if not args.skip_sync:
            steps.append((f"latency_8b_sync{tag}", lambda g=g: latency_8b(async_scheduling=False, gemv=g)))
    return steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--skip-sync", action="store_true", help="no sync-scheduling rows")
    ap.add_argument("--skip-nano", action="store_true", help="no nano-vllm rows (nor their peers)")
    ap.add_argument("--old-small-kernels", action="store_true",
                    help="TRITON_ATTN without the fused q/k norm + RoPE + cache write (for A/B runs)")
    ap.add_argument("--hf", choices=("generate", "continuous", "both"), default="both",
                    help="transformers peer: padded generate, continuous batching (generate_batch), or both")
    ap.add_argument("--limits", nargs="+", default=[], metavar="SEQSxTOKENS",
                    help="extra nano-vllm runs with these max_num_seqs x max_num_batched_tokens (e.g. 256x16384)")
    ap.add_argument("--small-m-gemv", default=None, metavar="on,off",
                    help="latency rows once per setting of the fused small-M linears (off: disabled_kernels triton_gemv)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the platform's")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the platform's")
    args = ap.parse_args()
    if args.old_small_kernels:  # a benchmark's switch: the class attribute the layer reads
        from attnserve.attention.backends.triton_attn import TritonAttentionBackend

        TritonAttentionBackend.fuses_rope = False
    result: dict = {"device": torch.cuda.get_device_name(), "old_small_kernels": args.old_small_kernels}
    reqs = workload()
    mine = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    steps = [("nano_vllm_attnserve", lambda: throughput_attnserve(reqs, **mine))]
    if not args.skip_sync:
        steps.append(("nano_vllm_attnserve_sync", lambda: throughput_attnserve(reqs, async_scheduling=False, **mine)))
    for lim in args.limits:
        seqs, tokens = (int(x) for x in lim.split("x"))
        steps.append((f"nano_vllm_attnserve_{lim}",
                      lambda s=seqs, t=tokens: throughput_attnserve(reqs, max_num_seqs=s, max_num_batched_tokens=t)))
    if args.skip_nano:
        steps = []
    if not args.skip_latency:
        steps[:0] = latency_steps(args)
    if not args.skip_hf and not args.skip_nano and args.hf in ("continuous", "both"):
        steps.append(("nano_vllm_transformers_cb", lambda: throughput_hf_continuous(reqs)))
    if not args.skip_hf and not args.skip_nano and args.hf in ("generate", "both"):
        steps.append(("nano_vllm_transformers", lambda: throughput_hf(reqs)))
    for name, fn in steps:
        t = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as e:  # report and go on: one failure must not hide the rest
            import traceback

            traceback.print_exc()
            result[name + "_error"] = f"{type(e).__name__}: {e}"
        print(name, result.get(name), f"({time.perf_counter() - t:.0f} s)", flush=True)
        torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    path = args.json or (os.path.join(out, "gpu_engine.json") if out else None)
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    print("\n| benchmark | result |\n| --- | --- |")
    for key in [k for k in result if k.startswith("latency_8b") and not k.endswith("_error")]:
        r = result[key]
        label = "async" if r["async_scheduling"] else "sync"
        if r["small_m_gemv"] != "default":
            label += f", small-M GEMV {r['small_m_gemv']}"
        print(f"| Llama-3.1-8B shape, batch 1 decode ({label}) | {r['decode_tok_s']:.1f} tok/s; floor "
              f"{r['floor_tok_s']:.0f} tok/s ({r['fraction_of_floor']:.0%} of it) |")
    peers = [(k, result[k]) for k in ("nano_vllm_transformers_cb", "nano_vllm_transformers") if k in result]
    for key in [k for k in result if k.startswith("nano_vllm_attnserve")]:
        r = result[key]
        label = key.removeprefix("nano_vllm_attnserve").lstrip("_") or "async, defaults"
        line = (f"| nano-vllm workload ({label}; {r['batch_limits']}) | "
                f"attnserve {r['tok_s']:.0f} tok/s ({r['elapsed_s']:.1f} s, {r['steps']} steps, "
                f"{r['preemptions']} preemptions)")
        for name, h in peers:
            line += f"; {name.removeprefix('nano_vllm_')} {h['tok_s']:.0f} tok/s" \
                    f"{' (' + h['note'] + ')' if h['note'] else ''}: {r['tok_s'] / h['tok_s']:.1f}x"
        print(line + " |")


if __name__ == "__main__":
    main()
