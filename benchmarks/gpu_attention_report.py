"""The printed tables of ``gpu_attention.py``: the checks, then (when anything was timed) the
ceilings, the decode rows and the causal prefill rows, each part only when ``--only`` ran it.
Formatting only: the numbers are ``gpu_attention.py``'s rows.
"""

from __future__ import annotations

from ceilings import describe

LABELS = {"sdpa": "sdpa", "sdpa_cudnn_mha": "cudnn", "sdpa_flash_mha": "fa-mha", "flex": "flex"}


def ratio(row: dict, peer: str) -> str:
    return f"{row[peer] / row['ours']:.2f}" if row.get(peer) and row.get("ours") else "-"


def us(seconds: float | None) -> str:
    return f"{seconds * 1e6:.1f}" if seconds else "-"


def peer_columns(row: dict | None, names: tuple) -> str:
    """Each peer's time, then each peer's time / ours (the header when ``row`` is None)."""
    if row is None:
        return "".join(f" {LABELS[n] + ' us':>10}" for n in names) + "".join(
            f" {LABELS[n] + '/o':>8}" for n in names
        )
    return "".join(f" {us(row.get(n)):>10}" for n in names) + "".join(
        f" {ratio(row, n):>8}" for n in names
    )


def print_tables(
    checks: list[dict],
    rows: list[dict],
    ceilings: dict | None,
    only: list[str],
    *,
    rel_tol: float,
    dims: str,
    page: int,
    heads: int,
    peers: tuple[tuple, tuple],
) -> None:
    """The tables of the parts in ``only``; ``ceilings`` None: nothing was timed. ``dims``: the
    heads, head size and dtype in words; ``peers``: the decode and the prefill peers' names."""
    if "checks" in only:
        print(f"\nchecks (max|out-ref|/max|ref|, bound {rel_tol:.0e}):")
        print(
            "  "
            + "  ".join(
                f"{c['case']}={c['rel_err']:.1e}{'' if c['ok'] else ' FAIL'}" for c in checks
            )
        )
    if ceilings is None:
        return
    print(f"\n{describe(ceilings)}")
    print("%cp: % of the measured copy bandwidth, %BW of the nominal; %mm: % of the measured")
    print("matmul rate, %pk of the nominal; ratio = peer time / ours (>1: we are faster)")
    if "decode" in only:
        print(f"\ndecode ({dims}, block {page}); peers: SDPA FlashAttention GQA, FlexAttention")
        print_decode(rows, peers[0])
    if "prefill" in only:
        print(f"\ncausal prefill ({dims}, one sequence); peers: sdpa = SDPA FlashAttention GQA,")
        print(
            f"cudnn / fa-mha = SDPA MHA (K/V expanded to {heads} heads) on cuDNN / FlashAttention"
        )
        print_prefill(rows, peers[1])


def print_decode(rows: list[dict], peers: tuple) -> None:
    print(
        f"{'B':>4} {'ctx':>6} {'spl':>3} {'ours us':>9} {'GB/s':>7} {'%cp':>5} {'%BW':>5}"
        + peer_columns(None, peers)
    )
    for r in (r for r in rows if r["kind"] == "decode"):
        if "skipped" in r:
            print(f"{r['batch']:>4} {r['ctx']:>6}  skipped: {r['skipped']}")
            continue
        print(
            f"{r['batch']:>4} {r['ctx']:>6} {r['splits']:>3} {us(r['ours']):>9} "
            f"{r['gbps']:>7.0f} {r['pct_bw_measured']:>5.1f} {r['pct_bw']:>5.1f}"
            + peer_columns(r, peers)
        )


def print_prefill(rows: list[dict], peers: tuple) -> None:
    """``kern``: the kernel timed as ours (what TRITON_ATTN launches: ``gluon`` on Hopper);
    with gluon, ``triton us`` is the Triton kernel it replaces and ``rel`` their difference."""
    print(
        f"{'tokens':>7} {'kern':>6} {'ours us':>10} {'TFLOP/s':>8} {'%mm':>5} {'%pk':>5}"
        f" {'triton us':>10} {'triton/o':>8} {'rel':>7}" + peer_columns(None, peers)
    )
    for r in (r for r in rows if r["kind"] == "prefill"):
        if "skipped" in r:
            print(f"{r['tokens']:>7}  skipped: {r['skipped']}")
            continue
        rel = r.get("gluon_rel_vs_triton")
        print(
            f"{r['tokens']:>7} {r.get('kernel', 'triton'):>6} {us(r['ours']):>10} "
            f"{r['tflops']:>8.0f} {r['pct_flops_measured']:>5.1f} {r['pct_flops']:>5.1f} "
            f"{us(r.get('triton')):>10} {ratio(r, 'triton'):>8} "
            f"{'-' if rel is None else format(rel, '.1e'):>7}" + peer_columns(r, peers)
        )
