"""TRITON_MLA_SPARSE: DSA (DeepSeek-V3.2, GLM-5) with the Triton indexer and sparse-MLA kernels.

The same contract, caches and arithmetic as TORCH_MLA_SPARSE (``torch_mla_sparse.py``), whose
docstring defines the two calls a sparse layer makes:

1. ``select_topk``: stores the new indexer keys (``write_indexer_rows``: model dtype or
   132-byte fp8 rows), then ``ops/indexer/logits_triton.lightning_indexer_topk`` scores every
   visible key in one kernel (exact over a model-dtype cache, DeepSeek's fp8 formula over an
   fp8 cache) and keeps the best ``topk``: decodes are one batched call, scored by the plan's
   ``indexer.decode`` variant (Triton's streaming kernel, or on a Hopper GPU over an fp8 cache
   the Gluon kernel, ``ops/indexer/logits_gluon``) and selected by ``indexer.topk_decode``'s
   radix select (``ops/indexer/topk_triton.py``, reading each row only up to its length);
   prefills one request at a time, in query chunks that bound the [Q, S] logits, scored by
   ``indexer.prefill`` (the tiled kernel) and selected by the plan's ``indexer.topk_prefill``
   (``torch.topk``, or the two-pass Triton select over each row's causal length). Rows that see at most
   ``topk`` keys select all of them without scoring, in position order (the selection is a
   set: attention does not depend on its order).
2. ``forward(..., topk_indices=...)``: stores the new latent rows, absorbs the queries and runs
   the plan's ``mla.sparse`` variant over each row's selected latent rows (decode and prefill
   rows alike, -1 slots skipped, all -1 gives 0), then applies ``W_UV``: on a Hopper GPU bf16
   rank-512 latents at 64+ heads by the Gluon kernel (``ops/mla/sparse_gluon``), fp8 latent rows
   by its fp8 twin (``ops/mla/sparse_gluon_fp8``), else Triton's ``sparse_mla``; all take
   ``sparse_mla``'s call. ``disabled_kernels=("gluon",)`` keeps Triton everywhere.

Not here: the kernels (``ops/indexer/logits_triton.py``, ``ops/mla/sparse_triton.py``), the projections and RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnserve.attention.backend import AttentionBackend, tensor_problem
from attnserve.attention.backends.torch_mla_sparse import write_and_attend, write_indexer_rows
from attnserve.attention.backends.triton_mla import absorb_query, apply_w_uv, latent_problem
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.ops.indexer.logits_triton import lightning_indexer_topk
from attnserve.platforms import to_device

__all__ = ["TritonMLASparseBackend", "TritonMLASparseMetadata"]

# Elements of one chunk's largest intermediate (logits [Q, S] float32, or absorbed queries and
# their outputs [T, H, L + R]): 2^24 = 64 MiB of float32.
_CHUNK_ELEMENTS = 1 << 24


def indexer_problem(q: torch.Tensor, cache: torch.Tensor):
    """The kernel problem of indexer queries [T, H_I, D] over the indexer cache (what the plan
    builds from the layer's spec)."""
    return tensor_problem(q, cache, num_heads=q.shape[1], num_kv_heads=1, head_size=q.shape[2])


@dataclass(slots=True)
class TritonMLASparseMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 where nothing is written
    positions: torch.Tensor  # [T] int64 absolute position of each new token
    token_req: torch.Tensor  # [T] int32 the request each token belongs to
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    num_decodes: int
    decode_max_seq_len: int
    prefills: list[tuple[int, int, int, int]]  # (q_start, q_end, request, seq_len) per prefill


def _chunks(start: int, end: int, per_item: int):
    """(a, b) ranges over [start, end) so a chunk holds about ``_CHUNK_ELEMENTS``."""
    step = max(1, _CHUNK_ELEMENTS // max(per_item, 1))
    for a in range(start, end, step):
        yield a, min(a + step, end)


class TritonMLASparseBackend(AttentionBackend):
    name = "TRITON_MLA_SPARSE"
    # a decode batch's metadata only slices the common tensors (its token -> request map is
    # 0..B-1, built once per bucket), host bounds are fixed at capture (the indexer scores
    # ``max_model_len`` columns, each row's top-k reads only its own length), and rows are
    # written without boolean indexing: the default graph hooks
    cuda_graph_safe = True

    def build_metadata(
        self, common: CommonAttentionMetadata, group_id: int
    ) -> TritonMLASparseMetadata:
        bt = common.block_tables[group_id]
        nd = common.num_decodes
        query_lens = to_device(torch.tensor(common.query_lens_cpu), bt.device)  # no stream wait
        reqs = torch.arange(common.num_reqs, dtype=torch.int32, device=bt.device)
        q = common.query_start_loc_cpu
        return TritonMLASparseMetadata(
            slot_mapping=common.slot_mappings[group_id],
            positions=common.positions.long(),
            token_req=torch.repeat_interleave(reqs, query_lens, output_size=common.num_tokens),
            block_table=bt,
            seq_lens=common.seq_lens,
            query_start_loc=common.query_start_loc,
            num_decodes=nd,
            decode_max_seq_len=max(common.seq_lens_cpu[:nd], default=0),
            prefills=[
                (q[i], q[i + 1], i, common.seq_lens_cpu[i]) for i in range(nd, common.num_reqs)
            ],
        )

    def select_topk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        weights: torch.Tensor,
        kv_cache: dict[str, torch.Tensor],
        metadata: TritonMLASparseMetadata,
        *,
        topk: int,
    ) -> torch.Tensor:
        """Store the new indexer keys and pick each new token's top-k keys.

        Args:
            q: [T, H_I, D] indexer queries after RoPE; k: [T, D] new keys after k_norm and RoPE.
            weights: [T, H_I] raw ``weights_proj(x)`` (float32).
            kv_cache: the layer's caches; ``"indexer"`` is read and written.
            metadata: what ``build_metadata`` returned for the layer's group.
            topk: the output width (``index_topk``).
        Returns:
            [T, topk] int32 absolute positions; -1 beyond the valid keys.
        """
        cache = kv_cache["indexer"]
        md = metadata
        write_indexer_rows(cache, k, md.slot_mapping)
        out = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
        nd = md.num_decodes
        problem = lambda: indexer_problem(q, cache)  # noqa: E731
        if nd:
            out[:nd] = lightning_indexer_topk(
                q[:nd], weights[:nd], cache, md.block_table[:nd], md.query_start_loc[: nd + 1],
                md.seq_lens[:nd], md.positions[:nd], topk=topk, max_query_len=1,
                max_seq_len=md.decode_max_seq_len, logits=self.launch("indexer.decode", problem),
                select=self.launch("indexer.topk_decode", problem),
            )  # fmt: skip
        if md.prefills:
            prefill_logits = self.launch("indexer.prefill", problem)
            # the torch variant (torch.topk) runs inside lightning_indexer_topk: no launch function
            picked = self.kernel("indexer.topk_prefill", problem)
            prefill_select = self.launch("indexer.topk_prefill", problem) if picked.launch else None
        for start, end, req, seq_len in md.prefills:
            table, lens = md.block_table[req : req + 1], md.seq_lens[req : req + 1]
            for a, b in _chunks(start, end, seq_len):
                qsl = to_device(torch.tensor([0, b - a], dtype=torch.int32), q.device)
                out[a:b] = lightning_indexer_topk(
                    q[a:b], weights[a:b], cache, table, qsl, lens, md.positions[a:b], topk=topk,
                    max_query_len=b - a, max_seq_len=seq_len, logits=prefill_logits, select=prefill_select,
                )  # fmt: skip
        return out

    def forward(self, layer, q, k, v, kv_cache, metadata: TritonMLASparseMetadata, *,
                topk_indices: torch.Tensor | None = None) -> torch.Tensor:
        return write_and_attend(self, layer, q, k, kv_cache, metadata, topk_indices)

    def attend(
        self,
        layer,
        q: torch.Tensor,
        cache: torch.Tensor,
        metadata: TritonMLASparseMetadata,
        topk_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Sparse MLA over latent rows already in ``cache`` (``forward`` without the write):
        [T, H, d_nope + R] queries, [T, K] positions -> [T, H, d_v]."""
        rank, rope, d_nope = layer.kv_lora_rank, layer.qk_rope_head_dim, layer.qk_nope_head_dim
        w_kv_b = layer.w_kv_b.to(q.dtype)
        out = q.new_empty(q.shape[0], q.shape[1], w_kv_b.shape[1] - d_nope)
        for a, b in _chunks(0, q.shape[0], q.shape[1] * (rank + rope)):
            q_abs = absorb_query(q[a:b], w_kv_b, d_nope)  # [rows, H, L + R]
            u = self.launch("mla.sparse", lambda q_abs=q_abs: latent_problem(q_abs, cache, rank))(
                q_abs, cache, metadata.block_table,
                metadata.seq_lens, topk_indices[a:b], metadata.token_req[a:b],
                kv_lora_rank=rank, scale=layer.scale,
            )  # fmt: skip
            out[a:b] = apply_w_uv(u, w_kv_b, d_nope)
        return out
