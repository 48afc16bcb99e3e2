"""Mamba-1 selective scan (Jamba), chunked parallel prefill and decode step.

Per channel c with a state ``h_c`` [N] (N = d_state), step size ``dt`` (already softplus'd, bias
included) and ``A = -exp(A_log)`` [D, N]::

    h_c <- exp(dt_c A_c) * h_c + dt_c B_t x_c;  y_c = C_t . h_c + D_c x_c;  y <- y * SiLU(z)

B and C are shared by all channels (Mamba-1 has no groups). Prefill splits the tokens into
chunks; inside a chunk the linear recurrence is solved by a log-depth (Hillis-Steele) scan, and
the state is carried between chunks; it equals the recurrence up to rounding.

Not here: the in/x/dt/out projections, Jamba's dt/B/C RMSNorms, the short conv (``conv.py``).
Pure PyTorch, float32 arithmetic; states are read from and written back to a state pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnserve.attention.state.conv import pad_varlen, read_states, unpad_varlen

__all__ = ["selective_scan_decode", "selective_scan_prefill"]


def _scan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """All states of ``h_t = a_t * h_{t-1} + b_t`` (h_{-1} = 0) along dim 1, in log2(C) steps."""
    step = 1
    while step < a.shape[1]:
        # Compose each element with the one ``step`` earlier: (a, b) o (a', b') = (a a', a b' + b).
        b = torch.cat([b[:, :step], b[:, step:] + a[:, step:] * b[:, :-step]], dim=1)
        a = torch.cat([a[:, :step], a[:, step:] * a[:, :-step]], dim=1)
        step *= 2
    return b


def _finish(
    y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None
) -> torch.Tensor:
    """Skip connection and output gate on float32 y, x, z of one shape [..., D]."""
    if D is not None:
        y = y + x * D.float()
    if z is not None:
        y = y * F.silu(z)
    return y


def selective_scan_prefill(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    ssm_state: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int = 128,
) -> torch.Tensor:
    """Selective scan over several sequences, each continuing from its state.

    Args:
        x: [T, D] conv output; dt: [T, D] step sizes after softplus; A: [D, N] (negative);
            B, C: [T, N]; D: [D] or None; z: [T, D] gate or None.
        ssm_state: [pool, D, N]; rows ``state_indices`` ([B] int64) are read (zeros where
            ``has_initial_state`` [B] is False) and overwritten in place.
        query_start_loc: [B+1] int32 cumulative token counts.
        chunk_size: tokens per scan chunk (memory is [B, chunk, D, N] per chunk).

    Returns:
        [T, D] in the dtype of ``x``.
    """
    xp, dtp, bp, cp = (pad_varlen(t.float(), query_start_loc, chunk_size) for t in (x, dt, B, C))
    a_mat = A.float()
    h = read_states(ssm_state, state_indices, has_initial_state)  # [B, D, N]
    outs = []
    for start in range(0, xp.shape[1], chunk_size):
        part = slice(start, start + chunk_size)
        a = torch.exp(dtp[:, part, :, None] * a_mat)  # [B, C, D, N]; 1 on padding (dt = 0)
        b = (dtp[:, part] * xp[:, part])[..., None] * bp[:, part, None, :]  # [B, C, D, N]
        b = torch.cat([b[:, :1] + a[:, :1] * h[:, None], b[:, 1:]], dim=1)  # fold in h
        states = _scan(a, b)  # [B, C, D, N]
        outs.append(torch.einsum("bcdn,bcn->bcd", states, cp[:, part]))
        h = states[:, -1]
    ssm_state[state_indices] = h.to(ssm_state.dtype)
    y = unpad_varlen(torch.cat(outs, dim=1), query_start_loc)  # [T, D]
    y = _finish(y, x.float(), D, None if z is None else z.float())
    return y.to(x.dtype)


def selective_scan_decode(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    ssm_state: torch.Tensor,
    *,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One token per sequence: x, dt, z [B, D]; B, C [B, N]; ssm_state [pool, D, N].

    Returns:
        [B, D] in the dtype of ``x``; the state rows are updated in place.
    """
    xf, dtf = x.float(), dt.float()
    h = ssm_state[state_indices].float() * torch.exp(dtf[..., None] * A.float())  # [B, D, N]
    h = h + (dtf * xf)[..., None] * B.float()[:, None, :]
    ssm_state[state_indices] = h.to(ssm_state.dtype)
    y = torch.einsum("bdn,bn->bd", h, C.float())
    return _finish(y, xf, D, None if z is None else z.float()).to(x.dtype)
