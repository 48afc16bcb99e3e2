"""The Gluon sparse MLA kernel over fp8 latent rows (``ops/mla/sparse_gluon_fp8``): its input
checks and class, its sm_90 compile, and on a Hopper GPU its output against the PyTorch twin.

Gluon has no interpreter, so on CPU the kernel is only compiled (``sm90.py``) and its compiled
form checked for what the design promises: no spills, shared memory within the 227 KB a block
may take (Q, one converted tile, two raw and two rope stages, P), the bf16 kernel's MMA shapes,
the waits of the half-by-half pipeline, the rows gathered by ``cp.async`` (16-byte pieces, the
scales by 4 bytes; no TMA) and dequantised from e4m3. The numeric test runs only where a Hopper
GPU is (``benchmarks/gpu_mla_sparse_gluon.py --rows fp8`` times it there).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon", reason="Triton without Gluon")

from attnserve.attention.backend import tensor_problem  # noqa: E402
from attnserve.attention.kernels import get_variant, reasons  # noqa: E402
from attnserve.attention.reference_mla import sparse_mla_attention  # noqa: E402
from attnserve.ops.mla.sparse_gluon_fp8 import (  # noqa: E402
    check_sparse_gluon_fp8_inputs,
    sparse_mla_gluon_fp8,
)
from tests.kernels.sm90 import compile_for_sm90  # noqa: E402
from tests.kernels.test_gluon_mla_sparse import _sparse_case  # noqa: E402

SCALE = 0.1352
BF16 = torch.bfloat16
U8 = torch.uint8


def _inputs(rows=3, heads=128, reqs=2, k=128, **over):
    d = dict(q=torch.zeros(rows, heads, 576, dtype=BF16),
             latent_cache=torch.zeros(4, 64, 656, dtype=U8),
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
        (dict(kv_lora_rank=256), "sparse_mla_gluon_fp8 takes kv_lora_rank 512"),
        (dict(q=torch.zeros(3, 128, 320, dtype=BF16)), r"q must be \[rows, heads, 576\]"),
        (dict(q=torch.zeros(3, 96, 576, dtype=BF16)), "multiple of 64"),
        (dict(q=torch.zeros(3, 128, 576, dtype=torch.float16)), "bf16 q and uint8 fp8 rows"),
        (dict(latent_cache=torch.zeros(4, 64, 576, dtype=BF16)), r"\[blocks, page, 656\]"),
        (dict(latent_cache=torch.zeros(4, 64, 328, dtype=BF16)), r"\[blocks, page, 656\]"),
        (dict(latent_cache=torch.zeros(4, 64, 656, dtype=torch.int8)), "uint8 fp8 rows"),
        (dict(latent_cache=torch.zeros(64, 4, 656, dtype=U8).transpose(0, 1)), "contiguous"),
        (dict(latent_cache=torch.zeros(4 * 64 * 656 + 8, dtype=U8)[8:].view(4, 64, 656)),
         "16-byte aligned"),  # fmt: skip
        (dict(q=torch.zeros(3, 576, 128, dtype=BF16).transpose(1, 2)), "contiguous"),
        (dict(block_table=torch.zeros(2, 3, dtype=torch.int64)), "block_table"),
        (dict(seq_lens=torch.zeros(3, dtype=torch.int32)), r"seq_lens must be int32 \[2\]"),
        (dict(topk_indices=torch.zeros(3, 128, dtype=torch.int64)), "2-D int32"),
        (dict(topk_indices=torch.zeros(2, 128, dtype=torch.int32)), r"\[3, K\]"),
        (dict(token_req=torch.zeros(4, dtype=torch.int64)), r"int32 or int64 \[3\]"),
        (dict(out=torch.zeros(3, 128, 256, dtype=BF16)), "out must be"),
        ({}, "sparse_mla_gluon_fp8 runs on Hopper"),  # everything right, but on CPU
        (dict(latent_cache=torch.zeros(9, 16, 656, dtype=U8)), "Hopper"),  # page 16 is taken
    ],
)
def test_inputs_outside_the_class_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        check_sparse_gluon_fp8_inputs(**_inputs(**change))


def test_entry_point_checks_before_launching():
    d = _inputs()
    with pytest.raises(ValueError, match="Hopper"):
        sparse_mla_gluon_fp8(d["q"], d["latent_cache"], d["block_table"], d["seq_lens"],
                             d["topk_indices"], d["token_req"], kv_lora_rank=512,
                             scale=SCALE)  # fmt: skip


@pytest.mark.parametrize(
    "change,takes",
    [
        ({}, True),
        (dict(latent_cache=torch.zeros(4, 16, 656, dtype=U8)), True),  # any page size
        (dict(latent_cache=torch.zeros(4, 1, 656, dtype=U8)), True),
        (dict(q=torch.zeros(3, 64, 576, dtype=BF16)), True),
        (dict(kv_lora_rank=256), False),
        (dict(q=torch.zeros(3, 96, 576, dtype=BF16)), False),
        (dict(q=torch.zeros(3, 16, 576, dtype=BF16)), False),  # 16 heads: Triton
        (dict(q=torch.zeros(3, 128, 576, dtype=torch.float16)), False),
        (dict(latent_cache=torch.zeros(4, 64, 576, dtype=BF16)), False),  # bf16 rows
        (dict(q=torch.zeros(65536, 64, 576, dtype=BF16)), False),  # past the grid's y limit
    ],
)
def test_the_class_the_kernel_table_sends_here(change, takes):
    """``mla.sparse/gluon_fp8``'s ``takes`` (what the plan asks of the layer) for these inputs."""
    d = _inputs(**change)
    q, cache, rank = d["q"], d["latent_cache"], d["kv_lora_rank"]
    problem = tensor_problem(q, cache, num_heads=q.shape[1], num_kv_heads=1, head_size=q.shape[2],
                             head_size_v=rank, kv_lora_rank=rank, max_rows=q.shape[0])
    variant = get_variant("mla.sparse", "gluon_fp8")
    assert (variant.takes(problem) == []) is takes, variant.takes(problem)
    # on CPU the pick passes the Gluon kernel over: it runs on Hopper only
    assert any("runs on cuda" in r for r in reasons(variant, problem))


