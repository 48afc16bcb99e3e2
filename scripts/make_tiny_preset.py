"""Build the ``attnserve-tiny-llama`` preset: a config and a byte-level BPE tokenizer.

The tokenizer is trained, reproducibly, on the docstrings of Python's standard library (text
every Python installation ships). The preset has no weights: the engine makes seeded random
ones when it loads it, until a trained demo model replaces it.

    python scripts/make_tiny_preset.py [OUT_DIR]
"""

from __future__ import annotations

import ast
import json
import sys
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB = 2048
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def stdlib_docstrings(limit: int = 400) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(root.glob("*.py"))[:limit]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                if doc:
                    texts.append(doc)
    return texts


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(stdlib_docstrings(), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "model_max_length": 2048, "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(tok.token_to_id(s)): {"content": s, "special": True, "lstrip": False,
                                                           "rstrip": False, "normalized": False, "single_word": False}
                                 for s in SPECIALS},
    }, indent=2) + "\n")
    eos = tok.token_to_id("<|endoftext|>")
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "vocab_size": tok.get_vocab_size(), "bos_token_id": eos, "eos_token_id": eos,
        "tie_word_embeddings": True, "torch_dtype": "float32", "hidden_act": "silu",
    }, indent=2) + "\n")
    print(f"wrote {out} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    default = Path(__file__).resolve().parents[1] / "src/attnserve/presets/models/attnserve-tiny-llama"
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else default)
