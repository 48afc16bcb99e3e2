"""The DSA lightning indexer's Triton kernels against their PyTorch twins, on CPU.

Runs through Triton's interpreter (``TRITON_INTERPRET=1``): index logits of the tiled kernel
(prefill, mixed batches) and of the streaming decode kernel against TORCH_MLA_SPARSE's scores
(``index_scores``), over fp32, fp16, bf16 and fp8 (132-byte rows) caches at tiny size (16 heads
x 32), and the selection of ``lightning_indexer_topk`` against ``indexer_topk``. Caches are
filled with NaN (0xFF bytes for fp8) before the live rows are written, so a read of the null
block or of an unused slot shows up as NaN. Then the kernels' GPU launches compiled for sm_90
(registers, spills, the pipeliner's async copies, the wgmma forms).

Not covered here: GPU numerics and speed (``benchmarks/gpu_mla.py``).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest  # noqa: E402
import torch  # noqa: E402

try:
    import triton  # noqa: E402, F401
except ImportError:
    pytest.skip("triton is not installed (pip install attnserve[gpu])", allow_module_level=True)

from attnserve.attention.backends.torch_mla_sparse import index_scores  # noqa: E402
from attnserve.attention.reference_mla import indexer_topk, write_indexer_keys  # noqa: E402
from attnserve.kvcache.fp8 import hadamard, indexer_fp8_views, quantize_act_fp8  # noqa: E402
from attnserve.ops.indexer.logits_triton import (  # noqa: E402
    IndexerConfig,
    indexer_logits,
    lightning_indexer_topk,
    row_align,
)
from tests.kernels.sm90 import compile_for_sm90  # noqa: E402
from tests.kernels.test_triton_mla import paged  # noqa: E402

IDX_HEADS, IDX_DIM = 16, 32

INDEXER_CASES = {
    "decode": ([1, 1, 1, 1], [1, 40, 64, 97]),
    "prefill": ([21], [21]),
    "mixed_chunked": ([1, 1, 13, 4, 6], [9, 66, 40, 4, 70]),
}


def indexer_batch(case, dtype, fp8, seed, page=16, lens=None):
    """A NaN-filled indexer cache holding random keys of the requests of ``case`` (or of
    ``lens``: query lengths, seq lengths), queries at each request's last positions."""
    gen = torch.Generator().manual_seed(seed)
    query_lens, seq_lens = lens or INDEXER_CASES[case]
    width = IDX_DIM + 4 if fp8 else IDX_DIM
    fill = 255 if fp8 else float("nan")
    cache, table, slots = paged(seq_lens, width, page, gen, fill, torch.uint8 if fp8 else dtype)
    for s in slots:
        write_indexer_keys(cache, torch.randn(len(s), IDX_DIM, generator=gen), s)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    return dict(
        q=torch.randn(len(positions), IDX_HEADS, IDX_DIM, generator=gen).to(dtype),
        weights=torch.randn(len(positions), IDX_HEADS, generator=gen),
        index_cache=cache,
        block_table=table,
        query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        positions=positions,
    ), (max(query_lens), max(seq_lens))


