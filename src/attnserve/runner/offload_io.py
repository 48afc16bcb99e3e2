"""Moving KV blocks and state snapshots between the device cache and the offload tier.

One block of one KV cache group is the concatenation, in layer order, of that block's page in
every tensor of the group (K and V, latent rows, indexer keys): one contiguous blob per block,
so a tier entry is self-contained. A state snapshot is the concatenation of one slot of every
state tensor. Bytes are copied as they are (raw views), so a round trip is bit-exact for every
cache dtype, fp8 included.

Blocks move in chunks: every layer's pages of a chunk's blocks are gathered on the device into
one contiguous ``[blocks, blob]`` buffer (one ``index_select`` per cache tensor), and each block
then crosses to the host in one copy of its whole blob, straight into the tier's (pinned) slot;
loads copy blobs into such a buffer and scatter it back (one ``index_copy_`` per tensor).

Ordering on CUDA, with ``stream`` this class's side stream and ``compute`` the current one:

1. ``stream`` waits for ``compute``, so stores read what earlier forwards and this step's
   state copies wrote.
2. On ``stream`` the step's stores are issued before its loads: a load may write a block that
   a store still reads (freed, evicted, allocated again), and one stream keeps them in order.
3. ``compute`` waits for ``stream`` (an event) before the forward when the step has loads (the
   forward reads them), when a store reads state snapshots (the next step's state copies may
   overwrite them), or when a store still in flight reads a block this step writes. Otherwise
   the stores overlap the forward.
4. A store completes (its blob becomes readable in the tier) only once its event has fired,
   and a load's source blobs stay held in the tier until its event has fired, so no eviction
   overwrites them mid-copy. ``poll`` checks the events without blocking, at every step.

On CPU there is no side stream: every copy is synchronous and completes at once, in the same
order, with the same bytes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from attnserve.kvcache.groups import KVCacheGroup
from attnserve.kvcache.offload.manager import STATE, LoadJob, OffloadManager, StoreJob
from attnserve.kvcache.state import StateCache

if TYPE_CHECKING:
    from attnserve.core.step import ScheduledRequest

__all__ = ["OffloadIO", "Transfer", "fence_for", "written_blocks"]


def _pages(t: torch.Tensor) -> torch.Tensor:
    """[num_blocks (or slots), page bytes], a view: writes through it land in the cache."""
    return t.view(t.shape[0], -1).view(torch.uint8)


def _runs(bufs: list[torch.Tensor]) -> list[tuple[int, int, torch.Tensor]]:
    """Split equal-size host buffers into runs that lie back to back in one storage (tier slots
    taken in order usually do), as (first, end, one view over the run): one copy per run."""
    out, first = [], 0
    for j in range(1, len(bufs) + 1):
        prev = bufs[j - 1]
        if j < len(bufs) and bufs[j].numel() == prev.numel() \
                and bufs[j].untyped_storage().data_ptr() == prev.untyped_storage().data_ptr() \
                and bufs[j].storage_offset() == prev.storage_offset() + prev.numel():
            continue
        head = bufs[first]
        out.append((first, j, head.as_strided(((j - first) * head.numel(),), (1,))))
        first = j
    return out


def written_blocks(scheduled: list[ScheduledRequest], block_size: int) -> set[tuple[int, int]]:
    """(group, block id) of every block this step's forward writes new tokens into."""
    out = set()
    for s in scheduled:
        first, last = s.start // block_size, (s.start + s.num_new_tokens - 1) // block_size
        for g, blocks in enumerate(s.block_ids):
            out.update((g, b) for b in blocks[first:last + 1])
    return out


@dataclass(slots=True)
class Transfer:
    """One step's copies; on CUDA, issued on the side stream and finished when ``done`` fires."""

    stores: list[tuple[tuple, int]] = field(default_factory=list)  # (key, bytes)
    loads: list[LoadJob] = field(default_factory=list)
    reads: set[tuple[int, int]] = field(default_factory=set)  # (group, block id) the stores read
    reads_state: bool = False
    events: tuple = ()  # CUDA: (start, stores issued, done)
    seconds: tuple[float, float] = (0.0, 0.0)  # CPU: (stores, loads)


def fence_for(inflight: Sequence[Transfer], writes: set[tuple[int, int]]) -> Transfer | None:
    """Of the transfers in flight (oldest first), the last one the coming forward must wait for:
    it loads (the forward reads them), reads state snapshots, or reads a block in ``writes``
    (``written_blocks``); None if none does. The side stream runs in order, so waiting for it
    waits for every transfer before it too."""
    return next((t for t in reversed(inflight)
                 if t.loads or t.reads_state or not t.reads.isdisjoint(writes)), None)


