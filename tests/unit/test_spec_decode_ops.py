"""Tests for speculative decoding's pure ops: the n-gram proposer and the rejection sampler.

The vectorised proposer is checked against its loop twin on many random contexts, and the twin
against vLLM's search (a KMP over the reversed context, re-derived here). The rejection sampler:
greedy rows against the target's argmax chain; random rows with a chi-square test at a fixed
seed that every emitted position follows the target's distribution, with the same test shown
to reject two wrong samplers; seeded rows independent of the rest of the batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnserve.spec_decode import (
    PLACEHOLDER_TOKEN_ID,
    propose_ngram,
    propose_ngram_reference,
    rejection_sample,
)

# ---------------------------------------------------------------------------------------------
# n-gram proposer


def vllm_kmp_search(tokens: list[int], min_n: int, max_n: int, k: int, max_model_len: int):
    """vLLM's ``_find_longest_matched_ngram_and_propose_tokens``, re-derived: KMP over the
    reversed context finds, at each position, the longest prefix (<= max_n) ending there; the
    last position reaching the overall longest (the earliest match in the original order) wins.
    """
    total = len(tokens)
    k = min(k, max_model_len - total)
    if total < min_n or k <= 0:
        return []
    rev = tokens[::-1]
    border = [0] * max_n  # border[i]: longest proper border of rev[:i + 1], for i < max_n
    longest = where = 0
    state, i = 0, 1
    while i < total:
        if rev[state] == rev[i]:
            state += 1
            if state >= longest:
                longest, where = state, i
            if i < max_n:
                border[i] = state
            if state == max_n:  # a full match: fall back so no n-gram grows past max_n
                state = border[max_n - 1]
            i += 1
        elif state:
            state = border[state - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - where + longest
    return tokens[start:start + k]


def ngram(tokens, min_n=1, max_n=3, k=4, max_model_len=None) -> tuple[list[int], list[int]]:
    """(vectorised, reference) proposals for one context."""
    kw = dict(prompt_lookup_min=min_n, prompt_lookup_max=max_n, num_speculative_tokens=k,
              max_model_len=max_model_len)
    return propose_ngram([tokens], **kw)[0], propose_ngram_reference(tokens, **kw)


NGRAM_SETTINGS = [(1, 1, 1), (1, 3, 4), (2, 2, 3), (2, 5, 7), (3, 4, 2), (1, 8, 5)]


@pytest.mark.parametrize("min_n,max_n,k", NGRAM_SETTINGS)
def test_ngram_vectorised_equals_reference_and_vllm(min_n, max_n, k):
    rng = np.random.default_rng(1000 * min_n + 10 * max_n + k)
    batch = []
    for _ in range(600):  # small vocabularies, so long and overlapping matches occur
        length = int(rng.integers(0, 70))
        vocab = int(rng.integers(1, 6))
        batch.append(rng.integers(0, vocab, length))
    batch[::3] = [b.astype(np.int32) for b in batch[::3]]  # mixed dtypes and plain lists
    batch[1::3] = [b.tolist() for b in batch[1::3]]
    max_model_len = 64  # some contexts reach or pass it: fewer or no drafts
    kw = dict(prompt_lookup_min=min_n, prompt_lookup_max=max_n, num_speculative_tokens=k,
              max_model_len=max_model_len)
    got = propose_ngram(batch, **kw)
    proposed = 0
    for tokens, drafts in zip(batch, got):
        tokens = [int(t) for t in tokens]
        want = propose_ngram_reference(tokens, **kw)
        assert drafts == want, (tokens, drafts, want)
        assert want == vllm_kmp_search(tokens, min_n, max_n, k, max_model_len), tokens
        proposed += bool(want)
    assert proposed > 100  # the cases exercise matches, not just misses


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=24),
    others=st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=3),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
    k=st.integers(1, 6),
    max_model_len=st.one_of(st.none(), st.integers(1, 30)),
)
def test_ngram_any_context(tokens, others, min_n, extra, k, max_model_len):
    """Any context, alone or among others, proposes what the reference and vLLM's search do."""
    kw = dict(prompt_lookup_min=min_n, prompt_lookup_max=min_n + extra, num_speculative_tokens=k,
              max_model_len=max_model_len)
    want = propose_ngram_reference(tokens, **kw)
    assert propose_ngram([tokens], **kw) == [want]
    assert propose_ngram([*others, tokens, *others], **kw)[len(others)] == want
    assert want == vllm_kmp_search(tokens, min_n, min_n + extra, k, max_model_len or 10**9)


