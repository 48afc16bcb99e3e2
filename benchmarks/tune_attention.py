"""Sweep the Triton attention kernel's launch configs on the H200 (decode and prefill shapes).

Uses the same inputs and timing as ``gpu_attention.py`` (CUDA graphs over rotated input sets),
with ``pick_config`` / ``pick_num_splits`` replaced per variant. Prints, per shape, every
variant's time and the best, so the defaults in ``triton_paged_attention.py`` can be set from
measurements rather than guesses.

    python benchmarks/tune_attention.py [--budget-s 300]
    python benchmarks/tune_attention.py --splits   # KV splits only, small batches, default tiles
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import gpu_attention as ga  # noqa: E402
from ceilings import NOMINAL_BW  # noqa: E402

import attnserve.ops.attention.paged_triton as tpa  # noqa: E402

DECODE_SHAPES = [(1, 16384), (1, 65536), (16, 4096), (16, 16384), (4, 32768), (64, 1024)]
PREFILL_SHAPES = [8192, 16384]


def time_decode(batch: int, ctx: int, cfg, splits: int) -> float:
    moved = batch * ctx * ga.KV_HEADS * ga.HEAD * 4
    sets = max(1, ga.num_sets(moved))
    data = [ga.paged_batch([1] * batch, [ctx] * batch) for _ in range(sets)]
    outs = [torch.empty_like(b["q"]) for b in data]
    for b in data:
        b["max_q"], b["max_s"] = 1, ctx
    tpa.pick_config = lambda *a, **k: cfg
    tpa.pick_num_splits = lambda *a, **k: splits
    t, _ = ga.time_per_call([lambda b=b, o=o: ga.run_ours(b, o) for b, o in zip(data, outs)], rep_ms=60)
    return t, moved / t / NOMINAL_BW


def time_prefill(n: int, cfg) -> float:
    data = [ga.paged_batch([n], [n]) for _ in range(2)]
    outs = [torch.empty_like(b["q"]) for b in data]
    for b in data:
        b["max_q"], b["max_s"] = n, n
    tpa.pick_config = lambda *a, **k: cfg
    tpa.pick_num_splits = lambda *a, **k: 1
    t, _ = ga.time_per_call([lambda b=b, o=o: ga.run_ours(b, o) for b, o in zip(data, outs)], rep_ms=100)
    return t, 4 * n * n * ga.HEAD * ga.HEADS / 2 / t / 1e12


SPLIT_BATCHES = (1, 2, 4, 8, 16)
SPLIT_CTX = (1024, 4096, 16384, 32768, 65536)


def sweep_splits(budget_s: float) -> dict:
    """Every power-of-two split count (down to 64 keys a split) at small batches, default tiles."""
    start = time.time()
    config_fn, auto_fn = tpa.pick_config, tpa.pick_num_splits  # time_decode replaces both
    cfg = config_fn(ga.HEAD, ga.HEADS // ga.KV_HEADS, 1, interpret=False)
    results = {}
    for batch, ctx in itertools.product(SPLIT_BATCHES, SPLIT_CTX):
        if time.time() - start > budget_s:
            break
        auto = auto_fn(batch, ga.KV_HEADS, 1, ctx, torch.device("cuda"))
        rows = []
        splits = 1
        while splits <= min(256, ctx // 64):
            t, frac = time_decode(batch, ctx, cfg, splits)
            rows.append({"splits": splits, "us": t * 1e6, "pct_bw": 100 * frac})
            splits *= 2
        best = min(rows, key=lambda r: r["us"])
        at_auto = next(r for r in rows if r["splits"] == auto)
        results[f"{batch}x{ctx}"] = {"auto": auto, "rows": rows}
        print(f"splits B={batch:>2} ctx={ctx:>6}: auto {auto:>3} {at_auto['us']:7.1f} us {at_auto['pct_bw']:5.1f}% | "
              f"best {best['splits']:>3} {best['us']:7.1f} us {best['pct_bw']:5.1f}%  "
              + " ".join(f"{r['splits']}:{r['us']:.1f}" for r in rows), flush=True)
        torch.cuda.empty_cache()
    tpa.pick_config, tpa.pick_num_splits = config_fn, auto_fn
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--splits", action="store_true", help="sweep KV splits only (small-batch decode)")
    args = ap.parse_args()
    if args.splits:
        results = sweep_splits(args.budget_s)
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "tune_splits.json"), "w") as f:
                json.dump(results, f, indent=2)
        return
    start = time.time()
    original_config, original_splits = tpa.pick_config, tpa.pick_num_splits
    results = {"decode": {}, "prefill": {}}
    group = ga.HEADS // ga.KV_HEADS
    for batch, ctx in DECODE_SHAPES:
        auto = original_splits(batch, ga.KV_HEADS, 1, ctx, torch.device("cuda"))
        rows = []
        for mult, block_n, warps, stages in itertools.product((1, 2, 4), (32, 64, 128), (4, 8), (2, 3, 4)):
            if time.time() - start > args.budget_s * 0.6:
                break
            splits = max(1, min(128, auto * mult, ctx // 256))
            cfg = tpa.AttentionConfig(1, max(16, group), block_n, warps, stages)
            try:
                t, frac = time_decode(batch, ctx, cfg, splits)
            except Exception as e:  # a config that does not compile or fit is skipped
                print(f"decode {batch}x{ctx} {cfg} failed: {type(e).__name__}", flush=True)
                continue
            rows.append({"splits": splits, "block_n": block_n, "warps": warps, "stages": stages, "us": t * 1e6,
                         "pct_bw": 100 * frac})
        torch.cuda.empty_cache()
        rows.sort(key=lambda r: r["us"])
        results["decode"][f"{batch}x{ctx}"] = {"auto_splits": auto, "rows": rows}
        print(f"decode B={batch} ctx={ctx} (auto splits {auto}): best {rows[:3]}", flush=True)
    for n in PREFILL_SHAPES:
        rows = []
        for target_m, block_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
            if time.time() - start > args.budget_s:
                break
            cfg = tpa.AttentionConfig(max(1, target_m // group), group, block_n, warps, stages)
            try:
                t, tflops = time_prefill(n, cfg)
            except Exception as e:
                print(f"prefill {n} {cfg} failed: {type(e).__name__}", flush=True)
                continue
            rows.append({"block_m": target_m, "block_n": block_n, "warps": warps, "stages": stages, "us": t * 1e6,
                         "tflops": tflops})
        torch.cuda.empty_cache()
        rows.sort(key=lambda r: r["us"])
        results["prefill"][str(n)] = rows
        print(f"prefill n={n}: best {rows[:3]}", flush=True)
    tpa.pick_config, tpa.pick_num_splits = original_config, original_splits
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "tune_attention.json"), "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
