"""H200 benchmark of the state prefill kernels (``ops/state/prefill_triton.py``) against their PyTorch twins.

Cases, each at 64 x 1024, 8 x 4096 and 1 x 32768 new tokens (sequences continuing from a state,
rows in random order in a larger pool), bf16 and float32 inputs (float32 states; conv states in
the input dtype):
- ``scan``: Jamba-1.5-Mini's Mamba layer, d_inner 8192, d_state 16 (``selective_scan_prefill``).
- ``lightning96``, ``lightning128``: MiniMax's lightning layer, 64 heads of 96 (the brief's shape;
  non-power-of-two, masked) and of 128 (MiniMax-Text-01's, algorithms.md 4.3)
  (``lightning_attention_prefill``).
- ``conv_qwen3_next``: the GDN short conv, 2*16*128 + 32*128 = 8192 channels, K 4, no bias;
  ``conv_jamba``: Jamba's, 8192 channels, K 4, with bias (``causal_conv1d_prefill``).

1. Checks: kernel and twin on the same inputs and copies of one pool; the max abs error of the
   outputs and of the final states, each also relative to the twin's largest value (bf16: output
   within 2e-2, state within 5e-3, lightning's bf16 products included; float32, lightning's
   products tf32x3: within 1e-4), and rows outside ``state_indices`` bit-identical.
2. Times: CUDA events around single calls, the median after warm-up, of the kernel and of the
   twin (what the TORCH_* backends run); tokens/s, GB/s of the bytes a call must move (inputs
   and outputs once, state rows read and written), that as % of 4.25 TB/s, and twin / kernel.
   For the scan also its exp floor (one exp per state element and token at 16 per clock per SM,
   132 SMs, 1.98 GHz): the scan is bound by those exps, not by memory, at d_state 16. bf16 rows
   also time a few variants of the pinned choices (``VARIANTS``: the scan's unroll and pieces,
   lightning's tf32 products and value tiles, the conv's tiles).

    python benchmarks/gpu_state_prefill.py [--smoke]

``--smoke`` runs the checks at toy sizes on CPU under Triton's interpreter (float32, no timing).
About 90 s on the H200, compiles included. Writes ``$OUT/gpu_state_prefill.json`` when ``OUT`` is set. Not a test:
tests/kernels/test_triton_state_prefill.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from ceilings import NOMINAL_BW  # noqa: E402

from attnserve.attention.state import (  # noqa: E402
    causal_conv1d_prefill,
    lightning_attention_prefill,
    selective_scan_prefill,
)
from attnserve.ops.state.prefill_triton import (  # noqa: E402
    fused_causal_conv1d_prefill,
    fused_lightning_prefill,
    fused_selective_scan_prefill,
)

EXP_RATE = 16 * 132 * 1.98e9  # exps per second (MUFU, H200)
BATCHES = [(64, 1024), (8, 4096), (1, 32768)]
# name -> dims: scan (d_inner, d_state); lightning (heads, head dim); conv (channels, width, bias)
CASES = {"scan": (8192, 16), "lightning96": (64, 96), "lightning128": (64, 128),
         "conv_qwen3_next": (8192, 4, False), "conv_jamba": (8192, 4, True)}
SMOKE_CASES = {"scan": (24, 6), "lightning96": (2, 24), "conv_qwen3_next": (40, 4, False),
               "conv_jamba": (40, 4, True)}
_LIGHTNING_VARIANTS = {"tf32": dict(dot="tf32"), "v64w8": dict(block_v=64, num_warps=8),
                      "v32w4": dict(block_v=32, num_warps=4)}
_CONV_VARIANTS = {"t16c256": dict(block_t=16, block_c=256), "t32c64": dict(block_t=32, block_c=64),
                  "t64c128": dict(block_t=64, block_c=128)}
VARIANTS = {"scan": {"unroll1": dict(unroll=1), "pieces1": dict(pieces=1)}, "lightning96": _LIGHTNING_VARIANTS,
            "lightning128": _LIGHTNING_VARIANTS, "conv_qwen3_next": _CONV_VARIANTS}


def make(case: str, dims, lens: list[int], dtype, device, seed: int):
    """(kernel, twin, args before the state, state pool, keyword args, bytes a call moves, exps)."""
    gen = torch.Generator(device).manual_seed(seed)  # inputs made on the device: GBs of them
    t, b = sum(lens), len(lens)
    pool = 2 * b + 3
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    kw = dict(query_start_loc=qsl, state_indices=torch.randperm(pool, generator=gen, device=device)[:b],
              has_initial_state=(torch.arange(b) % 4 != 3).to(device))  # every fourth starts from zeros
    size = torch.empty((), dtype=dtype).element_size()

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    def rand(*shape, scale=1.0):
        return (randn(*shape) * scale).to(dtype)

    if case == "scan":
        d, n = dims
        x, z = rand(t, d), rand(t, d)
        dt = F.softplus(randn(t, d) - 2)  # float32, as ssm_params gives it
        a = -torch.exp(torch.rand(d, n, generator=gen, device=device) * 2)  # A = -exp(A_log)
        args = [x, dt, a, rand(t, n), rand(t, n), torch.ones(d, device=device), z]
        state = randn(pool, d, n)
        moved = t * d * (3 * size + 4) + 2 * t * n * size + 2 * b * d * n * 4
        return fused_selective_scan_prefill, selective_scan_prefill, args, state, kw, moved, t * d * n
    if case.startswith("lightning"):
        h, hd = dims
        q, k = rand(t, h, hd, scale=hd**-0.5), rand(t, h, hd, scale=hd**-0.5)
        rates = (2.0 ** (-8.0 * torch.arange(1, h + 1) / h)).float().to(device)  # layer 0
        state = randn(pool, h, hd, hd)
        moved = 4 * t * h * hd * size + 2 * b * h * hd * hd * 4
        return fused_lightning_prefill, lightning_attention_prefill, [q, k, rand(t, h, hd), rates], state, \
            dict(kw, block_size=256), moved, 0
    c, width, bias = dims
    args = [rand(t, c), rand(c, width, scale=0.5), rand(c) if bias else None]
    state = randn(pool, c, width - 1).to(dtype)
    moved = 2 * t * c * size + 2 * b * c * (width - 1) * size
    return fused_causal_conv1d_prefill, causal_conv1d_prefill, args, state, dict(kw, silu=True), moved, 0


def check(case, kernel, twin, args, state, kw, dtype) -> dict:
    ours, ref = state.clone(), state.clone()
    out = kernel(*args, ours, **kw).float()
    want = twin(*args, ref, **kw).float()
    rows = kw["state_indices"]
    unused = torch.ones(state.shape[0], dtype=torch.bool, device=state.device)
    unused[rows] = False
    out_err, state_err = (out - want).abs().max().item(), (ours.float() - ref.float()).abs().max().item()
    out_rel = out_err / max(want.abs().max().item(), 1e-30)
    state_rel = state_err / max(ref.float().abs().max().item(), 1e-30)
    bf = dtype != torch.float32
    ok = (out_rel <= (2e-2 if bf else 1e-4) and state_rel <= (5e-3 if bf else 1e-4)
          and bool(torch.equal(ours[unused], state[unused])))
    return {"out_err": out_err, "out_rel": out_rel, "state_err": state_err, "state_rel": state_rel, "ok": ok}


def time_ms(fn, budget_s: float = 0.4) -> float:
    """Median milliseconds of ``fn`` over CUDA events, after warm-up; fewer calls for slow ones."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    reps = max(3, min(25, int(budget_s / max(time.perf_counter() - t0, 1e-6))))
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def run(case, dims, b, length, dtype, device, smoke) -> dict:
    lens = [length] * b if not smoke else [1, 5, 17]
    kernel, twin, args, state, kw, moved, exps = make(case, dims, lens, dtype, device, seed=b + length)
    row = {"case": case, "dtype": str(dtype).removeprefix("torch."), "batch": b, "len": length,
           **check(case, kernel, twin, args, state, kw, dtype)}
    if not smoke and row["ok"]:
        ms = time_ms(lambda: kernel(*args, state, **kw))
        twin_ms = time_ms(lambda: twin(*args, state, **kw))
        row.update(ms=ms, twin_ms=twin_ms, speedup=twin_ms / ms, mtok_s=sum(lens) / ms / 1e3,
                   gbps=moved / ms / 1e6, pct_bw=100 * moved / ms / 1e-3 / NOMINAL_BW)
        if exps:
            row["exp_floor_ms"] = exps / EXP_RATE * 1e3
        if dtype == torch.bfloat16:
            row["variants_ms"] = {name: time_ms(lambda v=v: kernel(*args, state, **kw, **v))
                                  for name, v in VARIANTS.get(case, {}).items()}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    smoke = "--smoke" in sys.argv
    device = "cpu" if smoke else "cuda"
    cases = SMOKE_CASES if smoke else CASES
    dtypes = [torch.float32] if smoke else [torch.bfloat16, torch.float32]
    batches = [(3, 23)] if smoke else BATCHES  # smoke: 3 sequences, 23 tokens
    t0 = time.perf_counter()
    rows = [run(case, dims, b, length, dtype, device, smoke)
            for case, dims in cases.items() for dtype in dtypes for b, length in batches]
    ok = all(r["ok"] for r in rows)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        Path(out, "gpu_state_prefill.json").write_text(json.dumps({"smoke": smoke, "rows": rows}, indent=1))
    print(f"\n{time.perf_counter() - t0:.0f} s; checks {'all ok' if ok else 'FAILED'}")
    print(f"{'case':<16}{'dtype':<9}{'BxL':>9}{'out rel':>9}{'st rel':>9}{'ms':>8}{'twin ms':>9}{'x':>7}"
          f"{'Mtok/s':>8}{'GB/s':>7}{'%BW':>6}  notes")
    for r in rows:
        shape = f"{r['batch']}x{r['len']}"
        head = f"{r['case']:<16}{r['dtype']:<9}{shape:>9}{r['out_rel']:>9.1e}{r['state_rel']:>9.1e}"
        if "ms" not in r:
            print(head + ("" if r["ok"] else "  FAILED"))
            continue
        notes = f"exp floor {r['exp_floor_ms']:.2f} ms " if "exp_floor_ms" in r else ""
        notes += " ".join(f"{k} {v:.2f}" for k, v in r.get("variants_ms", {}).items())
        print(head + f"{r['ms']:>8.2f}{r['twin_ms']:>9.1f}{r['speedup']:>7.1f}{r['mtok_s']:>8.1f}{r['gbps']:>7.0f}"
              f"{r['pct_bw']:>6.1f}  {notes}")
    if not ok:
        sys.exit(2)


if __name__ == "__main__":
    main()
