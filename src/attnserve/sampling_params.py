"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's fields), and
StructuredOutputsParams: the grammar a request's output must follow (vLLM's names).

Both check the types and ranges of what they hold, for any model; what depends on the model
(token ids below its vocabulary) is ``engine.check_params_for_model``'s, and compiling a
grammar is ``engine/structured_output.py``'s.
"""

from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["INT64_MAX", "MAX_BAD_WORDS", "SamplingParams", "StructuredOutputsParams"]

INT64_MAX = 2**63 - 1  # integer fields become int64 tensors in the sampler
MAX_BAD_WORDS = 128  # words per request (each is banned in up to two tokenisations)
MAX_BAD_WORD_CHARS = 256
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]
MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or grammar, in characters
MAX_CHOICES = 1024


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_unicode(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(slots=True)
class StructuredOutputsParams:
    """One constraint on the output, as vLLM's ``StructuredOutputsParams``: exactly one of
    ``json`` (a JSON schema, as a dict or its text), ``regex``, ``choice`` (the output is one of
    these strings), ``grammar`` (xgrammar's EBNF) or ``json_object`` (any JSON object).

    JSON allows at most two whitespace characters between tokens by default
    (``engine/structured_output.MAX_JSON_WHITESPACE``: small models otherwise fill the output
    with newlines); ``disable_any_whitespace`` makes it compact (one line, ``", "`` and ``": "``). ``disable_additional_properties`` is accepted for vLLM's
    sake: objects already admit no property their schema does not name (xgrammar's strict
    mode). Not supported: ``structural_tag``, ``whitespace_pattern``, Lark grammars.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be true or false")
        if self.json is not None:
            if isinstance(self.json, str):
                if len(self.json) > MAX_GRAMMAR_CHARS:
                    raise ValueError(f"structured_outputs.json is longer than {MAX_GRAMMAR_CHARS} characters")
                try:
                    schema = _json.loads(self.json)
                except (ValueError, RecursionError) as e:  # nesting deeper than the parser's stack
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            else:
                schema = self.json
                try:
                    size = len(self.schema_text())
                except (TypeError, ValueError, RecursionError) as e:
                    raise ValueError(f"structured_outputs.json is not JSON: {e}") from None
                if size > MAX_GRAMMAR_CHARS:
                    raise ValueError(f"structured_outputs.json is longer than {MAX_GRAMMAR_CHARS} characters")
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), "
                                 f"got {type(schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or len(value) > MAX_GRAMMAR_CHARS):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string of at most "
                                 f"{MAX_GRAMMAR_CHARS} characters")
        if self.choice is not None:
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if (not isinstance(self.choice, list) or not 0 < len(self.choice) <= MAX_CHOICES
                    or any(not isinstance(c, str) for c in self.choice)
                    or sum(len(c) for c in self.choice) > MAX_GRAMMAR_CHARS):
                raise ValueError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} strings")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when given")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(n for n in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, n) is not None)

    def schema_text(self) -> str:
        """``json`` as compact JSON text."""
        schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
        return _json.dumps(schema, separators=(",", ":"), ensure_ascii=False)

    def cache_key(self) -> tuple:
        """What the compiled grammar depends on (equal keys compile to the same grammar)."""
        spec: Any = getattr(self, self.kind)
        if self.kind == "json":  # the same schema however it is spaced (key order matters)
            spec = self.schema_text()
        elif self.kind == "choice":
            spec = tuple(spec)
        return (self.kind, spec, self.disable_any_whitespace, self.disable_additional_properties)


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
    # vLLM's: a space between special tokens and the text around them when they are shown.
    # transformers honours it only in its slow (pure Python) tokenizers; attnserve's are
    # tokenizers-library and byte tokenizers, whose decode has no such option (transformers'
    # fast decode and vLLM's fast detokenizer ignore it too), so it changes no text here
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words whose last token is banned where it would end one
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens (-1: what fits)
    structured_outputs: StructuredOutputsParams | None = None
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
        self._normalize_new_fields()
        self._validate()

    def _normalize_new_fields(self) -> None:
        """``logit_bias`` keys as ints (JSON sends "123"), lists as lists, a dict as
        ``StructuredOutputsParams``; the checks come in ``_validate``."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id to bias, got "
                                 f"{type(self.logit_bias).__name__}")
            bias = {}
            for key, value in self.logit_bias.items():
                try:
                    token = key if _is_int(key) else int(key) if isinstance(key, str) else None
                except ValueError:
                    token = None
                if token is None:
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
                bias[token] = value
            self.logit_bias = bias
        for name in ("allowed_token_ids", "bad_words"):
            value = getattr(self, name)
            if isinstance(value, tuple):
                setattr(self, name, list(value))
            elif value is not None and not isinstance(value, list):
                raise ValueError(f"{name} must be a list, got {type(value).__name__}")
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:  # an unknown key
                raise ValueError(f"structured_outputs: {e}") from None

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
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
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
        self._validate_logit_edits(bad)

    def _validate_logit_edits(self, bad) -> None:
        """logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens, structured_outputs;
        the engine bounds the token ids by the vocabulary (``check_params_for_model``)."""
        if self.logit_bias is not None:
            for token, value in self.logit_bias.items():
                if not 0 <= token <= INT64_MAX:
                    bad(f"logit_bias keys must be non-negative token ids, got {token}")
                if not _is_real(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                    bad(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids must not be empty (leave it out to allow every token)")
            if any(not _is_int(t) or not 0 <= t <= INT64_MAX for t in self.allowed_token_ids):
                bad(f"allowed_token_ids must be non-negative integers, got {self.allowed_token_ids[:8]!r}")
        if self.bad_words is not None:
            if len(self.bad_words) > MAX_BAD_WORDS:
                bad(f"bad_words has {len(self.bad_words)} words, more than {MAX_BAD_WORDS}")
            if any(not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS or not _is_unicode(w)
                   for w in self.bad_words):  # they are tokenised: no lone surrogate
                bad(f"bad_words must be non-blank strings of valid Unicode of at most {MAX_BAD_WORD_CHARS} characters")
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or not (t == -1 or 1 <= t <= INT64_MAX)):
            bad(f"truncate_prompt_tokens must be -1 or a positive integer, got {t!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad(f"structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}")

    def child_seed(self, index: int) -> int | None:
        """The seed of the ``index``-th of ``n`` completions: ``seed + index``, within int64."""
        return None if self.seed is None else (self.seed + index) % (INT64_MAX + 1)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def edits_logits(self) -> bool:
        """Whether the sampler has a bias or an allowed set to apply (bans come separately)."""
        return self.logit_bias is not None or self.allowed_token_ids is not None
