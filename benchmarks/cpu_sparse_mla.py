"""CPU decode: sparse MLA (DSA: indexer + top-k + MQA over the selected rows) against dense MLA.

One decode token per step at a long context (default 16K), through a few layers, each with its
own paged caches filled with random rows. Sparse is TORCH_MLA_SPARSE's ``select_topk`` (score
every indexer key, keep the top-k) then ``forward`` over the selected latent rows. Dense is the
same absorbed ("MQA") MLA decode over every latent row: TORCH_MLA_SPARSE's ``forward`` with
every position selected, so both sides share their arithmetic and only the rows differ.
``--torch-mla`` also times TORCH_MLA's own decode, one step: its SDPA call with
``enable_gqa`` expands the single latent KV head to every query head on CPU (about 9 GB per
layer at these shapes), which makes it a poor baseline here.

Attention shapes are DeepSeek-V3.2's (128 query heads, kv_lora_rank 512 + rope 64, 64 indexer
heads of 128); the projections are left out (they are the same on both paths, apart from the
indexer's small ones), and one ``kv_b_proj`` is shared by the layers to keep memory down.
Bytes per step count cache reads per layer and token: every latent row (dense), every indexer
key plus the selected latent rows (sparse), in each cache format. What this is not: a GPU or
kernel benchmark; on CPU the fp8 formats are dequantised in PyTorch, so they save bytes, not
time.

    python benchmarks/cpu_sparse_mla.py [--context 16384] [--topk 256] [--layers 4]
        [--steps 5] [--cache-dtypes float32 fp8] [--torch-mla] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch

from attnserve.attention.backends.torch_mla import TorchMLABackend
from attnserve.attention.backends.torch_mla_sparse import TorchMLASparseBackend
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.kvcache.fp8 import mla_fp8_row_bytes, quantize_indexer_fp8, quantize_mla_fp8

BLOCK = 64
RANK, ROPE, NOPE, V_DIM = 512, 64, 128, 128


def row_bytes(dtype: str, idx_dim: int) -> tuple[int, int]:
    """(latent row, indexer key) bytes per token per layer in a cache format."""
    if dtype == "fp8":
        return mla_fp8_row_bytes(RANK, ROPE), idx_dim + 4
    width = {"float32": 4, "bfloat16": 2}[dtype]
    return (RANK + ROPE) * width, idx_dim * width


def fill_caches(context: int, idx_dim: int, dtype: str, gen: torch.Generator):
    """One layer's latent and indexer caches: block 0 null, blocks 1.. hold the sequence."""
    num_blocks = context // BLOCK + 2
    slots = num_blocks * BLOCK
    c_kv, k_pe = torch.randn(slots, RANK, generator=gen), torch.randn(slots, ROPE, generator=gen)
    keys = torch.randn(slots, idx_dim, generator=gen)
    if dtype == "fp8":
        latent, index = quantize_mla_fp8(c_kv, k_pe), quantize_indexer_fp8(keys)
    else:
        latent, index = torch.cat([c_kv, k_pe], dim=-1), keys
    latent = latent.view(num_blocks, BLOCK, -1)
    index = index.view(num_blocks, BLOCK, -1)
    latent[0].zero_()
    index[0].zero_()
    return {"latent": latent, "indexer": index}


