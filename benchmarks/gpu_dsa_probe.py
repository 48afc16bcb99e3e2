"""Where DeepSeek-V3 / V3.2 time goes on the H200, and the sweeps behind two launch defaults.

Parts (default: all):

- ``micro``: graph-timed (one CUDA graph of 20 calls, median of 7 replays) top-k of 2,048 per
  row, ``torch.topk`` over the whole width against ``ops/indexer/topk_triton.topk_rows`` at several
  chunk sizes (rows of a short sequence in a wide buffer included: a CUDA graph's width is
  ``max_model_len``); and ``sparse_mla`` / ``mla_decode`` at 128 heads by KV split count
  (the basis of ``ops/mla/decode_triton.prepare_latent_launch``'s one-wave rule).
- ``prefill``: one 32K prompt through ``LLM(...)`` (4-layer cuts of V3.2 and V3, 16 routed
  experts, dummy bf16 weights), its time and the CUDA kernels of a profiled repeat.
- ``decode``: the CUDA kernels of 16 eager decode steps, batch 32 over 8K (V3.2, V3).

    python benchmarks/gpu_dsa_probe.py [micro] [prefill] [decode]

Prints JSON lines and profiler tables. Not a test; needs a CUDA GPU.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from attnserve import LLM, SamplingParams  # noqa: E402
from attnserve.ops.indexer.topk_triton import topk_rows  # noqa: E402
from attnserve.ops.mla.decode_triton import mla_decode  # noqa: E402
from attnserve.ops.mla.sparse_triton import sparse_mla  # noqa: E402
from attnserve.presets import resolve_config_path  # noqa: E402

DEV = "cuda"
TOPK = 2048
CUT = {"num_hidden_layers": 4, "first_k_dense_replace": 1, "n_routed_experts": 16, "n_group": 8, "topk_group": 4}
V32 = ("deepseek-ai/DeepSeek-V3.2", "TRITON_MLA_SPARSE")
V3 = ("deepseek-ai/DeepSeek-V3", "TRITON_MLA")


def graph_us(fn, reps: int = 20) -> float:
    """Microseconds per call of ``fn``, from a CUDA graph of ``reps`` calls (no launch cost)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return round(sorted(times)[3], 1)


def topk_sweep() -> None:
    print("== top-k of 2,048, graph-timed us: torch.topk over the width, topk_rows by chunk")
    shapes = [(1, 8192, 8192), (8, 8192, 8192), (32, 8192, 8192), (64, 32768, 32768), (32, 65536, 65536),
              (8, 131072, 8192), (64, 131072, 32768), (512, 32768, 32768)]
    for rows, width, length in shapes:
        x = torch.randn(rows, width, device=DEV)
        x[:, length:] = float("-inf")
        lens = torch.full((rows,), length, device=DEV, dtype=torch.int32)
        row = {"rows": rows, "width": width, "len": length,
               "torch": graph_us(lambda x=x: x.topk(TOPK, dim=-1, sorted=False))}
        for chunk in (1024, 2048, 4096, 8192):
            row[f"ours_{chunk}"] = graph_us(lambda x=x, lens=lens, c=chunk: topk_rows(x, lens, TOPK, chunk=c))
        print(json.dumps(row), flush=True)


