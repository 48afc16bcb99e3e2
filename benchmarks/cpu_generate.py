"""CPU throughput: attnserve against transformers ``generate`` on the same small model.

A Llama-shaped model of tens of millions of parameters (random weights, bf16 by default), batch 1 and
batch 16, the same prompts (random token ids) and the same number of new tokens (EOS ignored).
Both run in this process, one after the other; the table gives tokens/s and the ratio.

    python benchmarks/cpu_generate.py [--batches 1 16] [--prompt-len 128] [--new-tokens 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CONFIG = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
              tie_word_embeddings=False)


def build(path: str, dtype: torch.dtype = torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval().to(dtype)
    model.save_pretrained(path)
    return model


def run_hf(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + new_tokens
    return elapsed


def run_attnserve(llm, prompts: list[list[int]], new_tokens: int) -> float:
    from attnserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    from attnserve import LLM

    rows = []
    with tempfile.TemporaryDirectory() as d:
        hf = build(d, getattr(torch, args.dtype))
        params = sum(p.numel() for p in hf.parameters())
        llm = LLM(d, dtype=args.dtype, max_model_len=args.prompt_len + args.new_tokens + 16,
                  max_num_seqs=max(args.batches), max_num_batched_tokens=max(args.batches) * args.prompt_len)
        g = torch.Generator().manual_seed(0)
        for batch in args.batches:
            prompts = torch.randint(10, CONFIG["vocab_size"], (batch, args.prompt_len), generator=g).tolist()
            run_attnserve(llm, prompts[:1], 4)  # warm-up
            run_hf(hf, prompts[:1], 4)
            t_ours = run_attnserve(llm, prompts, args.new_tokens)
            t_hf = run_hf(hf, prompts, args.new_tokens)
            toks = batch * args.new_tokens
            rows.append({"batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                         "attnserve_tok_s": toks / t_ours, "transformers_tok_s": toks / t_hf,
                         "ratio": t_hf / t_ours, "attnserve_s": t_ours, "transformers_s": t_hf})
    print(f"model: llama, {params / 1e6:.1f}M parameters, {args.dtype}, torch threads {torch.get_num_threads()}")
    print(f"{'batch':>5} {'attnserve tok/s':>16} {'transformers tok/s':>19} {'ratio':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['attnserve_tok_s']:>16.1f} {r['transformers_tok_s']:>19.1f} {r['ratio']:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": params, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
