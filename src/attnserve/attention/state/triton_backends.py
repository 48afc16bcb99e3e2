"""The state backends with their decode step (and the delta rule's prefill) in Triton (CUDA, ROCm).

TRITON_GDN, TRITON_MAMBA, TRITON_LIGHTNING and TRITON_KDA run the same layer step, metadata and
state layout as their TORCH_* twins (``torch_backends.py``), with the decode tokens' recurrence
through a kernel that reads each sequence's state once and writes it once
(``ops/triton_gdn.fused_delta_rule_decode``, with per-head or per-key-channel decay for KDA;
``ops/triton_state_decode``: Mamba's scan step with skip and gate in the same pass, lightning's
decayed update). TRITON_GDN's and TRITON_KDA's prefills run the chunked delta rule in two varlen
launches (``ops/triton_delta_prefill``: no padding, no host synchronisation); Mamba's and
lightning's prefills keep the chunked PyTorch forms, and the convs stay PyTorch. On CPU they
run only when named, under Triton's interpreter (tests). Not graph-captured yet: hybrid models
run eagerly.
"""

from __future__ import annotations

from attnserve.attention.state.base import StateBackend
from attnserve.attention.state.steps import (
    gdn_forward,
    kda_forward,
    lightning_forward,
    mamba_forward,
)
from attnserve.ops.triton_delta_prefill import fused_gated_delta_prefill, fused_kda_prefill
from attnserve.ops.triton_gdn import fused_delta_rule_decode
from attnserve.ops.triton_state_decode import fused_lightning_decode, fused_selective_scan_decode

__all__ = ["TritonGDNBackend", "TritonKDABackend", "TritonLightningBackend", "TritonMambaBackend"]


class TritonGDNBackend(StateBackend):
    """Gated DeltaNet: chunked prefill and fused recurrent decode, both Triton."""

    name = "TRITON_GDN"
    step = staticmethod(gdn_forward)
    decode = staticmethod(fused_delta_rule_decode)
    prefill = staticmethod(fused_gated_delta_prefill)


class TritonMambaBackend(StateBackend):
    """Mamba-1: chunked prefill scan (PyTorch), fused recurrent decode (Triton)."""

    name = "TRITON_MAMBA"
    step = staticmethod(mamba_forward)
    decode = staticmethod(fused_selective_scan_decode)


class TritonLightningBackend(StateBackend):
    """Lightning attention: block prefill (PyTorch), fused recurrent decode (Triton)."""

    name = "TRITON_LIGHTNING"
    step = staticmethod(lightning_forward)
    decode = staticmethod(fused_lightning_decode)


class TritonKDABackend(StateBackend):
    """Kimi delta attention: chunked prefill and fused per-key-channel decode, both Triton."""

    name = "TRITON_KDA"
    step = staticmethod(kda_forward)
    decode = staticmethod(fused_delta_rule_decode)
    prefill = staticmethod(fused_kda_prefill)
