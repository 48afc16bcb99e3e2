"""The Gluon sparse MLA kernel (``ops/mla/sparse_gluon``): its input checks and class, its sm_90
compile, and on a Hopper GPU its output against the PyTorch twin.

Gluon has no interpreter, so on CPU the kernel is only compiled (``sm90.py``) and its compiled
form checked for what the design promises: no spills, shared memory within the 227 KB a block
may take (Q, two gathered stages, P), the score MMA split between the two warp groups
(``m64n32k16``) and P @ V by 128-column halves, one wait for the three score MMAs of a tile, and
the rows gathered by 16-byte ``cp.async`` (no TMA). The numeric test runs only where a Hopper
GPU is (``benchmarks/gpu_mla_sparse_gluon.py`` times it there).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon", reason="Triton without Gluon")

from attnserve.attention.backend import tensor_problem  # noqa: E402
from attnserve.attention.kernels import get_variant, reasons  # noqa: E402
from attnserve.attention.reference_mla import sparse_mla_attention, write_latent  # noqa: E402
from attnserve.ops.mla.sparse_gluon import check_sparse_gluon_inputs, sparse_mla_gluon  # noqa: E402
from tests.kernels.sm90 import compile_for_sm90  # noqa: E402

SCALE = 0.1352
BF16 = torch.bfloat16


def _inputs(rows=3, heads=128, reqs=2, k=128, **over):
    d = dict(q=torch.zeros(rows, heads, 576, dtype=BF16),
             latent_cache=torch.zeros(4, 64, 576, dtype=BF16),
             block_table=torch.zeros(reqs, 3, dtype=torch.int32),
             seq_lens=torch.zeros(reqs, dtype=torch.int32),
             topk_indices=torch.zeros(rows, k, dtype=torch.int32),
             token_req=torch.zeros(rows, dtype=torch.int32), kv_lora_rank=512,
             out=None)  # fmt: skip
    d.update(over)
    return d


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(kv_lora_rank=256), "kv_lora_rank 512"),
        (dict(q=torch.zeros(3, 128, 320, dtype=BF16)), r"q must be \[rows, heads, 576\]"),
        (dict(q=torch.zeros(3, 96, 576, dtype=BF16)), "multiple of 64"),
        (dict(q=torch.zeros(3, 128, 576, dtype=torch.float16)), "bf16"),
        (dict(latent_cache=torch.zeros(4, 64, 656, dtype=torch.uint8)), r"\[blocks, page, 576\]"),
        (dict(latent_cache=torch.zeros(4, 64, 576, dtype=torch.uint8)), "bf16"),  # fp8 bytes
        (dict(latent_cache=torch.zeros(64, 4, 576, dtype=BF16).transpose(0, 1)), "contiguous"),
        (dict(q=torch.zeros(3, 576, 128, dtype=BF16).transpose(1, 2)), "contiguous"),
        (dict(block_table=torch.zeros(2, 3, dtype=torch.int64)), "block_table"),
        (dict(seq_lens=torch.zeros(3, dtype=torch.int32)), r"seq_lens must be int32 \[2\]"),
        (dict(topk_indices=torch.zeros(3, 128, dtype=torch.int64)), "2-D int32"),
        (dict(topk_indices=torch.zeros(2, 128, dtype=torch.int32)), r"\[3, K\]"),
        (dict(topk_indices=torch.zeros(128, 3, dtype=torch.int32).t()), "unit last stride"),
        (dict(token_req=torch.zeros(3, dtype=torch.float32)), "token_req"),
        (dict(token_req=torch.zeros(4, dtype=torch.int64)), r"int32 or int64 \[3\]"),
        (dict(out=torch.zeros(3, 128, 256, dtype=BF16)), "out must be"),
        ({}, "Hopper"),  # everything right, but on CPU
        (dict(token_req=torch.zeros(3, dtype=torch.int64)), "Hopper"),
        (dict(latent_cache=torch.zeros(9, 16, 576, dtype=BF16)), "Hopper"),  # page 16 is taken
    ],
)
def test_inputs_outside_the_class_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        check_sparse_gluon_inputs(**_inputs(**change))


def test_entry_point_checks_before_launching():
    d = _inputs()
    with pytest.raises(ValueError, match="Hopper"):
        sparse_mla_gluon(d["q"], d["latent_cache"], d["block_table"], d["seq_lens"],
                         d["topk_indices"], d["token_req"], kv_lora_rank=512,
                         scale=SCALE)  # fmt: skip


@pytest.mark.parametrize(
    "change,takes",
    [
        ({}, True),
        (dict(latent_cache=torch.zeros(4, 16, 576, dtype=BF16)), True),  # any page size
        (dict(latent_cache=torch.zeros(4, 1, 576, dtype=BF16)), True),
        (dict(q=torch.zeros(3, 64, 576, dtype=BF16)), True),
        (dict(kv_lora_rank=256), False),
        (dict(q=torch.zeros(3, 96, 576, dtype=BF16)), False),
        (dict(q=torch.zeros(3, 16, 576, dtype=BF16)), False),  # 16 heads: Triton
        (dict(q=torch.zeros(3, 128, 576, dtype=torch.float16)), False),
        (dict(latent_cache=torch.zeros(4, 64, 656, dtype=torch.uint8)), False),  # fp8 rows
        (dict(q=torch.zeros(65536, 64, 576, dtype=BF16)), False),  # past the grid's y limit
    ],
)
def test_the_class_the_kernel_table_sends_here(change, takes):
    """``mla.sparse/gluon``'s ``takes`` (what the plan asks of the layer) for these inputs."""
    d = _inputs(**change)
    q, cache, rank = d["q"], d["latent_cache"], d["kv_lora_rank"]
    problem = tensor_problem(q, cache, num_heads=q.shape[1], num_kv_heads=1, head_size=q.shape[2],
                             head_size_v=rank, kv_lora_rank=rank, max_rows=q.shape[0])
    variant = get_variant("mla.sparse", "gluon")
    assert (variant.takes(problem) == []) is takes, variant.takes(problem)
    # on CPU the pick passes the Gluon kernel over: it runs on Hopper only
    assert any("runs on cuda" in r for r in reasons(variant, problem))


