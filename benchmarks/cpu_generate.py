"""CPU throughput: attnserve against transformers ``generate`` on the same small model.

A Llama-shaped model of tens of millions of parameters (random weights, saved in ``--dtype``,
bf16 by default), built once with transformers and saved; attnserve loads the same weights from
that directory. Both run in this process, one after the other; the table gives tokens/s and the
ratio. EOF is ignored. The first lines name the CPU, its instruction-set flags (those attnserve's
``dtype="auto"`` and CPU decode kernel read) and the threads.

Fixed lengths: batch 1 and batch 16, the same prompts (random token ids), the same number of new
tokens. ``--mixed``: issue #21's CPU goal, 64 requests with prompt and output lengths drawn
uniformly from 16..256 (seeded). attnserve takes them all at once with its defaults (no tuning
flag); transformers ``generate`` takes them in left-padded batches (64, and 16), each batch
running to its longest output, and only the useful tokens (each request's own output length)
count, as ``gpu_engine.throughput_hf`` counts them on the GPU. The ratio is against the faster
transformers batching. Two comparisons (issue #43): both engines at the same dtype
(``--dtype``), and each at its default (attnserve ``dtype="auto"``: bfloat16 on a CPU with native
bf16 dot products, else float32; transformers ``from_pretrained``'s default, the checkpoint's
dtype); where the defaults are the same dtypes as the first, its runs are not repeated.

    python benchmarks/cpu_generate.py [--batches 1 16] [--prompt-len 128] [--new-tokens 128] [--json out.json]
    python benchmarks/cpu_generate.py --mixed [--requests 64] [--min-len 16] [--max-len 256] [--hf-batches 64 16]
        [--repeats 3]
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


def mixed_requests(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, output length) pairs, both lengths uniform in [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n, 2), generator=g).tolist()
    return [(torch.randint(10, vocab, (p,), generator=g).tolist(), o) for p, o in lens]


def run_hf_mixed(model, reqs: list[tuple[list[int], int]], batch: int) -> tuple[float, int]:
    """transformers ``generate`` over left-padded batches of ``batch`` requests, each batch run
    to its longest output; (seconds, useful tokens: each request's own output length)."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    useful = 0
    start = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):  # left padding
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        new = max(o for _, o in chunk)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new)
        assert out.shape[1] == width + new
        useful += sum(o for _, o in chunk)
    return time.perf_counter() - start, useful


def run_attnserve_mixed(llm, reqs: list[tuple[list[int], int]]) -> tuple[float, int]:
    from attnserve import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [o for _, o in reqs]
    return elapsed, sum(o for _, o in reqs)


def cpu_lines() -> list[str]:
    """The CPU: its model and flags (as attnserve reads them), torch's capability and threads."""
    from attnserve.platforms.cpu_info import cpu_info

    info = cpu_info()
    return [f"CPU: {info.describe()}",
            f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
            f"threads {torch.get_num_threads()}; attnserve's CPU decode kernel path: {info.decode_isa}"]


def mixed_round(llm, hf: dict, reqs, args, best: dict) -> None:
    """One round: attnserve, then transformers at each batching; keeps the fastest of each."""
    t, toks = run_attnserve_mixed(llm, reqs)
    best["attnserve"] = min(best.get("attnserve", (t, toks)), (t, toks))
    for b in args.hf_batches:
        t, useful = run_hf_mixed(hf["model"], reqs, b)
        best[b] = min(best.get(b, (t, useful)), (t, useful))


