"""A request inside the engine: its tokens, how far it is computed, and why it finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from attnserve.kvcache.block_pool import BlockHash, hash_block_tokens
from attnserve.sampling_params import SamplingParams

__all__ = ["Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # a step failed on this request alone (the engine goes on)

    @property
    def finished(self) -> bool:
        return self in _FINISHED  # read several times per request and step: a prebuilt tuple


_FINISHED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
             RequestStatus.FINISHED_ERROR)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    block_size: int = 16
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # advanced when a step is scheduled (its tokens count as computed)
    # sampled tokens of launched steps not yet read back (async scheduling: at most one); the
    # next step may already feed it to the model, taking it from the device
    num_inflight: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule (-1: not scheduled yet)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    generator: torch.Generator | None = None
    # a seeded request's generator state before each scheduled sample: (index of the output
    # token that sample makes, state); a failed step's draws are undone with it
    rng_checkpoints: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    num_preemptions: int = 0
    # prompt logprobs are computed once even if the request is preempted and recomputed
    num_prompt_logprobs_done: int = 0
    first_token_time: float | None = None
    # time.monotonic() when the scheduler first gave it a step (vLLM's scheduled_ts); a
    # preempted request keeps it
    first_scheduled_time: float | None = None
    cacheable: bool = True  # False: never served from or stored in the prefix cache
    # bad_words as token sequences: the last token of each is banned where the output ends
    # with the others (``layers/sampler.bad_words_bans``)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # structured output: the engine's matcher (``engine/structured_output.RequestGrammar``),
    # advanced by each appended output token; None for an unconstrained request
    grammar: Any = None

    def __post_init__(self) -> None:
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.sampling_params.seed)
        self._all_token_ids = list(self.prompt_token_ids)
        self._update_block_hashes()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    @property
    def num_known_tokens(self) -> int:
        """Tokens the model has or will have seen: prompt, outputs, and those still in flight."""
        return len(self._all_token_ids) + self.num_inflight

    @property
    def needs_host_tokens(self) -> bool:
        """Sampling reads this request's latest outputs on the host (penalties, a min_tokens ban
        that may still apply, a grammar's next mask, bad words of several tokens), so its next
        step's sampling waits until they are back (its forward need not)."""
        p = self.sampling_params
        return (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
                or self.num_output_tokens < p.min_tokens or self.grammar is not None
                or any(len(w) > 1 for w in self.bad_words_token_ids))

    @property
    def needs_host_tokens_to_launch(self) -> bool:
        """A step's inputs read this request's progress on the host: prompt logprobs still being
        computed (which positions need logits), so its next step is launched only once the
        step before is back."""
        p = self.sampling_params
        return p.prompt_logprobs is not None and self.num_prompt_logprobs_done < self.num_prompt_tokens - 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    @property
    def skip_prefix_cache(self) -> bool:
        """Prompt logprobs need logits at every prompt position, so such requests compute it all;
        requests of models whose RoPE depends on the sequence length are not cacheable."""
        return self.wants_prompt_logprobs or not self.cacheable

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if len(self._all_token_ids) % self.block_size == 0:  # a block just filled up
            self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        full = len(self._all_token_ids) // self.block_size
        parent = self.block_hashes[-1] if self.block_hashes else None
        for i in range(len(self.block_hashes), full):
            parent = hash_block_tokens(parent, self._all_token_ids[i * self.block_size:(i + 1) * self.block_size])
            self.block_hashes.append(parent)
