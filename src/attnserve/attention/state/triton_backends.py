"""The state backends with Triton kernels for their decode steps, prefills and short convs.

TRITON_GDN, TRITON_MAMBA, TRITON_LIGHTNING and TRITON_KDA run the same layer step, metadata and
state layout as their TORCH_* twins (``torch_backends.py``), with the decode tokens' recurrence
through a kernel that reads each sequence's state once and writes it once
(``ops/state/delta_decode_triton.fused_delta_rule_decode``, with per-head or per-key-channel decay for KDA;
``ops/state/decode_triton``: Mamba's scan step with skip and gate in the same pass, lightning's
decayed update). The prefills are kernels too: the chunked delta rule of GDN and KDA in two
varlen launches (``ops/state/delta_prefill_triton``), Mamba's scan token by token and lightning block by
block (``ops/state/prefill_triton``), each sequence's bounds read on the device, no padding and no
host synchronisation; so is the short conv of GDN, Mamba and KDA, prefill and decode. On CPU they
run only when named, under Triton's interpreter (tests). All four are ``cuda_graph_safe``: the
kernels take the slots as a device tensor and launch a grid fixed by the batch size.
"""

from __future__ import annotations

from attnserve.attention.state.base import StateBackend
from attnserve.attention.state.steps import (
    gdn_forward,
    kda_forward,
    lightning_forward,
    mamba_forward,
)
from attnserve.ops.state.decode_triton import fused_lightning_decode, fused_selective_scan_decode
from attnserve.ops.state.delta_decode_triton import fused_delta_rule_decode
from attnserve.ops.state.delta_prefill_triton import fused_gated_delta_prefill, fused_kda_prefill
from attnserve.ops.state.prefill_triton import (
    fused_causal_conv1d_prefill,
    fused_causal_conv1d_update,
    fused_lightning_prefill,
    fused_selective_scan_prefill,
)

__all__ = ["TritonGDNBackend", "TritonKDABackend", "TritonLightningBackend", "TritonMambaBackend"]


class TritonGDNBackend(StateBackend):
    """Gated DeltaNet: chunked prefill, fused recurrent decode and short conv, all Triton."""

    name = "TRITON_GDN"
    cuda_graph_safe = True
    step = staticmethod(gdn_forward)
    decode = staticmethod(fused_delta_rule_decode)
    prefill = staticmethod(fused_gated_delta_prefill)
    conv_update = staticmethod(fused_causal_conv1d_update)
    conv_prefill = staticmethod(fused_causal_conv1d_prefill)


class TritonMambaBackend(StateBackend):
    """Mamba-1: prefill scan, recurrent decode and short conv, all Triton."""

    name = "TRITON_MAMBA"
    cuda_graph_safe = True
    step = staticmethod(mamba_forward)
    decode = staticmethod(fused_selective_scan_decode)
    prefill = staticmethod(fused_selective_scan_prefill)
    conv_update = staticmethod(fused_causal_conv1d_update)
    conv_prefill = staticmethod(fused_causal_conv1d_prefill)


class TritonLightningBackend(StateBackend):
    """Lightning attention: block prefill and recurrent decode, both Triton (no short conv: the conv
    pair is set for uniformity and unused)."""

    name = "TRITON_LIGHTNING"
    cuda_graph_safe = True
    step = staticmethod(lightning_forward)
    decode = staticmethod(fused_lightning_decode)
    prefill = staticmethod(fused_lightning_prefill)
    conv_update = staticmethod(fused_causal_conv1d_update)
    conv_prefill = staticmethod(fused_causal_conv1d_prefill)


class TritonKDABackend(StateBackend):
    """Kimi delta attention: chunked prefill, fused per-key-channel decode and short convs, all Triton."""

    name = "TRITON_KDA"
    cuda_graph_safe = True
    step = staticmethod(kda_forward)
    decode = staticmethod(fused_delta_rule_decode)
    prefill = staticmethod(fused_kda_prefill)
    conv_update = staticmethod(fused_causal_conv1d_update)
    conv_prefill = staticmethod(fused_causal_conv1d_prefill)
