"""Structured output through xgrammar: grammars compiled per constraint, one matcher per request.

``StructuredOutputManager`` turns a request's ``StructuredOutputsParams`` into a compiled
grammar (JSON schema, regex, choice, EBNF grammar, any JSON object) for this model's
vocabulary, and keeps the last compiled grammars by constraint, so a schema sent again is not
compiled again. Compiling is thread-safe: the server compiles on a worker thread before it
submits a request, and the engine's own compile is then a cache hit.

Each request (each of its ``n`` completions) gets a ``RequestGrammar``: a matcher advanced by
exactly the tokens appended to its output. Each step, once its forward is launched,
``fill_bitmask`` writes the next-token bitmask of every request that samples in it (int32
words, bit ``j`` of word ``i`` allowing token ``32 * i + j``), which the sampler applies to the
logits. xgrammar's fill releases the GIL. A preempted request keeps its
output tokens and so its matcher state; a token dropped by a failed step was never accepted.

JSON (a schema, ``json_object``, the tool-call schemas) allows whitespace between its tokens,
but at most ``MAX_JSON_WHITESPACE`` characters in each gap (xgrammar's ``max_whitespace_cnt``):
with unbounded whitespace a small model at temperature 0 can write newlines until
``max_tokens``. ``disable_any_whitespace`` (vLLM's option) allows none beyond the one-line
separators ``", "`` and ``": "`` (xgrammar's ``any_whitespace=False``).

Not here: applying the bitmask (``layers/sampler.py``), the request's life cycle
(``engine/engine.py``). xgrammar is imported on first use; without it, a structured request
is refused with the command that installs it.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from attnserve.sampling_params import StructuredOutputsParams
from attnserve.tokenizer import ByteTokenizer, FastTokenizer, Tokenizer

__all__ = ["MAX_JSON_WHITESPACE", "RequestGrammar", "StructuredOutputManager", "choice_grammar"]

_INSTALL_HINT = "structured output needs xgrammar: pip install 'attnserve[structured]'"
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[12:00:00] /path/file.cc:123: "
# The most whitespace characters JSON output may put in one gap between its tokens (after "{",
# around ":" and ",", before "}"...): room for a newline and an indent of one, and a bound on
# what a model that prefers whitespace can waste (the shipped demo models at temperature 0 fill
# every gap they are allowed).
MAX_JSON_WHITESPACE = 2


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(_INSTALL_HINT) from e
    return xgrammar


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _tokenizer_info(xgr, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the vocabulary: every id below ``vocab_size`` with the bytes it
    stands for (special tokens stand for nothing, so no grammar can produce them)."""
    stops = stop_token_ids or None
    if isinstance(tokenizer, FastTokenizer):
        # how tokens encode bytes (byte-level, byte-fallback, raw) is read from tokenizer.json
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
        encoded = [""] * vocab_size
        for token, i in tokenizer.backend.get_vocab(with_added_tokens=True).items():
            if i < vocab_size and i not in tokenizer.all_special_ids:
                encoded[i] = token
        return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                                 stop_token_ids=stops, add_prefix_space=meta["add_prefix_space"])
    if isinstance(tokenizer, ByteTokenizer):
        encoded = [bytes([i]) if i < 256 else b"" for i in range(vocab_size)]
        return xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)
    raise ValueError(f"structured output does not support a {type(tokenizer).__name__}")


def _json_whitespace(params: StructuredOutputsParams) -> dict[str, Any]:
    """xgrammar's whitespace options for a JSON constraint: bounded gaps, or none with
    ``disable_any_whitespace``."""
    if params.disable_any_whitespace:
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _clean(exc: BaseException) -> str:
    """xgrammar's message without its native log prefix."""
    return _NATIVE_PREFIX.sub("", str(exc).strip())


class RequestGrammar:
    """One request's matcher and how many of its output tokens it has accepted."""

    __slots__ = ("matcher", "num_accepted")

    def __init__(self, matcher: Any):
        self.matcher = matcher
        self.num_accepted = 0

    def advance(self, output_token_ids: Sequence[int]) -> str | None:
        """Accept the output tokens not accepted yet; an error message if one is refused."""
        while self.num_accepted < len(output_token_ids):
            token = output_token_ids[self.num_accepted]
            if not self.matcher.accept_token(token):
                return f"token {token} at output position {self.num_accepted} does not follow the grammar"
            self.num_accepted += 1
        return None

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token accepted."""
        return self.matcher.is_terminated()


class StructuredOutputManager:
    """Compiles constraints for one model's vocabulary and fills the per-step bitmask."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self._compiler = None  # built on first use: it reads the whole vocabulary
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._batch = None
        self.num_compiled = 0  # grammars compiled (cache misses)

    @property
    def words_per_row(self) -> int:
        return (self.vocab_size + 31) // 32

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                if self.tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer, and this model has none")
                info = _tokenizer_info(xgr, self.tokenizer, self.vocab_size, self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def warm_up(self) -> bool:
        """Import xgrammar and read the vocabulary now, if xgrammar is installed and the model
        has a tokenizer (a server does this before its first request: the import holds the
        interpreter for seconds). Whether structured output is available."""
        try:
            self._get_compiler()
        except ValueError:
            return False
        return True

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params`` (from the cache when compiled before).

        Raises:
            ValueError: xgrammar is missing, or the constraint does not compile (the message
                says why, e.g. an unsupported schema type or an unclosed regex bracket).
        """
        key = params.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiler = self._get_compiler()
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                schema = params.schema_text() if kind == "json" else '{"type": "object"}'
                compiled = compiler.compile_json_schema(schema, **_json_whitespace(params))
            elif kind == "regex":
                compiled = compiler.compile_regex(params.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(params.choice))
            else:
                compiled = compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{kind} does not compile: {_clean(e)}") from None
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def grammar_for(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher at the start of the grammar of ``params``."""
        return RequestGrammar(_xgrammar().GrammarMatcher(self.compile(params)))

    def fill_bitmask(self, grammars: Sequence[RequestGrammar]) -> torch.Tensor:
        """``[len(grammars), ceil(V / 32)]`` int32 on the host: row ``k`` is the set of tokens
        ``grammars[k]`` allows next."""
        xgr = _xgrammar()
        bitmask = xgr.allocate_token_bitmask(len(grammars), self.vocab_size)
        if len(grammars) == 1:
            grammars[0].matcher.fill_next_token_bitmask(bitmask, 0)
        elif grammars:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(max_threads="auto")
            self._batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask)
        return bitmask
