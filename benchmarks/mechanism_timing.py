"""The running half of ``gpu_mechanisms.py``: one engine per (case, context), its KV cache
checked against the memory left before and after it is built, the prefill cell and a decode
cell per batch timed through the engine, each cell recorded as it completes.

Not here: the cases and their configs (``mechanism_cases.py``), the floors and FLOP counts
(``step_floors.py``), the tables and JSON (``mechanism_report.py``), the command line and the
grid loop (``gpu_mechanisms.py``).
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from ceilings import NOMINAL_BW, NOMINAL_FLOPS
from mechanism_cases import Case
from step_floors import (
    attention_flops_per_token,
    cache_rows,
    check_rows,
    decode_cache_bytes,
    decode_flops,
    decode_state_bytes,
    decode_weight_bytes,
    param_bytes,
    prefill_flops,
    prefill_params,
    state_rows,
)

from attnserve import LLM, SamplingParams
from attnserve.arch import ModelArch, load_hf_config, read_arch
from attnserve.attention.registry import BackendSelectionError
from attnserve.config import EngineConfig
from attnserve.engine.plan import plan_engine
from attnserve.models.registry import get_model_class
from attnserve.platforms import current_platform

GIB = 1024**3


# --- memory checks ------------------------------------------------------------------------


def meta_weight_bytes(arch: ModelArch, dtype: str) -> int:
    """The model's parameter bytes, built on the meta device (nothing allocated)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device("meta"):
            model = get_model_class(arch)(arch)
    finally:
        torch.set_default_dtype(previous)
    return param_bytes(model.parameters())


def kv_precheck(path: str, kwargs: dict, batches: list[int], room: int = 1) -> tuple[list[int], dict[int, str]]:
    """Before building: the batches whose KV cache fits in the memory left (device: its
    utilisation share less what is in use less the weights; CPU: ``kv_cache_memory``), and a
    reason for each that does not. A hybrid's state slots count too: for batch b the engine
    keeps ``room * b`` snapshots, so 1 + b + room * b slots (running and snapshots). The
    profiling pass's activations are not known yet: the engine's real block count is checked
    after building."""
    config = EngineConfig.from_kwargs(path, **kwargs)
    arch = read_arch(load_hf_config(path))
    plan = plan_engine(arch, config, current_platform())
    state = plan.state_bytes_per_sequence
    per_seq = plan.sequence_bytes(plan.max_model_len) + room * state
    if config.cache.kv_cache_memory is not None:
        budget, what = config.cache.kv_cache_memory * GIB, "kv_cache_memory"
    elif torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        try:
            weights = meta_weight_bytes(arch, plan.dtype)
        except Exception:  # a model that cannot be built on the meta device: the post-check decides
            weights = 0
        budget = total * config.cache.gpu_memory_utilization - (total - free) - weights
        what = (f"{config.cache.gpu_memory_utilization} of {total / GIB:.0f} GiB, less {(total - free) / GIB:.1f} "
                f"in use and {weights / GIB:.1f} of weights")
    else:
        return list(batches), {}
    fit = [b for b in batches if b * per_seq + state <= budget]
    reasons = {b: f"KV cache of {b} x {plan.max_model_len} tokens needs {(b * per_seq + state) / GIB:.2f} GiB; "
                  f"{max(budget, 0) / GIB:.2f} GiB left ({what})" for b in batches if b not in fit}
    return fit, reasons


def kv_postcheck(llm: LLM, batches: list[int]) -> tuple[list[int], dict[int, str]]:
    """After building: the batches whose sequences all fit in the engine's block pool at once."""
    engine = llm.llm_engine
    per_seq = engine.kv_manager.num_blocks_for_tokens(engine.max_model_len)
    capacity = engine.parts.num_blocks - 1  # block 0 is the null block
    fit = [b for b in batches if b * per_seq <= capacity]
    reasons = {b: f"{b} sequences need {b * per_seq} blocks of {engine.config.cache.block_size} tokens; the "
                  f"engine has {capacity}" for b in batches if b not in fit}
    return fit, reasons


# --- running ------------------------------------------------------------------------------


