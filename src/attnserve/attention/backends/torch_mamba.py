"""TORCH_MAMBA: the Mamba-1 selective scan (Jamba) over a state pool in PyTorch.

Per step: the short conv of every token (decode tokens continue their conv state one step,
prefill chunks from theirs or from zeros), the layer's token-wise ``ssm_params`` (x_proj, the
dt/B/C norms, dt_proj, softplus), then the recurrent scan step for decode requests and the
chunked parallel scan for the rest. The decode/prefill split is ``StateMetadata``
(``torch_gdn.py``). ``mamba_forward`` is the whole layer step; TRITON_MAMBA (``triton_mamba.py``)
runs it with its fused decode kernel in place of the PyTorch decode step.

What it is not: the in/out projections and the gate (the layer, ``layers/mamba.py``), the
arithmetic (``layers/state_ops``), Mamba-2, or a kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from attnserve.attention.backend import AttentionBackend
from attnserve.attention.backends.torch_gdn import StateMetadata, build_state_metadata, conv_forward
from attnserve.layers.state_ops import selective_scan_decode, selective_scan_prefill

__all__ = ["TorchMambaBackend", "mamba_forward"]


class TorchMambaBackend(AttentionBackend):
    name = "TORCH_MAMBA"

    def __init__(self, block_size: int):
        self.block_size = block_size

    def build_metadata(self, common: Any, group_id: int) -> StateMetadata:
        return build_state_metadata(common)

    def forward(
        self, layer, x: torch.Tensor, z: torch.Tensor, state_cache: Any, metadata: StateMetadata
    ) -> torch.Tensor:
        """The gated scan output of every token; the layer's conv and SSM states advance.

        Args:
            layer: ``conv_weight`` [Di, K], ``conv_bias`` [Di] or None, ``A`` [Di, N] (negative,
                float32), ``D`` [Di], and ``ssm_params(x [T, Di]) -> (dt [T, Di] after softplus,
                B [T, N], C [T, N])``.
            x: [T, Di] the projected input before the conv; z: [T, Di] the output gate.
            state_cache: ``conv[0]`` [num_slots, Di, K-1], ``recurrent[0]`` [num_slots, Di, N].
            metadata: the step's ``StateMetadata``.
        Returns:
            [T, Di] ``(C . h + D x) * SiLU(z)`` in the dtype of ``x``.
        """
        return mamba_forward(layer, x, z, state_cache, metadata)


def mamba_forward(layer, x: torch.Tensor, z: torch.Tensor, state_cache: Any, metadata: StateMetadata, *,
                  decode: Callable = selective_scan_decode) -> torch.Tensor:
    """``TorchMambaBackend.forward`` with the one-token step ``decode``, called as
    ``selective_scan_decode`` (TRITON_MAMBA passes its kernel); the conv stays PyTorch."""
    xc = conv_forward(x, layer.conv_weight, layer.conv_bias, state_cache.conv[0], metadata)
    dt, b, c = layer.ssm_params(xc)
    a, d = layer.A, layer.D
    state, md = state_cache.recurrent[0], metadata
    return md.split(
        lambda s: decode(xc[s], dt[s], a, b[s], c[s], d, z[s], state, state_indices=md.decode_slots),
        lambda s: selective_scan_prefill(xc[s], dt[s], a, b[s], c[s], d, z[s], state, **md.prefill_args(),
                                         chunk_size=md.chunk_size(128)))
