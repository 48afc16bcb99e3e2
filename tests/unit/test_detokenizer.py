"""IncrementalDetokenizer: at every step the text it has returned is the full decode of the output
ids so far, minus a held-back U+FFFD tail; after flush() it is exactly the full decode.

Three tokenizers, all built here: a trained byte-level BPE (GPT-2/Llama-3 style), a Llama-2
style SentencePiece tokenizer (leading "▁" stripped, byte fallback) and the ByteTokenizer.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as RustTokenizer

from attnserve.detokenizer import IncrementalDetokenizer, decode_token
from attnserve.tokenizer import ByteTokenizer, FastTokenizer, Tokenizer

REPLACEMENT = "\ufffd"
IN_VOCAB = "abcdefghij éßü"  # of the sentencepiece-style tokenizer; the rest are byte tokens
CHARS = IN_VOCAB + "日本語😀🚀\n"


def random_text(rng: random.Random, n: int, byte_runs: bool = True) -> str:
    """Random text; without byte_runs no two characters outside IN_VOCAB are adjacent."""
    out: list[str] = []
    while len(out) < n:
        char = rng.choice(CHARS)
        if not byte_runs and out and char not in IN_VOCAB and out[-1] not in IN_VOCAB:
            char = rng.choice(IN_VOCAB)
        out.append(char)
    return "".join(out)


def byte_level_bpe() -> FastTokenizer:
    rng = random.Random(0)
    corpus = [random_text(rng, rng.randint(1, 30)) for _ in range(300)]
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=["<s>", "</s>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return FastTokenizer(tok, {"bos_token": "<s>", "eos_token": "</s>"})


def sentencepiece_style() -> FastTokenizer:
    """Unigram with byte fallback and Llama-2's legacy normalizer/decoder: the decoded text drops
    the first leading space, and characters outside the vocabulary are <0xNN> byte tokens."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    words = ["▁", "▁a", "▁ab", "▁abc", "bc", "de", "▁é", "é", "ß", "ü", *"abcdefghij"]
    vocab = [(p, 0.0) for p in pieces] + [(w, -float(len(w) < 2)) for w in words]
    tok = RustTokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return FastTokenizer(tok, {"bos_token": "<s>", "eos_token": "</s>"})


@pytest.fixture(scope="module")
def tokenizers_by_name() -> dict[str, Tokenizer]:
    return {
        "byte_level_bpe": byte_level_bpe(),
        "sentencepiece": sentencepiece_style(),
        "bytes": ByteTokenizer(vocab_size=300, bos_token_id=256, eos_token_id=257),
    }


def sequences(name: str, tok: Tokenizer, rng: random.Random) -> list[list[int]]:
    """Output id sequences for a tokenizer: encoded text with special tokens spliced in (anywhere,
    also inside a character's byte tokens), and for byte-level ones fully random ids.

    Byte fallback decodes a run of byte tokens as a whole (U+FFFD for every byte if the run is not
    valid UTF-8), so a prefix of a run of two characters may decode to FFFDs where the character
    before was: its decode is not prefix-stable, and its texts keep byte runs to one character.
    """
    byte_runs = name != "sentencepiece"
    specials = sorted(tok.all_special_ids)
    out = []
    for _ in range(40):
        text = random_text(rng, rng.randint(0, 25), byte_runs)
        ids = tok.encode(text, add_special_tokens=False)
        for _ in range(rng.randint(0, 3)):
            ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        out.append(ids)
    if byte_runs:
        out += [
            [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(40)
        ]
    return out


# what can complete an unfinished character: a continuation byte, then two more
CONTINUATIONS = [[c, *tail] for c in range(0x80, 0xC0) for tail in ([], [0x80, 0x80])]


def check_held_tail(tok: Tokenizer, ids: list[int], emitted: str, skip: bool) -> None:
    """What is held back is trailing U+FFFD only, the emitted text is final (no next byte changes
    it) and, for the byte tokenizer without special tokens, nothing final is held back."""
    full = tok.decode(ids, skip_special_tokens=skip)
    assert full.startswith(emitted) and emitted.startswith(full.rstrip(REPLACEMENT)), (ids, emitted)
    if not isinstance(tok, ByteTokenizer):
        return
    changed = [c for c in CONTINUATIONS if not tok.decode(ids + c, skip).startswith(full)]
    assert all(tok.decode(ids + c, skip).startswith(emitted) for c in CONTINUATIONS)
    if not tok.all_special_ids & set(ids):
        assert (len(full) > len(emitted)) == bool(changed), (ids, emitted, full)


def run_steps(tok: Tokenizer, ids: list[int], rng: random.Random, skip: bool) -> None:
    detok = IncrementalDetokenizer(tok, prompt_ids=[1, 2, 3], skip_special_tokens=skip)
    emitted, pos = "", 0
    while pos < len(ids):
        n = rng.randint(1, 3)
        delta = detok.step(ids[pos : pos + n])
        pos += n
        emitted += delta
        check_held_tail(tok, ids[:pos], emitted, skip)
        assert detok.output_text == emitted and detok.output_ids == ids[:pos]
    emitted += detok.flush()
    assert emitted == tok.decode(ids, skip_special_tokens=skip)
    assert detok.flush() == "" and detok.step([]) == ""


@pytest.mark.parametrize("name", ["byte_level_bpe", "sentencepiece", "bytes"])
@pytest.mark.parametrize("skip", [True, False])
def test_prefix_property(tokenizers_by_name: dict[str, Tokenizer], name: str, skip: bool) -> None:
    tok = tokenizers_by_name[name]
    rng = random.Random(f"{name}-{skip}")
    for ids in sequences(name, tok, rng):
        run_steps(tok, ids, rng, skip)


def test_multibyte_character_is_held_back() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [])
    emoji = list("😀".encode())
    assert [detok.step([b]) for b in [104, *emoji[:3]]] == ["h", "", "", ""]
    assert detok.step(emoji[3:] + [105]) == "😀i"
    assert detok.step([0xE6, 0x97]) == "" and detok.flush() == REPLACEMENT
    assert detok.output_text == "h😀i" + REPLACEMENT