# The kernel's launches (unsplit: bf16 rows out; split: fp32 partials + the merge; a page of 16
# rows), recorded on CPU tensors through the launcher the entry point calls after its checks.
_LAUNCHES = r"""
try:
    import attnserve.ops.mla.sparse_gluon as gs
except ImportError as exc:
    print(exc); sys.exit(77)
import attnserve.ops.mla.latent as tm

record(gs, "_sparse_mla_gluon_kernel")
record(tm, "_merge_kernel")
q = torch.zeros(3, 128, 576, dtype=torch.bfloat16)
table = torch.zeros(2, 8, dtype=torch.int32)
lens = torch.zeros(2, dtype=torch.int32)
idx = torch.zeros(3, 2048, dtype=torch.int32)
req = torch.zeros(3, dtype=torch.int32)
for page, splits in ((64, 1), (64, 4), (16, 1)):
    cache = torch.zeros(17, page, 576, dtype=torch.bfloat16)
    gs._launch(q, cache, table, lens, idx, req, 0.1352, None, splits)
"""


def test_kernel_compiles_for_sm90_without_spills():
    infos = compile_for_sm90(_LAUNCHES, ptxas=True)
    gluon = [i for i in infos if i["kernel"] == "_sparse_mla_gluon_kernel"]
    assert [i["kernel"] for i in infos].count("_merge_kernel") == 1
    assert len(gluon) == 3, infos
    for info in gluon:
        assert info["spill"] == 0, info
        assert info["shared"] <= 227 * 1024, info  # Q, two gathered stages, P: ~225 KB
        assert info["wgmma"] == [
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",  # P @ V, 128 columns a WG
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16",  # S, 32 keys a WG
        ], info
        # first tile's scores, the loop's P @ V (3 score groups may stay) and scores, the last
        # P @ V: four waits, no per-MMA ones
        assert info["wgmma_waits"] == [0, 0, 0, 3], info
        assert info["tma_loads"] == 0, info  # rows are gathered, not tiled
        # 3 column ranges x (2 prologue tiles + 1 in the loop), each by 16-byte copies
        assert info["async_copies"] == 9, info
        assert info["cp_async_bytes"] == [16], info


