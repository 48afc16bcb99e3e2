"""CUDA graphs for decode steps: one captured forward per batch-size bucket.

A decode-only batch of B requests is padded to the next bucket size; the padded rows attend
to the zeroed null block and write nothing (slot -1). Inputs and attention metadata live in
static buffers that each step overwrites before replaying the graph, and the attention
launches are captured with fixed bounds (``max_model_len``, a fixed number of KV splits), so
one graph serves every context length. Only backends whose forward is graph-safe (no host
syncs, no Python branching on data) take part: TRITON_ATTN today.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from attnserve.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionMetadata,
    TritonBatchPart,
)
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.attention.ops.triton_paged_attention import pick_num_splits
from attnserve.runner.forward_context import ForwardContext, forward_context

__all__ = ["CudaGraphRunner", "graph_buckets"]

logger = logging.getLogger(__name__)


def graph_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    out = [b for b in sizes if b < max_num_seqs]
    return out + [max_num_seqs]


@dataclass(slots=True)
class _Static:
    input_ids: torch.Tensor
    positions: torch.Tensor
    token_seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: list[torch.Tensor]
    slot_mappings: list[torch.Tensor]


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, backends: list, num_kv_heads: int, block_size: int,
                 max_num_seqs: int, max_model_len: int, device: torch.device):
        self.model = model
        self.backends = backends
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.buckets = graph_buckets(max_num_seqs)
        self.num_kv_heads = num_kv_heads
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        n = self.buckets[-1]
        max_blocks = -(-max_model_len // block_size)
        z = dict(device=device)
        self.static = _Static(
            input_ids=torch.zeros(n, dtype=torch.int64, **z), positions=torch.zeros(n, dtype=torch.int64, **z),
            token_seq_lens=torch.ones(n, dtype=torch.int64, **z),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, **z), seq_lens=torch.ones(n, dtype=torch.int32, **z),
            block_tables=[torch.zeros(n, max_blocks, dtype=torch.int32, **z) for _ in backends],
            slot_mappings=[torch.full((n,), -1, dtype=torch.int64, **z) for _ in backends])

    @staticmethod
    def supported(backends: list) -> bool:
        return all(isinstance(b, TritonAttentionBackend) for b in backends)

    def bucket_for(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def _context(self, bs: int) -> ForwardContext:
        st = self.static
        common = CommonAttentionMetadata(
            query_start_loc=st.query_start_loc[: bs + 1], seq_lens=st.seq_lens[:bs], positions=st.positions[:bs],
            block_tables=[t[:bs] for t in st.block_tables], slot_mappings=[m[:bs] for m in st.slot_mappings],
            query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[self.max_model_len] * bs, num_decodes=bs,
            max_query_len=1, max_seq_len=self.max_model_len)
        splits = pick_num_splits(bs, self.num_kv_heads, 1, self.max_model_len, self.device)
        metas = [TritonAttentionMetadata(common.slot_mappings[g], [TritonBatchPart(
            0, bs, common.block_tables[g], common.query_start_loc, common.seq_lens, 1, self.max_model_len, splits)])
            for g in range(len(self.backends))]
        return ForwardContext(common=common, attn_metadata=metas, token_seq_lens=st.token_seq_lens[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool."""
        st = self.static
        for bs in reversed(self.buckets):
            ctx = self._context(bs)
            with forward_context(ctx):
                for _ in range(2):  # warm up: compile kernels, settle allocations
                    self.model(st.input_ids[:bs], st.positions[:bs])
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[bs] = self.model(st.input_ids[:bs], st.positions[:bs])
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for decode batches %s", self.buckets)

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
        for g in range(len(self.backends)):
            table = common.block_tables[g]
            st.block_tables[g][:b].zero_()
            st.block_tables[g][:b, : table.shape[1]].copy_(table)
            st.block_tables[g][b:bs].zero_()
            st.slot_mappings[g][:b].copy_(common.slot_mappings[g])
            st.slot_mappings[g][b:bs].fill_(-1)
        self.graphs[bs].replay()
        return self.outputs[bs][:b]
