"""H200 check and timing of the Gluon sparse MLA kernels (bf16 and fp8 rows) against Triton's.

``--rows bf16,fp8`` (the default: both) picks the latent rows: bf16 (``ops/mla/sparse_gluon``)
and / or fp8 656-byte rows (``ops/mla/sparse_gluon_fp8``, ``kvcache/fp8.py``); each kind runs
the two parts below on its own caches, against Triton's ``sparse_mla`` on the same cache.

1. Checks, 128 heads, caches NaN-filled before the live rows are written (a read of an unused
   slot or of a row past a sequence shows as NaN): ``sparse_mla_gluon`` against the float32
   twin (``reference_mla.sparse_mla_attention``) over four requests (5000, 700, 129, 3000 rows)
   and six query rows (one decode row each, two more rows of the last request): row 0 all -1,
   row 1 every third slot -1, every row's picks drawn from its length + 64 (so some are past
   the sequence and must be skipped). K = 2048 with page 64 at splits 1 / 4 / default and page
   16; K = 100 (a partial second tile) with page 64 at 4 splits (two of them empty) and page 16
   unsplit. An fp8 cache is filled with 0xFF bytes (NaN values, scales and rope). Bound ``max|out - ref| / max|ref| <= 2e-2``; row 0 must be exactly 0. Triton's
   ``sparse_mla`` runs on the same inputs, for its error next to the Gluon one.
2. Timing, K = 2048 random distinct picks, 128 heads, page 64, (batch, context) = (1, 8K),
   (8, 32K), (32, 64K), (64, 8K), one decode row a request: ``sparse_mla_gluon`` against
   ``sparse_mla`` (default config), both with their default splits, by ``gpu_mla.timer`` (one
   CUDA graph over rotated input sets whose selected rows overflow L2, ``do_bench`` median):
   us, TFLOP/s (2 B H K 1088, for fp8 rows too), and the rel errors of the Gluon output against the Triton one
   (all rows) and of both against the twin (row 0). Then the Gluon kernel at 1..32 splits
   (its default is Triton's rule, one wave of programs): the best is the last column.

``--smoke`` runs on CPU at toy sizes (64 heads, short requests, K = 48 and 100): Gluon has no
interpreter, so the Gluon kernel is skipped (its input checks still run and must refuse CPU
tensors); the twin and the Triton kernel (Triton's interpreter) do run, and the checks then
hold Triton to the bound. One command, under 2 minutes on the H200:

    python benchmarks/gpu_mla_sparse_gluon.py [--smoke] [--rows bf16,fp8] [--grid] [--no-checks]

``--grid`` times gpu_mla.py's sparse rows (batch 32 x 8K, 32K, 128K) instead of the four shapes.

Writes ``$OUT/gpu_mla_sparse_gluon.json`` when ``OUT`` is set; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_mla  # noqa: E402  (puts the repository root on sys.path too)
import torch  # noqa: E402
from gpu_mla import (  # noqa: E402
    SCALE,
    dense_inputs,
    filled_cache,
    fits,
    mla_flops,
    rel_err,
    sets_for,
    timer,
)
from gpu_mla_gluon import fmt, gluon_enabled, print_timing  # noqa: E402

from attnserve.attention.reference_mla import sparse_mla_attention  # noqa: E402
from attnserve.kvcache.fp8 import mla_fp8_row_bytes  # noqa: E402
from attnserve.ops.mla.sparse_gluon import sparse_mla_gluon  # noqa: E402
from attnserve.ops.mla.sparse_gluon_fp8 import sparse_mla_gluon_fp8  # noqa: E402
from attnserve.ops.mla.sparse_triton import sparse_mla  # noqa: E402

REL_TOL = 2e-2
PAST = 64  # picks are drawn below length + PAST: some fall past the sequence
# checks: (K, page, splits); requests' lengths; query rows' requests (grouped, in order)
FULL = dict(heads=128, lens=(5000, 700, 129, 3000), reqs=(0, 1, 2, 3, 3, 3),
            cases=((2048, 64, 1), (2048, 64, 4), (2048, 64, None), (2048, 16, None),
                   (100, 64, 4), (100, 16, 1)),
            shapes=((1, 8192), (8, 32768), (32, 65536), (64, 8192)), topk=2048)  # fmt: skip
SMOKE = dict(heads=64, lens=(90, 40, 17, 120), reqs=(0, 1, 2, 3, 3, 3),
             cases=((48, 64, 1), (100, 16, 1)), shapes=((1, 256),), topk=64)  # fmt: skip
SPLITS = (1, 2, 4, 8, 16, 32)  # the Gluon kernel's split sweep at each timed shape
SKIP_GLUON = "smoke: Gluon has no interpreter, the Gluon kernel is skipped (run on a Hopper GPU)"
ROWS = ("bf16", "fp8")


def gluon_kernel(fp8: bool):
    return sparse_mla_gluon_fp8 if fp8 else sparse_mla_gluon


def row_bytes(fp8: bool) -> int:
    """Bytes of one latent row: 1152 (bf16) or 656 (fp8)."""
    return mla_fp8_row_bytes(512, 64) if fp8 else 2 * 576


def check_inputs(lens, reqs, k: int, heads: int, dev: str) -> dict:
    """Query rows, their picks (``idx``: what the kernels get; ``seen``: the same with picks past
    the request's length as -1, what the twin skips) and ``qsl`` for the twin's row owners."""
    gen = torch.Generator().manual_seed(k)
    idx = torch.full((len(reqs), k), -1, dtype=torch.int32)
    for t, r in enumerate(reqs):
        pick = torch.randperm(lens[r] + PAST, generator=gen)[:k]
        idx[t, : pick.numel()] = pick.to(torch.int32)
    idx[0] = -1
    idx[1, ::3] = -1
    owner_len = torch.tensor(lens)[torch.tensor(reqs)]
    seen = torch.where(idx < owner_len[:, None], idx, -1)
    counts = torch.bincount(torch.tensor(reqs), minlength=len(lens))
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    q = torch.randn(len(reqs), heads, 576, device=dev).to(torch.bfloat16)
    return dict(q=q, idx=idx.to(dev), seen=seen.to(dev), qsl=qsl.to(dev),
                lens=torch.tensor(lens, dtype=torch.int32, device=dev),
                req=torch.tensor(reqs, dtype=torch.int32, device=dev))  # fmt: skip


def check_case(sizes: dict, k: int, page: int, splits, dev: str, fp8: bool = False) -> dict:
    """One check case: the Gluon (and Triton) output against the twin, NaN-filled cache."""
    name = f"{'fp8_' if fp8 else ''}k{k}_page{page}_split{splits if splits else 'default'}"
    full_s = gpu_mla.S
    gpu_mla.S = dataclasses.replace(full_s, page=page)
    try:
        cache, table = filled_cache(sizes["lens"], "latent_fp8" if fp8 else "latent")
    finally:
        gpu_mla.S = full_s
    d = check_inputs(sizes["lens"], sizes["reqs"], k, sizes["heads"], dev)
    ref = sparse_mla_attention(d["q"].float(), cache, table, d["seen"], kv_lora_rank=512,
                               scale=SCALE, query_start_loc=d["qsl"])  # fmt: skip
    args = (d["q"], cache, table, d["lens"], d["idx"], d["req"])
    kw = dict(kv_lora_rank=512, scale=SCALE, num_splits=splits)
    tri = sparse_mla(*args, **kw)
    row = {"case": name, "triton_rel_err": rel_err(tri[1:], ref[1:])}
    if not gluon_enabled(dev):
        try:  # the input checks still run: CPU tensors are refused with a ValueError
            gluon_kernel(fp8)(*args, **kw)
            return {**row, "rel_err": float("inf"), "ok": False, "note": "CPU not refused"}
        except ValueError as exc:
            ok = bool((tri[0] == 0).all()) and row["triton_rel_err"] <= REL_TOL
            return {**row, "rel_err": None, "ok": ok, "note": f"skipped; CPU refused: {exc}"}
    out = torch.full_like(tri, float("nan"))
    gluon_kernel(fp8)(*args, out=out, **kw)
    zero_ok = bool((out[0] == 0).all())
    err = rel_err(out[1:], ref[1:])
    return {**row, "rel_err": err, "ok": zero_ok and err <= REL_TOL,
            "note": "" if zero_ok else "row of all -1 not 0"}  # fmt: skip


def time_shape(batch: int, ctx: int, heads: int, dev: str, fp8: bool = False) -> dict:
    """Triton and Gluon sparse decode at one (batch, context), same inputs."""
    k = gpu_mla.S.topk
    row = {"batch": batch, "ctx": ctx, "heads": heads, "topk": k, "rows": ROWS[fp8]}
    moved = batch * k * row_bytes(fp8)  # the selected rows
    sets = sets_for(moved) if sets_for(batch * ctx * row_bytes(fp8)) else 0
    sets = min(sets, fits(batch * ctx))  # (counted in bf16 rows: room to spare for fp8)
    if sets == 0:
        return {**row, "skipped": "does not fit in memory"}
    data = [dense_inputs(batch, heads, ctx, fp8, sparse=True) for _ in range(sets)]
    kw = dict(kv_lora_rank=512, scale=SCALE)

    def triton_call(d):
        return sparse_mla(d["q"], d["cache"], d["table"], d["lens"], d["idx"], d["req"], **kw)

    def gluon_call(d, splits=None):
        return gluon_kernel(fp8)(d["q"], d["cache"], d["table"], d["lens"], d["idx"], d["req"],
                                num_splits=splits, **kw)  # fmt: skip

    flops = mla_flops(batch, heads, k)
    t, graph = timer([lambda d=d: triton_call(d) for d in data])
    row.update(sets=sets, triton_us=t * 1e6, triton_tflops=flops / t / 1e12, graph=graph)
    d = data[0]
    ref_tri = triton_call(d)
    twin = sparse_mla_attention(d["q"][:1].float(), d["cache"], d["table"][:1], d["idx"][:1],
                                kv_lora_rank=512, scale=SCALE)  # fmt: skip
    row["triton_rel_vs_twin"] = rel_err(ref_tri[:1], twin)
    if not gluon_enabled(dev):
        row["gluon"] = SKIP_GLUON
        return row
    out = gluon_call(d)
    row.update(rel_vs_triton=rel_err(out, ref_tri), rel_vs_twin=rel_err(out[:1], twin))
    t, _ = timer([lambda d=d: gluon_call(d) for d in data])
    row.update(gluon_us=t * 1e6, gluon_tflops=flops / t / 1e12,
               speedup=row["triton_us"] / (t * 1e6))  # fmt: skip
    # the default splits are Triton's rule (one wave of programs); what the others would give
    swept = {}
    for sp in (sp for sp in SPLITS if sp <= k // 64):
        swept[sp] = timer([lambda d=d, sp=sp: gluon_call(d, sp) for d in data])[0] * 1e6
    row["gluon_splits_us"] = swept
    del data
    if dev == "cuda":
        torch.cuda.empty_cache()
    return row


def best_split(row: dict) -> str:
    swept = row.get("gluon_splits_us")
    if not swept:
        return "-"
    sp = min(swept, key=swept.get)
    return f"{sp}: {swept[sp]:.1f} us"


def print_table(checks: list[dict], rows: list[dict], kinds) -> None:
    print(f"\nchecks against the float32 twin (max|out-ref|/max|ref|, bound {REL_TOL:.0e}):")
    print(f"  {'case':>22} {'gluon':>9} {'triton':>9}")
    for c in checks:
        errs = f"{fmt(c['rel_err'], '.2e'):>9} {fmt(c['triton_rel_err'], '.2e'):>9}"
        print(f"  {c['case']:>22} {errs} {'ok' if c['ok'] else 'FAIL'} {c.get('note', '')}")
    for kind in kinds:
        mine = [r for r in rows if r["rows"] == kind]
        heads = mine[0]["heads"] if mine else "-"
        topk = mine[0]["topk"] if mine else "-"
        title = (f"sparse MLA decode, top-k {topk}, {heads} heads, page 64, {kind} rows; Triton "
                 f"default config")  # fmt: skip
        print_timing(mine, title, (f"{'best split':>14}", lambda r: f"{best_split(r):>14}"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, toy sizes, Gluon kernel skipped")
    ap.add_argument("--rows", default=",".join(ROWS), help="latent rows: bf16, fp8 or both")
    ap.add_argument("--grid", action="store_true",
                    help="time gpu_mla.py's sparse rows (batch 32 x 8K, 32K, 128K) instead")
    ap.add_argument("--no-checks", action="store_true", help="timing only")
    args = ap.parse_args()
    kinds = [r.strip() for r in args.rows.split(",") if r.strip()]
    if not kinds or any(r not in ROWS for r in kinds):
        ap.error(f"--rows takes a comma list of {ROWS}, got {args.rows!r}")
    if args.smoke:
        gpu_mla.DEV, sizes = "cpu", SMOKE
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke)")
        return 2
    else:
        sizes = FULL
    gpu_mla.S = dataclasses.replace(gpu_mla.FULL, topk=sizes["topk"])  # rank 512, rope 64, page 64
    dev = gpu_mla.DEV
    start = time.perf_counter()
    torch.manual_seed(0)
    checks, rows = [], []
    for kind in [] if args.no_checks else kinds:
        for k, page, splits in sizes["cases"]:
            checks.append(check_case(sizes, k, page, splits, dev, fp8=kind == "fp8"))
            print(json.dumps(checks[-1]), flush=True)
    shapes = sizes["shapes"]
    if args.grid and not args.smoke:
        shapes = ((32, 8192), (32, 32768), (32, 131072))
    for kind in kinds:
        for batch, ctx in shapes:
            rows.append(time_shape(batch, ctx, sizes["heads"], dev, fp8=kind == "fp8"))
            print(json.dumps(rows[-1]), flush=True)
    print_table(checks, rows, kinds)
    device = torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke)"
    result = dict(device=device, torch=torch.__version__, checks=checks, rows=rows,
                  wall_s=time.perf_counter() - start)  # fmt: skip
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "gpu_mla_sparse_gluon.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    print(f"wall {result['wall_s']:.1f} s")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
