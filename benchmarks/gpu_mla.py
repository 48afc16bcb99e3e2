"""H200 benchmark of the MLA kernels: dense decode, sparse MLA and the DSA indexer.

Dense and sparse rows time the kernel the MLA backends launch for the shape (the Gluon kernels
on Hopper where they take it, ``kernel`` "gluon"; else Triton's); the sparse prefill also times
the Triton kernel on the same inputs (``triton_us``); the sweep times Triton's configs.

1. Checks, bf16 against the float32 PyTorch twins (``attention/reference_mla.py``), bound
   ``max|out - ref| / max|ref| <= 2e-2``: dense decode (bf16 / fp8 rows, automatic and forced
   splits, 16 and 128 heads), sparse MLA over decode and prefill rows (-1 slots, a row of all
   -1), indexer logits (exact bf16, fp8 rows; a mixed batch through the tiled kernel, its decode
   rows alone through the streaming one) and its top-k against ``indexer_topk`` (recall).
2. Dense absorbed decode (576-wide bf16 rows, page 64), 16 and 128 heads x batch 1..128 x
   context 4K..64K: GB/s (latent rows, q, u), TFLOP/s (2 B H S 1088); peer: TORCH_MLA's
   absorbed form, SDPA over latent rows already gathered contiguous. Every timed row is also
   given as % of the ceilings measured at the start of the run (``ceilings.py``: device copy
   bandwidth, bf16 ``torch.mm`` rate; ``pct_bw_measured``, ``pct_flops_measured``) and of the
   nominal 4.25 TB/s and 790 TFLOP/s (``pct_bw``, ``pct_flops``).
3. Sparse MLA (top-k 2048, 128 heads): decode of 32 rows at 8K..128K (bf16 and fp8 rows)
   against dense decode of the same cache; prefill of 4096 rows (TFLOP/s).
4. Indexer (64 heads x 128), batch 1 and 32 at 8K..128K, fp8 and bf16 keys: the logits kernel
   (% of bandwidth: key rows in, logits out) and ``torch.topk``'s share; a causal prefill.
5. Unless ``--no-sweep``: a few launch configs per kernel at one shape each, with the best
   (the indexer's tiled and streaming decode kernels side by side, fp8 and bf16 keys).

Timing: ``benchmarks/gpu_attention.py``'s ``time_per_call`` (one CUDA graph over rotated input
sets, ``do_bench`` median). Shapes are skipped when they do not fit or the budget (270 s) has
run out. ``--smoke`` runs every path at toy sizes on CPU under Triton's interpreter. The
printed tables are ``gpu_mla_report.py``'s.

    python benchmarks/gpu_mla.py [--budget-s 270] [--no-peers] [--no-sweep] [--smoke]

Prints a compact table last; writes ``$OUT/gpu_mla.json`` when ``OUT`` is set.
Not a test: correctness on CPU is ``tests/kernels/test_triton_mla.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from ceilings import describe, fractions, measure_ceilings  # noqa: E402
from gpu_mla_report import print_tables  # noqa: E402

from attnserve.attention import kernels  # noqa: E402
from attnserve.attention.backends.torch_mla_sparse import index_scores  # noqa: E402
from attnserve.attention.backends.triton_mla import latent_problem  # noqa: E402
from attnserve.attention.backends.triton_mla_sparse import indexer_problem  # noqa: E402
from attnserve.attention.reference_mla import (  # noqa: E402
    absorb_q,
    apply_w_uv,
    indexer_topk,
    mla_decode_absorbed,
    sparse_mla_attention,
    write_indexer_keys,
    write_latent,
)
from attnserve.kvcache.fp8 import (  # noqa: E402
    hadamard,
    indexer_fp8_views,
    mla_fp8_row_bytes,
    mla_fp8_views,
    quantize_act_fp8,
)
from attnserve.ops.mla.decode_triton import mla_decode  # noqa: E402
from attnserve.ops.mla.decode_triton_tma import mla_decode_tma  # noqa: E402
from attnserve.ops.mla.latent import MLAConfig  # noqa: E402
from attnserve.ops.mla.sparse_triton import (  # noqa: E402
    IndexerConfig,
    indexer_logits,
    lightning_indexer_topk,
    sparse_mla,
    topk_from_logits,
)

NOPE, SCALE, REL_TOL = 128, 0.1352338, 2e-2


@dataclass(frozen=True)
class Sizes:
    rank: int = 512
    rope: int = 64
    page: int = 64
    topk: int = 2048
    idx_heads: int = 64
    idx_dim: int = 128
    few_heads: int = 16
    many_heads: int = 128
    dense_batches: tuple = (1, 8, 32, 128)
    dense_ctx: tuple = (4096, 16384, 65536)
    sparse_batch: int = 32
    long_ctx: tuple = (8192, 32768, 65536, 131072)  # sparse decode and indexer
    prefill_rows: int = 4096
    prefill_ctx: int = 8192
    idx_batches: tuple = (1, 32)
    check_lens: tuple = (1, 100, 1000, 4097)
    sweep_shape: tuple = (64, 8192)  # dense batch, context (sparse x4, indexer x8)


FULL = Sizes()
SMOKE = Sizes(128, 64, 16, 32, 16, 32, 16, 16, (1, 2), (100,), 2, (80,), 8, 80, (1, 2),
              (1, 17, 40, 60), (2, 20))  # fmt: skip
S, DEV = FULL, "cuda"


# ----------------------------------------------------------------------------- inputs


def block_table(batch: int, ctx: int) -> tuple[torch.Tensor, int]:
    """[B, ceil(ctx / page)] int32 of shuffled blocks (block 0 null), and the block count."""
    nb = -(-ctx // S.page)
    perm = torch.randperm(batch * nb, device=DEV, dtype=torch.int32) + 1
    return perm.view(batch, nb), batch * nb + 1


def fp8_bytes(shape) -> torch.Tensor:
    """Random e4m3 bit patterns without the two NaN codes (0x7F, 0xFF)."""
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=DEV) & 0xFE


def latent_cache(num_blocks: int, fp8: bool) -> torch.Tensor:
    if not fp8:
        return torch.randn(num_blocks, S.page, S.rank + S.rope, device=DEV, dtype=torch.bfloat16)
    rows = torch.empty(num_blocks, S.page, mla_fp8_row_bytes(S.rank, S.rope), dtype=torch.uint8,
                       device=DEV)  # fmt: skip
    values, scales, rope = mla_fp8_views(rows, S.rank, S.rope)
    values.view(torch.uint8).copy_(fp8_bytes(values.shape))
    scales.fill_(2.0**-6)
    rope.copy_(torch.randn(rope.shape, device=DEV, dtype=torch.bfloat16))
    return rows


def index_cache(num_blocks: int, fp8: bool) -> torch.Tensor:
    if not fp8:
        return torch.randn(num_blocks, S.page, S.idx_dim, device=DEV, dtype=torch.bfloat16)
    rows = torch.empty(num_blocks, S.page, S.idx_dim + 4, dtype=torch.uint8, device=DEV)
    values, scale = indexer_fp8_views(rows)
    values.view(torch.uint8).copy_(fp8_bytes(values.shape))
    scale.fill_(2.0**-6)
    return rows


def q_abs(rows: int, heads: int) -> torch.Tensor:
    return torch.randn(rows, heads, S.rank + S.rope, device=DEV, dtype=torch.bfloat16)


def random_topk(rows: int, ctx: int) -> torch.Tensor:
    """[rows, topk] int32 distinct random positions below ctx."""
    return torch.rand(rows, ctx, device=DEV).topk(S.topk, dim=-1).indices.to(torch.int32)


# ----------------------------------------------------------------------------- checks


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return float("nan")
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def filled_cache(lens, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-filled ``kind`` ("latent"/"indexer", "_fp8" for the byte rows) cache holding random
    rows of requests of the given lengths in shuffled blocks, and its block table."""
    fp8 = kind.endswith("fp8")
    if kind.startswith("latent"):
        width = mla_fp8_row_bytes(S.rank, S.rope) if fp8 else S.rank + S.rope
    else:
        width = S.idx_dim + 4 if fp8 else S.idx_dim
    nbs = [-(-n // S.page) for n in lens]
    table = torch.zeros(len(lens), max(nbs), dtype=torch.int32, device=DEV)
    perm = (torch.randperm(sum(nbs), device=DEV) + 1).tolist()
    dtype, fill = (torch.uint8, 255) if fp8 else (torch.bfloat16, float("nan"))
    cache = torch.full((sum(nbs) + 1, S.page, width), fill, dtype=dtype, device=DEV)
    for i, (n, nb) in enumerate(zip(lens, nbs)):
        table[i, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
        pos = torch.arange(n, device=DEV)
        slots = table[i].long()[pos // S.page] * S.page + pos % S.page
        if kind.startswith("latent"):
            c_kv, k_pe = torch.randn(n, S.rank, device=DEV), torch.randn(n, S.rope, device=DEV)
            write_latent(cache, c_kv, k_pe, slots)
        else:
            write_indexer_keys(cache, torch.randn(n, S.idx_dim, device=DEV), slots)
    return cache, table


def check_dense(heads: int, fp8: bool, splits: int | None) -> dict:
    lens = S.check_lens
    cache, table = filled_cache(lens, "latent_fp8" if fp8 else "latent")
    b, lens_t = len(lens), torch.tensor(lens, dtype=torch.int32, device=DEV)
    q_nope, q_pe = (torch.randn(b, heads, d, device=DEV) for d in (NOPE, S.rope))
    w_uk = torch.randn(heads, NOPE, S.rank, device=DEV) * S.rank**-0.5
    w_uv = torch.randn(heads, 128, S.rank, device=DEV)
    qsl = torch.arange(b + 1, device=DEV)
    ref = mla_decode_absorbed(q_nope, q_pe, cache, table, qsl, lens_t, w_uk=w_uk, w_uv=w_uv,
                              scale=SCALE)  # fmt: skip
    q = absorb_q(q_nope, q_pe, w_uk).to(torch.bfloat16)
    u = engine_kernel(q, cache, False)[1](q, cache, table, lens_t, kv_lora_rank=S.rank, scale=SCALE,
                                         max_seq_len=max(lens), num_splits=splits)  # fmt: skip
    name = f"dense_h{heads}{'_fp8' if fp8 else ''}{f'_split{splits}' if splits else ''}"
    return {"case": name, "rel_err": rel_err(apply_w_uv(u, w_uv), ref)}


def check_sparse(fp8: bool) -> dict:
    """Two decode rows (the first all -1) and prefill rows of a third request."""
    lens, n_pre = S.check_lens[1:], S.prefill_rows // 64 or 4
    cache, table = filled_cache(lens, "latent_fp8" if fp8 else "latent")
    reqs = torch.tensor([0, 1] + [2] * n_pre, dtype=torch.int32, device=DEV)
    pos = torch.tensor([lens[0] - 1, lens[1] - 1, *range(lens[2] - n_pre, lens[2])], device=DEV)
    causal = torch.arange(max(lens), device=DEV)[None, :] > pos[:, None]
    best = torch.rand(len(reqs), max(lens), device=DEV).masked_fill(causal, -1.0)
    best = best.topk(min(S.topk, max(lens)), dim=-1)
    idx = torch.where(best.values < 0, -1, best.indices).to(torch.int32)
    idx[0], idx[1, ::3] = -1, -1
    q = q_abs(len(reqs), S.many_heads)
    qsl = torch.tensor([0, 1, 2, 2 + n_pre], device=DEV)
    ref = sparse_mla_attention(q, cache, table, idx, kv_lora_rank=S.rank, scale=SCALE,
                               query_start_loc=qsl)  # fmt: skip
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    u = engine_kernel(q, cache, True)[1](q, cache, table, lens_t, idx, reqs, kv_lora_rank=S.rank, scale=SCALE)
    err = rel_err(u, ref) if (u[0] == 0).all() else float("inf")
    return {"case": f"sparse{'_fp8' if fp8 else ''}", "rel_err": err}


def check_indexer(fp8: bool) -> list[dict]:
    """Logits against TORCH_MLA_SPARSE's scores, top-k against ``indexer_topk`` (recall)."""
    lens, query_lens = S.check_lens[1:], (1, 1, S.prefill_rows // 64 or 4)
    cache, table = filled_cache(lens, "indexer_fp8" if fp8 else "indexer")
    positions = torch.cat([torch.arange(n - q, n, device=DEV) for q, n in zip(query_lens, lens)])
    t = len(positions)
    q = torch.randn(t, S.idx_heads, S.idx_dim, device=DEV).to(torch.bfloat16)
    w = torch.randn(t, S.idx_heads, device=DEV)
    qsl = torch.tensor([0, 1, 2, t], dtype=torch.int32, device=DEV)
    args = (cache, table, qsl, torch.tensor(lens, dtype=torch.int32, device=DEV), positions)
    bounds = dict(max_query_len=max(query_lens), max_seq_len=max(lens))
    d = indexer_query(q, w, fp8)
    got = indexer_logits(d["q"], d["w"], *args, width=max(lens), dot_scale=d["dot_scale"],
                         max_query_len=max(query_lens))  # fmt: skip
    want = torch.full_like(got, float("-inf"))
    for i, (a, e) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist())):
        pos = torch.arange(lens[i], device=DEV)
        rows = cache[table[i].long()[pos // S.page], pos % S.page]
        scores = index_scores(q[None, a:e], w[None, a:e], rows[None])[0]
        want[a:e, : lens[i]] = scores.masked_fill(pos > positions[a:e, None], float("-inf"))
    # the two decode rows alone: the streaming kernel (the mixed batch ran the tiled one)
    dec_args = (cache, table[:2], qsl[:3], args[3][:2], positions[:2])
    dec = indexer_logits(d["q"][:2], d["w"][:2], *dec_args, width=max(lens), max_query_len=1,
                         dot_scale=d["dot_scale"])  # fmt: skip
    tag = "_fp8" if fp8 else ""
    out = [{"case": f"indexer_logits{tag}", "rel_err": _logits_err(got, want)},
           {"case": f"indexer_decode{tag}", "rel_err": _logits_err(dec, want[:2])}]  # fmt: skip
    sel = lightning_indexer_topk(q, w, *args, topk=S.topk, **bounds).tolist()
    ref = indexer_topk(q, w, *args, topk=S.topk, fp8=fp8).tolist()
    hits = sum(len({x for x in b if x >= 0} & set(a)) for a, b in zip(sel, ref))
    total = sum(sum(x >= 0 for x in b) for b in ref)
    return [*out, {"case": f"indexer_topk{tag}", "rel_err": 1.0 - hits / total, "bound": 1e-2}]


def _logits_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """rel_err over the visible keys; inf when the -inf pattern differs."""
    seen = ~torch.isneginf(want)
    return rel_err(got[seen], want[seen]) if torch.equal(seen, ~got.isneginf()) else float("inf")


def run_checks() -> list[dict]:
    heads = (S.few_heads, S.many_heads)
    rows = [check_dense(h, f, sp) for h in heads for f in (False, True) for sp in (None, 4)]
    rows += [check_sparse(False), check_sparse(True), *check_indexer(False), *check_indexer(True)]
    for r in rows:
        r["ok"] = r["rel_err"] <= r.get("bound", REL_TOL)
    return rows


# ----------------------------------------------------------------------------- timing


def timer(calls, rep_ms: int = 100) -> tuple[float, bool]:
    """Seconds per call: CUDA graph over the rotated calls on the GPU; one plain pass in smoke."""
    if DEV == "cuda":
        from benchmarks.gpu_attention import time_per_call

        return time_per_call(calls, rep_ms)
    start = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - start) / len(calls), False


def sets_for(set_bytes: int) -> int:
    """Input sets to rotate (enough to overflow L2; 0 when one does not fit)."""
    if DEV != "cuda":
        return 1
    from benchmarks.gpu_attention import num_sets

    return num_sets(set_bytes)


def fits(cache_rows: int) -> int:
    """How many latent caches of ``cache_rows`` bf16 rows fit in half the free memory."""
    if DEV != "cuda":
        return 1
    return int(0.5 * torch.cuda.mem_get_info()[0] // (cache_rows * 2 * (S.rank + S.rope)))


def rates(row: dict, seconds: float, moved: float, flops: float, graph: bool) -> dict:
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return {**row, "us": seconds * 1e6, "graph": graph, "gbps": moved / seconds / 1e9,
            "tflops": flops / seconds / 1e12}  # fmt: skip


def latent_bytes(fp8: bool) -> int:
    return mla_fp8_row_bytes(S.rank, S.rope) if fp8 else 2 * (S.rank + S.rope)


def mla_flops(rows: int, heads: int, keys: int) -> float:
    return 2.0 * rows * heads * keys * (S.rank + S.rope + S.rank)


def dense_inputs(batch: int, heads: int, ctx: int, fp8: bool, sparse: bool = False) -> dict:
    table, num_blocks = block_table(batch, ctx)
    d = dict(q=q_abs(batch, heads), cache=latent_cache(num_blocks, fp8), table=table,
             lens=torch.full((batch,), ctx, dtype=torch.int32, device=DEV))  # fmt: skip
    if sparse:
        d["idx"] = random_topk(batch, ctx)
        d["req"] = torch.arange(batch, dtype=torch.int32, device=DEV)
    return d


def time_latent(kind: str, batch: int, heads: int, ctx: int, fp8: bool, config=None) -> dict:
    """Dense decode (``kind`` "dense") or sparse decode ("sparse_decode") of ``batch`` rows."""
    sparse = kind == "sparse_decode"
    keys = S.topk if sparse else ctx
    moved = batch * keys * latent_bytes(fp8) + batch * heads * (2 * S.rank + S.rope) * 2
    row = {"kind": kind, "heads": heads, "batch": batch, "ctx": ctx, "fp8": fp8}
    # rotate enough sets that the rows read (not the whole cache, for sparse) overflow L2
    sets = sets_for(moved) if sets_for(batch * ctx * latent_bytes(fp8)) else 0
    sets = min(sets, fits(batch * ctx))
    if sets == 0:
        return {**row, "skipped": "does not fit in memory"}
    data = [dense_inputs(batch, heads, ctx, fp8, sparse) for _ in range(sets)]
    opts = dict(kv_lora_rank=S.rank, scale=SCALE)
    kernel, fn = engine_kernel(data[0]["q"], data[0]["cache"], sparse, config)
    if kernel == "triton":
        opts["config"] = config
    if sparse:
        calls = [lambda d=d: fn(d["q"], d["cache"], d["table"], d["lens"], d["idx"], d["req"],
                                **opts) for d in data]  # fmt: skip
    else:
        calls = [lambda d=d: fn(d["q"], d["cache"], d["table"], d["lens"], max_seq_len=ctx,
                                **opts) for d in data]  # fmt: skip
    t, graph = timer(calls)
    del data, calls
    return rates({**row, "kernel": kernel}, t, moved, mla_flops(batch, heads, keys), graph)


def engine_kernel(q: torch.Tensor, cache: torch.Tensor, sparse: bool, config=None):
    """(the variant's name, its launch) the MLA backends run for these inputs: the kernel table's
    pick (``attention/kernels.py``) for ``mla.sparse`` / ``mla.absorbed``; a sweep's explicit
    ``config`` times the Triton kernel (dense: by TMA tiles where ``config`` is a ``TMA`` entry)."""
    if config is not None:
        if sparse:
            return "triton", sparse_mla
        return ("triton_tma", mla_decode_tma) if isinstance(config, TMA) else ("triton_gather", mla_decode)
    op, backend = ("mla.sparse", "TRITON_MLA_SPARSE") if sparse else ("mla.absorbed", "TRITON_MLA")
    variant = kernels.pick(op, latent_problem(q, cache, S.rank), backend).get()
    return variant.name, variant.load()


def time_dense_peer(batch: int, heads: int, ctx: int) -> dict:
    """TORCH_MLA's absorbed attention: SDPA over contiguous latent rows, heads as query rows."""
    sets = sets_for(batch * ctx * (S.rank + S.rope) * 2 * 3)  # keys, and room for scratch
    if sets == 0:
        return {"peer_error": "does not fit in memory"}
    shape = (batch, 1, ctx, S.rank + S.rope)
    inputs = [(q_abs(batch, heads).view(batch, 1, heads, -1),
               torch.randn(shape, device=DEV, dtype=torch.bfloat16)) for _ in range(sets)]  # fmt: skip

    def sdpa(q, keys):
        return F.scaled_dot_product_attention(q, keys, keys[..., : S.rank], scale=SCALE)

    try:
        return {"peer_us": timer([lambda x=x: sdpa(*x) for x in inputs])[0] * 1e6}
    except Exception as exc:  # noqa: BLE001 (report it and go on)
        return {"peer_error": f"{type(exc).__name__}: {exc}"[:200]}


def time_sparse_prefill() -> dict:
    rows, ctx, heads = S.prefill_rows, S.prefill_ctx, S.many_heads
    table, num_blocks = block_table(1, ctx)
    cache, q, idx = latent_cache(num_blocks, False), q_abs(rows, heads), random_topk(rows, ctx)
    req = torch.zeros(rows, dtype=torch.int32, device=DEV)
    lens = torch.tensor([ctx], dtype=torch.int32, device=DEV)
    out = torch.empty(rows, heads, S.rank, device=DEV, dtype=torch.bfloat16)

    kernel, fn = engine_kernel(q, cache, True)

    def call(fn=fn):
        return fn(q, cache, table, lens, idx, req, kv_lora_rank=S.rank, scale=SCALE, out=out)

    t, graph = timer([call], rep_ms=200)
    row = {"kind": "sparse_prefill", "rows": rows, "ctx": ctx, "heads": heads, "kernel": kernel}
    if kernel != "triton":  # the kernel it replaced, same inputs
        row["triton_us"] = timer([lambda: call(sparse_mla)], rep_ms=200)[0] * 1e6
    return rates(row, t, rows * S.topk * latent_bytes(False), mla_flops(rows, heads, S.topk), graph)


def indexer_query(q: torch.Tensor, w: torch.Tensor, fp8: bool) -> dict:
    """Kernel inputs as ``lightning_indexer_topk`` prepares them (fp8: rotated, quantised)."""
    if not fp8:
        return dict(q=q, w=w * S.idx_heads**-0.5, dot_scale=S.idx_dim**-0.5)
    q8, q_scale = quantize_act_fp8(hadamard(q))
    w = w * S.idx_heads**-0.5 * q_scale * S.idx_dim**-0.5
    return dict(q=q8.to(torch.float8_e4m3fn), w=w, dot_scale=1.0)


def indexer_inputs(batch: int, ctx: int, fp8: bool, rows_per_req: int = 1) -> dict:
    table, num_blocks = block_table(batch, ctx)
    t = batch * rows_per_req
    q = torch.randn(t, S.idx_heads, S.idx_dim, device=DEV, dtype=torch.bfloat16)
    d = indexer_query(q, torch.randn(t, S.idx_heads, device=DEV), fp8)
    d["args"] = (index_cache(num_blocks, fp8), table,
                 torch.arange(0, t + 1, rows_per_req, dtype=torch.int32, device=DEV),
                 torch.full((batch,), ctx, dtype=torch.int32, device=DEV),
                 ctx - rows_per_req + torch.arange(t, device=DEV) % rows_per_req)  # fmt: skip
    return d


def run_logits(d: dict, width: int, max_q: int, config=None) -> torch.Tensor:
    """The index scores by the kernel TRITON_MLA_SPARSE launches (the kernel table's pick for
    decode rows: the Gluon kernel over fp8 keys on Hopper), or Triton's with ``config``."""
    fn, kw = indexer_logits, {"config": config}
    if config is None and max_q == 1:
        cache = d["args"][0]
        problem = indexer_problem(torch.empty(0, S.idx_heads, S.idx_dim, device=DEV, dtype=torch.bfloat16), cache)
        fn, kw = kernels.pick("indexer.decode", problem, "TRITON_MLA_SPARSE").get().load(), {}
    return fn(d["q"], d["w"], *d["args"], width=width, max_query_len=max_q, dot_scale=d["dot_scale"],
              **kw)  # fmt: skip


def time_indexer(batch: int, ctx: int, fp8: bool, config=None) -> dict:
    moved = batch * ctx * ((S.idx_dim + 4 if fp8 else 2 * S.idx_dim) + 4)  # keys in, logits out
    row = {"kind": "indexer", "batch": batch, "ctx": ctx, "fp8": fp8}
    sets = sets_for(moved)
    if sets == 0:
        return {**row, "skipped": "does not fit in memory"}
    data = [indexer_inputs(batch, ctx, fp8) for _ in range(sets)]
    t_logits, graph = timer([lambda d=d: run_logits(d, ctx, 1, config) for d in data])
    logits = [run_logits(d, ctx, 1) for d in data]
    t_topk, _ = timer([lambda x=x: topk_from_logits(x, S.topk) for x in logits])
    del data, logits
    row = rates(row, t_logits, moved, 2.0 * batch * ctx * S.idx_heads * S.idx_dim, graph)
    return {**row, "topk_us": t_topk * 1e6, "topk_share": t_topk / (t_logits + t_topk)}


def time_indexer_prefill() -> dict:
    rows, ctx = S.prefill_rows, S.prefill_ctx
    d = indexer_inputs(1, ctx, True, rows_per_req=rows)
    t, graph = timer([lambda: run_logits(d, ctx, rows)], rep_ms=200)
    flops = 2.0 * rows * S.idx_heads * S.idx_dim * (ctx - rows / 2)  # causal
    row = {"kind": "indexer_prefill", "rows": rows, "ctx": ctx, "fp8": True}
    return rates(row, t, rows * ctx * 4 + ctx * (S.idx_dim + 4), flops, graph)


# ----------------------------------------------------------------------------- sweep

class TMA(MLAConfig):
    """A sweep entry timed by whole-page TMA tiles (dense rows in 64-row pages; sparse rows
    ignore it)."""

    __slots__ = ()


# the last two of each: whole-page TMA tiles
SWEEP_MANY_HEADS = [MLAConfig(*c) for c in ((16, 64, 4, 2), (32, 64, 8, 2), (64, 32, 8, 2),
                    (64, 64, 8, 1), (64, 64, 8, 2), (64, 64, 4, 2), (64, 16, 8, 3))] + [
                    TMA(64, 64, 8, 2), TMA(64, 32, 8, 2)]  # fmt: skip
SWEEP_FEW_HEADS = [MLAConfig(*c) for c in ((16, 64, 4, 2), (16, 128, 4, 2), (16, 32, 4, 3),
                   (16, 64, 8, 3), (16, 128, 8, 2), (16, 128, 4, 3), (16, 32, 4, 4), (16, 32, 4, 6),
                   (16, 32, 8, 4))] + [TMA(16, 64, 4, 2)]  # fmt: skip

# the tiled kernel (the decode path before the streaming one), then the streaming kernel: the
# pinned config, 128-key tiles, three key tiles in flight (7 stages), twice the programs, and
# the exact fp16 dot over fp8 rows (what e4m3 straight into the tensor cores saves)
SWEEP_INDEXER = [IndexerConfig(*c) for c in ((1, 128, 4, 3), (1, 64, 4, 3), (1, 128, 8, 3),
                 (1, 128, 4, 2, 1), (1, 128, 4, 3, 4), (1, 256, 8, 2))] + [
    IndexerConfig(1, 64, 4, 5, stream=True),
    IndexerConfig(1, 128, 4, 5, stream=True),
    IndexerConfig(1, 64, 4, 7, stream=True),
    IndexerConfig(1, 64, 4, 5, stream=True, waves=8),
    IndexerConfig(1, 64, 4, 5, stream=True, fp8_dot=False),
]  # fmt: skip


def sweep(deadline: float) -> list[dict]:
    """Each config at one shape per kernel; errors (e.g. shared memory) are reported."""
    b, c = S.sweep_shape
    h, few, sb, ib = S.many_heads, S.few_heads, S.sparse_batch, S.idx_batches[-1]
    jobs = [
        (f"dense_h{h}_b{b}_{c}", SWEEP_MANY_HEADS, lambda g: time_latent("dense", b, h, c, False, g)),
        (f"dense_h{few}_b{b}_{2 * c}", SWEEP_FEW_HEADS,
         lambda g: time_latent("dense", b, few, 2 * c, False, g)),
        (f"sparse_b{sb}_{4 * c}_fp8", SWEEP_MANY_HEADS,
         lambda g: time_latent("sparse_decode", sb, h, 4 * c, True, g)),
        (f"indexer_b{ib}_{8 * c}_fp8", SWEEP_INDEXER, lambda g: time_indexer(ib, 8 * c, True, g)),
        (f"indexer_b{ib}_{8 * c}_bf16", [g for g in SWEEP_INDEXER if g.fp8_dot],
         lambda g: time_indexer(ib, 8 * c, False, g)),
    ]  # fmt: skip
    out = []
    for shape, configs, fn in jobs:
        for cfg in configs:
            res = {"shape": shape, "config": asdict(cfg)}
            if time.perf_counter() > deadline:
                res["skipped"] = "time budget"
            else:
                try:
                    res["us"] = fn(cfg).get("us")
                except Exception as exc:  # noqa: BLE001 (a config that does not compile)
                    res["error"] = f"{type(exc).__name__}: {exc}"[:200]
            print(json.dumps(res), flush=True)
            out.append(res)
    return out


# ----------------------------------------------------------------------------- main


def time_sparse_vs_dense(batch: int, heads: int, ctx: int, fp8: bool) -> dict:
    row = time_latent("sparse_decode", batch, heads, ctx, fp8)
    return {**row, "dense_us": time_latent("dense", batch, heads, ctx, fp8).get("us")}


def bench_all(args, deadline: float, ceilings: dict) -> list[dict]:
    """Every timed shape, in order, until the time budget runs out; rates as fractions of the
    measured and the nominal ceilings."""
    jobs = [
        ("dense", time_latent, ("dense", b, h, c, False), dict(heads=h, batch=b, ctx=c))
        for h in (S.few_heads, S.many_heads)
        for b in S.dense_batches
        for c in S.dense_ctx
    ]
    b, h = S.sparse_batch, S.many_heads
    jobs += [
        ("sparse_decode", time_sparse_vs_dense, (b, h, c, f), dict(batch=b, ctx=c, fp8=f))
        for c in S.long_ctx
        for f in (False, True)
    ]
    jobs += [("sparse_prefill", time_sparse_prefill, (), {})]
    jobs += [
        ("indexer", time_indexer, (b, c, f), dict(batch=b, ctx=c, fp8=f))
        for b in S.idx_batches
        for c in S.long_ctx
        for f in (True, False)
    ]
    jobs += [("indexer_prefill", time_indexer_prefill, (), {})]
    rows = []
    for kind, fn, fn_args, shape in jobs:
        row = {"kind": kind, **shape, "skipped": "time budget"}
        if time.perf_counter() <= deadline:
            row = fn(*fn_args)
            if "us" in row:
                row.update(fractions(ceilings, bw=row["gbps"] * 1e9, flops=row["tflops"] * 1e12))
            if kind == "dense" and not args.no_peers and "us" in row:
                row.update(time_dense_peer(row["batch"], row["heads"], row["ctx"]))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows  # fmt: skip


def main() -> int:
    global S, DEV
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=270.0, help="stop starting new shapes")
    ap.add_argument("--no-peers", action="store_true", help="skip the SDPA peer")
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-config sweep")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU (interpreter)")
    args = ap.parse_args()
    if args.smoke:
        S, DEV = SMOKE, "cpu"
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke)")
        return 2
    start = time.perf_counter()
    deadline = start + args.budget_s
    torch.manual_seed(0)
    checks = run_checks()
    for c in checks:
        print(f"check {c['case']:>22}: {c['rel_err']:.2e} {'ok' if c['ok'] else 'FAIL'}")  # fmt: skip
    ceilings = measure_ceilings(DEV)
    print(describe(ceilings), flush=True)
    rows = bench_all(args, deadline, ceilings)
    swept = [] if args.no_sweep else sweep(deadline)
    import triton

    device = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)"
    result = dict(device=device, torch=torch.__version__, triton=triton.__version__,
                  sizes=asdict(S), peak_bw=ceilings["nominal_bw"], ceilings=ceilings, checks=checks,
                  rows=rows, sweep=swept,
                  wall_s=time.perf_counter() - start)  # fmt: skip
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "gpu_mla.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    print_tables(checks, rows, swept, S, ceilings, REL_TOL)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
