"""The Gluon MLA decode kernel (``ops/mla/decode_gluon``): its input checks, its sm_90 compile, and on a
Hopper GPU its output against the PyTorch twin.

Gluon has no interpreter, so on CPU the kernel is only compiled (``sm90.py``: TTGIR, PTX, the
bundled ptxas) and its compiled form checked for what the design promises: no spills, shared
memory within the 227 KB a block may take, the score MMA split between the two warp groups
(``m64n32k16``: 32 of the 64 keys each, not all 64 twice) and P @ V by 128-column halves, one
wait for the three score MMAs of a page, and the TMA loads. The numeric test runs only where a
Hopper GPU is (``benchmarks/gpu_mla_gluon.py`` times it there).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon", reason="Triton without Gluon")

from attnserve.attention.backend import tensor_problem  # noqa: E402
from attnserve.attention.kernels import get_variant, reasons  # noqa: E402
from attnserve.attention.reference_mla import sparse_mla_attention, write_latent  # noqa: E402
from attnserve.ops.mla.decode_gluon import (  # noqa: E402
    check_gluon_inputs,
    mla_decode_gluon,
)
from tests.kernels.sm90 import compile_for_sm90  # noqa: E402

SCALE = 0.1352


def _inputs(rows=2, heads=128, device="cpu", blocks=4, **over):
    d = dict(q=torch.zeros(rows, heads, 576, dtype=torch.bfloat16, device=device),
             latent_cache=torch.zeros(blocks, 64, 576, dtype=torch.bfloat16, device=device),
             block_table=torch.zeros(rows, 3, dtype=torch.int32, device=device),
             seq_lens=torch.zeros(rows, dtype=torch.int32, device=device),
             kv_lora_rank=512, out=None)  # fmt: skip
    d.update(over)
    return d


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(kv_lora_rank=256), "kv_lora_rank 512"),
        (dict(q=torch.zeros(2, 128, 320, dtype=torch.bfloat16)), r"q must be \[rows, heads, 576\]"),
        (dict(q=torch.zeros(2, 96, 576, dtype=torch.bfloat16)), "multiple of 64 or fewer"),
        (dict(q=torch.zeros(2, 128, 576, dtype=torch.float16)), "bf16"),
        (dict(latent_cache=torch.zeros(4, 32, 576, dtype=torch.bfloat16)), r"\[blocks, 64, 576\]"),
        (dict(latent_cache=torch.zeros(4, 64, 656, dtype=torch.uint8)), r"\[blocks, 64, 576\]"),
        (dict(q=torch.zeros(2, 576, 128, dtype=torch.bfloat16).transpose(1, 2)), "contiguous"),
        (dict(block_table=torch.zeros(2, 3, dtype=torch.int64)), "int32"),
        (dict(seq_lens=torch.zeros(3, dtype=torch.int32)), r"seq_lens must be int32 \[2\]"),
        (dict(out=torch.zeros(2, 128, 256, dtype=torch.bfloat16)), "out must be"),
        ({}, "Hopper"),  # everything right, but on CPU
    ],
)
def test_inputs_outside_the_class_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        check_gluon_inputs(**_inputs(**change))


def test_entry_point_checks_before_launching():
    d = _inputs()
    with pytest.raises(ValueError, match="Hopper"):
        mla_decode_gluon(d["q"], d["latent_cache"], d["block_table"], d["seq_lens"],
                         kv_lora_rank=512, scale=SCALE, max_seq_len=64)  # fmt: skip


@pytest.mark.parametrize(
    "change,takes",
    [
        ({}, True),
        (dict(kv_lora_rank=256), False),
        (dict(q=torch.zeros(2, 96, 576, dtype=torch.bfloat16)), False),
        (dict(q=torch.zeros(2, 16, 576, dtype=torch.bfloat16)), True),  # rows padded to 64
        (dict(q=torch.zeros(2, 32, 576, dtype=torch.bfloat16)), True),
        (dict(q=torch.zeros(2, 128, 576, dtype=torch.float16)), False),
        (dict(latent_cache=torch.zeros(4, 16, 576, dtype=torch.bfloat16)), False),  # page 16
        (dict(latent_cache=torch.zeros(4, 64, 656, dtype=torch.uint8)), False),  # fp8 rows
    ],
)
def test_the_class_the_kernel_table_sends_here(change, takes):
    """``mla.absorbed/gluon``'s ``takes`` (what the plan asks of the layer) for these inputs."""
    d = _inputs(**change)
    q, cache, rank = d["q"], d["latent_cache"], d["kv_lora_rank"]
    problem = tensor_problem(q, cache, num_heads=q.shape[1], num_kv_heads=1, head_size=q.shape[2],
                             head_size_v=rank, kv_lora_rank=rank, max_rows=q.shape[0])
    variant = get_variant("mla.absorbed", "gluon")
    assert (variant.takes(problem) == []) is takes, variant.takes(problem)
    # on CPU the pick passes the Gluon kernel over: it runs on Hopper only
    assert any("runs on cuda" in r for r in reasons(variant, problem))


