"""H200 benchmark of the Triton paged attention kernels against torch SDPA and FlexAttention.

1. Checks ``unified_attention`` and ``write_kv_cache`` against ``attention.reference`` on
   random bf16 inputs (decode with split-KV, mixed and chunked batches, each feature, fp8
   cache, head sizes 64/128/256): ``max|out - ref| / max|ref| <= 2e-2``; and that the peers
   compute the same thing (SDPA GQA against our decode, SDPA MHA on expanded K/V against our
   causal prefill).
2. The ceilings, measured in this run (``ceilings.py``): device copy bandwidth and the bf16
   ``torch.mm`` rate. Decode rows are given as fractions of the copy bandwidth, prefill rows of
   the matmul rate, each measured (``pct_*_measured``) and nominal (4.25 TB/s, 790 TFLOP/s:
   ``pct_bw``, ``pct_flops``).
3. Decode, batch 1/16/64/256 x context 1K/4K/16K/32K/64K (32 query / 8 KV heads, head 128, bf16,
   block 16): bytes moved (K and V read once, q and out), GB/s, % of copy bandwidth, and the
   time of SDPA (FlashAttention backend, contiguous K/V [B, H, S, D], GQA as is) and of
   compiled FlexAttention (its decoding path) on the same shapes, as peer / ours.
4. Causal prefill of one sequence of 1K..32K tokens, head 128: TFLOP/s, % of the matmul rate,
   and the peers: SDPA GQA as above; SDPA MHA (K/V expanded to the 32 query heads before the
   timed call) under the cuDNN backend and, separately, the FlashAttention one; FlexAttention.
   A peer whose backend is unavailable or refuses the shape is reported missing (None).

Timing: each call is captured once per input set into one CUDA graph (sets rotate, so L2
holds no set between its calls), ``triton.testing.do_bench`` takes the median over replays
after its warm-up, and the time per call is that median / number of sets. Shapes that would
not fit in memory are skipped, and so is whatever is left when the time budget runs out.
``--smoke`` runs every path at toy sizes on CPU under Triton's interpreter (float32, eager
FlexAttention, one plain pass per timing; the cuDNN peer is missing there).

    python benchmarks/gpu_attention.py [--budget-s 330] [--no-peers] [--smoke]
        [--only checks,decode,prefill] [--decode-shapes 1x32768,16x4096] [--prefill-tokens 16384]
        [--graph-calls 8]

``--only`` (repeatable or a comma list; default all three) picks the parts: ``checks`` alone
runs the checks and nothing else (no ceilings, no peers); leaving ``checks`` out times without
them. The checks, when run, come before any timing; a failed check does not stop the timing, but
the run exits 1 and the JSON's ``checks_ok`` is false. ``--decode-shapes`` (BATCHxCONTEXT) and
``--prefill-tokens`` replace the default grid of their part (an error where ``--only`` leaves that
part out). Issue #22's rows: ``--decode-shapes 1x32768,16x4096 --prefill-tokens 16384``.
``--graph-calls 8`` repeats each timing graph's rotation (ours and the peers') to 8+ calls, sharing
the graph's launch as a model step does (a graph of one big set's call also times it: 5-10 us).
The default run is the checks, the ceilings, 20 decode and 6 prefill rows; ``--budget-s``
(counted from the start, checks included) stops starting new shapes, so the run ends by the
budget plus the row in flight (the full default grid has not been timed in one run on the H200).

Prints a compact table last (only the parts run); writes ``$OUT/gpu_attention.json`` when ``OUT``
is set. Not a test: correctness on CPU is ``tests/kernels/test_triton_attention.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

SMOKE = __name__ == "__main__" and "--smoke" in sys.argv  # not when imported by another script
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from ceilings import NOMINAL_BW, fractions, measure_ceilings  # noqa: E402
from gpu_attention_report import print_tables  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from attnserve.attention import kernels  # noqa: E402
from attnserve.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from attnserve.attention.reference import alibi_slopes, paged_attention, write_kv  # noqa: E402
from attnserve.ops.attention.kv_write_triton import write_kv_cache  # noqa: E402
from attnserve.ops.attention.paged_triton import pick_num_splits, unified_attention  # noqa: E402
from attnserve.ops.attention.prefill_gluon import launch_prefill  # noqa: E402

HEADS, KV_HEADS, HEAD, PAGE = (4, 2, 32, 16) if SMOKE else (32, 8, 128, 16)
DTYPE = torch.float32 if SMOKE else torch.bfloat16  # the interpreter cannot do bf16 arithmetic
DECODE_BATCHES, DECODE_CTX = (
    ((1, 3), (96,)) if SMOKE else ((1, 16, 64, 256), (1024, 4096, 16384, 32768, 65536))
)
PREFILL_TOKENS = (64,) if SMOKE else (1024, 2048, 4096, 8192, 16384, 32768)
CHECK_LENS = (128, 100, 37) if SMOKE else (4096, 1000, 517)  # requests of the checks
DECODE_PEERS = ("sdpa", "flex")
PREFILL_PEERS = ("sdpa", "sdpa_cudnn_mha", "sdpa_flash_mha", "flex")
KINDS = ("checks", "decode", "prefill")  # the parts --only picks
REL_TOL = 2e-2
L2_BUST_BYTES, MAX_SETS = 256 << 20, 32
GRAPH_CALLS = 1  # least calls a timing graph holds (``--graph-calls``)
DEV = "cpu" if SMOKE else "cuda"


# ----------------------------------------------------------------------------- inputs


def paged_batch(
    q_lens,
    seq_lens,
    *,
    head=HEAD,
    heads=HEADS,
    kv_heads=KV_HEADS,
    cache_dtype=DTYPE,
    nan_fill=False,
    scales=(1.0, 1.0),
):
    """Random q and a paged cache (``DTYPE``) whose blocks are a random permutation (0 null)."""
    nbs = [-(-s // PAGE) for s in seq_lens]
    num_blocks = sum(nbs) + 1
    perm = torch.randperm(num_blocks - 1, device=DEV, dtype=torch.int32) + 1
    table = torch.zeros(len(seq_lens), max(nbs), dtype=torch.int32, device=DEV)
    if len(set(nbs)) == 1:  # equal lengths: one reshape instead of a loop
        table[:] = perm.view(len(seq_lens), nbs[0])
    else:
        for i, (start, n) in enumerate(zip(itertools.accumulate([0, *nbs]), nbs)):
            table[i, :n] = perm[start : start + n]
    shape = (num_blocks, PAGE, kv_heads, head)
    if cache_dtype == DTYPE and not nan_fill:
        k_cache = torch.randn(shape, device=DEV, dtype=DTYPE)
        v_cache = torch.randn(shape, device=DEV, dtype=DTYPE)
    else:  # quantised through the kernel's own twin, unused slots NaN
        k_cache = torch.full(shape, float("nan"), device=DEV).to(cache_dtype)
        v_cache = torch.full(shape, float("nan"), device=DEV).to(cache_dtype)
        for i, s in enumerate(seq_lens):
            pos = torch.arange(s, device=DEV)
            slots = table[i].long()[pos // PAGE] * PAGE + pos % PAGE
            kv = torch.randn(2, s, kv_heads, head, device=DEV)
            write_kv(k_cache, v_cache, kv[0], kv[1], slots, *scales)
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEV)
    q = torch.randn(int(sum(q_lens)), heads, head, device=DEV, dtype=DTYPE)
    return dict(
        q=q,
        key_cache=k_cache,
        value_cache=v_cache,
        block_table=table,
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
    )


def run_ours(b: dict, out: torch.Tensor, **features) -> torch.Tensor:
    """``unified_attention`` as TRITON_ATTN calls it: split decodes merged the backend's way
    (``split_merge``) unless ``features`` say otherwise."""
    features.setdefault("merge", TritonAttentionBackend.split_merge)
    qsl, lens = b["query_start_loc"], b["seq_lens"]
    return unified_attention(
        b["q"],
        b["key_cache"],
        b["value_cache"],
        out,
        b["block_table"],
        qsl,
        lens,
        scale=b["q"].shape[-1] ** -0.5,
        max_query_len=b.get("max_q") or int((qsl[1:] - qsl[:-1]).max()),
        max_seq_len=b.get("max_s") or int(lens.max()),
        **features,
    )


# ----------------------------------------------------------------------------- checks


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def check_attention() -> list[dict]:
    """Kernel vs reference on bf16 batches; returns one row per case."""
    g = torch.Generator(device=DEV).manual_seed(0)
    long, mid, short = CHECK_LENS
    mixed = ([1, 1, 1, 37, 200], [mid, 17, long, 300, 200])
    cases = [
        ("decode_split", ([1] * 4, [mid, 1, short, long]), {}, {}),
        ("decode_split_last", ([1] * 4, [mid, 1, short, long]), {"merge": "last_split"}, {}),
        ("mixed", mixed, {}, {}),
        ("window", mixed, {"window": 100}, {}),
        ("alibi", mixed, {"alibi": alibi_slopes(HEADS).to(DEV)}, {}),
        ("sinks", mixed, {"sinks": torch.randn(HEADS, device=DEV, generator=g)}, {}),
        ("softcap", mixed, {"softcap": 1.0}, {}),
        (
            "fp8_cache",
            mixed,
            {"k_scale": 0.5, "v_scale": 2.0},
            {"cache_dtype": torch.float8_e4m3fn, "scales": (0.5, 2.0)},
        ),
        ("head64", mixed, {}, {"head": 64}),
        ("head256", mixed, {}, {"head": 256}),
        ("mqa", mixed, {}, {"kv_heads": 1}),
    ]
    rows = []
    for name, (q_lens, seq_lens), features, build in cases:
        b = paged_batch(q_lens, seq_lens, nan_fill=True, **build)
        ref = paged_attention(
            b["q"],
            b["key_cache"],
            b["value_cache"],
            b["block_table"],
            b["query_start_loc"],
            b["seq_lens"],
            scale=b["q"].shape[-1] ** -0.5,
            **{k: v for k, v in features.items() if k != "merge"},
        )
        out = run_ours(b, torch.empty_like(ref), **features)
        err = rel_err(out, ref) if not out.isnan().any() else float("nan")
        rows.append({"case": name, "rel_err": err, "ok": err <= REL_TOL})
    rows.append(check_write())
    rows += check_sdpa_agrees()
    return rows


def check_write() -> dict:
    """KV write kernel vs its twin: bf16 exactly; fp8 allowing rare rounding-tie differences."""
    kv = torch.randn(2, 40, KV_HEADS, HEAD, device=DEV, dtype=DTYPE)
    slots = torch.randperm(64 * PAGE, device=DEV)[:40]
    slots[::7] = -1
    worst = 1.0
    for cache_dtype, scale in ((DTYPE, 1.0), (torch.float8_e4m3fn, 0.5)):
        if SMOKE and cache_dtype != DTYPE:  # values exact in fp8: the interpreter rounds off
            kv = (kv.to(cache_dtype).float() * scale).to(DTYPE)
        got = [
            torch.zeros(64, PAGE, KV_HEADS, HEAD, device=DEV, dtype=cache_dtype) for _ in range(2)
        ]
        want = [c.clone() for c in got]
        write_kv_cache(kv[0], kv[1], *got, slots, scale, scale)
        write_kv(*want, kv[0], kv[1], slots, scale, scale)
        for a, b in zip(got, want):
            same = (a.view(torch.uint8) == b.view(torch.uint8)).float().mean().item()
            worst = min(worst, same)
    return {"case": "write_kv", "rel_err": 1.0 - worst, "ok": worst > 0.999}


def check_sdpa_agrees() -> list[dict]:
    """The peers compute the same thing: SDPA on the gathered K/V (GQA) equals our decode, and
    SDPA on K/V expanded to the query heads (the MHA form) our causal prefill."""
    rows = []
    long = CHECK_LENS[0]
    for case, batch, n in (("sdpa_vs_ours", 2, long), ("sdpa_mha_vs_ours", 1, long // 8)):
        decode = case == "sdpa_vs_ours"
        b = paged_batch([1 if decode else n] * batch, [n] * batch)
        ours = run_ours(b, torch.empty_like(b["q"]))
        q, k, v = contiguous_kv(b, batch, n)
        q = q.transpose(1, 2)  # [B, H, n, D]
        if decode:
            peer = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        else:
            peer = F.scaled_dot_product_attention(*mha_form((q, k, v)), is_causal=True)
        err = rel_err(ours, peer.transpose(1, 2).reshape_as(ours))
        rows.append({"case": case, "rel_err": err, "ok": err <= REL_TOL})
    return rows


def contiguous_kv(b: dict, batch: int, seq: int):
    """q [B, n, H, D] and K/V [B, Hkv, S, D] gathered from a paged batch of equal lengths."""
    blocks = b["block_table"][:, : seq // PAGE].long()  # [B, S / PAGE]
    k = b["key_cache"][blocks].reshape(batch, seq, KV_HEADS, HEAD).transpose(1, 2)
    v = b["value_cache"][blocks].reshape(batch, seq, KV_HEADS, HEAD).transpose(1, 2)
    q = b["q"].view(batch, -1, HEADS, HEAD)
    return q, k.contiguous(), v.contiguous()


def mha_form(qkv: tuple) -> tuple:
    """q [B, H, S, D] and K/V [B, Hkv, S, D] -> K/V repeated to [B, H, S, D]: query head h reads
    KV head h // (H / Hkv), as under GQA."""
    q, k, v = qkv
    group = q.shape[1] // k.shape[1]
    return q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


