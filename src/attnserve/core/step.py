"""What one step hands over between the engine and the runner, in both directions.

The scheduler's output (``SchedulerOutput``: which requests, how many tokens each, their block
ids per KV cache group, state-slot copies and offload jobs) goes down to the runner; the
runner's output (``RunnerOutput``: sampled tokens and logprobs by request id) comes back. These
are the only types the engine and the runner exchange, so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnserve.core.request import Request
from attnserve.kvcache.offload.manager import LoadJob, StoreJob

__all__ = ["GrammarBitmask", "RunnerOutput", "ScheduledRequest", "SchedulerOutput", "TokenLogprobs"]


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_ids: list[list[int]]  # per KV cache group: the KV manager's own lists, valid for this step
    state_slot: int = 0  # hybrid models: the request's state slot (0: none)
    start: int = 0  # position of the first token scheduled this step
    samples: bool = False  # the step reaches the end of the known tokens, so a token is sampled


@dataclass(frozen=True, slots=True)
class GrammarBitmask:
    """Structured output: the tokens each constrained request that samples this step may take.
    The engine fills it after the step's forward is launched and hands it to ``ModelRunner.sample``."""

    request_ids: tuple[str, ...]
    bitmask: torch.Tensor  # [len(request_ids), ceil(V / 32)] int32, host; bit j of word i: token 32i + j


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[str, ...] = ()
    state_copies: tuple[tuple[int, int], ...] = ()  # (src, dst) state slots, before the forward
    offload: tuple[StoreJob, list[LoadJob]] | None = None  # copies to and from the offload tier

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# (token ids, logprobs, rank of the first id): the chosen/prompt token first, then the top-k
TokenLogprobs = tuple[list[int], list[float], int]


@dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
