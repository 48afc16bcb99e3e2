"""The profiling pass: the engine's largest step run once on dummy tokens before the KV cache
is sized, to measure the activation memory it needs and to compile the kernels it launches.

``profile_step`` builds a small temporary block pool (enough for the dummy requests), binds its
caches to the layers, and runs the steps that allocate the most through the real scheduler and
runner without CUDA graphs:

- a prefill of ``max_num_batched_tokens`` tokens spread over up to ``max_num_seqs`` requests
  (the MoE's largest routing workspace; the output head and a top-k/top-p sampler with the most
  logprobs a request may ask, over every request's logits), then one decode step of them;
- on CUDA, the long step (``long_step_lengths``): one request's largest chunk, after the
  longest context it may follow (``max_model_len``), with prompt logprobs. Its context is
  counted as computed, not run (``Scheduler.schedule_after_context``): what grows with the
  context (an MLA prefill's expanded chunks, the indexer's logits, gathered K/V) is reached
  without the time of a whole long prompt.

On CUDA it returns the largest step's peak bytes allocated above what was allocated before it
started (weights and the temporary caches), plus the largest decode step's when CUDA graphs
will keep one in their pool, so that ``determine_num_blocks`` can leave room for them;
the temporary caches are freed and the layers rebound by the real allocation afterwards. Before this pass a first long prefill met mid-run
compiled its Triton kernels inside a user's step (seconds on the H200). On CUDA it then runs one
small prefill step for each power-of-two query length up to 256 tokens (``warm_up_lengths``):
kernels pick their tiles by the step's longest query (``pick_config``), so a server whose
prompts arrive one by one met those variants mid-run, each compile a step of ~0.65 s on the H200.

What this is not: the KV sizing itself (``runner/cache_allocation.py``), nor CUDA-graph capture
(``runner/cuda_graph.py``, after the real allocation).
"""

from __future__ import annotations

import gc
import logging
import math
from dataclasses import replace
from functools import partial

import torch
from torch import nn

from attnserve.arch import ModelArch
from attnserve.config import EngineConfig
from attnserve.core.request import Request
from attnserve.engine.scheduler import Scheduler
from attnserve.kvcache.groups import KVCacheGroup, KVCacheLayout
from attnserve.kvcache.manager import KVCacheManager
from attnserve.kvcache.state import StatePool
from attnserve.runner.cache_allocation import allocate_kv_cache, allocate_state_cache
from attnserve.runner.model_runner import ModelRunner
from attnserve.sampling_params import SamplingParams

__all__ = ["dummy_lengths", "long_step_lengths", "profile_step", "warm_up_lengths"]

logger = logging.getLogger(__name__)

_WARM_UP_DEVICES = ("cuda",)  # where kernels compile on first use (tests add "cpu")
_LONG_STEP_DEVICES = ("cuda",)  # where the long step's peak is measured (tests add "cpu")
# the long step's temporary pool may take this share of the free device memory; past it the
# context is shortened (and the log says so)
_LONG_POOL_SHARE = 0.25


