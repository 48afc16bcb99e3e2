"""Moving KV blocks and state snapshots between the device cache and the offload tier.

One block of one KV cache group is the concatenation, in layer order, of that block's page in
every tensor of the group (K and V, latent rows, indexer keys): one contiguous blob per block,
so a transfer is one copy per tensor and a tier entry is self-contained. A state snapshot is
the concatenation of one slot of every state tensor. Bytes are copied as they are (raw views),
so a round trip is bit-exact for every cache dtype, fp8 included.
"""

from __future__ import annotations

import time

import torch

from attnserve.kvcache.groups import KVCacheGroup
from attnserve.kvcache.offload.manager import LoadJob, OffloadManager, StoreJob
from attnserve.kvcache.state import StateCache

__all__ = ["OffloadIO"]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class OffloadIO:
    def __init__(self, groups: list[KVCacheGroup], caches: dict, state_caches: list[StateCache]):
        self.group_tensors: list[list[torch.Tensor]] = []
        for g in groups:
            tensors = []
            for e in g.entries:
                value = caches[(e.layer, e.name)]
                tensors.extend(value if isinstance(value, tuple) else (value,))
            self.group_tensors.append(tensors)
        self.state_tensors = [t for c in state_caches for t in c.tensors()]

    def block_bytes(self, group: int) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.group_tensors[group])

    def state_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.state_tensors)

    def read_block(self, group: int, block_id: int) -> torch.Tensor:
        return torch.cat([_flat(t[block_id]).cpu() for t in self.group_tensors[group]])

    def write_block(self, group: int, block_id: int, data: torch.Tensor) -> None:
        offset = 0
        for t in self.group_tensors[group]:
            dst = _flat(t[block_id])
            dst.copy_(data[offset: offset + dst.numel()], non_blocking=True)
            offset += dst.numel()

    def read_state(self, slot: int) -> torch.Tensor:
        return torch.cat([_flat(t[slot]).cpu() for t in self.state_tensors])

    def write_state(self, slot: int, data: torch.Tensor) -> None:
        offset = 0
        for t in self.state_tensors:
            dst = _flat(t[slot])
            dst.copy_(data[offset: offset + dst.numel()], non_blocking=True)
            offset += dst.numel()

    def run(self, manager: OffloadManager, stores: StoreJob, loads: list[LoadJob]) -> None:
        """Stores first (they read blocks a load may overwrite), then loads."""
        start = time.perf_counter()
        for key, group, block_id in stores.blocks:
            manager.complete_store(key, self.read_block(group, block_id))
        for key, slot in stores.states:
            manager.complete_store(key, self.read_state(slot))
        manager.stats.store_seconds += time.perf_counter() - start
        for job in loads:
            start = time.perf_counter()
            for group, block_id, data in job.blocks:
                self.write_block(group, block_id, data)
            for slot, data in job.states:
                self.write_state(slot, data)
            manager.complete_load(job, time.perf_counter() - start)
