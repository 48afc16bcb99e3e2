"""The offload manager: two phases, driven by the scheduler, carried out by the model runner.

Store: when a request's block becomes full (and when a hybrid model snapshots its state at a
block boundary), the scheduler prepares a store of it to the tier; the runner copies the bytes
out before the next forward and completes the store. Load: when a new request's prefix misses
the device cache but the tier holds the next blocks, the scheduler looks them up (fetching and
verifying them, so a corrupt blob shortens the hit instead of corrupting the answer), allocates
device blocks for them, and prepares a load; the runner copies the bytes in before the forward
and completes the load. Blocks are keyed by their chained token hash and KV cache group, so a
block found in the tier holds exactly what recomputing it would produce.

Sliding-window groups follow the device prefix cache (``kvcache/policies.py``): every full block
is stored while it is still on the device, but a hit needs only the blocks the window reaches
back to from the hit's end; the earlier ones are not loaded and stay the null block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from attnserve.kvcache.block_pool import BlockHash
from attnserve.kvcache.offload.tiers import OffloadTier
from attnserve.kvcache.policies import window_blocks_needed

__all__ = ["LoadJob", "OffloadManager", "OffloadStats", "StoreJob", "TierHit"]

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
    failed_stores: int = 0  # blocks the tier could not keep (a full or unwritable disk)


@dataclass(slots=True)
class TierHit:
    """The blocks the tier holds right after a request's device prefix hit."""

    num_blocks: int = 0
    # per block, per group: its bytes, or None where the block falls out of a sliding window
    blobs: list[list[torch.Tensor | None]] = field(default_factory=list)
    state: torch.Tensor | None = None  # hybrid models: the state at the hit's end
    keys: list[tuple] = field(default_factory=list)  # every key fetched (held while loading)

    def num_null_blocks(self, group: int) -> int:
        """Leading blocks of the hit that ``group`` does not load (they stay the null block)."""
        return next((j for j, per_group in enumerate(self.blobs) if per_group[group] is not None), len(self.blobs))


@dataclass(slots=True)
class LoadJob:
    request_id: str
    blocks: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # (group, block id, bytes)
    states: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (state slot, bytes)
    keys: list[tuple] = field(default_factory=list)  # held in the tier until the copy is done
    issued: bool = False  # its copies were issued (the runner then completes it, whatever follows)


@dataclass(slots=True)
class StoreJob:
    blocks: list[tuple[tuple, int, int]] = field(default_factory=list)  # (key, group, block id)
    states: list[tuple[tuple, int]] = field(default_factory=list)  # (key, snapshot slot)


