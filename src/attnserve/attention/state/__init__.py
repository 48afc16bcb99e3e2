"""State layers' mechanisms (Gated DeltaNet, KDA, Mamba, lightning): their math and backends.

The math (exported here): pure tensor functions over a state pool, no weights. Each mechanism
has a chunked (or block / parallel-scan) prefill form over a varlen batch and a recurrent decode
form (one token per sequence); the two agree up to rounding. Every function takes flat tokens
with ``query_start_loc`` [B+1], reads each sequence's state at ``state_indices`` [B] (zeros where
``has_initial_state`` [B] is False) and writes the new state back in place; the Triton decode
kernels (``ops/``) are tested against them. Beside it: the ``StateBackend`` base and the step's
decode/prefill split (``base.py``), each mechanism's layer step (``steps.py``) and the backends
(``torch_backends.py``, ``triton_backends.py``). Not here: the layers that own the projections
and norms (``layers/``).
"""

from __future__ import annotations

from attnserve.attention.state.conv import causal_conv1d_prefill, causal_conv1d_update
from attnserve.attention.state.gated_delta import (
    delta_rule_decode,
    delta_rule_prefill,
    gated_delta_decode,
    gated_delta_prefill,
    l2norm,
)
from attnserve.attention.state.kda import kda_decode, kda_prefill
from attnserve.attention.state.lightning import (
    lightning_attention_decode,
    lightning_attention_prefill,
    lightning_decay_rates,
)
from attnserve.attention.state.mamba import selective_scan_decode, selective_scan_prefill

__all__ = [
    "causal_conv1d_prefill",
    "causal_conv1d_update",
    "delta_rule_decode",
    "delta_rule_prefill",
    "gated_delta_decode",
    "gated_delta_prefill",
    "kda_decode",
    "kda_prefill",
    "l2norm",
    "lightning_attention_decode",
    "lightning_attention_prefill",
    "lightning_decay_rates",
    "selective_scan_decode",
    "selective_scan_prefill",
]
