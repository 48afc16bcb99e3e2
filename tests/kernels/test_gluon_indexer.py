"""The Gluon indexer decode kernel (``ops/gluon_indexer``): its input checks and class, the
stage copy plan, its sm_90 compile, and on a Hopper GPU its logits against the float32 twin and
the Triton streaming kernel.

Gluon has no interpreter, so on CPU the kernel is only compiled (``sm90.py``) and its compiled
form checked for what the design promises: no spills, shared memory within the 227 KB a block
may take, one wgmma e4m3 form with keys as M (``m64n64k32``, 64 heads as N), pages copied by
16-byte ``cp.async`` and scales by 4-byte ones (no TMA), one wgmma wait a page. The numeric test
runs only where a Hopper GPU is (``benchmarks/gpu_indexer_gluon.py`` times it there).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon", reason="Triton without Gluon")

from attnserve.attention.reference_mla import gather_indexer_keys, write_indexer_keys  # noqa: E402
from attnserve.kvcache.fp8 import hadamard, quantize_act_fp8  # noqa: E402
from attnserve.ops.gluon_indexer import (  # noqa: E402
    _row_pieces,
    check_indexer_gluon_inputs,
    in_indexer_gluon_class,
    indexer_gluon_takes,
    indexer_logits_gluon,
)
from tests.kernels.sm90 import compile_for_sm90  # noqa: E402

E4M3 = torch.float8_e4m3fn


def _inputs(tokens=3, reqs=3, **over):
    d = dict(q=torch.zeros(tokens, 64, 128, dtype=E4M3),
             head_weights=torch.zeros(tokens, 64),
             index_cache=torch.zeros(5, 64, 132, dtype=torch.uint8),
             block_table=torch.zeros(reqs, 4, dtype=torch.int32),
             query_start_loc=torch.arange(reqs + 1, dtype=torch.int32),
             seq_lens=torch.zeros(reqs, dtype=torch.int32),
             positions=torch.zeros(tokens, dtype=torch.int64), max_query_len=1)  # fmt: skip
    d.update(over)
    return d


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(max_query_len=4), "decode batches only"),
        (dict(q=torch.zeros(3, 32, 128, dtype=E4M3)), r"q must be \[tokens, 64, 128\]"),
        (dict(q=torch.zeros(3, 64, 64, dtype=E4M3)), r"q must be \[tokens, 64, 128\]"),
        (dict(q=torch.zeros(3, 64, 128, dtype=torch.bfloat16)), "float8_e4m3fn"),
        (dict(q=torch.zeros(3, 128, 64, dtype=E4M3).transpose(1, 2)), "contiguous in its last"),
        (dict(head_weights=torch.zeros(3, 64, dtype=torch.bfloat16)), "head_weights"),
        (dict(head_weights=torch.zeros(2, 64)), r"float32 \[3, 64\]"),
        (dict(head_weights=torch.zeros(64, 3).t()), "head_weights must be contiguous"),
        (dict(index_cache=torch.zeros(5, 64, 128, dtype=torch.bfloat16)), "uint8"),
        (dict(index_cache=torch.zeros(5, 16, 132, dtype=torch.uint8)), r"\[blocks, 64, 132\]"),
        (dict(index_cache=torch.zeros(64, 5, 132, dtype=torch.uint8).transpose(0, 1)),
         "contiguous and 16-byte aligned"),
        (dict(index_cache=torch.zeros(5 * 64 * 132 + 4, dtype=torch.uint8)[4:].view(5, 64, 132)),
         "16-byte aligned"),
        (dict(block_table=torch.zeros(3, 4, dtype=torch.int64)), "block_table"),
        (dict(seq_lens=torch.zeros(2, dtype=torch.int32)), r"seq_lens must be int32 \[3\]"),
        (dict(query_start_loc=torch.arange(3, dtype=torch.int32)), r"query_start_loc.*\[4\]"),
        (dict(positions=torch.zeros(3, dtype=torch.float32)), "positions"),
        (dict(positions=torch.zeros(4, dtype=torch.int64)), r"int32 or int64 \[3\]"),
        ({}, "Hopper"),  # everything right, but on CPU
        (dict(positions=torch.zeros(3, dtype=torch.int32)), "Hopper"),
    ],
)  # fmt: skip
def test_inputs_outside_the_class_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        check_indexer_gluon_inputs(**_inputs(**change))


def test_entry_point_checks_before_launching():
    d = _inputs()
    d.pop("max_query_len")
    with pytest.raises(ValueError, match="Hopper"):
        indexer_logits_gluon(**d, width=256)


@pytest.mark.parametrize(
    "change,takes",
    [
        ({}, True),
        (dict(max_query_len=2), False),  # prefill: Triton's tiled kernel
        (dict(q=torch.zeros(3, 64, 128, dtype=torch.bfloat16)), False),
        (dict(index_cache=torch.zeros(5, 64, 128, dtype=torch.bfloat16)), False),  # bf16 keys
        (dict(index_cache=torch.zeros(5, 16, 132, dtype=torch.uint8)), False),  # page 16
        (dict(q=torch.zeros(3, 16, 128, dtype=E4M3), head_weights=torch.zeros(3, 16)), False),
    ],
)
def test_the_class_indexer_logits_may_send_here(change, takes):
    d = _inputs(**change)
    args = (d["q"], d["head_weights"], d["index_cache"], d["max_query_len"])
    assert in_indexer_gluon_class(*args) is takes
    assert indexer_gluon_takes(*args) is False  # on CPU nothing goes to the Gluon kernel


@pytest.mark.parametrize("stage", range(8))
def test_stage_copies_cover_the_page_in_aligned_slices(stage):
    """A stage's 33 rows of 256 bytes as slices the flat view takes: exactly the rows, in
    order, each starting at a multiple of its power-of-two length."""
    pieces = _row_pieces(33 * stage, 33)
    rows = [r for start, n in pieces for r in range(start, start + n)]
    assert rows == list(range(33 * stage, 33 * stage + 33))
    assert all(n & (n - 1) == 0 and start % n == 0 for start, n in pieces)
    assert len(pieces) <= 7


# The kernel's launches (fill_hidden on and off; the default 3 stages and 7), recorded on CPU
# tensors through the launcher the entry point calls after its checks.
_LAUNCHES = r"""
try:
    import attnserve.ops.gluon_indexer as gi
