"""Incremental detokenisation: the new text of a request's output at each engine step.

``IncrementalDetokenizer.step(new_ids)`` returns only the text that the new token ids add. The
text it has returned is always ``tokenizer.decode(output_ids)`` with any trailing U+FFFD held
back: a token can end in the middle of a UTF-8 character (byte-level BPE, byte fallback), and
the next tokens may complete it. ``flush()`` returns what is held back once the request ends.

Each step decodes a short window of recent tokens, not the whole output (vLLM's prefix and read
offsets): the window starts at a token already emitted, so that decoders which treat the first
token specially (a leading "▁" dropped, skipped special tokens) see the same start in both
decodes and their difference is the new text. The context's text is decoded once per window
(and a one-token context, the common case, is looked up per tokenizer), so a step costs about
one decode.

Trailing U+FFFD is held back only while a later token can still change it. Where the tokenizer
says which bytes its tokens add (``Tokenizer.token_bytes``: the byte tokenizer, whose ids past
the bytes are each a lone U+FFFD), a cut between two tokens is final once the bytes before it
end no unfinished UTF-8 sequence, or the token after it starts with no continuation byte: the
text up to a final cut is released, U+FFFD included, and the window restarts there. So a stream
of undecodable ids (random weights) costs a short window per step, not the whole output.
Without byte knowledge the held tail waits for a character that decodes (always correct).

``SamplingParams.spaces_between_special_tokens`` (vLLM's) is not read here: transformers
applies it only in its slow tokenizers, by joining the text of added tokens and the text between
them with spaces; the tokenizers here decode as transformers' fast tokenizers do, which ignore it
(as vLLM's fast detokenizer does), so either value gives the same text.

Not here: stop strings and their truncation (the engine checks them on ``output_text``), and
prompt text (the output text is defined without the prompt as context, so for SentencePiece-style
tokenizers it does not start with the space that vLLM keeps).
"""

from __future__ import annotations

import codecs
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnserve.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "decode_token"]

_REPLACEMENT = "\ufffd"
_NEVER_IN_UTF8 = frozenset((0xC0, 0xC1, *range(0xF5, 0x100)))  # bytes that end any sequence
_CUT_SEARCH = 8  # held tokens searched for a final cut per step (a cut is found as it arrives)


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
        self._prefix_text: str | None = None  # decode of [prefix, read): fixed until they move
        self._one_token_texts = _one_token_texts(tokenizer, skip_special_tokens)

    def step(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids`` to the output and return the text they complete.

        Returns:
            The new text; "" while the output ends inside a UTF-8 character.
        """
        self.output_ids.extend(new_ids)
        new_text = self._window_text()
        delta = ""
        if new_text.endswith(_REPLACEMENT) and (cut := self._final_cut()) is not None:
            # Release the window's text up to the cut (final, U+FFFD included); go on from there.
            text = new_text if cut == len(self.output_ids) else self._window_text(cut)
            delta = text[self._num_held_emitted :]
            held = max(self._num_held_emitted - len(text), 0)  # emitted chars past the cut
            self._advance(text, cut)
            self._num_held_emitted = held
            if cut == len(self.output_ids):
                self.output_text += delta
                return delta
            new_text = self._window_text()
        if new_text.endswith(_REPLACEMENT):
            # Emit what precedes the incomplete tail; keep the window until the tail resolves.
            stable = new_text.rstrip(_REPLACEMENT)
            delta += stable[self._num_held_emitted :]
            self._num_held_emitted = max(self._num_held_emitted, len(stable))
        else:
            delta += new_text[self._num_held_emitted :]
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

    def _window_text(self, end: int | None = None) -> str:
        """The text of tokens ``[read_offset, end)`` (default: all), decoded in the window."""
        ids, start = self.output_ids, self._prefix_offset
        if self._prefix_text is None:
            self._prefix_text = self._decode_prefix()
        full_text = self.tokenizer.decode(ids[start:end], skip_special_tokens=self.skip_special_tokens)
        return full_text[len(self._prefix_text) :]

    def _decode_prefix(self) -> str:
        """The text of the window's context ``[prefix_offset, read_offset)``. After one token per
        step it is the token before last alone, whose text is remembered per tokenizer."""
        start, end = self._prefix_offset, self._read_offset
        if end - start != 1:
            return self.tokenizer.decode(self.output_ids[start:end], skip_special_tokens=self.skip_special_tokens)
        token_id = self.output_ids[start]
        text = self._one_token_texts.get(token_id)
        if text is None:
            text = self._one_token_texts[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=self.skip_special_tokens)
        return text

    def _advance(self, new_text: str, end: int | None = None) -> None:
        # The next window starts at the tokens just emitted, unless they rendered nothing (skipped
        # special tokens, ids outside the vocabulary): a window must begin with a token that
        # decodes, or the decoder's first-token handling would fall on a new token instead.
        if new_text:
            self._prefix_offset = self._read_offset
        self._read_offset = len(self.output_ids) if end is None else end
        self._num_held_emitted = 0
        self._prefix_text = None

    def _final_cut(self) -> int | None:
        """The last cut ``q`` among the held tokens (``read_offset < q <= len``) that no later
        token can cross: the text of ``output_ids[:q]`` is final. None: none known."""
        ids, bytes_of = self.output_ids, self.tokenizer.token_bytes
        for q in range(len(ids), max(self._read_offset, len(ids) - _CUT_SEARCH), -1):
            head = bytes_of(ids[q]) if q < len(ids) else None
            if head and not 0x80 <= head[0] <= 0xBF:
                return q  # a lead or ASCII byte continues nothing: what precedes is final
            tail = self._bytes_before(q)
            if tail is not None and (tail[-1] < 0x80 or tail[-1] in _NEVER_IN_UTF8 or not _unfinished(tail)):
                return q  # the bytes before the cut end no unfinished character
        return None

    def _bytes_before(self, q: int) -> bytes | None:
        """The last (up to) 3 bytes of ``output_ids[:q]``; None if a token's bytes are unknown."""
        tail = b""
        for token_id in reversed(self.output_ids[max(q - 3, 0) : q]):  # a token adds >= 1 byte
            b = self.tokenizer.token_bytes(token_id)
            if not b:
                return None
            tail = b + tail
            if len(tail) >= 3:
                break
        return tail[-3:]


# per tokenizer, the text of each single token decoded with and without special tokens: the
# window's context is mostly one token, and a tokenizer's decode of it never changes
_ONE_TOKEN_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _one_token_texts(tokenizer: Tokenizer, skip_special_tokens: bool) -> dict[int, str]:
    try:
        texts = _ONE_TOKEN_TEXTS.get(tokenizer)
        if texts is None:
            texts = _ONE_TOKEN_TEXTS[tokenizer] = ({}, {})
    except TypeError:  # not weakly referable: this detokenizer keeps its own
        texts = ({}, {})
    return texts[skip_special_tokens]


def _unfinished(tail: bytes) -> bool:
    """Whether ``tail`` ends in a UTF-8 sequence that more bytes could complete (at most 3)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(tail, final=False)
    return bool(decoder.getstate()[0])