def mixed(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    from attnserve import LLM
    from attnserve.engine.plan import resolve_dtype
    from attnserve.platforms import current_platform

    rows = {}  # label -> (attnserve dtype, transformers dtype, best times)
    with tempfile.TemporaryDirectory() as d:
        hf_same = build(d, getattr(torch, args.dtype))  # the checkpoint, in --dtype
        params = sum(p.numel() for p in hf_same.parameters())
        reqs = mixed_requests(args.requests, args.min_len, args.max_len, CONFIG["vocab_size"])
        # the defaults, but for the context length of this small model
        same = LLM(d, dtype=args.dtype, max_model_len=2 * args.max_len + 16)
        auto_dtype, why = resolve_dtype("auto", args.dtype, current_platform())  # what LLM(d) runs
        hf_default = AutoModelForCausalLM.from_pretrained(d).eval()  # transformers' default dtype
        hf_default_dtype = str(hf_default.dtype).removeprefix("torch.")
        configs = {"same dtype": (same, {"model": hf_same}, args.dtype, args.dtype)}
        if (auto_dtype, hf_default_dtype) != (args.dtype, args.dtype):
            auto = LLM(d, max_model_len=2 * args.max_len + 16)
            assert auto.llm_engine.parts.dtype == auto_dtype
            configs["defaults"] = (auto, {"model": hf_default}, auto_dtype, hf_default_dtype)
        del hf_default
        for llm, hf, _, _ in configs.values():  # warm-up
            run_attnserve_mixed(llm, reqs[:2])
            run_hf_mixed(hf["model"], reqs[:2], 2)
        # alternating rounds, the fastest of each: on a shared machine a neighbour's load lands
        # on whichever engine runs at the time
        for _ in range(args.repeats):
            for label, (llm, hf, ours, theirs) in configs.items():
                mixed_round(llm, hf, reqs, args, rows.setdefault(label, (ours, theirs, {}))[2])
    toks = sum(o for _, o in reqs)
    lines = cpu_lines() + [
        f"model: llama, {params / 1e6:.1f}M parameters, checkpoint {args.dtype}",
        f"{args.requests} requests, prompt and output lengths uniform in {args.min_len}..{args.max_len}: "
        f"{sum(len(p) for p, _ in reqs)} prompt tokens, {toks} output tokens; fastest of {args.repeats} "
        f"alternating rounds",
        f"attnserve dtype=\"auto\" here: {auto_dtype} ({why}); transformers' default: {hf_default_dtype}"]
    if "defaults" not in rows:
        lines.append("each engine's default is the same-dtype run below (not repeated)")
    out = {"cpu": cpu_lines(), "params": params, "requests": args.requests, "output_tokens": toks, "runs": {}}
    for label, (ours, theirs, best) in rows.items():
        t_ours = best["attnserve"][0]
        hf_rows = {b: v for b, v in best.items() if b != "attnserve"}
        fastest = min(hf_rows, key=lambda b: hf_rows[b][0])
        ratio = hf_rows[fastest][0] / t_ours
        lines.append(f"{label}: attnserve {ours}, transformers {theirs}")
        lines.append(f"  attnserve LLM.generate, all at once: {t_ours:.1f} s, {toks / t_ours:.1f} tok/s")
        for b, (t, useful) in hf_rows.items():
            lines.append(f"  transformers generate, batches of {b} (left-padded): {t:.1f} s, {useful / t:.1f} useful tok/s")
        lines.append(f"  ratio (against transformers' faster batching, {fastest}): {ratio:.2f}x")
        out["runs"][label] = {"attnserve_dtype": ours, "transformers_dtype": theirs, "attnserve_s": t_ours,
                              "transformers_s": {str(b): t for b, (t, _) in hf_rows.items()}, "ratio": ratio}
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="the checkpoint's dtype, and both engines' in the same-dtype comparison")
    ap.add_argument("--mixed", action="store_true", help="issue #21's mixed workload (see the docstring)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--hf-batches", type=int, nargs="+", default=[64, 16])
    ap.add_argument("--repeats", type=int, default=3, help="--mixed: alternating rounds, the fastest of each")
    args = ap.parse_args()
    if args.mixed:
        mixed(args)
        return
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
    print("\n".join(cpu_lines()))
    print(f"model: llama, {params / 1e6:.1f}M parameters, {args.dtype}, torch threads {torch.get_num_threads()}")
    print(f"{'batch':>5} {'attnserve tok/s':>16} {'transformers tok/s':>19} {'ratio':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['attnserve_tok_s']:>16.1f} {r['transformers_tok_s']:>19.1f} {r['ratio']:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": params, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
