"""Time to first token of a long prompt on a hybrid model: a prefix-cache hit that restores the
state snapshot, against recomputing the prompt (the issue's goal: a 32K prompt's hit at least
5x faster than its recompute).

The hybrid cuts of ``gpu_mechanisms.py`` (default qwen3_next and jamba: Gated DeltaNet and
Mamba state; 3 or 7 state layers and 1 attention layer, dummy bf16 weights), one engine each
with prefix caching, ``--state-backend`` as there, eager (a first token is prefill only). A
warm-up round at 1K compiles the kernels of every path below. Then for each of ``--repeats``
rounds, with a fresh random prompt P of ``--prompt`` tokens (32K):

1. cold: P, one token; nothing cached (``num_cached_tokens`` 0);
2. hit: P plus ``--tail`` new tokens, ``--hits`` times with other tails: the engine finds P's
   blocks and the state snapshot it took when P's prefill ended on its last block, copies the
   snapshot into the request's slot and computes the tail only (in up to two steps: a prefill
   step of a hybrid ends on a block boundary). Checked: ``RequestOutput.num_cached_tokens`` is
   P's length in whole blocks, the scheduler's prefix-hit tokens grew by as much and the state
   pool counted one snapshot restore;
3. recompute: the prefix cache emptied (``BlockPool.reset_prefix_cache``), P plus the first
   hit's tail again: the whole prompt computed. Its first token against the hit's: the same in
   float32 (``--smoke``: a failure otherwise); in bf16 reported (the chunking differs).

Time to first token is the wall time of ``generate`` (synchronised; one request, nothing
queued); the engine's own ``time_to_first_token`` is recorded beside it. Reported per case:
the medians, and recompute / hit, the figure the goal names.

    python benchmarks/gpu_hybrid_prefix.py [--cases qwen3_next,jamba] [--prompt 32K] [--tail 32]
        [--hits 3] [--repeats 2] [--state-backend triton] [--block-size 16] [--budget-s 400] [--smoke]

``--smoke``: qwen3_next at gpu_mechanisms' toy sizes on CPU (float32, Triton's interpreter),
a 64-token prompt, tails of 11 (two steps each), blocks of 8, one round; exits non-zero
unless every hit hits and its first token is the recompute's.
Writes ``$OUT/gpu_hybrid_prefix.json`` when ``OUT`` is set (after every case).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from gpu_mechanisms import CASES, HYBRIDS, environment, model_dir, parse_sizes, random_prompts

from attnserve import LLM, SamplingParams

JSON_NAME = "gpu_hybrid_prefix.json"
GOAL = 5.0  # recompute / hit at 32K


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def first_token(llm: LLM, prompt: list[int]) -> tuple[float, object]:
    """(seconds, RequestOutput) of one greedy token of ``prompt``, with its top-5 logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=5, detokenize=False)
    sync()
    start = time.perf_counter()
    (out,) = llm.generate({"prompt_token_ids": prompt}, params)
    sync()
    return time.perf_counter() - start, out


def top_logprobs(out) -> dict[int, float]:
    return {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}


