"""The harness of ``nsa.attention`` variants: TORCH_NSA built with the variant, over a paged batch,
against a per-token reference written here from NSA's definition.

NSA has no PyTorch reference in ``attention/reference*.py`` (fla's code, ``tests/models/fla_nsa_oracle.py``,
runs in a subprocess and is slow), so ``reference_nsa`` computes each query token's three
branches with plain loops in float32 on the CPU, from ``/work/shared/specs/algorithms.md`` (NSA)
and TORCH_NSA's docstring (fla's form, which ``tests/models/test_parity_nsa.py`` checks against
fla). Where the two differ the backend's documented behaviour is followed: the spec's FLA row
forces only the current block (score 1.0, no initial block); the backend, after fla's kernels,
forces the first, the previous and the current block (score G), and keeps ``block_counts``
rounded up to a power of two.

The layer: 8 query heads over 2 KV heads of 16, NSA blocks of 4 tokens (unlike every page size),
``block_counts`` 3 (4 selected: the rounding matters, the three forced blocks alone would be 3), a
6-token window (not a multiple of the block). Selection drops blocks from position 20 on, the
window is shorter than most sequences. The spec's own window, ALiBi, sinks, soft-cap and fp8
cache do not apply to NSA (its window is the layer's).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from attnserve.arch.model_arch import NSADims
from attnserve.attention.backend import tensor_problem
from attnserve.attention.kernels import KernelVariant
from attnserve.attention.registry import load_backend
from tests.kernels.variants import (
    BatchSpec,
    Mode,
    Result,
    backend_kernels,
    make_common,
    paged_layout,
    relative_error,
)

NUM_HEADS, NUM_KV_HEADS, HEAD = 8, 2, 16
NSA_BLOCK, BLOCK_COUNTS, WINDOW = 4, 3, 6


def _softmax_attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, scale: float) -> torch.Tensor:
    """q [G, D] over keys/vals [n, D] (n >= 1) -> [G, D]."""
    return torch.softmax(q @ keys.T * scale, dim=-1) @ vals


def _selected_blocks(importance: list[float], cur: int, count: int) -> set[int]:
    """The forced blocks (first, previous, current) and the most important others, ``count`` in all."""
    forced = {c for c in (0, cur - 1, cur) if c >= 0}
    others = sorted((c for c in range(cur) if c not in forced), key=lambda c: -importance[c])
    return forced | set(others[: max(count - len(forced), 0)])


def reference_nsa(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, p: int, gates: torch.Tensor, *,
                  scale: float, block: int, block_counts: int, window: int | None) -> torch.Tensor:
    """One query token at position ``p``: q [H, D], its sequence's keys/vals [> p, Hkv, D] (key i at
    position i), gates [H, 3] (compression, selection, window) -> [H, D], all float32."""
    heads, kv_heads = q.shape[0], keys.shape[1]
    group = heads // kv_heads
    count = 1 << (block_counts - 1).bit_length()  # FLA's kernels: next power of two
    out = torch.zeros_like(q)
    n_cmp, cur = (p + 1) // block, p // block  # complete blocks; the query's own block
    for g in range(kv_heads):
        hs = slice(g * group, (g + 1) * group)
        qg, kg, vg = q[hs], keys[: p + 1, g], vals[: p + 1, g]
        # compression: mean-pooled complete blocks; 0 before the first is complete
        importance = [0.0] * cur
        if n_cmp:
            k_cmp = torch.stack([kg[c * block:(c + 1) * block].mean(0) for c in range(n_cmp)])
            v_cmp = torch.stack([vg[c * block:(c + 1) * block].mean(0) for c in range(n_cmp)])
            p_cmp = torch.softmax(qg @ k_cmp.T * scale, dim=-1)  # [G, n_cmp]
            out[hs] += gates[hs, 0:1] * (p_cmp @ v_cmp)
            importance = [p_cmp[:, c].sum().item() for c in range(cur)]  # summed over the group
        # selection: the chosen blocks' tokens up to p
        chosen = _selected_blocks(importance, cur, count)
        idx = [j for j in range(p + 1) if j // block in chosen]
        out[hs] += gates[hs, 1:2] * _softmax_attend(qg, kg[idx], vg[idx], scale)
        if window:
            lo = max(0, p - window + 1)
            out[hs] += gates[hs, 2:3] * _softmax_attend(qg, kg[lo:], vg[lo:], scale)
    return out


def _not_applicable(spec: BatchSpec) -> str | None:
    if spec.features:
        return f"NSA has none of {', '.join(sorted(spec.features))} (its window is the layer's)"
    if spec.fp8:
        return "TORCH_NSA reads a cache of the model dtype (no fp8)"
    return None


def _sequences(spec: BatchSpec, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each request's keys and values [seq_len, Hkv, D] at every position (cached and new)."""
    return [(torch.randn(s, NUM_KV_HEADS, HEAD, generator=gen), torch.randn(s, NUM_KV_HEADS, HEAD, generator=gen))
            for s in spec.seq_lens]


