"""H200 benchmark of the fused Gated DeltaNet decode step (``ops/state/delta_decode_triton.py``).

1. Checks the kernel against its PyTorch twin (``delta_rule_decode``) on the same inputs and
   state rows (random order in a larger pool): bf16 q/k/v, float32 state, Qwen3-Next's heads,
   one log decay per head and one per key channel. The state after the step within 1e-5 of the
   twin's (relative to its largest value), the output within 1e-2 (bf16 rounding), and every
   row outside ``state_indices`` bit-identical.
2. Times one GDN layer's decode step, Qwen3-Next shape (Hk 16, Hv 32, dk = dv = 128: 2 MiB of
   float32 state per sequence), at batch 1, 16, 64 and 256: the kernel (at its pinned value
   tile and at each of ``BLOCK_VS``) and the PyTorch step (``gated_delta_decode``), each as the
   median over a CUDA graph of calls that rotate over disjoint sets of state rows (256 MiB or
   more in all, so L2 does not hold them). Reports microseconds, GB/s of state moved (each
   row read once and written once), that as % of 4.25 TB/s, and torch time / kernel time.

    python benchmarks/gpu_gdn.py [--smoke]

``--smoke`` runs the checks at toy sizes on CPU under Triton's interpreter (float32).
Writes ``$OUT/gpu_gdn.json`` when ``OUT`` is set. Not a test: tests/kernels/test_triton_gdn.py.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from ceilings import NOMINAL_BW  # noqa: E402

from attnserve.attention.state import delta_rule_decode, gated_delta_decode  # noqa: E402
from attnserve.ops.state.delta_decode_triton import fused_delta_rule_decode  # noqa: E402

QWEN3_NEXT = (16, 32, 128, 128)  # Hk, Hv, dk, dv
BATCHES = [1, 16, 64, 256]
BLOCK_VS = [8, 16, 32, 64]
L2_BUST_BYTES, MAX_SETS = 256 << 20, 128


def inputs(b: int, heads: tuple[int, int, int, int], dtype, device, per_channel: bool, seed: int):
    """q, k [B, Hk, dk], v [B, Hv, dv], beta [B, Hv] in ``dtype``; g float32 [B, Hv] or [B, Hv, dk]."""
    hk, hv, dk, dv = heads
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, hv, dv, generator=gen)
    g = -torch.rand(b, hv, *((dk,) if per_channel else ()), generator=gen)
    beta = torch.rand(b, hv, generator=gen)
    return [x.to(device, dtype) for x in (q, k, v)] + [g.to(device), beta.to(device, dtype)]


def check(device, dtype, heads, batches) -> list[dict]:
    rows = []
    hk, hv, dk, dv = heads
    for per_channel in (False, True):
        for b in batches:
            q, k, v, g, beta = inputs(b, heads, dtype, device, per_channel, seed=b)
            pool = 2 * b + 3
            state = torch.randn(pool, hv, dk, dv, generator=torch.Generator().manual_seed(b + 1)).to(device)
            slots = torch.randperm(pool, generator=torch.Generator().manual_seed(b + 2))[:b].to(device)
            ours, twin = state.clone(), state.clone()
            g_twin = g if per_channel else g[..., None]
            out = fused_delta_rule_decode(q, k, v, g, beta, ours, state_indices=slots, use_qk_l2norm=True).float()
            ref = delta_rule_decode(q, k, v, g_twin, beta, twin, state_indices=slots, use_qk_l2norm=True).float()
            out_err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
            state_err = ((ours - twin).abs().max() / twin.abs().max()).item()
            unused = torch.ones(pool, dtype=torch.bool, device=device)
            unused[slots] = False
            untouched = bool(torch.equal(ours[unused], state[unused]))
            out_tol = 1e-5 if dtype == torch.float32 else 1e-2
            rows.append({"check": f"{'per-channel' if per_channel else 'per-head'} g, B={b}", "out_rel_err": out_err,
                         "state_rel_err": state_err, "untouched": untouched,
                         "ok": out_err <= out_tol and state_err <= 1e-5 and untouched})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def bench(b: int) -> dict:
    from gpu_attention import time_per_call

    hk, hv, dk, dv = QWEN3_NEXT
    row_bytes = hv * dk * dv * 4
    sets = min(MAX_SETS, max(1, math.ceil(L2_BUST_BYTES / (b * row_bytes))))
    state = torch.zeros(sets * b + 1, hv, dk, dv, device="cuda")  # slot 0 unused, as the engine's null slot
    order = torch.randperm(sets * b, generator=torch.Generator().manual_seed(b)) + 1
    args = []
    for i in range(sets):
        q, k, v, g, beta = inputs(b, QWEN3_NEXT, torch.bfloat16, "cuda", per_channel=False, seed=i)
        args.append((q, k, v, g, beta, order[i * b:(i + 1) * b].to("cuda")))

    def calls(fn, **kw):
        return [lambda a=a: fn(*a[:5], state, state_indices=a[5], use_qk_l2norm=True, **kw) for a in args]

    ours, graphed = time_per_call(calls(fused_delta_rule_decode))
    tiles = {bv: time_per_call(calls(fused_delta_rule_decode, block_v=bv))[0] * 1e6 for bv in BLOCK_VS}
    torch_s, torch_graphed = time_per_call(calls(gated_delta_decode))
    moved = 2 * b * row_bytes  # each row read once and written once
    row = {"batch": b, "sets": sets, "us": ours * 1e6, "gbps": moved / ours / 1e9, "pct_bw": 100 * moved / ours / NOMINAL_BW,
           "torch_us": torch_s * 1e6, "torch_gbps": moved / torch_s / 1e9, "speedup": torch_s / ours,
           "block_v_us": tiles, "graphed": graphed and torch_graphed}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    smoke = "--smoke" in sys.argv
    if smoke:
        checks = check("cpu", torch.float32, (2, 4, 24, 40), (1, 5))
    else:
        checks = check("cuda", torch.bfloat16, QWEN3_NEXT, (1, 7, 64))
    rows = [] if smoke or not all(c["ok"] for c in checks) else [bench(b) for b in BATCHES]
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_gdn.json").write_text(json.dumps({"smoke": smoke, "checks": checks, "rows": rows,
                                                         "shape": dict(zip(("hk", "hv", "dk", "dv"), QWEN3_NEXT))},
                                                        indent=1))
    print("\nchecks:", "  ".join(f"{c['check']}: out {c['out_rel_err']:.1e} state {c['state_rel_err']:.1e}"
                                 for c in checks))
    if rows:
        print(f"\n{'B':>5}{'us':>10}{'GB/s':>9}{'%BW':>7}{'torch us':>10}{'torch/ours':>11}  us per block_v")
        for r in rows:
            tiles = " ".join(f"{bv}:{us:.1f}" for bv, us in r["block_v_us"].items())
            print(f"{r['batch']:>5}{r['us']:>10.1f}{r['gbps']:>9.0f}{r['pct_bw']:>7.1f}{r['torch_us']:>10.1f}"
                  f"{r['speedup']:>11.2f}  {tiles}")
    if not all(c["ok"] for c in checks):
        sys.exit(2)


if __name__ == "__main__":
    main()
