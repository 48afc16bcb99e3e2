"""The harness of the ``mla`` and ``indexer`` families: ``mla.absorbed``, ``mla.expanded``,
``mla.sparse`` and the DSA indexer's ``indexer.*`` operations, each run by the backend that
launches it (TRITON_MLA, TORCH_MLA, TRITON_MLA_SPARSE, TORCH_MLA_SPARSE) built with the variant,
over one step of a paged batch, against ``attention.reference_mla``.

One step is what the layer does: dense MLA ``forward`` (write the new latent rows, attend); sparse
MLA ``select_topk`` (write the new indexer keys, score, select) and then ``forward`` over the
selected rows. Everything the step produced is checked, the variant's own result first:

- the output against ``mla_decode_absorbed`` (``mla.absorbed``), ``mla_prefill_expanded``
  (``mla.expanded``), or ``sparse_mla_attention`` + ``apply_w_uv`` over the indices the backend
  selected (``mla.sparse``; for the indexer ops a secondary check);
- the selection against ``indexer_topk`` as a set: the same number of keys a row, no key twice,
  none the row cannot see, and the sorted reference scores of the selected keys equal to those
  of the reference's keys (so a swap of two keys of equal score passes, any other difference
  fails; the error is that score difference relative to the row's largest score). Order is not
  part of the contract (``topk_rows`` gives position order, ``torch.topk`` best first);
- the caches byte for byte against the reference's own writes of the step's rows over the caches
  as they were (both backends write in PyTorch, so the fp8 rows must be identical).

Shapes: ``SMALL`` (float32, kv_lora_rank 128 so the fp8 layout applies, rope 16, 4 heads; an
indexer of 8 heads x 32, top-8) wherever the variant takes it; else, compiled or on a GPU,
``DEEPSEEK`` (bf16, 512 + 64, 64 heads; an indexer of 64 heads x 128 over an fp8 indexer cache,
top-80: two key tiles of the sparse Gluon kernels, the second partial): the Gluon variants, and
the TMA variant on a GPU (bf16 at 33+ heads only). fp8 specs store fp8 latent rows (656 bytes at
rank 512 + rope 64, 164 at 128 + 16) and fp8 indexer keys (D + 4 bytes). Every fp8 write goes through PyTorch
(``write_latent_rows``, ``write_indexer_rows``, the queries' ``quantize_act_fp8``), never through
a Triton store, so the interpreter's fp32 -> fp8 rounding bug cannot reach these caches; the
kernels only read e4m3 (an exact conversion) and the references read the same bytes.

Caches are NaN-filled (0xFF bytes in fp8) past the live rows, block 0 (the null block, what the
PyTorch backends pad with) zero: a read of a row no key owns shows up as NaN.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from attnserve.attention.backends.triton_mla import ABSORBED_MAX_QUERY, absorb_query, latent_problem
from attnserve.attention.backends.triton_mla_sparse import indexer_problem
from attnserve.attention.kernels import KernelVariant
from attnserve.attention.reference_mla import (
    absorb_q,
    apply_w_uv,
    gather_indexer_keys,
    indexer_topk,
    mla_decode_absorbed,
    mla_prefill_expanded,
    sparse_mla_attention,
    write_indexer_keys,
    write_latent,
)
from attnserve.attention.registry import load_backend
from attnserve.kvcache.fp8 import hadamard, mla_fp8_row_bytes, quantize_act_fp8
from tests.kernels.variants import (
    BatchSpec,
    Mode,
    Result,
    backend_kernels,
    make_common,
    paged_layout,
    relative_error,
)

SPARSE_BACKENDS = frozenset({"TRITON_MLA_SPARSE", "TORCH_MLA_SPARSE"})
INF = float("inf")


@dataclass(frozen=True)
class Shape:
    """The layer's dimensions and dtype."""

    name: str
    dtype: torch.dtype
    heads: int
    nope: int  # qk_nope_head_dim
    rope: int  # qk_rope_head_dim
    v: int  # v_head_dim
    rank: int  # kv_lora_rank
    idx_heads: int
    idx_dim: int
    topk: int
    idx_fp8: bool  # an fp8 indexer cache whatever the spec (DeepSeek-V3.2's deployed cache)