def test_ngram_edge_cases():
    # vLLM's docstring example: [4, 2, 3] has no earlier match, [2, 3] has; 3 tokens follow it
    assert ngram([1, 2, 3, 4, 2, 3], min_n=2, max_n=3, k=4) == ([4, 2, 3], [4, 2, 3])
    # shorter than any n-gram, empty, a single token
    for tokens in ([], [7], [7, 8]):
        assert ngram(tokens, min_n=2, max_n=3) == ([], [])
    assert ngram([5, 5], min_n=1, max_n=3) == ([5], [5])  # the smallest context that can match
    # no match
    assert ngram([1, 2, 3, 4, 5, 6], min_n=1, max_n=3) == ([], [])
    # the longest n-gram wins over a later shorter one; the earliest occurrence of it wins
    assert ngram([9, 1, 2, 7, 8, 2, 6, 1, 2], min_n=1, max_n=3) == ([7, 8, 2, 6], [7, 8, 2, 6])
    assert ngram([1, 2, 3, 0, 1, 2, 4, 1, 2], min_n=2, max_n=2, k=1) == ([3], [3])
    # the match may overlap the suffix itself; k larger than what follows: all that follows
    assert ngram([3, 3, 3, 3], min_n=1, max_n=2, k=10) == ([3, 3], [3, 3])
    # a match right before the suffix (the last earlier position possible)
    assert ngram([4, 1, 2, 1, 2], min_n=2, max_n=2, k=5) == ([1, 2], [1, 2])
    # an occurrence needs a token after it: the suffix matching itself proposes nothing
    assert ngram([1, 2, 3], min_n=3, max_n=3) == ([], [])
    # max_model_len caps k, and a full context drafts nothing
    assert ngram([1, 2, 3, 1, 2], min_n=2, max_n=2, k=4, max_model_len=6) == ([3], [3])
    assert ngram([1, 2, 3, 1, 2], min_n=2, max_n=2, k=4, max_model_len=5) == ([], [])
    kw = dict(prompt_lookup_min=1, prompt_lookup_max=2, num_speculative_tokens=3)
    assert propose_ngram([], **kw) == []


def test_ngram_rejects_bad_settings():
    for lo, hi, k in ((0, 2, 1), (3, 2, 1), (1, 2, 0)):
        with pytest.raises(ValueError):
            propose_ngram([[1, 2]], prompt_lookup_min=lo, prompt_lookup_max=hi,
                          num_speculative_tokens=k)


# ---------------------------------------------------------------------------------------------
# rejection sampler


def flat_inputs(targets: list[torch.Tensor], drafts_probs: list[torch.Tensor] | None):
    """Per-request [k_i + 1, V] targets and [k_i, V] draft probs, stacked as the op takes them."""
    target = torch.cat(targets)
    draft = None if drafts_probs is None else torch.cat(drafts_probs)
    return target, draft


def greedy_chain(target: torch.Tensor, drafts: list[int]) -> list[int]:
    """What decoding without speculation emits: the target's argmax at each position, stopping
    after the first one the draft got wrong (or after the bonus position)."""
    out = []
    for j, x in enumerate(drafts):
        out.append(int(target[j].argmax()))
        if x != out[-1]:
            return out
    return out + [int(target[len(drafts)].argmax())]


def random_case(gen: torch.Generator, num_reqs: int, vocab: int, max_k: int, hit: float = 0.7):
    """Random per-request targets, draft probs and drafts that match the target's argmax often."""
    ks = torch.randint(0, max_k + 1, (num_reqs,), generator=gen).tolist()
    targets = [torch.softmax(3 * torch.randn(k + 1, vocab, generator=gen), -1) for k in ks]
    draft_probs = [torch.softmax(torch.randn(k, vocab, generator=gen), -1) for k in ks]
    drafts = []
    for t, k in zip(targets, ks):
        guess = torch.randint(0, vocab, (k,), generator=gen)
        hits = torch.rand(k, generator=gen) < hit
        drafts.append(torch.where(hits, t[:k].argmax(-1), guess).tolist())
    return ks, targets, draft_probs, drafts


def emitted(out, row: int) -> list[int]:
    return out.token_ids[row, : int(out.num_emitted[row])].tolist()