def snapshot_room(case: Case, context: int, args) -> int:
    """State snapshots the engine keeps per sequence of a batch (``num_state_snapshots``), enough
    that a hybrid's snapshots outlive the grid (least recently used are evicted). It takes one wherever a step leaves a request on a block
    boundary: at each prefill chunk's end (about ceil(context / max_num_batched_tokens) + 2 a
    prompt, the last boundary and the end included) and every block_size decoded tokens (a
    decode cell's run decodes N - 4). Sized as the batch, the snapshots of the prefill cell
    were evicted before the decode cells came back to them, which then prefilled their prompts
    again (64 x 32K tokens at batch 64, in every repeat). Each costs state memory only
    (Qwen3-Next's cut: 6 MiB a slot)."""
    if not case.state:
        return 1
    block = args.block_size or 16
    return math.ceil(context / args.max_num_batched_tokens) + 3 + math.ceil(args.new / block)


def engine_kwargs(args, case: Case, context: int, max_batch: int, state_backend: str = "triton") -> dict:
    """``LLM(...)`` keywords of one (case, context) engine."""
    kwargs = dict(load_format="dummy", dtype="float32" if args.smoke else "bfloat16",
                  attention_backend=case.backend_name(state_backend), max_model_len=context + args.new + 16,
                  max_num_seqs=max_batch,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype)
    if args.smoke:
        kwargs["kv_cache_memory"] = 0.05
    else:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    return kwargs


def random_prompts(vocab: int, count: int, length: int, seed: int) -> list[dict]:
    """``count`` prompts of ``length`` random token ids (distinct: no two share a block)."""
    ids = np.random.default_rng(seed).integers(0, vocab, size=(count, length))
    return [{"prompt_token_ids": row} for row in ids.tolist()]


