"""TRITON_MLA: dense MLA over the paged latent cache, with the Triton absorbed kernel.

The same contract, cache layout and arithmetic as TORCH_MLA (``torch_mla.py``): the layer hands
``q`` [T, H, d_nope + R], the new latent rows ``k`` [T, L + R] and ``v`` None; new rows are
written by ``write_latent_rows`` (model dtype or 656-byte fp8 rows). Decodes and short prefills
(at most ``ABSORBED_MAX_QUERY`` new tokens: a short chunk of a chunked prefill, the block
recomputed after a prefix-cache hit, a short prompt) run in the absorbed ("MQA") form, in one
launch: each of their query rows becomes ``[W_UK^T q_nope ; q_pe]`` here, and
the plan's variant of ``mla.absorbed`` (``attention/kernels.py``) attends it over its request's
raw latent rows as a decode row that sees its causal key count (split-KV on long contexts), after
which ``W_UV`` maps ``u`` to per-head values. The variants, first that fits: on a Hopper GPU the
DeepSeek class (bf16, rank 512, 64-row pages; 64+ heads, or fewer padded to 64 rows) by the Gluon
kernel (``ops/mla/decode_gluon``); from Hopper on, model-dtype rows in pages of a multiple of 64
at 33+ heads by whole-page TMA tiles (``ops/mla/decode_triton_tma``); otherwise rows gathered by
pointer (``ops/mla/decode_triton``; any page, fp8 rows). All three take ``mla_decode``'s call.
Longer prefills keep TORCH_MLA's expanded PyTorch path (``mla.expanded``, ``prefill_expanded``), one
request at a time, its context expanded a bounded chunk at a time.
The per-row metadata is built once per step in ``build_metadata`` (device tensors plus host
bounds: no sync in ``forward``); a decode-only batch builds only slices of the common tensors,
so CUDA graphs capture it. Not here: the kernels (``ops/mla/decode_triton.py``), sparse MLA
(``triton_mla_sparse.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnserve.attention.backend import AttentionBackend, tensor_problem
from attnserve.attention.backends.torch_mla import prefill_expanded, write_latent_rows
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.platforms import to_device

__all__ = [
    "ABSORBED_MAX_QUERY",
    "TritonMLABackend",
    "TritonMLAMetadata",
    "absorb_query",
    "apply_w_uv",
    "latent_problem",
]

# Prefills of at most this many new tokens run absorbed. Per key (DeepSeek-V3: H 128, L 512,
# R 64, d_nope 128, d_v 128) the absorbed form costs each query 2*H*(L + R + L) = 278K FLOPs;
# the expanded form first expands the key once per request, 2*L*H*(d_nope + d_v) = 33.5 MFLOP.
# Measured on the H200 (2026-12-03, devruns-style timing of this backend's two paths at 8K and
# 32K cached tokens): at 128 new tokens absorbed takes 0.67 / 2.36 ms with the Gluon kernel
# and 1.03 / 3.96 with the Triton one, expanded 1.57 / 6.09; at 256 Gluon still wins 1.4x but
# Triton loses 0.9x. 128 wins on both kernels.
ABSORBED_MAX_QUERY = 128


def latent_problem(q_abs: torch.Tensor, cache: torch.Tensor, kv_lora_rank: int):
    """The kernel problem of absorbed (or sparse) rows [N, H, L + R] over a latent cache (what the
    plan builds from the layer's spec)."""
    return tensor_problem(q_abs, cache, num_heads=q_abs.shape[1], num_kv_heads=1, head_size=q_abs.shape[2],
                          head_size_v=kv_lora_rank, kv_lora_rank=kv_lora_rank)


@dataclass(slots=True)
class TritonMLAMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 where nothing is written
    num_absorbed: int  # N query rows run absorbed: the decodes, then the short prefills' rows
    absorbed_rows: torch.Tensor | None  # [N] int64 token row of each; None: rows 0..N-1
    block_table: torch.Tensor  # [N, max_blocks] int32 each absorbed row's request's blocks
    seq_lens: torch.Tensor  # [N] int32 keys each absorbed row sees (its position + 1)
    max_seq_len: int  # host bound of seq_lens
    prefills: list[tuple[int, int, torch.Tensor]]  # (q_start, q_end, slots [S]) long prefills
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
        q, lens = common.query_start_loc_cpu, common.seq_lens_cpu
        short, long = [], []
        for i in range(nd, common.num_reqs):
            (short if q[i + 1] - q[i] <= ABSORBED_MAX_QUERY else long).append(i)
        metadata = TritonMLAMetadata(
            slot_mapping=common.slot_mappings[group_id],
            num_absorbed=nd,
            absorbed_rows=None,
            block_table=bt[:nd],
            seq_lens=common.seq_lens[:nd],
            max_seq_len=max([*lens[:nd], *(lens[i] for i in short)], default=0),
            prefills=[(q[i], q[i + 1], self._slots(bt[i], lens[i])) for i in long],
        )
        if short:  # a decode-only batch (the graphed kind) never gets here
            self._add_short_prefills(metadata, common, bt, short)
        return metadata

    @staticmethod
    def _add_short_prefills(
        md: TritonMLAMetadata, common: CommonAttentionMetadata, bt: torch.Tensor, short: list[int]
    ) -> None:
        """Extend the absorbed rows (the decodes) with every query row of the ``short``
        prefills: row i of a chunk of q_len new tokens whose request holds seq_len keys after
        this step sees seq_len - q_len + i + 1 keys."""
        nd = common.num_decodes
        q, lens = common.query_start_loc_cpu, common.seq_lens_cpu
        rows, reqs, keys = list(range(nd)), list(range(nd)), list(lens[:nd])
        for i in short:
            q_len = q[i + 1] - q[i]
            rows += range(q[i], q[i + 1])
            reqs += [i] * q_len
            keys += range(lens[i] - q_len + 1, lens[i] + 1)
        index = to_device(torch.tensor([rows, reqs, keys], dtype=torch.int64), bt.device)  # [3, N]
        md.num_absorbed = len(rows)
        md.absorbed_rows = None if rows[-1] == len(rows) - 1 else index[0]  # rows ascend
        md.block_table = bt.index_select(0, index[1])
        md.seq_lens = index[2].to(torch.int32)

    def forward(self, layer, q, k, v, kv_cache, metadata: TritonMLAMetadata) -> torch.Tensor:
        """Write the new latent rows ``k`` and attend; returns [T, H, d_v] in q's dtype."""
        cache = kv_cache["latent"]
        rank, rope, d_nope = layer.kv_lora_rank, layer.qk_rope_head_dim, layer.qk_nope_head_dim
        write_latent_rows(cache, k, metadata.slot_mapping, rank)
        w_kv_b = layer.w_kv_b.to(q.dtype)
        out = q.new_empty(q.shape[0], q.shape[1], w_kv_b.shape[1] - d_nope)
        n, rows = metadata.num_absorbed, metadata.absorbed_rows
        if n:
            q_rows = q[:n] if rows is None else q.index_select(0, rows)  # [N, H, d_nope + R]
            q_abs = absorb_query(q_rows, w_kv_b, d_nope)  # [N, H, L + R]
            u = self.launch("mla.absorbed", lambda: latent_problem(q_abs, cache, rank))(
                q_abs,
                cache,
                metadata.block_table,
                metadata.seq_lens,
                kv_lora_rank=rank,
                scale=layer.scale,
                max_seq_len=metadata.max_seq_len,
                num_splits=metadata.num_splits,
            )  # [N, H, L]
            if rows is None:
                out[:n] = apply_w_uv(u, w_kv_b, d_nope)
            else:
                out.index_copy_(0, rows, apply_w_uv(u, w_kv_b, d_nope))
        for start, end, slots in metadata.prefills:  # the context in chunks of bounded memory
            out[start:end] = prefill_expanded(q[start:end], cache, slots, rank, rope, w_kv_b, layer.scale)
        return out