def twin_logits(b) -> torch.Tensor:
    """[T, S_max] index scores by TORCH_MLA_SPARSE's formula, -inf where not visible."""
    qsl, lens, cache = b["query_start_loc"].tolist(), b["seq_lens"].tolist(), b["index_cache"]
    out = torch.full((len(b["positions"]), max(lens)), float("-inf"))
    for i, s in enumerate(lens):
        pos = torch.arange(s)
        rows = cache[b["block_table"][i].long()[pos // cache.shape[1]], pos % cache.shape[1]]
        a, e = qsl[i], qsl[i + 1]
        if a == e:  # no token of this request in the batch
            continue
        scores = index_scores(b["q"][None, a:e], b["weights"][None, a:e], rows[None])[0]
        visible = pos[None, :] <= b["positions"][a:e, None]
        out[a:e, :s] = scores.masked_fill(~visible, float("-inf"))
    return out


def run_logits(b, fp8, max_q, max_s, config=None, width=None, fill_hidden=True):
    """(kernel logits, twin logits) of an indexer batch, scaled as lightning_indexer_topk does;
    the twin's columns past ``max_s`` (up to ``width``) are -inf."""
    heads, dim = IDX_HEADS, IDX_DIM
    if fp8:
        q8, q_scale = quantize_act_fp8(hadamard(b["q"]))
        q_in, hw, dot_scale = q8, b["weights"] * heads**-0.5 * q_scale * dim**-0.5, 1.0
    else:
        q_in, hw, dot_scale = b["q"], b["weights"] * heads**-0.5, dim**-0.5
    args = {k: v for k, v in b.items() if k not in ("q", "weights")}
    width = width or max_s
    got = indexer_logits(q_in, hw, **args, width=width, max_query_len=max_q, dot_scale=dot_scale,
                         config=config, fill_hidden=fill_hidden)  # fmt: skip
    want = twin_logits(b)
    return got, torch.nn.functional.pad(want, (0, width - want.shape[1]), value=float("-inf"))


def assert_close_logits(got, want, tol):
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "causal / length mask"
    seen = ~torch.isneginf(want)
    assert ((got[seen] - want[seen]).abs().max() / want[seen].abs().max()) < tol


@pytest.mark.parametrize("case", sorted(INDEXER_CASES))
@pytest.mark.parametrize(
    "dtype,fp8", [(torch.float32, False), (torch.float16, False), (torch.float32, True)],
    ids=["fp32", "fp16", "fp8"],
)  # fmt: skip
def test_indexer_logits_and_topk(case, dtype, fp8):
    b, (max_q, max_s) = indexer_batch(case, dtype, fp8, seed=11)
    got, want = run_logits(b, fp8, max_q, max_s)
    assert_close_logits(got, want, 2e-3 if dtype == torch.float16 else 2e-6)
    args = {k: v for k, v in b.items() if k not in ("q", "weights")}
    topk = 8
    sel = lightning_indexer_topk(
        b["q"], b["weights"], **args, topk=topk, max_query_len=max_q, max_seq_len=max_s
    )
    ref = indexer_topk(b["q"], b["weights"], **args, topk=topk, fp8=fp8)
    assert_same_selection(sel, ref, want)


@pytest.mark.parametrize(
    "case,config",
    [("decode", IndexerConfig(1, 16, 4, 1, key_tiles=2)),
     ("mixed_chunked", IndexerConfig(2, 32, 4, 1, key_tiles=3)),
     ("mixed_chunked", IndexerConfig(4, 16, 4, 1, key_tiles=1))],
    ids=["decode-16x2", "mixed-t2-32x3", "mixed-t4-16x1"],
)  # fmt: skip
def test_indexer_logits_tiling(case, config):
    """Several programs per row, each over several key tiles (the last one past the width),
    and token blocks that straddle requests' ends; fp8 rows."""
    b, (max_q, max_s) = indexer_batch(case, torch.float32, True, seed=13)
    got, want = run_logits(b, True, max(max_q, 2), max_s, config)
    assert_close_logits(got, want, 2e-6)


def assert_same_selection(sel, ref, logits, tol=1e-4):
    """Same number of -1 per row, and the selected keys' scores equal the twin's (so a swap
    between keys of equal score passes, any other difference fails)."""
    assert sel.shape == ref.shape and sel.dtype == torch.int32
    assert torch.equal((sel < 0).sum(1), (ref < 0).sum(1))
    for row in range(sel.shape[0]):
        a, b = sel[row][sel[row] >= 0].long(), ref[row][ref[row] >= 0].long()
        assert len(set(a.tolist())) == len(a), "a key selected twice"
        va, vb = logits[row, a].sort().values, logits[row, b].sort().values
        assert (va - vb).abs().max().item() <= tol * max(1.0, vb.abs().max().item()), row


def test_indexer_topk_selects_every_key_when_few():
    """max_seq_len <= topk: every visible key, without scoring; equal to the twin as a set."""
    b, (max_q, max_s) = indexer_batch("mixed_chunked", torch.float32, False, seed=12)
    args = {k: v for k, v in b.items() if k not in ("q", "weights")}
    sel = lightning_indexer_topk(b["q"], b["weights"], **args, topk=80, max_query_len=max_q,
                                 max_seq_len=max_s)  # fmt: skip
    ref = indexer_topk(b["q"], b["weights"], **args, topk=80, fp8=False)
    for row in range(sel.shape[0]):
        assert set(sel[row].tolist()) == set(ref[row].tolist())


# ----------------------------------------------------------------------------- streaming decode kernel

# one token per request: one key; no token this step; shorter than a tile; a token before its
# request's last key (position 40 of 64, set below); lengths across pages and tiles
STREAM_LENS = ([1, 0, 1, 1, 1, 1], [1, 23, 9, 64, 130, 200])
STREAM_CONFIGS = {
    "16x4": IndexerConfig(1, 16, 4, 1, stream=True, waves=24),  # 4 programs a request, some idle
    "32x1": IndexerConfig(1, 32, 4, 1, stream=True),  # one program a request
}


@pytest.mark.parametrize("fill_hidden", [True, False], ids=["fill", "nofill"])
@pytest.mark.parametrize("cache", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("config", sorted(STREAM_CONFIGS))
def test_stream_kernel_matches_twin(config, page, cache, fill_hidden):
    """Decode rows through the streaming kernel over a width past every length (a CUDA graph's
    max_model_len): the twin's scores and -inf over the whole width with fill_hidden; without,
    the same up to the end of each row's last visible key tile (the rest is not written)."""
    fp8 = cache == "fp8"
    dtype = torch.bfloat16 if cache == "bf16" else torch.float32
    b, (_, max_s) = indexer_batch(None, dtype, fp8, seed=17, page=page, lens=STREAM_LENS)
    b["positions"][3] = 40
    cfg = STREAM_CONFIGS[config]
    width = max_s + 2 * cfg.block_s + 5
    got, want = run_logits(b, fp8, 1, max_s, cfg, width=width, fill_hidden=fill_hidden)
    if fill_hidden:
        assert_close_logits(got, want, 2e-6)
        return
    for row, pos in enumerate(b["positions"].tolist()):
        end = min(width, -(-(pos + 1) // cfg.block_s) * cfg.block_s)
        assert_close_logits(got[row, :end], want[row, :end], 2e-6)


def test_indexer_configs_are_checked():
    with pytest.raises(ValueError, match="block_t 1"):
        IndexerConfig(2, 16, 4, 1, stream=True)
    with pytest.raises(ValueError, match="power of two"):
        IndexerConfig(1, 24, 4, 1)
    b, (max_q, max_s) = indexer_batch("mixed_chunked", torch.float32, False, seed=3)
    with pytest.raises(ValueError, match="decode batches"):
        run_logits(b, False, max_q, max_s, IndexerConfig(1, 16, 4, 1, stream=True))


def test_decode_kernel_choice_on_the_gpu():
    """GPU decode: fp8 keys always stream; bf16 keys stream from STREAM_MIN_SEQS_BF16 requests
    (the tiled kernel was ahead at batch 1 on the H200); prefill takes the tiled kernel."""
    from attnserve.ops.indexer.logits_triton import STREAM_MIN_SEQS_BF16, pick_indexer_config

    def pick(fp8, seqs, max_q=1):
        return pick_indexer_config(64, max_q, torch.bfloat16, False, fp8=fp8, num_seqs=seqs).stream

    assert pick(True, 1) and pick(True, 64)
    assert not pick(False, 1) and not pick(False, STREAM_MIN_SEQS_BF16 - 1)
    assert pick(False, STREAM_MIN_SEQS_BF16) and pick(False, None)
    assert not pick(True, 8, max_q=16) and not pick(False, 8, max_q=16)


def test_row_align_of_key_rows():
    """The alignment (elements) the kernels promise the compiler for key rows: 132-byte fp8
    rows 4 (not 16: the loads are 4 bytes wide), 128 bf16 one 16-byte vector, odd widths less."""
    assert row_align(indexer_fp8_views(torch.zeros(3, 64, 132, dtype=torch.uint8))[0]) == 4
    assert row_align(torch.zeros(3, 16, 128, dtype=torch.bfloat16)) == 8
    assert row_align(torch.zeros(3, 16, 128)) == 4
    assert row_align(torch.zeros(3, 16, 66, dtype=torch.bfloat16)) == 2
    assert row_align(torch.zeros(3, 16, 33)) == 1


# The GPU launches (64 heads x 128, page 64): the streaming kernel at its pinned fp8 and bf16
# (fill_hidden) configs, the exact fp16 variant and the sweep's streaming candidates; the tiled
# kernel at the pinned prefill config and the old decode one.
_LAUNCHES = r"""
sys.path.insert(0, BENCHMARKS)  # as when gpu_mla.py runs as a script
from gpu_mla import SWEEP_INDEXER

from attnserve.ops.indexer import logits_triton as I

record(I, "_indexer_kernel", "_indexer_stream_kernel")
B, S, PAGE = 8, 4096, 64  # 8 requests: bf16 keys stream from 8 (STREAM_MIN_SEQS_BF16)


def launch(fp8, max_q=1, config=None, fill=False):
    nb = B * S // PAGE + 1
    cache = torch.zeros(nb, PAGE, 132 if fp8 else 128, dtype=torch.uint8 if fp8 else torch.bfloat16)
    t = B * max_q
    q = torch.zeros(t, 64, 128, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    I.indexer_logits(q, torch.zeros(t, 64), cache, torch.arange(1, nb, dtype=torch.int32).view(B, -1),
                     torch.arange(0, t + 1, max_q, dtype=torch.int32), torch.full((B,), S, dtype=torch.int32),
                     torch.full((t,), S - 1), width=S, max_query_len=max_q, dot_scale=1.0, config=config,
                     fill_hidden=fill)


launch(True)
launch(False, fill=True)
launch(True, config=I.IndexerConfig(1, 64, 4, 5, stream=True, fp8_dot=False))
for cfg in SWEEP_INDEXER:
    if cfg.stream and cfg.fp8_dot:  # the fp16 one is launched above
        launch(True, config=cfg)
launch(True, max_q=64, fill=True)
launch(True, config=I.IndexerConfig(1, 128, 4, 3))
"""


def test_kernels_compile_for_sm90():
    """No spills; the streaming kernel's loop is pipelined (async copies) and runs on wgmma:
    e4m3 x e4m3 for fp8 rows, bf16 for bf16 rows, f16 for the exact fp8 variant."""
    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    infos = compile_for_sm90(f"BENCHMARKS = {str(benchmarks)!r}\n" + _LAUNCHES, ptxas=True)
    stream = [i for i in infos if i["kernel"] == "_indexer_stream_kernel"]
    assert len(stream) >= 6 and len(infos) == len(stream) + 2, infos
    for info in infos:
        assert info["spill"] == 0, info
    for info in stream:
        assert info["async_copies"] > 0 and info["wgmma"], info
    kinds = [" ".join(i["wgmma"]) for i in stream]
    assert "e4m3.e4m3" in kinds[0] and "bf16.bf16" in kinds[1], kinds
    assert "f16.f16" in kinds[2] and "bf16" not in kinds[2], kinds
    assert all("e4m3.e4m3" in k for k in kinds[3:]), kinds