SMALL = Shape("small", torch.float32, 4, 16, 16, 16, 128, 8, 32, 8, False)
DEEPSEEK = Shape("deepseek", torch.bfloat16, 64, 128, 64, 128, 512, 64, 128, 80, True)


def _tolerance(shape: Shape) -> float:
    return 2e-2 if shape.dtype == torch.bfloat16 else 1e-4


def _selection_tolerance(idx_cache: torch.Tensor) -> float:
    # fp8 keys: Hopper's e4m3 MMAs accumulate with about 14 bits (the streaming Triton kernel's
    # fp8_dot and the Gluon kernel), so two keys within ~1e-4 of each other may swap
    return 1e-3 if idx_cache.dtype == torch.uint8 else 1e-4


# --- does the launcher launch the operation for this spec ---------------------------------------


def _not_launched(backend: str, op: str, spec: BatchSpec, topk: int) -> str | None:
    """Why ``backend`` does not launch ``op`` on ``spec``'s rows (None: it does)."""
    nd = spec.num_decodes
    prefill_q = spec.query_lens[nd:]
    prefill_s = spec.seq_lens[nd:]
    if op == "mla.absorbed":
        if backend == "TRITON_MLA":  # decodes and prefills of at most ABSORBED_MAX_QUERY new tokens
            ok = nd > 0 or any(q <= ABSORBED_MAX_QUERY for q in prefill_q)
            return None if ok else f"no decode rows and no prefill of at most {ABSORBED_MAX_QUERY} tokens"
        return None if nd else "no decode rows"
    if op == "mla.expanded":
        # TRITON_MLA expands only prefills of more than ABSORBED_MAX_QUERY new tokens, which no
        # shared spec has (the longest is 23): there the variant runs under TORCH_MLA only
        if backend == "TRITON_MLA":
            ok = any(q > ABSORBED_MAX_QUERY for q in prefill_q)
            return None if ok else f"no prefill of more than {ABSORBED_MAX_QUERY} tokens"
        return None if prefill_q else "no prefill rows"
    if op == "mla.sparse":
        return None
    # the indexer: TRITON_MLA_SPARSE scores nothing for rows that see at most topk keys (it
    # selects them all), so a spec without a longer row would not run the variant
    decode = op in ("indexer.decode", "indexer.topk_decode")
    if decode and not nd:
        return "no decode rows"
    if not decode and not prefill_q:
        return "no prefill rows"
    lens = spec.seq_lens[:nd] if decode else prefill_s
    if max(lens) <= topk:
        return f"no {'decode' if decode else 'prefill'} row sees more than top-{topk} keys"
    return None


# --- inputs -----------------------------------------------------------------------------------


