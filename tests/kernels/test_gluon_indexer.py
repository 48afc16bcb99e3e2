"""The Gluon indexer decode kernel (``ops/indexer/logits_gluon``): its input checks and class, the
stage copy plan, its sm_90 compile, and on a Hopper GPU its logits against the float32 twin and
the Triton streaming kernel.

Gluon has no interpreter, so on CPU the kernel is only compiled (``sm90.py``) and its compiled
form checked for what the design promises: no spills, shared memory within the 227 KB a block
may take, one wgmma e4m3 form with keys as M (``m64n64k32``, 64 heads as N), pages copied by
16-byte ``cp.async`` and scales by 4-byte ones (no TMA), one wgmma wait a page. The numeric test
runs only where a Hopper GPU is: the checks of ``benchmarks/gpu_indexer_gluon.py`` (which times
it there). In one pytest session with ``test_triton_indexer.py`` (which sets TRITON_INTERPRET),
the Triton side of those checks runs under the interpreter: slower, still a valid check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon", reason="Triton without Gluon")

from attnserve.attention.backend import tensor_problem  # noqa: E402
from attnserve.attention.kernels import get_variant, reasons  # noqa: E402
from attnserve.ops.indexer.logits_gluon import (  # noqa: E402
    check_indexer_gluon_inputs,
    indexer_logits_gluon,
    pick_variant,
    row_pieces,
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
    for bad in (dict(stages=1), dict(stages=8), dict(waves=0)):
        with pytest.raises(ValueError, match="stages must be 2..7"):
            indexer_logits_gluon(**d, width=256, **bad)
    with pytest.raises(ValueError, match="variant must be one of"):
        indexer_logits_gluon(**d, width=256, variant="smem")


@pytest.mark.parametrize(
    "change,takes",
    [
        ({}, True),
        (dict(index_cache=torch.zeros(5, 64, 128, dtype=torch.bfloat16)), False),  # bf16 keys
        (dict(index_cache=torch.zeros(5, 16, 132, dtype=torch.uint8)), False),  # page 16
        (dict(q=torch.zeros(3, 16, 128, dtype=E4M3), head_weights=torch.zeros(3, 16)), False),
    ],
)
def test_the_class_the_kernel_table_sends_here(change, takes):
    """``indexer.decode/gluon``'s ``takes`` (what the plan asks of the layer) for these inputs."""
    d = _inputs(**change)
    q, cache = d["q"], d["index_cache"]
    problem = tensor_problem(q, cache, num_heads=q.shape[1], num_kv_heads=1, head_size=q.shape[2])
    variant = get_variant("indexer.decode", "gluon")
    assert (variant.takes(problem) == []) is takes, variant.takes(problem)
    assert any("runs on cuda" in r for r in reasons(variant, problem))


@pytest.mark.parametrize(
    "requests,width,variant",
    [(1, 131072, "tile"), (8, 8192, "tile"), (8, 32768, "regs"), (32, 8192, "regs"),
     (32, 131072, "regs"), (2, 131071, "tile")],
)
def test_large_launches_take_the_register_operand_variant(requests, width, variant):
    # measured on the H200: "regs" from 8 x 32K (262,144 keys) up, "tile" below
    assert pick_variant(requests, width) == variant


@pytest.mark.parametrize("stage", range(8))
def test_stage_copies_cover_the_page_in_aligned_slices(stage):
    """A stage's 33 rows of 256 bytes as slices the flat view takes: exactly the rows, in
    order, each starting at a multiple of its power-of-two length."""
    pieces = row_pieces(33 * stage, 33)
    rows = [r for start, n in pieces for r in range(start, start + n)]
    assert rows == list(range(33 * stage, 33 * stage + 33))
    assert all(n & (n - 1) == 0 and start % n == 0 for start, n in pieces)
    assert len(pieces) <= 7


