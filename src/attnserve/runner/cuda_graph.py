"""CUDA graphs for decode steps: one captured forward per batch-size bucket, through the backend hooks.

A decode-only batch of B requests is padded to the next bucket size; the padded rows attend
to the zeroed null block and write nothing (slot -1). In state layers they advance the null
state slot 0, which no request owns, snapshots or reads (``kvcache/state.py``), so its content
is scratch and every real slot comes out as in an eager step.
The runner owns persistent copies of the step's common device inputs (token ids, positions,
``CommonAttentionMetadata``'s tensors); per bucket it asks each group's backend once for the
metadata of a captured batch (``Backend.build_graph_metadata``, over views of those buffers,
with ``max_model_len`` as every sequence's host-side bound), so one graph serves every context
length. Before a replay it copies the step into its buffers and lets each backend refresh the
buffers it owns (``Backend.refresh_graph_metadata``). It knows no backend by type: a backend
takes part when it says its decode forward is graph-safe (``Backend.cuda_graph_safe``).

What it is not: the decision to use graphs (``ModelRunner``, and the engine's builder for
model-wide conditions such as the MoE activation), or prefill graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attnserve.attention.backend import Backend
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.core.forward_context import ForwardContext, forward_context

__all__ = ["CudaGraphRunner", "graph_buckets"]

logger = logging.getLogger(__name__)


def graph_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    out = [b for b in sizes if b < max_num_seqs]
    return out + [max_num_seqs]


@dataclass(slots=True)
class _Static:
    """The persistent inputs every captured graph reads, sized for the largest bucket."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    token_seq_lens: torch.Tensor  # [N] int64
    query_start_loc: torch.Tensor  # [N + 1] int32: 0, 1, ..., N (one token per request)
    seq_lens: torch.Tensor  # [N] int32
    block_tables: list[torch.Tensor]  # per group [N, max_blocks] int32
    slot_mappings: list[torch.Tensor]  # per group [N] int64
    state_slots: torch.Tensor | None  # [N] int64, hybrid models
    has_initial_state: torch.Tensor | None  # [N] bool, hybrid models


@dataclass(slots=True)
class _Captured:
    replay: Callable[[], None]
    output: torch.Tensor  # [bucket, D] hidden states the graph writes
    metadata: list[Any]  # per group, from build_graph_metadata