def _context_slots(spec: BatchSpec, table: torch.Tensor) -> torch.Tensor:
    """Slots of the positions cached before this step, over all requests."""
    bs, out = spec.block_size, []
    for i, (q, s) in enumerate(zip(spec.query_lens, spec.seq_lens)):
        pos = torch.arange(s - q)
        out.append(table[i].long()[pos // bs] * bs + pos % bs)
    return torch.cat(out)


def _empty_cache(num_blocks: int, spec: BatchSpec, width: int, dtype: torch.dtype) -> torch.Tensor:
    """NaN (0xFF bytes for fp8 rows) everywhere but the null block, which is zero."""
    fill = 255 if dtype == torch.uint8 else float("nan")
    cache = torch.full((num_blocks, spec.block_size, width), fill, dtype=dtype)
    cache[0] = 0
    return cache


def _build(spec: BatchSpec, shape: Shape, device: torch.device, sparse: bool) -> SimpleNamespace:
    """One step's inputs: the caches with every request's cached rows, the layer, the new
    tokens' queries and rows (and, sparse, the indexer's)."""
    gen = spec.generator()
    num_blocks, table, slots = paged_layout(spec, gen)
    ctx = _context_slots(spec, table)
    s = shape
    if spec.fp8:
        latent = _empty_cache(num_blocks, spec, mla_fp8_row_bytes(s.rank, s.rope), torch.uint8)
    else:
        latent = _empty_cache(num_blocks, spec, s.rank + s.rope, s.dtype)
    c_kv, k_pe = torch.randn(len(ctx), s.rank, generator=gen), torch.randn(len(ctx), s.rope, generator=gen)
    write_latent(latent, c_kv, k_pe, ctx)
    w_kv_b = torch.randn(s.heads, s.nope + s.v, s.rank, generator=gen) * s.rank**-0.5
    layer = SimpleNamespace(kv_lora_rank=s.rank, qk_rope_head_dim=s.rope, qk_nope_head_dim=s.nope,
                            scale=(s.nope + s.rope) ** -0.5, w_kv_b=w_kv_b.to(device, s.dtype))  # fmt: skip
    t = sum(spec.query_lens)
    x = SimpleNamespace(shape=shape, table=table.to(device), slots=slots.to(device), layer=layer,
                        common=make_common(spec, table, slots, device),
                        q=torch.randn(t, s.heads, s.nope + s.rope, generator=gen).to(device, s.dtype),
                        k=torch.randn(t, s.rank + s.rope, generator=gen).to(device, s.dtype))  # fmt: skip
    x.caches = {"latent": latent.to(device)}
    if sparse:
        fp8 = spec.fp8 or s.idx_fp8
        width, dtype = (s.idx_dim + 4, torch.uint8) if fp8 else (s.idx_dim, s.dtype)
        idx = _empty_cache(num_blocks, spec, width, dtype)
        write_indexer_keys(idx, torch.randn(len(ctx), s.idx_dim, generator=gen), ctx)
        x.caches["indexer"] = idx.to(device)
        x.q_idx = torch.randn(t, s.idx_heads, s.idx_dim, generator=gen).to(device, s.dtype)
        x.k_idx = torch.randn(t, s.idx_dim, generator=gen).to(device, s.dtype)
        x.w = torch.randn(t, s.idx_heads, generator=gen).to(device)
    x.before = {name: c.clone() for name, c in x.caches.items()}
    return x


def _problem(op: str, x: SimpleNamespace):
    """The kernel problem as the backend builds it from the same tensors."""
    if op.startswith("indexer."):
        return indexer_problem(x.q_idx, x.caches["indexer"])
    q_abs = absorb_query(x.q, x.layer.w_kv_b.to(x.q.dtype), x.shape.nope)
    return latent_problem(q_abs, x.caches["latent"], x.shape.rank)


def _inputs(variant: KernelVariant, spec: BatchSpec, mode: Mode, sparse: bool) -> SimpleNamespace | str:
    """The inputs of the first shape the variant takes (the DeepSeek one only where nothing is
    interpreted: a compile run or a GPU), or why it takes none."""
    shapes = [SMALL] if mode.numeric and mode.device.type == "cpu" else [SMALL, DEEPSEEK]
    refused = []
    for shape in shapes:
        x = _build(spec, shape, mode.device, sparse)
        why = variant.takes(_problem(variant.op, x))
        if not why:
            return x
        refused.append(f"{shape.name} shape: {'; '.join(why)}")
    return " | ".join(refused)


# --- references and checks --------------------------------------------------------------------


def _same_bytes(got: torch.Tensor, want: torch.Tensor) -> float:
    """0 when the caches hold the same bytes (NaN rows included), else inf."""
    return 0.0 if torch.equal(got.view(torch.uint8), want.view(torch.uint8)) else INF


def _ref_caches(x: SimpleNamespace) -> dict[str, torch.Tensor]:
    """The reference's own writes of the step's rows over the caches as they were."""
    ref = {name: c.clone() for name, c in x.before.items()}
    rank = x.shape.rank
    write_latent(ref["latent"], x.k[:, :rank], x.k[:, rank:], x.slots)
    if "indexer" in ref:
        write_indexer_keys(ref["indexer"], x.k_idx, x.slots)
    return ref


def _weights(x: SimpleNamespace) -> tuple[torch.Tensor, torch.Tensor]:
    w = x.layer.w_kv_b.float()
    return w[:, : x.shape.nope], w[:, x.shape.nope :]


def _index_scores(x: SimpleNamespace, cache: torch.Tensor) -> torch.Tensor:
    """[T, max seq_len] reference index scores, -inf where the token cannot see the key: exact
    over a float cache, DeepSeek's fp8 formula over fp8 rows (keys dequantised in the rotated
    space; their power-of-two scales commute with the ReLU)."""
    q, w, c = x.q_idx, x.w.float(), x.common
    heads, dim = q.shape[1], q.shape[2]
    if cache.dtype == torch.uint8:
        q, q_scale = quantize_act_fp8(hadamard(q))
        w, dot_scale = w * heads**-0.5 * q_scale * dim**-0.5, 1.0
    else:
        q, w, dot_scale = q.float(), w * heads**-0.5, dim**-0.5
    out = torch.full((q.shape[0], c.max_seq_len), -INF, device=q.device)
    qsl = c.query_start_loc_cpu
    for i, s in enumerate(c.seq_lens_cpu):
        a, b = qsl[i], qsl[i + 1]
        keys = gather_indexer_keys(cache, x.table[i], s)  # [S, D]
        dots = torch.relu(torch.einsum("thd,sd->ths", q[a:b], keys) * dot_scale)
        scores = torch.einsum("th,ths->ts", w[a:b], dots)
        visible = torch.arange(s, device=q.device)[None, :] <= c.positions[a:b, None]
        out[a:b, :s] = scores.masked_fill(~visible, -INF)
    return out


def _selection_error(got: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor) -> tuple[float, str]:
    """(largest score difference of the sorted selections relative to the row's largest score,
    inf for a wrong count, a key twice or a key the row cannot see; the recall)."""
    got, ref, scores = got.cpu(), ref.cpu(), scores.cpu()
    worst, hits, total = 0.0, 0, 0
    for t in range(got.shape[0]):
        a, b = got[t][got[t] >= 0].long(), ref[t][ref[t] >= 0].long()
        if len(a) != len(b) or len(set(a.tolist())) != len(a) or (len(a) and a.max() >= scores.shape[1]):
            return INF, f"row {t} selects {sorted(a.tolist())}, the reference {sorted(b.tolist())}"
        if not len(b):
            continue
        va, vb = scores[t, a], scores[t, b]
        if not torch.isfinite(va).all():
            return INF, f"row {t} selects a key it cannot see: {sorted(a.tolist())}"
        top = scores[t][torch.isfinite(scores[t])].abs().max().clamp_min(1e-6)
        worst = max(worst, ((va.sort().values - vb.sort().values).abs().max() / top).item())
        hits += len(set(a.tolist()) & set(b.tolist()))
        total += len(b)
    return worst, f"recall {hits}/{total}"


def _verdict(primary: str, checks: dict[str, tuple[float, float]], note: str = "") -> Result:
    """The primary check's error and tolerance; inf when any other check fails its own."""
    err, tol = checks[primary]
    failed = [f"{n} {e:.3g} > {t:g}" for n, (e, t) in checks.items() if n != primary and not e <= t]
    detail = ", ".join(f"{n} {e:.2g}" for n, (e, _) in checks.items()) + (f" ({note})" if note else "")
    if failed:
        return Result(INF, tol, "failed: " + "; ".join(failed) + " | " + detail)
    return Result(err, tol, detail)


# --- one step under one launcher --------------------------------------------------------------


def _dense(variant: KernelVariant, backend, x: SimpleNamespace, mode: Mode) -> Result:
    md = backend.build_metadata(x.common, 0)
    out = backend.forward(x.layer, x.q, x.k, None, x.caches, md)
    if not mode.numeric:
        return Result(0.0, 0.0, "compiled")
    ref_caches = _ref_caches(x)
    w_uk, w_uv = _weights(x)
    twin = mla_prefill_expanded if variant.op == "mla.expanded" else mla_decode_absorbed
    c, nope = x.common, x.shape.nope
    ref = twin(x.q[..., :nope].float(), x.q[..., nope:].float(), ref_caches["latent"], x.table,
               c.query_start_loc, c.seq_lens, w_uk=w_uk, w_uv=w_uv, scale=x.layer.scale)  # fmt: skip
    return _verdict("output", {"output": (relative_error(out, ref), _tolerance(x.shape)),
                               "latent cache": (_same_bytes(x.caches["latent"], ref_caches["latent"]), 0.0)})


def _sparse(variant: KernelVariant, backend, x: SimpleNamespace, mode: Mode) -> Result:
    md = backend.build_metadata(x.common, 0)
    topk = x.shape.topk
    idx = backend.select_topk(x.q_idx, x.k_idx, x.w, x.caches, md, topk=topk)
    out = backend.forward(x.layer, x.q, x.k, None, x.caches, md, topk_indices=idx)
    if not mode.numeric:
        return Result(0.0, 0.0, "compiled")
    ref_caches = _ref_caches(x)
    c, nope, icache = x.common, x.shape.nope, ref_caches["indexer"]
    ref_idx = indexer_topk(x.q_idx, x.w, icache, x.table, c.query_start_loc, c.seq_lens, c.positions,
                           topk=topk, fp8=icache.dtype == torch.uint8)  # fmt: skip
    sel_err, recall = _selection_error(idx, ref_idx, _index_scores(x, icache))
    w_uk, w_uv = _weights(x)
    q_abs = absorb_q(x.q[..., :nope].float(), x.q[..., nope:].float(), w_uk)
    u = sparse_mla_attention(q_abs, ref_caches["latent"], x.table, idx, kv_lora_rank=x.shape.rank,
                             scale=x.layer.scale, query_start_loc=c.query_start_loc)  # fmt: skip
    checks = {"output": (relative_error(out, apply_w_uv(u, w_uv)), _tolerance(x.shape)),
              "selection": (sel_err, _selection_tolerance(icache)),
              "latent cache": (_same_bytes(x.caches["latent"], ref_caches["latent"]), 0.0),
              "indexer cache": (_same_bytes(x.caches["indexer"], icache), 0.0)}  # fmt: skip
    return _verdict("output" if variant.op == "mla.sparse" else "selection", checks, recall)


def _run_under(variant: KernelVariant, backend_name: str, spec: BatchSpec, mode: Mode) -> Result | str:
    sparse = backend_name in SPARSE_BACKENDS
    x = _inputs(variant, spec, mode, sparse)
    if isinstance(x, str):
        return x
    why = _not_launched(backend_name, variant.op, spec, x.shape.topk)
    if why:
        return why
    # backend_kernels takes a variant of one launcher; mla.expanded and indexer.topk_prefill have two
    one = dataclasses.replace(variant, launched_by=frozenset({backend_name}))
    backend = load_backend(backend_name)(spec.block_size, backend_kernels(one, mode))
    result = (_sparse if sparse else _dense)(variant, backend, x, mode)
    assert backend.kernels[variant.op] == variant.name
    return dataclasses.replace(result, detail=f"{backend_name}, {x.shape.name} shape: {result.detail}")


def run(variant: KernelVariant, spec: BatchSpec, mode: Mode) -> Result | str:
    if spec.features:
        return f"MLA has no {', '.join(sorted(spec.features))}"
    results, skipped = [], []
    for backend_name in sorted(variant.launched_by):
        result = _run_under(variant, backend_name, spec, mode)
        if isinstance(result, str):
            skipped.append(f"{backend_name}: {result}")
        else:
            results.append(result)
    if not results:
        return "; ".join(skipped)
    # several launchers (mla.expanded, indexer.topk_prefill): the worst of them, every one's detail
    worst = max(results, key=lambda r: r.error / r.tolerance if r.tolerance else r.error)
    return dataclasses.replace(worst, detail=" | ".join(r.detail for r in results))
