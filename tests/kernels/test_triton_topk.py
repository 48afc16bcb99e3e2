"""``ops/indexer/topk_triton.topk_rows`` (radix select) against ``torch.topk``, under Triton's interpreter.

Rows are split into chunks (512 columns under the interpreter), each its own program, so ties
and the cut fall across chunk boundaries here. The selection is a set: each row's selected scores, sorted, must equal torch's top-k values,
with no column twice, none at or past the row's length, -1 filling the slots of rows with fewer
finite scores; ties at the cut go to the earlier columns. Columns past a row's length hold NaN,
so a kernel that read them would select them or break the count.
"""

from __future__ import annotations

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from attnserve.ops.indexer.topk_triton import topk_rows  # noqa: E402
from attnserve.ops.mla.sparse_triton import topk_from_logits  # noqa: E402


def check(scores: torch.Tensor, lens: torch.Tensor, topk: int, got: torch.Tensor) -> None:
    assert got.shape == (scores.shape[0], topk) and got.dtype == torch.int32
    for r in range(scores.shape[0]):
        row = scores[r, : int(lens[r])]
        want = topk_from_logits(row[None], topk)[0]  # the PyTorch twin: torch.topk
        want = want[want >= 0].long()
        sel = got[r][got[r] >= 0].long()
        assert sel.numel() == want.numel(), r
        assert torch.equal(got[r][sel.numel():], torch.full((topk - sel.numel(),), -1, dtype=torch.int32)), r
        assert torch.equal(sel, sel.sort().values) and len(set(sel.tolist())) == sel.numel(), r
        assert (sel < len(row)).all(), r
        assert torch.equal(row[sel].sort().values, row[want].sort().values), r


def test_random_rows_and_lengths():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 900, generator=gen)
    lens = torch.tensor([900, 1, 0, 517, 64, 65])
    for r, n in enumerate(lens.tolist()):
        scores[r, n:] = float("nan")  # never read
    check(scores, lens, 64, topk_rows(scores, lens, 64))


def test_masked_keys_ties_and_signs():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(5, 1100, generator=gen) * 1e-3  # 3 chunks of 512 per row
    scores[0, 30:] = float("-inf")  # fewer finite keys than topk: all of them, then -1
    scores[1] = torch.randint(-2, 3, (1100,), generator=gen).float()  # heavy ties, across chunks
    scores[2, ::2] = float("-inf")  # a causal-like mask inside the row
    scores[3] = -torch.rand(1100, generator=gen) - 1  # all negative
    scores[4] = 0.0  # one value everywhere: the first topk columns
    lens = torch.full((5,), 1100)
    got = topk_rows(scores, lens, 40)
    check(scores, lens, 40, got)
    assert torch.equal(got[4], torch.arange(40, dtype=torch.int32))
    ties = scores[1]
    cut = ties[got[1].long()].min()
    above = (ties > cut).nonzero().flatten()
    assert set(above.tolist()) <= set(got[1].tolist())
    equal_taken = [c for c in got[1].tolist() if ties[c] == cut]
    assert equal_taken == (ties == cut).nonzero().flatten().tolist()[: len(equal_taken)]  # earliest first


def test_lens_beyond_width_and_wide_buffer():
    """lens are clamped to the width; a strided view of a wider buffer works."""
    gen = torch.Generator().manual_seed(2)
    buf = torch.randn(3, 512, generator=gen)
    scores = buf[:, :300]
    lens = torch.tensor([1000, 300, 7])
    check(scores, lens.clamp(max=300), 16, topk_rows(scores, lens, 16))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="float32"):
        topk_rows(torch.zeros(2, 8, dtype=torch.float16), torch.ones(2, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="lens"):
        topk_rows(torch.zeros(2, 8), torch.ones(3, dtype=torch.int32), 2)
