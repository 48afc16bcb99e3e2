"""Kimi delta attention (KDA, Kimi-Linear): the gated delta rule with a per-channel decay.

Per head, with a state ``S`` [dk, dv] and a log decay vector ``g_t`` [dk] (each key channel, i.e.
each row of ``S``, decays at its own rate)::

    S <- diag(exp(g_t)) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T
    o_t = S^T q_t / sqrt(dk)

The math is the general ``delta_rule_*`` of ``gated_delta.py``; this file fixes the shapes KDA
uses (as many key heads as value heads, ``g`` per channel). Not here: the forget-gate
projection that produces ``g`` (``-exp(A_log) * softplus(f + dt_bias)``), the three short convs
(``conv.py``), the sigmoid-gated RMSNorm.
"""

from __future__ import annotations

import torch

from attnserve.attention.state.gated_delta import delta_rule_decode, delta_rule_prefill

__all__ = ["kda_decode", "kda_prefill"]


def _check(q: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> None:
    if q.shape[-2] != v.shape[-2] or g.shape != q.shape:
        raise ValueError(
            f"KDA wants q, k, g [.., H, dk] and v [.., H, dv]; got q {tuple(q.shape)}, "
            f"v {tuple(v.shape)}, g {tuple(g.shape)}"
        )


def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Chunked KDA over several sequences.

    Args:
        q, k: [T, H, dk]; v: [T, H, dv]; g: [T, H, dk] per-channel log decay (<= 0);
            beta: [T, H].
        state: [pool, H, dk, dv]; rows ``state_indices`` ([B] int64) are read (zeros where
            ``has_initial_state`` [B] is False) and overwritten in place.
        query_start_loc: [B+1] int32 cumulative token counts.
        use_qk_l2norm: l2-normalise q and k before use (Kimi-Linear: True).
        chunk_size: tokens per WY chunk.

    Returns:
        [T, H, dv] in the dtype of ``v``.
    """
    _check(q, v, g)
    return delta_rule_prefill(
        q,
        k,
        v,
        g,
        beta,
        state,
        query_start_loc=query_start_loc,
        state_indices=state_indices,
        has_initial_state=has_initial_state,
        use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size,
    )


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    state_indices: torch.Tensor,
    use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """One KDA step per sequence: q, k, g [B, H, dk], v [B, H, dv], beta [B, H].

    Returns:
        [B, H, dv] in the dtype of ``v``; the state rows are updated in place.
    """
    _check(q, v, g)
    return delta_rule_decode(
        q, k, v, g, beta, state, state_indices=state_indices, use_qk_l2norm=use_qk_l2norm
    )
