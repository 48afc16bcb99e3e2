"""The decode path's small kernels, old against fused, at Llama-3.1-8B's layer shapes (H200).

1. RoPE then the KV-cache write (``triton_fused.rotary`` + ``write_kv_cache``, two launches)
   against ``rope_write_kv_cache`` (one): q [B, 32, 128], k and v [B, 8, 128] as views of one
   QKV projection output, neox, bf16 cache.
2. Split-KV decode attention with the separate merge kernel (``merge="kernel"``, two launches)
   against the merge inside the attention launch (``merge="last_split"``, one), at the split
   count a decode graph uses (``pick_num_splits`` with ``max(context, --max-model-len)``: the
   graph runner's host bound is ``max_model_len``).
3. Qwen3's per-head q/k RMSNorm in front of the fused RoPE write: ``rms_norm`` on q and on k
   then ``rope_write_kv_cache`` (three launches) against ``rope_write_kv_cache(qk_norm=...)``
   (one), at Qwen3-0.6B's layer shape (16 q heads, 8 KV heads of 128, 28 layers), batch 1 and
   256, context 512.

Correctness first, on every batch: the fused RoPE write gives the unfused Triton path's bits
(q and the cache) and the PyTorch twin's values (``rotary_ref`` + ``write_kv``); both merges
match ``attention.reference.paged_attention`` (max|out - ref| / max|ref| <= 2e-2); the fused q/k
norm matches the three launches and the PyTorch twin (``rms_norm_ref``, ``rotary_ref``,
``write_kv``) to the same tolerance (not to the bit on the GPU: its sum of squares reduces another
tile layout than ``rms_norm``'s; the row says how many q values differ). The script exits
non-zero when a check fails.

Timing: one CUDA graph per variant holds ``--reps`` rounds over ``L`` layers (each layer its own
cache, as in the model, so the caches do not all sit in L2); the time per call is the median
replay time (CUDA events) / (reps * L). Batches 1, 8, 64 x context 128..4K.

    python benchmarks/gpu_small_kernels.py [--max-model-len 2048] [--reps 20]
    python benchmarks/gpu_small_kernels.py --smoke   # CPU, Triton's interpreter, toy sizes

Prints a table; writes ``$OUT/gpu_small_kernels.json`` when ``OUT`` is set.
Not a test: CPU correctness is ``tests/kernels/test_rope_kv_write.py`` and
``tests/kernels/test_triton_attention.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from graph_timing import graph_replay_us  # noqa: E402

from attnserve.attention.reference import paged_attention, write_kv  # noqa: E402
from attnserve.layers.fused import rms_norm_ref, rotary_ref  # noqa: E402
from attnserve.ops.attention.kv_write_triton import rope_write_kv_cache, write_kv_cache  # noqa: E402
from attnserve.ops.attention.paged_triton import pick_num_splits, unified_attention  # noqa: E402
from attnserve.ops.dense.fused_triton import rms_norm, rotary  # noqa: E402

PAGE = 16
REL_TOL = 2e-2


def shapes(smoke: bool) -> dict:
    if smoke:
        return dict(dev="cpu", dtype=torch.float32, heads=4, kv_heads=2, head=32, layers=2,
                    batches=(1, 2), contexts=(64, 128), splits_floor=4)
    return dict(dev="cuda", dtype=torch.bfloat16, heads=32, kv_heads=8, head=128, layers=32,
                batches=(1, 8, 64), contexts=(128, 512, 1024, 2048, 4096), splits_floor=1)


class Layer:
    """One layer's inputs for a decode batch of B at one context: QKV output, caches, metadata."""

    def __init__(self, s: dict, batch: int, ctx: int, gen: torch.Generator):
        dev, h, hk, d = s["dev"], s["heads"], s["kv_heads"], s["head"]
        blocks = -(-ctx // PAGE)
        self.qkv = torch.randn(batch, (h + 2 * hk) * d, device=dev, generator=gen).to(s["dtype"])
        self.q = self.qkv[:, : h * d].view(batch, h, d)
        self.k = self.qkv[:, h * d : (h + hk) * d].view(batch, hk, d)
        self.v = self.qkv[:, (h + hk) * d :].view(batch, hk, d)
        shape = (batch * blocks + 1, PAGE, hk, d)
        self.k_cache = torch.randn(shape, device=dev, generator=gen).to(s["dtype"])
        self.v_cache = torch.randn(shape, device=dev, generator=gen).to(s["dtype"])
        perm = torch.randperm(batch * blocks, device=dev, generator=gen).to(torch.int32) + 1
        self.block_table = perm.view(batch, blocks)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        self.positions = torch.full((batch,), ctx - 1, dtype=torch.int64, device=dev)
        last = self.block_table[:, (ctx - 1) // PAGE].long()
        self.slots = last * PAGE + (ctx - 1) % PAGE  # the decode token's slot
        self.out = torch.empty(batch, h, d, device=dev, dtype=s["dtype"])


def rope_old(layer: Layer, table: torch.Tensor) -> torch.Tensor:
    q, k = rotary(layer.q, layer.k, table, layer.positions, table.shape[1], False)
    write_kv_cache(k, layer.v, layer.k_cache, layer.v_cache, layer.slots)
    return q


def rope_new(layer: Layer, table: torch.Tensor) -> torch.Tensor:
    return rope_write_kv_cache(layer.q, layer.k, layer.v, layer.k_cache, layer.v_cache, layer.slots,
                               table, layer.positions, table.shape[1], False)


def qk_shapes(smoke: bool) -> dict:
    """Qwen3-0.6B's attention layer (``s`` for ``Layer``), decode batches 1 and 256."""
    if smoke:
        return dict(dev="cpu", dtype=torch.float32, heads=4, kv_heads=2, head=32, layers=2, batches=(1, 2))
    return dict(dev="cuda", dtype=torch.bfloat16, heads=16, kv_heads=8, head=128, layers=28, batches=(1, 256))


def qk_norm_weights(layer: Layer, gen: torch.Generator) -> tuple:
    d, dev = layer.q.shape[-1], layer.q.device
    w = [(torch.rand(d, device=dev, generator=gen) + 0.5).to(layer.q.dtype) for _ in range(2)]
    return w[0], w[1], 1e-6, 1e-6


def qk_norm_old(layer: Layer, table: torch.Tensor, norm: tuple) -> torch.Tensor:
    q, k = rms_norm(layer.q, norm[0], norm[2]), rms_norm(layer.k, norm[1], norm[3])
    return rope_write_kv_cache(q, k, layer.v, layer.k_cache, layer.v_cache, layer.slots, table, layer.positions,
                               table.shape[1], False)


def qk_norm_new(layer: Layer, table: torch.Tensor, norm: tuple) -> torch.Tensor:
    return rope_write_kv_cache(layer.q, layer.k, layer.v, layer.k_cache, layer.v_cache, layer.slots, table,
                               layer.positions, table.shape[1], False, qk_norm=norm)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)


def check_qk_norm(layer: Layer, table: torch.Tensor, norm: tuple) -> tuple[list[str], int]:
    """Failures of the fused q/k norm against the three launches and the twin, and how many q
    values differ from the three launches' bits."""
    caches = (layer.k_cache.clone(), layer.v_cache.clone())
    q_old = qk_norm_old(layer, table, norm)
    old = (layer.k_cache.clone(), layer.v_cache.clone())
    layer.k_cache.copy_(caches[0])
    layer.v_cache.copy_(caches[1])
    q_new = qk_norm_new(layer, table, norm)
    twin = [c.clone() for c in caches]
    q_ref, k_ref = rotary_ref(rms_norm_ref(layer.q, norm[0], norm[2]), rms_norm_ref(layer.k, norm[1], norm[3]),
                              table, layer.positions, table.shape[1], False)
    write_kv(*twin, k_ref, layer.v, layer.slots)
    bad = []
    for name, got, a, b in (("q", q_new, q_old, q_ref), ("k cache", layer.k_cache, old[0], twin[0]),
                            ("v cache", layer.v_cache, old[1], twin[1])):
        for what, want in (("the three launches", a), ("the PyTorch twin", b)):
            err = rel_err(got, want)
            if not err <= REL_TOL:
                bad.append(f"fused q/k norm: {name} off {what} by {err:.1e}")
    return bad, int((q_new != q_old).sum().item())


def run_qk_norm(args) -> tuple[list[dict], list[str]]:
    s = qk_shapes(args.smoke)
    gen = torch.Generator(device=s["dev"]).manual_seed(1)
    ctx, d = 512, s["head"]
    angles = torch.arange(ctx + 1, device=s["dev"]).float()[:, None] * (
        1e6 ** (-torch.arange(0, d, 2, device=s["dev"]).float() / d))
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    rows, failures = [], []
    reps = 1 if args.smoke else args.reps
    for batch in s["batches"]:
        layers = [Layer(s, batch, ctx, gen) for _ in range(s["layers"])]
        norms = [qk_norm_weights(x, gen) for x in layers]
        bad, q_diff = check_qk_norm(layers[0], table, norms[0])
        failures += [f"qk-norm batch {batch}: {b}" for b in bad]
        row = dict(batch=batch, context=ctx, layers=len(layers), q_values_not_bit_equal=q_diff)
        for name, call in (("norm2_rope_write", qk_norm_old), ("fused", qk_norm_new)):
            pairs = list(zip(layers, norms))
            fn = lambda call=call, pairs=pairs: [call(x, table, w) for x, w in pairs]  # noqa: E731
            row[name] = round(time_per_call(s, fn, len(layers), reps), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del layers, norms, pairs, fn
        if s["dev"] == "cuda":
            torch.cuda.empty_cache()
    return rows, failures


def attend(layer: Layer, splits: int, merge: str, ctx: int) -> torch.Tensor:
    return unified_attention(layer.q, layer.k_cache, layer.v_cache, layer.out, layer.block_table, layer.qsl,
                             layer.seq_lens, scale=layer.q.shape[-1] ** -0.5, max_query_len=1,
                             max_seq_len=ctx, num_splits=splits, merge=merge)


def check(s: dict, layer: Layer, table: torch.Tensor, splits: int, ctx: int) -> list[str]:
    """Failures of the fused kernels against the old ones and the PyTorch twins (empty: all pass)."""
    bad = []
    caches = (layer.k_cache.clone(), layer.v_cache.clone())
    q_old = rope_old(layer, table)
    old = (layer.k_cache.clone(), layer.v_cache.clone())
    layer.k_cache.copy_(caches[0])
    layer.v_cache.copy_(caches[1])
    q_new = rope_new(layer, table)
    if not (torch.equal(q_new, q_old) and torch.equal(layer.k_cache, old[0]) and torch.equal(layer.v_cache, old[1])):
        bad.append("rope_write_kv_cache differs from rotary + write_kv_cache")
    twin = [c.clone() for c in caches]
    q_ref, k_ref = rotary_ref(layer.q, layer.k, table, layer.positions, table.shape[1], False)
    write_kv(*twin, k_ref, layer.v, layer.slots)
    for name, got, want in (("q", q_new, q_ref), ("k cache", layer.k_cache, twin[0]), ("v cache", layer.v_cache, twin[1])):
        err = (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)
        if err > REL_TOL:
            bad.append(f"fused RoPE write: {name} off the PyTorch twin by {err:.1e}")
    ref = paged_attention(layer.q, layer.k_cache, layer.v_cache, layer.block_table, layer.qsl, layer.seq_lens,
                          scale=layer.q.shape[-1] ** -0.5).float()
    for merge in ("kernel", "last_split"):
        for _ in range(2):  # twice: the in-kernel merge's counters must come back to 0
            out = attend(layer, splits, merge, ctx).float()
            err = (out - ref).abs().max().item() / ref.abs().max().item()
            if not err <= REL_TOL:
                bad.append(f"attention merge={merge}, {splits} splits: rel err {err:.1e}")
    return bad


def time_per_call(s: dict, fn: Callable[[], None], calls: int, reps: int) -> float:
    """Microseconds per call: median of graph replays (CUDA) or wall time (smoke)."""
    if s["dev"] == "cpu":
        t = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t) / calls

    def body() -> None:
        for _ in range(reps):
            fn()

    return graph_replay_us(body, warm=fn, replays=10) / (reps * calls)


def layers_that_fit(s: dict, batch: int, ctx: int) -> int:
    if s["dev"] == "cpu":
        return s["layers"]
    per_layer = 2 * batch * (-(-ctx // PAGE) + 1) * PAGE * s["kv_heads"] * s["head"] * 2
    return max(1, min(s["layers"], int(40e9 // per_layer)))


def run(s: dict, args) -> tuple[list[dict], list[str]]:
    gen = torch.Generator(device=s["dev"]).manual_seed(0)
    table_pos = max(s["contexts"]) + 1
    angles = torch.arange(table_pos, device=s["dev"]).float()[:, None] * (
        1e4 ** (-torch.arange(0, s["head"], 2, device=s["dev"]).float() / s["head"]))
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)  # [positions, head]: cos | sin
    rows, failures = [], []
    reps = 1 if args.smoke else args.reps
    for batch in s["batches"]:
        for ctx in s["contexts"]:
            n = layers_that_fit(s, batch, ctx)
            layers = [Layer(s, batch, ctx, gen) for _ in range(n)]
            dev = torch.device(s["dev"])
            splits = max(s["splits_floor"], pick_num_splits(batch, s["kv_heads"], 1, max(ctx, args.max_model_len), dev))
            bad = check(s, layers[0], table, splits, ctx)
            failures += [f"batch {batch} ctx {ctx}: {b}" for b in bad]
            row = dict(batch=batch, context=ctx, layers=n, splits=splits)
            variants = {
                "rope_write_old": lambda x: rope_old(x, table),
                "rope_write_fused": lambda x: rope_new(x, table),
                "attn_merge_kernel": lambda x, sp=splits, c=ctx: attend(x, sp, "kernel", c),
                "attn_merge_in_kernel": lambda x, sp=splits, c=ctx: attend(x, sp, "last_split", c),
            }
            for name, call in variants.items():
                fn = lambda call=call, layers=layers: [call(x) for x in layers]  # noqa: E731
                row[name] = round(time_per_call(s, fn, n, reps), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del layers
            if s["dev"] == "cuda":
                torch.cuda.empty_cache()
    return rows, failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, toy sizes")
    ap.add_argument("--max-model-len", type=int, default=2048,
                    help="the graph runner's host bound for the split count (gpu_profile --parts 8b: 2048)")
    ap.add_argument("--reps", type=int, default=20, help="rounds over the layers in one graph")
    args = ap.parse_args()
    s = shapes(args.smoke)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --smoke)")
    rows, failures = run(s, args)
    qk_rows, qk_failures = run_qk_norm(args)
    failures += qk_failures
    print("\nus per layer call (decode; RoPE+write: 2 launches -> 1; split attention: 2 -> 1)")
    print(f"{'batch':>5} {'ctx':>5} {'splits':>6} | {'rope+write':>10} {'fused':>7} {'saved':>6} | "
          f"{'attn+merge':>10} {'merged':>7} {'saved':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['context']:>5} {r['splits']:>6} | {r['rope_write_old']:>10.2f} "
              f"{r['rope_write_fused']:>7.2f} {r['rope_write_old'] - r['rope_write_fused']:>6.2f} | "
              f"{r['attn_merge_kernel']:>10.2f} {r['attn_merge_in_kernel']:>7.2f} "
              f"{r['attn_merge_kernel'] - r['attn_merge_in_kernel']:>6.2f}")
    print("\nus per layer call, Qwen3-0.6B shape (q/k RMSNorm + RoPE+write: 3 launches -> 1)")
    print(f"{'batch':>5} | {'2 norms + rope+write':>20} {'fused':>7} {'saved':>6} | q values not bit-equal")
    for r in qk_rows:
        print(f"{r['batch']:>5} | {r['norm2_rope_write']:>20.2f} {r['fused']:>7.2f} "
              f"{r['norm2_rope_write'] - r['fused']:>6.2f} | {r['q_values_not_bit_equal']}")
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "gpu_small_kernels.json"
        path.write_text(json.dumps({"rows": rows, "qk_norm_rows": qk_rows, "failures": failures}, indent=1))
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("\nall checks passed")


if __name__ == "__main__":
    main()
