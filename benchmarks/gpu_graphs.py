"""Decode steps with and without CUDA graphs, for each graph-safe backend, through ``LLM(...)``.

Real configs cut to 4 full-width layers, dummy bf16 weights: Llama-3.1-8B (TRITON_ATTN) and
DeepSeek-V3 (TRITON_MLA) and DeepSeek-V3.2 (TRITON_MLA_SPARSE: indexer, top-k and sparse MLA),
each 1 dense + 3 MoE layers of 16 routed experts, in a bf16 and an fp8 latent cache. ``B`` requests of ``C`` prompt tokens each, then ``N`` greedy tokens, once with
CUDA graphs (the default) and once with ``enforce_eager``: the ms per decode step is
``(time(N tokens) - time(1 token)) / (N - 1)`` on prefix-cache hits (so the prefill is only the
prompt's last block), the median of three; the greedy tokens of the two runs are compared
(bf16: the graphs' split count follows ``max_model_len``, eager's the batch's longest sequence,
so a near-tie may flip).

    python benchmarks/gpu_graphs.py [--smoke] [--batch 8] [--context 8192] [--cases dsv32_4l,...]

``--smoke``: tiny configs on CPU in float32 (no graphs there: both runs are eager), so CI
catches a broken script; by default only the Llama and V3.2 cases. Writes ``$OUT/gpu_graphs.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from attnserve import LLM, SamplingParams  # noqa: E402
from attnserve.presets import resolve_config_path  # noqa: E402

CUT = {"num_hidden_layers": 4, "first_k_dense_replace": 1, "n_routed_experts": 16, "n_group": 8, "topk_group": 4}
CASES = {  # name -> (config, overrides, backend, engine options)
    "llama8b_4l": ("meta-llama/Llama-3.1-8B-Instruct", {"num_hidden_layers": 4}, "TRITON_ATTN", {}),
    "dsv3_4l": ("deepseek-ai/DeepSeek-V3", CUT, "TRITON_MLA", {}),
    "dsv3_4l_fp8": ("deepseek-ai/DeepSeek-V3", CUT, "TRITON_MLA", {"kv_cache_dtype": "fp8"}),
    "dsv32_4l": ("deepseek-ai/DeepSeek-V3.2", CUT, "TRITON_MLA_SPARSE", {}),
    "dsv32_4l_fp8": ("deepseek-ai/DeepSeek-V3.2", CUT, "TRITON_MLA_SPARSE", {"kv_cache_dtype": "fp8"}),
}
SMOKE = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "kv_lora_rank": 128,
         "q_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "head_dim": 16,
         "index_n_heads": 4, "index_head_dim": 32, "index_topk": 8}


def model_dir(name: str, overrides: dict, smoke: bool) -> str:
    d = tempfile.mkdtemp(prefix="attnserve_graphs_")
    cfg = json.loads(Path(resolve_config_path(name)).read_text())
    cfg.update(overrides)
    if smoke:
        cfg.update({k: v for k, v in SMOKE.items() if k in cfg or k == "num_hidden_layers"})
        cfg.pop("quantization_config", None)
    (Path(d) / "config.json").write_text(json.dumps(cfg))
    return d


def _timed(llm: LLM, prompts: list, tokens: int) -> tuple[float, list]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]


def decode_ms(path: str, backend: str, engine: dict, eager: bool, batch: int, context: int, new: int,
              smoke: bool) -> tuple[float, list, bool]:
    llm = LLM(path, load_format="dummy", dtype="float32" if smoke else "bfloat16", attention_backend=backend,
              max_model_len=context + new + 16, max_num_seqs=batch, max_num_batched_tokens=max(4096, context),
              enforce_eager=eager, **({"kv_cache_memory": 0.05} if smoke else {"gpu_memory_utilization": 0.85}),
              **engine)
    rng = random.Random(0)
    vocab = llm.llm_engine.arch.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(context)]} for _ in range(batch)]
    _timed(llm, prompts, new)  # warm-up: compiles, and fills the prefix cache
    full, tokens = zip(*(_timed(llm, prompts, new) for _ in range(3)))
    one = [_timed(llm, prompts, 1)[0] for _ in range(3)]
    graphed = llm.llm_engine.runner.graphs is not None
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return 1e3 * (statistics.median(full) - statistics.median(one)) / (new - 1), tokens[0], graphed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--cases", default=None, help="comma-separated subset of " + ",".join(CASES))
    args = ap.parse_args()
    # the smoke run covers the standard and the sparse-MLA graph hooks (the MLA ones: tests/kernels)
    args.cases = args.cases or ("llama8b_4l,dsv32_4l" if args.smoke else ",".join(CASES))
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}")
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        args.batch, args.context, args.new = 2, 40, 4
    rows = []
    for name in args.cases.split(","):
        config, overrides, backend, engine = CASES[name]
        path = model_dir(config, overrides, args.smoke)
        graphs_ms, graph_tokens, graphed = decode_ms(path, backend, engine, False, args.batch, args.context,
                                                     args.new, args.smoke)
        eager_ms, eager_tokens, _ = decode_ms(path, backend, engine, True, args.batch, args.context, args.new,
                                              args.smoke)
        shutil.rmtree(path, ignore_errors=True)
        agree = sum(a == b for a, b in zip(graph_tokens, eager_tokens)) / len(graph_tokens)
        rows.append({"case": name, "backend": backend, "batch": args.batch, "context": args.context,
                     "graphs_captured": graphed, "graphs_ms": graphs_ms, "eager_ms": eager_ms,
                     "speedup": eager_ms / graphs_ms if graphs_ms > 0 else None, "greedy_agree": agree})
        print(json.dumps(rows[-1]), flush=True)
        if args.smoke and agree != 1.0:  # both runs are eager on CPU: they must agree exactly
            sys.exit(f"{name}: the two eager runs disagree")
        if not args.smoke and not graphed:
            sys.exit(f"{name}: {backend} was not captured in CUDA graphs")
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_graphs.json").write_text(json.dumps(rows, indent=2))
    print(f"\ndecode ms per step, {args.batch} requests of {args.context} tokens, dummy bf16 weights")
    print(f"{'case':<14}{'backend':<13}{'graphs':>9}{'eager':>9}{'eager/graphs':>14}{'greedy agree':>14}")
    for r in rows:
        print(f"{r['case']:<14}{r['backend']:<13}{r['graphs_ms']:>9.2f}{r['eager_ms']:>9.2f}"
              f"{(r['speedup'] or 0):>14.2f}{r['greedy_agree']:>14.2f}")


if __name__ == "__main__":
    main()
