"""H200 benchmark of the fused Mamba-1 and lightning decode steps (``ops/state/decode_triton.py``).

1. Checks each kernel against its PyTorch twin (``selective_scan_decode``,
   ``lightning_attention_decode``) on the same inputs and state rows (random order in a larger
   pool): bf16 inputs (Mamba's dt float32, as the layer gives it), float32 state. The state
   after the step within 1e-5 of the twin's (relative to its largest value), the output within
   1e-2 (bf16 rounding), and every row outside ``state_indices`` bit-identical.
2. Times one layer's decode step at batch 1, 16, 64 and 256, Jamba-1.5-Mini's Mamba layer
   (d_inner 8192, d_state 16: 512 KiB of float32 state per sequence) and MiniMax-Text-01's
   lightning layer (64 heads, dk = dv = 128: 4 MiB per sequence): the kernel (at its pinned tile
   and at each tile of ``TILES``) and the PyTorch step (the twin, which is what the torch backend
   runs), each as the median over a CUDA graph of calls that rotate over disjoint sets of state
   rows (256 MiB or more in all, so L2 does not hold them). Reports microseconds, GB/s of state
   moved (each row read once and written once), that as % of 4.25 TB/s, and torch time / kernel
   time.

    python benchmarks/gpu_state_decode.py [--smoke]

``--smoke`` runs the checks at toy sizes on CPU under Triton's interpreter (float32).
Writes ``$OUT/gpu_state_decode.json`` when ``OUT`` is set. Not a test:
tests/kernels/test_triton_state_decode.py.
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

from attnserve.attention.state import lightning_attention_decode, selective_scan_decode  # noqa: E402
from attnserve.ops.state.decode_triton import (  # noqa: E402
    fused_lightning_decode,
    fused_selective_scan_decode,
)

JAMBA = (8192, 16)  # d_inner, d_state (Jamba-1.5-Mini)
MINIMAX = (64, 128, 128)  # heads, dk, dv (MiniMax-Text-01)
BATCHES = [1, 16, 64, 256]
TILES = {"jamba": ("block_d", [16, 32, 64, 128, 256]), "minimax": ("block_v", [8, 16, 32, 64])}
L2_BUST_BYTES, MAX_SETS = 256 << 20, 512


def jamba_inputs(b: int, shape, dtype, device, seed: int):
    """x, dt (float32), A [D, N], B, C [B, N], D [D], z: the arguments before the state."""
    d, n = shape
    gen = torch.Generator().manual_seed(seed)
    x, z = (torch.randn(b, d, generator=gen).to(device, dtype) for _ in range(2))
    dt = torch.nn.functional.softplus(torch.randn(b, d, generator=gen) - 2).to(device)
    a = (-torch.arange(1, n + 1, dtype=torch.float32)).expand(d, n).contiguous().to(device)  # S4D-real
    bb, cc = (torch.randn(b, n, generator=gen).to(device, dtype) for _ in range(2))
    return [x, dt, a, bb, cc, torch.ones(d, device=device), z]


def minimax_inputs(b: int, shape, dtype, device, seed: int):
    """q, k [B, H, dk], v [B, H, dv], decay rates [H]: the arguments before the state."""
    h, dk, dv = shape
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, dk, generator=gen).to(device, dtype) / dk**0.5 for _ in range(2))
    v = torch.randn(b, h, dv, generator=gen).to(device, dtype)
    rates = 2.0 ** (-8.0 * torch.arange(1, h + 1) / h)  # layer 0 of lightning_decay_rates
    return [q, k, v, rates.float().to(device)]


# name -> (inputs, kernel, twin); the state per sequence is the shape itself
MODELS = {
    "jamba": (jamba_inputs, fused_selective_scan_decode, selective_scan_decode),
    "minimax": (minimax_inputs, fused_lightning_decode, lightning_attention_decode),
}


def check(model: str, device, dtype, shape, batches) -> list[dict]:
    make, kernel, twin = MODELS[model]
    rows = []
    for b in batches:
        args = make(b, shape, dtype, device, seed=b)
        pool = 2 * b + 3
        state = torch.randn(pool, *shape, generator=torch.Generator().manual_seed(b + 1)).to(device)
        slots = torch.randperm(pool, generator=torch.Generator().manual_seed(b + 2))[:b].to(device)
        ours, ref_state = state.clone(), state.clone()
        out = kernel(*args, ours, state_indices=slots).float()
        ref = twin(*args, ref_state, state_indices=slots).float()
        out_err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        state_err = ((ours - ref_state).abs().max() / ref_state.abs().max()).item()
        unused = torch.ones(pool, dtype=torch.bool, device=device)
        unused[slots] = False
        untouched = bool(torch.equal(ours[unused], state[unused]))
        out_tol = 1e-5 if dtype == torch.float32 else 1e-2
        rows.append({"check": f"{model} B={b}", "out_rel_err": out_err, "state_rel_err": state_err,
                     "untouched": untouched, "ok": out_err <= out_tol and state_err <= 1e-5 and untouched})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench(model: str, shape, b: int) -> dict:
    from gpu_attention import time_per_call

    make, kernel, twin = MODELS[model]
    row_bytes = math.prod(shape) * 4
    sets = min(MAX_SETS, max(1, math.ceil(L2_BUST_BYTES / (b * row_bytes))))
    state = torch.zeros(sets * b + 1, *shape, device="cuda")  # slot 0 unused, as the engine's null slot
    order = torch.randperm(sets * b, generator=torch.Generator().manual_seed(b)) + 1
    args = [(make(b, shape, torch.bfloat16, "cuda", seed=i), order[i * b:(i + 1) * b].to("cuda")) for i in range(sets)]

    def calls(fn, **kw):
        return [lambda a=a, rows=rows: fn(*a, state, state_indices=rows, **kw) for a, rows in args]

    ours, graphed = time_per_call(calls(kernel))
    tile_name, tiles = TILES[model]
    tile_us = {t: time_per_call(calls(kernel, **{tile_name: t}))[0] * 1e6 for t in tiles}
    torch_s, torch_graphed = time_per_call(calls(twin))
    moved = 2 * b * row_bytes  # each row read once and written once
    row = {"model": model, "batch": b, "sets": sets, "us": ours * 1e6, "gbps": moved / ours / 1e9,
           "pct_bw": 100 * moved / ours / NOMINAL_BW, "torch_us": torch_s * 1e6, "torch_gbps": moved / torch_s / 1e9,
           "speedup": torch_s / ours, f"{tile_name}_us": tile_us, "graphed": graphed and torch_graphed}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    smoke = "--smoke" in sys.argv
    if smoke:
        shapes = {"jamba": (40, 12), "minimax": (3, 24, 40)}
        checks = [c for m, s in shapes.items() for c in check(m, "cpu", torch.float32, s, (1, 5))]
    else:
        shapes = {"jamba": JAMBA, "minimax": MINIMAX}
        checks = [c for m, s in shapes.items() for c in check(m, "cuda", torch.bfloat16, s, (1, 7, 64))]
    ok = all(c["ok"] for c in checks)
    rows = [] if smoke or not ok else [bench(m, s, b) for m, s in shapes.items() for b in BATCHES]
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_state_decode.json").write_text(json.dumps(
            {"smoke": smoke, "checks": checks, "rows": rows, "shapes": shapes}, indent=1))
    print("\nchecks:", "  ".join(f"{c['check']}: out {c['out_rel_err']:.1e} state {c['state_rel_err']:.1e}"
                                 for c in checks))
    if rows:
        print(f"\n{'model':<9}{'B':>5}{'us':>10}{'GB/s':>9}{'%BW':>7}{'torch us':>10}{'torch/ours':>11}  us per tile")
        for r in rows:
            tile_name = TILES[r["model"]][0]
            tiles = " ".join(f"{t}:{us:.1f}" for t, us in r[f"{tile_name}_us"].items())
            print(f"{r['model']:<9}{r['batch']:>5}{r['us']:>10.1f}{r['gbps']:>9.0f}{r['pct_bw']:>7.1f}"
                  f"{r['torch_us']:>10.1f}{r['speedup']:>11.2f}  {tile_name} {tiles}")
    if not ok:
        sys.exit(2)


if __name__ == "__main__":
    main()
