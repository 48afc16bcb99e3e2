"""A serving engine's warm-up: dummy requests through the real engine before the first request.

PyTorch pays on the first call of each shape and path (allocator growth, oneDNN and MKL kernels
made for a new matrix shape, first-use imports), and a server's first requests paid it: a
prefill of a length not seen, a decode at a batch size not seen, a sampler path (top-k/top-p,
a seeded draw, penalties, logprobs, a grammar's bitmask) not taken yet, the detokenizer and
stop strings. ``warm_up(engine)`` runs those steps once, through ``LLMEngine.add_request`` and
``LLMEngine.step`` as requests run:

- one prefill step each of 1 to 16 tokens and of 32, 64, 128 and 256 (what the step budget and
  ``max_model_len`` allow): on a CPU oneDNN makes its kernels per matrix shape, a few hundred
  microseconds per linear layer and new token count in bfloat16;
- up to 16 requests together, one for each sampling path, their ``max_tokens`` staggered so the
  decode steps run every batch size from 16 down to 1 (the last ones greedy-only);
- each sampling path alone (a batch of one, two tokens).

A prompt of a length outside that list still pays its shape's first call once (milliseconds on
a small model); so does a decode batch larger than 16.

It leaves no trace: its requests are not cacheable (``Request.cacheable = False``, as a
length-dependent RoPE's are), so they read and write no prefix cache, state snapshot or offload
tier; every count the engine keeps for metrics (its number attributes, the scheduler's stats, the
runner's device wait) is put back as it was. The profiling pass (``profile_run.py``) is the
other warm-up: it runs the largest step, before the KV cache is sized.

The server's start-up runs it last before it answers ``/health`` (``api_server.build_app``'s
lifespan, through ``EngineClient.warm_up``: on the engine's thread, or in the engine process
stepping as its loop does): run earlier, before the frontend's own start-up, it left the
engine's caches cold again by the first request.
``LLM`` does not: a script that builds one pays a few first-call milliseconds in its first
``generate`` rather than a warm-up in every construction.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from attnserve.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from attnserve.engine.engine import LLMEngine

__all__ = ["WarmUpPlan", "warm_up", "warm_up_plan"]

logger = logging.getLogger(__name__)

_MAX_PREFILL = 256  # the longest warm-up prefill (the profiling pass ran the step budget's)
_EVERY_PREFILL = 16  # every prefill length up to this one (short prompts are common; CPU kernels are per shape)
_MAX_BATCH = 16  # the most requests decoding together
_PROMPT_LEN = 8  # the batch's prompts
_ID = "attnserve-warm-up"


@dataclass(frozen=True, slots=True)
class WarmUpPlan:
    """What ``warm_up`` runs: one prefill step of each of ``prefills`` tokens; then ``batch``
    decoding together (prompts of ``prompt_len`` tokens, ``max_tokens`` staggered so the batch
    shrinks by one request a step); then each of ``paths`` alone (batch 1, two tokens)."""

    prefills: list[int]
    prompt_len: int
    batch: list[SamplingParams]
    paths: list[SamplingParams]


def warm_up_plan(engine: LLMEngine) -> WarmUpPlan:
    """``engine``'s warm-up, within its step budget, ``max_model_len``, ``max_num_seqs`` and
    ``max_logprobs``."""
    sched, max_len = engine.config.scheduler, engine.max_model_len
    longest = min(_MAX_PREFILL, sched.max_num_batched_tokens, max_len - 1)
    prefills = sorted({n for n in range(1, min(_EVERY_PREFILL, longest) + 1)}
                      | {1 << k for k in range(max(longest, 0).bit_length())})
    prompt_len = max(1, min(_PROMPT_LEN, max_len // 2))
    tokens = max(1, min(2, max_len - prompt_len))
    size = max(1, min(_MAX_BATCH, sched.max_num_seqs, max_len - prompt_len - 1))
    k = min(2, engine.config.model.max_logprobs) if engine.config.model.max_logprobs >= 0 else 2
    logprobs = k or None
    vocab = engine.arch.vocab_size
    paths = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=0, logprobs=logprobs),
        SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                       logit_bias={1 % vocab: 1.0}, min_tokens=1),
        SamplingParams(temperature=0.0, logprobs=logprobs, prompt_logprobs=logprobs),
        SamplingParams(temperature=0.7, n=2),
        SamplingParams(temperature=0.0, allowed_token_ids=[i % vocab for i in range(3, 67)]),
        SamplingParams(temperature=1.0, top_p=0.95, stop=["\n\n"], bad_words=["xq"]),
        SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(json_object=True)),
    ]
    paths = [p if p.structured_outputs is not None else replace(p, ignore_eos=True) for p in paths]
    batch = []
    for i in range(size):  # max_tokens staggered: the batch shrinks by one each decode step
        p = paths[i] if i < len(paths) else paths[0]
        batch.append(replace(p, max_tokens=max(1, min(i + 2, max_len - prompt_len))))
    batch.reverse()  # the greedy plain one is the longest: the last decode steps are greedy-only
    return WarmUpPlan(prefills, prompt_len, batch, [replace(p, max_tokens=tokens) for p in paths])


def warm_up(engine: LLMEngine, deltas: bool = False) -> None:
    """Run ``warm_up_plan(engine)`` on ``engine`` (idle: no request of its own in flight) and put
    back every count it changed; a request the model refuses (no tokenizer for a text prompt,
    structured output without xgrammar) is left out. ``deltas``: step as an engine process does
    (``LLMEngine.step(deltas=True)``)."""
    if engine.has_unfinished_requests():
        raise RuntimeError("the warm-up runs on an idle engine")
    saved = _counts(engine)
    start = time.perf_counter()
    plan = warm_up_plan(engine)
    vocab = engine.arch.vocab_size
    steps = ran = 0

    def run(requests: list[tuple[str, Any, SamplingParams]]) -> None:
        nonlocal steps, ran
        s, r = _run(engine, requests, deltas)
        steps, ran = steps + s, ran + r

    def prompt(i: int, params: SamplingParams) -> Any:
        if (params.stop or params.bad_words) and engine.tokenizer is not None:
            return "Hello, this is a warm-up."  # the tokenizer, the detokenizer, stop strings
        return [(i * 13 + j * 5 + 3) % vocab for j in range(plan.prompt_len)]

    for i, n in enumerate(plan.prefills):  # one prefill step each
        run([(f"{_ID}-prefill-{i}", [(i * 31 + j * 7 + 3) % vocab for j in range(n)],
              SamplingParams(temperature=0.0, max_tokens=1))])
    run([(f"{_ID}-batch-{i}", prompt(i, p), p) for i, p in enumerate(plan.batch)])
    for i, p in enumerate(plan.paths):
        run([(f"{_ID}-alone-{i}", prompt(i, p), p)])
    _restore(engine, saved)
    logger.info("warm-up: %d requests in %d steps (prefills of 1..%d tokens, %d requests decoding together, "
                "each sampling path alone) in %.2f s", ran, steps, plan.prefills[-1] if plan.prefills else 0,
                len(plan.batch), time.perf_counter() - start)


def _run(engine: LLMEngine, requests: list[tuple[str, Any, SamplingParams]], deltas: bool) -> tuple[int, int]:
    """Add ``requests`` (uncacheable) and step until they finish; (steps taken, requests run)."""
    added = 0
    for request_id, prompt, params in requests:
        try:
            engine.add_request(request_id, prompt, params)
        except (ValueError, TypeError) as e:  # this model refuses it (PromptError, no xgrammar)
            logger.debug("warm-up: request %s left out: %s", request_id, e)
            continue
        for c in engine.states[request_id].completions:
            c.request.cacheable = False
        added += 1
    steps = 0
    limit = 4 * (_MAX_BATCH + _MAX_PREFILL)
    while engine.has_unfinished_requests() and steps < limit:
        engine.step(deltas=deltas)
        steps += 1
    if engine.has_unfinished_requests():  # a pool too small to run them: they go
        logger.warning("warm-up: requests still unfinished after %d steps, aborted", steps)
        engine.abort_request(list(engine.states))
    return steps, added


def _is_count(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) or (
        isinstance(value, list) and bool(value) and all(isinstance(x, (int, float)) for x in value))


def _counts(engine: LLMEngine) -> dict[str, Any]:
    """Every count the warm-up may change: the engine's number (and list-of-number) attributes,
    the scheduler's stats, the runner's device wait."""
    return {
        "engine": {k: copy.copy(v) for k, v in vars(engine).items() if _is_count(v)},
        "scheduler": copy.deepcopy(engine.scheduler.stats),
        "device_wait_seconds": engine.runner.device_wait_seconds,
    }


def _restore(engine: LLMEngine, saved: dict[str, Any]) -> None:
    for name, value in saved["engine"].items():
        setattr(engine, name, value)
    engine.scheduler.stats = saved["scheduler"]
    engine.runner.device_wait_seconds = saved["device_wait_seconds"]
