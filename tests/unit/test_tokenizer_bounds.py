"""How many characters one token stands for, and tokenising without the GIL (issue #39, point 2).

``Tokenizer.max_chars_per_token`` lets the server refuse a text too long for the model before it
is tokenised. It must be a proof, never a guess: for every pipeline it bounds, every text of c
characters has at least c / bound tokens (checked with hypothesis on texts made of what shrinks
under NFC/NFKC, whitespace runs, special tokens, scripts the vocabulary lacks); every pipeline
it leaves unbounded has a text that defeats any bound from its vocabulary (shown here).
``FastTokenizer.encode`` and a long ``decode`` leave the GIL to other threads while they work.
"""

from __future__ import annotations

import json
import random
import threading
import time
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as RustTokenizer

from attnserve.entrypoints.openai.protocol import OpenAIError, check_prompt_chars
from attnserve.presets import resolve_model_preset
from attnserve.tokenizer import ByteTokenizer, FastTokenizer, load_tokenizer

BYTES = [f"<0x{b:02X}>" for b in range(256)]
rng = random.Random(0)
# words of plain letters, and of characters NFC composes from several (so that long tokens of them exist)
CORPUS = [" ".join("".join(rng.choices("abcdefghij", k=rng.randint(1, 7))) for _ in range(8)) for _ in range(300)]
CORPUS += [" ".join(c * rng.randint(1, 8) for c in "\u1f86\uac01\u00e9") for _ in range(100)]


def _bpe(pre=None, normalizer=None, alphabet=(), specials=("<s>",), **model_json) -> RustTokenizer:
    tok = RustTokenizer(models.BPE(unk_token="<unk>" if "<unk>" in specials else None))
    tok.pre_tokenizer, tok.normalizer = pre, normalizer
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials),
                                                        initial_alphabet=list(alphabet), show_progress=False))
    if model_json:  # flags the trainer does not set
        spec = json.loads(tok.to_str())
        spec["model"].update(model_json)
        tok = RustTokenizer.from_str(json.dumps(spec))
    return tok


def bounded() -> dict[str, FastTokenizer]:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    metaspace = _bpe(pre_tokenizers.Metaspace(), normalizers.Sequence([normalizers.Replace(" ", "\u2581")]),
                     specials=("<unk>", *BYTES), byte_fallback=True, fuse_unk=True)
    return {
        "byte-level": FastTokenizer(_bpe(byte_level, alphabet=alphabet)),
        "byte-level NFC": FastTokenizer(_bpe(byte_level, normalizers.NFC(), alphabet=alphabet)),
        "byte-level NFKC lowercase": FastTokenizer(_bpe(
            pre_tokenizers.Sequence([pre_tokenizers.Digits(), byte_level]),
            normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]), alphabet=alphabet)),
        "metaspace byte-fallback": FastTokenizer(metaspace),
        "metaspace NFC": FastTokenizer(_bpe(pre_tokenizers.Metaspace(), normalizers.NFC(), specials=("<unk>",))),
        "unk one per character": FastTokenizer(_bpe(pre_tokenizers.Metaspace(), specials=("<unk>",))),
        "shipped demo": load_tokenizer(resolve_model_preset("attnserve-demo-gqa")),
    }


TOKENIZERS = bounded()
# what shrinks most under NFC (Hangul jamo, stacked Greek accents) and NFKC (U+FDFA, ligatures),
# whitespace runs, special-token text, characters outside every vocabulary here
PIECES = st.sampled_from(["\u1100\u1161\u11a8", "\u03b1\u0313\u0342\u0345", "e\u0301", "\ufdfa", "\ufb03", "  ",
                          "\n\n\n", "\t", "<s>", "<unk>", "<0x41>", "\u2581", "abc", "j", "\u00e9", "\u2603", "\U0001f600",
                          "\u0301", "\u200b", "\x00", "\ud7a3"])