def timed(llm: LLM, prompts: list, tokens: int) -> float:
    """Seconds for ``llm.generate`` of ``tokens`` greedy tokens each (EOS ignored, no detokenising)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t


def budget_reason(budget_s: float) -> str:
    """The reason of a cell that ``--budget-s`` kept from starting."""
    return f"not started: the run's time budget (--budget-s {budget_s:g}) was spent"


class Recorder:
    """Collects cells and prints each as a JSON line when it completes; rewrites ``json_path``
    (when given) after every cell, so a command stopped by its time limit leaves what it
    measured. ``budget_s``: decides only whether a (case, context) group starts (``may_start``);
    a group that started runs all its cells."""

    def __init__(self, json_path: Path | None = None, header: dict | None = None, budget_s: float | None = None):
        self.cells: list[dict] = []
        self.json_path, self.header, self.budget_s = json_path, header or {}, budget_s
        self.started = time.perf_counter()
        self.engines_started = 0

    def emit(self, cell: dict) -> None:
        self.cells.append(cell)
        print(json.dumps(cell), flush=True)
        if self.json_path is not None:
            self.json_path.write_text(json.dumps({**self.header, "partial": True, "cells": self.cells}, indent=2))

    def may_start(self) -> bool:
        """Whether a new (case, context) group may start: no budget, no engine started yet (a
        run always measures its first engine), or fewer than ``budget_s`` seconds spent."""
        return (self.budget_s is None or self.engines_started == 0
                or time.perf_counter() - self.started <= self.budget_s)

    def not_run(self, base: dict, batches: list[int], status: str, reasons: dict[int, str] | str,
                prefill: bool = False) -> None:
        """Skipped or failed decode cells (and the prefill cell when ``prefill``)."""
        why = (lambda b: reasons) if isinstance(reasons, str) else reasons.get
        key = "reason" if status == "skipped" else "error"
        if prefill and batches:
            self.emit({**base, "cell": "prefill", "batch": max(batches), "status": status, key: why(max(batches))})
        for b in batches:
            self.emit({**base, "cell": "decode", "batch": b, "status": status, key: why(b)})


def measure_prefill(llm: LLM, prompts: list, context: int, warm_up: bool, base: dict) -> dict:
    """Warm up on an unrelated prompt (``warm_up``), then prefill ``prompts`` once
    (max_tokens=1), which also fills the prefix cache; the prefill cell."""
    engine = llm.llm_engine
    if warm_up:  # Triton compiles outside the timed prefill (two prompts: a batch of one is a variant of its own)
        timed(llm, random_prompts(engine.arch.vocab_size, 2, min(context, 1024), seed=1), 2)
    seconds = timed(llm, prompts, 1)
    batch = len(prompts)
    flops = prefill_flops(engine.runner.model, engine.arch, batch, context)
    per_token, head = prefill_params(engine.runner.model, engine.arch)
    return {**base, "cell": "prefill", "batch": batch, "status": "ok", "seconds": seconds,
            "tok_s": batch * context / seconds, "flops": flops, "tflops": flops / seconds / 1e12,
            "fraction_of_peak": flops / seconds / NOMINAL_FLOPS, "params_per_token": per_token, "head_params": head,
            "attention_flops_per_token": attention_flops_per_token(engine.arch, context)}


def decode_steps_ms(llm: LLM, prompts: list, steps: int, warm: int = 4) -> tuple[float, float]:
    """Mean ms of ``steps`` decode-only engine steps of ``prompts``, timed once every request
    has its first token (so no prefill, not even the recomputed last block of a prefix hit,
    falls in the timed span), after ``warm`` more steps; the requests are then aborted. Also
    the share of the prompts' tokens the prefix cache served.

    (Timing ``generate`` with N tokens and with 1 and subtracting leaves the prefill's
    variance in the difference: 64 prefix hits of 8K-32K tokens vary by 0.1-0.3 s, which is
    1.5-5 ms a step over 63 steps, as much as the step itself.)"""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + warm + 8, ignore_eos=True, detokenize=False)
    ids = [engine.add_request(None, p, params) for p in prompts]
    requests = [engine.scheduler.requests[i] for i in ids]
    for _ in range(100_000):  # bounded: a stuck prefill fails the cell instead of hanging
        if all(r.num_output_tokens > 0 for r in requests):
            break
        engine.step()
    else:
        raise RuntimeError("the prompts never finished their prefill")
    cached = sum(max(r.num_cached_tokens, 0) for r in requests) / sum(r.num_prompt_tokens for r in requests)
    for _ in range(warm):
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    if any(r.num_output_tokens < steps + warm for r in requests):
        raise RuntimeError("a request did not decode in every timed step (preempted or finished)")
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * seconds / steps, cached


def measure_decode(llm: LLM, prompts: list, batch: int, context: int, args, rows: dict, base: dict,
                   states: dict | None = None) -> dict:
    """Decode ms per step of the first ``batch`` prompts (prefix hits) and its HBM floor."""
    engine = llm.llm_engine
    steps = max(1, args.new - 16)
    runs = [decode_steps_ms(llm, prompts[:batch], steps) for _ in range(args.repeats)]
    ms = statistics.median(r[0] for r in runs)
    weights = decode_weight_bytes(engine.runner.model, engine.arch, batch)
    cache = decode_cache_bytes(engine.arch, rows, batch, context, states)
    floor_ms = 1e3 * (weights + cache) / NOMINAL_BW
    flops = decode_flops(engine.runner.model, engine.arch, batch, context)
    flop_ms = 1e3 * flops / NOMINAL_FLOPS
    bound = max(floor_ms, flop_ms)
    return {**base, "cell": "decode", "batch": batch, "status": "ok", "decode_ms": ms, "floor_ms": floor_ms,
            "floor_fraction": floor_ms / ms if ms > 0 else None, "flop_floor_ms": flop_ms, "decode_flops": flops,
            "bound_fraction": bound / ms if ms > 0 else None, "weight_bytes": weights, "cache_bytes": cache,
            "state_bytes": decode_state_bytes(states or {}, batch), "prefix_hit_fraction": min(r[1] for r in runs),
            "timed_steps": steps, "graphs": engine.runner.graphs is not None,
            "async_scheduling": engine.async_scheduling}


def measure_engine(llm: LLM, context: int, batches: list[int], args, rec: Recorder, base: dict) -> None:
    """The prefill cell and a decode cell per batch of one engine (the batches whose sequences
    fit its block pool; the others are recorded as skipped)."""
    engine = llm.llm_engine
    base.update(mechanism_arch=engine.arch.mechanism.value, kv_cache_dtype=engine.parts.plan.kv_cache_dtype,
                block_size=engine.config.cache.block_size)
    if base.get("state_backend"):  # what every layer group ran: the state backend first
        base["backend"] = " + ".join(dict.fromkeys([base["backend"], *engine.parts.backend_names]))
    todo, reasons = kv_postcheck(llm, batches)
    rec.not_run(base, [b for b in batches if b not in todo], "skipped", reasons)
    if not todo:
        return
    rows, states = cache_rows(engine.runner.model), state_rows(engine.runner.model)
    check_rows(rows, engine.parts.plan, states)
    base["cache_row_bytes"] = rows[min(rows)]
    if states:
        base["state_slot_bytes"] = states[min(states)]
    prompts = random_prompts(engine.arch.vocab_size, max(todo), context, seed=context)
    rec.emit(measure_prefill(llm, prompts, context, not args.smoke, base))  # nothing compiles in smoke
    for b in todo:  # no budget check: the prefill they reuse is paid for
        rec.emit(measure_decode(llm, prompts, b, context, args, rows, base, states))


def not_fitting(error: Exception) -> bool:
    """Whether building an engine failed because the configuration does not fit this device
    (out of memory, the engine's KV cache checks, no backend for it) rather than by a bug."""
    if isinstance(error, (torch.cuda.OutOfMemoryError, BackendSelectionError)):
        return True
    return isinstance(error, ValueError) and "KV cache" in str(error)


def run_context(case: Case, path: str, context: int, batches: list[int], args, rec: Recorder,
                state_backend: str = "triton") -> None:
    """One engine for ``case`` at ``context``: the prefill cell and a decode cell per batch."""
    base = {"case": case.name, "mechanism": case.mechanism, "backend": case.backend_name(state_backend),
            "context": context}
    if case.state:
        base["state_backend"] = case.backend_name(state_backend)
    if case.cut_experts:  # --experts: a cut of another width is another measurement
        base["routed_experts"] = args.experts
    if not rec.may_start():
        rec.not_run(base, batches, "skipped", budget_reason(rec.budget_s), prefill=True)
        return
    kwargs = engine_kwargs(args, case, context, max(batches), state_backend)
    room = snapshot_room(case, context, args)
    try:
        fit, reasons = kv_precheck(path, kwargs, batches, room)
    except ValueError as e:  # a plan the engine would refuse (e.g. fp8 rows this rank cannot tile)
        rec.not_run(base, batches, "skipped", f"{type(e).__name__}: {e}", prefill=True)
        return
    rec.not_run(base, [b for b in batches if b not in fit], "skipped", reasons)
    if not fit:
        return
    kwargs["max_num_seqs"] = max(fit)
    if case.state:
        kwargs["num_state_snapshots"] = max(fit) * room
    started = time.perf_counter()
    try:
        rec.engines_started += 1  # counted before the build: a failed build used up the grace too
        llm = LLM(path, **kwargs)
    except Exception as e:
        unfit = not_fitting(e)
        if not unfit:
            traceback.print_exc()
        rec.not_run(base, fit, "skipped" if unfit else "failed", f"{type(e).__name__}: {e}", prefill=True)
        return
    base["build_s"] = round(time.perf_counter() - started, 1)
    try:
        measure_engine(llm, context, fit, args, rec, base)
    except Exception as e:  # the engine may be left mid-request: the rest of this context is not run
        traceback.print_exc()
        done = {(c["cell"], c["batch"]) for c in rec.cells
                if (c["case"], c["context"], c.get("state_backend")) == (case.name, context, base.get("state_backend"))}
        rec.not_run(base, [b for b in fit if ("decode", b) not in done], "failed", f"{type(e).__name__}: {e}",
                    prefill=not any(kind == "prefill" for kind, _ in done))
    finally:  # nothing else holds the engine: its memory goes back before the next one is sized
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
