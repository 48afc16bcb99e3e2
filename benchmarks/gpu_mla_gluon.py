"""H200 check and timing of the Gluon MLA decode kernel (``ops/mla/decode_gluon``) against the Triton one.

1. Checks, 128 heads, page 64, caches NaN-filled before the live rows are written (a read of an
   unused slot or of a row past a sequence shows as NaN): ``mla_decode_gluon`` against the
   float32 twin (``reference_mla.sparse_mla_attention`` with every position) over lengths
   (0, 1, 63, 64, 65, 1000, 4097), splits 1 / 4 / default; bound ``max|out - ref| / max|ref|
   <= 2e-2``, and the empty request's row must be exactly 0.
2. Timing, 128 heads, page 64, bf16: (batch, context) = (64, 8K), (8, 32K), (32, 64K), (1, 16K),
   ``mla_decode_gluon`` against ``mla_decode`` with ``MLAConfig(64, 64, 8, 2)`` (the
   current default), both with their default splits; ``--heads 16`` (or 32: the Gluon kernel
   pads its rows to 64) at (1, 64K), (8, 64K), (32, 64K), (128, 16K), (128, 64K) against
   ``mla_decode``'s default for those heads, with % of the copy bandwidth, by ``gpu_mla.timer`` (one CUDA graph over
   rotated input sets that overflow L2, ``do_bench`` median): us, TFLOP/s (2 B H S 1088), and
   the rel errors of the Gluon output against the Triton one (all rows) and of both against
   the twin (row 0).

``--smoke`` runs on CPU at toy sizes to show the script imports and runs: Gluon has no
interpreter, so the Gluon kernel is skipped (its input checks still run); the twin and the
Triton kernel (Triton's interpreter) do run. One command, under 2 minutes on the H200:

    python benchmarks/gpu_mla_gluon.py [--heads 128,16] [--grid] [--no-checks] [--smoke]

``--grid`` times gpu_mla.py's dense grid (batch 1, 8, 32, 128 x context 4K, 16K, 64K) instead.

Writes ``$OUT/gpu_mla_gluon.json`` when ``OUT`` is set; exits 1 when a check fails.
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

from attnserve.attention.reference_mla import sparse_mla_attention  # noqa: E402
from attnserve.ops.mla.decode_gluon import mla_decode_gluon  # noqa: E402
from attnserve.ops.mla.decode_triton import mla_decode  # noqa: E402
from attnserve.ops.mla.latent import MLAConfig  # noqa: E402

REL_TOL = 2e-2
TRITON = MLAConfig(64, 64, 8, 2)
FULL = dict(heads=128, check_lens=(0, 1, 63, 64, 65, 1000, 4097), check_splits=(1, 4, None),
            shapes=((64, 8192), (8, 32768), (32, 65536), (1, 16384)))  # fmt: skip
# fewer than 64 heads (DeepSeek-V2-Lite, V3 over 8 GPUs): the kernel pads its rows to 64; the
# Triton kernel it is timed against is mla_decode's default for those heads (what TRITON_MLA runs)
FEW = dict(FULL, shapes=((1, 65536), (8, 65536), (32, 65536), (128, 16384), (128, 65536)))
# --grid: gpu_mla.py's dense decode grid (batches x contexts), for "no slower at any shape"
GRID = tuple((b, c) for b in (1, 8, 32, 128) for c in (4096, 16384, 65536))
COPY_BW = 4.25e12  # bytes/s, the H200's measured copy ceiling (% of BW in the few-heads table)
SMOKE = dict(heads=64, check_lens=(0, 1, 65), check_splits=(1,), shapes=((1, 128),))
SKIP_GLUON = "smoke: Gluon has no interpreter, mla_decode_gluon is skipped (run on a Hopper GPU)"


def positions(lens, device) -> torch.Tensor:
    """[B, max len] every position of each request, -1 past its length (the twin's top-k)."""
    pos = torch.full((len(lens), max(max(lens), 1)), -1, dtype=torch.int32, device=device)
    for i, n in enumerate(lens):
        pos[i, :n] = torch.arange(n, dtype=torch.int32, device=device)
    return pos


def gluon_enabled(dev: str) -> bool:
    return dev == "cuda"


def check_gluon(heads: int, lens, splits, dev: str) -> dict:
    """One check case: the Gluon output against the twin (NaN-filled cache)."""
    name = f"h{heads}_split{splits if splits else 'default'}"
    cache, table = filled_cache(lens, "latent")
    q = torch.randn(len(lens), heads, 576, device=dev).to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
    ref = sparse_mla_attention(q.float(), cache, table, positions(lens, dev), kv_lora_rank=512,
                               scale=SCALE)  # fmt: skip
    args = (q, cache, table, lens_t)
    kw = dict(kv_lora_rank=512, scale=SCALE, max_seq_len=max(lens), num_splits=splits)
    if not gluon_enabled(dev):
        try:  # the input checks still run: CPU tensors are refused with a ValueError
            mla_decode_gluon(*args, **kw)
            return {"case": name, "rel_err": float("inf"), "ok": False, "note": "CPU not refused"}
        except ValueError as exc:
            note = f"skipped; CPU refused: {exc}"
            return {"case": name, "rel_err": None, "ok": True, "note": note}
    out = torch.full((len(lens), heads, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    mla_decode_gluon(*args, out=out, **kw)
    empty = [i for i, n in enumerate(lens) if n == 0]
    zero_ok = all(bool((out[i] == 0).all()) for i in empty)
    live = [i for i, n in enumerate(lens) if n > 0]
    err = rel_err(out[live], ref[live])
    return {"case": name, "rel_err": err, "ok": zero_ok and err <= REL_TOL,
            "note": "" if zero_ok else "empty request not 0"}  # fmt: skip


def time_shape(batch: int, ctx: int, heads: int, dev: str) -> dict:
    """Triton TMA kernel and Gluon kernel at one (batch, context), same inputs."""
    row = {"batch": batch, "ctx": ctx, "heads": heads}
    sets = sets_for(batch * ctx * 1152)
    sets = min(sets, fits(batch * ctx)) if sets else 0
    if sets == 0:
        return {**row, "skipped": "does not fit in memory"}
    data = [dense_inputs(batch, heads, ctx, False) for _ in range(sets)]
    kw = dict(kv_lora_rank=512, scale=SCALE, max_seq_len=ctx)

    config = TRITON if heads >= 64 else None

    def triton_call(d):
        return mla_decode(d["q"], d["cache"], d["table"], d["lens"], config=config, **kw)

    def gluon_call(d):
        return mla_decode_gluon(d["q"], d["cache"], d["table"], d["lens"], **kw)

    flops = mla_flops(batch, heads, ctx)
    row["bytes"] = batch * ctx * 1152 + batch * heads * (576 + 512) * 2
    t, graph = timer([lambda d=d: triton_call(d) for d in data])
    row.update(triton_us=t * 1e6, triton_tflops=flops / t / 1e12, graph=graph)
    d = data[0]
    ref_tri = triton_call(d)
    twin = sparse_mla_attention(d["q"][:1].float(), d["cache"], d["table"][:1],
                                positions([ctx], dev), kv_lora_rank=512, scale=SCALE)  # fmt: skip
    row["triton_rel_vs_twin"] = rel_err(ref_tri[:1], twin)
    if not gluon_enabled(dev):
        row["gluon"] = SKIP_GLUON
        return row
    out = gluon_call(d)
    row.update(rel_vs_triton=rel_err(out, ref_tri), rel_vs_twin=rel_err(out[:1], twin))
    t, _ = timer([lambda d=d: gluon_call(d) for d in data])
    row.update(gluon_us=t * 1e6, gluon_tflops=flops / t / 1e12,
               speedup=row["triton_us"] / (t * 1e6))  # fmt: skip
    del data
    if dev == "cuda":
        torch.cuda.empty_cache()
    return row


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def bw_cell(r: dict) -> str:
    """% of the copy bandwidth, Triton -> Gluon (memory-bound shapes: few heads)."""
    pct = [100 * r["bytes"] / (r[k] * 1e-6) / COPY_BW for k in ("triton_us", "gluon_us") if k in r]
    return " -> ".join(f"{p:.1f}%" for p in pct)


def print_table(checks: list[dict], rows: list[dict]) -> None:
    print(f"\nchecks against the float32 twin (max|out-ref|/max|ref|, bound {REL_TOL:.0e}):")
    for c in checks:
        print(f"  {c['case']:>20}: {fmt(c['rel_err'], '.2e')} {'ok' if c['ok'] else 'FAIL'} "
              f"{c.get('note', '')}")  # fmt: skip
    for heads in sorted({r["heads"] for r in rows}, reverse=True):
        few = heads < 64
        print_timing([r for r in rows if r["heads"] == heads],
                     f"dense MLA decode, {heads} heads, page 64, bf16; Triton "
                     f"{'mla_decode default' if few else TRITON}",
                     ("% of BW (4.25 TB/s)", bw_cell))  # fmt: skip


def print_timing(rows: list[dict], title: str, extra: tuple | None = None) -> None:
    """The timing table, one line a (batch, context); ``extra``: (header, fn(row) -> str) of a
    last column."""
    head, cell = extra or ("", lambda r: "")
    print(f"\n{title}")
    print(f"{'B':>4} {'ctx':>6} {'triton us':>10} {'TFLOP/s':>8} {'gluon us':>10} {'TFLOP/s':>8} "
          f"{'speedup':>7} {'rel/tri':>8} {'rel/twin':>8} {'tri/twin':>8} {head}".rstrip())  # fmt: skip
    for r in rows:
        if "skipped" in r:
            print(f"{r['batch']:>4} {r['ctx']:>6}  skipped: {r['skipped']}")
            continue
        print(f"{r['batch']:>4} {r['ctx']:>6} {fmt(r['triton_us']):>10} "
              f"{fmt(r['triton_tflops']):>8} {fmt(r.get('gluon_us')):>10} "
              f"{fmt(r.get('gluon_tflops')):>8} {fmt(r.get('speedup'), '.2f'):>7} "
              f"{fmt(r.get('rel_vs_triton'), '.1e'):>8} {fmt(r.get('rel_vs_twin'), '.1e'):>8} "
              f"{fmt(r.get('triton_rel_vs_twin'), '.1e'):>8} {cell(r)}".rstrip())  # fmt: skip
    if rows and "gluon" in rows[0]:
        print(f"  ({rows[0]['gluon']})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, toy sizes, Gluon kernel skipped")
    ap.add_argument("--heads", default="128", help="comma list: 128 (and 64+), 16 or 32 (padded)")
    ap.add_argument("--grid", action="store_true", help="time gpu_mla.py's dense grid instead")
    ap.add_argument("--no-checks", action="store_true", help="timing only")
    args = ap.parse_args()
    heads_list = [int(h) for h in args.heads.split(",")]
    if args.smoke:
        gpu_mla.DEV, sizes = "cpu", SMOKE
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke)")
        return 2
    else:
        sizes = FULL
    dev = gpu_mla.DEV
    start = time.perf_counter()
    torch.manual_seed(0)
    if args.smoke:
        heads_list = [sizes["heads"]]
    checks, rows = [], []
    for heads in [] if args.no_checks else heads_list:
        checks += [check_gluon(heads, sizes["check_lens"], sp, dev)
                   for sp in sizes["check_splits"]]  # fmt: skip
    for c in checks:
        print(json.dumps(c), flush=True)
    for heads in heads_list:
        shapes = FEW["shapes"] if heads < 64 and not args.smoke else sizes["shapes"]
        if args.grid and not args.smoke:
            shapes = GRID
        for batch, ctx in shapes:
            rows.append(time_shape(batch, ctx, heads, dev))
            print(json.dumps(rows[-1]), flush=True)
    print_table(checks, rows)
    device = torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke)"
    result = dict(device=device, torch=torch.__version__, triton_config=str(TRITON),
                  checks=checks, rows=rows, wall_s=time.perf_counter() - start)  # fmt: skip
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "gpu_mla_gluon.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    print(f"wall {result['wall_s']:.1f} s")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