def one_round(llm: LLM, length: int, tail: int, hits: int, seed: int) -> dict:
    """Cold, ``hits`` hits and the recompute of one fresh prompt (the module docstring)."""
    engine = llm.llm_engine
    vocab, block = engine.arch.vocab_size, engine.config.cache.block_size
    prompt = random_prompts(vocab, 1, length, seed)[0]["prompt_token_ids"]
    tails = [random_prompts(vocab, 1, tail, seed + 1 + i)[0]["prompt_token_ids"] for i in range(hits)]
    cold_s, cold = first_token(llm, prompt)
    expected = length // block * block  # the hit stops at the last block P fills
    stats, pool = engine.scheduler.stats, engine.kv_manager.state_pool
    hit_s, hit_ttft, problems, first_hit = [], [], [], None
    for t in tails:
        tokens_before, restores_before = stats.prefix_hit_tokens, pool.num_hits
        s, out = first_token(llm, prompt + t)
        hit_s.append(s)
        hit_ttft.append(out.metrics.get("time_to_first_token"))
        first_hit = first_hit or out
        got = (out.num_cached_tokens, stats.prefix_hit_tokens - tokens_before, pool.num_hits - restores_before)
        if got != (expected, expected, 1):
            problems.append(f"hit of {length} + {len(t)} tokens: num_cached_tokens {got[0]}, scheduler "
                            f"prefix-hit tokens +{got[1]}, snapshot restores +{got[2]}; expected {expected}, "
                            f"{expected}, 1")
    if not engine.kv_manager.pool.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be emptied: blocks are still in use")
    recompute_s, recompute = first_token(llm, prompt + tails[0])
    if cold.num_cached_tokens or recompute.num_cached_tokens:
        problems.append(f"cold / recompute served from the cache: {cold.num_cached_tokens} / "
                        f"{recompute.num_cached_tokens} tokens")
    a, b = top_logprobs(first_hit), top_logprobs(recompute)
    shared = set(a) & set(b)
    return {"prompt": length, "tail": tail, "expected_cached": expected, "cold_s": cold_s,
            "cold_ttft_s": cold.metrics.get("time_to_first_token"), "hit_s": hit_s, "hit_ttft_s": hit_ttft,
            "recompute_s": recompute_s, "recompute_ttft_s": recompute.metrics.get("time_to_first_token"),
            "same_token": first_hit.outputs[0].token_ids == recompute.outputs[0].token_ids,
            "top5_max_diff": max((abs(a[t] - b[t]) for t in shared), default=None), "problems": problems}


def snapshot_slots(args) -> int:
    """The engine's state snapshot slots (``num_state_snapshots``; least recently used evicted).
    A round takes about 3 snapshots for P (its chunk ends, its last boundary, its
    end) and up to 2 a hit (a tail that crosses a boundary is computed in two steps, each
    ending on a boundary): with 2 slots, a round's second hit found P's snapshot evicted by the
    first hit's and recomputed everything."""
    return 2 * (args.hits + 4)


def run_case(name: str, args) -> dict:
    """One engine, a warm-up round, ``args.repeats`` measured rounds; the case's summary."""
    case = CASES[name]
    backend = case.backend_name(args.state_backend)
    result = {"case": name, "mechanism": case.mechanism, "state_backend": backend, "prompt": args.prompt,
              "tail": args.tail}
    path, changed = model_dir(case, args.experts, args.smoke)
    result["overrides"] = changed
    kwargs = dict(load_format="dummy", dtype="float32" if args.smoke else "bfloat16", attention_backend=backend,
                  max_model_len=args.prompt + args.tail + 16, max_num_seqs=1,
                  num_state_snapshots=snapshot_slots(args), enforce_eager=True,
                  max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                  enable_prefix_caching=True)
    if args.smoke:
        kwargs["kv_cache_memory"] = 0.05
    else:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    started = time.perf_counter()
    llm = None
    try:
        llm = LLM(path, **kwargs)
        engine = llm.llm_engine
        result["backend"] = " + ".join(dict.fromkeys([backend, *engine.parts.backend_names]))
        result["block_size"] = engine.config.cache.block_size
        result["build_s"] = time.perf_counter() - started
        warm = one_round(llm, min(args.prompt, 1024), args.tail, 1, seed=1)  # compiles every path
        result["warm_up"] = {"problems": warm["problems"]}
        rounds = []
        for r in range(args.repeats):
            if rounds and args.deadline and time.perf_counter() > args.deadline:
                break
            rounds.append(one_round(llm, args.prompt, args.tail, args.hits, seed=1000 * (r + 1)))
            print(json.dumps({"case": name, **rounds[-1]}), flush=True)
        hit = statistics.median(s for r in rounds for s in r["hit_s"])
        recompute = statistics.median(r["recompute_s"] for r in rounds)
        result.update(status="ok", rounds=rounds, cold_s=statistics.median(r["cold_s"] for r in rounds),
                      hit_s=hit, recompute_s=recompute, speedup=recompute / hit,
                      problems=sorted({p for r in [warm, *rounds] for p in r["problems"]}),
                      same_token=all(r["same_token"] for r in rounds))
    except Exception as e:  # the next case still runs; the exit status says it failed
        import traceback

        traceback.print_exc()
        result.update(status="failed", error=f"{type(e).__name__}: {e}")
    finally:
        result["seconds"] = time.perf_counter() - started
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        shutil.rmtree(path, ignore_errors=True)
    return result