TEXTS = st.one_of(st.text(max_size=60), st.lists(PIECES, max_size=60).map("".join),
                  st.tuples(PIECES, st.integers(1, 400)).map(lambda p: p[0] * p[1]))


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_every_text_has_at_least_chars_over_the_bound_tokens(name):
    tok = TOKENIZERS[name]
    bound = tok.max_chars_per_token
    assert bound is not None and bound >= 1

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(TEXTS)
    def holds(text):
        for special in (False, True):
            assert len(tok.encode(text, add_special_tokens=special)) * bound >= len(text), (text, bound)

    holds()


def test_the_byte_tokenizer_and_the_normalizers_bounds():
    assert ByteTokenizer().max_chars_per_token == 1
    text = "日本語 and \U0001f600"
    assert len(ByteTokenizer().encode(text, add_special_tokens=False)) >= len(text)
    # NFC and NFKC compose at most this many characters into one: the bound's factors
    assert TOKENIZERS["byte-level NFC"].max_chars_per_token == 4 * TOKENIZERS["byte-level"].max_chars_per_token
    code_points = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    assert max(len(unicodedata.normalize("NFD", c)) for c in code_points) == 4
    assert max(len(unicodedata.normalize("NFKD", c)) for c in code_points) == 18


def _unbounded() -> list[tuple[str, RustTokenizer, str]]:
    """(what, tokenizer, a text that has far fewer tokens than characters / longest token)."""
    lstrip = _bpe(pre_tokenizers.Metaspace(), specials=("<unk>",))
    lstrip.add_special_tokens([AddedToken("<m>", lstrip=True, special=True)])
    wordpiece = RustTokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    return [
        ("Strip drops whitespace", _bpe(normalizer=normalizers.Strip(), specials=("<unk>",)), "a" + " " * 5000),
        ("Replace with nothing", _bpe(normalizer=normalizers.Replace("b", ""), specials=("<unk>",)), "b" * 5000),
        ("whitespace pre-tokenizer", _bpe(pre_tokenizers.WhitespaceSplit(), specials=("<unk>",)), "a" + " " * 5000),
        ("fused unknowns", _bpe(specials=("<unk>",), fuse_unk=True), "\u2603" * 5000),
        ("unknowns dropped", _bpe(), "\u2603" * 5000),
        ("an added token that takes whitespace", lstrip, " " * 5000 + "<m>"),
        ("WordPiece's one [UNK] per word", wordpiece, "c" * 5000),
    ]


@pytest.mark.parametrize("what,backend,text", _unbounded(), ids=[u[0] for u in _unbounded()])
def test_pipelines_that_prove_no_bound_get_none(what, backend, text):
    tok = FastTokenizer(backend)
    longest = max(len(t) for t in backend.get_vocab(with_added_tokens=True))
    assert len(tok.encode(text, add_special_tokens=False)) * longest < len(text)  # no vocabulary bound holds
    assert tok.max_chars_per_token is None


def test_check_prompt_chars_refuses_only_above_the_bound():
    check_prompt_chars(512 * 17, 17, 512)
    check_prompt_chars(10**9, None, 512)  # no bound known: left to the token count
    with pytest.raises(OpenAIError) as info:
        check_prompt_chars(512 * 17 + 1, 17, 512, "messages")
    err = info.value
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")
    assert "512 tokens" in err.message and "8705 characters" in err.message and "--max-model-len" in err.message


@pytest.mark.parametrize("work", ["encode", "decode"])
def test_long_work_leaves_the_gil_to_other_threads(work):
    tok = TOKENIZERS["shipped demo"]
    text = random.Random(1).randbytes(400_000).translate(bytes(b"abcdefghijklmnopqrstuvwxyz     "[b % 31]
                                                                  for b in range(256))).decode()
    ids = list(range(3, 3000)) * 700  # 2 M ids
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.perf_counter()
    out = tok.encode(text) if work == "encode" else tok.decode(ids, skip_special_tokens=False)
    took = time.perf_counter() - start
    done.set()
    ticker.join()
    assert out == (tok.backend.encode(text).ids if work == "encode" else tok.backend.decode(ids, False))
    assert max(gaps) < max(took / 4, 0.05), f"another thread waited {max(gaps):.3f} s of the {took:.3f} s {work}"
