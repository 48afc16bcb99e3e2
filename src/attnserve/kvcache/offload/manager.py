"""The offload manager: two phases, driven by the scheduler, carried out by the model runner.

Store: when a request's block becomes full (and when a hybrid model snapshots its state at a
block boundary), the scheduler prepares a store of it to the tier; the runner copies the bytes
out before the next forward and completes the store. Load: when a new request's prefix misses
the device cache but the tier holds the next blocks, the scheduler looks them up (fetching and
verifying them, so a corrupt blob shortens the hit instead of corrupting the answer), allocates
device blocks for them, and prepares a load; the runner copies the bytes in before the forward
and completes the load. Blocks are keyed by their chained token hash and KV cache group, so a
block found in the tier holds exactly what recomputing it would produce.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from attnserve.kvcache.block_pool import BlockHash
from attnserve.kvcache.offload.tiers import OffloadTier

__all__ = ["LoadJob", "OffloadManager", "OffloadStats", "StoreJob"]

STATE = -1  # the group id under which state snapshots are keyed


@dataclass(slots=True)
class OffloadStats:
    hit_tokens: int = 0  # prompt tokens served from the tier instead of recomputed
    queried_tokens: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    failed_loads: int = 0


@dataclass(slots=True)
class LoadJob:
    request_id: str
    blocks: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # (group, block id, bytes)
    states: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (state slot, bytes)


@dataclass(slots=True)
class StoreJob:
    blocks: list[tuple[tuple, int, int]] = field(default_factory=list)  # (key, group, block id)
    states: list[tuple[tuple, int]] = field(default_factory=list)  # (key, snapshot slot)


class OffloadManager:
    def __init__(self, tier: OffloadTier, num_groups: int, block_size: int, has_state: bool):
        self.tier = tier
        self.num_groups = num_groups
        self.block_size = block_size
        self.has_state = has_state
        self.stats = OffloadStats()
        self._stores = StoreJob()
        self._loads: list[LoadJob] = []
        self._stored_upto: dict[str, int] = {}  # request -> blocks already offered to the tier

    # --- loads ------------------------------------------------------------------------------
    def lookup(self, block_hashes: list[BlockHash], start_block: int, max_blocks: int
               ) -> tuple[int, list[list[torch.Tensor]], torch.Tensor | None]:
        """How many blocks after ``start_block`` the tier holds for every group (and, for hybrid
        models, the state at the last of them), with their bytes, fetched and verified now.

        Returns:
            (number of blocks, per-block lists of per-group bytes, state bytes or None).
        """
        self.stats.queried_tokens += max(max_blocks, 0) * self.block_size
        found: list[list[torch.Tensor]] = []
        for k in range(start_block, start_block + max(max_blocks, 0)):
            blobs = [self.tier.get((block_hashes[k], g)) for g in range(self.num_groups)]
            if any(b is None for b in blobs):
                break
            found.append(blobs)
        state = None
        while found and self.has_state:  # a hybrid hit also needs the state at its end
            state = self.tier.get((block_hashes[start_block + len(found) - 1], STATE))
            if state is not None:
                break
            found.pop()
        return len(found), found, state

    def prepare_load(self, request_id: str, blobs: list[list[torch.Tensor]], block_ids: list[list[int]],
                     start_block: int, state: torch.Tensor | None, state_slot: int) -> None:
        job = LoadJob(request_id)
        for j, per_group in enumerate(blobs):
            for g, data in enumerate(per_group):
                job.blocks.append((g, block_ids[g][start_block + j], data))
        if state is not None:
            job.states.append((state_slot, state))
        self.stats.hit_tokens += len(blobs) * self.block_size
        self._stored_upto[request_id] = start_block + len(blobs)  # already in the tier
        self._loads.append(job)

    def complete_load(self, job: LoadJob, seconds: float) -> None:
        self.stats.bytes_loaded += sum(d.numel() for _, _, d in job.blocks) + sum(d.numel() for _, d in job.states)
        self.stats.load_seconds += seconds

    # --- stores -----------------------------------------------------------------------------
    def prepare_store(self, request_id: str, block_hashes: list[BlockHash], block_ids: list[list[int]],
                      num_computed_tokens: int) -> None:
        """Offer the request's newly full blocks to the tier (those it does not hold yet)."""
        full = min(num_computed_tokens // self.block_size, len(block_hashes))
        for k in range(self._stored_upto.get(request_id, 0), full):
            for g in range(self.num_groups):
                key = (block_hashes[k], g)
                if key not in self.tier and block_ids[g][k] != 0:
                    self._stores.blocks.append((key, g, block_ids[g][k]))
        self._stored_upto[request_id] = max(full, self._stored_upto.get(request_id, 0))

    def prepare_state_store(self, block_hash: BlockHash, snapshot_slot: int) -> None:
        key = (block_hash, STATE)
        if key not in self.tier:
            self._stores.states.append((key, snapshot_slot))

    def complete_store(self, key: tuple, data: torch.Tensor) -> None:
        self.tier.put(key, data)
        self.stats.bytes_stored += data.numel()

    def forget(self, request_id: str) -> None:
        self._stored_upto.pop(request_id, None)

    # --- hand-off to the runner -----------------------------------------------------------------
    def take_jobs(self) -> tuple[StoreJob, list[LoadJob]]:
        stores, loads = self._stores, self._loads
        self._stores, self._loads = StoreJob(), []
        return stores, loads


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start