def check_layout(out, drafts: list[list[int]], vocab: int) -> None:
    max_k = max((len(d) for d in drafts), default=0)
    assert out.token_ids.shape == (len(drafts), max_k + 1)
    assert out.token_ids.dtype == torch.int64
    for i, d in enumerate(drafts):
        n = int(out.num_accepted[i])
        assert 0 <= n <= len(d)
        row = out.token_ids[i].tolist()
        assert row[:n] == d[:n]
        assert 0 <= row[n] < vocab
        assert all(t == PLACEHOLDER_TOKEN_ID for t in row[n + 1:])


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_greedy_equals_decoding_without_speculation(with_draft_probs):
    gen = torch.Generator().manual_seed(3)
    ks, targets, draft_probs, drafts = random_case(gen, num_reqs=300, vocab=50, max_k=6)
    target, draft = flat_inputs(targets, draft_probs if with_draft_probs else None)
    # every row greedy, then every other row random: greedy rows must not change
    for greedy in ([True] * len(ks), [i % 2 == 0 for i in range(len(ks))]):
        out = rejection_sample(drafts, target, draft, greedy, [None] * len(ks))
        check_layout(out, drafts, 50)
        for i, g in enumerate(greedy):
            if g:
                assert emitted(out, i) == greedy_chain(targets[i], drafts[i])
    full = [int(out.num_accepted[i]) == k for i, k in enumerate(ks)]
    assert 20 < sum(full) < len(ks) - 20  # both the bonus and the mismatch paths ran
    # greedy rows read only the argmax: logits in place of probabilities give the same tokens
    logits = torch.cat([t.log() * 2.5 + 1.0 for t in targets])
    by_logits = rejection_sample(drafts, logits, draft, [True] * len(ks), [None] * len(ks))
    by_probs = rejection_sample(drafts, target, draft, [True] * len(ks), [None] * len(ks))
    assert torch.equal(by_logits.token_ids, by_probs.token_ids)


def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """The chi-square goodness-of-fit p-value of ``samples`` against ``probs`` (tokens with
    probability 0 must never appear: they make the p-value 0)."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = samples.numel() * probs[support].double()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = torch.tensor((int(support.sum()) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))  # P(chi2_dof > stat)


VOCAB, TRIALS, ALPHA = 8, 20_000, 1e-3
# the target at the two draft positions and the bonus position; token 7 is filtered out at 0
P = torch.tensor([
    [0.30, 0.05, 0.20, 0.10, 0.15, 0.12, 0.08, 0.00],
    [0.02, 0.40, 0.08, 0.10, 0.05, 0.05, 0.20, 0.10],
    [0.10, 0.10, 0.10, 0.30, 0.10, 0.10, 0.10, 0.10],
])
# the draft, deliberately different (total variation 0.4 and 0.5 from the target)
Q = torch.tensor([
    [0.05, 0.30, 0.05, 0.10, 0.10, 0.10, 0.10, 0.20],
    [0.30, 0.05, 0.05, 0.10, 0.05, 0.30, 0.05, 0.10],
])


def spec_round(draft_dist: torch.Tensor, with_draft_probs: bool, seed: int):
    """TRIALS independent requests, each verifying 2 drafts drawn from ``draft_dist``."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(d, TRIALS, replacement=True, generator=gen)
                          for d in draft_dist], dim=1)  # [TRIALS, 2]
    target = P.repeat(TRIALS, 1)  # [3 * TRIALS, V]
    draft = Q.repeat(TRIALS, 1) if with_draft_probs else None  # [2 * TRIALS, V]
    with torch.random.fork_rng():
        # not `seed`: the same seed would replay the drafts' random stream as the uniforms
        torch.manual_seed(seed + 1_000_003)
        out = rejection_sample(drafts.tolist(), target, draft, [False] * TRIALS, [None] * TRIALS)
    return drafts, out


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_random_rows_follow_the_target(with_draft_probs):
    # n-gram drafts are deterministic for the sampler (draft prob 1), whatever picked them:
    # here another distribution than Q, to show the result does not depend on it
    draft_dist = Q if with_draft_probs else Q.flip(-1)
    drafts, out = spec_round(draft_dist, with_draft_probs, seed=11)
    tokens, n = out.token_ids, out.num_emitted
    # each position, among the rounds that reach it, follows the target there
    for pos in range(3):
        reached = tokens[n > pos, pos]
        assert reached.numel() * P[pos][P[pos] > 0].min() >= 20  # expected counts >= 20
        assert chi2_pvalue(reached, P[pos]) > ALPHA, pos
    assert (tokens[:, 0] != 7).all()  # never a token the target filtered out

    # The same test rejects wrong samplers. Always accepting emits the drafts themselves:
    assert chi2_pvalue(drafts[:, 0], P[0]) < 1e-6
    if with_draft_probs:
        # Drawing from the target instead of the residual after a rejection:
        gen = torch.Generator().manual_seed(5)
        fresh = torch.multinomial(P[0], TRIALS, replacement=True, generator=gen)
        wrong = torch.where(out.num_accepted > 0, drafts[:, 0], fresh)
        assert chi2_pvalue(wrong, P[0]) < 1e-6


