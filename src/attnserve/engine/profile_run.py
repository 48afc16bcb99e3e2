"""The profiling pass: the engine's largest step run once on dummy tokens before the KV cache
is sized, to measure the activation memory it needs and to compile the kernels it launches.

``profile_step`` builds a small temporary block pool (enough for the dummy requests), binds its
caches to the layers, and runs two steps through the real scheduler and runner without CUDA
graphs: a prefill of ``max_num_batched_tokens`` tokens spread over up to ``max_num_seqs``
requests (the output head and a top-k/top-p sampler over every request's logits included), then
one decode step of the same requests. On CUDA it returns the peak bytes allocated above what was
allocated before it started (weights and the temporary caches), so that
``determine_num_blocks`` can leave room for them; the temporary caches are freed and the layers
rebound by the real allocation afterwards. Before this pass a first long prefill met mid-run
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

__all__ = ["dummy_lengths", "profile_step", "warm_up_lengths"]

logger = logging.getLogger(__name__)

_WARM_UP_DEVICES = ("cuda",)  # where kernels compile on first use (tests add "cpu")


def dummy_lengths(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the dummy requests: the step's whole token budget over as many requests
    as may run, each short enough to take one more (decode) token within ``max_model_len``."""
    longest = max(1, max_model_len - 1)
    tokens = min(max_num_batched_tokens, max_num_seqs * longest)
    n = min(max_num_seqs, tokens)
    n = max(n, math.ceil(tokens / longest))
    base, extra = divmod(tokens, n)
    return [base + (i < extra) for i in range(n)]


def warm_up_lengths(longest_query: int, covered: int, cap: int = 256) -> list[int]:
    """Query lengths of the warm-up steps: each power of two from 2 up to ``longest_query`` (the
    longest a step may have) and ``cap``, but ``covered`` (the profiling step's longest)."""
    top = min(longest_query, cap)
    return [n for n in (1 << k for k in range(1, top.bit_length())) if n != covered]


def profile_step(model: nn.Module, arch: ModelArch, layout: KVCacheLayout, state_groups: list[KVCacheGroup],
                 backends: list, config: EngineConfig, device: torch.device, max_model_len: int) -> int | None:
    """Run the dummy prefill and decode steps; peak activation bytes on CUDA, None elsewhere."""
    groups = list(layout.groups)
    sched = config.scheduler
    lengths = dummy_lengths(sched.max_num_batched_tokens, sched.max_num_seqs, max_model_len)
    block_size = config.cache.block_size
    num_blocks = 1 + len(groups) * sum(-(-(n + 1) // block_size) for n in lengths)
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
    # sampling that allocates the most: temperature with top-k and top-p over every row's logits
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, max_tokens=2, ignore_eos=True)
    vocab = arch.vocab_size
    for i, n in enumerate(lengths):
        ids = [(i * 7919 + j * 104729) % vocab for j in range(n)]
        scheduler.add_request(Request(f"profile-{i}", ids, params, block_size=block_size))
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    steps = 0
    while scheduler.num_unfinished and steps < 2 + len(lengths):  # a hybrid prefill may take chunks
        out = scheduler.schedule()
        if out.is_empty:
            break
        scheduler.update(out, runner.execute(out).sampled)
        steps += 1
    peak = None
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    warm = warm_up_lengths(min(sched.max_num_batched_tokens, max_model_len - 1), max(lengths)) if device.type in _WARM_UP_DEVICES else []
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i, n in enumerate(warm):  # one new request a step: its prefill is the step's longest query
        scheduler.add_request(Request(f"warm-up-{i}", [(i * 31 + j * 7) % vocab for j in range(n)], greedy,
                                      block_size=block_size))
        out = scheduler.schedule()
        if not out.is_empty:
            scheduler.update(out, runner.execute(out).sampled)
    del runner, scheduler, kv, caches, state_caches
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    logger.info("profiling pass: %d steps over %d dummy requests (%d tokens)%s%s", steps, len(lengths),
                sum(lengths), f", peak activations {peak / 1024**2:.0f} MiB" if peak is not None else "",
                f"; warm-up prefills of {warm} tokens" if warm else "")
    return peak
