"""Sparse MLA with its latent cache in host memory (``kv_offload_sparse_latents``).

DSA attends each query over only its top-k latent rows (``index_topk``: 2048 in DeepSeek-V3.2
and GLM-5), which the lightning indexer picks from its own, much smaller key cache. So the
latent cache of a sparse layer can live in host memory while the indexer cache stays on the
device: per token and layer the device then holds 132 bytes (fp8 indexer key) instead of 788,
and host memory the 656-byte latent row.

``HostLatentSparseBackend(inner)`` wraps the group's selected backend (TORCH_MLA_SPARSE or
TRITON_MLA_SPARSE) and keeps its arithmetic:

- ``select_topk`` is the inner one, over the device indexer cache;
- ``forward`` packs the new latent rows on the device (model dtype, or the 656-byte fp8 rows),
  writes them to their slots of the host cache, gathers the rows the step attends over into a
  small device *staging* cache, and runs the inner backend's ``attend`` on it. The staging
  cache is paged like the real one (same page size), in this order:

  - page 0, host block 0 (the null block);
  - each prefill request's whole sequence, page by page (its queries together select most of
    its rows, where gathering per query would move K rows for every query), indices unchanged;
  - ``ceil(K / block_size)`` pages per one-token row (a decode) holding its K selected rows in
    index order (a -1 slot holds position 0's row, where the inner backend reads for it); its
    indices become 0..K-1 (-1 kept).

  The inner ``attend`` then reads the same values in the same order, through the same chunks
  and kernel launches (same rows, top-k width and splits): the output is bit-identical to the
  all-on-device path.

Per step, the staging layout (with the inner backend's metadata over it) and the host blocks
of the prefill pages are found once; per layer, the decodes' selected slots are looked up on
the host, which costs one device-to-host copy of their top-k indices. On CUDA the host cache
is pinned; pages and rows are gathered on the CPU (``index_select`` into a reused pinned
buffer) and copied in with one transfer per layer, and the new rows come out with one copy.
Each forward synchronises with the host, so these steps run without CUDA graphs. Not here:
the sizing and the checks (``runner/host_latents.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from attnserve.attention.backend import AttentionBackend
from attnserve.attention.backends.torch_mla import pack_latent_rows
from attnserve.attention.metadata import CommonAttentionMetadata

__all__ = ["HostLatentMetadata", "HostLatentSparseBackend"]


@dataclass(slots=True)
class HostLatentMetadata:
    inner: Any  # the inner backend's metadata of the step (select_topk: the device indexer)
    common: CommonAttentionMetadata
    group_id: int
    write_rows: torch.Tensor  # [N] int64 (device): the new rows that have a slot
    write_slots: torch.Tensor  # [N] int64 (host): their host slots
    decode_tables: torch.Tensor  # [num_decodes, max_blocks] int64 (host) block tables
    pages: torch.Tensor  # int64 (host): host blocks of staging pages 0.. (null, then prefills')
    prefill_pages: list[int]  # staging pages of each prefill request
    staged: dict[int, Any] = field(default_factory=dict)  # top-k width -> inner metadata

    @property
    def num_decodes(self) -> int:
        return self.common.num_decodes


class HostLatentSparseBackend(AttentionBackend):
    """Host-resident latent cache, device indexer cache, staged rows: see the module doc."""

    def __init__(self, inner: AttentionBackend, block_size: int, device: torch.device):
        self.inner = inner
        self.name = inner.name  # the arithmetic, and so the name, is the inner backend's
        self.kernels = inner.kernels  # and so are its kernel variants
        self.block_size = block_size
        self.device = device
        self._pinned: torch.Tensor | None = None  # CUDA: reused host buffer of gathered rows
        self._copied: Any = None  # CUDA event: the last copy out of ``_pinned`` is done

    def build_metadata(self, common: CommonAttentionMetadata, group_id: int) -> HostLatentMetadata:
        bs, nd = self.block_size, common.num_decodes
        tables = common.block_tables[group_id].to("cpu", torch.int64)  # [B, max_blocks]
        slot_mapping = common.slot_mappings[group_id]
        keep = slot_mapping >= 0
        sizes = [-(-common.seq_lens_cpu[r] // bs) for r in range(nd, common.num_reqs)]
        pages = [tables.new_zeros(1)]  # staging page 0: host block 0, the null block
        pages += [tables[nd + i, :n] for i, n in enumerate(sizes)]
        return HostLatentMetadata(
            inner=self.inner.build_metadata(common, group_id),
            common=common,
            group_id=group_id,
            write_rows=keep.nonzero().squeeze(1),
            write_slots=slot_mapping[keep].cpu(),
            decode_tables=tables[:nd],
            pages=torch.cat(pages),
            prefill_pages=sizes,
        )

    def _staged_metadata(self, md: HostLatentMetadata, topk: int) -> Any:
        """The inner backend's metadata over the staging layout for a top-k width: page 0 null,
        then each prefill request's pages (its own length), then ``p = ceil(topk / block_size)``
        pages per decode, holding its selected rows (length ``topk``)."""
        common, nd = md.common, md.num_decodes
        per_decode = -(-topk // self.block_size)
        width = max([per_decode if nd else 1, *md.prefill_pages])
        table = torch.zeros(common.num_reqs, width, dtype=torch.int32)
        page = 1
        for i, n in enumerate(md.prefill_pages):
            table[nd + i, :n] = torch.arange(page, page + n)
            page += n
        table[:nd, :per_decode] = page + torch.arange(nd * per_decode).view(nd, per_decode)
        seq_lens = [topk] * nd + common.seq_lens_cpu[nd:]
        tables = list(common.block_tables)
        tables[md.group_id] = table.to(common.block_tables[md.group_id].device)
        staged = replace(
            common,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=common.seq_lens.device),
            block_tables=tables,
            seq_lens_cpu=seq_lens,
            max_seq_len=max(seq_lens),
        )
        return self.inner.build_metadata(staged, md.group_id)

    def select_topk(self, q, k, weights, kv_cache, metadata: HostLatentMetadata, *, topk: int):
        """The inner backend's selection over the device indexer cache."""
        return self.inner.select_topk(q, k, weights, kv_cache, metadata.inner, topk=topk)

    def forward(
        self,
        layer,
        q,
        k,
        v,
        kv_cache,
        metadata: HostLatentMetadata,
        *,
        topk_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write the new latent rows ``k`` to the host cache, stage the selected rows on the
        device and attend there (arguments and result as the inner backend's ``forward``)."""
        if topk_indices is None:
            raise ValueError(f"{self.name} attends over top-k indices: pass topk_indices")
        md, host = metadata, kv_cache["latent"]  # host: [num_blocks, block_size, W]
        rows = pack_latent_rows(k[md.write_rows], host, layer.kv_lora_rank)
        host.view(-1, host.shape[-1]).index_copy_(0, md.write_slots, rows.to(host.device))
        topk = topk_indices.shape[1]
        if topk not in md.staged:
            md.staged[topk] = self._staged_metadata(md, topk)
        staging = self._gather(host, md.pages, self._decode_slots(md, topk_indices))
        nd = md.num_decodes
        if nd:  # decode rows find their K rows at staged positions 0..K-1
            idx = topk_indices.clone()
            order = torch.arange(topk, dtype=idx.dtype, device=idx.device)
            idx[:nd] = torch.where(idx[:nd] >= 0, order, -1)
            topk_indices = idx
        return self.inner.attend(layer, q, staging, md.staged[topk], topk_indices)

    def _decode_slots(self, md: HostLatentMetadata, topk_indices: torch.Tensor) -> torch.Tensor:
        """Host slots of the decodes' selected rows, [num_decodes * p * block_size]: each row's
        K slots in index order (position 0's for a -1 slot), padded to whole pages with the null
        slot 0."""
        nd, bs = md.num_decodes, self.block_size
        if not nd:
            return md.pages.new_zeros(0)
        pos = topk_indices[:nd].to("cpu", torch.int64).clamp(min=0)  # [nd, K]
        slots = md.decode_tables.gather(1, pos // bs) * bs + pos % bs  # [nd, K]
        pad = -pos.shape[1] % bs
        if pad:
            slots = torch.cat([slots, slots.new_zeros(nd, pad)], dim=1)
        return slots.flatten()

    def _gather(self, host: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The staging cache on the device: host ``pages`` (whole blocks), then host ``rows``
        (slots), as [len(pages) + len(rows) / block_size, block_size, W]."""
        bs, width = self.block_size, host.shape[-1]
        n = pages.numel() * bs + rows.numel()
        buf = self._host_buffer(n, host.dtype, width)
        torch.index_select(host, 0, pages, out=buf[: pages.numel() * bs].view(-1, bs, width))
        torch.index_select(host.view(-1, width), 0, rows, out=buf[pages.numel() * bs :])
        if self.device.type != "cuda":
            return buf.view(-1, bs, width)
        out = buf.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out.view(-1, bs, width)

    def _host_buffer(self, n: int, dtype: torch.dtype, width: int) -> torch.Tensor:
        """[n, width] host rows to gather into: new on CPU; on CUDA a reused pinned buffer,
        once the previous copy out of it has finished."""
        if self.device.type != "cuda":
            return torch.empty(n, width, dtype=dtype)
        buf = self._pinned
        if buf is None or buf.shape[0] < n or buf.dtype != dtype or buf.shape[1] != width:
            size = max(n, 2 * buf.shape[0] if buf is not None else 0)
            buf = self._pinned = torch.empty(size, width, dtype=dtype, pin_memory=True)
        elif self._copied is not None:
            self._copied.synchronize()
        return buf[:n]