def _write(caches: tuple[torch.Tensor, torch.Tensor], table: torch.Tensor, r: int, pos: range, seq) -> None:
    """Put positions ``pos`` of request ``r``'s keys and values in its pages."""
    bs = caches[0].shape[1]
    for p in pos:
        blk = int(table[r, p // bs])
        for cache, x in zip(caches, seq):
            cache[blk, p % bs] = x[p]


def run(variant: KernelVariant, spec: BatchSpec, mode: Mode) -> Result | str:
    assert mode.numeric, f"{variant.key} is not Gluon: no compile run"
    why = _not_applicable(spec)
    if why:
        return why
    device, dtype = mode.device, torch.float32
    gen = spec.generator()
    num_blocks, table, slots = paged_layout(spec, gen)
    common = make_common(spec, table, slots, device)
    seqs = _sequences(spec, gen)
    # stale values everywhere else in the pages (gathered with a request's pages, then masked)
    caches = tuple(torch.randn(num_blocks, spec.block_size, NUM_KV_HEADS, HEAD, generator=gen) for _ in range(2))
    for r, c in enumerate(spec.context_lens):
        _write(caches, table, r, range(c), seqs[r])
    want_caches = tuple(x.clone() for x in caches)
    for r, (c, s) in enumerate(zip(spec.context_lens, spec.seq_lens)):
        _write(want_caches, table, r, range(c, s), seqs[r])
    t = common.num_tokens
    q = torch.randn(t, NUM_HEADS, HEAD, generator=gen)
    gates = torch.sigmoid(torch.randn(t, NUM_HEADS, 3, generator=gen))
    new = [torch.cat([x[c:] for (x, _), c in zip(seqs, spec.context_lens)]),
           torch.cat([v[c:] for (_, v), c in zip(seqs, spec.context_lens)])]
    dims = NSADims(block_size=NSA_BLOCK, block_counts=BLOCK_COUNTS, window=WINDOW)
    layer = SimpleNamespace(scale=HEAD**-0.5, nsa_block_size=dims.block_size, num_selected=dims.num_selected,
                            window=dims.window)
    kc, vc = (x.to(device, dtype) for x in caches)
    qd, kd, vd, gd = (x.to(device, dtype) for x in (q, *new, gates))
    reasons = variant.takes(tensor_problem(qd, kc, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                                           head_size=HEAD, head_size_v=HEAD))
    if reasons:
        return "; ".join(reasons)
    (backend_name,) = variant.launched_by
    backend = load_backend(backend_name)(spec.block_size, backend_kernels(variant, mode))
    out = backend.forward(layer, qd, kd, vd, (kc, vc), backend.build_metadata(common, 0), gates=gd)
    assert backend.kernels[variant.op] == variant.name
    ref = torch.empty_like(q)
    qsl = common.query_start_loc_cpu
    for r, (c, s) in enumerate(zip(spec.context_lens, spec.seq_lens)):
        for i, p in enumerate(range(c, s)):
            row = qsl[r] + i
            ref[row] = reference_nsa(q[row], *seqs[r], p, gates[row], scale=layer.scale, block=NSA_BLOCK,
                                     block_counts=BLOCK_COUNTS, window=WINDOW)
    err = max(relative_error(out, ref), relative_error(kc, want_caches[0]), relative_error(vc, want_caches[1]))
    return Result(err, 1e-4, f"(output {relative_error(out, ref):.3g})")
