"""The model runner: one scheduled step in, sampled tokens (and logprobs) out.

It owns the model, the KV cache tensors and one attention backend per KV cache group. Each
step it lays the scheduled tokens out flat (decodes first), builds ``CommonAttentionMetadata``
once, lets every group's backend derive its own metadata, runs the model inside the forward
context, and samples from the logits of the rows that need a token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from attnserve.arch import ModelArch
from attnserve.attention.backend import AttentionBackend
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from attnserve.kvcache.groups import KVCacheGroup
from attnserve.layers.rotary import RotaryEmbedding
from attnserve.layers.sampler import Sampler, SamplingBatch, gather_logprobs
from attnserve.runner.block_table import BlockTables
from attnserve.runner.forward_context import ForwardContext, forward_context
from attnserve.runner.offload_io import written_blocks

if TYPE_CHECKING:
    from attnserve.runner.worker import WorkerGroup

__all__ = ["ModelRunner", "RunnerOutput", "TokenLogprobs"]

# (token ids, logprobs, rank of the first id): the chosen/prompt token first, then the top-k
TokenLogprobs = tuple[list[int], list[float], int]


@dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, arch: ModelArch, groups: list[KVCacheGroup],
                 backends: list[AttentionBackend], device: torch.device, *, max_model_len: int,
                 max_num_seqs: int, cuda_graphs: bool = False, state_caches: list | None = None,
                 offload=None, offload_io=None, workers: WorkerGroup | None = None):
        self.model = model
        self.workers = workers  # tensor parallel (rank 0): each step's inputs go to the other ranks
        self.state_caches = state_caches or []
        self.offload, self.offload_io = offload, offload_io
        self.arch = arch
        self.groups = groups
        self.backends = backends
        self.device = device
        self.block_size = groups[0].block_size
        self.block_tables = BlockTables([g.policy == "full" for g in groups], num_rows=max_num_seqs)
        self.sampler = Sampler()
        for m in model.modules():  # RoPE tables sized once: no per-step host syncs
            if isinstance(m, RotaryEmbedding):
                m.reserve(max_model_len, device)
        self.graphs = None
        if cuda_graphs and device.type == "cuda":
            self._capture_graphs(backends, max_num_seqs, max_model_len)

    def _capture_graphs(self, backends, max_num_seqs: int, max_model_len: int) -> None:
        from attnserve.runner.cuda_graph import CudaGraphRunner  # imports Triton: CUDA only

        if CudaGraphRunner.supported(backends):
            self.graphs = CudaGraphRunner(self.model, backends, self.arch.num_kv_heads, self.block_size,
                                          max_num_seqs, max_model_len, self.device)
            self.graphs.capture()

    # --- inputs -----------------------------------------------------------------------------
    def _prepare(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, ForwardContext]:
        """Flat token ids and the step's metadata; per-token arrays are built with numpy from
        each request's start and length, block tables from the persistent rows."""
        n = len(scheduled)
        starts = np.fromiter((s.request.num_computed_tokens for s in scheduled), np.int64, n)
        query_lens = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, n)
        seq_lens = starts + query_lens
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        ids: list[int] = []
        for s in scheduled:
            start, k = s.request.num_computed_tokens, s.num_new_tokens
            if k == 1:
                ids.append(s.request.all_token_ids[start])
            else:
                ids.extend(s.request.all_token_ids[start:start + k])
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
        return input_ids, ForwardContext(common=common, attn_metadata=metas, token_seq_lens=token_seq_lens)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array (made for this step only) as a tensor on the device."""
        tensor = torch.from_numpy(array)
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)

    # --- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        # decodes first (those with history before one-token prompts): backends batch them
        scheduled = sorted(output.scheduled, key=lambda s: (s.num_new_tokens != 1, s.start == 0))
        self._copy_states(output.state_copies)  # snapshot saves and restores first,
        if output.offload is not None:  # then tier stores (read) and loads (write)
            self.offload_io.run(self.offload, *output.offload, written_blocks(scheduled, self.block_size))
        input_ids, ctx = self._prepare(scheduled)
        qsl = ctx.common.query_start_loc_cpu
        sample_reqs = [s.request for s in scheduled if s.samples]
        rows = [qsl[i + 1] - 1 for i, s in enumerate(scheduled) if s.samples]  # rows needing logits
        prompt_spans = []
        for i, s in enumerate(scheduled):
            span = self._prompt_span(s) if s.request.wants_prompt_logprobs else None
            if span is not None:
                prompt_spans.append((s, *span))
                rows.extend(range(qsl[i] + span[0] - s.start, qsl[i] + span[1] - s.start))
        if self.workers is not None:  # the other ranks run the same forward and output head
            self.workers.broadcast_step(input_ids, ctx, output.state_copies, rows)
        if self.graphs is not None and ctx.common.num_decodes == len(scheduled) \
                and self.graphs.bucket_for(len(scheduled)) is not None:
            hidden = self.graphs.run(input_ids, ctx)
        else:
            with forward_context(ctx):
                hidden = self.model(input_ids, ctx.common.positions)
        result = RunnerOutput()
        if not rows:
            return result
        logits = self.model.compute_logits(hidden[rows])  # [len(rows), V]
        if sample_reqs:
            self._sample(logits[: len(sample_reqs)], sample_reqs, result)
        offset = len(sample_reqs)
        for s, first, last in prompt_spans:
            self._prompt_logprobs(logits[offset: offset + last - first], s, first, last, result)
            offset += last - first
        return result

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (if any); the runner is unusable afterwards."""
        if self.workers is not None:
            self.workers.shutdown()

    def _copy_states(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Snapshot saves and prefix-hit restores, in order (a restore may read a fresh save)."""
        for src, dst in copies:
            for cache in self.state_caches:
                for t in cache.tensors():
                    t[dst].copy_(t[src])

    def _sample(self, logits: torch.Tensor, reqs: list, result: RunnerOutput) -> None:
        params = [r.sampling_params for r in reqs]
        banned = []
        for r in reqs:
            p = r.sampling_params
            if r.num_output_tokens < p.min_tokens:
                banned.append(list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids)))
            else:
                banned.append([])
        batch = SamplingBatch.from_params(
            params, generators=[r.generator for r in reqs], output_token_ids=[r.output_token_ids for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            banned_token_ids=banned if any(banned) else None, device=logits.device)
        out = self.sampler(logits, batch)
        tokens = out.sampled_token_ids.tolist()
        for j, r in enumerate(reqs):
            result.sampled[r.request_id] = tokens[j]
            if r.sampling_params.logprobs is not None and out.logprobs is not None:
                k = r.sampling_params.logprobs
                lp = out.logprobs
                result.logprobs[r.request_id] = (lp.token_ids[j, : k + 1].tolist(),
                                                 lp.logprobs[j, : k + 1].tolist(), int(lp.ranks[j]))

    @staticmethod
    def _prompt_span(s: ScheduledRequest) -> tuple[int, int] | None:
        """Positions [first, last) of this step whose logits give prompt logprobs, or None."""
        req = s.request
        first = max(s.start, req.num_prompt_logprobs_done)  # position p predicts prompt token p + 1
        last = min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1)
        return (first, last) if last > first else None

    def _prompt_logprobs(self, logits: torch.Tensor, s: ScheduledRequest, first: int, last: int,
                         result: RunnerOutput) -> None:
        req = s.request
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(req.prompt_token_ids[first + 1: last + 1], device=logprobs.device)
        k = req.sampling_params.prompt_logprobs
        lp = gather_logprobs(logprobs, targets, k)
        result.prompt_logprobs[req.request_id] = [
            (lp.token_ids[j].tolist(), lp.logprobs[j].tolist(), int(lp.ranks[j])) for j in range(last - first)]


def _leading_true(mask: np.ndarray) -> int:
    """How many entries at the start of ``mask`` are True."""
    return len(mask) if mask.all() else int(np.argmin(mask))
