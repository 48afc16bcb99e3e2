"""H200 check and timing of the Gluon indexer decode kernel (``ops/indexer/logits_gluon``) against
Triton's streaming one.

1. Checks, fp8 keys, 64 heads x 128, page 64, the cache filled with 0xFF bytes (e4m3 NaN) before
   the live rows are written (a read of an unused row or of a key past a length shows as NaN):
   ``indexer_logits_gluon`` and Triton's streaming kernel (``indexer_logits`` with its pinned
   config) against the float32 twin (``twin_logits``: the dequantised keys of
   ``reference_mla.gather_indexer_keys``) over requests of lengths 0, 1, 63, 64, 65, 700, 4097,
   3000 and 8191 (one of them with no token this step, one token before its request's last
   key), width past every length (a CUDA graph's ``max_model_len``): with ``fill_hidden`` the
   whole width, without it up to each row's last visible page; -inf exactly where the twin's
   is, bound ``max|out - ref| / max|ref| <= 2e-2`` per row. Also at ``waves`` 1 (long chunks:
   many trips round the stage ring), with 7 stages and with 2 (``CHECKS``). Every case runs each
   ``variant`` of the Gluon kernel (the default "tile", "regs", "regs_inorder"): the variants
   against the twin (same bound) and against the default (``VARIANT_TOL``; bit-equal noted).
2. Timing, batch 1, 8, 32 x context 8K, 32K, 64K, 128K, random e4m3 keys, every key visible,
   ``fill_hidden`` off (as ``lightning_indexer_topk`` decodes): both kernels by
   ``gpu_mla.timer`` (one CUDA graph over rotated input sets that overflow L2, ``do_bench``
   median): us, the share of the device copy bandwidth measured in this run (``ceilings.py``;
   bytes = keys read + logits written, B S (132 + 4)), the speed-up and the rel error of the
   Gluon logits against the Triton ones; then each other variant of the Gluon kernel (us, %
   copy: the A/B against the default).

``--smoke`` runs on CPU at toy sizes: Gluon has no interpreter, so the Gluon kernel is skipped
(its input checks still run and must refuse CPU tensors); the twin and the Triton kernel
(Triton's interpreter) do run, and the checks then hold Triton to the bound. One command, about
a minute on the H200:

    python benchmarks/gpu_indexer_gluon.py [--smoke]

Prints a short table last; writes ``$OUT/gpu_indexer_gluon.json`` when ``OUT`` is set; exits 1
when a check fails.
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
from ceilings import describe, measure_ceilings  # noqa: E402
from gpu_mla import filled_cache, indexer_inputs, indexer_query, sets_for, timer  # noqa: E402
from gpu_mla_gluon import fmt, gluon_enabled  # noqa: E402

from attnserve.attention.reference_mla import gather_indexer_keys  # noqa: E402
from attnserve.ops.indexer.logits_gluon import VARIANTS, indexer_logits_gluon  # noqa: E402
from attnserve.ops.indexer.logits_triton import indexer_logits, pick_indexer_config  # noqa: E402

REL_TOL = 2e-2
VARIANT_TOL = 1e-2  # the variants against the default (another K order in the wgmma)
PAGE, ROW_BYTES = 64, 132
# checks: request lengths, the request with no token, (request, position) of one token before
# its last key; timing: (batch, context)
FULL = dict(lens=(0, 1, 63, 64, 65, 700, 4097, 3000, 8191), idle=2, early=(6, 1999), extra=200,
            shapes=[(b, c) for b in (1, 8, 32) for c in (8192, 32768, 65536, 131072)])  # fmt: skip
SMOKE = dict(lens=(0, 1, 63, 65, 130, 200), idle=2, early=(5, 150), extra=70,
             shapes=[(1, 256), (2, 192)])  # fmt: skip
# (fill_hidden, waves, stages) of the checks: waves 1 makes long chunks (many trips round the ring)
CHECKS = ((True, 4, 3), (False, 4, 3), (False, 1, 3), (False, 1, 7), (False, 4, 2))
SKIP_GLUON = "smoke: Gluon has no interpreter, indexer_logits_gluon is skipped (run on Hopper)"


def twin_logits(q8, hw, cache, table, lens, qsl, positions, width) -> torch.Tensor:
    """Float32 [T, width]: ``sum_h hw * relu(q8 . k)`` over the dequantised keys of each token's
    request (the key's scale is a positive power of two, so relu(s x) = s relu(x): the same
    value as scaling after the sum), -inf past ``min(position + 1, length)``."""
    out = torch.full((q8.shape[0], width), float("-inf"), device=q8.device)
    for r, n in enumerate(lens):
        for t in range(int(qsl[r]), int(qsl[r + 1])):
            limit = min(int(positions[t]) + 1, n)
            if limit > 0:
                keys = gather_indexer_keys(cache, table[r], limit)  # [limit, 128] float32
                scores = torch.relu(q8[t].float() @ keys.T)  # [64, limit]
                out[t, :limit] = (hw[t].float()[:, None] * scores).sum(0)
    return out


def check_inputs(lens, idle: int, early: tuple, dev: str) -> dict:
    """A decode batch over a NaN-filled fp8 cache: one token a request but request ``idle``,
    each at its request's last key but request ``early[0]``'s (at ``early[1]``)."""
    cache, table = filled_cache(lens, "indexer_fp8")
    has = [int(i != idle) for i in range(len(lens))]
    qsl = torch.tensor([0, *torch.tensor(has).cumsum(0).tolist()], dtype=torch.int32)
    pos = [early[1] if r == early[0] else max(n - 1, 0) for r, n in enumerate(lens) if has[r]]
    heads, dim = gpu_mla.S.idx_heads, gpu_mla.S.idx_dim
    d = indexer_query(torch.randn(len(pos), heads, dim, device=dev),
                      torch.randn(len(pos), heads, device=dev), True)  # fmt: skip
    args = (cache, table, qsl.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev),
            torch.tensor(pos, device=dev))  # fmt: skip
    return dict(q=d["q"], w=d["w"], args=args)


def compare(got: torch.Tensor, want: torch.Tensor, ends) -> float:
    """Worst per-row ``max|got - want| / max|want|`` over the visible keys; inf when the -inf
    pattern differs up to a row's end (the columns the kernel must write) or a NaN shows."""
    worst = 0.0
    for t, end in enumerate(ends):
        g, w = got[t, :end], want[t, :end]
        if not torch.equal(torch.isneginf(g), torch.isneginf(w)) or g.isnan().any():
            return float("inf")
        seen = ~torch.isneginf(w)
        if seen.any():
            err = (g[seen] - w[seen]).abs().max() / w[seen].abs().max()
            worst = max(worst, err.item())
    return worst