def test_special_tokens_between_words(tokenizers_by_name: dict[str, Tokenizer]) -> None:
    # A window starting at a skipped special token would strip the next word's leading space.
    tok = tokenizers_by_name["sentencepiece"]
    ids = tok.encode("abc ab", add_special_tokens=False)
    ids = [ids[0], tok.eos_token_id, tok.eos_token_id, *ids[1:]]
    detok = IncrementalDetokenizer(tok, [])
    text = "".join(detok.step([i]) for i in ids) + detok.flush()
    assert text == "abc ab" == tok.decode(ids)


def test_byte_fallback_runs(tokenizers_by_name: dict[str, Tokenizer]) -> None:
    # Adjacent characters outside the vocabulary form one byte run; the text still comes out
    # character by character and ends equal to the full decode.
    tok = tokenizers_by_name["sentencepiece"]
    ids = tok.encode("a日本😀 é語", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.step([i]) for i in ids]
    assert [d for d in deltas if d] == ["a", "日", "本", "😀", " é", "語"]
    assert detok.flush() == "" and detok.output_text == tok.decode(ids) == "a日本😀 é語"


class CountingTokenizer(ByteTokenizer):
    def __init__(self, vocab_size: int = 256) -> None:
        super().__init__(vocab_size)
        self.longest = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return super().decode(ids, skip_special_tokens)


def test_decodes_a_short_window() -> None:
    tok, plain = CountingTokenizer(), ByteTokenizer()
    rng = random.Random(3)
    ids = tok.encode(random_text(rng, 600))  # ~1,500 byte ids, multi-byte characters included
    detok = IncrementalDetokenizer(tok, [])
    for i in range(0, len(ids), 2):
        detok.step(ids[i : i + 2])
    assert detok.output_text + detok.flush() == plain.decode(ids)
    # The window reaches back to the step before last that ended on a character boundary.
    clean = [
        i for i in range(0, len(ids) + 2, 2) if not plain.decode(ids[:i]).endswith(REPLACEMENT)
    ]
    max_gap = max(b - a for a, b in zip(clean, clean[1:]))
    assert tok.longest <= 2 * max_gap < 50  # not the whole output (~1,500 ids)


def test_undecodable_ids_decode_a_short_window() -> None:
    # Random weights over a large vocabulary: nearly every id is a lone U+FFFD. Each is final at
    # once, so the window stays short (it used to grow with the output: quadratic).
    tok, plain = CountingTokenizer(vocab_size=151936), ByteTokenizer(vocab_size=151936)
    rng = random.Random(5)
    ids = [rng.randrange(151936) if rng.random() < 0.9 else rng.randrange(256) for _ in range(3000)]
    detok = IncrementalDetokenizer(tok, [])
    for token_id in ids:
        detok.step([token_id])
        assert len(detok.output_text) >= len(plain.decode(detok.output_ids)) - 1
    assert detok.output_text + detok.flush() == plain.decode(ids)
    assert tok.longest < 16


def test_byte_tokenizer_token_bytes() -> None:
    tok = ByteTokenizer(vocab_size=300, bos_token_id=256, eos_token_id=257)
    rng = random.Random(7)
    for _ in range(50):
        ids = [rng.randrange(258, 300) if rng.random() < 0.2 else rng.randrange(256) for _ in range(20)]
        stream = b"".join(tok.token_bytes(i) for i in ids)
        assert stream.decode("utf-8", errors="replace") == tok.decode(ids)
    assert tok.token_bytes(256) is None and tok.token_bytes(300) is None and tok.token_bytes(-1) is None


def test_decode_token(tokenizers_by_name: dict[str, Tokenizer]) -> None:
    tok = tokenizers_by_name["byte_level_bpe"]
    assert decode_token(tok, tok.eos_token_id) == "</s>"
    ids = tok.encode("日本", add_special_tokens=False)
    assert "".join(decode_token(tok, i) for i in ids).replace(REPLACEMENT, "") in (
        "日本",
        "日",
        "本",
        "",
    )
    assert decode_token(tokenizers_by_name["bytes"], 0xE6) == REPLACEMENT
    assert decode_token(tokenizers_by_name["bytes"], 257) == "</s>"
    assert decode_token(tokenizers_by_name["bytes"], 65) == "A"
