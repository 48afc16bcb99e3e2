"""N-gram prompt lookup: draft tokens copied from earlier in a request's own context (vLLM's
``method="ngram"``).

For a context ``t`` of ``T`` tokens (prompt + output so far), the proposer takes the largest
``n`` in ``[prompt_lookup_min, prompt_lookup_max]`` for which the last ``n`` tokens occur
earlier with at least one token after them, picks the *earliest* such occurrence ``t[s:s+n]``
(``s + n <= T - 1``; it may overlap the suffix itself), and proposes the up to ``k`` tokens
that follow it, ``t[s+n : s+n+k]``, with ``k = min(num_speculative_tokens, max_model_len - T)``.
No match (or ``T < prompt_lookup_min``) proposes nothing. This is exactly what vLLM's KMP
search (``_find_longest_matched_ngram_and_propose_tokens``) returns: it scans the reversed
context for the longest prefix (capped at ``prompt_lookup_max``) and keeps the last, i.e. the
earliest in the original order, of the positions reaching it.

How: a window ending at ``e`` equals the last ``n`` tokens iff the longest common suffix of
``t[:e+1]`` and ``t`` is at least ``n``. ``propose_ngram`` computes that length, capped at
``prompt_lookup_max``, for every position of every request of the batch at once (the requests
concatenated into one flat array, one vectorised pass per suffix offset), then takes per request
the largest length and the first position reaching it. Cost: ``O(sum(T) * prompt_lookup_max)``
time and ``O(sum(T))`` memory, no Python loop over requests or positions (vLLM's numba KMP is
``O(T)`` per request). The search reads the whole context, as vLLM's does; ``max_model_len``
bounds ``T``, and with it the work, and caps ``k`` so no draft runs past the model length.

This file is not the engine's drafting step (which requests draft, async scheduling); it is
the pure proposal. ``propose_ngram_reference`` is its slow twin, written the obvious way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["propose_ngram", "propose_ngram_reference"]


def _draft_budget(
    num_tokens: np.ndarray | int, num_speculative_tokens: int, max_model_len: int | None
) -> np.ndarray | int:
    """How many tokens a request of ``num_tokens`` may draft: ``k``, less what would pass the
    model length (vLLM's ``min(k, max_model_len - T)``)."""
    if max_model_len is None:
        return num_speculative_tokens
    return np.minimum(num_speculative_tokens, max_model_len - num_tokens)


def _check(prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int) -> None:
    if prompt_lookup_min < 1 or prompt_lookup_max < prompt_lookup_min:
        raise ValueError(
            f"need 1 <= prompt_lookup_min <= prompt_lookup_max, "
            f"got {prompt_lookup_min} and {prompt_lookup_max}"
        )
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")


def propose_ngram_reference(
    token_ids: Sequence[int],
    *,
    prompt_lookup_min: int,
    prompt_lookup_max: int,
    num_speculative_tokens: int,
    max_model_len: int | None = None,
) -> list[int]:
    """One request's proposal, by plain loops (the twin ``propose_ngram`` is tested against)."""
    _check(prompt_lookup_min, prompt_lookup_max, num_speculative_tokens)
    t = [int(x) for x in token_ids]
    total = len(t)
    k = int(_draft_budget(total, num_speculative_tokens, max_model_len))
    if k <= 0:
        return []
    for n in range(min(prompt_lookup_max, total - 1), prompt_lookup_min - 1, -1):
        suffix = t[total - n:]
        for s in range(total - n):  # s + n <= total - 1: a token follows the occurrence
            if t[s:s + n] == suffix:
                return t[s + n:s + n + k]
    return []


def propose_ngram(
    batch_token_ids: Sequence[np.ndarray | Sequence[int]],
    *,
    prompt_lookup_min: int,
    prompt_lookup_max: int,
    num_speculative_tokens: int,
    max_model_len: int | None = None,
) -> list[list[int]]:
    """Draft tokens for every request of a batch by n-gram prompt lookup.

    Args:
        batch_token_ids: per request, its context (prompt + output so far) as token ids.
        prompt_lookup_min: the shortest n-gram that may match (>= 1).
        prompt_lookup_max: the longest n-gram tried (the search prefers longer matches).
        num_speculative_tokens: the most tokens proposed per request (``k``).
        max_model_len: no proposal reaches past this many tokens; None for no cap.

    Returns:
        Per request, the proposed token ids (possibly empty), as ``propose_ngram_reference``.
    """
    _check(prompt_lookup_min, prompt_lookup_max, num_speculative_tokens)
    num_reqs = len(batch_token_ids)
    lengths = np.array([len(t) for t in batch_token_ids], dtype=np.int64)  # [B]
    budget = _draft_budget(lengths, num_speculative_tokens, max_model_len)
    budget = np.broadcast_to(budget, lengths.shape)  # [B]
    # only requests that can match: an n-gram and a token after it, and room to draft
    live = np.flatnonzero((lengths > prompt_lookup_min) & (budget > 0))
    drafts: list[list[int]] = [[] for _ in range(num_reqs)]
    if live.size == 0:
        return drafts
    lengths = lengths[live]
    flat = np.concatenate([np.asarray(batch_token_ids[i], dtype=np.int64) for i in live.tolist()])
    start, count = _longest_match(flat, lengths, prompt_lookup_min, prompt_lookup_max)
    count = np.minimum(count, budget[live])
    # [B', k] flat indices of the drafted tokens; those past `count` are cut below
    index = np.minimum(start[:, None] + np.arange(num_speculative_tokens), flat.size - 1)
    for i, row, n in zip(live.tolist(), flat[index].tolist(), count.tolist()):
        drafts[i] = row[:n]
    return drafts


def _longest_match(
    flat: np.ndarray, lengths: np.ndarray, min_n: int, max_n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per request of ``flat`` (the contexts back to back, each of ``lengths[b] >= 2`` tokens):
    the flat index where the proposal starts and how many context tokens follow it (0 where no
    n-gram of ``[min_n, max_n]`` matches)."""
    num_tokens = flat.size
    offsets = np.cumsum(lengths) - lengths  # [B] first flat index of each request
    req = np.repeat(np.arange(lengths.size), lengths)  # [N] request of each position
    local = np.arange(num_tokens) - offsets[req]  # [N] position e within its request
    last = offsets + lengths - 1  # [B] flat index of each request's last token
    # run[p]: the longest common suffix of t[:e+1] and t, capped at max_n; an n-gram ending at
    # e matches the last n tokens iff run >= n. Built one suffix offset r at a time.
    run = np.zeros(num_tokens, dtype=np.int64)
    alive = local < np.repeat(lengths - 1, lengths)  # e <= T - 2: a token follows the window
    for r in range(max_n):  # a loop over the n-gram offset (<= max_n), not over positions
        alive[local < r] = False  # the window would start before the request
        if r > 0:
            shifted = np.empty_like(flat)  # shifted[p] = flat[p - r]
            shifted[r:], shifted[:r] = flat[:-r], -1
        else:
            shifted = flat
        alive &= shifted == np.repeat(flat[last - r], lengths)  # vs. t[T - 1 - r]
        if not alive.any():
            break
        run += alive
    best = np.maximum.reduceat(run, offsets)  # [B] longest n-gram (<= max_n) with a match
    first = np.where(run >= best[req], np.arange(num_tokens), num_tokens)
    first = np.minimum.reduceat(first, offsets)  # [B] earliest window end reaching it
    start = first + 1  # the proposal starts right after the matched window
    count = np.where(best >= min_n, offsets + lengths - start, 0)
    return start, count