def check_case(sizes: dict, fill_hidden: bool, waves: int, dev: str, stages: int = 3) -> dict:
    name = f"{'fill' if fill_hidden else 'nofill'}_waves{waves}_stages{stages}"
    lens = sizes["lens"]
    d = check_inputs(lens, sizes["idle"], sizes["early"], dev)
    cache, table, qsl, lens_t, pos = d["args"]
    width = max(lens) + sizes["extra"]
    want = twin_logits(d["q"], d["w"], cache, table, lens, qsl.tolist(), pos, width)
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.diff(qsl.cpu()).long())
    limits = torch.minimum(pos.cpu() + 1, lens_t.cpu()[req]).clamp(min=0)
    ends = [width if fill_hidden else min(width, -(-int(n) // PAGE) * PAGE) for n in limits]
    cfg = pick_indexer_config(64, 1, torch.bfloat16, fp8=True, num_seqs=len(lens))
    tri = indexer_logits(d["q"], d["w"], *d["args"], width=width, max_query_len=1, dot_scale=1.0,
                         config=cfg, fill_hidden=fill_hidden)  # fmt: skip
    row = {"case": name, "triton_rel_err": compare(tri, want, ends)}
    if not gluon_enabled(dev):
        try:  # the input checks still run: CPU tensors are refused with a ValueError
            indexer_logits_gluon(d["q"], d["w"], *d["args"], width=width)
            return {**row, "rel_err": float("inf"), "ok": False, "note": "CPU not refused"}
        except ValueError as exc:
            ok = row["triton_rel_err"] <= REL_TOL
            return {**row, "rel_err": None, "ok": ok, "note": f"skipped; CPU refused: {exc}"}
    outs = {v: indexer_logits_gluon(d["q"], d["w"], *d["args"], width=width, waves=waves,
                                    fill_hidden=fill_hidden, stages=stages, variant=v)
            for v in VARIANTS}  # fmt: skip
    row["rel_err"] = compare(outs["tile"], want, ends)
    ok = row["rel_err"] <= REL_TOL
    for v in VARIANTS[1:]:
        row[f"{v}_rel_err"] = compare(outs[v], want, ends)
        row[f"{v}_vs_tile"] = compare(outs[v], outs["tile"], ends)
        row[f"{v}_equal"] = all(torch.equal(outs[v][t, :e], outs["tile"][t, :e])
                                for t, e in enumerate(ends))  # fmt: skip
        ok = ok and row[f"{v}_rel_err"] <= REL_TOL and row[f"{v}_vs_tile"] <= VARIANT_TOL
    return {**row, "ok": ok}


def time_shape(batch: int, ctx: int, copy_bw: float, dev: str) -> dict:
    """Triton's streaming kernel and the Gluon one at one (batch, context), same inputs."""
    moved = batch * ctx * (ROW_BYTES + 4)  # keys read, logits written
    row = {"batch": batch, "ctx": ctx, "bytes": moved}
    sets = sets_for(moved)
    if sets == 0:
        return {**row, "skipped": "does not fit in memory"}
    data = [indexer_inputs(batch, ctx, True) for _ in range(sets)]
    cfg = pick_indexer_config(64, 1, torch.bfloat16, fp8=True, num_seqs=batch)

    def triton_call(d):
        return indexer_logits(d["q"], d["w"], *d["args"], width=ctx, max_query_len=1,
                              dot_scale=d["dot_scale"], config=cfg, fill_hidden=False)  # fmt: skip

    def gluon_call(d, variant="tile"):
        return indexer_logits_gluon(d["q"], d["w"], *d["args"], width=ctx, variant=variant,
                                    dot_scale=d["dot_scale"], fill_hidden=False)  # fmt: skip

    t, graph = timer([lambda d=d: triton_call(d) for d in data])
    row.update(sets=sets, graph=graph, triton_us=t * 1e6, triton_pct=100 * moved / t / copy_bw)
    if not gluon_enabled(dev):
        return {**row, "gluon": SKIP_GLUON}
    tri, out = triton_call(data[0]), gluon_call(data[0])
    row["rel_vs_triton"] = compare(out, tri, [ctx] * batch)
    t, _ = timer([lambda d=d: gluon_call(d) for d in data])
    row.update(gluon_us=t * 1e6, gluon_pct=100 * moved / t / copy_bw,
               speedup=row["triton_us"] / (t * 1e6))  # fmt: skip
    for v in VARIANTS[1:]:
        row[f"{v}_vs_tile"] = compare(gluon_call(data[0], v), out, [ctx] * batch)
        t, _ = timer([lambda d=d, v=v: gluon_call(d, v) for d in data])
        row.update({f"{v}_us": t * 1e6, f"{v}_pct": 100 * moved / t / copy_bw})
    del data
    if dev == "cuda":
        torch.cuda.empty_cache()
    return row


def print_table(checks: list[dict], rows: list[dict], ceilings: dict) -> None:
    print(
        f"\nchecks against the float32 twin (worst row max|out-ref|/max|ref|, bound {REL_TOL};"
        f" the variants against the default: 'vs tile', bound {VARIANT_TOL}, '=': bit-equal):"
    )
    heads = "".join(f" {v:>12} {'vs tile':>8} {'=':>1}" for v in VARIANTS[1:])
    print(f"  {'case':>21} {'gluon':>9} {'triton':>9}{heads}")
    for c in checks:
        errs = f"{fmt(c['rel_err'], '.2e'):>9} {fmt(c['triton_rel_err'], '.2e'):>9}"
        for v in VARIANTS[1:]:
            same = {True: "y", False: "n"}.get(c.get(f"{v}_equal"), "-")
            errs += (f" {fmt(c.get(f'{v}_rel_err'), '.2e'):>12}"
                     f" {fmt(c.get(f'{v}_vs_tile'), '.1e'):>8} {same:>1}")  # fmt: skip
        print(f"  {c['case']:>21} {errs} {'ok' if c['ok'] else 'FAIL'} {c.get('note', '')}")
    print(f"\nfp8 indexer decode logits, 64 heads x 128, page 64; {describe(ceilings)}")
    print("% copy: (keys read + logits written) / time / measured copy bandwidth")
    print("gluon: the default (keys through the swizzled tile); regs: keys as the wgmma's register"
          " A, K permuted; regs_inorder: the same in K order")  # fmt: skip
    heads = "".join(f" {v + ' us':>15} {'% copy':>7}" for v in VARIANTS[1:])
    print(f"{'B':>4} {'ctx':>7} {'triton us':>10} {'% copy':>7} {'gluon us':>9} {'% copy':>7} "
          f"{'speedup':>7} {'rel/tri':>8}{heads}")  # fmt: skip
    for r in rows:
        if "skipped" in r:
            print(f"{r['batch']:>4} {r['ctx']:>7}  skipped: {r['skipped']}")
            continue
        cols = "".join(f" {fmt(r.get(f'{v}_us')):>15} {fmt(r.get(f'{v}_pct')):>7}"
                       for v in VARIANTS[1:])  # fmt: skip
        print(f"{r['batch']:>4} {r['ctx']:>7} {fmt(r['triton_us']):>10} "
              f"{fmt(r['triton_pct']):>7} {fmt(r.get('gluon_us')):>9} "
              f"{fmt(r.get('gluon_pct')):>7} {fmt(r.get('speedup'), '.2f'):>7} "
              f"{fmt(r.get('rel_vs_triton'), '.1e'):>8}{cols}")  # fmt: skip
    if rows and "gluon" in rows[0]:
        print(f"  ({rows[0]['gluon']})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, toy sizes, Gluon kernel skipped")
    args = ap.parse_args()
    if args.smoke:
        gpu_mla.DEV, sizes = "cpu", SMOKE
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke)")
        return 2
    else:
        sizes = FULL
    gpu_mla.S = gpu_mla.FULL  # 64 indexer heads x 128, page 64
    dev = gpu_mla.DEV
    start = time.perf_counter()
    torch.manual_seed(0)
    checks = [check_case(sizes, fill, waves, dev, stages)
              for fill, waves, stages in CHECKS]  # fmt: skip
    for c in checks:
        print(json.dumps(c), flush=True)
    ceilings = measure_ceilings(dev)
    rows = []
    for batch, ctx in sizes["shapes"]:
        rows.append(time_shape(batch, ctx, ceilings["copy_bw"], dev))
        print(json.dumps(rows[-1]), flush=True)
    print_table(checks, rows, ceilings)
    device = torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke)"
    result = dict(device=device, torch=torch.__version__, ceilings=ceilings, checks=checks,
                  rows=rows, wall_s=time.perf_counter() - start)  # fmt: skip
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "gpu_indexer_gluon.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    print(f"wall {result['wall_s']:.1f} s")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
