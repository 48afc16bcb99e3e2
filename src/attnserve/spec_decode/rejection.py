"""Rejection sampling for speculative decoding: which draft tokens a request keeps, and the one
token the target adds after them (vLLM V1's ``RejectionSampler`` semantics).

Per request with draft tokens ``x_1..x_k``, the target's distributions ``p_1..p_{k+1}`` (one per
verified position, after temperature, top-k, top-p, ...) and the draft's ``q_1..q_k``:

- greedy rows keep ``x_j`` while it equals ``argmax p_j`` (the first maximal index), then emit
  ``argmax p_j`` at the first mismatch, or ``argmax p_{k+1}`` (the bonus) when all ``k`` match:
  the tokens decoding without speculation would produce.
- random rows keep ``x_j`` with probability ``min(1, p_j(x_j) / q_j(x_j))``; at the first
  rejection they emit a draw from ``normalize(max(0, p_j - q_j))``, and when all ``k`` are kept
  a bonus draw from ``p_{k+1}``. Every emitted token then follows the target's distribution
  (Leviathan et al., 2023). Without draft probabilities (n-gram) the draft is deterministic:
  ``q_j`` is one on ``x_j``, so ``x_j`` is kept with probability ``p_j(x_j)`` and the residual
  is ``p_j`` with ``x_j`` removed.

As vLLM's: one uniform per draft token, and one exponential race (``argmax(dist / E)``,
``E ~ Exp(1)``) per row; a draft with ``q_j(x_j) = 0`` is rejected; a seeded row draws its
uniforms, then its ``[V]`` exponentials, from its own generator, so its tokens depend only on
its own inputs; a greedy row draws nothing. Two differences: a token is kept when ``u < p/q``
(vLLM: ``u <= p/q``), so a token the target filtered out (``p = 0``) is never kept even when
``u`` is exactly 0; and the bonus token is drawn here, from ``p_{k+1}`` with the same race as
the residual (a row uses one or the other, never both), instead of coming in from the sampler.
A residual that rounds to all zeros (``p = q`` up to rounding) falls back to ``p_j``.

Work: a few gathers over ``[B, max_k]``, one ``[B, V]`` row per request for the emitted token's
distribution, and an argmax over the target rows when some row is greedy; no loop over
positions or the vocabulary (the loop over seeded rows draws from their generators, as the
sampler's ``_exponential_race``). This file does not turn logits into probabilities (the
sampler's ``sampling_probs`` does), track requests or free the rejected tokens' KV slots.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attnserve.platforms import to_device

__all__ = ["PLACEHOLDER_TOKEN_ID", "RejectionOutput", "rejection_sample"]

PLACEHOLDER_TOKEN_ID = -1  # fills each row of RejectionOutput.token_ids after its tokens


@dataclass(frozen=True, slots=True)
class RejectionOutput:
    """What one verification step emits per request."""

    token_ids: torch.Tensor  # [B, max_k + 1] int64: the kept drafts, then one target token, then -1
    num_accepted: torch.Tensor  # [B] int64: draft tokens kept, in [0, k_i]

    @property
    def num_emitted(self) -> torch.Tensor:
        """[B] tokens each row emits: the kept drafts plus the target's one."""
        return self.num_accepted + 1


def rejection_sample(
    draft_token_ids: Sequence[Sequence[int]],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: Sequence[bool],
    generators: Sequence[torch.Generator | None],
) -> RejectionOutput:
    """Verify every request's draft tokens against the target and emit the accepted tokens.

    Args:
        draft_token_ids: per request, its ``k_i >= 0`` draft tokens.
        target_probs: ``[sum(k_i) + B, V]`` the target's probabilities, request by request, each
            with its ``k_i + 1`` positions in order (the last one gives the bonus token). Only
            the argmax of a greedy row's positions is read, so they may hold logits instead.
        draft_probs: ``[sum(k_i), V]`` the draft's probabilities at each draft token, request by
            request; None for a deterministic draft (n-gram).
        greedy: per request, whether it decodes greedily.
        generators: per request, its own generator if it is seeded, else None (the global one).

    Returns:
        ``RejectionOutput`` with ``[B, max_k + 1]`` tokens (-1 after each row's
        ``num_accepted + 1``) and ``[B]`` accepted-draft counts, on ``target_probs``' device.
    """
    num_reqs = len(draft_token_ids)
    num_draft_list = [len(d) for d in draft_token_ids]
    total_draft = sum(num_draft_list)
    _check_shapes(num_reqs, total_draft, target_probs, draft_probs, greedy, generators)
    device = target_probs.device
    num_draft, drafts, valid = _pad_drafts(draft_token_ids, num_draft_list, device)
    target_start = torch.cumsum(num_draft + 1, 0) - (num_draft + 1)  # [B] first row of each request
    draft_start = torch.cumsum(num_draft, 0) - num_draft  # [B]
    pos = torch.arange(drafts.shape[1], device=device)  # [K]
    target_rows = torch.where(valid, target_start[:, None] + pos, 0)  # [B, K]
    draft_rows = torch.where(valid, draft_start[:, None] + pos, 0)  # [B, K]
    is_greedy = to_device(torch.tensor(list(greedy), dtype=torch.bool), device)  # [B]
    all_greedy, any_greedy = all(greedy), any(greedy)

    argmax = target_probs.argmax(dim=-1) if any_greedy else None  # [sum(k_i) + B]
    accepted = torch.zeros_like(valid)  # [B, K]
    if any_greedy:
        accepted |= is_greedy[:, None] & (drafts == argmax[target_rows])
    if not all_greedy:
        uniforms, exponentials = _draws(num_draft_list, target_probs, greedy, generators)
        p = target_probs[target_rows, drafts].float()  # [B, K] p_j(x_j)
        q = torch.ones_like(p) if draft_probs is None else draft_probs[draft_rows, drafts].float()
        accepted |= ~is_greedy[:, None] & (q > 0) & (uniforms * q < p)
    accepted &= valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B] kept before the first rejection

    # The emitted token comes from position num_accepted: a residual there if a draft was
    # rejected, the bonus position (k_i) if none was.
    final_rows = target_start + num_accepted  # [B]
    final = argmax[final_rows] if any_greedy else None  # [B]
    if not all_greedy:
        dist = _emit_distribution(target_probs[final_rows].float(), drafts, draft_probs,
                                  draft_start, num_accepted, num_draft)  # [B, V]
        sampled = (dist / exponentials).argmax(dim=-1)
        final = sampled if final is None else torch.where(is_greedy, final, sampled)

    col = torch.arange(drafts.shape[1] + 1, device=device)  # [K + 1]
    padded = torch.cat([drafts, drafts.new_zeros(num_reqs, 1)], dim=1)  # [B, K + 1]
    n = num_accepted[:, None]
    tail = torch.where(col == n, final[:, None], PLACEHOLDER_TOKEN_ID)  # [B, K + 1]
    return RejectionOutput(token_ids=torch.where(col < n, padded, tail), num_accepted=num_accepted)


