"""Structured output's cost per token: tokens/s with and without a JSON schema on the demo model.

The shipped demo model (``attnserve-demo-gqa``, vocabulary 4,096; ``--model`` for another)
generates ``--new-tokens`` per request at each batch size, seeded sampling, EOS ignored, once
unconstrained and twice with a JSON schema whose output cannot end early (an array of at
least ten objects, so requests run to ``--new-tokens``): in the engine's order ("overlapped":
the bitmask filled after the step's forward is launched, so on CUDA while the device
computes; with async scheduling the forward launched before the step before is read back,
only the sampling waiting for it) and, for comparison, in the order before ("old order": the
bitmask filled before the launch; with async scheduling the step before read back before the
next is scheduled). Reported per run: tokens/s, ms per step, the fill's host time per step and the
grammar's whole host time per generated token (the fill, and advancing the matcher after the
step), each the fastest of ``--repeats`` alternating runs. Then the bitmask's application in
the sampler alone (unpack and mask) at this vocabulary and at a 151,936-token one, per step.

    python benchmarks/cpu_structured.py [--batches 1 8] [--new-tokens 64] [--repeats 3] [--device cpu]
                                        [--model DIR] [--async-scheduling on|off] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

SCHEMA = {"type": "array", "minItems": 10, "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["id", "tags"]}}
PROMPTS = ["def f(x):", "import os", "class A:", "x = [", "for i in range(", "# a comment", "y = {", "if x:"]


def _timed(obj, name: str, totals: dict[str, float]):
    real = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - start

    setattr(obj, name, wrapper)


MODES = ("none", "overlapped", "old order")  # no schema; with one: the engine's order, the order before


@contextlib.contextmanager
def _old_order(runner):
    """The order before the overlap: the bitmask filled, then the step's forward launched; and
    under async scheduling a step with a constrained request running read the step before back
    before it was scheduled (its forward did not run ahead)."""
    from attnserve.core.request import Request

    real_launch, real_prop = runner.launch, Request.needs_host_tokens_to_launch

    def launch(output, grammar_bitmask=None):
        mask = grammar_bitmask(output) if grammar_bitmask is not None else None
        return real_launch(output, lambda _: mask)

    runner.launch = launch
    Request.needs_host_tokens_to_launch = property(lambda r: real_prop.fget(r) or r.needs_host_tokens)
    try:
        yield
    finally:
        del runner.launch
        Request.needs_host_tokens_to_launch = real_prop


def run(llm, batch: int, new_tokens: int, mode: str) -> dict:
    from attnserve import SamplingParams
    from attnserve.sampling_params import StructuredOutputsParams

    structured = mode != "none"
    so = StructuredOutputsParams(json=SCHEMA) if structured else None
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=new_tokens, ignore_eos=True,
                             structured_outputs=so) for i in range(batch)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    llm.generate(prompts, [SamplingParams(**{**_fields(p), "max_tokens": 4}) for p in params])  # warm-up
    engine = llm.llm_engine
    totals: dict[str, float] = {}
    _timed(engine.structured, "fill_bitmask", totals)
    _timed(engine, "_advance_grammar", totals)
    steps = engine.scheduler.stats.steps
    with _old_order(engine.runner) if mode == "old order" else contextlib.nullcontext():
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    del engine.structured.fill_bitmask, engine._advance_grammar  # back to the class's methods
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = engine.scheduler.stats.steps - steps
    grammar = totals.get("fill_bitmask", 0.0) + totals.get("_advance_grammar", 0.0)
    if structured:
        for o in outs:  # what ended in time is valid JSON
            if o.outputs[0].finish_reason == "stop":
                json.loads(o.outputs[0].text)
    return {"batch": batch, "mode": mode, "tokens": tokens, "steps": steps,
            "tok_per_s": tokens / elapsed, "ms_per_step": 1e3 * elapsed / steps,
            "fill_ms_per_step": 1e3 * totals.get("fill_bitmask", 0.0) / steps,
            "grammar_ms_per_token": 1e3 * grammar / tokens}


def _fields(p) -> dict:
    return {k: getattr(p, k) for k in p.__dataclass_fields__ if not k.startswith("_")}


def apply_cost(device: str, batch: int, vocab: int, reps: int = 50) -> float:
    """ms per step of ``apply_token_bitmask`` on ``[batch, vocab]`` logits, every row masked."""
    from attnserve.layers.sampler import SamplingBatch, apply_token_bitmask
    from attnserve.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    logits = torch.randn(batch, vocab, device=device)
    sb = SamplingBatch.from_params([SamplingParams()] * batch, [None] * batch, [[]] * batch, [[]] * batch,
                                   None, device, token_bitmask=(list(range(batch)), bitmask))
    for _ in range(3):
        apply_token_bitmask(logits, sb)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        apply_token_bitmask(logits, sb)
    if device == "cuda":
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="a model directory or hub id (default: the demo model)")
    ap.add_argument("--async-scheduling", choices=["on", "off"], default=None,
                    help="default: the engine's (on for CUDA, off for CPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from attnserve import LLM

    wanted = None if args.async_scheduling is None else args.async_scheduling == "on"
    llm = LLM(args.model, device=args.device, max_model_len=512, max_num_seqs=max(args.batches),
              async_scheduling=wanted)
    asynchronous = llm.llm_engine.async_scheduling
    vocab = llm.llm_engine.arch.vocab_size
    rows = []
    for b in args.batches:  # the fastest of --repeats runs, alternating, against a noisy machine
        runs = [run(llm, b, args.new_tokens, m) for _ in range(args.repeats) for m in MODES]
        rows += [max((r for r in runs if r["mode"] == m), key=lambda r: r["tok_per_s"]) for m in MODES]
    print(f"{args.model or 'demo model'} (vocabulary {vocab}) on {args.device}, {args.new_tokens} new tokens "
          f"per request, async scheduling {'on' if asynchronous else 'off'}, torch threads {torch.get_num_threads()}")
    print("| batch | JSON schema: order | tokens | steps | tok/s | ms/step | fill ms/step | "
          "grammar host ms/token |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['batch']} | {'no schema' if r['mode'] == 'none' else r['mode']} | {r['tokens']} | "
              f"{r['steps']} | {r['tok_per_s']:.1f} | {r['ms_per_step']:.2f} | {r['fill_ms_per_step']:.3f} | "
              f"{r['grammar_ms_per_token']:.3f} |")
    applies = [{"batch": b, "vocab": v, "ms": apply_cost(args.device, b, v)}
               for b in args.batches for v in dict.fromkeys((vocab, 151936))]
    for a in applies:
        print(f"apply_token_bitmask, batch {a['batch']}, vocabulary {a['vocab']}: {a['ms']:.3f} ms per step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": rows, "apply": applies, "device": args.device, "async_scheduling": asynchronous}, f, indent=1)


if __name__ == "__main__":
    main()
