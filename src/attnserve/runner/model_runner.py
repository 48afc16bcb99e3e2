"""The model runner: one scheduled step in, sampled tokens (and logprobs) out.

It owns the model, the KV cache tensors and one attention backend per KV cache group. Each
step it lays the scheduled tokens out flat (decodes first), builds ``CommonAttentionMetadata``
once, lets every group's backend derive its own metadata, runs the model inside the forward
context, and samples from the logits of the rows that need a token.

``execute`` is ``launch`` then ``collect``: ``launch`` queues the step's device work and
returns at once; ``collect`` waits for it and reads the tokens back. Between the two the engine
may launch the next step (async scheduling): a decode whose input token was sampled by the
step before and is not yet on the host reads it from that step's device tensor.

``launch`` is ``launch_forward`` then ``sample``: the first queues the forward, the logits and
any prompt logprobs, the second the sampling (with structured output's bitmask, which the
engine fills on the host in between, while the device computes the forward) and the copies
back. A CUDA graph covers the model's forward only, so sampling is the same in both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from attnserve.arch import ModelArch
from attnserve.attention.backend import Backend
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.core.forward_context import ForwardContext, forward_context
from attnserve.core.step import GrammarBitmask, RunnerOutput, ScheduledRequest, SchedulerOutput
from attnserve.kvcache.groups import KVCacheGroup
from attnserve.kvcache.spec import CachePolicy
from attnserve.layers.rotary import RotaryEmbedding
from attnserve.layers.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    bad_words_bans,
    gather_logprobs,
)
from attnserve.platforms import to_device
from attnserve.runner.block_table import BlockTables
from attnserve.runner.cuda_graph import CudaGraphRunner
from attnserve.runner.offload_io import written_blocks

__all__ = ["ModelRunner", "StepBroadcast", "StepHandle"]

logger = logging.getLogger(__name__)


BitmaskFn = Callable[[SchedulerOutput], GrammarBitmask | None]


class StepBroadcast(Protocol):
    """Tensor parallelism, rank 0: sends each step's inputs to the other ranks
    (``runner/worker.StepBroadcaster``), which then run the same forward."""

    def broadcast_step(self, input_ids: torch.Tensor, ctx: ForwardContext,
                       state_copies: tuple[tuple[int, int], ...], logit_rows: list[list[int]]) -> None: ...

@dataclass(slots=True)
class StepHandle:
    """A launched step's results, on their way to the host: each tensor is copied into pinned
    memory as soon as it is computed, and ``event`` marks the last copy, so reading them back
    waits for this step alone, not for a step launched after it on the same stream."""

    sample_reqs: list = field(default_factory=list)
    logits: torch.Tensor | None = None  # [N, V] on the device: launched, waiting for ``sample``
    sampled_queued: bool = False  # ``sample`` ran: the copies back and ``event`` are queued
    sampled: torch.Tensor | None = None  # [N] int64, host
    logprobs: LogprobsTensors | None = None  # host
    prompt: list = field(default_factory=list)  # (request id, LogprobsTensors on the host) per prompt span
    event: torch.cuda.Event | None = None


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Start copying ``t`` to (pinned) host memory without waiting for it."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


# Elements of the [rows, vocab] float32 logprobs that prompt logprobs compute at a time (2^25:
# 128 MiB, 256 rows of a 129K vocabulary): the slice the profiling pass measures, whatever the chunk.
_PROMPT_LOGPROB_ELEMENTS = 1 << 25


def _cat_logprobs(parts: list[LogprobsTensors]) -> LogprobsTensors:
    """One request's prompt logprobs from its slices, in row order."""
    if len(parts) == 1:
        return parts[0]
    return LogprobsTensors(torch.cat([p.token_ids for p in parts]), torch.cat([p.logprobs for p in parts]),
                           torch.cat([p.ranks for p in parts]))


def _lp_to_host(lp: LogprobsTensors) -> LogprobsTensors:
    return LogprobsTensors(_to_host(lp.token_ids), _to_host(lp.logprobs), _to_host(lp.ranks))


