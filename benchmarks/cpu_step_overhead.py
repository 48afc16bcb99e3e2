"""Engine host overhead per step on CPU: where a step's time goes when the model costs little.

A 2-layer Qwen3-shaped model with hidden size 64 (random weights, float32, a vocabulary of 4,096
and the byte tokenizer that a directory with only a config gets, as in ``gpu_engine.py``) runs a
scaled nano-vllm workload: 256 requests, prompt and output lengths uniform in 32..256, random
token ids, greedy, EOS ignored, max_num_seqs=256, max_num_batched_tokens=16384. Timers wrapped
around the engine's phases (here only: the engine carries no timing hooks) split each step:

- schedule: ``Scheduler.schedule``
- prepare: the rest of ``ModelRunner.execute``: step order, flat inputs, block tables, slot
  mappings, attention metadata, logit rows
- forward: the tensor work a GPU would do: the model, ``compute_logits`` and the ``Sampler``
- sample: the rest of ``ModelRunner._sample``: the sampling batch, tokens back to the host
- output: the rest of ``LLMEngine.step``: ``Scheduler.update``, detokenisation, outputs

"host" is everything but forward: what a GPU waits for each step when the host does its work
serially. Times are the engine thread's CPU time (torch runs on that one thread), so another
busy process on the machine disturbs them less than wall time. Objects that exist before the
runs are frozen out of the garbage collector (a full collection over torch's objects took
~120 ms, landing in whichever phase it hit). The table takes the fastest of ``--repeats`` runs
and gives milliseconds per step, for decode-only steps at batch >= 240 and for all steps.

    python benchmarks/cpu_step_overhead.py [--repeats 3] [--no-detokenize] [--profile out.prof]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from attnserve import LLM, SamplingParams  # noqa: E402

CONFIG = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              vocab_size=4096, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1000000,
              tie_word_embeddings=True, hidden_act="silu", torch_dtype="float32", eos_token_id=1)
PHASES = ("schedule", "prepare", "forward", "sample", "output")
CLOCK = time.thread_time


class StepTimer:
    """Wraps the engine's phase methods on their instances; ``steps`` holds each step's split."""

    def __init__(self, engine):
        self.steps: list[dict] = []
        self._cur: dict[str, float] = {}
        self._undo: list = []
        runner = engine.runner
        self._wrap(engine.scheduler, "schedule", "schedule", self._note_batch)
        self._wrap(runner, "execute", "execute")
        self._wrap(runner, "_sample", "sample")
        self._wrap(runner.sampler, "forward", "sampler")
        self._wrap(runner.model, "compute_logits", "logits")
        self._undo += [runner.model.register_forward_pre_hook(lambda *_: self._cur.__setitem__("t0", CLOCK())),
                       runner.model.register_forward_hook(lambda *_: self._add("model", CLOCK() - self._cur["t0"]))]
        self._wrap(engine, "step", "step", self._record)

    def remove(self) -> None:
        for handle in self._undo:
            handle.remove()

    def _add(self, key: str, dt: float) -> None:
        self._cur[key] = self._cur.get(key, 0.0) + dt

    def _wrap(self, obj, name: str, key: str, after=None) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            t = CLOCK()
            out = fn(*args, **kwargs)
            self._add(key, CLOCK() - t)
            if after is not None:
                after(out)
            return out

        setattr(obj, name, timed)
        self._undo.append(_Unwrap(obj, name))

    def _note_batch(self, sched_out) -> None:
        self._cur["batch"] = len(sched_out.scheduled)
        self._cur["decode_only"] = all(s.num_new_tokens == 1 for s in sched_out.scheduled)

    def _record(self, _outputs) -> None:
        c, self._cur = self._cur, {}
        if "execute" not in c:
            return  # nothing was scheduled
        g = c.get
        forward = g("model", 0.0) + g("logits", 0.0) + g("sampler", 0.0)
        self.steps.append({"batch": c["batch"], "decode_only": c["decode_only"], "schedule": c["schedule"],
                           "prepare": c["execute"] - g("model", 0.0) - g("logits", 0.0) - g("sample", 0.0),
                           "forward": forward, "sample": g("sample", 0.0) - g("sampler", 0.0),
                           "output": c["step"] - c["schedule"] - c["execute"], "total": c["step"]})


class _Unwrap:
    def __init__(self, obj, name: str):
        self.obj, self.name = obj, name

    def remove(self) -> None:
        self.obj.__dict__.pop(self.name, None)


def workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi)) for _ in range(n)]


def run_once(llm: LLM, reqs, detokenize: bool, profile: cProfile.Profile | None = None) -> dict:
    # every run starts from an empty prefix cache: repeats would otherwise hit earlier runs' prompts
    assert llm.llm_engine.kv_manager.pool.reset_prefix_cache()
    timer = StepTimer(llm.llm_engine)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=detokenize) for _, o in reqs]
    cpu, wall = CLOCK(), time.perf_counter()
    if profile is not None:
        profile.enable()
    outs = llm.generate(prompts, params)
    if profile is not None:
        profile.disable()
    cpu, wall = CLOCK() - cpu, time.perf_counter() - wall
    timer.remove()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(o for _, o in reqs)
    return {"steps": timer.steps, "cpu_s": cpu, "wall_s": wall, "tokens": tokens}


def summarize(steps: list[dict]) -> dict:
    n = max(len(steps), 1)
    row = {k: 1e3 * sum(s[k] for s in steps) / n for k in (*PHASES, "total")}
    row["host"] = row["total"] - row["forward"]
    row["steps"] = len(steps)
    row["batch"] = sum(s["batch"] for s in steps) / n
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs; the table takes the fastest")
    ap.add_argument("--no-detokenize", action="store_true", help="SamplingParams(detokenize=False)")
    ap.add_argument("--profile", default=None, help="one more run under cProfile, its stats written here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    reqs = workload(args.requests, args.min_len, args.max_len, CONFIG["vocab_size"])
    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(CONFIG))
        llm = LLM(d, load_format="dummy", dtype="float32", max_model_len=1024, max_num_seqs=args.requests,
                  max_num_batched_tokens=16384, kv_cache_memory=0.25)
        llm.generate([{"prompt_token_ids": p} for p, _ in reqs[:8]],
                     SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
        gc.collect()
        gc.freeze()  # what exists now (torch, the model) is never scanned again: steadier numbers
        runs = [run_once(llm, reqs, not args.no_detokenize) for _ in range(args.repeats)]
        if args.profile:
            prof = cProfile.Profile()
            run_once(llm, reqs, not args.no_detokenize, prof)
            prof.dump_stats(args.profile)
    best = min(runs, key=lambda r: r["cpu_s"])
    steps = best["steps"]
    rows = {"decode, batch >= 240": summarize([s for s in steps if s["decode_only"] and s["batch"] >= 240]),
            "all steps": summarize(steps)}
    steps_per_s = len(steps) / best["cpu_s"]
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu_s": best["cpu_s"], "wall_s": best["wall_s"],
                                               "tokens": best["tokens"], "steps_per_s": steps_per_s,
                                               "rows": rows}, indent=2))
    print(f"{args.requests} requests, lengths {args.min_len}..{args.max_len}, detokenize={not args.no_detokenize}: "
          f"{best['tokens']} output tokens in {best['cpu_s']:.2f} s of CPU time (wall {best['wall_s']:.2f} s), "
          f"{len(steps)} steps, {steps_per_s:.1f} steps/s, {best['tokens'] / best['cpu_s']:.0f} tok/s")
    print("\n| ms per step | steps | batch | " + " | ".join(PHASES) + " | host | total |")
    print("| --- |" + " ---: |" * (len(PHASES) + 4))
    for name, r in rows.items():
        cells = " | ".join(f"{r[k]:.2f}" for k in (*PHASES, "host", "total"))
        print(f"| {name} | {r['steps']} | {r['batch']:.0f} | {cells} |")


if __name__ == "__main__":
    main()