def _pad_drafts(
    draft_token_ids: Sequence[Sequence[int]], num_draft: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B]`` draft counts, ``[B, max_k]`` drafts padded with 0, and ``[B, max_k]`` which are
    real, on ``device``."""
    counts = to_device(torch.tensor(num_draft, dtype=torch.int64), device)  # [B]
    max_k = max(num_draft, default=0)
    valid = torch.arange(max_k, device=device) < counts[:, None]  # [B, K]
    flat = torch.tensor(list(itertools.chain.from_iterable(draft_token_ids)), dtype=torch.int64)
    drafts = torch.zeros(len(num_draft), max_k, dtype=torch.int64, device=device)
    drafts[valid] = to_device(flat, device)  # row-major, as the drafts come
    return counts, drafts, valid


def _check_shapes(num_reqs, total_draft, target_probs, draft_probs, greedy, generators) -> None:
    if len(greedy) != num_reqs or len(generators) != num_reqs:
        raise ValueError(f"greedy and generators need one entry per request ({num_reqs})")
    if target_probs.ndim != 2 or target_probs.shape[0] != total_draft + num_reqs:
        raise ValueError(
            f"target_probs must be [sum(k_i) + B, V] = [{total_draft + num_reqs}, V], "
            f"got {tuple(target_probs.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (total_draft, target_probs.shape[1]):
        raise ValueError(
            f"draft_probs must be [sum(k_i), V] = [{total_draft}, {target_probs.shape[1]}], "
            f"got {tuple(draft_probs.shape)}"
        )


def _draws(
    num_draft: list[int],
    target_probs: torch.Tensor,
    greedy: Sequence[bool],
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, K]`` uniforms in [0, 1) and ``[B, V]`` Exp(1) draws; a seeded random row takes
    its ``k_i`` uniforms, then its ``V`` exponentials, from its own generator."""
    num_reqs, vocab_size = len(num_draft), target_probs.shape[1]
    max_k, device = max(num_draft, default=0), target_probs.device
    seeded = [i for i, g in enumerate(generators) if g is not None and not greedy[i]]
    uniforms = torch.rand(num_reqs, max_k, device=device)
    exponentials = torch.empty(num_reqs, vocab_size, device=device).exponential_()
    if seeded:
        rows_u, rows_e = [], []
        for i in seeded:  # per seeded row, in its own generator's order
            g = generators[i]
            u = torch.rand(num_draft[i], generator=g, device=g.device)
            rows_u.append(torch.nn.functional.pad(u, (0, max_k - num_draft[i])))
            rows_e.append(torch.empty(vocab_size, device=g.device).exponential_(generator=g))
        index = to_device(torch.tensor(seeded), device)
        uniforms[index] = torch.stack(rows_u).to(device)  # [len(seeded), K]
        exponentials[index] = torch.stack(rows_e).to(device)  # [len(seeded), V]
    # Exp(1) can round to 0; a zero would turn a 0 probability into 0/0 = nan.
    return uniforms, exponentials.clamp_(min=torch.finfo(exponentials.dtype).tiny)


def _emit_distribution(
    dist: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_start: torch.Tensor,
    num_accepted: torch.Tensor,
    num_draft: torch.Tensor,
) -> torch.Tensor:
    """``[B, V]`` what each random row draws its emitted token from (unnormalised, as the race
    needs): the target at the bonus position if every draft was kept, else the residual
    ``max(0, p_j - q_j)`` at the first rejected position ``j``."""
    rejected = num_accepted < num_draft  # [B]
    if drafts.shape[1] == 0:
        return dist
    j = num_accepted.clamp(max=drafts.shape[1] - 1)  # [B] a valid column for every row
    if draft_probs is None:  # the draft is one-hot on x_j: the residual is p_j without x_j
        residual = dist.scatter(1, drafts.gather(1, j[:, None]), 0.0)
    else:
        rows = (draft_start + j).clamp(max=draft_probs.shape[0] - 1)  # [B]
        residual = (dist - draft_probs[rows].float()).clamp_(min=0.0)
    keep = rejected & (residual.sum(dim=-1) > 0)  # an all-zero residual falls back to p_j
    return torch.where(keep[:, None], residual, dist)
