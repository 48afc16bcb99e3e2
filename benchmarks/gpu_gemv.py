"""The small-M fused linears (``ops/dense/gemv_triton.py``) against cuBLAS and the unfused decode path (H200).

Shapes: Llama-3.1-8B's layer (qkv N=6144 K=4096, o_proj 4096x4096, gate_up 28672x4096, down
4096x14336, lm_head 128256x4096) and Qwen3-0.6B's (qkv 4096x1024, o_proj 1024x2048, gate_up
6144x1024, down 1024x3072), M in {1, 2, 4, 8, 16}, bf16. Each shape runs the variant the model
runs there: qkv and gate_up the add + RMSNorm prologue, down the act-and-mul (SiLU) prologue,
o_proj and lm_head the plain product.

1. Correctness: every config timed, and the pinned one (``config_for``) in fp32 too, against
   the PyTorch twin (``layers/gemv.py``'s ``*_ref``; ``F.linear``): max|y - ref| / max|ref|
   <= 2e-2 in bf16, 1e-4 in fp32; the new residual equal to the twin's bit for bit. The script
   exits non-zero when a check fails.
2. Timing: a small config sweep per (shape, M) (the pinned config included), cuBLAS
   ``F.linear`` alone, and the unfused sequence the engine runs without the kernels (the Triton
   add + RMSNorm kernel + ``F.linear``; the Triton act-and-mul kernel + ``F.linear``; for the
   plain shapes cuBLAS alone). One CUDA graph per variant holds ``--reps`` rounds over enough
   weight copies (>= 256 MB) that no weight is in L2 when it is read; time per call = median
   replay (CUDA events) / calls. Bandwidth = (W + x + y bytes) / time against 4.25 TB/s.

Prints one line per (shape, M), a table, the winners as ``CONFIGS`` entries to pin in
``ops/dense/gemv_triton.py``, and the largest M at which the fused path beats the unfused one on every
shape (for ``layers/gemv.MAX_M``); writes ``$OUT/gpu_gemv.json`` when ``OUT`` is set.

    python benchmarks/gpu_gemv.py                      # ~2-3 minutes on the H200 (compiles)
    python benchmarks/gpu_gemv.py --shapes llama8b --m 1,16 --no-sweep
    python benchmarks/gpu_gemv.py --smoke              # CPU, Triton's interpreter, toy sizes

Not a test: CPU correctness is ``tests/kernels/test_triton_gemv.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from ceilings import NOMINAL_BW  # noqa: E402
from graph_timing import graph_replay_us  # noqa: E402

from attnserve.layers.gemv import act_linear_ref, norm_linear_ref  # noqa: E402
from attnserve.ops.dense import fused_triton as triton_fused  # noqa: E402
from attnserve.ops.dense import gemv_triton as triton_gemv  # noqa: E402
from attnserve.ops.dense.gemv_triton import GemvConfig, config_for  # noqa: E402

EPS = 1e-5
SHAPES = {  # name -> (N, K, prologue)
    "llama8b.qkv": (6144, 4096, "norm"),
    "llama8b.o_proj": (4096, 4096, "plain"),
    "llama8b.gate_up": (28672, 4096, "norm"),
    "llama8b.down": (4096, 14336, "act"),
    "llama8b.lm_head": (128256, 4096, "plain"),
    "qwen3_0.6b.qkv": (4096, 1024, "norm"),
    "qwen3_0.6b.o_proj": (1024, 2048, "plain"),
    "qwen3_0.6b.gate_up": (6144, 1024, "norm"),
    "qwen3_0.6b.down": (1024, 3072, "act"),
}
SMOKE_SHAPES = {"toy.qkv": (80, 96, "norm"), "toy.o_proj": (48, 64, "plain"), "toy.down": (80, 96, "act")}
_G = GemvConfig
SWEEP = {  # M class -> candidates (the pinned config is added)
    "m1": [_G(8, 512, 4, 1), _G(8, 512, 4, 3), _G(16, 256, 4, 3), _G(16, 256, 8, 3), _G(32, 128, 4, 3),
           _G(32, 128, 8, 3), _G(64, 64, 4, 3), _G(4, 1024, 4, 3), _G(8, 1024, 4, 3), _G(64, 64, 4, 1)],
    "small": [_G(8, 256), _G(16, 128, 4, 3), _G(16, 256, 4, 3, True), _G(32, 256, 4, 3, True),
              _G(16, 512, 4, 3, True), _G(32, 128, 4, 4, True), _G(64, 128, 4, 3, True)],
    "large": [_G(16, 256, 4, 3, True), _G(32, 256, 4, 3, True), _G(16, 512, 4, 3, True),
              _G(32, 128, 4, 4, True), _G(64, 128, 4, 3, True), _G(64, 256, 8, 3, True),
              _G(16, 128, 4, 4, True), _G(32, 512, 8, 2, True)],
}
SMOKE_SWEEP = [_G(16, 32, 1, 1), _G(16, 32, 1, 1, True)]


class Case:
    """One shape at one M: weight copies, inputs, and the variants as callables of a weight."""

    def __init__(self, n: int, k: int, prologue: str, m: int, dtype: torch.dtype, dev: str, copies: int):
        g = torch.Generator(device=dev).manual_seed(n + k + m)
        self.n, self.k, self.m, self.prologue = n, k, m, prologue
        self.weights = [(torch.randn(n, k, generator=g, device=dev) / k**0.5).to(dtype) for _ in range(copies)]
        width = 2 * k if prologue == "act" else k
        self.x = torch.randn(m, width, generator=g, device=dev).to(dtype)
        self.res = torch.randn(m, k, generator=g, device=dev).to(dtype)
        self.nw = (torch.rand(k, generator=g, device=dev) + 0.5).to(dtype)
        self.plain_x = self.x[:, :k].contiguous()

    def bytes(self) -> int:
        w = self.weights[0]
        return (w.numel() + self.x.numel() + self.m * self.n) * w.element_size()

    def fused(self, w: torch.Tensor, cfg: GemvConfig | None):
        if self.prologue == "norm":
            return triton_gemv.rms_norm_linear(self.x, self.nw, EPS, w, None, self.res, config=cfg)
        if self.prologue == "act":
            return triton_gemv.act_and_mul_linear(self.x, "silu", w, config=cfg)
        return triton_gemv.linear(self.x, w, config=cfg)

    def twin(self, w: torch.Tensor):
        if self.prologue == "norm":
            return norm_linear_ref(self.x, self.nw, EPS, w, None, self.res)
        if self.prologue == "act":
            return act_linear_ref(self.x, "silu", w)
        return F.linear(self.x, w)

    def unfused(self, w: torch.Tensor):
        """What the engine runs without the kernels (Triton norm / activation, then cuBLAS)."""
        if self.prologue == "norm":
            h, s = triton_fused.rms_norm(self.x, self.nw, EPS, self.res)
            return F.linear(h, w), s
        if self.prologue == "act":
            return F.linear(triton_fused.act_and_mul(self.x, "silu"), w)
        return F.linear(self.x, w)

    def cublas(self, w: torch.Tensor):
        return F.linear(self.plain_x, w)


def m_bucket(m: int) -> int:
    """The M key of ``CONFIGS``: 1, 2, 4, 8 or 16."""
    return 1 << (m - 1).bit_length()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30)).item()


def check(case: Case, cfg: GemvConfig | None, tol: float) -> str | None:
    """None, or what differs from the twin."""
    got, want = case.fused(case.weights[0], cfg), case.twin(case.weights[0])
    if case.prologue == "norm":
        if not torch.equal(got[1], want[1]):
            return f"residual differs (max {rel_err(got[1], want[1]):.2e})"
        got, want = got[0], want[0]
    err = rel_err(got, want)
    return None if err <= tol else f"rel err {err:.2e} > {tol:.0e}"


def time_us(case: Case, fn: Callable[[torch.Tensor], object], reps: int) -> float:
    """Microseconds per call over the weight copies: median of CUDA-graph replays (wall time on CPU)."""
    calls = reps * len(case.weights)
    if case.x.device.type == "cpu":
        t = time.perf_counter()
        for w in case.weights:
            fn(w)
        return 1e6 * (time.perf_counter() - t) / len(case.weights)

    def body() -> None:
        for _ in range(reps):
            for w in case.weights:
                fn(w)

    return graph_replay_us(body, warm=lambda: fn(case.weights[0])) / calls


def candidates(m: int, n: int, k: int, prologue: str, smoke: bool, sweep: bool) -> list[GemvConfig]:
    pinned = config_for(m, n, k, prologue)
    if not sweep:
        return [pinned]
    pool = SMOKE_SWEEP if smoke else SWEEP["m1" if m == 1 else "small" if m <= 4 else "large"]
    return [pinned] + [c for c in pool if c != pinned]


def run_case(name: str, case: Case, args, failures: list[str]) -> dict:
    n, k, m = case.n, case.k, case.m
    row: dict = {"shape": name, "m": m, "n": n, "k": k, "prologue": case.prologue, "bytes": case.bytes()}
    reps = 1 if args.smoke else args.reps
    best = None
    for cfg in candidates(m, n, k, case.prologue, args.smoke, not args.no_sweep):
        bad = check(case, cfg, 2e-2 if case.x.dtype == torch.bfloat16 else 1e-4)
        if bad:
            failures.append(f"{name} M={m} {cfg}: {bad}")
            continue
        us = time_us(case, lambda w, cfg=cfg: case.fused(w, cfg), reps)
        if best is None or us < best[0]:
            best = (us, cfg)
    if best is None:
        return row
    row["fused_us"], cfg = round(best[0], 2), best[1]
    row["config"] = {f: getattr(cfg, f) for f in ("block_n", "block_k", "num_warps", "num_stages", "dot")}
    row["pinned"] = cfg == config_for(m, n, k, case.prologue)
    row["cublas_us"] = round(time_us(case, case.cublas, reps), 2)
    row["unfused_us"] = round(time_us(case, case.unfused, reps), 2)
    for key in ("fused", "cublas", "unfused"):
        row[f"{key}_bw"] = round(case.bytes() / (row[f"{key}_us"] * 1e-6) / NOMINAL_BW, 3)
    return row


def check_fp32(name: str, n: int, k: int, prologue: str, dev: str, ms: list[int], failures: list[str]) -> None:
    """The pinned config in fp32 (IEEE dots), one weight copy."""
    for m in (ms[0], ms[-1]):
        case = Case(n, k, prologue, m, torch.float32, dev, 1)
        bad = check(case, None, 1e-4)
        if bad:
            failures.append(f"{name} M={m} fp32: {bad}")
        del case


def summary(rows: list[dict]) -> None:
    print(f"\n{'shape':<20} {'M':>3} | {'fused us':>8} {'BW':>5} | {'cuBLAS':>7} {'BW':>5} | "
          f"{'unfused':>7} {'BW':>5} | {'vs unfused':>10} | config")
    for r in rows:
        if "fused_us" not in r:
            continue
        c = r["config"]
        print(f"{r['shape']:<20} {r['m']:>3} | {r['fused_us']:>8.1f} {r['fused_bw']:>5.0%} | "
              f"{r['cublas_us']:>7.1f} {r['cublas_bw']:>5.0%} | {r['unfused_us']:>7.1f} {r['unfused_bw']:>5.0%} | "
              f"{r['unfused_us'] / r['fused_us']:>9.2f}x | {c['block_n']}x{c['block_k']} w{c['num_warps']} "
              f"s{c['num_stages']}{' dot' if c['dot'] else ''}{' (pinned)' if r['pinned'] else ''}")
    print("\n# winners, to pin in ops/dense/gemv_triton.py CONFIGS (prologue, M bucket, N, K):")
    for r in rows:
        if "config" in r and not r["pinned"]:
            c = r["config"]
            print(f"    (\"{r['prologue']}\", {m_bucket(r['m'])}, {r['n']}, {r['k']}): GemvConfig({c['block_n']}, "
                  f"{c['block_k']}, {c['num_warps']}, {c['num_stages']}, {c['dot']}),")
    wins = {}
    for r in rows:
        if "fused_us" in r:
            wins.setdefault(r["m"], []).append(r["fused_us"] <= r["unfused_us"])
    ok = [m for m in sorted(wins) if all(wins[m])]
    print(f"\nfused <= unfused on every shape at M in {ok}; all M tried: {sorted(wins)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, toy sizes")
    ap.add_argument("--shapes", default="", help="comma-separated name prefixes (llama8b, qwen3, llama8b.qkv)")
    ap.add_argument("--m", default="1,2,4,8,16", help="comma-separated batch rows")
    ap.add_argument("--no-sweep", action="store_true", help="time the pinned config only")
    ap.add_argument("--reps", type=int, default=3, help="rounds over the weight copies in one graph")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --smoke)")
    dev, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    prefixes = [p for p in args.shapes.split(",") if p]
    shapes = {k: v for k, v in shapes.items() if not prefixes or k.startswith(tuple(prefixes))}
    ms = [1, 3] if args.smoke else [int(m) for m in args.m.split(",")]
    rows, failures = [], []
    t0 = time.perf_counter()
    for name, (n, k, prologue) in shapes.items():
        w_bytes = n * k * torch.finfo(dtype).bits // 8
        copies = 1 if args.smoke else max(1, -(-(256 << 20) // w_bytes))
        for m in ms:
            case = Case(n, k, prologue, m, dtype, dev, copies)
            row = run_case(name, case, args, failures)
            rows.append(row)
            print(json.dumps(row), f"({time.perf_counter() - t0:.0f} s)", flush=True)
            del case
        check_fp32(name, n, k, prologue, dev, ms, failures)
        if dev == "cuda":
            torch.cuda.empty_cache()
    summary(rows)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_gemv.json"), "w") as f:
            json.dump({"rows": rows, "failures": failures, "bandwidth": NOMINAL_BW}, f, indent=1)
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