class OffloadIO:
    def __init__(self, groups: list[KVCacheGroup], caches: dict, state_caches: list[StateCache],
                 device: torch.device | None = None, chunk_bytes: int = 64 << 20):
        """``chunk_bytes``: the largest device buffer a gather or scatter uses at once."""
        self.layouts: dict[int, list[torch.Tensor]] = {}  # group (STATE: snapshots) -> page views
        for i, g in enumerate(groups):
            tensors = []
            for e in g.entries:
                value = caches[(e.layer, e.name)]
                tensors.extend(value if isinstance(value, tuple) else (value,))
            self.layouts[i] = [_pages(t) for t in tensors]
        self.layouts[STATE] = [_pages(t) for c in state_caches for t in c.tensors()]
        self.device = device or torch.device("cpu")
        self.chunk_bytes = chunk_bytes
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._inflight: deque[Transfer] = deque()

    def block_bytes(self, group: int) -> int:
        return sum(p.shape[1] for p in self.layouts[group])

    def state_bytes(self) -> int:
        return self.block_bytes(STATE)

    # --- the step ---------------------------------------------------------------------------
    def run(self, manager: OffloadManager, stores: StoreJob, loads: list[LoadJob],
            writes: set[tuple[int, int]] = frozenset()) -> None:
        """Issue this step's stores, then its loads; ``writes``: blocks the coming forward writes."""
        self.poll(manager)
        t = Transfer()
        if self.stream is None:
            self._issue(manager, t, stores, loads)
            self._finish(manager, t)
            return
        compute = torch.cuda.current_stream(self.device)
        if stores.blocks or stores.states or loads:
            self.stream.wait_stream(compute)
            t.events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
            with torch.cuda.stream(self.stream):
                self._issue(manager, t, stores, loads)
            self._inflight.append(t)
        fence = fence_for(self._inflight, writes)
        if fence is not None:  # the side stream is in order: the last such event covers the rest
            compute.wait_event(fence.events[2])

    def poll(self, manager: OffloadManager, wait: bool = False) -> None:
        """Complete the transfers whose copies are done (all of them, waiting, if ``wait``)."""
        while self._inflight and (wait or self._inflight[0].events[2].query()):
            t = self._inflight.popleft()
            t.events[2].synchronize()
            start, mid, done = t.events
            t.seconds = (start.elapsed_time(mid) / 1e3, mid.elapsed_time(done) / 1e3)
            self._finish(manager, t)

    def _finish(self, manager: OffloadManager, t: Transfer) -> None:
        for key, nbytes in t.stores:
            manager.complete_store(key, nbytes)
        manager.stats.store_seconds += t.seconds[0]
        for job in t.loads:
            manager.complete_load(job, t.seconds[1] / len(t.loads))

    def _issue(self, manager: OffloadManager, t: Transfer, stores: StoreJob, loads: list[LoadJob]) -> None:
        clock = time.perf_counter()
        if t.events:
            t.events[0].record()
        for layout, items in self._reserve(manager, t, stores).items():
            self._store(layout, items)
        mid = time.perf_counter()
        if t.events:
            t.events[1].record()
        into: dict[int, list[tuple[int, torch.Tensor]]] = {}  # layout -> (block id or slot, blob)
        for job in loads:
            for group, block_id, data in job.blocks:
                into.setdefault(group, []).append((block_id, data))
            for slot, data in job.states:
                into.setdefault(STATE, []).append((slot, data))
        for layout, items in into.items():
            self._load(layout, items)
        t.loads = list(loads)
        for job in loads:
            job.issued = True
        if t.events:
            t.events[2].record()
        else:
            t.seconds = (mid - clock, time.perf_counter() - mid)

    def _reserve(self, manager: OffloadManager, t: Transfer, stores: StoreJob
                 ) -> dict[int, list[tuple[int, torch.Tensor]]]:
        """Tier buffers for the stores, by layout: (block id or slot, buffer); the tier skips what
        it has already and what it has no free or evictable slot for."""
        out: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for key, layout, index in [*stores.blocks, *((k, STATE, s) for k, s in stores.states)]:
            nbytes = self.block_bytes(layout)
            buf = manager.store_buffer(key, nbytes)
            if buf is None:
                continue
            out.setdefault(layout, []).append((index, buf))
            t.stores.append((key, nbytes))
            if layout == STATE:
                t.reads_state = True
            else:
                t.reads.add((layout, index))
        return out

    # --- copies -----------------------------------------------------------------------------
    def _chunks(self, layout: int, items: list):
        step = max(1, self.chunk_bytes // max(1, self.block_bytes(layout)))
        for i in range(0, len(items), step):
            chunk = items[i:i + step]
            ids = torch.tensor([index for index, _ in chunk], dtype=torch.int64).to(self.device, non_blocking=True)
            yield chunk, ids

    def _store(self, layout: int, items: list[tuple[int, torch.Tensor]]) -> None:
        """Copy pages ``index`` of every tensor of ``layout`` into the tier buffers, one blob each."""
        pages = self.layouts[layout]
        for chunk, ids in self._chunks(layout, items):
            stage = torch.empty(len(chunk), self.block_bytes(layout), dtype=torch.uint8, device=self.device)
            offset = 0
            for p in pages:  # stage[:, offset: offset + page] = p[ids]
                dst = stage[:, offset: offset + p.shape[1]]
                if p.device == stage.device:
                    torch.index_select(p, 0, ids, out=dst)
                else:  # a cache kept in host memory
                    dst.copy_(p.index_select(0, ids.to(p.device)))
                offset += p.shape[1]
            for a, b, buf in _runs([buf for _, buf in chunk]):
                buf.copy_(stage[a:b].view(-1), non_blocking=True)

    def _load(self, layout: int, items: list[tuple[int, torch.Tensor]]) -> None:
        """Copy each blob into pages ``index`` of every tensor of ``layout``."""
        pages = self.layouts[layout]
        for chunk, ids in self._chunks(layout, items):
            stage = torch.empty(len(chunk), self.block_bytes(layout), dtype=torch.uint8, device=self.device)
            for a, b, data in _runs([data for _, data in chunk]):
                stage[a:b].view(-1).copy_(data, non_blocking=True)
            offset = 0
            for p in pages:  # p[ids] = stage[:, offset: offset + page]
                p.index_copy_(0, ids.to(p.device), stage[:, offset: offset + p.shape[1]].to(p.device))
                offset += p.shape[1]
