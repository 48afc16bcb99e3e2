"""Incremental detokenisation: the new text of a request's output at each engine step.

``IncrementalDetokenizer.step(new_ids)`` returns only the text that the new token ids add. The
text it has returned is always ``tokenizer.decode(output_ids)`` with any trailing U+FFFD held
back: a token can end in the middle of a UTF-8 character (byte-level BPE, byte fallback), and
the next tokens may complete it. ``flush()`` returns what is held back once the request ends.

Each step decodes a short window of recent tokens, not the whole output (vLLM's prefix and read
offsets): the window starts at a token already emitted, so that decoders which treat the first
token specially (a leading "▁" dropped, skipped special tokens) see the same start in both
decodes and their difference is the new text.

Not here: stop strings and their truncation (the engine checks them on ``output_text``), and
prompt text (the output text is defined without the prompt as context, so for SentencePiece-style
tokenizers it does not start with the space that vLLM keeps).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnserve.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "decode_token"]

_REPLACEMENT = "\ufffd"


def decode_token(tokenizer: Tokenizer, token_id: int) -> str:
    """The text of one token as shown next to its logprob (vLLM's ``decoded_token``): special
    tokens are shown, a partial UTF-8 character is U+FFFD."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a request's output token ids into text, a few tokens at a time.

    Args:
        tokenizer: the model's tokenizer.
        prompt_ids: the request's prompt; kept for the caller (``num_prompt_tokens``), not used
            as decoding context (see the module docstring).
        skip_special_tokens: drop special tokens from the text, as ``decode`` does.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.num_prompt_tokens = len(prompt_ids)
        self.output_ids: list[int] = []
        self.output_text = ""  # everything step() and flush() have returned
        self._prefix_offset = 0  # window start: tokens in [prefix, read) are context, emitted
        self._read_offset = 0  # tokens from here on are not (fully) emitted yet
        self._num_held_emitted = 0  # chars of the window's new text emitted before its tail

    def step(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids`` to the output and return the text they complete.

        Returns:
            The new text; "" while the output ends inside a UTF-8 character.
        """
        self.output_ids.extend(new_ids)
        new_text = self._window_text()
        if new_text.endswith(_REPLACEMENT):
            # Emit what precedes the incomplete tail; keep the window until the tail resolves.
            stable = new_text.rstrip(_REPLACEMENT)
            delta = stable[self._num_held_emitted :]
            self._num_held_emitted = max(self._num_held_emitted, len(stable))
        else:
            delta = new_text[self._num_held_emitted :]
            self._advance(new_text)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """Return the held-back tail (U+FFFD for a character that was never completed)."""
        new_text = self._window_text()
        delta = new_text[self._num_held_emitted :]
        self._advance(new_text)
        self.output_text += delta
        return delta

    def _window_text(self) -> str:
        ids, start = self.output_ids, self._prefix_offset
        skip = self.skip_special_tokens
        prefix_text = self.tokenizer.decode(
            ids[start : self._read_offset], skip_special_tokens=skip
        )
        full_text = self.tokenizer.decode(ids[start:], skip_special_tokens=skip)
        return full_text[len(prefix_text) :]

    def _advance(self, new_text: str) -> None:
        # The next window starts at the tokens just emitted, unless they rendered nothing (skipped
        # special tokens, ids outside the vocabulary): a window must begin with a token that
        # decodes, or the decoder's first-token handling would fall on a new token instead.
        if new_text:
            self._prefix_offset = self._read_offset
        self._read_offset = len(self.output_ids)
        self._num_held_emitted = 0