except ImportError as exc:
    print(exc); sys.exit(77)

record(gi, "_indexer_gluon_kernel")
B, S = 4, 4096
nb = B * S // 64 + 1
cache = torch.zeros(nb, 64, 132, dtype=torch.uint8)
q = torch.zeros(B, 64, 128, dtype=torch.float8_e4m3fn)
table = torch.arange(1, nb, dtype=torch.int32).view(B, -1)
for stages, fill in ((3, False), (3, True), (7, False)):
    gi.STAGES = stages
    gi._launch(q, torch.zeros(B, 64), cache, table, torch.arange(0, B + 1, dtype=torch.int32),
               torch.full((B,), S, dtype=torch.int32), torch.full((B,), S - 1), S, 1.0, fill, 4)
"""


def test_kernel_compiles_for_sm90_without_spills():
    infos = compile_for_sm90(_LAUNCHES, ptxas=True)
    assert [i["kernel"] for i in infos] == ["_indexer_gluon_kernel"] * 3, infos
    for info in infos:
        assert info["spill"] == 0, info
        assert info["shared"] <= 227 * 1024, info
        assert info["wgmma"] == ["wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3"], info
        assert not info["wgmma_a_regs"], info  # A (the keys) from the swizzled tile
        assert info["wgmma_waits"] and set(info["wgmma_waits"]) == {0}, info
        assert info["tma_loads"] == 0, info
        assert info["cp_async_bytes"] == [4, 16], info  # scales by 4 bytes, pages by 16
    three, seven = infos[0]["shared"], infos[2]["shared"]
    assert three <= 52 * 1024 < seven <= 100 * 1024, infos  # 32 KB of stages, then 64 KB
    assert infos[0]["regs"] <= 128, infos[0]  # four programs an SM


def _nan_cache(lens, seed):
    """0xFF-filled (e4m3 NaN) fp8 cache of 64-key pages with each request's keys in shuffled
    blocks, and its block table."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // 64) for n in lens]
    cache = torch.full((sum(blocks) + 1, 64, 132), 255, dtype=torch.uint8)
    table = torch.zeros(len(lens), max(max(blocks), 1), dtype=torch.int32)
    free = (torch.randperm(sum(blocks), generator=gen) + 1).tolist()
    for i, (n, b) in enumerate(zip(lens, blocks)):
        table[i, :b] = torch.tensor(free[:b], dtype=torch.int32)
        free = free[b:]
        pos = torch.arange(n)
        write_indexer_keys(cache, torch.randn(n, 128, generator=gen),
                           table[i].long()[pos // 64] * 64 + pos % 64)  # fmt: skip
    return cache, table


def twin_logits(q8, hw, cache, table, lens, positions, width):
    """Float32 [T, width]: ``sum_h hw * relu(q8 . k)`` over the dequantised keys (the scale is
    a positive power of two: relu(s x) = s relu(x)) of each token's request, -inf elsewhere."""
    out = torch.full((q8.shape[0], width), float("-inf"))
    for t, (n, p) in enumerate(zip(lens, positions.tolist())):
        limit = min(p + 1, n)
        if limit <= 0:
            continue
        keys = gather_indexer_keys(cache, table[t], limit)  # [limit, 128]
        out[t, :limit] = (hw[t, :, None] * torch.relu(q8[t].float() @ keys.T)).sum(0)
    return out


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="the Gluon kernel runs on Hopper GPUs only",
)
@pytest.mark.parametrize("fill_hidden", [True, False])
def test_matches_twin_and_triton_on_hopper(fill_hidden):
    from attnserve.ops.triton_indexer import indexer_logits, pick_indexer_config

    lens = [0, 1, 63, 64, 65, 700, 4097, 3000]
    cache, table = _nan_cache(lens, seed=5)
    positions = torch.tensor([0, 0, 62, 63, 64, 500, 4096, 2999])  # one before its last key
    gen = torch.Generator().manual_seed(6)
    q8, q_scale = quantize_act_fp8(hadamard(torch.randn(len(lens), 64, 128, generator=gen)))
    hw = torch.randn(len(lens), 64, generator=gen) * q_scale
    width = max(lens) + 200  # past every length, as a CUDA graph's max_model_len
    want = twin_logits(q8, hw, cache, table, lens, positions, width)
    dev = torch.device("cuda")
    args = (q8.to(dev, E4M3), hw.to(dev), cache.to(dev), table.to(dev),
            torch.arange(len(lens) + 1, dtype=torch.int32, device=dev),
            torch.tensor(lens, dtype=torch.int32, device=dev), positions.to(dev))  # fmt: skip
    got = indexer_logits_gluon(*args, width=width, fill_hidden=fill_hidden).cpu()
    cfg = pick_indexer_config(64, 1, torch.bfloat16, False, fp8=True, num_seqs=len(lens))
    tri = indexer_logits(*args, width=width, max_query_len=1, dot_scale=1.0, config=cfg,
                         fill_hidden=fill_hidden).cpu()  # fmt: skip
    for t, (n, p) in enumerate(zip(lens, positions.tolist())):
        limit = max(0, min(p + 1, n))
        end = width if fill_hidden else min(width, -(-limit // 64) * 64)
        for out in (got, tri):
            assert torch.equal(torch.isneginf(out[t, :end]), torch.isneginf(want[t, :end])), t
        if limit:
            scale = want[t, :limit].abs().max()
            assert ((got[t, :limit] - want[t, :limit]).abs().max() / scale) < 2e-2, t
            assert ((got[t, :limit] - tri[t, :limit]).abs().max() / scale) < 2e-2, t
