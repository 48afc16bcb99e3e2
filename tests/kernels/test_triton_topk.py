"""``ops/indexer/topk_triton.topk_rows`` (radix select) and ``topk_twopass.topk_rows_twopass``
(sketch, collect, resolve) against ``torch.topk``, under Triton's interpreter.

Rows are split into chunks (512 columns under the interpreter; 1024 for the two-pass kernel),
each its own program, so ties and the cut fall across chunk boundaries here. The two-pass tests
also check which way each row's cut was resolved (``resolve_paths``), so that every branch of the
resolve launch runs: a tile in registers (min, max, pairwise rank, radix rounds), several buffer
tiles, and the fallback over the row itself when the candidates overflow the buffer.
The selection is a set: each row's selected scores, sorted, must equal torch's top-k values,
with no column twice, none at or past the row's length, -1 filling the slots of rows with fewer
finite scores; ties at the cut go to the earlier columns. Columns past a row's length hold NaN,
so a kernel that read them would select them or break the count.
"""

from __future__ import annotations

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from attnserve.ops.indexer.topk_triton import topk_rows  # noqa: E402
from attnserve.ops.indexer.topk_twopass import (  # noqa: E402
    TwoPassConfig,
    pick_twopass_config,
    sketch_rows,
    topk_rows_twopass,
    topk_workspace,
)
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


def _select(name):
    return topk_rows if name == "radix" else topk_rows_twopass


SELECTS = pytest.mark.parametrize("select", ["radix", "twopass"])  # the same contract


@SELECTS
def test_random_rows_and_lengths(select):
    topk_rows = _select(select)
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 900, generator=gen)
    lens = torch.tensor([900, 1, 0, 517, 64, 65])
    for r, n in enumerate(lens.tolist()):
        scores[r, n:] = float("nan")  # never read
    check(scores, lens, 64, topk_rows(scores, lens, 64))


@SELECTS
def test_masked_keys_ties_and_signs(select):
    topk_rows = _select(select)
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


@SELECTS
def test_lens_beyond_width_and_wide_buffer(select):
    """lens are clamped to the width; a strided view of a wider buffer works."""
    topk_rows = _select(select)
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


# --- topk_rows_twopass (sketch, collect, resolve): the same contract, the same result -------------


def resolve_paths(ws: dict, topk: int) -> set[str]:
    """Which way the resolve launch took for each row (mirrors ``_resolve_kernel``'s branches)."""
    cfg, out = ws["config"], set()
    for r in range(ws["meta"].shape[0]):
        total = int(ws["meta"][r, 0])
        if total <= topk:
            out.add("all")
            continue
        if total > cfg.cap:
            out.add("row")
            continue
        hist = ws["hist2"][r]
        at_least = hist.flip(0).cumsum(0).flip(0)
        b2 = int((at_least >= topk).nonzero().max())
        quota = topk - int(hist[b2 + 1 :].sum())
        members = int(hist[b2])
        if total > cfg.tile:
            out.add("buffer-" + ("pairwise" if members <= 64 else "rounds"))
        else:
            kind = (
                "min"
                if quota == members
                else "max"
                if quota == 1
                else "pairwise"
                if members <= 64
                else "rounds"
            )
            out.add("tile-" + kind)
    return out


def twopass(scores, lens, topk, config=None):
    ws = topk_workspace(scores.shape[0], scores.shape[1], topk, scores.device, config)
    got = topk_rows_twopass(scores, lens, topk, workspace=ws)
    check(
        scores, lens.clamp(max=scores.shape[1]), topk, got
    )  # with the ties rule: topk_rows' result
    return got, resolve_paths(ws, topk)


def test_twopass_random_ragged_rows():
    """Rows of up to 9000 columns in chunks of 1024 (the interpreter's), ragged, NaN past each
    length; groups of 2 to 16 keys in the sketch."""
    gen = torch.Generator().manual_seed(10)
    scores = (
        torch.randn(6, 9000, generator=gen)
        * torch.tensor([1.0, 1e-3, 30.0, 1.0, 1.0, 1.0])[:, None]
    )
    lens = torch.tensor([9000, 8191, 5000, 3000, 1, 0])
    for r, n in enumerate(lens.tolist()):
        scores[r, n:] = float("nan")
    paths = set()
    for topk in (64, 256):
        paths |= twopass(scores, lens, topk)[1]
    assert paths >= {"all", "tile-min"}, paths
    assert torch.equal(
        topk_rows_twopass(scores[:4, :3000], lens[:4], 64),
        topk_rows(scores[:4, :3000], lens[:4], 64),
    )