class ModelRunner:
    def __init__(self, model: torch.nn.Module, arch: ModelArch, groups: list[KVCacheGroup],
                 backends: list[Backend], device: torch.device, *, max_model_len: int,
                 max_num_seqs: int, cuda_graphs: bool = False, state_caches: list | None = None,
                 offload=None, offload_io=None, broadcaster: StepBroadcast | None = None):
        self.model = model
        self.broadcaster = broadcaster  # tensor parallel (rank 0): each step's inputs go to the other ranks
        self.state_caches = state_caches or []
        self.offload, self.offload_io = offload, offload_io
        self.arch = arch
        self.groups = groups
        self.backends = backends
        self.device = device
        self.block_size = groups[0].block_size
        self.block_tables = BlockTables([g.policy is CachePolicy.FULL for g in groups], num_rows=max_num_seqs)
        self.sampler = Sampler()
        self.device_wait_seconds = 0.0  # time ``collect`` blocked on the device (the host ran ahead)
        for m in model.modules():  # RoPE tables sized once: no per-step host syncs
            if isinstance(m, RotaryEmbedding):
                m.reserve(max_model_len, device)
        # the last launched step's sampled ids on the device, and each request's row in them
        self._last_sampled: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        self._unsampled: StepHandle | None = None  # launched by launch_forward, not sampled yet
        self.graphs = None
        if cuda_graphs and device.type == "cuda":
            self._capture_graphs(backends, max_num_seqs, max_model_len)

    def _capture_graphs(self, backends, max_num_seqs: int, max_model_len: int) -> None:
        if CudaGraphRunner.supported(backends):
            self.graphs = CudaGraphRunner(self.model, backends, self.block_size, max_num_seqs, max_model_len,
                                          self.device, has_state=bool(self.state_caches),
                                          num_paged_groups=len(self.groups))
            self.graphs.capture()
        else:
            logger.info("CUDA graphs off: backends %s are not all graph-safe", sorted({b.name for b in backends}))

    # --- inputs -----------------------------------------------------------------------------
    def _prepare(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, ForwardContext]:
        """Flat token ids and the step's metadata; per-token arrays are built with numpy from
        each request's start and length, block tables from the persistent rows."""
        n = len(scheduled)
        starts = np.fromiter((s.start for s in scheduled), np.int64, n)
        query_lens = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, n)
        seq_lens = starts + query_lens
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        ids: list[int] = []
        inflight: list[tuple[int, int]] = []  # (flat position, row of the last step's samples)
        for s in scheduled:
            start, k, tokens = s.start, s.num_new_tokens, s.request.all_token_ids
            if k == 1:
                if start < len(tokens):
                    ids.append(tokens[start])
                else:  # sampled by the step still running: read it on the device
                    if self._unsampled is not None:  # its tokens are not in _last_sampled yet
                        raise RuntimeError("a step reads the tokens of a step that was launched but not sampled")
                    inflight.append((len(ids), self._inflight_row(s.request.request_id)))
                    ids.append(0)
            else:
                ids.extend(tokens[start:start + k])
        req_of_token = np.repeat(np.arange(n), query_lens)  # [T]
        positions = np.arange(len(ids)) - np.repeat(qsl[:-1] - starts, query_lens)  # [T] start + offset
        rows, widths = self.block_tables.update(scheduled)
        token_rows = rows[req_of_token]
        tables = self.block_tables
        block_tables = [self._to_device(tables.gather(g, rows, widths[g])) for g in range(len(self.groups))]
        slot_mappings = [self._to_device(tables.slots(g, token_rows, positions, self.block_size))
                         for g in range(len(self.groups))]
        num_decodes = _leading_true(query_lens == 1)
        common = CommonAttentionMetadata(
            query_start_loc=self._to_device(qsl.astype(np.int32)),
            seq_lens=self._to_device(seq_lens.astype(np.int32)), positions=self._to_device(positions), block_tables=block_tables, slot_mappings=slot_mappings,
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist(), num_decodes=num_decodes,
            max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()))
        if self.state_caches:
            slots = np.fromiter((s.state_slot for s in scheduled), np.int64, n)
            common.state_slots = self._to_device(slots)
            common.has_initial_state = self._to_device(starts > 0)
            common.num_state_decodes = _leading_true(starts[:num_decodes] > 0)
        # length-dependent RoPE (dynamic NTK, longrope) sees each request's whole known length,
        # as one forward over the full prompt would: chunking a prefill does not change it
        rope_lens = np.fromiter((s.request.num_tokens for s in scheduled), np.int64, n)
        token_seq_lens = self._to_device(rope_lens[req_of_token])
        metas = [b.build_metadata(common, g) for g, b in enumerate(self.backends)]
        input_ids = self._to_device(np.array(ids, dtype=np.int64))
        if inflight:
            dst, src = (self._to_device(np.array(c, dtype=np.int64)) for c in zip(*inflight))
            input_ids[dst] = self._last_sampled[src]
        return input_ids, ForwardContext(common=common, attn_metadata=metas, token_seq_lens=token_seq_lens)

    def _inflight_row(self, request_id: str) -> int:
        row = self._last_rows.get(request_id)
        if row is None:
            raise RuntimeError(f"request {request_id} is scheduled on a token the last step did not sample")
        return row

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array (made for this step only) as a tensor on the device (pinned, no wait)."""
        return to_device(torch.from_numpy(array), self.device)

    # --- the step ---------------------------------------------------------------------------
    def execute(self, output: SchedulerOutput, grammar_bitmask: BitmaskFn | None = None) -> RunnerOutput:
        """Run one step and read its results back."""
        return self.collect(self.launch(output, grammar_bitmask))

    def launch(self, output: SchedulerOutput, grammar_bitmask: BitmaskFn | None = None) -> StepHandle:
        """Queue one step's forward and sampling on the device; nothing is read back yet.

        Args:
            output: the scheduled step.
            grammar_bitmask: structured output: called with ``output`` once the forward is
                queued (the host fills the bitmask while the device computes), returns the
                bitmask the sampling applies, or None when no row is constrained.
        """
        handle = self.launch_forward(output)
        self.sample(handle, None if grammar_bitmask is None else grammar_bitmask(output))
        return handle

    @torch.inference_mode()
    def launch_forward(self, output: SchedulerOutput) -> StepHandle:
        """Queue one step's forward, the logits of the rows that sample and any prompt
        logprobs; on CUDA it returns while the device computes. ``sample`` must follow before
        the next step is launched (that step may read this one's sampled tokens)."""
        # decodes first (those with history before one-token prompts): backends batch them;
        # among them the shortest context first: the paged decode kernel starts the last (the
        # longest) first, and the short ones fill the end of its launch
        # (nano-vllm workload on the H200: measured in docs/performance.md)
        scheduled = sorted(output.scheduled, key=lambda s: (s.num_new_tokens != 1, s.start == 0,
                                                            s.start if s.num_new_tokens == 1 else 0))
        self._copy_states(output.state_copies)  # snapshot saves and restores first,
        if output.offload is not None:  # then tier stores (read) and loads (write)
            self.offload_io.run(self.offload, *output.offload, written_blocks(scheduled, self.block_size))
        input_ids, ctx = self._prepare(scheduled)
        qsl = ctx.common.query_start_loc_cpu
        sample_reqs = [s.request for s in scheduled if s.samples]
        rows = [qsl[i + 1] - 1 for i, s in enumerate(scheduled) if s.samples]  # rows needing logits
        prompt_spans = []  # (scheduled, first, last, first row of hidden)
        for i, s in enumerate(scheduled):
            span = self._prompt_span(s) if s.request.wants_prompt_logprobs else None
            if span is not None:
                prompt_spans.append((s, *span, qsl[i] + span[0] - s.start))
        # prompt logprobs a bounded slice of rows at a time: a whole chunk's [rows, V] float32
        # would be gigabytes (8K rows of a 129K vocabulary: 4 GiB) that the memory plan never had
        step = max(1, _PROMPT_LOGPROB_ELEMENTS // self.arch.vocab_size)
        prompt_slices = [(s, a, min(a + step, last), row + a - first)
                         for s, first, last, row in prompt_spans for a in range(first, last, step)]
        head_calls = ([rows] if rows else []) + [list(range(row, row + b - a)) for _, a, b, row in prompt_slices]
        if self.broadcaster is not None:  # the other ranks run the same forward and output head
            self.broadcaster.broadcast_step(input_ids, ctx, output.state_copies, head_calls)
        if self.graphs is not None and self.graphs.can_run(ctx.common):
            hidden = self.graphs.run(input_ids, ctx)
        else:
            with forward_context(ctx):
                hidden = self.model(input_ids, ctx.common.positions)
        handle = StepHandle(sample_reqs)
        self._unsampled = handle
        if rows:
            index = rows if self.device.type == "cpu" else self._to_device(np.array(rows, dtype=np.int64))
            handle.logits = self.model.compute_logits(hidden[index])  # [len(rows), V]
        parts: dict[str, list[LogprobsTensors]] = {}
        for s, a, b, row in prompt_slices:
            lp = self._prompt_logprobs(self.model.compute_logits(hidden[row: row + b - a]), s, a, b)
            parts.setdefault(s.request.request_id, []).append(lp)
        handle.prompt = [(rid, _lp_to_host(_cat_logprobs(lps))) for rid, lps in parts.items()]
        return handle

    @torch.inference_mode()
    def sample(self, handle: StepHandle, grammar: GrammarBitmask | None = None) -> None:
        """Queue the sampling of a step ``launch_forward`` queued, ``grammar``'s bitmask applied
        (rows of requests that sample in it), and the copies of its results to the host.

        Raises:
            RuntimeError: the step was sampled already.
            ValueError: ``grammar`` names a request that does not sample in this step, or its
                bitmask does not have one row per request.
        """
        if handle.sampled_queued:
            raise RuntimeError("this step was sampled already")
        if grammar is not None:
            _check_grammar(grammar, handle.sample_reqs)
        if handle.logits is not None:
            out = self._sample(handle.logits, handle.sample_reqs, grammar)
            handle.logits = None
            self._last_sampled = out.sampled_token_ids
            self._last_rows = {r.request_id: j for j, r in enumerate(handle.sample_reqs)}
            handle.sampled = _to_host(out.sampled_token_ids)
            handle.logprobs = None if out.logprobs is None else _lp_to_host(out.logprobs)
        handle.sampled_queued = True
        if self._unsampled is handle:
            self._unsampled = None
        if self.device.type == "cuda":
            handle.event = torch.cuda.Event()
            handle.event.record()

    def collect(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a launched step and read its tokens and logprobs back to the host."""
        if not handle.sampled_queued:
            raise RuntimeError("collect: the step was launched but not sampled (call sample first)")
        result = RunnerOutput()
        if handle.event is not None:
            t0 = time.perf_counter()
            handle.event.synchronize()
            self.device_wait_seconds += time.perf_counter() - t0
        if handle.sampled is not None:
            tokens = handle.sampled.tolist()
            result.sampled = {r.request_id: t for r, t in zip(handle.sample_reqs, tokens)}
            lp = handle.logprobs
            for j, r in enumerate(handle.sample_reqs if lp is not None else ()):
                if r.sampling_params.logprobs is not None:
                    k = r.sampling_params.logprobs
                    result.logprobs[r.request_id] = (lp.token_ids[j, : k + 1].tolist(),
                                                     lp.logprobs[j, : k + 1].tolist(), int(lp.ranks[j]))
        for rid, lp in handle.prompt:
            result.prompt_logprobs[rid] = [(ids, vals, rank) for ids, vals, rank in
                                           zip(lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist())]
        return result

    def _copy_states(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Snapshot saves and prefix-hit restores, in order (a restore may read a fresh save)."""
        for src, dst in copies:
            for cache in self.state_caches:
                for t in cache.tensors():
                    t[dst].copy_(t[src])

    def _sample(self, logits: torch.Tensor, reqs: list, grammar: GrammarBitmask | None = None) -> SamplerOutput:
        params = [r.sampling_params for r in reqs]
        banned = []
        for r in reqs:
            p = r.sampling_params
            # a grammar decides where the output ends: min_tokens does not ban its stop token
            if r.num_output_tokens < p.min_tokens and r.grammar is None:
                banned.append(list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids)))
            else:
                banned.append([])
            if r.bad_words_token_ids:
                banned[-1] += bad_words_bans(r.bad_words_token_ids, r.output_token_ids)
        bitmask = None
        if grammar is not None:  # the engine filled a row for each constrained request sampling here
            row = {r.request_id: j for j, r in enumerate(reqs)}
            bitmask = ([row[rid] for rid in grammar.request_ids], grammar.bitmask)
        batch = SamplingBatch.from_params(
            params, generators=[r.generator for r in reqs], output_token_ids=[r.output_token_ids for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            banned_token_ids=banned if any(banned) else None, device=logits.device, token_bitmask=bitmask)
        return self.sampler(logits, batch)

    @staticmethod
    def _prompt_span(s: ScheduledRequest) -> tuple[int, int] | None:
        """Positions [first, last) of this step whose logits give prompt logprobs, or None."""
        req = s.request
        first = max(s.start, req.num_prompt_logprobs_done)  # position p predicts prompt token p + 1
        last = min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1)
        return (first, last) if last > first else None

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, s: ScheduledRequest, first: int, last: int):
        req = s.request
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = to_device(torch.tensor(req.prompt_token_ids[first + 1: last + 1]), logprobs.device)
        return gather_logprobs(logprobs, targets, req.sampling_params.prompt_logprobs)


def _check_grammar(grammar: GrammarBitmask, sample_reqs: list) -> None:
    """Raises ValueError unless ``grammar`` has one bitmask row per request and each of its
    requests samples in the step."""
    if grammar.bitmask.dim() != 2 or grammar.bitmask.shape[0] != len(grammar.request_ids):
        raise ValueError(f"grammar bitmask of shape {tuple(grammar.bitmask.shape)} for "
                         f"{len(grammar.request_ids)} requests: one row per request is needed")
    sampling = {r.request_id for r in sample_reqs}
    stray = [rid for rid in grammar.request_ids if rid not in sampling]
    if stray:
        raise ValueError(f"grammar bitmask rows for requests that do not sample in this step: {stray[:5]}")


def _leading_true(mask: np.ndarray) -> int:
    """How many entries at the start of ``mask`` are True."""
    return len(mask) if mask.all() else int(np.argmin(mask))
