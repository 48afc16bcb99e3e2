"""Ship the trained demo models: bf16 weights into the package, golden completions, a KV plot.

After ``scripts/train_demo.py`` wrote the three variants to a directory, this script
1. copies each into ``src/attnserve/presets/models/<name>`` with its weights stored in bf16
   (a few MB each) and the config saying so;
2. records each model's greedy completions of a few prompts, computed by attnserve in float32,
   into ``tests/models/data/demo_completions.json`` (the test compares against them);
3. keeps a held-out sample for the perplexity test in ``tests/models/data/demo_held_out.txt``;
4. draws ``docs/demo_kv_memory.png``: KV bytes per sequence against context length per variant.

    python scripts/finish_demo.py /tmp/demo_models
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from attnserve.arch import read_arch

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ROOT / "src/attnserve/presets/models"
DATA = ROOT / "tests/models/data"
NAMES = ["attnserve-demo-gqa", "attnserve-demo-mla", "attnserve-demo-dsa"]
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):", "for i in range("]


def ship(src: Path) -> None:
    for name in NAMES:
        dst = PRESETS / name
        if dst.exists():
            shutil.rmtree(dst)
        dst.mkdir(parents=True)
        weights = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(src / name / "model.safetensors")).items()}
        save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((src / name / "config.json").read_text())
        config["torch_dtype"] = config["dtype"] = "bfloat16"
        (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in ("tokenizer.json", "tokenizer_config.json", "training.json"):
            shutil.copy(src / name / f, dst / f)


def record() -> None:
    from attnserve import LLM, SamplingParams

    out = {}
    params = SamplingParams(temperature=0.0, max_tokens=24)
    for name in NAMES:
        outs = LLM(name, dtype="float32").generate(PROMPTS, params)
        out[name] = {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, outs)}
        for p, o in zip(PROMPTS, outs):
            print(f"--- {name}: {p!r}\n{p}{o.outputs[0].text}")
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / "demo_completions.json").write_text(json.dumps(out, indent=1) + "\n")


def plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnserve.arch import load_hf_config
    from attnserve.config import CacheConfig
    from attnserve.entrypoints.inspect import _sequence_bytes
    from attnserve.kvcache.groups import cache_entries

    xs = [2**k for k in range(6, 12)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in NAMES:
        arch = read_arch(load_hf_config(PRESETS / name))
        entries = cache_entries(arch, CacheConfig(block_size=16), "bfloat16")
        ax.plot(xs, [_sequence_bytes(entries, x) / 1024 for x in xs], marker="o",
                label=f"{name} ({arch.mechanism.value})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("KV cache per sequence (KiB, bf16)")
    ax.set_title("attnserve demo models: KV memory by attention mechanism")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(ROOT / "docs/demo_kv_memory.png", dpi=110)


def main() -> None:
    src = Path(sys.argv[1])
    ship(src)
    held = (src / "_tokenizer" / "held_out.txt").read_text()
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / "demo_held_out.txt").write_text(held[:24_000])
    record()
    plot()


if __name__ == "__main__":
    main()