def test_twopass_cut_bin_members_ranked_pairwise_and_by_rounds():
    """The cut falls among keys that share the candidate histogram's bin: 300 consecutive floats
    (a few members: ranked pairwise), or 200 equal scores (many: radix rounds)."""
    gen = torch.Generator().manual_seed(14)
    s = torch.rand(2, 3000, generator=gen) * 0.5
    steps = torch.randperm(3000, generator=gen)
    s[0, steps[:300]] = 1.0 + torch.arange(300, dtype=torch.float32) * 2.0**-23  # one ulp apart
    s[1, steps[:50]] = 3.0
    s[1, steps[50:250]] = 2.0  # the cut inside 200 ties: the earliest 50 columns of them
    got, paths = twopass(s, torch.tensor([3000, 3000]), 100)
    assert {"tile-pairwise", "tile-rounds"} <= paths, paths


def test_twopass_ties_masks_signs_and_clusters():
    """Every way the cut can fall: heavy ties, -inf masks, negatives, one value everywhere,
    scores outside the sketch's range, a hot block (clustered top keys), narrow rounded scores."""
    gen = torch.Generator().manual_seed(11)
    width = 6000
    s = torch.randn(8, width, generator=gen)
    s[0, 30:] = float("-inf")  # fewer finite keys than topk
    s[1] = torch.randint(-2, 3, (width,), generator=gen).float()  # 5 values: ties across chunks
    s[2, ::2] = float("-inf")
    s[3] = -torch.rand(width, generator=gen) - 1  # all negative
    s[4] = 0.25  # one value everywhere: the first topk columns
    s[5] *= 1e7  # outside the sketch's +-[2^-16, 2^16)
    s[6] += 10 * (torch.arange(width) >= width - 700).float()  # the top keys in one block
    s[7] = (s[7] * 4).round() / 4 + 100  # 100 +- 1 in quarters: a narrow range with ties
    lens = torch.full((8,), width)
    got, paths = twopass(s, lens, 100)
    assert torch.equal(got[4], torch.arange(100, dtype=torch.int32))
    assert (
        torch.equal(got[0][:30], torch.arange(30, dtype=torch.int32)) and (got[0][30:] == -1).all()
    )
    assert {"all", "buffer-rounds"} <= paths, paths


def test_twopass_fallbacks_small_buffer_and_tiles():
    """A buffer of 256 candidates: rows with more resolve over the row itself; tiles of 256:
    several buffer tiles a row; both exact."""
    gen = torch.Generator().manual_seed(12)
    width = 4000
    s = torch.randn(4, width, generator=gen)
    s[1] = torch.randint(0, 4, (width,), generator=gen).float()
    s[2] = 1.0
    lens = torch.tensor([4000, 3999, 2500, 700])
    base = pick_twopass_config(4, width, 80, s.device)
    small = TwoPassConfig(**{**base.__dict__, "cap": 256, "tile": 256})
    got, paths = twopass(s, lens, 80, small)
    assert "row" in paths, paths
    assert torch.equal(got[2], torch.arange(80, dtype=torch.int32))
    tiles = TwoPassConfig(**{**base.__dict__, "tile": 64})
    paths = twopass(s[:1], lens[:1], 80, tiles)[1] | twopass(s[3:], lens[3:], 80, tiles)[1]
    assert any(p.startswith("buffer-") for p in paths), paths
    # topk above the tile: rows with fewer finite keys copy the buffer tile by tile
    s[0, 1000:] = float("-inf")
    big = TwoPassConfig(**{**pick_twopass_config(4, width, 1500, s.device).__dict__, "tile": 512})
    got, paths = twopass(s[:2], lens[:2], 1500, big)
    assert "all" in paths and (got[0] >= 0).sum() == 1000, paths


def test_twopass_sketched_by_a_producer_and_wide_buffer():
    """``sketched=True`` skips pass 1 when a producer filled the sketch (here ``sketch_rows``);
    a strided view of a wider buffer, lens past the width."""
    gen = torch.Generator().manual_seed(13)
    buf = torch.randn(3, 2600, generator=gen)
    scores = buf[:, :2500]
    lens = torch.tensor([5000, 2500, 40])
    ws = topk_workspace(3, 2500, 48, scores.device)
    sketch_rows(scores, lens, 48, ws)
    got = topk_rows_twopass(scores, lens, 48, workspace=ws, sketched=True)
    check(scores, lens.clamp(max=2500), 48, got)


def test_twopass_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="float32"):
        topk_rows_twopass(
            torch.zeros(2, 8, dtype=torch.float16), torch.ones(2, dtype=torch.int32), 2
        )
    with pytest.raises(ValueError, match="lens"):
        topk_rows_twopass(torch.zeros(2, 8), torch.ones(3, dtype=torch.int32), 2)
    assert topk_rows_twopass(torch.zeros(0, 8), torch.zeros(0, dtype=torch.int32), 4).shape == (
        0,
        4,
    )
