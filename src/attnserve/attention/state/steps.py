"""One layer step of each state mechanism over the slot pool, split into decode and prefill.

``gdn_forward``, ``mamba_forward``, ``lightning_forward`` and ``kda_forward`` are the ``step`` of
the state backends (``base.StateBackend``): the short convs where the mechanism has them, then
the recurrent one-token form for the step's decode tokens and the chunked (block, scan) form for
the rest, each continuing its sequence's state. ``decode`` is the one-token form; a TRITON_*
backend passes its fused kernel, called with the same arguments, and ``prefill`` likewise replaces
the chunked form, ``conv_update`` and ``conv_prefill`` the short conv's two forms.

What it is not: the projections, gates and norms (the layers, ``layers/``), the arithmetic
(``gated_delta.py``, ``mamba.py``, ``lightning.py``, ``kda.py``, ``conv.py``), or a kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from attnserve.attention.state.base import StateMetadata
from attnserve.attention.state.conv import causal_conv1d_prefill, causal_conv1d_update
from attnserve.attention.state.gated_delta import gated_delta_decode, gated_delta_prefill
from attnserve.attention.state.kda import kda_decode, kda_prefill
from attnserve.attention.state.lightning import (
    lightning_attention_decode,
    lightning_attention_prefill,
)
from attnserve.attention.state.mamba import selective_scan_decode, selective_scan_prefill

__all__ = ["conv_forward", "gdn_forward", "kda_forward", "lightning_forward", "mamba_forward"]


def conv_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    metadata: StateMetadata,
    *,
    update: Callable[..., torch.Tensor] = causal_conv1d_update,
    prefill: Callable[..., torch.Tensor] = causal_conv1d_prefill,
) -> torch.Tensor:
    """SiLU(causal depthwise conv) of every token, each continuing its sequence's conv state.

    Args:
        x: [T, C] pre-conv inputs (decode tokens first).
        weight: [C, K]; bias: [C] or None.
        conv_state: [num_slots, C, K-1], updated in place.
        metadata: the step's ``StateMetadata``.
        update, prefill: the conv of the decode and of the prefill tokens, called as
            ``causal_conv1d_update`` and ``causal_conv1d_prefill`` (the TRITON_* backends pass
            their kernels).
    Returns:
        [T, C] in the dtype of ``x``.
    """
    md = metadata
    return md.split(
        lambda s: update(x[s], weight, bias, conv_state, state_indices=md.decode_slots, silu=True),
        lambda s: prefill(x[s], weight, bias, conv_state, **md.prefill_args(), silu=True))


def gdn_forward(
    layer,
    mixed_qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_cache: Any,
    metadata: StateMetadata,
    *,
    decode: Callable[..., torch.Tensor] = gated_delta_decode,
    prefill: Callable[..., torch.Tensor] = gated_delta_prefill,
    conv_update: Callable[..., torch.Tensor] = causal_conv1d_update,
    conv_prefill: Callable[..., torch.Tensor] = causal_conv1d_prefill,
) -> torch.Tensor:
    """The delta-rule output of every token; the layer's conv and recurrent states advance.

    Args:
        layer: ``num_k_heads``, ``num_v_heads``, ``head_k_dim``, ``head_v_dim`` and
            ``conv_weight`` [C, K] (C = 2 * Hk * dk + Hv * dv).
        mixed_qkv: [T, C] the projected [q | k | v] before the conv.
        g: [T, Hv] log decay (<= 0, float32); beta: [T, Hv] write strength.
        state_cache: ``conv[0]`` [num_slots, C, K-1], ``recurrent[0]`` [num_slots, Hv, dk, dv].
        metadata: the step's ``StateMetadata``.
        decode: the recurrent step of the decode tokens, called as ``gated_delta_decode``
            (TRITON_GDN passes its fused kernel).
        prefill: the chunked form of the prefill tokens, called as ``gated_delta_prefill``.
        conv_update, conv_prefill: the short conv's two forms (``conv_forward``).
    Returns:
        [T, Hv, dv] in the dtype of ``mixed_qkv``.
    """
    t = mixed_qkv.shape[0]
    x = conv_forward(mixed_qkv, layer.conv_weight, None, state_cache.conv[0], metadata, update=conv_update,
                     prefill=conv_prefill)
    key_dim = layer.num_k_heads * layer.head_k_dim
    q, k, v = x.split([key_dim, key_dim, layer.num_v_heads * layer.head_v_dim], dim=-1)
    q = q.reshape(t, layer.num_k_heads, layer.head_k_dim)  # [T, Hk, dk]
    k = k.reshape(t, layer.num_k_heads, layer.head_k_dim)
    v = v.reshape(t, layer.num_v_heads, layer.head_v_dim)  # [T, Hv, dv]
    state, md = state_cache.recurrent[0], metadata
    return md.split(
        lambda s: decode(q[s], k[s], v[s], g[s], beta[s], state, state_indices=md.decode_slots, use_qk_l2norm=True),
        lambda s: prefill(q[s], k[s], v[s], g[s], beta[s], state, **md.prefill_args(),
                          use_qk_l2norm=True, chunk_size=md.chunk_size(64)))


def mamba_forward(layer, x: torch.Tensor, z: torch.Tensor, state_cache: Any, metadata: StateMetadata, *,
                  decode: Callable = selective_scan_decode, prefill: Callable = selective_scan_prefill,
                  conv_update: Callable = causal_conv1d_update,
                  conv_prefill: Callable = causal_conv1d_prefill) -> torch.Tensor:
    """The gated scan output of every token; the layer's conv and SSM states advance.

    Args:
        layer: ``conv_weight`` [Di, K], ``conv_bias`` [Di] or None, ``A`` [Di, N] (negative,
            float32), ``D`` [Di], and ``ssm_params(x [T, Di]) -> (dt [T, Di] after softplus,
            B [T, N], C [T, N])``.
        x: [T, Di] the projected input before the conv; z: [T, Di] the output gate.
        state_cache: ``conv[0]`` [num_slots, Di, K-1], ``recurrent[0]`` [num_slots, Di, N].
        metadata: the step's ``StateMetadata``.
        decode: the one-token scan step, called as ``selective_scan_decode``.
        prefill: the chunked scan of the prefill tokens, called as ``selective_scan_prefill``.
        conv_update, conv_prefill: the short conv's two forms (``conv_forward``).
    Returns:
        [T, Di] ``(C . h + D x) * SiLU(z)`` in the dtype of ``x``.
    """
    xc = conv_forward(x, layer.conv_weight, layer.conv_bias, state_cache.conv[0], metadata, update=conv_update,
                      prefill=conv_prefill)
    dt, b, c = layer.ssm_params(xc)
    a, d = layer.A, layer.D
    state, md = state_cache.recurrent[0], metadata
    return md.split(
        lambda s: decode(xc[s], dt[s], a, b[s], c[s], d, z[s], state, state_indices=md.decode_slots),
        lambda s: prefill(xc[s], dt[s], a, b[s], c[s], d, z[s], state, **md.prefill_args(),
                          chunk_size=md.chunk_size(128)))


def lightning_forward(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state_cache: Any,
                      metadata: StateMetadata, *, decode: Callable = lightning_attention_decode,
                      prefill: Callable = lightning_attention_prefill, conv_update: Callable | None = None,
                      conv_prefill: Callable | None = None) -> torch.Tensor:
    """``o_t = sum_{j<=t} lambda^(t-j) (q_t . k_j) v_j`` per head, over cached and new tokens.

    Args:
        layer: ``decay_rates`` [H] (the per-head ``s_h``, float32) and ``block_size`` (tokens
            per prefill block).
        q, k: [T, H, dk]; v: [T, H, dv] (after the SiLU).
        state_cache: ``recurrent[0]`` [num_slots, H, dk, dv] (no conv state).
        metadata: the step's ``StateMetadata``.
        decode: the one-token step, called as ``lightning_attention_decode``.
        prefill: the block form of the prefill tokens, called as ``lightning_attention_prefill``.
        conv_update, conv_prefill: unused (lightning has no short conv); taken so that every
            state backend hands its step the same kernels.
    Returns:
        [T, H, dv] in the dtype of ``v``.
    """
    state, rates, md = state_cache.recurrent[0], layer.decay_rates, metadata
    return md.split(
        lambda s: decode(q[s], k[s], v[s], rates, state, state_indices=md.decode_slots),
        lambda s: prefill(q[s], k[s], v[s], rates, state, **md.prefill_args(),
                          block_size=md.chunk_size(layer.block_size)))


def kda_forward(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state_cache: Any, metadata: StateMetadata, *, decode: Callable = kda_decode,
                prefill: Callable = kda_prefill, conv_update: Callable = causal_conv1d_update,
                conv_prefill: Callable = causal_conv1d_prefill) -> torch.Tensor:
    """The KDA output of every token; the layer's three conv states and its state advance.

    Args:
        layer: ``num_heads``, ``head_dim`` and ``conv_weights`` (q, k, v: each [H*d, K]).
        q, k, v: [T, H*d] projections before their convs.
        g: [T, H, d] per-channel log decay (<= 0, float32); beta: [T, H].
        state_cache: ``conv`` (q, k, v: each [num_slots, H*d, K-1]), ``recurrent[0]``
            [num_slots, H, d, d].
        metadata: the step's ``StateMetadata``.
        decode: the one-token step, called as ``kda_decode``.
        prefill: the chunked form of the prefill tokens, called as ``kda_prefill``.
        conv_update, conv_prefill: the short conv's two forms (``conv_forward``).
    Returns:
        [T, H, d] in the dtype of ``v``.
    """
    t, h, d = q.shape[0], layer.num_heads, layer.head_dim
    q, k, v = (
        conv_forward(x, w, None, conv, metadata, update=conv_update, prefill=conv_prefill).view(t, h, d)  # [T, H, d]
        for x, w, conv in zip((q, k, v), layer.conv_weights, state_cache.conv)
    )
    state, md = state_cache.recurrent[0], metadata
    return md.split(
        lambda s: decode(q[s], k[s], v[s], g[s], beta[s], state, state_indices=md.decode_slots,
                         use_qk_l2norm=True),
        lambda s: prefill(q[s], k[s], v[s], g[s], beta[s], state, **md.prefill_args(),
                          use_qk_l2norm=True, chunk_size=md.chunk_size(64)))