def dummy_lengths(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the dummy requests: the step's whole token budget over as many requests
    as may run, each short enough to take one more (decode) token within ``max_model_len``."""
    longest = max(1, max_model_len - 1)
    tokens = min(max_num_batched_tokens, max_num_seqs * longest)
    n = min(max_num_seqs, tokens)
    n = max(n, math.ceil(tokens / longest))
    base, extra = divmod(tokens, n)
    return [base + (i < extra) for i in range(n)]


def long_step_lengths(max_num_batched_tokens: int, max_model_len: int) -> tuple[int, int]:
    """(context, new tokens) of the long step: the largest chunk one request may run, after
    the longest context that leaves it a token to generate within ``max_model_len``."""
    new = max(1, min(max_num_batched_tokens, max_model_len - 1))
    return max(0, max_model_len - 1 - new), new


def warm_up_lengths(longest_query: int, covered: int, cap: int = 256) -> list[int]:
    """Query lengths of the warm-up steps: each power of two from 2 up to ``longest_query`` (the
    longest a step may have) and ``cap``, but ``covered`` (the profiling step's longest)."""
    top = min(longest_query, cap)
    return [n for n in (1 << k for k in range(1, top.bit_length())) if n != covered]


def profile_step(model: nn.Module, arch: ModelArch, layout: KVCacheLayout, state_groups: list[KVCacheGroup],
                 backends: list, config: EngineConfig, device: torch.device, max_model_len: int, *,
                 graph_pool: bool = False) -> int | None:
    """Run the dummy prefill and decode steps; peak activation bytes on CUDA, None elsewhere.

    ``graph_pool``: CUDA graphs will be captured after the KV cache; their pool keeps a decode
    step's activations for good, besides what an eager step then needs, so the largest decode
    step's peak is added."""
    groups = list(layout.groups)
    sched = config.scheduler
    lengths = dummy_lengths(sched.max_num_batched_tokens, sched.max_num_seqs, max_model_len)
    block_size = config.cache.block_size
    num_blocks = 1 + len(groups) * sum(-(-(n + 1) // block_size) for n in lengths)
    long_step = None
    if device.type in _LONG_STEP_DEVICES:
        context, new = long_step_lengths(sched.max_num_batched_tokens, max_model_len)
        context = _fit_context(layout, device, context, new, block_size)
        long_step = context, new
        num_blocks = max(num_blocks, _pool_blocks(len(groups), context + new, block_size))
    state_pool = StatePool(len(lengths), 0) if state_groups else None
    kv = KVCacheManager(groups, num_blocks, enable_caching=False, state_pool=state_pool)
    state_layers = frozenset(e.layer for g in state_groups for e in g.entries)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    caches = allocate_kv_cache(model, layout, num_blocks, device, backends, state_layers)
    state_caches = allocate_state_cache(model, state_groups, state_pool.num_slots, device, backends) \
        if state_pool is not None else []
    runner = ModelRunner(model, arch, groups, backends, device, max_model_len=max_model_len,
                         max_num_seqs=len(lengths), cuda_graphs=False, state_caches=state_caches)
    scheduler = Scheduler(replace(sched, max_num_seqs=len(lengths), max_num_batched_tokens=sum(lengths)),
                          kv, max_model_len)
    # sampling that allocates the most: temperature with top-k and top-p over every row's logits,
    # and the most logprobs a request may ask
    max_logprobs = config.model.max_logprobs if config.model.max_logprobs >= 0 else 20
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, max_tokens=2, ignore_eos=True,
                            logprobs=max_logprobs or None)
    vocab = arch.vocab_size
    for i, n in enumerate(lengths):
        ids = [(i * 7919 + j * 104729) % vocab for j in range(n)]
        scheduler.add_request(Request(f"profile-{i}", ids, params, block_size=block_size))
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    steps = 0
    peaks = {"step": 0, "decode": 0}
    run = partial(_run_step, scheduler, runner, device, base if cuda else 0, peaks)
    while scheduler.num_unfinished and steps < 2 + len(lengths):  # a hybrid prefill may take chunks
        out = scheduler.schedule()
        if out.is_empty:
            break
        run(out)
        steps += 1
    if long_step is not None:
        context, new = long_step
        long_params = replace(params, prompt_logprobs=max_logprobs or None)
        req = Request("profile-long", [(j * 104729) % vocab for j in range(context + new)], long_params,
                      block_size=block_size)
        scheduler.add_request(req)
        out = scheduler.schedule_after_context(req, context)
        while True:  # its chunk, then a decode step (or more chunks, when a hybrid aligns them)
            run(out)
            steps += 1
            if not scheduler.num_unfinished or steps > 8 + len(lengths):
                break
            out = scheduler.schedule()
            if out.is_empty:
                break
    peak = None
    if cuda:
        peak = peaks["step"] + (peaks["decode"] if graph_pool else 0)
    warm = warm_up_lengths(min(sched.max_num_batched_tokens, max_model_len - 1), max(lengths)) if device.type in _WARM_UP_DEVICES else []
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i, n in enumerate(warm):  # one new request a step: its prefill is the step's longest query
        scheduler.add_request(Request(f"warm-up-{i}", [(i * 31 + j * 7) % vocab for j in range(n)], greedy,
                                      block_size=block_size))
        out = scheduler.schedule()
        if not out.is_empty:
            scheduler.update(out, runner.execute(out).sampled)
    del run, runner, scheduler, kv, caches, state_caches
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    long_note = "" if long_step is None else f"; a chunk of {long_step[1]} tokens after {long_step[0]} of context"
    peak_note = "" if peak is None else f", peak activations {peaks['step'] / 1024**2:.0f} MiB" + (
        f" and {peaks['decode'] / 1024**2:.0f} MiB for the CUDA graphs' pool" if graph_pool else "")
    logger.info("profiling pass: %d steps over %d dummy requests (%d tokens)%s%s%s", steps, len(lengths),
                sum(lengths), long_note, peak_note,
                f"; warm-up prefills of {warm} tokens" if warm else "")
    return peak


def _run_step(scheduler: Scheduler, runner: ModelRunner, device: torch.device, base: int, peaks: dict,
              out) -> None:
    """Run one scheduled step; on CUDA fold its peak above ``base`` into ``peaks`` ("step", and
    "decode" for a step of decodes only)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    scheduler.update(out, runner.execute(out).sampled)
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        peaks["step"] = max(peaks["step"], peak)
        if all(s.num_new_tokens == 1 for s in out.scheduled):
            peaks["decode"] = max(peaks["decode"], peak)


def _pool_blocks(num_groups: int, num_tokens: int, block_size: int) -> int:
    """Blocks of a temporary pool that holds one more token after ``num_tokens`` in every group
    (windows not applied: a step allocates before it frees what slid out), the null block included."""
    return 1 + num_groups * -(-(num_tokens + 1) // block_size)


def _fit_context(layout: KVCacheLayout, device: torch.device, context: int, new: int, block_size: int) -> int:
    """``context`` shortened so the long step's temporary pool takes at most ``_LONG_POOL_SHARE``
    of the free device memory (CUDA; elsewhere unchanged)."""
    if device.type != "cuda":
        return context
    budget = torch.cuda.mem_get_info(device)[0] * _LONG_POOL_SHARE
    fitted = context
    while fitted > 0 and _pool_blocks(len(layout.groups), fitted + new, block_size) * layout.bytes_per_block > budget:
        fitted //= 2
    if fitted < context:
        logger.warning("profiling pass: the long step follows a context of %d tokens, not %d: a temporary pool "
                       "for the whole context would take more than %.0f%% of the free memory", fitted, context,
                       100 * _LONG_POOL_SHARE)
    return fitted
