"""TRITON_ATTN: standard attention over the paged cache with the Triton kernels (CUDA, ROCm).

New K/V go into the cache with one kernel (with RoPE, and a q/k RMSNorm where the model has one,
fused in when the layer leaves them to the backend: ``forward_rope``); decodes and prefills then
run as two launches, of the variants the plan chose for ``attention.decode`` and
``attention.prefill`` (``attention/kernels.py``): Triton's ``unified_attention`` (decodes take
its split-KV decode path and a merge launch; prefills the tiled one), and on a Hopper GPU, for
plain causal bf16/fp16 attention at head 128, the Gluon prefill kernel
(``ops/attention/prefill_gluon``; ``disabled_kernels=("gluon",)`` keeps Triton). A prefill part
whose requests all have one new token launches the decode variant. Both variants take
``unified_attention``'s call: every feature of the layer (window, ALiBi, sinks, soft-cap, fp8
cache) is a kernel argument. The
metadata holds device tensors and host-side bounds only, so a decode batch built over the graph
runner's buffers can be captured in a CUDA graph (the contract's default hooks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from attnserve.attention.backend import AttentionBackend, RopeTable, layer_features, tensor_problem
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.ops.attention.kv_write_triton import rope_write_kv_cache, write_kv_cache

__all__ = ["TritonAttentionBackend", "TritonAttentionMetadata", "TritonBatchPart"]


@dataclass(slots=True)
class TritonBatchPart:
    """One launch: its requests' block tables, query offsets (from 0) and lengths."""

    token_start: int
    token_end: int
    block_table: torch.Tensor  # [n, max_blocks] int32
    query_start_loc: torch.Tensor  # [n + 1] int32, starting at 0
    seq_lens: torch.Tensor  # [n] int32
    max_query_len: int
    max_seq_len: int
    num_splits: int | None = None  # None: picked at launch from the host bounds


@dataclass(slots=True)
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    parts: list[TritonBatchPart]


class TritonAttentionBackend(AttentionBackend):
    name = "TRITON_ATTN"
    # a decode batch's metadata only slices the common tensors; the split count follows from
    # the host bounds (batch, KV heads, max_seq_len), fixed at capture: the default graph hooks
    cuda_graph_safe = True
    fuses_rope = True  # rotation and cache write in one kernel (ops/attention/kv_write_triton.py)
    # how split-KV decode merges: "kernel" (a second launch) or "last_split" (the last split
    # program to finish merges, in the attention launch). The H200 measured the in-launch merge
    # 6-15 µs slower a layer call at batch 1-64 (benchmarks/gpu_small_kernels.py, 2026-12-02)
    split_merge: ClassVar[str] = "kernel"

    def build_metadata(self, common: CommonAttentionMetadata, group_id: int) -> TritonAttentionMetadata:
        bt = common.block_tables[group_id]
        qsl = common.query_start_loc
        nd = common.num_decodes
        n = common.num_reqs
        parts = []
        if nd:
            parts.append(TritonBatchPart(0, nd, bt[:nd], qsl[: nd + 1], common.seq_lens[:nd], 1,
                                         max(common.seq_lens_cpu[:nd])))
        if nd < n:
            start = common.query_start_loc_cpu[nd]
            qlens = common.query_lens_cpu[nd:]
            parts.append(TritonBatchPart(start, common.num_tokens, bt[nd:], qsl[nd:] - start,
                                         common.seq_lens[nd:], max(qlens), max(common.seq_lens_cpu[nd:])))
        return TritonAttentionMetadata(common.slot_mappings[group_id], parts)

    def forward(self, layer, q, k, v, kv_cache, metadata: TritonAttentionMetadata) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        num_tokens = metadata.slot_mapping.shape[0]
        write_kv_cache(k[:num_tokens], v[:num_tokens], key_cache, value_cache, metadata.slot_mapping,
                       layer.k_scale, layer.v_scale)
        return self._attend(layer, q, key_cache, value_cache, metadata)

    def forward_rope(self, layer, q, k, v, kv_cache, metadata: TritonAttentionMetadata,
                     rope: RopeTable) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        q = rope_write_kv_cache(q, k, v, key_cache, value_cache, metadata.slot_mapping, rope.cos_sin_table,
                                rope.positions, rope.rotary_dim, rope.interleaved, layer.k_scale, layer.v_scale,
                                rope.qk_norm)
        return self._attend(layer, q, key_cache, value_cache, metadata)

    def _attend(self, layer, q, key_cache, value_cache, metadata: TritonAttentionMetadata) -> torch.Tensor:
        out = torch.empty(q.shape[0], q.shape[1], value_cache.shape[-1], dtype=q.dtype, device=q.device)
        for part in metadata.parts:
            s, e = part.token_start, part.token_end
            op = "attention.prefill" if part.max_query_len > 1 else "attention.decode"
            attend = self.launch(op, lambda: self._problem(layer, q, key_cache, value_cache))
            attend(q[s:e], key_cache, value_cache, out[s:e], part.block_table, part.query_start_loc, part.seq_lens,
                   scale=layer.scale, window=layer.window, alibi=layer.alibi_slopes, sinks=layer.sinks,
                   softcap=layer.softcap, k_scale=layer.k_scale, v_scale=layer.v_scale,
                   max_query_len=part.max_query_len, max_seq_len=part.max_seq_len, num_splits=part.num_splits,
                   merge=self.split_merge)
        return out

    @staticmethod
    def _problem(layer, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor):
        """The kernel problem of this layer's calls (what the plan builds from its spec)."""
        return tensor_problem(q, key_cache, num_heads=q.shape[1], num_kv_heads=key_cache.shape[2],
                              head_size=key_cache.shape[3], head_size_v=value_cache.shape[3],
                              features=layer_features(layer))
