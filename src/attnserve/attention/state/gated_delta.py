"""The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5), chunked prefill and decode step.

Per value head, with a state ``S`` [dk, dv] and a log decay ``g_t <= 0``::

    S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t / sqrt(dk)

The decay is one scalar per head (Gated DeltaNet) or one value per key channel (KDA, see
``kda.py``, which reuses the general ``delta_rule_*`` functions here). Prefill uses the chunked
WY form: within a chunk the delta updates are solved at once as a unit lower-triangular system,
and only the state is carried from chunk to chunk; it equals the recurrence up to rounding.

Not here: the projections, the short conv (``conv.py``), the gated RMSNorm, or any kernel. Pure
PyTorch, float32 arithmetic; states are read from and written back to a state pool.
"""

from __future__ import annotations

import torch

from attnserve.attention.state.conv import pad_varlen, read_states, unpad_varlen

__all__ = [
    "delta_rule_decode",
    "delta_rule_prefill",
    "gated_delta_decode",
    "gated_delta_prefill",
    "l2norm",
]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the FLA convention: eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 q, k with ``num_v_heads`` heads (head j uses key head j // group), q scaled."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    group = num_v_heads // k.shape[-2]
    if group * k.shape[-2] != num_v_heads:
        raise ValueError(f"{num_v_heads} value heads cannot share {k.shape[-2]} key heads")
    if group > 1:  # expand, not repeat_interleave: no repeat count reaches the device on any torch
        q, k = (x.unsqueeze(-2).expand(*x.shape[:-1], group, x.shape[-1]).reshape(*x.shape[:-2], num_v_heads, -1)
                for x in (q, k))
    return q * q.shape[-1] ** -0.5, k


def _decayed_dot(a: torch.Tensor, b: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """``out[t, j] = sum_c a[t, c] b[j, c] decay[t, j, c]``; decay's last dim is 1 or c."""
    if decay.shape[-1] == 1:
        return (a @ b.transpose(-1, -2)) * decay[..., 0]
    return torch.einsum("...tc,...jc,...tjc->...tj", a, b, decay)


def _chunk_step(
    s: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of the WY form, all heads and sequences at once.

    s [B,H,dk,dv]; q, k [B,H,C,dk]; v [B,H,C,dv]; g [B,H,C,dg] (dg = 1 or dk); beta [B,H,C].
    """
    size = q.shape[2]
    cum = g.cumsum(2)  # [B, H, C, dg] log decay from the chunk start to t, inclusive
    after = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)  # j > t
    pair = (cum[:, :, :, None] - cum[:, :, None]).masked_fill(after[..., None], float("-inf"))
    pair = pair.exp()  # [B, H, C(t), C(j), dg] decay from j to t, zero where j > t
    # (I + A) u = beta * (v - exp(cum) k S), A[t, j] = beta_t <k_t, k_j>_decayed for j < t.
    a = (beta[..., None] * _decayed_dot(k, k, pair)).tril(-1)  # [B, H, C, C]
    w = torch.linalg.solve_triangular(a, beta[..., None] * v, upper=False, unitriangular=True)
    kd = torch.linalg.solve_triangular(
        a, beta[..., None] * k * cum.exp(), upper=False, unitriangular=True
    )  # [B, H, C, dk]
    u = w - kd @ s  # [B, H, C, dv]
    o = (q * cum.exp()) @ s + _decayed_dot(q, k, pair) @ u  # [B, H, C, dv]
    last = cum[:, :, -1:]  # [B, H, 1, dg]
    s = s * last.transpose(-1, -2).exp() + (k * (last - cum).exp()).transpose(-1, -2) @ u
    return o, s


def delta_rule_prefill(
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
    """Chunked gated delta rule over several sequences; decay per head or per key channel.

    Args:
        q, k: [T, Hk, dk]; Hk divides Hv and value head j reads key head ``j // (Hv // Hk)``.
        v: [T, Hv, dv].
        g: [T, Hv, 1] (one log decay per head) or [T, Hv, dk] (per key channel), <= 0.
        beta: [T, Hv] write strength.
        state: [pool, Hv, dk, dv]; rows ``state_indices`` are read (zeros where
            ``has_initial_state`` is False) and overwritten in place with the final state.
        query_start_loc: [B+1] int32; state_indices: [B] int64; has_initial_state: [B] bool.
        use_qk_l2norm: l2-normalise q and k (per head, in float32) before use.
        chunk_size: tokens per WY chunk.

    Returns:
        [T, Hv, dv] in the dtype of ``v``.
    """
    qf, kf = _prepare_qk(q, k, v.shape[-2], use_qk_l2norm)

    def padded(x: torch.Tensor) -> torch.Tensor:
        return pad_varlen(x.float(), query_start_loc, chunk_size).transpose(1, 2)  # [B, H, L, ...]

    qp, kp, vp, gp, bp = (padded(x) for x in (qf, kf, v, g, beta))
    s = read_states(state, state_indices, has_initial_state)  # [B, Hv, dk, dv]
    outs = []
    for start in range(0, qp.shape[2], chunk_size):
        part = slice(start, start + chunk_size)
        o, s = _chunk_step(
            s, qp[:, :, part], kp[:, :, part], vp[:, :, part], gp[:, :, part], bp[:, :, part]
        )
        outs.append(o)
    state[state_indices] = s.to(state.dtype)
    out = torch.cat(outs, dim=2).transpose(1, 2)  # [B, L, Hv, dv]
    return unpad_varlen(out, query_start_loc).to(v.dtype)


def delta_rule_decode(
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
    """One token per sequence of the gated delta recurrence.

    Args:
        q, k: [B, Hk, dk]; v: [B, Hv, dv]; g: [B, Hv, 1] or [B, Hv, dk]; beta: [B, Hv].
        state: [pool, Hv, dk, dv], rows ``state_indices`` ([B] int64) updated in place.
        use_qk_l2norm: l2-normalise q and k before use.

    Returns:
        [B, Hv, dv] in the dtype of ``v``.
    """
    qf, kf = _prepare_qk(q, k, v.shape[-2], use_qk_l2norm)
    s = state[state_indices].float() * g.float().exp()[..., None]  # [B, Hv, dk, dv]
    u = beta.float()[..., None] * (v.float() - torch.einsum("bhkv,bhk->bhv", s, kf))
    s = s + kf[..., None] * u[..., None, :]
    state[state_indices] = s.to(state.dtype)
    return torch.einsum("bhkv,bhk->bhv", s, qf).to(v.dtype)


def gated_delta_prefill(
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
    """Gated DeltaNet prefill: ``delta_rule_prefill`` with one log decay per head.

    Args:
        q, k: [T, Hk, dk]; v: [T, Hv, dv]; g: [T, Hv] log decay; beta: [T, Hv].
        state: [pool, Hv, dk, dv]. Other arguments as in ``delta_rule_prefill``.

    Returns:
        [T, Hv, dv] in the dtype of ``v``.
    """
    return delta_rule_prefill(
        q,
        k,
        v,
        g[..., None],
        beta,
        state,
        query_start_loc=query_start_loc,
        state_indices=state_indices,
        has_initial_state=has_initial_state,
        use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size,
    )


def gated_delta_decode(
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
    """Gated DeltaNet decode step: q, k [B, Hk, dk], v [B, Hv, dv], g and beta [B, Hv].

    Returns:
        [B, Hv, dv] in the dtype of ``v``; the state rows are updated in place.
    """
    return delta_rule_decode(
        q, k, v, g[..., None], beta, state, state_indices=state_indices, use_qk_l2norm=use_qk_l2norm
    )
