"""vLLM's ``prompt_logprobs`` request field on both endpoints: checked, and rendered as vLLM does.

The request asks for the top ``k`` logprobs at each prompt position (plus the prompt token's
own); -1 asks for the whole vocabulary. Either is bounded by the server's ``max_logprobs``
(``--max-logprobs``, -1: no bound), as vLLM bounds it, with a 400 naming the field.

The answer has vLLM's shape: a list with one entry per prompt token, the first ``None`` (no
token predicts it), then ``{"<token id>": {"logprob", "rank", "decoded_token"}}``. A completion
carries it on each choice, a chat response at its top level (vLLM's places). A stream carries
it on its first chunk with generated text (vLLM refuses ``prompt_logprobs`` with ``stream``:
an extension). ``-inf`` becomes -9999.0, as vLLM clamps it, since JSON has no infinity.

Not here: computing them (the engine: ``SamplingParams.prompt_logprobs``), echo's completion
logprobs (``serving_completion.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from attnserve.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    CompletionChoice,
    OpenAIError,
    check_logprobs,
)
from attnserve.outputs import Logprob

__all__ = ["ChatChunkWithPromptLogprobs", "CompletionChoiceWithPromptLogprobs", "check_prompt_logprobs",
           "render_prompt_logprobs"]

_CLAMP = -9999.0  # what vLLM sends for a logprob of -inf


class CompletionChoiceWithPromptLogprobs(CompletionChoice):
    """A completion choice with the prompt's logprobs (others go without the field)."""

    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class ChatChunkWithPromptLogprobs(ChatCompletionChunk):
    """A chat stream's first chunk with generated text, when the request asked for them (the
    other chunks go without the field)."""

    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


def check_prompt_logprobs(value: int | None, vocab_size: int, max_logprobs: int) -> int | None:
    """The engine's ``prompt_logprobs`` for the request's: -1 is the whole vocabulary; another
    negative value, or more than ``max_logprobs`` allows, is a 400 naming the field."""
    if value is None:
        return None
    if value < -1:
        raise OpenAIError(f"prompt_logprobs must be a non-negative integer or -1 (the whole vocabulary), "
                          f"got {value}", param="prompt_logprobs")
    k = vocab_size if value == -1 else value
    check_logprobs(k, max_logprobs, "prompt_logprobs")
    return k


def render_prompt_logprobs(
    entries: Sequence[dict[int, Logprob] | None] | None,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """The engine's prompt logprobs in vLLM's JSON shape (token ids as string keys)."""
    if entries is None:
        return None
    return [
        None if entry is None else {
            str(tid): {"logprob": _CLAMP if math.isinf(lp.logprob) else lp.logprob, "rank": lp.rank,
                       "decoded_token": lp.decoded_token}
            for tid, lp in entry.items()
        }
        for entry in entries
    ]
