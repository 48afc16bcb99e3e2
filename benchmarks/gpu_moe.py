"""H200 benchmark of the grouped MoE kernels (``ops/triton_moe.py``).

1. Checks, bf16, against ``FusedExperts._forward_torch`` (the PyTorch expert loop) on the same
   weights: ``max|out - ref| / max|ref|`` at most 2e-2, for SwiGLU and GPT-OSS's clamped form.
2. Times one MoE layer's experts, Mixtral-8x7B shape (8 experts, hidden 4096, intermediate
   14336, top-2) and DeepSeek-V3 shape (256 experts, 7168, 2048, top-8), at 1 to 256 tokens:
   microseconds, the bytes of the experts the batch touches over that time as % of 4.25 TB/s,
   and the time ratio against the PyTorch loop (which syncs with the host, so it is timed
   eagerly; ours inside a CUDA graph, as the engine runs it).

    python benchmarks/gpu_moe.py [--smoke]

``--smoke`` runs the checks at toy sizes on CPU under Triton's interpreter (float32).
Writes ``$OUT/gpu_moe.json`` when ``OUT`` is set. Not a test: tests/kernels/test_triton_moe.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from attnserve.layers.fused import override_impl  # noqa: E402
from attnserve.layers.moe import FusedExperts  # noqa: E402

BANDWIDTH = 4.25e12
SHAPES = {"mixtral": (8, 4096, 14336, 2), "deepseek_v3": (256, 7168, 2048, 8)}
TOKENS = [1, 16, 64, 256]


def experts(e: int, h: int, i: int, dtype, device, clamped: bool = False) -> FusedExperts:
    ex = FusedExperts(e, h, i, bias=clamped, swiglu_limit=7.0 if clamped else None,
                      swiglu_alpha=1.702 if clamped else None)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 if clamped else h ** -0.5))
    return ex.to(device, dtype)


def routing(t: int, e: int, k: int, device):
    g = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
    return torch.rand(t, k, generator=g).to(device), ids


def check(device, dtype, sizes) -> list[dict]:
    rows = []
    e, h, i, k = sizes
    for clamped in (False, True):
        ex = experts(e, h, i, dtype, device, clamped)
        for t in (1, 7, 40):
            x = torch.randn(t, h, device=device, dtype=dtype)
            w, ids = routing(t, e, k, device)
            ref = ex._forward_torch(x, w, ids).float()
            with override_impl("triton"):
                out = ex(x, w, ids).float()
            err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
            rows.append({"check": f"{'clamped' if clamped else 'swiglu'} T={t}", "rel_err": err, "ok": err <= 2e-2})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def bench(name: str) -> list[dict]:
    from gpu_attention import time_per_call
    from triton.testing import do_bench

    e, h, i, k = SHAPES[name]
    ex = experts(e, h, i, torch.bfloat16, "cuda")
    rows = []
    for t in TOKENS:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        w, ids = routing(t, e, k, "cuda")
        with override_impl("triton"):
            ours, graphed = time_per_call([lambda x=x, w=w, ids=ids: ex(x, w, ids)])
        loop = do_bench(lambda x=x, w=w, ids=ids: ex._forward_torch(x, w, ids), warmup=10, rep=100,
                        return_mode="median") * 1e-3
        touched = ids.unique().numel() * 3 * h * i * 2
        rows.append({"shape": name, "tokens": t, "experts_touched": ids.unique().numel(), "us": ours * 1e6,
                     "pct_bw": 100 * touched / ours / BANDWIDTH, "loop_us": loop * 1e6, "loop_over_ours": loop / ours,
                     "graphed": graphed})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    smoke = "--smoke" in sys.argv
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    checks = check(device, dtype, (6, 64, 96, 2) if smoke else (8, 1024, 2048, 2))
    rows = [] if smoke else [r for name in SHAPES for r in bench(name)]
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_moe.json").write_text(json.dumps({"checks": checks, "rows": rows}, indent=1))
    print("\nchecks:", "  ".join(f"{c['check']}={c['rel_err']:.1e}" for c in checks))
    if rows:
        print(f"\n{'shape':<12}{'T':>5}{'experts':>9}{'us':>10}{'%BW':>7}{'loop us':>10}{'loop/ours':>10}")
        for r in rows:
            print(f"{r['shape']:<12}{r['tokens']:>5}{r['experts_touched']:>9}{r['us']:>10.1f}{r['pct_bw']:>7.1f}"
                  f"{r['loop_us']:>10.1f}{r['loop_over_ours']:>10.2f}")
    if not all(c["ok"] for c in checks):
        sys.exit(2)


if __name__ == "__main__":
    main()
