"""Decode and prefill per attention mechanism, against the H200's bandwidth and FLOP ceilings.

Real configs cut to 4 full-width layers, dummy bf16 weights, through ``LLM(...)``:

- ``llama8b`` (GQA): Llama-3.1-8B-Instruct, TRITON_ATTN;
- ``qwen3_30b_a3b`` (MoE): Qwen3-30B-A3B, every layer MoE with all 128 experts (top-8), TRITON_ATTN;
- ``dsv3`` (MLA): DeepSeek-V3, 1 dense + 3 MoE layers of ``--experts`` routed experts (16), TRITON_MLA;
- ``dsv32`` (DSA): DeepSeek-V3.2, the same cut, TRITON_MLA_SPARSE;
- ``glm5`` (DSA): GLM-5, the same cut (its ``n_group``/``topk_group`` of 1 divide any count),
  TRITON_MLA_SPARSE.

Hybrids, cut to their layer period at full width, every routed expert kept; the state layers
run the backend ``--state-backend`` names (TRITON_<kind>, default, or TORCH_<kind>: a
state-only name applies to the layers it handles), the attention layers the platform's first
that fits (on CUDA TRITON_ATTN, TRITON_MLA for Kimi's MLA):

- ``qwen3_next`` (GDN+GQA): Qwen3-Next-80B-A3B, 3 Gated DeltaNet + 1 gated attention layer,
  every layer MoE with all 512 experts (top-10) and the shared expert (13.4 GiB of weights);
- ``qwen35`` (GDN+GQA): Qwen3.5-27B (dense), the same 3 + 1 (7.6 GiB);
- ``qwen35_moe`` (GDN+GQA): Qwen3.5-35B-A3B, the same 3 + 1, 256 experts top-8 and a shared
  expert (8.2 GiB; its config is ``RELEASED``'s, see there);
- ``kimi_linear`` (KDA+MLA): Kimi-Linear-48B-A3B, 3 KDA + 1 MLA layer, layer 0 dense, the
  others 256 experts top-8 and a shared expert (12.0 GiB);
- ``jamba`` (Mamba+GQA): AI21-Jamba-1.5-Mini, one period of 8: 7 Mamba + 1 attention layer
  (layer 4), MoE (16 experts top-2) at the odd layers (24.8 GiB);
- ``minimax`` (lightning+GQA): MiniMax-Text-01 (``RELEASED``'s config), 3 lightning + 1
  softmax layer (the released 7 : 1 would be 8 layers, 87 GiB), all 32 experts top-2 (46.7 GiB).

``--experts N`` sets the routed experts of the three DeepSeek/GLM cuts; ``n_group`` becomes the
largest divisor of N not above the config's, ``topk_group`` at least enough groups for top-k.

Grid: batch 1 / 8 / 64 x context 1K / 8K / 32K for every case; DSA and dense MLA also 64K and 128K
at the ``--dsa-long-batches`` (1, 32). One engine per (case, context): ``max_num_seqs`` the
largest batch, ``max_model_len`` context + new tokens + 16. Its largest batch of distinct random
prompts (no two share a block) runs once with ``max_tokens=1`` after a short warm-up: that is
the prefill cell, and it fills the prefix cache. Then for each batch b the first b prompts run
again (prefix hits: only the last block is recomputed; a hybrid restores its state snapshot at
that block, for which its engine keeps ``snapshot_room`` snapshots per sequence
(``num_state_snapshots``), so that the snapshots outlive the grid; ``prefix_hit_fraction`` in each decode cell says how much of the
prompts the cache served) through the engine's ``step``: once
every request has its first token and 4 more steps have run, N - 16 decode steps are timed
(synchronised at both ends), the median of ``--repeats``: decode ms per step. (Subtracting a
1-token ``generate`` from an N-token one left the prefill's variance in the result.) Before an engine is built,
the KV cache of its batches is checked against the memory left (the plan's bytes per sequence,
the weights' bytes from the model built on the meta device); after, against the blocks the
engine really has. A batch that does not fit is recorded as skipped with the reason.

The floors (the bytes a decode step must read at 4.25 TB/s, its FLOPs at 790 TFLOP/s) and the
FLOPs of a prefill come from ``benchmarks/step_floors.py``, whose docstring gives the formulas;
the table gives both decode floors and the fraction of the larger one reached.

    python benchmarks/gpu_mechanisms.py [--cases dsv32,glm5|hybrids] [--batches 1,8] [--contexts 8K,128K]
        [--dsa-long-batches 1,32] [--experts 16] [--new 64] [--kv-cache-dtype fp8] [--block-size 64]
        [--max-num-batched-tokens 16384] [--state-backend torch,triton] [--budget-s 540]
        [--docs docs/performance.md] [--smoke]
    python benchmarks/gpu_mechanisms.py --render run1.json run2.json [--docs docs/performance.md]

Prints a JSON line per cell as it completes, then a markdown table; writes
``$OUT/gpu_mechanisms.json`` (cells, options, environment) when ``OUT`` is set, after every cell
(``"partial": true`` until the run ends), so a command stopped by its time limit keeps its
cells; ``--budget-s`` decides only whether a (case, context) group starts: none starts after
that many seconds (its cells are recorded as skipped), except the run's first engine, which
always starts; a group that started runs its prefill and the decode cells of all its batches,
so a prefill is never paid for and its decode cells dropped (a group can end past the budget:
leave the command's limit room for the longest one). ``--docs`` rewrites the table between
the ``gpu_mechanisms`` markers of that markdown file (appending the section when they are
missing). A device command is limited in time: run the grid in parts
(``--cases``, ``--contexts``) and ``--render`` their JSON files into one table (a later file's
cell replaces an earlier one's). The long DSA prefills dominate the cost: 32 prompts of 128K
are 4.2M prompt tokens, about 48 PFLOP for the DeepSeek-V3.2 cut (28 of them attention and
indexer), minutes at the rates ``gpu_mla.py`` measured. For the hybrids, the prefills of their
state layers in PyTorch (chunked delta rule, Mamba's log-step scan) set the pace: Jamba's seven
Mamba layers move about 6 GB of float32 scan tensors per 128-token chunk and layer; estimated
(not measured) 64 x 32K prompts take 30-60 s a case, Jamba's 4-5 minutes. ``--state-backend
torch,triton`` runs each hybrid with both; its cells carry ``state_backend``.

``--smoke``: the five cases at toy sizes on CPU in float32 under Triton's interpreter (one
layer for the GQA, MoE and MLA cases and DeepSeek-V3.2, whose one layer is MoE; GLM-5 one dense
and one MoE layer, the second a "shared" layer without indexer; index_topk 16 so the indexer
selects), and the hybrids of ``SMOKE_HYBRIDS`` (one per state kind: a state and an attention
layer each, TRITON_<kind> under the interpreter, the first context only; ``--cases hybrids``
all six), batch 1/2, contexts 32/64, 3 new tokens, one repeat, blocks of 8, no warm-up; then the
docs rewrite into a temporary file and the JSON read back. It exits non-zero unless every cell
ran (cells ``--budget-s`` skipped excepted); a device run exits non-zero when a cell failed
(skipped cells are not failures).

This file holds the command line and the grid loop; the cases and their cuts are in
``mechanism_cases.py``, building and timing the engines in ``mechanism_timing.py``, the table,
the docs rewrite and ``--render``'s loader in ``mechanism_report.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# sibling modules (the script's directory is on sys.path); gpu_hybrid_prefix.py and
# tests/unit/test_step_floors.py import the cases and helpers from here
from mechanism_cases import (  # noqa: E402
    CASES,
    HYBRIDS,
    LONG_CONTEXT,
    SMOKE_EXPERTS,
    SMOKE_HYBRIDS,
    grid,
    model_dir,
    parse_sizes,
)
from mechanism_report import (  # noqa: E402
    DEFAULT_EXPERTS,
    JSON_NAME,
    docs_block,
    environment,
    load_results,
    markdown_table,
    rewrite_docs,
    smoke_checks,
)
from mechanism_timing import (  # noqa: E402
    Recorder,
    budget_reason,
    random_prompts,  # noqa: F401 (gpu_hybrid_prefix.py imports it from here)
    run_context,
)

# --- main ---------------------------------------------------------------------------------


# option defaults on the device and in the smoke run (an option given on the command line wins)
DEFAULTS = {"cases": ",".join(CASES), "batches": "1,8,64", "contexts": "1K,8K,32K,64K,128K",
            "dsa_long_batches": "1,32", "experts": DEFAULT_EXPERTS, "new": 64, "repeats": 3, "block_size": None}
SMOKE_DEFAULTS = {"cases": ",".join([*(n for n in CASES if n not in HYBRIDS), *SMOKE_HYBRIDS]), "batches": "1,2",
                  "contexts": "32,64", "dsa_long_batches": "1", "experts": SMOKE_EXPERTS,
                  "new": 3, "repeats": 1, "block_size": 8}  # blocks of 8: a prefix hit recomputes less


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", help=f"comma list of {', '.join(CASES)} (default all; --smoke: the attention "
                                    f"cases and {', '.join(SMOKE_HYBRIDS)}); 'hybrids' names {', '.join(HYBRIDS)}")
    ap.add_argument("--state-backend", default="triton",
                    help="the hybrids' state backends, TORCH_<kind> or TRITON_<kind>: torch, triton, or "
                         "torch,triton for both in one run (their attention layers take the platform's first)")
    ap.add_argument("--budget-s", type=float,
                    help="seconds after which no new (case, context) group starts (its cells recorded as "
                         "skipped); a group that started runs its prefill and all its decode cells, and the "
                         "first engine always starts, so a run may end past the budget")
    ap.add_argument("--batches", help=f"comma list (default {DEFAULTS['batches']})")
    ap.add_argument("--contexts", help=f"comma list, K = 1024 (default {DEFAULTS['contexts']}; above "
                                       f"{LONG_CONTEXT // 1024}K: DSA cases only)")
    ap.add_argument("--dsa-long-batches", help=f"batches of the DSA contexts above {LONG_CONTEXT // 1024}K "
                                               f"(default {DEFAULTS['dsa_long_batches']})")
    ap.add_argument("--experts", type=int, help="routed experts of the DeepSeek/GLM cuts (default 16)")
    ap.add_argument("--new", type=int, help="new tokens of the timed decode (default 64)")
    ap.add_argument("--repeats", type=int, help="timings per measurement, their median (default 3)")
    ap.add_argument("--block-size", type=int, help="the engine's block_size (default: its own)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument("--docs", help="markdown file whose gpu_mechanisms section to rewrite")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU under Triton's interpreter")
    ap.add_argument("--render", nargs="+", metavar="JSON",
                    help="run nothing: merge these outputs of earlier runs (later ones win) into the table")
    args = ap.parse_args()
    for key, value in (SMOKE_DEFAULTS if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    names = [n for item in args.cases.split(",") for n in (HYBRIDS if item == "hybrids" else [item]) if n]
    unknown = set(names) - set(CASES)
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; choose from {', '.join(CASES)}")
    args.cases = ",".join(dict.fromkeys(names))
    args.state_backends = list(dict.fromkeys(b.strip().lower() for b in args.state_backend.split(",") if b.strip()))
    if not args.state_backends or set(args.state_backends) - {"torch", "triton"}:
        ap.error(f"--state-backend takes torch, triton or torch,triton, got {args.state_backend!r}")
    if args.new < 1:
        ap.error("--new must be at least 1 (N - 16 decode steps are timed, at least one)")
    return args


def run_grid(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Every (case, context) engine of the grid; (cells, environment)."""
    batches, contexts = parse_sizes(args.batches), parse_sizes(args.contexts)
    long_batches = parse_sizes(args.dsa_long_batches)
    out = os.environ.get("OUT")
    json_path = None
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        json_path = Path(out, JSON_NAME)
    env = environment()  # a partial file reads back through --render as a whole one does
    env["weights"] = "dummy float32" if args.smoke else "dummy bf16"
    rec = Recorder(json_path, {"environment": env, "options": {k: v for k, v in vars(args).items() if k != "docs"}},
                   args.budget_s)
    started = time.perf_counter()
    env["cases"] = cases = {}
    for name in args.cases.split(","):
        case = CASES[name]
        path, changed = model_dir(case, args.experts, args.smoke)
        cases[name] = {"config": case.config, "backend": case.backend or [case.backend_name(b)
                                                                         for b in args.state_backends],
                       "mechanism": case.mechanism, "overrides": changed}
        try:
            # the smoke run's hybrids take its first context only (the test's time)
            case_contexts = contexts[:1] if args.smoke and case.state else contexts
            for state_backend in args.state_backends if case.state else ["triton"]:
                for context, bs in grid(case, batches, case_contexts, long_batches):
                    run_context(case, path, context, bs, args, rec, state_backend)
        finally:
            shutil.rmtree(path, ignore_errors=True)
    env["seconds"] = time.perf_counter() - started
    return rec.cells, env


def main() -> None:
    args = parse_args()
    if args.render:
        cells, env = load_results(args.render)
    elif not args.smoke and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --smoke)")
    else:
        cells, env = run_grid(args)
    out = os.environ.get("OUT")
    if out:
        options = {k: v for k, v in vars(args).items() if k != "docs"}
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, JSON_NAME).write_text(json.dumps({"environment": env, "options": options, "cells": cells},
                                                   indent=2))
    block = docs_block(markdown_table(cells), env, cells)
    print(f"\n{block}")
    if args.docs:
        rewrite_docs(args.docs, block)
    if args.smoke:
        smoke_checks(cells, block, out)
    if args.render:
        return
    # a smoke run must run every cell but those --budget-s asked it to skip
    budget = budget_reason(args.budget_s) if args.budget_s is not None else None
    bad = [c for c in cells if c["status"] == "failed"
           or (args.smoke and c["status"] != "ok" and c.get("reason") != budget)]
    if bad or not cells:
        sys.exit(f"{len(bad)} cells did not run: " + "; ".join(sorted({c.get("error") or c.get("reason")
                                                                        for c in bad})) if bad else "no cell ran")


if __name__ == "__main__":
    main()