def test_acceptance_edge_probabilities():
    vocab = 6
    target = torch.zeros(4, vocab)
    target[0, 2] = target[1, 4] = 1.0  # certain on the drafts
    target[2, 3] = 0.5
    target[2, 5] = 0.5  # the bonus position
    target[3] = torch.full((vocab,), 1 / vocab)
    # n-gram: target prob 1 on each draft keeps them all; prob 0 never keeps one
    out = rejection_sample([[2, 4], []], target, None, [False, False], [None, None])
    assert out.num_accepted.tolist() == [2, 0]
    assert emitted(out, 0)[:2] == [2, 4] and emitted(out, 0)[2] in (3, 5)
    zero = torch.tensor([[0.0, 0.5, 0.5, 0, 0, 0], [0.2] * 5 + [0.0]])  # p(draft) = 0
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        out = rejection_sample([[0]], zero, None, [False], [gen])
        assert out.num_accepted.item() == 0 and emitted(out, 0)[0] in (1, 2)
        # a draft the draft model gave probability 0 is rejected (as vLLM's)
        q = torch.tensor([[0.0, 0.5, 0.5, 0, 0, 0]])
        out = rejection_sample([[3]], torch.full((2, vocab), 1 / vocab), q, [False], [gen])
        assert out.num_accepted.item() == 0
        # equal target and draft keep every draft
        out = rejection_sample([[1, 2]], torch.full((3, vocab), 1 / vocab),
                               torch.full((2, vocab), 1 / vocab), [False], [gen])
        assert out.num_accepted.item() == 2


def test_seeded_rows_ignore_the_rest_of_the_batch():
    gen = torch.Generator().manual_seed(8)
    vocab = 16
    probe_t = [torch.softmax(torch.randn(5, vocab, generator=gen), -1)]  # k = 4
    probe_q = [torch.softmax(torch.randn(4, vocab, generator=gen), -1)]
    probe_d = [torch.multinomial(probe_q[0], 1, generator=gen).flatten().tolist()]

    def run(seed: int, batch_seed: int, where: int, with_draft_probs: bool) -> list[int]:
        bgen = torch.Generator().manual_seed(batch_seed)
        ks, targets, draft_probs, drafts = random_case(bgen, num_reqs=5, vocab=vocab, max_k=5)
        greedy = [bool(b) for b in torch.randint(0, 2, (5,), generator=bgen)]
        gens = [torch.Generator().manual_seed(100 + i) if i % 2 else None for i in range(5)]
        targets[where:where] = probe_t
        draft_probs[where:where] = probe_q
        drafts[where:where] = probe_d
        greedy[where:where] = [False]
        gens[where:where] = [torch.Generator().manual_seed(seed)]
        target, draft = flat_inputs(targets, draft_probs if with_draft_probs else None)
        out = rejection_sample(drafts, target, draft, greedy, gens)
        check_layout(out, drafts, vocab)
        return emitted(out, where)

    for with_draft_probs in (True, False):
        results = set()
        for seed in range(12):
            first = run(seed, batch_seed=1, where=0, with_draft_probs=with_draft_probs)
            torch.rand(7)  # the global generator moves; the seeded row does not care
            assert run(seed, batch_seed=2, where=3, with_draft_probs=with_draft_probs) == first
            assert run(seed, batch_seed=3, where=5, with_draft_probs=with_draft_probs) == first
            results.add(tuple(first))
        assert len(results) > 3  # the seed does decide the outcome


def test_rejection_shapes_and_empty_drafts():
    target = torch.softmax(torch.randn(3, 5), -1)
    out = rejection_sample([[], [], []], target, torch.empty(0, 5), [True, False, False],
                           [None, torch.Generator().manual_seed(0), None])
    assert out.token_ids.shape == (3, 1) and out.num_accepted.tolist() == [0, 0, 0]
    assert out.token_ids[0, 0] == target[0].argmax()
    with pytest.raises(ValueError):
        rejection_sample([[1]], target, None, [True], [None])  # needs 2 target rows
    with pytest.raises(ValueError):
        rejection_sample([[1]], target[:2], torch.ones(2, 5), [True], [None])