def table(results: list[dict]) -> str:
    lines = ["| case | backend | prompt | tail | cold s | recompute s | hit ms | recompute / hit | cached "
             "tokens | same first token |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        if r.get("status") != "ok":
            lines.append(f"| {r['case']} | {r.get('backend', r['state_backend'])} | {r['prompt']} | {r['tail']} | "
                         f"{r.get('status')}: {r.get('error', '')} | | | | | |")
            continue
        cached = r["rounds"][0]["expected_cached"] if not r["problems"] else "MISS"
        lines.append(f"| {r['case']} | {r['backend']} | {r['prompt']:,} | {r['tail']} | {r['cold_s']:.3f} | "
                     f"{r['recompute_s']:.3f} | {1e3 * r['hit_s']:.1f} | {r['speedup']:.1f}x | {cached} | "
                     f"{'yes' if r['same_token'] else 'no'} |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", help=f"comma list of {', '.join(HYBRIDS)} (default qwen3_next,jamba)")
    ap.add_argument("--prompt", help="prompt tokens, K = 1024 (default 32K)")
    ap.add_argument("--tail", type=int, help="new tokens after the cached prompt (default 32)")
    ap.add_argument("--hits", type=int, help="hits per round, each with its own tail (default 3)")
    ap.add_argument("--repeats", type=int, help="rounds, each with a fresh prompt (default 2)")
    ap.add_argument("--state-backend", default="triton", choices=("torch", "triton"))
    ap.add_argument("--block-size", type=int, help="the engine's block_size (default: its own)")
    ap.add_argument("--experts", type=int, default=16, help="routed experts of cuts that take --experts")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--budget-s", type=float, default=400.0,
                    help="no new round or case starts after this many seconds (each case runs one round)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU under Triton's interpreter")
    args = ap.parse_args()
    defaults = ({"cases": "qwen3_next", "prompt": "64", "tail": 11, "hits": 2, "repeats": 1, "block_size": 8}
                if args.smoke else {"cases": "qwen3_next,jamba", "prompt": "32K", "tail": 32, "hits": 3,
                                    "repeats": 2, "block_size": None})
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.prompt = parse_sizes(args.prompt)[0]
    unknown = set(args.cases.split(",")) - set(HYBRIDS)
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; choose from {', '.join(HYBRIDS)}")
    if args.tail < 1 or args.hits < 1 or args.repeats < 1:
        ap.error("--tail, --hits and --repeats must be at least 1")
    return args


def main() -> int:
    args = parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke)")
        return 2
    start = time.perf_counter()
    args.deadline = start + args.budget_s
    results = []
    out = os.environ.get("OUT")
    for name in args.cases.split(","):
        if results and time.perf_counter() > args.deadline:
            results.append({"case": name, "state_backend": CASES[name].backend_name(args.state_backend),
                            "prompt": args.prompt, "tail": args.tail, "status": "skipped",
                            "error": f"time budget (--budget-s {args.budget_s:g}) spent"})
            continue
        results.append(run_case(name, args))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "rounds"}), flush=True)
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            options = {k: v for k, v in vars(args).items() if k != "deadline"}
            Path(out, JSON_NAME).write_text(json.dumps(
                {"environment": {**environment(), "command": " ".join(["python", *sys.argv])},
                 "options": options, "results": results,
                 "wall_s": time.perf_counter() - start}, indent=1))
    print("\n" + table(results))
    bad = [r for r in results if r.get("status") == "failed" or r.get("problems")
           or (args.smoke and r.get("status") == "ok" and not r["same_token"])]
    for r in bad:
        print(f"{r['case']}: {r.get('error') or '; '.join(r.get('problems') or ['first token differs'])}")
    for r in results:
        if r.get("status") == "ok" and not args.smoke and args.prompt >= 32768:
            print(f"{r['case']}: recompute / hit {r['speedup']:.1f}x at {args.prompt:,} tokens "
                  f"({'meets' if r['speedup'] >= GOAL else 'below'} the goal of {GOAL:g}x)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