class OffloadManager:
    def __init__(self, tier: OffloadTier, num_groups: int, block_size: int, has_state: bool,
                 windows: list[int | None] | None = None):
        """``windows``: each group's sliding window in tokens, None for full attention (all)."""
        self.tier = tier
        self.num_groups = num_groups
        self.block_size = block_size
        self.has_state = has_state
        windows = windows or [None] * num_groups
        # blocks a hit needs before its end, per group (None: every block)
        self.window_blocks = [None if w is None else window_blocks_needed(w, block_size) for w in windows]
        self.stats = OffloadStats()
        self._stores = StoreJob()
        self._loads: list[LoadJob] = []
        self._stored_upto: dict[str, int] = {}  # request -> blocks already offered to the tier

    # --- loads ------------------------------------------------------------------------------
    def lookup(self, block_hashes: list[BlockHash], start_block: int, max_blocks: int) -> TierHit:
        """The longest run of blocks after ``start_block`` (at most ``max_blocks``) the tier can
        serve: for full groups every block, for sliding groups the blocks their window needs
        before the run's end, for hybrid models the state at its end; their bytes are fetched
        and verified now, and a blob that fails its check shortens the hit."""
        self.stats.queried_tokens += max(max_blocks, 0) * self.block_size
        n = max(max_blocks, 0)
        while n > 0:
            n = self._longest(block_hashes, start_block, n)
            hit = self._fetch(block_hashes, start_block, n) if n else None
            if hit is not None:
                return hit
            # a blob failed its check and left the tier: look again
        return TierHit()

    def _first_needed(self, group: int, n: int) -> int:
        """First block (counted from the hit's start) that a hit of ``n`` blocks loads in ``group``."""
        c = self.window_blocks[group]
        return 0 if c is None else max(0, n - c)

    def _longest(self, block_hashes: list[BlockHash], start: int, n: int) -> int:
        """The longest hit of at most ``n`` blocks whose blobs are all in the tier (by key)."""
        limit = n
        for g in (g for g, c in enumerate(self.window_blocks) if c is None):  # full: every block
            limit = next((j for j in range(limit) if (block_hashes[start + j], g) not in self.tier), limit)
        windowed = []
        for g, c in enumerate(self.window_blocks):
            if c is None:
                continue
            runs, run = [], 0  # runs[j]: blocks present in a row, ending at block start + j
            for k in range(start, start + limit):
                run = run + 1 if (block_hashes[k], g) in self.tier else 0
                runs.append(run)
            windowed.append((c, runs))
        for m in range(limit, 0, -1):
            # blocks before the hit's start that a window needs are device hits, already there
            if all(runs[m - 1] >= min(m, c) for c, runs in windowed) and \
                    (not self.has_state or (block_hashes[start + m - 1], STATE) in self.tier):
                return m
        return 0

    def _fetch(self, block_hashes: list[BlockHash], start: int, n: int) -> TierHit | None:
        hit = TierHit(n)
        for j in range(n):
            per_group: list[torch.Tensor | None] = []
            for g in range(self.num_groups):
                if j < self._first_needed(g, n):
                    per_group.append(None)
                    continue
                key = (block_hashes[start + j], g)
                per_group.append(self.tier.get(key))
                if per_group[-1] is None:
                    return None
                hit.keys.append(key)
            hit.blobs.append(per_group)
        if self.has_state:
            key = (block_hashes[start + n - 1], STATE)
            hit.state = self.tier.get(key)
            if hit.state is None:
                return None
            hit.keys.append(key)
        return hit

    def prepare_load(self, request_id: str, hit: TierHit, block_ids: list[list[int]], start_block: int,
                     state_slot: int) -> None:
        """Plan the copies of ``hit`` into the request's new blocks (a sliding group's blocks
        outside its window must be the null block), holding the blobs in the tier until done."""
        job = LoadJob(request_id, keys=list(hit.keys))
        for j, per_group in enumerate(hit.blobs):
            for g, data in enumerate(per_group):
                block_id = block_ids[g][start_block + j]
                assert (data is None) == (block_id == 0), "a loaded block must be allocated, a skipped one null"
                if data is not None:
                    job.blocks.append((g, block_id, data))
        if hit.state is not None:
            job.states.append((state_slot, hit.state))
        self.tier.hold(job.keys)
        self.stats.hit_tokens += hit.num_blocks * self.block_size
        self._stored_upto[request_id] = start_block + hit.num_blocks  # already in the tier
        self._loads.append(job)

    def complete_load(self, job: LoadJob, seconds: float) -> None:
        """The copy of ``job`` is done (its bytes are on the device): release its blobs."""
        self.tier.release(job.keys)
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

    def store_buffer(self, key: tuple, nbytes: int) -> torch.Tensor | None:
        """Where the runner copies a prepared store's bytes (None: skip it, the tier is busy or
        has it already); the blob is readable only after ``complete_store``."""
        return self.tier.reserve(key, nbytes)

    def cancel_loads(self, loads: list[LoadJob]) -> None:
        """A step failed before its copies were issued: release what its loads held in the tier
        (its requests recompute; issued ones complete as usual)."""
        for job in loads:
            if not job.issued:
                self.tier.release(job.keys)
                self.stats.failed_loads += 1

    def complete_store(self, key: tuple, nbytes: int) -> None:
        if self.tier.commit(key):
            self.stats.bytes_stored += nbytes
        else:
            self.stats.failed_stores += 1

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
