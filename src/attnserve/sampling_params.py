"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's fields)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["INT64_MAX", "SamplingParams"]

INT64_MAX = 2**63 - 1  # integer fields become int64 tensors in the sampler


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None  # top-k per prompt position (plus the prompt token)
    skip_special_tokens: bool = True
    detokenize: bool = True
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids"):  # one value or a list of them
            value = getattr(self, name)
            if value is None:
                value = []
            elif isinstance(value, (str, int)) and not isinstance(value, bool):
                value = [value]
            elif isinstance(value, (list, tuple)):
                value = list(value)
            else:
                raise ValueError(f"{name} must be a list, got {type(value).__name__}")
            setattr(self, name, value)
        self._validate()

    def _validate(self) -> None:  # noqa: C901 - a flat list of checks reads best
        """Every field's type and range, so that nothing a request carries can fail inside an
        engine step: integers fit int64 (the sampler's tensors), floats are finite."""

        def bad(msg: str) -> None:
            raise ValueError(msg)

        def integer(name: str, low: int, high: int = INT64_MAX, optional: bool = False) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            if not _is_int(value) or not low <= value <= high:
                bad(f"{name} must be an integer in [{low}, {high}], got {value!r}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value):
                bad(f"{name} must be a finite number, got {value!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        integer("n", 1)
        if self.temperature < 0.0:
            bad(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        integer("top_k", -1)  # -1 or 0: disabled; above the vocabulary: no limit
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            bad(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        integer("seed", 0, optional=True)
        integer("max_tokens", 1, optional=True)
        integer("min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        integer("logprobs", 0, optional=True)  # the engine bounds both by the vocabulary
        integer("prompt_logprobs", 0, optional=True)
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop strings must be non-empty strings")
        if any(not _is_int(t) or not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            bad(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids[:8]!r}")

    def child_seed(self, index: int) -> int | None:
        """The seed of the ``index``-th of ``n`` completions: ``seed + index``, within int64."""
        return None if self.seed is None else (self.seed + index) % (INT64_MAX + 1)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