class CudaGraphRunner:
    """Captures and replays the decode forward of every batch-size bucket.

    Args:
        model: the model; its layers read the forward context like an eager step.
        backends: one per KV cache group (every one ``cuda_graph_safe``): the paged groups, then
            the state groups.
        block_size, max_model_len: the cache's block size and the longest sequence.
        max_num_seqs: the largest bucket.
        device: the CUDA device.
        has_state: the model has state layers (their slots and initial-state flags are inputs).
        num_paged_groups: how many of ``backends`` serve paged groups (each has a block table and
            a slot mapping); None: all of them.
    """

    warmups = 2  # eager forwards per bucket before its capture: compile kernels, settle allocations

    def __init__(self, model: torch.nn.Module, backends: list[Backend], block_size: int,
                 max_num_seqs: int, max_model_len: int, device: torch.device, has_state: bool = False,
                 num_paged_groups: int | None = None):
        self.model = model
        self.backends = backends
        self.num_paged = len(backends) if num_paged_groups is None else num_paged_groups
        self.max_model_len = max_model_len
        self.device = device
        self.buckets = graph_buckets(max_num_seqs)
        self.captured: dict[int, _Captured] = {}
        self.pool = None
        n = self.buckets[-1]
        max_blocks = -(-max_model_len // block_size)
        z = dict(device=device)
        self.static = _Static(
            input_ids=torch.zeros(n, dtype=torch.int64, **z), positions=torch.zeros(n, dtype=torch.int64, **z),
            token_seq_lens=torch.ones(n, dtype=torch.int64, **z),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, **z), seq_lens=torch.ones(n, dtype=torch.int32, **z),
            block_tables=[torch.zeros(n, max_blocks, dtype=torch.int32, **z) for _ in range(self.num_paged)],
            slot_mappings=[torch.full((n,), -1, dtype=torch.int64, **z) for _ in range(self.num_paged)],
            state_slots=torch.zeros(n, dtype=torch.int64, **z) if has_state else None,
            has_initial_state=torch.ones(n, dtype=torch.bool, **z) if has_state else None)

    @staticmethod
    def supported(backends: list[Backend]) -> bool:
        """Whether every group's backend can be captured."""
        return all(b.cuda_graph_safe for b in backends)

    def bucket_for(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def can_run(self, common: CommonAttentionMetadata) -> bool:
        """A step replays a graph when it is decode-only, fits a bucket, and (hybrid models)
        every request continues a state (the graphs capture the recurrent decode form)."""
        n = common.num_reqs
        if common.num_decodes != n or self.bucket_for(n) is None:
            return False
        return self.static.state_slots is None or common.num_state_decodes == n

    def _common(self, bs: int) -> CommonAttentionMetadata:
        """Views of the persistent buffers for a decode batch of ``bs``, with capture bounds."""
        st = self.static
        has_state = st.state_slots is not None
        return CommonAttentionMetadata(
            query_start_loc=st.query_start_loc[: bs + 1], seq_lens=st.seq_lens[:bs], positions=st.positions[:bs],
            block_tables=[t[:bs] for t in st.block_tables], slot_mappings=[m[:bs] for m in st.slot_mappings],
            query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[self.max_model_len] * bs, num_decodes=bs,
            max_query_len=1, max_seq_len=self.max_model_len,
            state_slots=st.state_slots[:bs] if has_state else None,
            has_initial_state=st.has_initial_state[:bs] if has_state else None,
            num_state_decodes=bs if has_state else 0)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool."""
        for bs in reversed(self.buckets):
            common = self._common(bs)
            metadata = [b.build_graph_metadata(common, g) for g, b in enumerate(self.backends)]
            ctx = ForwardContext(common=common, attn_metadata=metadata,
                                 token_seq_lens=self.static.token_seq_lens[:bs])
            for _ in range(self.warmups):
                self._forward(ctx)
            self._synchronize()
            replay, output = self._capture_graph(lambda ctx=ctx: self._forward(ctx))
            self.captured[bs] = _Captured(replay, output, metadata)
        self._synchronize()
        logger.info("captured CUDA graphs for decode batches %s", self.buckets)

    def _forward(self, ctx: ForwardContext) -> torch.Tensor:
        """The model over the persistent inputs of ``ctx``'s batch, in ``ctx``."""
        bs = ctx.common.num_reqs
        with forward_context(ctx):
            return self.model(self.static.input_ids[:bs], self.static.positions[:bs])

    def _capture_graph(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Record ``forward`` into a graph; (its replay, the output tensor it writes)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, output

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Replay the graph of the bucket that holds this decode batch; returns [B, D]."""
        common = ctx.common
        b = common.num_reqs
        bs = self.bucket_for(b)
        st = self.static
        st.input_ids[:b].copy_(input_ids)
        st.positions[:b].copy_(common.positions)
        st.token_seq_lens[:b].copy_(ctx.token_seq_lens)
        st.seq_lens[:b].copy_(common.seq_lens)
        st.seq_lens[b:bs].fill_(1)
        for g in range(self.num_paged):
            table = common.block_tables[g]
            st.block_tables[g][:b].zero_()
            st.block_tables[g][:b, : table.shape[1]].copy_(table)
            st.block_tables[g][b:bs].zero_()
            st.slot_mappings[g][:b].copy_(common.slot_mappings[g])
            st.slot_mappings[g][b:bs].fill_(-1)
        if st.state_slots is not None:  # padded rows run on the null slot (scratch)
            st.state_slots[:b].copy_(common.state_slots)
            st.state_slots[b:bs].zero_()
            st.has_initial_state[:bs].fill_(True)
        captured = self.captured[bs]
        for backend, metadata in zip(self.backends, captured.metadata):
            backend.refresh_graph_metadata(metadata, common)
        captured.replay()
        return captured.output[:b]
