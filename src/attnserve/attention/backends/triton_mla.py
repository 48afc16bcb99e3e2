"""TRITON_MLA: dense MLA over the paged latent cache, decoding with the Triton kernel.

The same contract, cache layout and arithmetic as TORCH_MLA (``torch_mla.py``): the layer hands
``q`` [T, H, d_nope + R], the new latent rows ``k`` [T, L + R] and ``v`` None; new rows are
written by ``write_latent_rows`` (model dtype or 656-byte fp8 rows). Decodes run in the
absorbed ("MQA") form: the query becomes ``[W_UK^T q_nope ; q_pe]`` here, and
``ops/triton_mla.mla_decode`` attends over the raw latent rows (split-KV on long contexts),
after which ``W_UV`` maps ``u`` to per-head values. Prefills keep TORCH_MLA's expanded PyTorch
path, one request at a time. Decode metadata is device tensors plus host bounds only (no sync
in ``forward``). Not here: the kernels (``ops/triton_mla.py``), sparse MLA
(``triton_mla_sparse.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnserve.attention.backend import AttentionBackend
from attnserve.attention.backends.torch_mla import attend_expanded, read_latent, write_latent_rows
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.ops.triton_mla import mla_decode

__all__ = ["TritonMLABackend", "TritonMLAMetadata", "absorb_query", "apply_w_uv"]


@dataclass(slots=True)
class TritonMLAMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 where nothing is written
    num_decodes: int
    decode_block_table: torch.Tensor  # [B_dec, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [B_dec] int32
    decode_max_seq_len: int
    prefills: list[tuple[int, int, torch.Tensor]]  # (q_start, q_end, slots [S]) per prefill
    num_splits: int | None = None  # fixed when a decode batch is captured in a CUDA graph


def absorb_query(q: torch.Tensor, w_kv_b: torch.Tensor, d_nope: int) -> torch.Tensor:
    """[T, H, d_nope + R] -> [T, H, L + R] ``[W_UK^T q_nope ; q_pe]`` in q's dtype.

    Args:
        q: ``q_nope`` then the rotated ``q_pe``; w_kv_b: [H, d_nope + d_v, L] in q's dtype.
    """
    q_latent = torch.einsum("thd,hdl->thl", q[..., :d_nope], w_kv_b[:, :d_nope])  # [T, H, L]
    return torch.cat([q_latent, q[..., d_nope:]], dim=-1)


def apply_w_uv(u: torch.Tensor, w_kv_b: torch.Tensor, d_nope: int) -> torch.Tensor:
    """Per-head values ``W_UV u``: [T, H, L] -> [T, H, d_v]."""
    return torch.einsum("thl,hvl->thv", u, w_kv_b[:, d_nope:])


class TritonMLABackend(AttentionBackend):
    name = "TRITON_MLA"
    # a decode batch's metadata only slices the common tensors (no prefills, host bounds fixed
    # at capture) and latent rows are written without boolean indexing: the default graph hooks
    cuda_graph_safe = True

    def _slots(self, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
        pos = torch.arange(seq_len, device=block_table_row.device)
        blocks = block_table_row.long()[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def build_metadata(self, common: CommonAttentionMetadata, group_id: int) -> TritonMLAMetadata:
        bt = common.block_tables[group_id]
        nd = common.num_decodes
        q = common.query_start_loc_cpu
        prefills = [
            (q[i], q[i + 1], self._slots(bt[i], common.seq_lens_cpu[i]))
            for i in range(nd, common.num_reqs)
        ]
        return TritonMLAMetadata(
            slot_mapping=common.slot_mappings[group_id],
            num_decodes=nd,
            decode_block_table=bt[:nd],
            decode_seq_lens=common.seq_lens[:nd],
            decode_max_seq_len=max(common.seq_lens_cpu[:nd], default=0),
            prefills=prefills,
        )

    def forward(self, layer, q, k, v, kv_cache, metadata: TritonMLAMetadata) -> torch.Tensor:
        """Write the new latent rows ``k`` and attend; returns [T, H, d_v] in q's dtype."""
        cache = kv_cache["latent"]
        rank, rope, d_nope = layer.kv_lora_rank, layer.qk_rope_head_dim, layer.qk_nope_head_dim
        write_latent_rows(cache, k, metadata.slot_mapping, rank)
        w_kv_b = layer.w_kv_b.to(q.dtype)
        out = q.new_empty(q.shape[0], q.shape[1], w_kv_b.shape[1] - d_nope)
        nd = metadata.num_decodes
        if nd:
            u = mla_decode(
                absorb_query(q[:nd], w_kv_b, d_nope),
                cache,
                metadata.decode_block_table,
                metadata.decode_seq_lens,
                kv_lora_rank=rank,
                scale=layer.scale,
                max_seq_len=metadata.decode_max_seq_len,
                num_splits=metadata.num_splits,
            )  # [B_dec, H, L]
            out[:nd] = apply_w_uv(u, w_kv_b, d_nope)
        for start, end, slots in metadata.prefills:
            latent = read_latent(cache, slots, rank, rope, q.dtype)[None]  # [1, S, L + R]
            o = attend_expanded(q[None, start:end], latent, None, w_kv_b, layer.scale)
            out[start:end] = o[0]
        return out