# The kernel's launches (unsplit: bf16 rows out; split: fp32 partials + the merge; a page of 16
# rows), recorded on CPU tensors through the launcher the entry point calls after its checks.
_LAUNCHES = r"""
try:
    import attnserve.ops.mla.sparse_gluon_fp8 as gs
except ImportError as exc:
    print(exc); sys.exit(77)
import attnserve.ops.mla.latent as tm

record(gs, "_sparse_mla_gluon_fp8_kernel")
record(tm, "_merge_kernel")
q = torch.zeros(3, 128, 576, dtype=torch.bfloat16)
table = torch.zeros(2, 8, dtype=torch.int32)
lens = torch.zeros(2, dtype=torch.int32)
idx = torch.zeros(3, 2048, dtype=torch.int32)
req = torch.zeros(3, dtype=torch.int32)
for page, splits in ((64, 1), (64, 4), (16, 1)):
    cache = torch.zeros(17, page, 656, dtype=torch.uint8)
    gs._launch(q, cache, table, lens, idx, req, 0.1352, None, splits)
"""


def test_kernel_compiles_for_sm90_without_spills():
    infos = compile_for_sm90(_LAUNCHES, ptxas=True)
    gluon = [i for i in infos if i["kernel"] == "_sparse_mla_gluon_fp8_kernel"]
    assert [i["kernel"] for i in infos].count("_merge_kernel") == 1
    assert len(gluon) == 3, infos
    for info in gluon:
        assert info["spill"] == 0, info
        # Q 72 KB, converted tile 64, two raw stages 66, two rope stages 16, P 8: ~227 KB
        assert info["shared"] <= 227 * 1024, info
        assert info["wgmma"] == [
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",  # P @ V, 128 columns a WG
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16",  # S, 32 keys a WG
        ], info
        # first tile's scores; in the loop: P @ V half 0 (half 1 may stay), half 1 (the scores
        # over half 0 may stay), the scores; the last P @ V
        assert info["wgmma_waits"] == [0, 0, 0, 1, 1], info
        assert info["tma_loads"] == 0, info  # rows are gathered, not tiled
        # 3 parts (values, scales, rope) x (2 prologue tiles + 1 after tile 0 + 1 in the loop)
        assert info["async_copies"] == 12, info
        assert info["cp_async_bytes"] == [4, 16], info  # scales by 4 bytes, the rest by 16
        assert info["e4m3_cvts"] > 0, info  # the values are dequantised from e4m3 pairs


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="the Gluon kernel runs on Hopper GPUs only",
)
@pytest.mark.parametrize("k,page,splits", [(2048, 64, None), (2048, 64, 1), (100, 16, 4),
                                           (2048, 16, None), (64, 64, 1), (192, 64, 1)])  # fmt: skip
def test_matches_twin_on_hopper(k, page, splits):
    cache, table, lens, reqs, idx, seen = _sparse_case(k, page, fp8=True)
    q = torch.randn(len(reqs), 128, 576, generator=torch.Generator().manual_seed(2))
    q = q.bfloat16().float()  # the kernel reads bf16 queries
    # the twin maps row t to request owner[t]; it skips -1 only, so past-length picks are -1
    qsl = torch.tensor([0, 1, 2, 3, 7])
    ref = sparse_mla_attention(q, cache, table, seen, kv_lora_rank=512, scale=SCALE,
                               query_start_loc=qsl)  # fmt: skip
    dev = torch.device("cuda")
    out = torch.full((len(reqs), 128, 512), float("nan"), dtype=BF16, device=dev)
    sparse_mla_gluon_fp8(q.to(dev, BF16), cache.to(dev), table.to(dev),
                         torch.tensor(lens, dtype=torch.int32, device=dev), idx.to(dev),
                         torch.tensor(reqs, dtype=torch.int32, device=dev), kv_lora_rank=512,
                         scale=SCALE, out=out, num_splits=splits)  # fmt: skip
    out = out.cpu().float()
    assert (out[0] == 0).all(), "a row with no selected rows gives 0"
    assert not out.isnan().any(), "an unused slot or a row past a sequence was read"
    err = (out[1:] - ref[1:]).abs().max() / ref[1:].abs().max()
    assert err < 2e-2, err
