"""H200 benchmark of the chunked gated-delta-rule prefill (``ops/state/delta_prefill_triton.py``).

1. Checks the kernel against its PyTorch twin (``gated_delta_prefill``, ``kda_prefill``) on the
   same inputs and state rows (random order in a larger pool, every other sequence with an
   initial state): Qwen3-Next's GDN heads (Hk 16, Hv 32, dk = dv = 128, one log decay per head)
   and Kimi-Linear's KDA heads (H 32, dk = dv = 128, one log decay per key channel), bf16 and
   float32 q/k/v/beta (float32 g and state), varlen batches of 64 x 1024, 8 x 4096 and
   1 x 32768 tokens. Prints the largest absolute error of the outputs and of the final states,
   each also relative to the twin's largest value, and whether rows outside ``state_indices``
   stayed bit-identical. Passes within 1e-4 relative (float32) or 2e-2 (bf16: tf32 dots and
   bf16 outputs).
2. Times one layer's prefill, the kernel and the twin (what TORCH_GDN / TORCH_KDA run), each as
   the median of several CUDA-event-timed calls after warm-up; and fla's
   ``chunk_gated_delta_rule`` / ``chunk_kda`` where ``import fla`` works (skipped otherwise).
   Reports ms, tokens/s, TFLOP/s and twin time / kernel time.

FLOPs (the model's, per token and value head, chunk C = 64): 4 C dk (q k^T and k k^T over the
chunk) + 4 C dv (the triangular solve's product and P y) + 6 dk dv (k S, q S and the state
update). That leaves out the triangular inverse itself, KDA's per-level decay products and the
padding of a last chunk. Memory moved is not counted; the kernel's reads are q, k (per key
head), v, g, beta, and (I + A)^-1 and P (2 C values per token and value head, written once and
read once per value tile).

    python benchmarks/gpu_delta_prefill.py [--smoke] [--sweep] [--quick]

``--smoke`` runs the checks at toy sizes on CPU under Triton's interpreter (float32).
``--quick`` checks bf16 at 64 x 1024 only and times bf16 only (the full checks take minutes:
the float32 twin at 32K tokens). ``--sweep`` also times the kernel at other (block_v, num_warps, chunk) configs (bf16 only).
Writes ``$OUT/gpu_delta_prefill.json`` when ``OUT`` is set. Not a test:
tests/kernels/test_triton_delta_prefill.py.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from attnserve.attention.state import gated_delta_prefill  # noqa: E402
from attnserve.attention.state.kda import kda_prefill  # noqa: E402
from attnserve.ops.state.delta_prefill_triton import fused_delta_rule_prefill  # noqa: E402

# name -> (Hk, Hv, dk, dv, decay per key channel)
MODELS = {"gdn": (16, 32, 128, 128, False), "kda": (32, 32, 128, 128, True)}
BATCHES = [(64, 1024), (8, 4096), (1, 32768)]
SWEEP = [(32, 4, 64), (64, 4, 64), (128, 8, 64), (64, 8, 32)]  # block_v, num_warps, chunk (state kernel)
CHUNK = 64


def flops_per_token(dk: int, dv: int, c: int = CHUNK) -> int:
    return 4 * c * dk + 4 * c * dv + 6 * dk * dv


def make(model: str, b: int, n: int, dtype, device, seed: int = 0):
    """Inputs of one prefill: q, k, v, g, beta; state pool; query_start_loc, rows, has_initial_state."""
    hk, hv, dk, dv, per_channel = MODELS[model]
    gen = torch.Generator().manual_seed(seed)
    t = b * n

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q, k, v = rand(t, hk, dk).to(dtype), rand(t, hk, dk).to(dtype), rand(t, hv, dv).to(dtype)
    # log decays as the layers make them (-exp(A_log) softplus(.)): GDN about -0.7 per token, KDA per
    # channel with a long tail (some channels forget within a token)
    g = -F.softplus(rand(t, hv, dk) * 2 - 1) if per_channel else -F.softplus(rand(t, hv) - 0.5)
    beta = torch.sigmoid(rand(t, hv)).to(dtype)
    pool = b + 3
    state = rand(pool, hv, dk, dv) * 0.1
    qsl = torch.arange(0, t + 1, n, dtype=torch.int32, device=device)
    rows = torch.randperm(pool, generator=gen)[:b].to(device)
    init = (torch.arange(b) % 2 == 0).to(device)
    return (q, k, v, g, beta), state, dict(query_start_loc=qsl, state_indices=rows, has_initial_state=init,
                                           use_qk_l2norm=True)


def twin_of(model: str):
    return kda_prefill if MODELS[model][4] else gated_delta_prefill


def check(model: str, b: int, n: int, dtype, device) -> dict:
    inputs, state, kw = make(model, b, n, dtype, device)
    ours, ref = state.clone(), state.clone()
    out = fused_delta_rule_prefill(*inputs, ours, **kw).float()
    want = twin_of(model)(*inputs, ref, **kw).float()
    unused = torch.ones(state.shape[0], dtype=torch.bool, device=device)
    unused[kw["state_indices"]] = False
    out_err, state_err = (out - want).abs().max().item(), (ours - ref).abs().max().item()
    row = {"check": f"{model} {str(dtype)[6:]} {b}x{n}", "out_abs_err": out_err,
           "out_rel_err": out_err / want.abs().max().item(), "state_abs_err": state_err,
           "state_rel_err": state_err / ref.abs().max().item(),
           "untouched": bool(torch.equal(ours[unused], state[unused])), "finite": bool(out.isfinite().all())}
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    row["ok"] = row["out_rel_err"] <= tol and row["state_rel_err"] <= tol and row["untouched"] and row["finite"]
    print(json.dumps(row), flush=True)
    return row


def median_ms(fn, warmup: int = 2, reps: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fla_fn(model: str):
    """fla's chunked kernel for the same call, or None where fla does not import."""
    try:
        if MODELS[model][4]:
            from fla.ops.kda import chunk_kda as fn
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
    except Exception as exc:  # not installed, or its Triton does not match
        print(f"  (fla unavailable: {type(exc).__name__}: {exc})")
        return None

    def call(inputs, state, kw):
        q, k, v, g, beta = inputs
        cu = kw["query_start_loc"].long()
        rows, init = kw["state_indices"], kw["has_initial_state"]
        h0 = state[rows] * init[:, None, None, None]
        hv = v.shape[1]
        if q.shape[1] != hv:  # fla wants as many q/k heads as value heads
            q, k = (x.repeat_interleave(hv // x.shape[1], dim=1) for x in (q, k))
        o, ht = fn(q[None], k[None], v[None], g[None].to(q.dtype), beta[None], initial_state=h0,
                   output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        state[rows] = ht.to(state.dtype)
        return o

    return call


def bench(model: str, b: int, n: int, dtype, sweep: bool) -> dict:
    inputs, state, kw = make(model, b, n, dtype, "cuda", seed=1)
    ms = median_ms(lambda: fused_delta_rule_prefill(*inputs, state, **kw))
    twin = twin_of(model)
    twin_ms = median_ms(lambda: twin(*inputs, state, **kw), warmup=1, reps=3)
    _, hv, dk, dv, _ = MODELS[model]
    t = b * n
    row = {"model": model, "dtype": str(dtype)[6:], "batch": f"{b}x{n}", "ms": ms, "tok_per_s": t / ms * 1e3,
           "tflops": t * hv * flops_per_token(dk, dv) / ms * 1e-9, "twin_ms": twin_ms, "speedup": twin_ms / ms}
    fla = fla_fn(model)
    if fla is not None:
        try:
            row["fla_ms"] = median_ms(lambda: fla(inputs, state, kw))
        except Exception as exc:
            print(f"  (fla failed: {type(exc).__name__}: {exc})")
    if sweep and dtype == torch.bfloat16:
        row["sweep_ms"] = {}
        for bv, warps, chunk in SWEEP:
            try:
                cfg = dict(block_v=bv, num_warps=warps, chunk_size=chunk)
                row["sweep_ms"][f"bv{bv} w{warps} c{chunk}"] = median_ms(
                    lambda cfg=cfg: fused_delta_rule_prefill(*inputs, state, **kw, **cfg), warmup=1, reps=3)
            except Exception as exc:  # e.g. out of shared memory at this config
                row["sweep_ms"][f"bv{bv} w{warps} c{chunk}"] = f"{type(exc).__name__}: {str(exc)[:80]}"
    print(json.dumps(row), flush=True)
    return row


def compiled() -> list[dict]:
    """Registers, spills and shared memory of each compiled variant of the kernel."""
    from attnserve.ops.state import delta_prefill_triton as P

    out = []
    for kernel in (P._intra_kernel, P._state_kernel):
        for cache in kernel.device_caches.values():
            for k in cache[0].values():
                try:
                    k._init_handles()
                    out.append({"kernel": kernel.__name__, "regs": k.n_regs, "spills": k.n_spills,
                                "shared": k.metadata.shared, "warps": k.metadata.num_warps})
                except Exception as exc:  # the cache layout is Triton's own
                    out.append({"kernel": kernel.__name__, "error": f"{type(exc).__name__}: {exc}"})
    return out


def main() -> None:
    smoke, sweep, quick = "--smoke" in sys.argv, "--sweep" in sys.argv, "--quick" in sys.argv
    began = time.time()
    if smoke:
        MODELS.update(gdn=(1, 2, 24, 20, False), kda=(2, 2, 16, 16, True))
        checks = [check(m, b, n, torch.float32, "cpu") for m in MODELS for b, n in [(3, 17), (1, 40)]]
    else:
        dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32)
        checks = [check(m, b, n, dt, "cuda") for m in MODELS for dt in dtypes for b, n in BATCHES[:1 if quick else None]]
    ok = all(c["ok"] for c in checks)
    rows = [] if smoke or not ok else [bench(m, b, n, dt, sweep) for m in MODELS for dt in dtypes for b, n in BATCHES]
    kernels = [] if smoke else compiled()
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_delta_prefill.json").write_text(json.dumps(
            {"smoke": smoke, "checks": checks, "rows": rows, "models": MODELS, "kernels": kernels,
             "seconds": time.time() - began}, indent=1))
    print("\nchecks (max abs error, relative to the twin's largest value):")
    for c in checks:
        print(f"  {c['check']:<24} out {c['out_abs_err']:.1e} ({c['out_rel_err']:.1e})  "
              f"state {c['state_abs_err']:.1e} ({c['state_rel_err']:.1e})  untouched {c['untouched']}  "
              f"{'ok' if c['ok'] else 'FAIL'}")
    if rows:
        print(f"\n{'model':<6}{'dtype':<10}{'batch':<10}{'ms':>9}{'Mtok/s':>9}{'TFLOP/s':>9}{'twin ms':>10}"
              f"{'speedup':>9}{'fla ms':>9}")
        for r in rows:
            fla = f"{r['fla_ms']:>9.2f}" if "fla_ms" in r else f"{'-':>9}"
            print(f"{r['model']:<6}{r['dtype']:<10}{r['batch']:<10}{r['ms']:>9.2f}{r['tok_per_s'] / 1e6:>9.2f}"
                  f"{r['tflops']:>9.1f}{r['twin_ms']:>10.1f}{r['speedup']:>9.1f}{fla}")
            if "sweep_ms" in r:
                print("      sweep: " + "  ".join(f"{k}: {v:.2f}" if isinstance(v, float) else f"{k}: {v}"
                                            for k, v in r["sweep_ms"].items()))
    for k in kernels:
        print("compiled:", k)
    print(f"\n{time.time() - began:.0f} s")
    if not ok:
        sys.exit(2)


if __name__ == "__main__":
    main()
