"""The batch limits an engine runs with: ``max_num_seqs`` and ``max_num_batched_tokens``.

A value the user sets is used as given. One left out (None) is the platform default of
``BATCH_DEFAULTS``, by device class (CPU, a GPU under 70 GiB, a GPU of 70 GiB or more) and usage
context (the offline ``LLM`` class, or the OpenAI server), as vLLM chooses them
(``EngineArgs.get_batch_defaults``): a large GPU is fast only with large steps, a server keeps
its steps shorter than an offline batch for the latency of the requests already decoding.

A default (never a value the user set) is then capped where the engine's memory says so, and
the cap is logged: the state slots of a hybrid model (``cap_by_state``; one per running sequence
and as many snapshots, each state is tens of MiB for a large model, so 1,024 of them would not
fit), and the KV cache (``cap_by_blocks``; a running sequence holds at least one block).

This file decides the numbers and says why; it reads no device (the caller passes the device's
memory) and allocates nothing. ``engine/builder.py`` resolves them once, before anything is
sized; ``entrypoints/inspect.py`` shows the table.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from attnserve.config import USAGE_CONTEXTS, SchedulerConfig

__all__ = ["BATCH_DEFAULTS", "LARGE_GPU_GIB", "BatchLimits", "device_class", "resolve_batch_limits"]

GIB = 1024**3
LARGE_GPU_GIB = 70  # H100 / H200 / B200 class (vLLM's threshold)

# (device class, usage context) -> (max_num_seqs, max_num_batched_tokens). Edit the numbers here.
# CPU keeps the small limits it always had: a CPU step is compute-bound from a few hundred
# tokens on, so larger steps add no throughput, only latency for the requests decoding in them,
# and the CPU KV budget grows with max_num_seqs (``runner/cache_allocation.py``).
BATCH_DEFAULTS: dict[tuple[str, str], tuple[int, int]] = {
    ("gpu-large", "llm"): (1024, 16384),
    ("gpu-large", "server"): (1024, 8192),
    ("gpu", "llm"): (256, 8192),
    ("gpu", "server"): (256, 2048),
    ("cpu", "llm"): (128, 2048),
    ("cpu", "server"): (128, 2048),
}

_CLASS_LABELS = {"gpu-large": f"GPU >= {LARGE_GPU_GIB} GiB", "gpu": f"GPU < {LARGE_GPU_GIB} GiB", "cpu": "CPU"}
_USAGE_LABELS = {"llm": "LLM class", "server": "OpenAI server"}
USER = "set by the user"


def device_class(device_type: str, device_memory_bytes: int | None) -> str:
    """"cpu", "gpu" or "gpu-large" (a CUDA/ROCm device of ``LARGE_GPU_GIB`` or more; unknown
    memory counts as small)."""
    if device_type == "cpu":
        return "cpu"
    if device_type != "cuda":
        raise ValueError(f"no batch defaults for device type '{device_type}' (cpu or cuda)")
    return "gpu-large" if device_memory_bytes is not None and device_memory_bytes >= LARGE_GPU_GIB * GIB else "gpu"


def default_label(cls: str, usage_context: str) -> str:
    return f"platform default for {_CLASS_LABELS[cls]}, {_USAGE_LABELS[usage_context]}"


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """The resolved limits, each with why it has its value."""

    max_num_seqs: int
    max_num_batched_tokens: int
    seqs_reason: str
    tokens_reason: str
    seqs_by_user: bool = False

    def describe(self) -> str:
        """"max_num_seqs 1024, max_num_batched_tokens 16384 (platform default for ...)", each
        value with its own reason where they differ."""
        if self.seqs_reason == self.tokens_reason:
            return (f"max_num_seqs {self.max_num_seqs}, max_num_batched_tokens {self.max_num_batched_tokens} "
                    f"({self.seqs_reason})")
        return (f"max_num_seqs {self.max_num_seqs} ({self.seqs_reason}), max_num_batched_tokens "
                f"{self.max_num_batched_tokens} ({self.tokens_reason})")

    def apply(self, sched: SchedulerConfig) -> SchedulerConfig:
        return replace(sched, max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens)

    def capped(self, cap: int, why: str) -> BatchLimits:
        if self.seqs_by_user or cap >= self.max_num_seqs:
            return self
        return replace(self, max_num_seqs=max(1, cap),
                       seqs_reason=f"{self.seqs_reason}, capped from {self.max_num_seqs}: {why}")

    def cap_by_state(self, budget_bytes: int, state_bytes_per_seq: int, snapshots_per_seq: int) -> BatchLimits:
        """A default capped so that its state slots (``snapshots_per_seq`` more per running
        sequence: 1 when the snapshots default to max_num_seqs, else 0) take at most half of
        ``budget_bytes``, the rest being left to the KV blocks."""
        per_seq = state_bytes_per_seq * (1 + snapshots_per_seq)
        if per_seq <= 0:
            return self
        cap = budget_bytes // 2 // per_seq
        return self.capped(cap, f"{cap} sequences' state slots fill half the memory left "
                                 f"({budget_bytes / GIB:.1f} GiB)")

    def cap_by_blocks(self, usable_blocks: int) -> BatchLimits:
        """A default capped at the KV cache's usable blocks: a running sequence holds one at least."""
        return self.capped(usable_blocks, f"the KV cache holds {usable_blocks} blocks")


def resolve_batch_limits(sched: SchedulerConfig, device_type: str, device_memory_bytes: int | None,
                         usage_context: str, max_model_len: int) -> BatchLimits:
    """The user's values where set, ``BATCH_DEFAULTS`` elsewhere.

    Without chunked prefill every prompt is prefilled in one step, so a default token budget is
    raised to ``max_model_len`` (as vLLM does) and a smaller one the user set is an error.
    A default ``max_num_seqs`` above the token budget the user set is lowered to it (each
    running sequence takes one token a step).
    """
    if usage_context not in USAGE_CONTEXTS:
        raise ValueError(f"usage_context must be one of {USAGE_CONTEXTS}, got '{usage_context}'")
    cls = device_class(device_type, device_memory_bytes)
    default_seqs, default_tokens = BATCH_DEFAULTS[(cls, usage_context)]
    label = default_label(cls, usage_context)
    seqs_by_user = sched.max_num_seqs is not None
    seqs, seqs_reason = (sched.max_num_seqs, USER) if seqs_by_user else (default_seqs, label)
    if sched.max_num_batched_tokens is not None:
        tokens, tokens_reason = sched.max_num_batched_tokens, USER
        if not sched.enable_chunked_prefill and tokens < max_model_len:
            raise ValueError(f"max_num_batched_tokens ({tokens}) is smaller than max_model_len ({max_model_len}): "
                             f"without chunked prefill a prompt is prefilled in one step; raise it, lower "
                             f"max_model_len, or enable chunked prefill")
        if not seqs_by_user and seqs > tokens:
            seqs, seqs_reason = tokens, f"{label}, lowered to max_num_batched_tokens"
    else:
        tokens, tokens_reason = default_tokens, label
        if not sched.enable_chunked_prefill and tokens < max_model_len:
            tokens, tokens_reason = max_model_len, f"{label}, raised to max_model_len (no chunked prefill)"
    return BatchLimits(seqs, tokens, seqs_reason, tokens_reason, seqs_by_user)