# ----------------------------------------------------------------------------- timing


def time_per_call(
    calls: list[Callable[[], object]], rep_ms: int = 100, min_calls: int | None = None
) -> tuple[float, bool]:
    """Median seconds per call over a CUDA graph of all calls (eager rotation if capture fails);
    in smoke runs (CPU), one plain pass. The rotation is repeated to ``min_calls`` (default
    ``GRAPH_CALLS``) calls a graph, sharing the graph's launch (see ``--graph-calls``)."""
    min_calls = GRAPH_CALLS if min_calls is None else min_calls
    calls = [calls[i % len(calls)] for i in range(max(len(calls), min_calls))]
    if DEV != "cuda":
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) / len(calls), False
    for call in calls:
        call()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        ms = do_bench(graph.replay, warmup=25, rep=rep_ms, return_mode="median")
        return ms * 1e-3 / len(calls), True
    except Exception as exc:  # a peer that cannot be captured is timed eagerly
        print(f"  (graph capture failed: {type(exc).__name__}: {exc}; timing eagerly)")
        torch.cuda.synchronize()
        rotation = itertools.cycle(calls)
        ms = do_bench(lambda: next(rotation)(), warmup=25, rep=rep_ms, return_mode="median")
        return ms * 1e-3, False


def num_sets(set_bytes: int, cap: int = MAX_SETS) -> int:
    """Input sets to rotate: enough to overflow L2, at most a quarter of free memory (0: skip)."""
    if DEV != "cuda":
        return 1
    free = torch.cuda.mem_get_info()[0]
    if set_bytes > 0.8 * free:
        return 0
    by_memory = max(1, int(0.25 * free // set_bytes))
    return min(cap, math.ceil(L2_BUST_BYTES / set_bytes), by_memory)


def peer_fns() -> tuple[dict, Callable]:
    """The peers by name, each ``(fn(q, k, v, causal, mask), mha)`` on contiguous [B, H, S, D]
    inputs (``mha``: K/V expanded to the query heads first), and Flex's causal mask maker."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = flex_attention if SMOKE else torch.compile(flex_attention)  # no compiler in smoke

    def sdpa(backend, gqa: bool):
        def call(q, k, v, causal, mask):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        return call

    def flex_call(q, k, v, causal, block_mask):
        return flex(q, k, v, block_mask=block_mask, enable_gqa=True)

    def causal_mask(n):
        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        try:  # compiled mask building avoids an n x n intermediate
            return create_block_mask(causal, None, None, n, n, device=DEV, _compile=not SMOKE)
        except TypeError:
            return create_block_mask(causal, None, None, n, n, device=DEV)

    fns = {
        "sdpa": (sdpa(SDPBackend.FLASH_ATTENTION, True), False),
        "sdpa_cudnn_mha": (sdpa(SDPBackend.CUDNN_ATTENTION, False), True),
        "sdpa_flash_mha": (sdpa(SDPBackend.FLASH_ATTENTION, False), True),
        "flex": (flex_call, False),
    }
    return fns, causal_mask


def bench_peers(make_inputs, sets, causal, peers, rep_ms) -> dict:
    """Each peer's time on contiguous [B, H, S, D] inputs (prefill: ``PREFILL_PEERS``, decode:
    ``DECODE_PEERS``); the MHA forms' K/V are expanded before timing. A peer that fails (its
    backend unavailable, the shape refused) is None with its error. Inputs freed afterwards."""
    fns, causal_mask = peers
    inputs = [make_inputs() for _ in range(sets)]
    mask = causal_mask(inputs[0][0].shape[2]) if causal else None
    expanded = [mha_form(x) for x in inputs] if causal else None  # outside the timed calls
    res = {}
    for name in PREFILL_PEERS if causal else DECODE_PEERS:
        fn, mha = fns[name]
        calls = [lambda x=x, fn=fn: fn(*x, causal, mask) for x in (expanded if mha else inputs)]
        try:
            res[name], res[f"{name}_graph"] = time_per_call(calls, rep_ms)
        except Exception as exc:  # report it and go on
            res[name], res[f"{name}_error"] = None, f"{type(exc).__name__}: {exc}"[:300]
    del inputs, expanded, calls
    torch.cuda.empty_cache()
    return res


def bench_decode(batch: int, ctx: int, peers, ceilings: dict) -> dict | None:
    size = DTYPE.itemsize
    moved = 2 * batch * ctx * KV_HEADS * HEAD * size + 2 * batch * HEADS * HEAD * size  # + q, out
    sets = num_sets(moved)
    row = {
        "kind": "decode",
        "batch": batch,
        "ctx": ctx,
        "bytes": moved,
        "sets": sets,
        "splits": pick_num_splits(batch, KV_HEADS, 1, ctx, torch.device(DEV)),
    }
    if sets == 0:
        return {**row, "skipped": "does not fit in memory"}
    data = [paged_batch([1] * batch, [ctx] * batch) for _ in range(sets)]
    outs = [torch.empty_like(b["q"]) for b in data]
    for b in data:
        b["max_q"], b["max_s"] = 1, ctx
    calls = [lambda b=b, o=o: run_ours(b, o) for b, o in zip(data, outs)]
    row["ours"], row["ours_graph"] = time_per_call(calls)
    row["gbps"] = moved / row["ours"] / 1e9
    row.update(fractions(ceilings, bw=moved / row["ours"]))
    del data, outs, calls
    torch.cuda.empty_cache()
    if peers:

        def make():
            q = torch.randn(batch, HEADS, 1, HEAD, device=DEV, dtype=DTYPE)
            kv = torch.randn(2, batch, KV_HEADS, ctx, HEAD, device=DEV, dtype=DTYPE)
            return q, kv[0], kv[1]

        row.update(bench_peers(make, sets, False, peers, 100))
    return row


def bench_prefill(n: int, peers, ceilings: dict) -> dict | None:
    flops = 4 * n * n * HEAD * HEADS / 2  # causal
    set_bytes = n * (2 * HEADS + 2 * KV_HEADS) * HEAD * DTYPE.itemsize
    sets = num_sets(set_bytes, cap=4 if n <= 4096 else 2)
    row = {"kind": "prefill", "tokens": n, "flops": flops, "sets": sets}
    if sets == 0:
        return {**row, "skipped": "does not fit in memory"}
    data = [paged_batch([n], [n]) for _ in range(sets)]
    outs = [torch.empty_like(b["q"]) for b in data]
    for b in data:
        b["max_q"], b["max_s"] = n, n
    calls = [lambda b=b, o=o: run_ours(b, o) for b, o in zip(data, outs)]
    row["ours"], row["ours_graph"] = time_per_call(calls, rep_ms=200)
    row["kernel"] = "triton"
    b = data[0]
    problem = TritonAttentionBackend._problem(SimpleNamespace(), b["q"], b["key_cache"], b["value_cache"])
    if kernels.pick("attention.prefill", problem, "TRITON_ATTN").variant == "gluon":
        # what the TRITON_ATTN backend launches on Hopper: the Gluon kernel is "ours", the
        # Triton one it replaces becomes a peer column
        def gluon(b, o):
            return launch_prefill(b["q"], b["key_cache"], b["value_cache"], o, b["block_table"],
                                  b["query_start_loc"], b["seq_lens"], HEAD**-0.5)  # fmt: skip

        ref = run_ours(b, outs[0].clone())
        got = gluon(b, outs[0])
        row["gluon_rel_vs_triton"] = rel_err(got, ref)
        row["triton"] = row["ours"]
        row["ours"], row["ours_graph"] = time_per_call(
            [lambda b=b, o=o: gluon(b, o) for b, o in zip(data, outs)], rep_ms=200
        )
        row["kernel"] = "gluon"
    row["tflops"] = flops / row["ours"] / 1e12
    row.update(fractions(ceilings, flops=flops / row["ours"]))
    del data, outs, calls
    torch.cuda.empty_cache()
    if peers:

        def make():
            q = torch.randn(1, HEADS, n, HEAD, device=DEV, dtype=DTYPE)
            kv = torch.randn(2, 1, KV_HEADS, n, HEAD, device=DEV, dtype=DTYPE)
            return q, kv[0], kv[1]

        row.update(bench_peers(make, sets, True, peers, 200))
    return row


# ----------------------------------------------------------------------------- options


def positive_ints(text: str) -> list[int]:
    """``--prefill-tokens``: a comma list of positive ints."""
    items = [v.strip() for v in text.split(",")]
    if not all(v.isdigit() and int(v) > 0 for v in items):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of positive ints")
    return [int(v) for v in items]


def decode_shapes(text: str) -> list[tuple[int, int]]:
    """``--decode-shapes``: a comma list of BATCHxCONTEXT, e.g. ``1x32768,16x4096``."""
    shapes = []
    for item in text.split(","):
        batch, _, ctx = item.strip().lower().partition("x")
        try:
            shapes.append((positive_ints(batch)[0], positive_ints(ctx)[0]))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected BATCHxCONTEXT, two positive ints, e.g. 16x4096"
            ) from None
    return shapes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options; ``only`` comes back in ``KINDS`` order, ``decode_shapes`` and ``prefill_tokens`` as
    the shapes to time (the defaults for a part run without them, empty for a part not run)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop starting new shapes")
    ap.add_argument("--no-peers", action="store_true", help="time our kernels only")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU (interpreter)")
    ap.add_argument(
        "--only",
        action="append",
        metavar="PARTS",
        help=f"parts to run, of {', '.join(KINDS)} (repeat or comma list; default all)",
    )
    ap.add_argument(
        "--decode-shapes",
        type=decode_shapes,
        metavar="BxCTX,...",
        help=f"decode shapes to time (default batches {DECODE_BATCHES} x contexts {DECODE_CTX})",
    )
    ap.add_argument("--graph-calls", type=int, default=1, metavar="N",
                    help="least calls a timing graph holds (shares its launch)")  # fmt: skip
    ap.add_argument(
        "--prefill-tokens",
        type=positive_ints,
        metavar="N,...",
        help=f"causal prefill lengths to time (default {PREFILL_TOKENS})",
    )
    args = ap.parse_args(argv)
    if args.graph_calls < 1:
        ap.error("--graph-calls must be >= 1")
    only = {k.strip() for item in args.only or [",".join(KINDS)] for k in item.split(",")}
    if only - set(KINDS):
        ap.error(f"--only: unknown {sorted(only - set(KINDS))}; choose from {', '.join(KINDS)}")
    args.only = [k for k in KINDS if k in only]
    defaults = {
        "decode_shapes": [(b, c) for b in DECODE_BATCHES for c in DECODE_CTX],
        "prefill_tokens": list(PREFILL_TOKENS),
    }
    for kind, opt in (("decode", "decode_shapes"), ("prefill", "prefill_tokens")):
        if kind not in args.only:
            if getattr(args, opt) is not None:
                ap.error(f"--{opt.replace('_', '-')} given, but --only leaves out {kind}")
            setattr(args, opt, [])
        elif getattr(args, opt) is None:
            setattr(args, opt, defaults[opt])
    return args


def time_shapes(args: argparse.Namespace, ceilings: dict, start: float) -> list[dict]:
    """The decode rows, then the prefill rows; those not started by ``args.budget_s`` seconds
    after ``start`` are skipped."""
    peers = None if args.no_peers else peer_fns()
    shapes = [("decode", b, c) for b, c in args.decode_shapes]
    shapes += [("prefill", n, None) for n in args.prefill_tokens]
    rows = []
    for kind, a, c in shapes:
        if time.perf_counter() - start > args.budget_s:
            shape = {"batch": a, "ctx": c} if kind == "decode" else {"tokens": a}
            rows.append({"kind": kind, **shape, "skipped": "time budget"})
            continue
        if kind == "decode":
            row = bench_decode(a, c, peers, ceilings)
        else:
            row = bench_prefill(a, peers, ceilings)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> int:
    global GRAPH_CALLS
    args = parse_args()
    GRAPH_CALLS = args.graph_calls
    if not SMOKE and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke)")
        return 2
    import torch._dynamo as dynamo

    for knob in ("recompile_limit", "cache_size_limit"):  # flex recompiles per shape at first
        if hasattr(dynamo.config, knob):
            setattr(dynamo.config, knob, 64)
    start = time.perf_counter()
    torch.manual_seed(0)
    checks = check_attention() if "checks" in args.only else []
    for c in checks:
        print(
            f"check {c['case']:>16}: {c['rel_err']:.2e} {'ok' if c['ok'] else 'FAIL'}", flush=True
        )
    timed = args.decode_shapes or args.prefill_tokens
    ceilings = measure_ceilings(DEV) if timed else None
    if ceilings:
        print(json.dumps({"ceilings": ceilings}), flush=True)
    rows = time_shapes(args, ceilings, start) if timed else []
    failed = [c["case"] for c in checks if not c["ok"]]
    result = {
        "device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "only": args.only,
        "decode_shapes": args.decode_shapes,
        "prefill_tokens": args.prefill_tokens,
        "rel_tol": REL_TOL,
        "peak_bw": NOMINAL_BW,
        "ceilings": ceilings,
        "checks": checks,
        "checks_ok": not failed if checks else None,  # None: not run
        "rows": rows,
        "wall_s": time.perf_counter() - start,
    }
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        path = os.path.join(os.environ["OUT"], "gpu_attention.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    dims = f"{HEADS}/{KV_HEADS} heads, head {HEAD}, {str(DTYPE).removeprefix('torch.')}"
    peers = (DECODE_PEERS, PREFILL_PEERS)
    kw = dict(rel_tol=REL_TOL, dims=dims, page=PAGE, heads=HEADS, peers=peers)
    print_tables(checks, rows, ceilings, args.only, **kw)
    if failed:
        print(f"\nchecks FAILED: {', '.join(failed)} (bound {REL_TOL:.0e})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
