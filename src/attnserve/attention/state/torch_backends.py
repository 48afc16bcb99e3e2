"""The state backends in PyTorch, on any device: TORCH_GDN, TORCH_MAMBA, TORCH_LIGHTNING, TORCH_KDA.

Each is its mechanism's layer step (``steps.py``) with the PyTorch recurrent form for the decode
tokens and the chunked form for the prefills: Gated DeltaNet (Qwen3-Next, Qwen3.5), the Mamba-1
selective scan (Jamba), MiniMax's lightning attention and Kimi delta attention (Kimi-Linear).
The fused decode kernels are the TRITON_* twins (``triton_backends.py``).

All four are ``cuda_graph_safe``: a decode-only step runs the conv update and the recurrent form
over the step's slots with gathers and scatters by index (no host reads, no boolean indexing,
shapes fixed by the batch size), so a captured graph replays it for any slot values
(``base.py`` says what the captured metadata holds).
"""

from __future__ import annotations

from attnserve.attention.state.base import StateBackend
from attnserve.attention.state.steps import (
    gdn_forward,
    kda_forward,
    lightning_forward,
    mamba_forward,
)

__all__ = ["TorchGDNBackend", "TorchKDABackend", "TorchLightningBackend", "TorchMambaBackend"]


class TorchGDNBackend(StateBackend):
    """Gated DeltaNet: short conv, then the chunked (prefill) or recurrent (decode) delta rule."""

    name = "TORCH_GDN"
    cuda_graph_safe = True
    step = staticmethod(gdn_forward)


class TorchMambaBackend(StateBackend):
    """Mamba-1: short conv (with bias), token-wise SSM inputs, chunked or recurrent scan."""

    name = "TORCH_MAMBA"
    cuda_graph_safe = True
    step = staticmethod(mamba_forward)


class TorchLightningBackend(StateBackend):
    """Lightning attention: block-wise prefill, recurrent decode (no conv state)."""

    name = "TORCH_LIGHTNING"
    cuda_graph_safe = True
    step = staticmethod(lightning_forward)


class TorchKDABackend(StateBackend):
    """Kimi delta attention: three short convs, chunked WY prefill, recurrent decode."""

    name = "TORCH_KDA"
    cuda_graph_safe = True
    step = staticmethod(kda_forward)
