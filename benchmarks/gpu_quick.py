"""A short GPU run: the fused elementwise kernels against their twins on CUDA, then the
Llama-3.1-8B-shaped batch-1 decode rate (the figure they are meant to move).

    python benchmarks/gpu_quick.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from attnserve.layers import fused  # noqa: E402


def check_fused() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    r = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, generator=g)
    out, res = fused.rms_norm(x, w, 1e-5, residual=r)
    ref_out, ref_res = fused.rms_norm_ref(x, w, 1e-5, residual=r)
    print("rms_norm+residual max err", (out.float() - ref_out.float()).abs().max().item(),
          (res.float() - ref_res.float()).abs().max().item())
    gu = torch.randn(37, 2 * 14336, device="cuda", dtype=torch.bfloat16, generator=g)
    print("silu_and_mul max err", (fused.act_and_mul(gu, "silu").float() - fused.act_and_mul_ref(gu, "silu").float())
          .abs().max().item())


def main() -> None:
    check_fused()
    import gpu_engine

    r = gpu_engine.latency_8b()
    print(f"8B batch 1: {r['decode_tok_s']:.1f} tok/s, floor {r['floor_tok_s']:.0f} ({r['fraction_of_floor']:.0%})")


if __name__ == "__main__":
    main()
