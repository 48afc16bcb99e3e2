"""H200 check and timing of the Gluon causal prefill kernel (``ops/attention/prefill_gluon``), issue #22.

1. Checks, 32 query / 8 KV heads, head 128, bf16, pages 16 and 64, caches NaN-filled before the
   live rows are written (a read of an unused slot or past a sequence shows as NaN): every variant
   of ``CONFIGS`` against the float32 twin (``attention.reference.paged_attention``) on one
   request of 1, 17, 129 and 1000 new tokens (the 1-token one inside a prefill step: the host bound
   ``max_query_len`` is 2) and a batch of 5, 300 and 2049 new tokens after 100, 0 and 4096 cached
   ones; that batch also at page 16 with 8/8 heads in fp16, 24/8 and 64/8 in bf16 (head groups 1,
   3 and 8: the first variant and the first split one only); ``unified_attention`` (the kernel it
   would replace) on the same cases. Bound ``max|out - ref| / max|ref| <= 2e-2``, no NaN, and the
   7 rows past the batch's tokens untouched.
2. Timing, one request of 4K, 16K, 32K tokens, no context, page 16: each variant,
   ``unified_attention``, and the SDPA peers on contiguous [1, H, S, D] inputs (cuDNN and
   FlashAttention with K/V expanded to the 32 heads before the timed call; FlashAttention GQA) by
   ``gpu_attention.time_per_call`` (one CUDA graph over rotated input sets, ``do_bench`` median):
   TFLOP/s (causal: 2 n^2 128 32) and % of the bf16 ``torch.mm`` rate measured in this run; each
   variant's output against ``unified_attention``'s on the same inputs (a check too, same bound).

``--smoke`` runs on CPU at toy sizes (float32, 4/2 heads, head 32) to show the script runs:
Gluon has no interpreter, so its calls are skipped (its input checks still run and must refuse);
the twin and ``unified_attention`` (Triton's interpreter) do run. ``--variants a,b`` times only
those. A watchdog ends the run with a traceback after ``--budget-s`` (a hung kernel). One command,
under 3 minutes on the H200:

    python benchmarks/gpu_prefill_gluon.py [--smoke] [--variants n128_s3_overlap] [--budget-s 175]
        [--shapes 512,1024,8x512@1024] [--no-checks]

``--shapes`` replaces the timed batches: ``N`` is one request of N tokens, ``RxQ@C`` R requests
of Q new tokens after C cached ones (a varlen batch: TRITON_ATTN's prefill steps; no SDPA peer).

Writes ``$OUT/gpu_prefill_gluon.json`` when ``OUT`` is set; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import faulthandler
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
from ceilings import measure_ceilings  # noqa: E402
from gpu_attention import bench_peers, num_sets, paged_batch, peer_fns, rel_err  # noqa: E402

from attnserve.attention.reference import paged_attention  # noqa: E402
from attnserve.ops.attention.paged_triton import unified_attention  # noqa: E402
from attnserve.ops.attention.prefill_gluon import CONFIGS, prefill_attention_gluon  # noqa: E402

REL_TOL, PAD = 2e-2, 7
PEERS = ("sdpa_cudnn_mha", "sdpa_flash_mha", "sdpa")  # no Flex: its compiles cost minutes
# (q_lens, context lens) of the checks
FULL = dict(heads=32, kv_heads=8, head=128, dtype=torch.bfloat16, pages=(16, 64),
            checks=(((1,), (0,)), ((17,), (0,)), ((129,), (0,)), ((1000,), (0,)),
                    ((5, 300, 2049), (100, 0, 4096))),
            groups=((8, 8, torch.float16), (24, 8, torch.bfloat16), (64, 8, torch.bfloat16)),
            tokens=(4096, 16384, 32768))  # fmt: skip
SMOKE = dict(heads=4, kv_heads=2, head=32, dtype=torch.float32, pages=(16,),
             checks=(((17,), (0,)), ((5, 30, 9), (3, 0, 20))), groups=((2, 2, torch.float32),),
             tokens=(64,))  # fmt: skip


def batch(q_lens, ctx_lens, sizes: dict, page: int) -> dict:
    """A NaN-filled paged batch (``gpu_attention.paged_batch`` at this page size) whose q and out
    carry PAD spare rows past the batch's tokens (q zero, out a sentinel)."""
    ga.PAGE, ga.DTYPE = page, sizes["dtype"]  # paged_batch reads the module's page and q dtype
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    b = paged_batch(q_lens, seq_lens, head=sizes["head"], heads=sizes["heads"],
                    kv_heads=sizes["kv_heads"], cache_dtype=sizes["dtype"], nan_fill=True)  # fmt: skip
    b["q"] = torch.cat([b["q"], b["q"].new_zeros(PAD, *b["q"].shape[1:])])
    b["max_q"], b["max_s"] = max(max(q_lens), 2), max(seq_lens)
    return b


