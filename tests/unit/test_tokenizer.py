"""Tokenizer loading, encode/decode and chat templates against transformers' AutoTokenizer.

Tokenizers are trained here (a tiny byte-level BPE with multi-byte text and special tokens) and
written to tmp dirs; nothing is downloaded. Equality with the oracle is exact.
"""

from __future__ import annotations

import datetime
import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from attnserve.tokenizer import ByteTokenizer, FastTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

WORDS = "hello world café naïve 日本 日本語 東京 😀 🚀 the quick brown fox über straße a I < | >".split()
WORDS.append("\n")
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama-3 style: bos_token variable, trim_blocks/lstrip_blocks, tojson with indent, tools,
# raise_exception, strftime_now, loop controls, {% generation %}, a pass-through kwarg.
LLAMA3 = """{{ bos_token }}
{% if tools is not none %}
<|im_start|>tools
{% for tool in tools %}
{{ tool | tojson(indent=2) }}
{% endfor %}
<|im_end|>
{% endif %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('bad role ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' and skip_system %}{% continue %}{% endif %}
<|im_start|>{{ message['role'] }}
{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}
{% endgeneration %}
{% else %}{% if 'name' in message %}[{{ message.name }}] {% endif %}{{ message['content'] | trim }}
{% endif %}
{% if message.get('reasoning_content') %}[think]{{ message['reasoning_content'] }}{% endif %}
{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant {{ strftime_now('%Y') }}
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "hello 日本 😀"}],
    [
        {"role": "system", "content": "Be brief. Ünïcode"},
        {"role": "user", "content": " the quick fox "},
        {"role": "assistant", "content": "café", "reasoning_content": "think 東京"},
        {"role": "user", "content": "again", "name": None},
        {"role": "user", "content": "named", "name": "bob"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Wetter in Köln",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def bpe_json() -> str:
    """A trained byte-level BPE (no post-processor), serialised."""
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))) for _ in range(400)]
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens(["<|tool|>", "<|sep|>"])  # added, not special
    return tok.to_str()


def write_model(
    path: Path,
    tok_json: str,
    config: dict | None,
    *,
    bos_post: bool = False,
    files: dict[str, str] | None = None,
) -> Path:
    tok = RustTokenizer.from_str(tok_json)
    if bos_post:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    for name, text in (files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text, encoding="utf-8")
    return path


def oracle(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path))


BASE = {"tokenizer_class": "TokenizersBackend", "bos_token": "<s>", "eos_token": "</s>"}
CASES = {
    # name: (tokenizer_config, bos post-processor in tokenizer.json, extra files)
    "chatml": ({**BASE, "eos_token": "<|im_end|>", "chat_template": CHATML}, False, {}),
    "llama3": ({**BASE, "chat_template": LLAMA3, "model_max_length": 4096}, True, {}),
    # transformers 5 ignores add_bos_token/add_eos_token when tokenizer.json exists
    "add_bos_ignored": ({**BASE, "add_bos_token": True, "add_eos_token": True}, False, {}),
    "add_bos_false": ({**BASE, "add_bos_token": False, "chat_template": LLAMA3}, True, {}),
    # special tokens the vocabulary lacks are added; flags of added_tokens_decoder win
    "added_tokens": (
        {
            **BASE,
            "pad_token": "<pad>",
            "image_token": "<image>",
            "additional_special_tokens": ["<extra>", "hello"],
            "sep_token": "<|sep|>",  # stays a non-special added token
            "cls_token": "<|tool|>",  # made special: a named token's flag is ignored
            "added_tokens_decoder": {
                "3": {"content": "<|im_end|>", "special": False, "normalized": False},
                "999": {"content": "<|tool|>", "special": False, "normalized": False},
            },
            "chat_template": "{{ image_token }}{{ pad_token }}",
        },
        False,
        {},
    ),
    # legacy special_tokens_map.json overrides tokenizer_config.json
    "special_tokens_map": (
        {**BASE, "chat_template": LLAMA3},
        True,
        {"special_tokens_map.json": json.dumps({"eos_token": "<|im_end|>", "pad_token": "</s>"})},
    ),
    "no_config": (None, True, {}),
}

TEXTS = [
    "<|tool|>x<|sep|>",
    "hello world",
    "",
    " café naïve 日本語 😀🚀",
    "<s>hello</s><|im_start|>x<|im_end|>",
    "<pad><image><extra> hello",
    "  straße\n\nüber  ",
]


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(tmp_path: Path, bpe_json: str, case: str) -> None:
    config, bos_post, files = CASES[case]
    path = write_model(tmp_path / case, bpe_json, config, bos_post=bos_post, files=files)
    ours, hf = load_tokenizer(path), oracle(path)
    assert isinstance(ours, FastTokenizer)
    assert ours.vocab_size == len(hf)
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert ours.model_max_length == (None if hf.model_max_length > 1e29 else hf.model_max_length)
    assert set(hf.all_special_ids) <= ours.all_special_ids
    dropped = {i for i in range(ours.vocab_size) if hf.decode([i], skip_special_tokens=True) == ""}
    assert dropped <= ours.all_special_ids <= dropped | set(hf.all_special_ids)
    rng = random.Random(1)
    texts = TEXTS + ["".join(rng.choice(WORDS + SPECIALS) for _ in range(12)) for _ in range(20)]
    for text in texts:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == hf.encode(
                text, add_special_tokens=add
            )
    id_lists = [
        [rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 20))] for _ in range(50)
    ]
    id_lists += [hf.encode(text) for text in texts]
    for ids in id_lists:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert ours.has_chat_template == (hf.chat_template is not None)
    if ours.has_chat_template:
        check_templates(ours, hf)


def check_templates(ours, hf) -> None:
    for messages in CONVERSATIONS:
        for gen in (True, False):
            for tools in (None, TOOLS):
                want = hf.apply_chat_template(
                    messages,
                    tools=tools,
                    add_generation_prompt=gen,
                    tokenize=False,
                    skip_system=True,
                )
                got = ours.apply_chat_template(messages, gen, tools, skip_system=True)
                assert got == want
                assert ours.encode(got, add_special_tokens=False) == hf.encode(
                    want, add_special_tokens=False
                )


def test_llama3_template_renders_what_it_should(tmp_path: Path, bpe_json: str) -> None:
    path = write_model(tmp_path, bpe_json, CASES["llama3"][0], bos_post=True)
    text = load_tokenizer(path).apply_chat_template(
        CONVERSATIONS[1], tools=TOOLS, skip_system=False
    )
    assert text.startswith('<s>\n<|im_start|>tools\n{\n  "type": "function",\n  "function": {')
    assert "Wetter in Köln" in text  # tojson keeps non-ASCII
    assert "<|im_start|>system\nBe brief. Ünïcode\n</s>" in text
    assert "<|im_start|>assistant\ncafé\n[think]think 東京</s>" in text and "None" not in text
    assert text.endswith(f"<|im_start|>assistant {datetime.date.today().year}\n")


def test_chat_template_file_wins(tmp_path: Path, bpe_json: str) -> None:
    config = {**BASE, "chat_template": CHATML}
    path = write_model(tmp_path, bpe_json, config, files={"chat_template.jinja": LLAMA3})
    ours, hf = load_tokenizer(path), oracle(path)
    assert ours.apply_chat_template(CONVERSATIONS[0]).startswith("<s>")
    check_templates(ours, hf)


def test_named_templates(tmp_path: Path, bpe_json: str) -> None:
    tool_use = "TOOLS {{ tools | length }}" + CHATML
    config = {
        **BASE,
        "chat_template": [
            {"name": "default", "template": CHATML},
            {"name": "tool_use", "template": tool_use},
        ],
    }
    path = write_model(tmp_path, bpe_json, config)
    ours, hf = load_tokenizer(path), oracle(path)
    check_templates(ours, hf)
    assert ours.apply_chat_template(CONVERSATIONS[0], tools=TOOLS).startswith("TOOLS 1")
    assert ours.apply_chat_template(
        CONVERSATIONS[0], chat_template="tool_use", tools=[]
    ).startswith("TOOLS 0")
    assert ours.apply_chat_template(CONVERSATIONS[0], chat_template="x{{ eos_token }}") == "x</s>"


def test_template_errors(tmp_path: Path, bpe_json: str) -> None:
    path = write_model(tmp_path / "a", bpe_json, CASES["llama3"][0], bos_post=True)
    tok = load_tokenizer(path)
    with pytest.raises(ValueError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="empty conversation"):
        tok.apply_chat_template([])
    no_template = load_tokenizer(write_model(tmp_path / "b", bpe_json, BASE))
    assert not no_template.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template(CONVERSATIONS[0])


def test_errors_name_the_file(tmp_path: Path, bpe_json: str) -> None:
    def expect(path: Path, exc: type[Exception], name: str) -> None:
        with pytest.raises(exc, match=name.replace(".", r"\.")):
            load_tokenizer(path)

    bad_json = write_model(tmp_path / "bad_json", bpe_json, None)
    (bad_json / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    expect(bad_json, ValueError, "tokenizer_config.json")
    bad_tok = tmp_path / "bad_tok"
    bad_tok.mkdir()
    (bad_tok / "tokenizer.json").write_text('{"model": 3}', encoding="utf-8")
    expect(bad_tok, ValueError, "tokenizer.json")
    bad_file = write_model(
        tmp_path / "bad_file", bpe_json, BASE, files={"chat_template.jinja": "{% for x in %}"}
    )
    expect(bad_file, ValueError, "chat_template.jinja")
    bad_cfg = write_model(tmp_path / "bad_cfg", bpe_json, {**BASE, "chat_template": "{{ x"})
    expect(bad_cfg, ValueError, "tokenizer_config.json")
    bad_token = write_model(tmp_path / "bad_token", bpe_json, {**BASE, "eos_token": 3})
    expect(bad_token, ValueError, "tokenizer_config.json")
    spm = tmp_path / "spm"
    spm.mkdir()
    (spm / "tokenizer.model").write_bytes(b"\x00")
    expect(spm, ValueError, "tokenizer.model")
    empty = tmp_path / "empty"
    empty.mkdir()
    expect(empty, FileNotFoundError, "config.json")
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({"vocab_size": 100}), encoding="utf-8")
    expect(small, ValueError, "config.json")
    (small / "config.json").write_text("[1]", encoding="utf-8")
    expect(small, ValueError, "config.json")
    expect(tmp_path / "missing", FileNotFoundError, "missing")


def random_text(rng: random.Random, n: int) -> str:
    # code points from every UTF-8 length, no surrogates
    ranges = [(0x20, 0x7E), (0xA0, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFD), (0x10000, 0x10FFFF)]
    return "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(n))


def test_byte_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"vocab_size": 300, "bos_token_id": 256, "eos_token_id": [257, 2]}),
        encoding="utf-8",
    )
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (300, 256, 257)
    assert tok.all_special_ids == {256, 257} and not tok.has_chat_template
    rng = random.Random(2)
    for _ in range(200):
        text = random_text(rng, rng.randint(0, 30))
        ids = tok.encode(text)
        assert ids == [256, *text.encode("utf-8")]
        assert tok.decode(ids + [257]) == text
        assert tok.decode(ids + [257], skip_special_tokens=False) == "<s>" + text + "</s>"
    raw = bytes(rng.randrange(256) for _ in range(500))  # invalid UTF-8 runs
    assert tok.decode(list(raw)) == raw.decode("utf-8", errors="replace")
    split = list("日本".encode())
    assert tok.decode(split[:2] + [256] + split[2:]) == "日本"  # a skipped special does not cut it
    assert tok.decode([104, 299, 105]) == "h\ufffdi"
    assert tok.convert_ids_to_tokens([104, 32, 256, 299]) == ["h", "<0x20>", "<s>", ""]
    with pytest.raises(ValueError, match="apply_chat_template|no chat template"):
        tok.apply_chat_template(CONVERSATIONS[0])


def test_byte_tokenizer_decode_matches_the_id_by_id_loop() -> None:
    # decode maps ids >= 256 to the byte 0xFF and decodes once when no special id is present;
    # _decode_runs is its slow twin. Bytes of broken and complete multi-byte characters, ids
    # >= 256 between them, special ids skipped or shown, all must agree.
    tok = ByteTokenizer(400, bos_token_id=300, eos_token_id=301)
    pieces = list(range(256)) + list("日😀é".encode()) * 20 + [0xC0, 0xED, 0xA0, 0xF5] * 5 + list(range(256, 400)) * 2
    rng = random.Random(4)
    for _ in range(5000):
        ids = [rng.choice(pieces) for _ in range(rng.randint(0, 12))]
        for skip in (True, False):
            assert tok.decode(ids, skip) == tok._decode_runs(ids, skip), ids
    assert tok.decode(tuple(x for x in [104, 399, 105])) == "h\ufffdi"
    with pytest.raises(ValueError, match="negative token id -1"):
        tok.decode([104, -1])


def test_byte_tokenizer_small_special_ids_are_bytes(tmp_path: Path) -> None:
    config = {"text_config": {"vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2}}
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.all_special_ids) == (None, None, set())
    assert tok.decode([1, 2, 65]) == "\x01\x02A"
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(255)
