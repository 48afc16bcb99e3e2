"""CPU decode attention alone: TORCH_SDPA's bucketed SDPA path against the C++ paged decode kernel,
and the kernel's instruction-set paths against each other.

One decode step of the mixed workload's attention shape (bfloat16, 8 query and 4 KV heads of
64, block 16): ``--batch`` sequences with context lengths uniform in ``--min-len..--max-len``
(seeded), random block tables over a cache with room for all of them, one cache per layer. A
step is the backend's ``build_metadata`` and ``--layers`` forwards (each writes its new K/V and
attends), with ``attention.decode`` = ``torch`` (bucketed SDPA) or ``cpu_ext`` (the kernel's
default path); a kernel row is ``--layers`` calls of the kernel alone on one path (``avx2``,
``avx512``, ``avx512_bf16``: each this CPU runs). Everything alternates, fastest of
``--repeats``, for each thread count; the outputs are compared with the bucketed path's once.

    python benchmarks/cpu_decode_attention.py [--batch 64] [--min-len 32] [--max-len 512] [--layers 8]
        [--threads 1 2] [--dtype bfloat16] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from attnserve.attention.backends.torch_sdpa import TorchSDPABackend
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.ops.cpu import paged_decode as cpu_paged_decode
from attnserve.platforms.cpu_info import cpu_info

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 16


def make_step(batch: int, lo: int, hi: int, dtype: torch.dtype, gen: torch.Generator):
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
    nblk = [-(-n // BLOCK) for n in lens]
    perm = (torch.randperm(sum(nblk), generator=gen) + 1).tolist()
    bt = torch.zeros(batch, max(nblk), dtype=torch.int32)
    slots, at = [], 0
    for i, n in enumerate(nblk):
        bt[i, :n] = torch.tensor(perm[at:at + n])
        at += n
        slots.append(int(bt[i, (lens[i] - 1) // BLOCK]) * BLOCK + (lens[i] - 1) % BLOCK)
    common = CommonAttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        positions=torch.tensor(lens) - 1, block_tables=[bt], slot_mappings=[torch.tensor(slots)],
        query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=lens, num_decodes=batch, max_query_len=1,
        max_seq_len=max(lens))
    caches = [(torch.randn(sum(nblk) + 1, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
               torch.randn(sum(nblk) + 1, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype))]
    qkv = [torch.randn(batch, h, HEAD_DIM, generator=gen).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS)]
    return common, caches, qkv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    common, caches, qkv = make_step(args.batch, args.min_len, args.max_len, dtype, gen)
    # one cache per layer, as a model has: the step reads args.layers times as much K/V
    caches = caches + [tuple(c.clone() for c in caches[0]) for _ in range(args.layers - 1)]
    layer = SimpleNamespace(scale=HEAD_DIM ** -0.5, window=None, alibi_slopes=None, sinks=None, softcap=None,
                            k_scale=1.0, v_scale=1.0)
    # the two kernel variants of attention.decode the TORCH_SDPA backend launches
    paths = {"bucketed SDPA": TorchSDPABackend(BLOCK, {"attention.decode": "torch"}),
             "paged kernel": TorchSDPABackend(BLOCK, {"attention.decode": "cpu_ext"})}

    def step(backend) -> torch.Tensor:
        meta = backend.build_metadata(common, 0)
        for i in range(args.layers):
            out = backend.forward(layer, *qkv, caches[i], meta)
        return out

    if not cpu_paged_decode.available():
        raise SystemExit("the CPU decode kernel is not available here")
    isas = cpu_paged_decode.supported_isas()
    q, out = qkv[0], torch.empty_like(qkv[0])
    bt, seq = common.block_tables[0], common.seq_lens

    def kernel(isa: str) -> torch.Tensor:
        for i in range(args.layers):
            cpu_paged_decode.paged_decode(q, *caches[i], bt, seq, layer.scale, out, isa=isa)
        return out

    runs = {name: (lambda b=backend: step(b)) for name, backend in paths.items()}
    runs |= {f"kernel {isa}": (lambda i=isa: kernel(i)) for isa in isas}
    outs = {name: run().float().clone() for name, run in runs.items()}
    err = max((outs["bucketed SDPA"] - o).abs().max().item() for o in outs.values())
    keys = sum(common.seq_lens_cpu)
    info = cpu_info()
    print(f"CPU: {info.describe()}; torch capability {torch.backends.cpu.get_cpu_capability()}; default path "
          f"{cpu_paged_decode.kernel_isa()}")
    print(f"batch {args.batch}, lengths {args.min_len}..{args.max_len} ({keys} keys), {args.layers} layers, "
          f"{args.dtype}, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, block {BLOCK}; max |difference| {err:.2e}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
        row = ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in best.items())
        print(f"threads {threads}: {row}")
        ratios = [f"paged kernel / bucketed SDPA {best['bucketed SDPA'] / best['paged kernel']:.2f}x"]
        ratios += [f"{isa} / avx2 {best['kernel avx2'] / best[f'kernel {isa}']:.2f}x" for isa in isas[1:]]
        print(f"threads {threads}: " + ", ".join(ratios))


if __name__ == "__main__":
    main()