def split_sweep() -> None:
    print("== sparse_mla / mla_decode, 128 heads, bf16 rows, page 64: graph-timed us by KV splits")
    heads, rank, rope = 128, 512, 64
    for kind, batch, ctx in [("sparse", 1, 32768), ("sparse", 8, 32768), ("sparse", 32, 32768),
                             ("sparse", 64, 32768), ("dense", 1, 1024), ("dense", 1, 8192), ("dense", 8, 8192),
                             ("dense", 64, 8192)]:
        cache = torch.randn(batch * ctx // 64 + 1, 64, rank + rope, device=DEV, dtype=torch.bfloat16)
        table = (1 + torch.arange(batch * ctx // 64, device=DEV, dtype=torch.int32)).view(batch, -1)
        lens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
        q = torch.randn(batch, heads, rank + rope, device=DEV, dtype=torch.bfloat16)
        idx = torch.randint(0, ctx, (batch, TOPK), device=DEV, dtype=torch.int32)
        req = torch.arange(batch, device=DEV, dtype=torch.int32)

        def call(splits, kind=kind, cache=cache, table=table, lens=lens, q=q, idx=idx, req=req, ctx=ctx):
            if kind == "sparse":
                return sparse_mla(q, cache, table, lens, idx, req, kv_lora_rank=rank, scale=0.1, num_splits=splits)
            return mla_decode(q, cache, table, lens, kv_lora_rank=rank, scale=0.1, max_seq_len=ctx,
                              num_splits=splits)

        row = {"kind": kind, "batch": batch, "ctx": ctx}
        for splits in (None, 1, 2, 4, 8, 16, 32):
            row[f"s{splits or 'auto'}"] = graph_us(lambda s=splits, call=call: call(s))
        print(json.dumps(row), flush=True)
        del cache


def model_dir(name: str) -> str:
    d = tempfile.mkdtemp(prefix="attnserve_probe_")
    cfg = json.loads(Path(resolve_config_path(name)).read_text())
    cfg.update(CUT)
    (Path(d) / "config.json").write_text(json.dumps(cfg))
    return d


def print_kernels(prof, title: str) -> None:
    print(f"== {title}")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=70))


def prefill_profile(name: str, backend: str, ctx: int = 32768, chunk: int = 8192) -> None:
    from torch.profiler import ProfilerActivity, profile

    d = model_dir(name)
    llm = LLM(d, load_format="dummy", dtype="bfloat16", attention_backend=backend, max_model_len=ctx + 64,
              max_num_seqs=4, max_num_batched_tokens=chunk, gpu_memory_utilization=0.85)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prompt(n: int = ctx) -> dict:
        return {"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(n)]}

    llm.generate([prompt(3000)], params)  # compiles
    llm.generate([prompt()], params)
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate([prompt()], params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    print(json.dumps({"model": name, "backend": backend, "ctx": ctx, "chunk": chunk, "prefill_s": round(seconds, 3),
                      "tok_s": round(ctx / seconds)}), flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt()], params)
        torch.cuda.synchronize()
    print_kernels(prof, f"prefill kernels, {name}, one {ctx}-token prompt")
    del llm
    torch.cuda.empty_cache()
    shutil.rmtree(d, ignore_errors=True)


def decode_profile(name: str, backend: str, batch: int = 32, ctx: int = 8192, steps: int = 16) -> None:
    from torch.profiler import ProfilerActivity, profile

    d = model_dir(name)
    llm = LLM(d, load_format="dummy", dtype="bfloat16", attention_backend=backend, max_model_len=ctx + 64,
              max_num_seqs=batch, max_num_batched_tokens=16384, gpu_memory_utilization=0.85, enforce_eager=True)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(ctx)]} for _ in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
        torch.cuda.synchronize()
    print_kernels(prof, f"eager decode kernels, {name}, batch {batch} x {ctx}, {steps} tokens (prefix hits: the "
                        f"last block's prefill included)")
    del llm
    torch.cuda.empty_cache()
    shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    parts = set(sys.argv[1:]) or {"micro", "prefill", "decode"}
    unknown = parts - {"micro", "prefill", "decode"}
    if unknown:
        sys.exit(f"unknown parts {sorted(unknown)}: micro, prefill, decode")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    if "micro" in parts:
        topk_sweep()
        split_sweep()
    if "prefill" in parts:
        for name, backend in (V32, V3):
            prefill_profile(name, backend)
    if "decode" in parts:
        for name, backend in (V32, V3):
            decode_profile(name, backend)


if __name__ == "__main__":
    main()
