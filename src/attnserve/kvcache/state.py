"""Per-sequence state of hybrid models: a slot pool, and prefix-cache snapshots of it.

State layers (Gated DeltaNet, Mamba, lightning, KDA) keep a fixed-size state per sequence
instead of per-token K/V. Paging buys nothing there, so the state lives in a pool of slots
carved from the same memory budget as the KV blocks: one slot per running sequence, plus
snapshot slots that hold the state at block boundaries so a prefix hit can restore it
(least recently used snapshots are evicted first). This file knows slot ids and block hashes,
not tensors; copies between slots are returned as (src, dst) pairs for the model runner to
carry out.

Slot 0 is the null slot: never allocated, snapshotted, stored or loaded. The padded rows of a
replayed CUDA graph advance it (``runner/cuda_graph.py``), so its content is scratch; nothing
reads it as a state (a request starts from zeros where ``has_initial_state`` is False, whatever
its slot holds).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from attnserve.kvcache.block_pool import BlockHash

__all__ = ["StateCache", "StatePool"]


@dataclass(slots=True)
class StateCache:
    """One state layer's tensors, each [num_slots, *shape]."""

    conv: tuple[torch.Tensor, ...]
    recurrent: tuple[torch.Tensor, ...]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.conv + self.recurrent


class StatePool:
    def __init__(self, num_running: int, num_snapshots: int):
        if num_running < 1:
            raise ValueError("the state pool needs at least one running slot")
        self.num_slots = 1 + num_running + num_snapshots
        self._free_running = list(range(num_running, 0, -1))
        self._free_snapshots = list(range(self.num_slots - 1, num_running, -1))
        self.slot_of: dict[str, int] = {}
        self.snapshots: OrderedDict[BlockHash, int] = OrderedDict()  # LRU order, oldest first
        self.num_hits = 0

    @property
    def num_free_running(self) -> int:
        return len(self._free_running)

    def allocate(self, request_id: str) -> int:
        if request_id in self.slot_of:
            return self.slot_of[request_id]
        if not self._free_running:
            raise RuntimeError("no free state slot (the scheduler admits at most max_num_seqs requests)")
        slot = self._free_running.pop()
        self.slot_of[request_id] = slot
        return slot

    def free(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self._free_running.append(slot)

    def lookup(self, block_hash: BlockHash) -> int | None:
        slot = self.snapshots.get(block_hash)
        if slot is not None:
            self.snapshots.move_to_end(block_hash)
        return slot

    def reserve_snapshot(self, block_hash: BlockHash) -> int | None:
        """A snapshot slot for ``block_hash`` (evicting the least recently used one), or None
        when it is already snapshotted or the pool has no snapshot slots."""
        if block_hash in self.snapshots:
            self.snapshots.move_to_end(block_hash)
            return None
        if self._free_snapshots:
            slot = self._free_snapshots.pop()
        elif self.snapshots:
            _, slot = self.snapshots.popitem(last=False)
        else:
            return None
        self.snapshots[block_hash] = slot
        return slot

    def check_integrity(self) -> None:
        running = set(self.slot_of.values())
        snaps = set(self.snapshots.values())
        free_r, free_s = set(self._free_running), set(self._free_snapshots)
        assert len(running) == len(self.slot_of), "two requests share a state slot"
        assert len(snaps) == len(self.snapshots), "two snapshots share a slot"
        everything = [running, snaps, free_r, free_s]
        assert sum(len(s) for s in everything) == self.num_slots - 1, "a state slot was lost"
        assert not (running & free_r) and not (snaps & free_s), "a slot is both used and free"
        assert 0 not in running | snaps | free_r | free_s, "the null slot is in use"