# The kernel's launches (fill_hidden on and off; the default 3 stages, 7 and 2), recorded on CPU
# tensors through the launcher the entry point calls after its checks.
_SETUP = r"""
try:
    import attnserve.ops.indexer.logits_gluon as gi
except ImportError as exc:
    print(exc); sys.exit(77)

record(gi, "_indexer_gluon_kernel")
B, S = 4, 4096
nb = B * S // 64 + 1
cache = torch.zeros(nb, 64, 132, dtype=torch.uint8)
q = torch.zeros(B, 64, 128, dtype=torch.float8_e4m3fn)
table = torch.arange(1, nb, dtype=torch.int32).view(B, -1)
"""
_LAUNCHES = (
    _SETUP
    + r"""
for stages, fill in ((None, False), (None, True), (7, False), (2, False)):
    gi._launch(q, torch.zeros(B, 64), cache, table, torch.arange(0, B + 1, dtype=torch.int32),
               torch.full((B,), S, dtype=torch.int32), torch.full((B,), S - 1), S, 1.0, fill, 4,
               stages)
"""
)


def test_kernel_compiles_for_sm90_without_spills():
    infos = compile_for_sm90(_LAUNCHES, ptxas=True)
    assert [i["kernel"] for i in infos] == ["_indexer_gluon_kernel"] * 4, infos
    for info in infos:
        assert info["spill"] == 0, info
        assert info["shared"] <= 227 * 1024, info
        assert info["wgmma"] == ["wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3"], info
        assert not info["wgmma_a_regs"], info  # A (the keys) from the swizzled tile
        assert info["wgmma_waits"] and set(info["wgmma_waits"]) == {0}, info
        assert info["tma_loads"] == 0, info
        assert info["cp_async_bytes"] == [4, 16], info  # scales by 4 bytes, pages by 16
    three, seven, two = infos[0]["shared"], infos[2]["shared"], infos[3]["shared"]
    assert three <= 52 * 1024 < seven <= 100 * 1024, infos  # a 32 KB ring, then 64 KB
    assert two == three - 64 * 4, infos  # the same 32 KB ring (66 rows: 128), one scale stage less
    assert infos[0]["regs"] <= 128, infos[0]  # four programs an SM


# the variants with the keys as a register A ("regs": both fills, 3 stages and 7; "regs_inorder"),
# then the default
_LAUNCHES_REGS = (
    _SETUP
    + r"""
for stages, fill, variant in ((None, False, "regs"), (None, True, "regs"), (7, False, "regs"),
                              (None, False, "regs_inorder"), (None, False, "tile")):
    gi._launch(q, torch.zeros(B, 64), cache, table, torch.arange(0, B + 1, dtype=torch.int32),
               torch.full((B,), S, dtype=torch.int32), torch.full((B,), S - 1), S, 1.0, fill, 4,
               stages, variant)
"""
)


def test_regs_variant_compiles_for_sm90_with_a_from_registers():
    infos = compile_for_sm90(_LAUNCHES_REGS, ptxas=True)
    assert [i["kernel"] for i in infos] == ["_indexer_gluon_kernel"] * 5, infos
    *regs, tile = infos
    for info in regs:
        assert info["spill"] == 0, info
        assert info["wgmma"] == ["wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3"], info
        assert info["wgmma_a_regs"], info  # A (the keys) from registers
        assert info["wgmma_waits"] and set(info["wgmma_waits"]) == {0}, info
        assert info["tma_loads"] == 0, info
        assert info["cp_async_bytes"] == [4, 16], info
    assert not tile["wgmma_a_regs"], tile
    assert regs[0]["shared"] == regs[3]["shared"] == tile["shared"] - 64 * 128, infos  # no tile
    assert regs[0]["regs"] <= 128 and regs[3]["regs"] <= 128, infos  # four programs an SM


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="the Gluon kernel runs on Hopper GPUs only",
)
@pytest.mark.parametrize("case", range(5))
def test_matches_twin_and_triton_on_hopper(case):
    """The benchmark's checks (NaN-filled cache, lengths 0 / 1 / 63 / 64 / 65 / ... / 8191, a
    request with no token, a token before its last key, width past every length): Gluon (both
    variants) and Triton logits against the float32 twin, -inf exactly where the twin's is, and
    the "regs" variant against the default."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import gpu_indexer_gluon as bench

    fill_hidden, waves, stages = bench.CHECKS[case]
    row = bench.check_case(bench.FULL, fill_hidden, waves, "cuda", stages)
    assert row["ok"] and row["triton_rel_err"] <= bench.REL_TOL, row
    assert row["regs_rel_err"] <= bench.REL_TOL, row
    assert row["regs_vs_tile"] <= bench.VARIANT_TOL, row
