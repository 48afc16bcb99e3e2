"""What bf16 greedy agreement means on a hybrid model: a trained Qwen3-Next-style model against random weights.

``gpu_check.py`` reports that attnserve's Qwen3-Next in bf16 agrees with transformers in 0% of
greedy continuations on its tiny random model. On random weights the next-token distribution is
nearly flat, so the top two logits sit closer together than bf16 rounding (about 1e-2) and any
two bf16 implementations pick different tokens; that says nothing about either. This script
trains the same layer (``scripts/train_demo.py``'s ``attnserve-demo-gdn``: Gated DeltaNet in
3 of every 4 layers, gated full attention, dense MLP, 7.4M parameters) on the Python standard
library for ``--minutes``, then measures on held-out file openings, for the trained model and
for the same architecture with its initial random weights:

- the held-out perplexity (transformers, float32);
- greedy agreement with transformers' float32 run of ``--new`` tokens: the share of prompts
  whose continuations are identical, and the mean number of leading tokens that match, for
  transformers bf16, attnserve float32 and attnserve bf16 (each state backend given);
- the top-1 margin of transformers' float32 logits at the prompts' last position (the median gap
  between the two largest logits), the quantity bf16 rounding competes with.

    python benchmarks/gpu_hybrid_drift.py [--minutes 2] [--prompts 32] [--new 32] [--backends TORCH_GDN,TRITON_GDN]
    python benchmarks/gpu_hybrid_drift.py --smoke   # CPU, seconds of training, tiny sizes

Writes ``$OUT/gpu_hybrid_drift.json`` when OUT is set; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))
sys.modules.setdefault("fla", None)  # transformers' reference delta rule, not fla's kernels
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

VARIANT = "attnserve-demo-gdn"


def held_prompts(tok, held_text: str, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens: the openings of held-out files (one per file)."""
    out = []
    for text in held_text.split("\n\n\n"):
        ids = tok.encode(text).ids
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == count:
            break
    if len(out) < count:  # few long files: take consecutive windows of the text
        ids = tok.encode(held_text).ids
        out += [ids[i:i + length] for i in range(0, len(ids) - length, length)][: count - len(out)]
    return out


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], new: int, device: str) -> tuple[list[list[int]], list[float]]:
    outs, margins = [], []
    for p in prompts:
        x = torch.tensor([p], device=device)
        logits = model(x).logits[0, -1].float()
        top2 = logits.topk(2).values
        margins.append((top2[0] - top2[1]).item())
        g = model.generate(x, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(g[0, len(p):].tolist())
    return outs, margins


def agreement(outs: list[list[int]], ref: list[list[int]]) -> dict:
    same = sum(o == r for o, r in zip(outs, ref))
    lead = []
    for o, r in zip(outs, ref):
        n = 0
        while n < min(len(o), len(r)) and o[n] == r[n]:
            n += 1
        lead.append(n)
    return {"identical": same / len(ref), "mean_leading_match": statistics.mean(lead)}


def attnserve_greedy(path: Path, prompts, new: int, dtype: str, backend: str | None, device: str):
    from attnserve import LLM, SamplingParams

    kw = {"attention_backend": backend} if backend else {}
    llm = LLM(str(path), dtype=dtype, device=device, max_model_len=512, max_num_seqs=64, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    names = llm.llm_engine.parts.backend_names
    del llm
    return [list(o.outputs[0].token_ids) for o in outs], names


def measure(path: Path, prompts, args, device: str) -> dict:
    from train_demo import perplexity
    from transformers import AutoModelForCausalLM

    row: dict = {}
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    row["held_out_ppl"] = round(perplexity(hf32, args.held_ids, device, batches=4), 2)
    ref, margins = hf_greedy(hf32, prompts, args.new, device)
    row["median_top1_margin"] = statistics.median(margins)
    row["share_margin_below_0.02"] = sum(m < 0.02 for m in margins) / len(margins)
    del hf32
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    row["transformers_bf16"] = agreement(hf_greedy(hf16, prompts, args.new, device)[0], ref)
    del hf16
    for backend in args.backends:
        for dtype in ("float32", "bfloat16"):
            outs, names = attnserve_greedy(path, prompts, args.new, dtype, backend, device)
            row[f"attnserve_{dtype}_{backend or 'default'}"] = dict(agreement(outs, ref), backends=names)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--backends", default="TORCH_GDN,TRITON_GDN",
                    help="state backends for attnserve's runs (comma-separated; 'default' for the platform's)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    args.backends = [None if b == "default" else b for b in args.backends.split(",")]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.minutes, args.prompts, args.new, args.prompt_len = 0.05, 3, 4, 16
        args.backends = [None]
    import train_demo

    work = Path(tempfile.mkdtemp(prefix="hybrid_drift_"))
    train_texts, val_texts, held_texts = train_demo.corpus()
    if args.smoke:
        train_texts, val_texts, held_texts = train_texts[:40], val_texts[:5], held_texts[:5]
    tok = train_demo.train_tokenizer(train_texts, work / "_tokenizer")
    data = {"train": train_demo.encode(tok, train_texts), "val": train_demo.encode(tok, val_texts),
            "held": train_demo.encode(tok, held_texts), "stdlib": "this python"}
    args.held_ids = data["held"]
    targs = argparse.Namespace(device=device, seed=0, lr=2e-3, minutes=args.minutes, max_steps=100_000,
                               evals=5, dense_warmup=0.1, batch=64 if device == "cuda" else 4)
    t0 = time.time()
    info = train_demo.train_one(VARIANT, data, work, targs)
    trained = work / VARIANT
    # the same architecture with its initial weights: train_one with no step
    random_dir = work / "random"
    model_type, kwargs = train_demo.VARIANTS[VARIANT]
    train_demo.build(model_type, kwargs, targs.seed).save_pretrained(random_dir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (random_dir / f).write_bytes((work / "_tokenizer" / f).read_bytes())
    prompts = held_prompts(tok, "\n\n\n".join(held_texts), args.prompts, args.prompt_len)
    result = {"training": info, "train_wall_s": round(time.time() - t0, 1), "prompts": len(prompts),
              "prompt_len": args.prompt_len, "new": args.new, "device": torch.cuda.get_device_name()
              if device == "cuda" else "cpu"}
    for name, path in (("trained", trained), ("random", random_dir)):
        result[name] = measure(path, prompts, args, device)
        print(json.dumps({name: result[name]}), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_hybrid_drift.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'model':<9}{'ppl':>8}{'margin':>8}{'<0.02':>7}  " + "  ".join(
        f"{k}" for k in result["trained"] if isinstance(result["trained"][k], dict)))
    for name in ("trained", "random"):
        r = result[name]
        cells = [f"{v['identical']:.2f}/{v['mean_leading_match']:.1f}" for v in r.values() if isinstance(v, dict)]
        print(f"{name:<9}{r['held_out_ppl']:>8.1f}{r['median_top1_margin']:>8.3f}{r['share_margin_below_0.02']:>7.2f}  "
              + "  ".join(cells))
    print("cells: share of prompts with identical greedy continuations / mean leading tokens matching, "
          "against transformers float32")


if __name__ == "__main__":
    main()
