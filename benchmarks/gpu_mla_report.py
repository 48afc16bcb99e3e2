"""The printed tables of ``gpu_mla.py``: checks, dense and sparse MLA decode, the indexer,
the prefills and the sweep's best configs, with each rate as a fraction of the ceilings
measured in the run (``ceilings.py``). Formatting only: the numbers are ``gpu_mla.py``'s rows.
"""

from __future__ import annotations

from ceilings import describe


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


# fmt: off
def print_tables(checks: list[dict], rows: list[dict], swept: list[dict], sizes, ceilings: dict,
                 rel_tol: float) -> None:
    """``sizes``: gpu_mla's ``Sizes``; ``ceilings``: ``measure_ceilings``'s dict."""
    S = sizes
    print(f"\nchecks (max|out-ref|/max|ref|; top-k: 1 - recall), bound {rel_tol:.0e}:")
    print("  " + "  ".join(f"{c['case']}={c['rel_err']:.1e}{'' if c['ok'] else ' FAIL'}" for c in checks))
    print(f"\n{describe(ceilings)}")
    print("%cp: % of the measured copy bandwidth (%BW: of the nominal); %mm: % of the measured matmul rate")
    print(f"\ndense MLA decode (bf16 latent rows, page {S.page}); peer/o = SDPA time / ours")
    print(f"{'H':>4} {'B':>4} {'ctx':>6} {'us':>9} {'GB/s':>6} {'%cp':>5} {'%BW':>5} {'TFLOP/s':>7} {'%mm':>5} "
          f"{'peer us':>9} {'peer/o':>6} kernel")
    for r in (r for r in rows if r["kind"] == "dense"):
        if "skipped" in r:
            print(f"{r['heads']:>4} {r['batch']:>4} {r['ctx']:>6}  skipped: {r['skipped']}")
            continue
        peer = r["peer_us"] / r["us"] if r.get("peer_us") else None
        print(f"{r['heads']:>4} {r['batch']:>4} {r['ctx']:>6} {r['us']:>9.1f} {r['gbps']:>6.0f} "
              f"{r['pct_bw_measured']:>5.1f} {r['pct_bw']:>5.1f} {r['tflops']:>7.1f} {r['pct_flops_measured']:>5.1f} "
              f"{fmt(r.get('peer_us')):>9} {fmt(peer, '.2f'):>6} {r.get('kernel', '-')}")
    print(f"\nsparse MLA decode (batch {S.sparse_batch}, {S.many_heads} heads, top-k {S.topk}) vs dense decode, same cache")
    print(f"{'ctx':>7} {'cache':>5} {'sparse us':>9} {'%cp':>5} {'TFLOP/s':>7} {'%mm':>5} {'dense us':>9} {'dense/sparse':>12} kernel")
    for r in (r for r in rows if r["kind"] == "sparse_decode"):
        if "skipped" in r:
            print(f"{r['ctx']:>7}  skipped: {r['skipped']}")
            continue
        gain = r["dense_us"] / r["us"] if r.get("dense_us") else None
        print(f"{r['ctx']:>7} {'fp8' if r['fp8'] else 'bf16':>5} {r['us']:>9.1f} {r['pct_bw_measured']:>5.1f} "
              f"{r['tflops']:>7.1f} {r['pct_flops_measured']:>5.1f} {fmt(r.get('dense_us')):>9} {fmt(gain, '.2f'):>12} {r.get('kernel', '-')}")
    print(f"\nlightning indexer decode ({S.idx_heads} heads x {S.idx_dim}): logits kernel, then torch.topk")
    print(f"{'B':>4} {'ctx':>7} {'keys':>5} {'logits us':>9} {'GB/s':>6} {'%cp':>5} {'%BW':>5} {'topk us':>8} "
          f"{'topk share':>10}")
    for r in (r for r in rows if r["kind"] == "indexer"):
        if "skipped" in r:
            print(f"{r['batch']:>4} {r['ctx']:>7}  skipped: {r['skipped']}")
            continue
        print(f"{r['batch']:>4} {r['ctx']:>7} {'fp8' if r['fp8'] else 'bf16':>5} {r['us']:>9.1f} {r['gbps']:>6.0f} "
              f"{r['pct_bw_measured']:>5.1f} {r['pct_bw']:>5.1f} {r['topk_us']:>8.1f} {100 * r['topk_share']:>9.0f}%")
    for r in (r for r in rows if r["kind"] in ("sparse_prefill", "indexer_prefill")):
        print(f"{r['kind']}: {r.get('rows')} rows over {r.get('ctx')} keys: {fmt(r.get('us'))} us, "
              f"{fmt(r.get('tflops'))} TFLOP/s, {fmt(r.get('pct_flops_measured'))}% of the measured matmul rate "
              f"({fmt(r.get('pct_flops'))}% of nominal); {r.get('kernel', 'triton')} kernel"
              + (f", Triton {r['triton_us']:.1f} us" if r.get("triton_us") else ""))
    for shape in dict.fromkeys(s["shape"] for s in swept):
        done = [s for s in swept if s["shape"] == shape and s.get("us")]
        if done:
            best = min(done, key=lambda s: s["us"])
            print(f"sweep {shape}: best {best['config']} {best['us']:.1f} us ({len(done)} configs ran)")
# fmt: on