def _nan_cache(lens, page, seed, fp8=False):
    """NaN-filled cache of ``page``-row blocks with each request's rows in shuffled blocks
    (``fp8``: 656-byte rows, all bytes 0xFF: e4m3, scale and rope NaN)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // page) for n in lens]
    shape = (sum(blocks) + 1, page, 656 if fp8 else 576)
    if fp8:
        cache = torch.full(shape, 255, dtype=torch.uint8)
    else:
        cache = torch.full(shape, float("nan"), dtype=BF16)
    table = torch.zeros(len(lens), max(max(blocks), 1), dtype=torch.int32)
    free = (torch.randperm(sum(blocks), generator=gen) + 1).tolist()
    for i, (n, b) in enumerate(zip(lens, blocks)):
        table[i, :b] = torch.tensor(free[:b], dtype=torch.int32)
        free = free[b:]
        pos = torch.arange(n)
        slots = table[i].long()[pos // page] * page + pos % page
        write_latent(cache, torch.randn(n, 512, generator=gen), torch.randn(n, 64, generator=gen),
                     slots)  # fmt: skip
    return cache, table


def _sparse_case(k, page, seed=3, fp8=False):
    """Decode rows of three requests and four prefill rows of a fourth: row 0 all -1, row 1
    some -1 and some positions past its request's length, the rest random distinct picks."""
    lens = [700, 3000, 129, 2500]
    reqs = [0, 1, 2, 3, 3, 3, 3]
    gen = torch.Generator().manual_seed(seed)
    cache, table = _nan_cache(lens, page, seed, fp8)
    idx = torch.full((len(reqs), k), -1, dtype=torch.int32)
    for t, r in enumerate(reqs):
        pick = torch.randperm(lens[r] + 64, generator=gen)[:k]  # some past the length
        idx[t, : pick.numel()] = pick.to(torch.int32)
    idx[0] = -1
    idx[1, ::3] = -1
    seen = torch.where(idx < torch.tensor(lens)[torch.tensor(reqs)][:, None], idx, -1)
    return cache, table, lens, reqs, idx, seen


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="the Gluon kernel runs on Hopper GPUs only",
)
@pytest.mark.parametrize("k,page,splits", [(2048, 64, None), (2048, 64, 1), (100, 16, 4),
                                           (2048, 16, None), (64, 64, 1)])  # fmt: skip
def test_matches_twin_on_hopper(k, page, splits):
    cache, table, lens, reqs, idx, seen = _sparse_case(k, page)
    q = torch.randn(len(reqs), 128, 576, generator=torch.Generator().manual_seed(2))
    q = q.bfloat16().float()  # the kernel reads bf16 queries
    # the twin maps row t to request owner[t]; it skips -1 only, so past-length picks are -1
    qsl = torch.tensor([0, 1, 2, 3, 7])
    ref = sparse_mla_attention(q, cache, table, seen, kv_lora_rank=512, scale=SCALE,
                               query_start_loc=qsl)  # fmt: skip
    dev = torch.device("cuda")
    out = torch.full((len(reqs), 128, 512), float("nan"), dtype=BF16, device=dev)
    sparse_mla_gluon(q.to(dev, BF16), cache.to(dev), table.to(dev),
                     torch.tensor(lens, dtype=torch.int32, device=dev), idx.to(dev),
                     torch.tensor(reqs, dtype=torch.int32, device=dev), kv_lora_rank=512,
                     scale=SCALE, out=out, num_splits=splits)  # fmt: skip
    out = out.cpu().float()
    assert (out[0] == 0).all(), "a row with no selected rows gives 0"
    assert not out.isnan().any(), "an unused slot or a row past a sequence was read"
    err = (out[1:] - ref[1:]).abs().max() / ref[1:].abs().max()
    assert err < 2e-2, err
