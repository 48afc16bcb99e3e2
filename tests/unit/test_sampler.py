"""Tests for the sampler: greedy, filters, seeded draws, frequencies, logprobs and penalties.

Filter sets are checked against a brute-force float64 per-row reference; frequencies with a
chi-square bound; logprobs, ranks and penalties against hand computations.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnserve.layers.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    gather_logprobs,
    sampling_probs,
)
from attnserve.sampling_params import SamplingParams

# chi-square with at most 3 degrees of freedom exceeds 30 with probability < 2e-6.
CHI2_BOUND = 30.0


def make_batch(params, *, seeds=None, outputs=None, prompts=None, banned=None) -> SamplingBatch:
    n = len(params)
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in (seeds or [None] * n)]
    return SamplingBatch.from_params(
        params,
        gens,
        outputs or [[] for _ in range(n)],
        prompts or [[] for _ in range(n)],
        banned,
        "cpu",
    )


def kept(probs: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row > 0).flatten().tolist()) for row in probs]


def reference_keep(row: list[float], temp: float, k: int, p: float, min_p: float):
    """Brute-force kept set for one row, plus how close any decision came to its boundary."""
    x = [v / temp for v in row]
    n = len(x)
    keep = set(range(n))
    margin = math.inf
    if 0 < k < n:
        keep = {i for i in keep if sum(x[j] > x[i] for j in range(n)) < k}

    def probs(ids: set[int]) -> dict[int, float]:
        m = max(x[i] for i in ids)
        e = {i: math.exp(x[i] - m) for i in ids}
        z = sum(e.values())
        return {i: v / z for i, v in e.items()}

    if p < 1.0:
        pr = probs(keep)
        above = {i: sum(pr[j] for j in keep if x[j] > x[i]) for i in keep}
        margin = min([margin] + [abs(a - p) for a in above.values() if a > 0])
        keep = {i for i in keep if above[i] < p}
    if min_p > 0.0:
        pr = probs(keep)
        top = max(pr.values())
        floor = min_p * top
        margin = min([margin] + [abs(v - floor) / top for v in pr.values() if v < top])
        keep = {i for i in keep if pr[i] >= floor}
    return keep, margin


def test_from_params_fields():
    params = [
        SamplingParams(temperature=0.0, top_k=-1, logprobs=2),
        SamplingParams(temperature=0.7, top_k=5, logprobs=4),
        SamplingParams(temperature=1.0),
    ]
    b = make_batch(params, banned=[[], [], []])
    assert b.top_k.tolist() == [0, 5, 0]
    assert b.top_p is None and b.min_p is None and b.banned_token_ids is None
    assert b.presence_penalty is None and b.repetition_penalty is None
    assert b.max_num_logprobs == 4
    assert not b.all_greedy and not b.all_random
    b = make_batch([SamplingParams(temperature=0.0, top_k=-1, top_p=0.5)] * 2, banned=[[1], []])
    assert b.all_greedy and b.top_k is None and b.top_p.tolist() == [0.5, 0.5]
    assert b.banned_token_ids == ([1], []) and b.max_num_logprobs is None
    b = make_batch([SamplingParams(repetition_penalty=1.5, min_p=0.1)])
    assert b.all_random and b.frequency_penalty is None
    assert b.repetition_penalty.tolist() == [1.5] and b.min_p.tolist() == pytest.approx([0.1])
    with pytest.raises(ValueError):
        SamplingBatch.from_params([SamplingParams()] * 2, [None], [[], []], [[], []], None, "cpu")


def test_greedy_is_argmax_and_skips_sort_and_draws(monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(16, 50)
    logits[3, [7, 9]] = 10.0  # a tie: argmax takes the first
    batch = make_batch([SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 16)

    def forbidden(*args, **kwargs):
        raise AssertionError("an all-greedy batch must not sort, softmax or draw")

    for name in ("sort", "topk", "softmax", "exponential_"):
        monkeypatch.setattr(torch.Tensor, name, forbidden, raising=False)
        monkeypatch.setattr(torch, name, forbidden, raising=False)
    out = Sampler()(logits, batch)
    monkeypatch.undo()
    assert out.logprobs is None
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids[3].item() == 7


def test_plain_greedy_takes_the_argmax_of_bf16_logits_without_a_float32_copy(monkeypatch):
    """No edits to the logits: the argmax runs on the head's dtype (the same token as in float32,
    ties included); with an edit (a bias) the float32 path runs and still agrees."""
    torch.manual_seed(1)
    logits = torch.randn(8, 300).to(torch.bfloat16)
    logits[2, [5, 250]] = 7.0  # a tie in bf16
    want = logits.float().argmax(dim=-1)
    batch = make_batch([SamplingParams(temperature=0.0)] * 8)
    assert not batch.edits_logits

    def no_copy(*args, **kwargs):
        raise AssertionError("plain greedy must not build float32 logits")

    monkeypatch.setattr("attnserve.layers.sampler.apply_penalties", no_copy)
    out = Sampler()(logits, batch)
    monkeypatch.undo()
    assert torch.equal(out.sampled_token_ids, want) and out.sampled_token_ids[2].item() == 5
    biased = make_batch([SamplingParams(temperature=0.0, logit_bias={250: 1.0})] * 8)
    assert biased.edits_logits
    assert Sampler()(logits, biased).sampled_token_ids[2].item() == 250
    lp = make_batch([SamplingParams(temperature=0.0, logprobs=2)] * 8)
    out = Sampler()(logits, lp)
    assert out.logprobs.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs.logprobs[:, 0], logits.float().log_softmax(-1).gather(1, want[:, None])[:, 0])


def test_filters_match_bruteforce_reference():
    gen = torch.Generator().manual_seed(1)
    vocab, checked, skipped, changed = 12, 0, 0, 0
    for _ in range(20):
        rows, params = [], []
        for _ in range(32):
            if torch.rand(1, generator=gen).item() < 0.7:  # integer logits: many ties
                row = torch.randint(-3, 4, (vocab,), generator=gen).float()
            else:
                row = torch.randn(vocab, generator=gen) * 2
            pick = lambda xs: xs[torch.randint(len(xs), (1,), generator=gen).item()]  # noqa: E731
            u = torch.rand(3, generator=gen).tolist()
            params.append(
                SamplingParams(
                    temperature=pick([0.3, 0.7, 1.0, 1.5]),
                    top_k=pick([0, 0, -1, 1, 2, 5, vocab, vocab + 3]),
                    top_p=pick([1.0, 1.0, 1e-6, 0.05 + 0.95 * u[0], 0.05 + 0.95 * u[1]]),
                    min_p=pick([0.0, 0.0, 1.0, u[2], u[2] / 4]),
                )
            )
            rows.append(row)
        logits = torch.stack(rows)
        batch = make_batch(params)
        got = kept(sampling_probs(apply_penalties(logits, batch), batch))
        for i, sp in enumerate(params):
            want, margin = reference_keep(
                rows[i].tolist(), sp.temperature, max(sp.top_k, 0), sp.top_p, sp.min_p
            )
            if margin < 1e-4:  # float32 vs float64 could legitimately disagree here
                skipped += 1
                continue
            checked += 1
            changed += len(want) < vocab
            assert got[i] == want, (i, sp, rows[i].tolist())
    assert skipped < 0.05 * (checked + skipped) and changed > 0.5 * checked


def test_filter_ties_and_edge_values():
    logits = torch.tensor([2.0, 2.0, 1.0, 1.0, 0.0])
    p_top = math.exp(2) / (2 * math.exp(2) + 2 * math.exp(1) + 1)
    cases = [
        (dict(top_k=1), {0, 1}),
        (dict(top_k=2), {0, 1}),
        (dict(top_k=3), {0, 1, 2, 3}),
        (dict(top_k=5), {0, 1, 2, 3, 4}),
        (dict(top_k=9), {0, 1, 2, 3, 4}),
        (dict(top_k=-1), {0, 1, 2, 3, 4}),
        (dict(top_p=1e-6), {0, 1}),
        (dict(top_p=p_top + 1e-3), {0, 1}),
        (dict(top_p=2 * p_top - 1e-3), {0, 1}),
        (dict(top_p=2 * p_top + 1e-3), {0, 1, 2, 3}),
        (dict(top_p=1.0, top_k=2), {0, 1}),
        (dict(min_p=1.0), {0, 1}),
        (dict(min_p=math.exp(-1) - 1e-3), {0, 1, 2, 3}),
        (dict(min_p=math.exp(-1) + 1e-3), {0, 1}),
        (dict(min_p=math.exp(-2) - 1e-3, top_k=4), {0, 1, 2, 3}),
        (dict(min_p=0.0, top_p=0.999), {0, 1, 2, 3, 4}),
    ]
    params = [SamplingParams(**kw) for kw, _ in cases]
    batch = make_batch(params)
    probs = sampling_probs(logits.expand(len(cases), -1), batch)
    assert kept(probs) == [want for _, want in cases]
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(cases)), atol=1e-6, rtol=0)
    # Kept tokens keep their relative weights: top_k=3 renormalises over {0, 1, 2, 3}.
    z = 2 * math.exp(2) + 2 * math.exp(1)
    assert probs[2].tolist() == pytest.approx([math.exp(2) / z] * 2 + [math.exp(1) / z] * 2 + [0])


def run_steps(logits, params, seeds, steps=12):
    batch = make_batch(params, seeds=seeds)  # fresh generators
    sampler = Sampler()
    return torch.stack([sampler(logits, batch).sampled_token_ids for _ in range(steps)], 1)


def test_seeded_sampling_reproducible_and_independent_of_batch():
    gen = torch.Generator().manual_seed(2)
    row = torch.randn(64, generator=gen) * 0.5
    others = torch.randn(3, 64, generator=gen) * 3
    mine = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    torch.manual_seed(0)
    alone = run_steps(row[None], [mine], [1234])[0]
    torch.manual_seed(99)  # a different global RNG must not matter
    again = run_steps(row[None], [mine], [1234])[0]
    assert torch.equal(alone, again)
    companions = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, top_k=3, seed=7),
    ]
    for pos in (0, 3):
        logits = torch.cat([others[:pos], row[None], others[pos:]])
        params = companions[:pos] + [mine] + companions[pos:]
        seeds = [None, None, 7][:pos] + [1234] + [None, None, 7][pos:]
        assert torch.equal(run_steps(logits, params, seeds)[pos], alone)
    other_seed = run_steps(row[None], [mine], [4321])[0]
    assert not torch.equal(other_seed, alone)
    assert len(set(alone.tolist())) > 3  # it really samples


def chi_square(tokens: torch.Tensor, expected: list[float]) -> float:
    counts = torch.bincount(tokens, minlength=len(expected)).double()
    total = counts.sum().item()
    stat = 0.0
    for c, e in zip(counts.tolist(), expected):
        if e == 0.0:
            assert c == 0, "a filtered-out token was sampled"
        else:
            stat += (c - total * e) ** 2 / (total * e)
    return stat


@pytest.mark.parametrize(
    "kwargs, expected, wrong",
    [
        (dict(), [0.4, 0.3, 0.2, 0.1], [0.25] * 4),
        (dict(temperature=0.5), [16 / 30, 9 / 30, 4 / 30, 1 / 30], [0.4, 0.3, 0.2, 0.1]),
        (dict(top_k=2), [4 / 7, 3 / 7, 0, 0], [0.4, 0.3, 0.2, 0.1]),
        (dict(top_p=0.75), [4 / 9, 3 / 9, 2 / 9, 0], [0.4, 0.3, 0.2, 0.1]),
        (dict(min_p=0.3, temperature=1.0), [4 / 9, 3 / 9, 2 / 9, 0], [0.4, 0.3, 0.2, 0.1]),
    ],
)
def test_sample_frequencies_match_distribution(kwargs, expected, wrong):
    torch.manual_seed(3)
    n = 40_000
    logits = (torch.tensor([0.4, 0.3, 0.2, 0.1]).log() + 3.0).expand(n, -1)
    out = Sampler()(logits, make_batch([SamplingParams(**kwargs)] * n))
    assert chi_square(out.sampled_token_ids, expected) < CHI2_BOUND
    # The test has power: the same draws are far from a plausible wrong answer.
    counts = torch.bincount(out.sampled_token_ids, minlength=4).double() / n
    assert (counts - torch.tensor(wrong, dtype=torch.float64)).abs().max() > 0.03


def test_seeded_rows_frequencies():
    n = 3000
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().expand(n, -1)
    out = Sampler()(logits, make_batch([SamplingParams()] * n, seeds=list(range(n))))
    assert chi_square(out.sampled_token_ids, [0.4, 0.3, 0.2, 0.1]) < CHI2_BOUND


def test_gather_logprobs_by_hand():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0], [0.5, -1.0, 3.0, 0.5]])
    lz = [
        math.log(math.exp(1) + 2 * math.exp(2) + 1),
        math.log(2 * math.exp(0.5) + math.exp(-1) + math.exp(3)),
    ]
    out = gather_logprobs(logits.log_softmax(-1), torch.tensor([0, 3], dtype=torch.int32), 2)
    assert out.token_ids.shape == (2, 3) and out.token_ids.dtype == torch.int64
    assert out.logprobs.dtype == torch.float32
    assert out.ranks.tolist() == [3, 2]  # ties: 1 + number strictly larger
    assert out.token_ids[0, 0] == 0 and set(out.token_ids[0, 1:].tolist()) == {1, 2}
    assert out.token_ids[1, :2].tolist() == [3, 2] and out.token_ids[1, 2].item() in (0, 3)
    want = [[1 - lz[0], 2 - lz[0], 2 - lz[0]], [0.5 - lz[1], 3 - lz[1], 0.5 - lz[1]]]
    torch.testing.assert_close(out.logprobs, torch.tensor(want), atol=1e-6, rtol=0)
    none = gather_logprobs(logits.log_softmax(-1), torch.tensor([1, 2]), 0)
    assert none.token_ids.tolist() == [[1], [2]] and none.ranks.tolist() == [1, 1]


def test_sampler_logprobs_come_from_raw_logits():
    torch.manual_seed(4)
    logits = torch.randn(4, 20)
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0),
        SamplingParams(temperature=0.5, logprobs=1, top_k=4),
        SamplingParams(temperature=1.5, top_p=0.8),
        SamplingParams(temperature=0.0, presence_penalty=1.5),
    ]
    outputs = [[int(logits[0].argmax())], [], [], [int(logits[3].argmax())]]
    batch = make_batch(params, outputs=outputs, banned=[[5], [], [], []])
    out = Sampler()(logits, batch)
    raw = logits.double().log_softmax(-1)
    tokens = out.sampled_token_ids
    assert out.logprobs.token_ids.shape == (4, 4)
    assert torch.equal(out.logprobs.token_ids[:, 0], tokens)
    torch.testing.assert_close(
        out.logprobs.logprobs.double(), raw.gather(1, out.logprobs.token_ids), atol=1e-6, rtol=0
    )
    assert torch.equal(out.logprobs.token_ids[:, 1:], raw.topk(3, dim=-1).indices)
    want_ranks = (raw > raw.gather(1, tokens[:, None])).sum(-1) + 1
    assert torch.equal(out.logprobs.ranks, want_ranks)
    # The penalised greedy rows moved off the raw argmax, so their rank is > 1.
    assert (out.logprobs.ranks[[0, 3]] > 1).all()


def test_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]).expand(3, -1)
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5),
        SamplingParams(),
        SamplingParams(presence_penalty=-1.0),
    ]
    batch = make_batch(params, outputs=[[1, 1, 3]] * 3, prompts=[[0, 4, 99]] * 3)
    got = apply_penalties(logits, batch)
    want = torch.tensor(
        [
            [1.0, -3.0, 0.5, 0.75, -4.0, 1.0],  # rep: 2/2, -1*2, 3/2, -2*2; then freq + presence
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
            [2.0, 0.0, 0.5, 4.0, -2.0, 1.0],
        ]
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0]))  # untouched


def test_banned_tokens():
    torch.manual_seed(5)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 0.5, 2.5]]).expand(3, -1)
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.0)]
    batch = make_batch(params, banned=[[3, 5], [3, 5], []])
    processed = apply_penalties(logits, batch)
    assert torch.isinf(processed[:2, [3, 5]]).all() and torch.isfinite(processed[2]).all()
    sampler = Sampler()
    seen = torch.stack([sampler(logits, batch).sampled_token_ids for _ in range(300)])
    assert (seen[:, 0] == 2).all() and (seen[:, 2] == 3).all()
    assert set(seen[:, 1].tolist()) == {0, 1, 2, 4}


def test_mixed_batch_behaves_per_row():
    torch.manual_seed(6)
    logits = torch.tensor([0.0, 1.0, 2.5, 2.0, 1.5, -1.0, 0.3, 1.2]).repeat(6, 1)
    logits += 0.1 * torch.randn(6, 8)
    params = [
        SamplingParams(temperature=0.0, top_k=2),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.8, top_p=1e-6),
        SamplingParams(temperature=1.3, min_p=1.0),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.5, seed=11),
    ]
    seeds = [None] * 5 + [11]
    batch = make_batch(params, seeds=seeds)
    probs = sampling_probs(apply_penalties(logits, batch), batch)
    for i, sp in enumerate(params):  # each row's distribution does not depend on its companions
        alone = make_batch([sp])
        torch.testing.assert_close(
            probs[i : i + 1], sampling_probs(logits[i : i + 1], alone), atol=1e-7, rtol=0
        )
    top3 = set(logits[4].topk(3).indices.tolist())
    sampler = Sampler()
    seen = torch.stack([sampler(logits, batch).sampled_token_ids for _ in range(300)])
    argmax = logits.argmax(-1)
    for i in range(4):
        assert (seen[:, i] == argmax[i]).all()
    assert set(seen[:, 4].tolist()) == top3
    assert set(seen[:, 5].tolist()) == kept(probs[5:6])[0] and len(kept(probs[5:6])[0]) > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_is_argmax_ties_included(dtype):
    """The CPU greedy path (``max(dim).indices``) against ``argmax``: the first maximal index,
    on random rows and on rows with ties at the maximum (bf16 rounds many values together)."""
    from attnserve.layers.sampler import greedy_argmax

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 3000, generator=gen).to(dtype)
    top = logits.max(dim=-1).values
    for row, cols in enumerate(torch.randint(0, 3000, (40, 3), generator=gen).tolist()):
        if row % 2:
            logits[row, cols] = top[row] + 1  # a three-way tie at a new maximum
    logits[5] = 0.0  # a whole row tied
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))
    assert greedy_argmax(logits)[5] == 0