def call(kernel, b: dict, out: torch.Tensor, **kw) -> torch.Tensor:
    """``kernel`` (``unified_attention``'s arguments) on batch ``b`` into ``out``."""
    return kernel(b["q"], b["key_cache"], b["value_cache"], out, b["block_table"],
                  b["query_start_loc"], b["seq_lens"], scale=b["q"].shape[-1] ** -0.5,
                  max_query_len=b["max_q"], max_seq_len=b["max_s"], **kw)  # fmt: skip


def judge(out: torch.Tensor, ref: torch.Tensor, live: int) -> tuple[float, str]:
    """(rel error of the live rows, '' or what went wrong)."""
    if not (out[live:] == 7.0).all():
        return float("inf"), "a row past the batch's tokens was written"
    if out[:live].isnan().any():
        return float("nan"), "NaN in the output"
    return rel_err(out[:live], ref), ""


def check_case(q_lens, ctx_lens, page: int, sizes: dict, names, gluon: bool) -> list[dict]:
    """Every variant and unified_attention against the twin on one batch."""
    b = batch(q_lens, ctx_lens, sizes, page)
    live = sum(q_lens)
    ref = paged_attention(b["q"][:live], b["key_cache"], b["value_cache"], b["block_table"],
                          b["query_start_loc"], b["seq_lens"], scale=b["q"].shape[-1] ** -0.5)  # fmt: skip
    case = (f"p{page}_q{'+'.join(map(str, q_lens))}_ctx{'+'.join(map(str, ctx_lens))}"
            f"_h{sizes['heads']}/{sizes['kv_heads']}_{str(sizes['dtype'])[6:]}")  # fmt: skip
    rows = []
    for name in ("triton", *names):
        out = torch.full_like(b["q"], 7.0)
        row = {"case": case, "kernel": name}
        try:
            if name == "triton":
                call(unified_attention, b, out)
            else:
                call(prefill_attention_gluon, b, out, config=CONFIGS[name])
        except ValueError as exc:
            if not gluon:  # CPU tensors: the input checks must refuse them
                rows.append({**row, "rel_err": None, "ok": True, "note": f"skipped: {exc}"})
                continue
            rows.append({**row, "rel_err": None, "ok": False, "note": f"refused: {exc}"[:300]})
            continue
        except Exception as exc:  # a compile or launch error: report it and go on
            rows.append({**row, "rel_err": None, "ok": False, "note": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        err, note = judge(out, ref, live)
        if not gluon and name != "triton":
            note = "CPU not refused"
        rows.append({**row, "rel_err": err, "ok": err <= REL_TOL and not note, "note": note})
    return rows


def parse_shape(text: str) -> tuple[list[int], list[int]]:
    """"N" (one request of N new tokens) or "RxQ@C" (R requests of Q new tokens after C cached
    ones): (q_lens, context lens)."""
    reqs, _, rest = text.rpartition("x")
    q, _, ctx = rest.partition("@")
    try:
        r, q_len, c = int(reqs or 1), int(q), int(ctx or 0)
    except ValueError:
        raise ValueError(f"bad shape {text!r}: want N or RxQ@C, e.g. 4096 or 8x512@1024") from None
    if r < 1 or q_len < 1 or c < 0:
        raise ValueError(f"bad shape {text!r}: requests and new tokens >= 1, context >= 0")
    return [q_len] * r, [c] * r


def shape_name(q_lens, ctx_lens) -> str:
    if len(q_lens) == 1 and ctx_lens[0] == 0:
        return str(q_lens[0])
    return f"{len(q_lens)}x{q_lens[0]}@{ctx_lens[0]}"


def time_tokens(shape, sizes: dict, names, gluon: bool, peers, mm_flops: float) -> dict:
    """Every kernel on one batch (``parse_shape``; page 16): TFLOP/s and % of mm. The SDPA peers
    run only for one request with no context (their inputs are one contiguous sequence)."""
    q_lens, ctx_lens = shape
    n = sum(q_lens)
    pairs = sum(q * c + q * (q + 1) / 2 for q, c in zip(q_lens, ctx_lens))  # causal (q, k) pairs
    flops = 4 * pairs * sizes["head"] * sizes["heads"]
    row = {"tokens": shape_name(q_lens, ctx_lens), "flops": flops}
    keys = sum(q + c for q, c in zip(q_lens, ctx_lens))
    set_bytes = (2 * n * sizes["heads"] + 2 * keys * sizes["kv_heads"]) * sizes["head"] * 2
    sets = num_sets(set_bytes, cap=2)
    if sets == 0:
        return {**row, "skipped": "does not fit in memory"}
    ga.PAGE = 16
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    data = [paged_batch(q_lens, seq_lens, head=sizes["head"], heads=sizes["heads"],
                        kv_heads=sizes["kv_heads"], cache_dtype=sizes["dtype"]) for _ in range(sets)]  # fmt: skip
    for b in data:
        b["max_q"], b["max_s"] = max(max(q_lens), 2), max(seq_lens)
    if len(q_lens) > 1 or ctx_lens[0]:
        peers = None
    outs = [torch.empty_like(b["q"]) for b in data]
    base = call(unified_attention, data[0], torch.empty_like(data[0]["q"]))
    kernels = [("triton", unified_attention, {})]
    if gluon:
        kernels += [(name, prefill_attention_gluon, {"config": CONFIGS[name]}) for name in names]
    for name, kernel, kw in kernels:
        try:
            if name != "triton":
                row[f"{name}_rel_vs_triton"] = rel_err(call(kernel, data[0], outs[0], **kw), base)
            calls = [lambda b=b, o=o, k=kernel, kw=kw: call(k, b, o, **kw) for b, o in zip(data, outs)]
            t, _ = ga.time_per_call(calls, rep_ms=200)
        except Exception as exc:  # report it and go on
            row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        row[name] = {"us": t * 1e6, "tflops": flops / t / 1e12, "pct_mm": 100 * flops / t / mm_flops}
    del data, outs
    if peers:
        fns, _ = peers
        h, kvh, d, dt = sizes["heads"], sizes["kv_heads"], sizes["head"], sizes["dtype"]

        def make():
            q = torch.randn(1, h, n, d, device=ga.DEV, dtype=dt)
            kv = torch.randn(2, 1, kvh, n, d, device=ga.DEV, dtype=dt)
            return q, kv[0], kv[1]

        res = bench_peers(make, sets, True, (fns, lambda _n: None), 200)
        for name in PEERS:
            if res.get(name):
                row[name] = {"us": res[name] * 1e6, "tflops": flops / res[name] / 1e12,
                             "pct_mm": 100 * flops / res[name] / mm_flops}  # fmt: skip
            elif f"{name}_error" in res:
                row[f"{name}_error"] = res[f"{name}_error"]
    return row


def fmt(err) -> str:
    return "skipped" if err is None else f"{err:.1e}"


def print_table(checks: list[dict], rows: list[dict], names, mm_flops: float) -> None:
    bad = [c for c in checks if not c["ok"]]
    worst = max((c["rel_err"] for c in checks if c["rel_err"] is not None), default=None)
    print(f"\nchecks: {len(checks) - len(bad)}/{len(checks)} ok (bound {REL_TOL:.0e}), worst "
          f"rel err {fmt(worst)}")  # fmt: skip
    for c in bad:
        print(f"  FAIL {c['kernel']} {c['case']}: {fmt(c['rel_err'])} {c.get('note', '')[:200]}")
    cols = ["triton", *names, *PEERS]
    print(f"\ncausal prefill TFLOP/s (% of torch.mm {mm_flops / 1e12:.0f} TFLOP/s), one request")
    print(f"{'tokens':>12} " + " ".join(f"{c[:16]:>16}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(f"{v['tflops']:>7.1f} ({v['pct_mm']:>4.1f}%)" if v else f"{'-':>16}")
        print(f"{r['tokens']:>12} " + " ".join(f"{x:>16}" for x in cells))
    errs = [f"{k}: {v}" for r in rows for k, v in r.items() if k.endswith("_error")]
    for e in errs:
        print(f"  {e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, toy sizes, Gluon calls skipped")
    ap.add_argument("--variants", default=",".join(CONFIGS), help="comma list of CONFIGS names")
    ap.add_argument("--budget-s", type=float, default=175.0, help="watchdog: end a hung run")
    ap.add_argument("--shapes", default="", help="comma list of N or RxQ@C (default 4K,16K,32K)")
    ap.add_argument("--no-checks", action="store_true", help="timing only")
    args = ap.parse_args()
    try:
        shapes = [parse_shape(x) for x in args.shapes.split(",") if x]
    except ValueError as exc:
        ap.error(str(exc))
    names = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in names if v not in CONFIGS]:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(CONFIGS)}")
    if args.smoke:
        ga.DEV, ga.DTYPE, sizes = "cpu", torch.float32, SMOKE
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke)")
        return 2
    else:
        sizes = FULL
    faulthandler.dump_traceback_later(args.budget_s, exit=True)
    gluon = ga.DEV == "cuda"
    start = time.perf_counter()
    torch.manual_seed(0)
    checks = []
    cases = [(page, q, c, sizes, names) for page in sizes["pages"] for q, c in sizes["checks"]]
    # other head groups and dtypes on the last case, for the first variant and the first split
    # one only (each is a compile of each variant: seconds)
    few = list(dict.fromkeys([names[0], *[n for n in names if CONFIGS[n].split][:1]]))
    for heads, kv_heads, dtype in sizes["groups"]:
        other = dict(sizes, heads=heads, kv_heads=kv_heads, dtype=dtype)
        cases.append((sizes["pages"][0], *sizes["checks"][-1], other, few))
    for page, q_lens, ctx_lens, shape, which in [] if args.no_checks else cases:
        rows = check_case(q_lens, ctx_lens, page, shape, which, gluon)
        checks += rows
        cells = [f"{c['kernel']} {fmt(c['rel_err'])}{'' if c['ok'] else ' FAIL'}" for c in rows]
        print(f"{rows[0]['case']}: " + ", ".join(cells), flush=True)
    ga.DTYPE = sizes["dtype"]
    ceilings = measure_ceilings(ga.DEV)
    ga.PREFILL_PEERS, peers = PEERS, peer_fns()  # bench_peers times the module's peer list
    rows = []
    for shape in shapes or [([n], [0]) for n in sizes["tokens"]]:
        rows.append(time_tokens(shape, sizes, names, gluon, peers, ceilings["matmul_flops"]))
        r = rows[-1]
        n = r["tokens"]
        cells = [f"{k} {v['tflops']:.0f}" for k, v in r.items() if isinstance(v, dict)]
        print(f"{n} tokens TFLOP/s: " + ", ".join(cells), flush=True)
        for name in names:  # the output against unified_attention's is a check too
            err = rows[-1].get(f"{name}_rel_vs_triton")
            if err is not None:
                checks.append({"case": f"vs_triton_{n}", "kernel": name, "rel_err": err,
                               "ok": err <= REL_TOL, "note": ""})  # fmt: skip
    faulthandler.cancel_dump_traceback_later()
    print_table(checks, rows, names, ceilings["matmul_flops"])
    device = torch.cuda.get_device_name() if gluon else "cpu (smoke)"
    result = dict(device=device, torch=torch.__version__, configs={n: str(CONFIGS[n]) for n in names},
                  ceilings=ceilings, checks=checks, rows=rows, wall_s=time.perf_counter() - start)  # fmt: skip
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        path = os.path.join(os.environ["OUT"], "gpu_prefill_gluon.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    print(f"wall {result['wall_s']:.1f} s")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
