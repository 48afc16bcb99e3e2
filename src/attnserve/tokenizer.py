"""Tokenizers: loading a model directory's tokenizer, encoding, decoding, chat templates.

Two implementations behind one small base class:
- ``FastTokenizer`` wraps a ``tokenizers.Tokenizer`` loaded from ``tokenizer.json`` and reads
  ``tokenizer_config.json`` / ``special_tokens_map.json`` / ``chat_template.jinja`` the way
  transformers 5 does, so that encode, decode and chat templates agree with ``AutoTokenizer``.
- ``ByteTokenizer``: ids 0..255 are the UTF-8 bytes of the text, for model directories that ship
  no tokenizer (random test models) and for CPU logic tests.

Encoding releases the GIL while the Rust side works (``encode_batch_fast``; ``tokenizers``' own
``encode`` holds it), so a long text tokenised on a worker thread leaves the server's event loop
running. ``max_chars_per_token`` bounds how many characters one token can stand for, where the
pipeline in ``tokenizer.json`` proves one: a text longer than ``max_model_len`` times it cannot
fit the model, and is refused before it is tokenised.

This is not a port of transformers: no slow (Python or SentencePiece) tokenizers, no padding,
truncation or batching, no tokenizer-class specific rebuilding; ``tokenizer.json`` is the truth.
Incremental (streaming) decoding lives in ``detokenizer.py``.
"""

from __future__ import annotations

import abc
import functools
import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension

from attnserve.template_sandbox import (
    TemplateBounds,
    TemplateBoundsError,
    TemplateEnvironment,
    render_bounded,
)

__all__ = ["ByteTokenizer", "FastTokenizer", "Tokenizer", "load_chat_template", "load_tokenizer"]

logger = logging.getLogger(__name__)

# transformers' named special tokens, in its order; other "*_token" keys of tokenizer_config.json
# (image_token, ...) are named special tokens too.
_NAMED_TOKENS = tuple(f"{n}_token" for n in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"))
# Tokenizer files we cannot load without tokenizer.json: better an error than silent bytes.
_UNSUPPORTED_FILES = ("tokenizer.model", "spiece.model", "tekken.json", "vocab.json", "vocab.txt")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_LONG_DECODE = 4096  # ids: decoded without holding the GIL
_NO_MAX_LENGTH = 10**29  # transformers writes int(1e30) for "no limit"
_NO_TEMPLATE = (
    "this model has no chat template (none in tokenizer_config.json or chat_template.jinja): "
    "pass one (a Jinja template or the path of a file holding one) with `--chat-template` "
    "(attnserve serve), `chat_template=` (LLM.chat), or `chat_template` in a chat request (a "
    "server started with --trust-request-chat-template); or use the completions API"
)


def load_chat_template(value: str | Path | None) -> str | None:
    """A chat template given as a file path or as the template itself (vLLM's
    ``--chat-template``): the file's text, the string itself when it is no file but looks like
    a template (it has ``{``, ``}`` or a newline), or None for None.

    Raises:
        ValueError: a string that names no readable file and is no template (naming it).
    """
    if value is None:
        return None
    try:
        is_file = Path(value).expanduser().is_file()
    except OSError:  # a template too long for a file name
        is_file = False
    if is_file:
        return _read_text(Path(value).expanduser())
    if isinstance(value, Path) or not any(c in value for c in "{}\n"):
        raise ValueError(f"chat template '{value}' is neither a readable file nor a template (a "
                         "template has Jinja tags such as '{{ ... }}' or '{% ... %}')")
    return value


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text in HF templates; it renders
    its body unchanged (we do not compute assistant-token masks)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson HTML-escapes and has no indent/separators: templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=64)