# The kernel's launches (unsplit: bf16 rows out; split: fp32 partials + the merge), recorded on
# CPU tensors through the launcher the entry point calls after its checks.
_LAUNCHES = r"""
try:
    import attnserve.ops.mla.decode_gluon as gm
except ImportError as exc:
    print(exc); sys.exit(77)
import attnserve.ops.mla.latent as tm

record(gm, "_mla_decode_gluon_kernel")
record(tm, "_merge_kernel")
q = torch.zeros(3, 128, 576, dtype=torch.bfloat16)
cache = torch.zeros(17, 64, 576, dtype=torch.bfloat16)
table = torch.zeros(3, 8, dtype=torch.int32)
lens = torch.zeros(3, dtype=torch.int32)
for splits in (1, 4):
    gm._launch(q, cache, table, lens, 0.1352, 512, None, splits)
gm._launch(q[:, :16], cache, table, lens, 0.1352, 512, None, 4)  # 16 heads: padding rows
"""


def test_kernel_compiles_for_sm90_without_spills():
    infos = compile_for_sm90(_LAUNCHES, ptxas=True)
    gluon = [i for i in infos if i["kernel"] == "_mla_decode_gluon_kernel"]
    assert "_merge_kernel" in [i["kernel"] for i in infos]
    assert len(gluon) == 3, infos  # unsplit, split, split at 16 heads
    for info in gluon:
        assert info["spill"] == 0, info
        assert info["shared"] <= 227 * 1024, info  # Q, two page stages, P: ~225 KB
        assert info["wgmma"] == [
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",  # P @ V, 128 columns a WG
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16",  # S, 32 keys a WG
        ], info
        # first page's scores, the loop's P @ V (3 score groups may stay) and scores, the last
        # P @ V: four waits, no per-MMA ones
        assert info["wgmma_waits"] == [0, 0, 0, 3], info
        assert info["tma_loads"] == 9, info  # 3 boxes x (2 prologue pages + 1 in the loop)


def _nan_cache(lens, seed):
    """NaN-filled cache with each request's rows in shuffled blocks (never block 0)."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // 64) for n in lens]
    cache = torch.full((sum(pages) + 1, 64, 576), float("nan"), dtype=torch.bfloat16)
    table = torch.zeros(len(lens), max(max(pages), 1), dtype=torch.int32)
    free = (torch.randperm(sum(pages), generator=gen) + 1).tolist()
    for i, (n, p) in enumerate(zip(lens, pages)):
        table[i, :p] = torch.tensor(free[:p], dtype=torch.int32)
        free = free[p:]
        pos = torch.arange(n)
        slots = table[i].long()[pos // 64] * 64 + pos % 64
        write_latent(cache, torch.randn(n, 512, generator=gen), torch.randn(n, 64, generator=gen),
                     slots)  # fmt: skip
    return cache, table


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="the Gluon kernel runs on Hopper GPUs only",
)
@pytest.mark.parametrize("splits", [1, 4, None])
@pytest.mark.parametrize("heads", [128, 16])
def test_matches_twin_on_hopper(splits, heads):
    lens = [0, 1, 63, 64, 65, 1000, 4097]
    cache, table = _nan_cache(lens, seed=1)
    q = torch.randn(len(lens), heads, 576, generator=torch.Generator().manual_seed(2))
    q = q.bfloat16().float()  # the kernel reads bf16 queries
    pos = torch.full((len(lens), max(lens)), -1, dtype=torch.int32)
    for i, n in enumerate(lens):
        pos[i, :n] = torch.arange(n)
    ref = sparse_mla_attention(q, cache, table, pos, kv_lora_rank=512, scale=SCALE)
    dev = torch.device("cuda")
    out = torch.full((len(lens), heads, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    mla_decode_gluon(q.to(dev, torch.bfloat16), cache.to(dev), table.to(dev),
                     torch.tensor(lens, dtype=torch.int32, device=dev), kv_lora_rank=512,
                     scale=SCALE, max_seq_len=max(lens), out=out, num_splits=splits)  # fmt: skip
    out = out.cpu().float()
    assert (out[0] == 0).all(), "a request with no keys gives 0"
    assert not out.isnan().any(), "a row past a sequence or an unused slot was read"
    err = (out[1:] - ref[1:]).abs().max() / ref[1:].abs().max()
    assert err < 2e-2, err
