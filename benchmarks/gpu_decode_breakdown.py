"""Where a memory-bound decode's time goes on the H200 (issue #22's gap analysis).

For each shape the step's floor (its bytes at the copy bandwidth measured in this run) is set
against what the engine launches and against kernels that only read the same bytes:

- paged decode (``--shapes 1x32768,16x4096``; 32 query / 8 KV heads, head 128, bf16, page 16,
  cache [blocks, 16, KV heads, 128]): TRITON_ATTN's ``unified_attention`` with its split-KV
  partials merged by a second launch (``split_merge`` "kernel"). The profiler's kernel times
  (CUPTI, inside the CUDA graph) split it into the attention kernel and the merge kernel; the
  rest of the graph's time per call is the gap between launches (and, with one or two input
  sets, the graph's own launch: ``eng x8`` shares it among 8 calls, as a model step's graph
  shares it among its layers). ``read_same`` is a Triton
  kernel with the same grid (request, KV head, split) and the same 64-key tiles, gathered
  through the block table, that only sums K and V: what this access pattern reads at best.
  ``read_flat`` sums the same number of bytes as one contiguous tensor. ``empty x2`` is a graph
  of two empty kernels: the fixed cost of two launches.
- fp8 indexer keys (``--indexer 32x65536``; 132-byte rows, page 64): reading the pages as
  4-byte words per row (what a 132-byte row stride allows) against the same pages read as whole
  contiguous 8,448-byte blocks in 16-byte vectors.

Timing: ``gpu_attention.time_per_call`` (CUDA graph over rotated sets, ``do_bench`` median).

    python benchmarks/gpu_decode_breakdown.py [--shapes 1x32768,16x4096] [--indexer 32x65536]

Prints a table last; writes ``$OUT/gpu_decode_breakdown.json`` when ``OUT`` is set.
Needs a CUDA GPU (``--smoke`` runs the read kernels under Triton's interpreter at toy sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_attention as ga  # noqa: E402  (puts src/ on sys.path too)
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from ceilings import measure_ceilings  # noqa: E402

from attnserve.ops.attention.paged_triton import pick_num_splits  # noqa: E402


# fmt: off
@triton.jit
def _read_tile(acc, k_ptr, v_ptr, bt_ptr, seq, head, t, seq_len, stride_blk, stride_tok,
               stride_head, stride_bt, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = tl.load(bt_ptr + seq * stride_bt + pos // PAGE, mask=pos < seq_len, other=0)
    row = blk.to(tl.int64) * stride_blk + (pos % PAGE) * stride_tok + head * stride_head
    ptrs = row[:, None] + tl.arange(0, D)[None, :]
    ok = (pos < seq_len)[:, None]
    acc += tl.load(k_ptr + ptrs, mask=ok, other=0.0).to(tl.float32)
    acc += tl.load(v_ptr + ptrs, mask=ok, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _read_paged_kernel(k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, num_splits, stride_blk, stride_tok,
                       stride_head, stride_bt, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                       D: tl.constexpr, INTERPRET: tl.constexpr):
    """Sum of a (request, KV head, split)'s K and V rows, tiles of BLOCK_N keys as the decode
    kernel reads them (block table lookup per key, D contiguous values a row)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)
    tiles = tl.cdiv(seq_len, BLOCK_N)
    per = tl.cdiv(tiles, num_splits)
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    hi = tl.minimum(split * per + per, tiles)
    if INTERPRET:  # the interpreter's range() cannot take a loaded bound
        t = split * per
        while t < hi:
            acc = _read_tile(acc, k_ptr, v_ptr, bt_ptr, seq, head, t, seq_len, stride_blk,
                             stride_tok, stride_head, stride_bt, PAGE, BLOCK_N, D)
            t += 1
    else:
        for t in range(split * per, hi):
            acc = _read_tile(acc, k_ptr, v_ptr, bt_ptr, seq, head, t, seq_len, stride_blk,
                             stride_tok, stride_head, stride_bt, PAGE, BLOCK_N, D)
    pid = (seq * tl.num_programs(1) + head) * num_splits + split
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _read_flat_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Sum of a contiguous int32 range, ITERS blocks a program."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        idx = (pid * ITERS + i) * BLOCK + offs
        acc += tl.load(x_ptr + idx, mask=idx < n, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


@triton.jit
def _read_rows_kernel(x_ptr, bt_ptr, out_ptr, stride_bt, PAGES_PER_PROG: tl.constexpr, ROW_WORDS: tl.constexpr,
                      WORDS_PAD: tl.constexpr, PAGE: tl.constexpr, VECTOR: tl.constexpr):
    """Sum of a request's fp8 indexer pages: VECTOR reads each page as one contiguous block
    (PAGE * ROW_WORDS int32 words, 16-byte aligned); else row by row, ROW_WORDS words a row at
    the row stride (4-byte aligned only: 132-byte rows)."""
    seq = tl.program_id(0)
    chunk = tl.program_id(1)
    acc = tl.zeros([PAGE, WORDS_PAD], tl.int32)
    rows = tl.arange(0, PAGE)
    words = tl.arange(0, WORDS_PAD)
    for i in range(PAGES_PER_PROG):
        blk = tl.load(bt_ptr + seq * stride_bt + chunk * PAGES_PER_PROG + i).to(tl.int64)
        base = x_ptr + blk * (PAGE * ROW_WORDS)
        if VECTOR:  # flat [PAGE * WORDS_PAD] view of the page's words, aligned to 16 bytes
            flat = rows[:, None] * WORDS_PAD + words[None, :]
            acc += tl.load(base + flat, mask=flat < PAGE * ROW_WORDS, other=0)
        else:
            acc += tl.load(base + rows[:, None] * ROW_WORDS + words[None, :],
                           mask=(words < ROW_WORDS)[None, :], other=0)
    tl.store(out_ptr + seq * tl.num_programs(1) + chunk, tl.sum(tl.sum(acc, 1), 0))
# fmt: on


def parse(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, text.split(",")):
        b, _, c = item.partition("x")
        out.append((int(b), int(c)))
    return out


def kernel_times(graph_call, reps: int = 20) -> dict[str, float]:
    """Mean GPU microseconds per replay of each kernel the call's replays run (CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    graph_call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph_call()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name.split("(")[0][:40]
            totals[name] = totals.get(name, 0.0) + ev.device_time / reps
    return totals


def graph_of(calls):
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return g


def decode_row(batch: int, ctx: int, bw: float) -> dict:
    ga.PAGE, heads, kv_heads, head = 16, ga.HEADS, ga.KV_HEADS, ga.HEAD
    moved = batch * ctx * kv_heads * head * 2 * 2 + 2 * batch * heads * head * 2
    sets = max(ga.num_sets(batch * ctx * kv_heads * head * 4), 1)
    data = [ga.paged_batch([1] * batch, [ctx] * batch) for _ in range(sets)]
    for b in data:  # host bounds, as the engine passes them (no sync inside the graph)
        b["max_q"], b["max_s"] = 1, ctx
    outs = [torch.empty_like(b["q"]) for b in data]
    row = {"shape": f"{batch}x{ctx}", "bytes": moved, "floor_us": moved / bw * 1e6, "sets": sets}
    calls = [lambda b=b, o=o: ga.run_ours(b, o) for b, o in zip(data, outs)]
    t, _ = ga.time_per_call(calls)
    row["engine_us"] = t * 1e6
    t, _ = ga.time_per_call(calls, min_calls=8)  # the graph's launch shared by 8 calls
    row["engine_x8_us"] = t * 1e6
    try:
        g = graph_of(calls)
        per = kernel_times(g.replay)
        row["kernels_us"] = {k: v / sets for k, v in per.items()}
    except Exception as exc:  # noqa: BLE001 (the profiler is optional)
        row["kernels_error"] = f"{type(exc).__name__}: {exc}"[:200]
    splits = pick_num_splits(batch, kv_heads, 1, ctx, data[0]["q"].device)
    row["splits"] = splits
    sums = torch.empty(batch * kv_heads * splits, device=ga.DEV)

    def read_same(b):
        kc = b["key_cache"]
        _read_paged_kernel[(batch, kv_heads, splits)](
            kc, b["value_cache"], b["block_table"], b["seq_lens"], sums, splits, kc.stride(0),
            kc.stride(1), kc.stride(2), b["block_table"].stride(0), PAGE=16, BLOCK_N=64,
            D=b["key_cache"].shape[-1], INTERPRET=ga.DEV != "cuda", num_warps=4,
            num_stages=3)  # fmt: skip

    t, _ = ga.time_per_call([lambda b=b: read_same(b) for b in data])
    row["read_same_us"] = t * 1e6
    words = moved // 4
    flats = [torch.zeros(words, dtype=torch.int32, device=ga.DEV) for _ in range(sets)]
    block, iters = 2048, 8
    grid = triton.cdiv(words, block * iters)
    out = torch.empty(grid, dtype=torch.int32, device=ga.DEV)
    t, _ = ga.time_per_call([lambda x=x: _read_flat_kernel[(grid,)](x, out, words, BLOCK=block,
                                                                     ITERS=iters)
                             for x in flats])  # fmt: skip
    row["read_flat_us"] = t * 1e6
    del data, outs, flats
    return row


def empty_two(dev) -> float:
    x = torch.zeros(1, dtype=torch.int32, device=dev)
    out = torch.empty(1, dtype=torch.int32, device=dev)

    def two():
        _read_flat_kernel[(1,)](x, out, 0, BLOCK=16, ITERS=1)
        _read_flat_kernel[(1,)](x, out, 0, BLOCK=16, ITERS=1)

    return ga.time_per_call([two] * 8)[0] * 1e6


def indexer_row(batch: int, ctx: int, bw: float) -> dict:
    page, row_bytes = 64, 132
    pages = ctx // page
    moved = batch * ctx * row_bytes
    sets = max(ga.num_sets(moved), 1)
    blocks = batch * pages + 1
    caches = [torch.randint(0, 256, (blocks * page * row_bytes // 4,), dtype=torch.int32,
                            device=ga.DEV) for _ in range(sets)]  # fmt: skip
    table = (torch.randperm(blocks - 1, device=ga.DEV).view(batch, pages) + 1).int()
    row = {"shape": f"indexer {batch}x{ctx}", "bytes": moved, "floor_us": moved / bw * 1e6}
    per_prog = max(1, pages * batch // (4 * 132))  # ~4 waves of programs
    per_prog = next(d for d in range(per_prog, 0, -1) if pages % d == 0)
    out = torch.empty(batch * (pages // per_prog), dtype=torch.int32, device=ga.DEV)
    for name, vector in (("read_rows4_us", False), ("read_pages16_us", True)):
        def call(c, vector=vector):
            _read_rows_kernel[(batch, pages // per_prog)](
                c, table, out, table.stride(0), PAGES_PER_PROG=per_prog, ROW_WORDS=row_bytes // 4,
                WORDS_PAD=64, PAGE=page, VECTOR=vector, num_warps=4)

        t, _ = ga.time_per_call([lambda c=c: call(c) for c in caches])
        row[name] = t * 1e6
    del caches
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x32768,16x4096", help="paged decode BATCHxCONTEXT list")
    ap.add_argument("--indexer", default="32x65536", help="fp8 indexer BATCHxCONTEXT list")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, toy sizes")
    args = ap.parse_args()
    if args.smoke:
        ga.DEV, ga.DTYPE = "cpu", torch.float32
        args.shapes, args.indexer = "1x128", "1x256"
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke)")
        return 2
    start = time.perf_counter()
    ceilings = measure_ceilings(torch.device(ga.DEV))
    bw = ceilings["copy_bw"]
    rows = [decode_row(b, c, bw) for b, c in parse(args.shapes)]
    for r in rows:
        print(json.dumps(r), flush=True)
    idx = [indexer_row(b, c, bw) for b, c in parse(args.indexer)]
    for r in idx:
        print(json.dumps(r), flush=True)
    empty = empty_two(torch.device(ga.DEV)) if ga.DEV == "cuda" else None
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s; a graph of two empty kernels: "
          f"{'-' if empty is None else f'{empty:.1f}'} us")
    print(f"{'shape':>20} {'floor':>7} {'engine':>7} {'eng x8':>7} {'attn':>7} {'merge':>7} {'gap':>6} "
          f"{'read_same':>9} {'read_flat':>9}  (us; % of floor = floor / time)")
    for r in rows:
        if "engine_us" not in r:
            continue
        ks = r.get("kernels_us", {})
        attn = sum(v for k, v in ks.items() if "attention" in k)
        merge = sum(v for k, v in ks.items() if "merge" in k)
        gap = r["engine_us"] - attn - merge if ks else None
        cells = [r["floor_us"], r["engine_us"], r["engine_x8_us"], attn or None, merge or None, gap,
                 r["read_same_us"], r["read_flat_us"]]
        print(f"{r['shape']:>20} " + " ".join(
            f"{'-' if c is None else f'{c:.1f}':>7}" for c in cells[:6]) + " " + " ".join(
            f"{c:>6.1f} {100 * r['floor_us'] / c:>2.0f}%" for c in cells[6:]))  # fmt: skip
        if ks:
            print("   kernels: " + ", ".join(f"{k} {v:.1f}" for k, v in ks.items()))
    for r in idx:
        print(f"{r['shape']:>20} floor {r['floor_us']:.1f} us; 4-byte row reads "
              f"{r['read_rows4_us']:.1f} ({100 * r['floor_us'] / r['read_rows4_us']:.0f}%), "
              f"16-byte page reads {r['read_pages16_us']:.1f} "
              f"({100 * r['floor_us'] / r['read_pages16_us']:.0f}%)")
    result = dict(ceilings=ceilings, rows=rows, indexer=idx, empty_two_us=empty,
                  wall_s=time.perf_counter() - start)
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "gpu_decode_breakdown.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