def _compile_template(source: str) -> jinja2.Template:
    env = TemplateEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _normalize_message(message: Any) -> dict[str, Any]:
    # As transformers: keys whose value is None are dropped (OpenAI clients send content=None),
    # and a message's reasoning is visible under every name that templates read.
    if not isinstance(message, Mapping):
        raise TypeError(f"chat messages must be dicts, got {type(message).__name__}")
    out = {key: value for key, value in message.items() if value is not None}
    reasoning = next((out[key] for key in _REASONING_KEYS if key in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


class Tokenizer(abc.ABC):
    """What the engine and the server need from a tokenizer.

    Chat templates are shared: an implementation hands its template sources and the variables
    the templates see (``bos_token``, ``eos_token``, ...) to ``__init__``.
    """

    vocab_size: int  # number of token ids, added tokens included
    bos_token_id: int | None
    eos_token_id: int | None
    all_special_ids: set[int]  # named special tokens and every id that decode() can skip
    model_max_length: int | None = None
    # the most characters of a text one token can stand for (so a text of c characters has at
    # least c / max_chars_per_token tokens); None where the tokenizer proves no such bound
    max_chars_per_token: int | None = None

    def __init__(
        self,
        chat_templates: Mapping[str, str] | None = None,
        template_vars: Mapping[str, str] | None = None,
    ) -> None:
        self._chat_templates = dict(chat_templates or {})
        self._template_vars = dict(template_vars or {})

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds bos/eos where HF adds them."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 decodes to U+FFFD."""

    @abc.abstractmethod
    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings of ``ids`` ("" for an id outside the vocabulary)."""

    def token_bytes(self, token_id: int) -> bytes | None:
        """The UTF-8 bytes ``token_id`` adds to the byte stream that ``decode`` decodes (with
        errors replaced), when this tokenizer decodes so and the token is not special; None:
        unknown. The incremental detokenizer uses it to release text ending in U+FFFD that no
        later token can change; None keeps such text held back (always correct)."""
        return None

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_templates)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        bounds: TemplateBounds | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation with the model's chat template, as transformers does.

        Args:
            messages: OpenAI-style messages (dicts with "role", "content", ...).
            add_generation_prompt: append the header that starts the assistant's turn.
            tools: JSON schemas of the tools the model may call.
            chat_template: a template name of this model, or a template source, instead of the
                default ("tool_use" when tools are given and the model has one).
            bounds: render under these time and size bounds (``template_sandbox``): for a
                template nobody vetted, such as one sent in a request.
            kwargs: further variables for the template (documents, enable_thinking, ...); they
                win over the special-token variables.

        Returns:
            The prompt text (special tokens appear as text; encode it with
            ``add_special_tokens=False``).

        Raises:
            ValueError: the model has no chat template, or the template rejects the messages.
        """
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        variables = {"documents": None, **self._template_vars, **kwargs}
        try:
            template = self._select_template(chat_template, tools)
            return render_bounded(
                template,
                bounds,
                messages=[_normalize_message(m) for m in messages],
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except TemplateBoundsError as exc:
            raise ValueError(f"chat template stopped: {exc}") from exc
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from exc
        except (RecursionError, MemoryError, ArithmeticError, LookupError, AttributeError) as exc:
            if bounds is None:
                raise
            # an untrusted template's own failure (a recursion, 1/0, a missing key...)
            raise ValueError(f"chat template error: {type(exc).__name__}: {exc}") from exc

    def _select_template(self, name_or_source: str | None, tools: Any) -> jinja2.Template:
        templates = self._chat_templates
        if name_or_source is not None:
            source = templates.get(name_or_source, name_or_source)
            try:
                return _compile_template(source)
            except jinja2.TemplateSyntaxError as exc:
                raise ValueError(f"chat template argument: invalid template: {exc}") from exc
        if not templates:
            raise ValueError(_NO_TEMPLATE)
        if tools is not None and "tool_use" in templates:
            return _compile_template(templates["tool_use"])
        if "default" not in templates:
            raise ValueError(f"the model has chat templates {sorted(templates)} but no 'default'")
        return _compile_template(templates["default"])


class FastTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` plus the special-token names and chat templates of its config."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        named_tokens: Mapping[str, str] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        model_max_length: int | None = None,
    ) -> None:
        named_tokens = dict(named_tokens or {})
        super().__init__(chat_templates, named_tokens)
        self.backend = backend
        self.model_max_length = model_max_length
        named_ids = {name: backend.token_to_id(content) for name, content in named_tokens.items()}
        self.bos_token_id = named_ids.get("bos_token")
        self.eos_token_id = named_ids.get("eos_token")
        # The ids decode(skip_special_tokens=True) drops (the backend's own record, which an
        # added token's "special" flag can contradict), plus the named special tokens as HF.
        self.all_special_ids = {i for i in named_ids.values() if i is not None}
        for i in backend.get_added_tokens_decoder():
            if backend.decode([i], skip_special_tokens=True) != backend.decode([i], False):
                self.all_special_ids.add(i)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.max_chars_per_token = _max_chars_per_token(backend)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch_fast releases the GIL while it works (encode holds it: seconds for a
        # megabyte), and tracks no offsets, whose hundreds of bytes a token cost seconds to free
        # for millions of tokens, under the GIL (tokenizers < 0.21: encode_batch)
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return encode([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if len(ids) < _LONG_DECODE:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        # decode_batch releases the GIL while it works (decode holds it: a second for millions of ids)
        return self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.backend.id_to_token(i) or "" for i in ids]


# --- how many characters one token can stand for ----------------------------------------------
# Every token stands for at most as many characters of the normalized, pre-tokenized text as its
# vocabulary string has (a byte-level string has one character per byte; "<0x0A>" and "##" are
# longer than what they cover), as long as nothing on the way drops characters or lets one token
# swallow a run of them. Normalizers: NFC and NFKC compose, and no code point decomposes into more
# than 4 (canonically) or 18 (compatibly, U+FDFA) characters, so they shrink a text at most that
# much; the others listed never shorten it. Anything else (Strip, Precompiled, a regex Replace,
# whitespace-splitting pre-tokenizers, WordPiece's one [UNK] per unknown word, fused unknowns,
# added tokens that strip the whitespace around them) proves no bound.
_SHRINK = {"NFC": 4, "NFKC": 18, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "Append": 1, "ByteLevel": 1}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"}


def _shrink(normalizer: Mapping[str, Any] | None) -> int | None:
    """How many times shorter ``normalizer`` can make a text, at most (None: unbounded)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        total = 1
        for part in normalizer.get("normalizers") or []:
            factor = _shrink(part)
            if factor is None:
                return None
            total *= factor
        return total
    if kind == "Replace":
        pattern, content = (normalizer.get("pattern") or {}).get("String"), normalizer.get("content")
        ok = isinstance(pattern, str) and isinstance(content, str) and content
        return -(-len(pattern) // len(content)) if ok else None
    return _SHRINK.get(kind)


def _pre_tokenizers(spec: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        return [p for part in spec.get("pretokenizers") or [] for p in _pre_tokenizers(part)]
    return [spec]


def _max_chars_per_token(backend: tokenizers.Tokenizer) -> int | None:
    """A proven bound on the characters of input one token of ``backend`` stands for, or None."""
    spec = json.loads(backend.to_str())
    shrink, model = _shrink(spec.get("normalizer")), spec.get("model") or {}
    pre = _pre_tokenizers(spec.get("pre_tokenizer"))
    if shrink is None or any(p.get("type") not in _KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed"
                             for p in pre):
        return None
    if any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values()):
        return None  # such a token takes the whitespace beside it, however long
    vocab = backend.get_vocab(with_added_tokens=True)
    # no character may be dropped or fused with others into one unknown token
    if any(p.get("type") == "ByteLevel" for p in pre):
        covered = all(c in vocab for c in tokenizers.pre_tokenizers.ByteLevel.alphabet())
    elif model.get("byte_fallback"):
        covered = all(f"<0x{b:02X}>" in vocab for b in range(256))
    else:
        covered = model.get("type") == "BPE" and model.get("unk_token") in vocab and not model.get("fuse_unk")
    if not covered or model.get("type") not in ("BPE", "Unigram"):
        return None
    return shrink * max((len(token) for token in vocab), default=1)


_SINGLE_BYTES = [bytes([b]) for b in range(256)]


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are UTF-8 bytes; ``bos_token_id``/``eos_token_id`` (>= 256) are special tokens;
    every other id below ``vocab_size`` decodes to U+FFFD. It has no chat template."""

    def __init__(
        self,
        vocab_size: int = 256,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        super().__init__()
        if vocab_size < 256:
            raise ValueError(f"a byte tokenizer needs vocab_size >= 256, got {vocab_size}")
        names: dict[int, str] = {}
        for token_id, name in ((bos_token_id, "<s>"), (eos_token_id, "</s>")):
            if token_id is not None and not 256 <= token_id < vocab_size:
                raise ValueError(f"special token id {token_id} is not in [256, {vocab_size})")
            if token_id is not None:
                names[token_id] = name
        self.vocab_size = vocab_size
        self.max_chars_per_token = 1  # one byte per token, and a character is at least one byte
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.all_special_ids = set(names)
        self._special_names = names

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        bos = [self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []
        return bos + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = ids if isinstance(ids, (list, tuple)) else list(ids)
        if self._special_names.keys().isdisjoint(ids):
            # Without special tokens, an id >= 256 decodes exactly as the byte 0xFF would: one
            # U+FFFD that ends the byte run before it (never valid UTF-8, it ends any sequence)
            try:
                return bytes([i if i < 256 else 255 for i in ids]).decode("utf-8", errors="replace")
            except ValueError:  # a negative id: the loop below names it
                pass
        return self._decode_runs(ids, skip_special_tokens)

    def _decode_runs(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        """``decode`` one id at a time: the reference the fast path above must equal."""
        parts: list[str] = []
        run = bytearray()  # bytes since the last non-byte token; skipped specials do not cut it
        for token_id in ids:
            if token_id < 0:
                raise ValueError(f"negative token id {token_id}")
            if token_id < 256:
                run.append(token_id)
                continue
            if token_id in self._special_names and skip_special_tokens:
                continue
            parts.append(run.decode("utf-8", errors="replace"))
            run.clear()
            parts.append(self._special_names.get(token_id, "\ufffd"))
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self._token_str(i) for i in ids]

    def token_bytes(self, token_id: int) -> bytes | None:
        # an id >= 256 decodes as the byte 0xFF would (see decode); special tokens are None:
        # skipped they do not cut a byte run, shown they do
        if token_id in self._special_names or not 0 <= token_id < self.vocab_size:
            return None
        return _SINGLE_BYTES[token_id] if token_id < 256 else b"\xff"

    def _token_str(self, token_id: int) -> str:
        if 0x21 <= token_id <= 0x7E:  # printable ASCII as itself, other bytes as <0xNN>
            return chr(token_id)
        if 0 <= token_id < 256:
            return f"<0x{token_id:02X}>"
        return self._special_names.get(token_id, "")


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load the tokenizer of a model directory.

    Args:
        model_dir: a directory with ``tokenizer.json`` (and optionally ``tokenizer_config.json``,
            ``special_tokens_map.json``, ``chat_template.jinja``), or with only a ``config.json``
            (then a ``ByteTokenizer`` of its ``vocab_size``, with a warning that says so: text
            is right only for a byte-level model).

    Returns:
        A ``FastTokenizer`` or a ``ByteTokenizer``.

    Raises:
        FileNotFoundError, ValueError: a missing or malformed file; the message names it.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: not a directory")
    if (model_dir / "tokenizer.json").is_file():
        return _load_fast(model_dir)
    for name in _UNSUPPORTED_FILES:
        if (model_dir / name).is_file():
            raise ValueError(f"{model_dir / name}: only tokenizer.json tokenizers are supported; pass "
                             "the `tokenizer` option (--tokenizer) a directory with the model's "
                             "tokenizer.json")
    tokenizer = _load_byte(model_dir)
    logger.warning(
        "%s has no tokenizer.json: text is encoded and decoded as UTF-8 bytes (token ids 0-255), which "
        "is right only for a byte-level model; a model trained with another tokenizer (vocabulary of "
        "%d) reads garbage and writes garbage. Pass the `tokenizer` option (--tokenizer) a directory "
        "with its tokenizer.json, or send token ids", model_dir, tokenizer.vocab_size)
    return tokenizer


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from exc


def _load_fast(model_dir: Path) -> FastTokenizer:
    path = model_dir / "tokenizer.json"
    config_path = model_dir / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    map_path = model_dir / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and map_path.is_file():
        config.update(_read_json(map_path))  # transformers reads it only in this legacy case
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception
        raise ValueError(f"{path}: cannot load tokenizer: {exc}") from exc
    backend.no_truncation()
    backend.no_padding()
    if config.get("split_special_tokens"):
        backend.encode_special_tokens = True
    try:
        named, extra = _special_tokens(config)
        decoder = config.get("added_tokens_decoder") or {}
        # a named special token is special whatever its flag says
        named_contents = {tok.content for tok in named.values()}
        added = [
            _added_token(
                decoder[k], special=True if decoder[k]["content"] in named_contents else None
            )
            for k in sorted(decoder, key=int)
        ]
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"{config_path}: bad special tokens: {exc}") from exc
    _sync_added_tokens(backend, added, [*named.values(), *extra])
    max_len = config.get("model_max_length")
    return FastTokenizer(
        backend,
        named_tokens={name: tok.content for name, tok in named.items()},
        chat_templates=_chat_templates(model_dir, config, config_path),
        model_max_length=max_len if isinstance(max_len, int) and max_len < _NO_MAX_LENGTH else None,
    )


def _added_token(value: Any, special: bool | None = None) -> tokenizers.AddedToken:
    if isinstance(value, str):
        return tokenizers.AddedToken(value, special=True if special is None else special)
    if not isinstance(value, Mapping) or not isinstance(value.get("content"), str):
        raise TypeError(f"a token must be a string or an object with a 'content', got {value!r}")
    special = bool(value.get("special", False)) if special is None else special
    flags = {
        k: bool(value[k]) for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value
    }
    return tokenizers.AddedToken(value["content"], special=special, **flags)


def _special_tokens(config: Mapping[str, Any]) -> tuple[dict[str, tokenizers.AddedToken], list]:
    """Named special tokens (bos_token, ..., and any other "*_token" string) and the unnamed
    extra special tokens, as transformers 5 collects them from tokenizer_config.json."""
    named: dict[str, tokenizers.AddedToken] = {}
    for key in _NAMED_TOKENS:
        if config.get(key) is not None:
            named[key] = _added_token(config[key], special=True)
    for key, value in config.items():
        is_token = isinstance(value, str) or (
            isinstance(value, Mapping) and isinstance(value.get("content"), str)
        )
        if key.endswith("_token") and key not in named and is_token:
            named[key] = _added_token(value, special=True)
    extra_values = (
        config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    )
    if isinstance(extra_values, Mapping):  # named extras
        named.update({k: _added_token(v, special=True) for k, v in extra_values.items()})
        extra_values = []
    return named, [_added_token(v, special=True) for v in extra_values]


def _sync_added_tokens(
    backend: tokenizers.Tokenizer,
    config_tokens: list[tokenizers.AddedToken],
    special_tokens: list[tokenizers.AddedToken],
) -> None:
    # transformers 5 re-adds every token of tokenizer_config's added_tokens_decoder (its flags
    # win over tokenizer.json's), then adds each named or extra special token that is not yet an
    # added token. Adding a token the vocabulary already has keeps its id.
    to_add = list(config_tokens)
    known = {tok.content for tok in backend.get_added_tokens_decoder().values()}
    known |= {tok.content for tok in config_tokens}
    for tok in special_tokens:
        if tok.content not in known:
            to_add.append(tok)
            known.add(tok.content)
    if to_add:
        backend.add_tokens(to_add)


def _chat_templates(
    model_dir: Path, config: Mapping[str, Any], config_path: Path
) -> dict[str, str]:
    """Named template sources: template files (chat_template.jinja is "default", then
    additional_chat_templates/*.jinja) replace tokenizer_config.json's, as in transformers."""
    files = {"default": model_dir / "chat_template.jinja"}
    for path in sorted((model_dir / "additional_chat_templates").glob("*.jinja")):
        files[path.name.removesuffix(".jinja")] = path
    sources = {name: (_read_text(p), p) for name, p in files.items() if p.is_file()}
    if not sources:
        raw = config.get("chat_template")
        if isinstance(raw, str):
            sources["default"] = (raw, config_path)
        elif isinstance(raw, list):
            for entry in raw:
                if not (isinstance(entry, Mapping) and {"name", "template"} <= entry.keys()):
                    raise ValueError(
                        f"{config_path}: chat_template entries need 'name' and 'template'"
                    )
                sources[str(entry["name"])] = (str(entry["template"]), config_path)
        elif raw is not None:
            raise ValueError(f"{config_path}: chat_template must be a string or a list")
    for name, (source, path) in sources.items():
        try:
            _compile_template(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"{path}: invalid chat template {name!r}: {exc}") from exc
    return {name: source for name, (source, _) in sources.items()}


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _load_byte(model_dir: Path) -> ByteTokenizer:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{model_dir}: no tokenizer.json, and no config.json to size a byte tokenizer"
        )
    config = _read_json(path)
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def get(key: str) -> Any:
        return config[key] if config.get(key) is not None else text_config.get(key)

    vocab_size = get("vocab_size")
    if not isinstance(vocab_size, int) or vocab_size < 256:
        raise ValueError(
            f"{path}: vocab_size is {vocab_size!r}; the directory has no tokenizer.json and a "
            "byte-level tokenizer needs vocab_size >= 256"
        )
    bos, eos = _first_id(get("bos_token_id")), _first_id(get("eos_token_id"))
    try:  # ids below 256 are bytes; ids past the vocabulary can never be generated: neither is special
        return ByteTokenizer(
            vocab_size,
            bos if bos is not None and 256 <= bos < vocab_size else None,
            eos if eos is not None and 256 <= eos < vocab_size else None,
        )
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