def decode_metadata(context: int) -> CommonAttentionMetadata:
    """One request decoding its token at position ``context - 1``."""
    blocks = list(range(1, context // BLOCK + 2))
    pos = context - 1
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([context], dtype=torch.int32),
        positions=torch.tensor([pos]),
        block_tables=[torch.tensor([blocks], dtype=torch.int32)],
        slot_mappings=[torch.tensor([blocks[pos // BLOCK] * BLOCK + pos % BLOCK])],
        query_start_loc_cpu=[0, 1],
        seq_lens_cpu=[context],
        num_decodes=1,
        max_query_len=1,
        max_seq_len=context,
    )


def time_steps(step, steps: int, warm_up: bool = True) -> float:
    if warm_up:
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def run(args, dtype: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    caches = [fill_caches(args.context, args.index_dim, dtype, gen) for _ in range(args.layers)]
    layer = SimpleNamespace(
        kv_lora_rank=RANK,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=NOPE,
        scale=0.1352,
        w_kv_b=torch.randn(args.heads, NOPE + V_DIM, RANK, generator=gen) * RANK**-0.5,
    )
    q = torch.randn(1, args.heads, NOPE + ROPE, generator=gen)
    rows = torch.randn(1, RANK + ROPE, generator=gen)
    q_i = torch.randn(1, args.index_heads, args.index_dim, generator=gen)
    k_i = torch.randn(1, args.index_dim, generator=gen)
    w_i = torch.randn(1, args.index_heads, generator=gen)
    common = decode_metadata(args.context)
    sparse = TorchMLASparseBackend(BLOCK)
    every = torch.arange(args.context, dtype=torch.int32)[None]  # [1, S]: dense selection
    index_time = [0.0]

    def dense_step():
        meta = sparse.build_metadata(common, 0)
        for c in caches:
            sparse.forward(layer, q, rows, None, c, meta, topk_indices=every)

    def sparse_step():
        meta = sparse.build_metadata(common, 0)
        for c in caches:
            start = time.perf_counter()
            idx = sparse.select_topk(q_i, k_i, w_i, c, meta, topk=args.topk)
            index_time[0] += time.perf_counter() - start
            sparse.forward(layer, q, rows, None, c, meta, topk_indices=idx)

    def torch_mla_step():
        backend = TorchMLABackend(BLOCK)
        meta = backend.build_metadata(common, 0)
        for c in caches:
            backend.forward(layer, q, rows, None, c, meta)

    with torch.inference_mode():
        t_dense = time_steps(dense_step, args.steps)
        t_sparse = time_steps(sparse_step, args.steps)
        t_torch_mla = time_steps(torch_mla_step, 1, warm_up=False) if args.torch_mla else None
    t_index = index_time[0] / (args.steps + 1)
    latent_b, index_b = row_bytes(dtype, args.index_dim)
    return {
        "cache_dtype": dtype,
        "context": args.context,
        "topk": args.topk,
        "layers": args.layers,
        "dense_ms_per_token": 1e3 * t_dense,
        "sparse_ms_per_token": 1e3 * t_sparse,
        "sparse_indexer_ms_per_token": 1e3 * t_index,
        "torch_mla_ms_per_token": t_torch_mla and 1e3 * t_torch_mla,
        "dense_bytes_per_layer": args.context * latent_b,
        "sparse_bytes_per_layer": args.context * index_b + args.topk * latent_b,
    }


def bytes_table(args) -> list[str]:
    lines = [
        f"{'cache format':>12} | {'dense B/layer':>13} | {'sparse B/layer':>14} | "
        f"{'(indexer + selected)':>22} | ratio"
    ]
    for fmt in ("float32", "bfloat16", "fp8"):
        latent_b, index_b = row_bytes(fmt, args.index_dim)
        d = args.context * latent_b
        s_idx, s_sel = args.context * index_b, args.topk * latent_b
        lines.append(
            f"{fmt:>12} | {d:>13,} | {s_idx + s_sel:>14,} | "
            f"{f'{s_idx:,} + {s_sel:,}':>22} | {d / (s_idx + s_sel):5.2f}x"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--topk", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--index-heads", type=int, default=64)
    p.add_argument("--index-dim", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--cache-dtypes", nargs="+", default=["float32", "fp8"])
    p.add_argument(
        "--torch-mla",
        action="store_true",
        help="also time TORCH_MLA's decode (one step; slow and memory-hungry on CPU)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print(
        f"decode, batch 1, context {args.context}, top-k {args.topk}, {args.layers} layers, "
        f"{args.heads} heads x ({RANK} + {ROPE}), indexer {args.index_heads} x "
        f"{args.index_dim}, {torch.get_num_threads()} threads"
    )
    results = [run(args, dtype) for dtype in args.cache_dtypes]
    print(
        f"{'cache':>8} | {'dense ms/tok':>12} | {'sparse ms/tok':>13} | "
        f"{'of it indexer':>13} | speed-up | TORCH_MLA ms/tok"
    )
    for r in results:
        tm = r["torch_mla_ms_per_token"]
        print(
            f"{r['cache_dtype']:>8} | {r['dense_ms_per_token']:>12.1f} | "
            f"{r['sparse_ms_per_token']:>13.1f} | {r['sparse_indexer_ms_per_token']:>13.1f} | "
            f"{r['dense_ms_per_token'] / r['sparse_ms_per_token']:7.2f}x | "
            f"{'-' if tm is None else f'{tm:.1f}'}"
        )
    print("cache bytes read per decode token and layer:")
    print("\n".join(bytes_table(args)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
