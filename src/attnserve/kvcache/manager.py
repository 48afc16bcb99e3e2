"""KVCacheManager: the scheduler's view of the KV cache across every group.

It answers three questions for the scheduler: how much of a prompt is already cached
(``get_computed_blocks``), can these new tokens get slots (``allocate_slots``, all groups or
none), and give a request's blocks back (``free``). One block pool serves every group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from attnserve.kvcache.block_pool import BlockHash, BlockPool, KVCacheBlock
from attnserve.kvcache.groups import KVCacheGroup
from attnserve.kvcache.policies import SingleTypeManager, create_manager
from attnserve.kvcache.spec import CachePolicy
from attnserve.kvcache.state import StatePool

__all__ = ["CacheRequest", "KVCacheManager"]


class CacheRequest(Protocol):
    """What the KV cache reads of a request (``core.Request`` is one): the cache knows block
    hashes and token counts, not prompts, sampling or outputs."""

    request_id: str
    num_computed_tokens: int
    cacheable: bool  # False: never served from or stored in the prefix cache

    @property
    def num_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> Sequence[BlockHash]: ...

    @property
    def skip_prefix_cache(self) -> bool: ...


class KVCacheManager:
    def __init__(self, groups: list[KVCacheGroup], num_blocks: int, enable_caching: bool = True,
                 state_pool: StatePool | None = None):
        if not groups:
            raise ValueError("a KV cache manager needs at least one group")
        self.groups = groups
        self.block_size = groups[0].block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.managers: list[SingleTypeManager] = [create_manager(g, self.pool) for g in groups]
        self._no_hits: tuple[list[KVCacheBlock], ...] = tuple([] for _ in groups)  # never filled
        # full attention never drops a running request's blocks: tokens that fit the blocks it
        # holds need no allocation at all (``allocate_slots``' fast path)
        self._blocks_only_grow = all(g.policy == CachePolicy.FULL for g in groups)
        # hybrid models: per-sequence state slots, and snapshots at block boundaries
        self.state_pool = state_pool
        self._restore: dict[str, int] = {}  # request -> snapshot slot its prefix hit restores
        self._state_copies: list[tuple[int, int]] = []  # (src slot, dst slot), in order

    @property
    def snapshots_enabled(self) -> bool:
        return self.state_pool is not None and self.enable_caching

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: CacheRequest) -> tuple[list[list[KVCacheBlock]], int]:
        """Cache hits for a request that holds no blocks: per-group blocks and the hit length.

        The last prompt token is always recomputed (its logits start the generation), so a hit
        covers at most ``num_tokens - 1`` tokens, in whole blocks, the same length in every group.
        """
        empty: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        if not self.enable_caching or request.skip_prefix_cache:
            return empty, 0
        self.pool.num_queries += request.num_tokens
        length = request.num_tokens - 1
        hits = empty
        while True:  # shrink until every group (and the state snapshots) agree on one length
            hits = [m.find_longest_cache_hit(request.block_hashes, length) for m in self.managers]
            agreed = min(len(h) for h in hits) * self.block_size
            if self.state_pool is not None:
                agreed = self._snapshot_length(request, agreed)
            if agreed == length or agreed == 0 or all(len(h) * self.block_size == agreed for h in hits):
                length = agreed
                break
            length = agreed
        hits = [h[: length // self.block_size] for h in hits]
        self._restore.pop(request.request_id, None)
        if self.state_pool is not None and length:
            self._restore[request.request_id] = self.state_pool.lookup(request.block_hashes[length // self.block_size - 1])
            self.state_pool.num_hits += 1
        self.pool.num_hits += length
        return hits, length

    def _snapshot_length(self, request: CacheRequest, length: int) -> int:
        """The longest prefix, at most ``length``, whose state snapshot exists."""
        k = length // self.block_size
        while k and request.block_hashes[k - 1] not in self.state_pool.snapshots:
            k -= 1
        return k * self.block_size

    def with_null_blocks(self, hits: list[list[KVCacheBlock]], counts: list[int]) -> list[list[KVCacheBlock]]:
        """Hits for a prefix that continues from the offload tier, where ``counts[g]`` of the tier's
        blocks fall out of group ``g``'s sliding window: those stay null, as in a device hit, and
        so do the group's device hits before them (the window no longer reaches them)."""
        return [[self.pool.null_block] * (len(h) + k) if k else h for h, k in zip(hits, counts)]

    def can_allocate(self, request: CacheRequest, num_new_tokens: int, num_new_computed_tokens: int = 0,
                     new_computed_blocks: list[list[KVCacheBlock]] | None = None) -> bool:
        """Whether ``allocate_slots`` would succeed (blocks a window would drop count as free)."""
        new_computed = new_computed_blocks or [[] for _ in self.managers]
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        needed = sum(m.num_blocks_to_allocate(request.request_id, total, hits)
                     for m, hits in zip(self.managers, new_computed))
        droppable = sum(m.num_skippable_blocks(request.request_id, request.num_computed_tokens)
                        for m in self.managers)
        return needed <= self.pool.num_free_blocks + droppable

    def allocate_slots(self, request: CacheRequest, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[list[KVCacheBlock]] | None = None) -> bool:
        """Give the request room for ``num_new_tokens`` more tokens in every group, or nothing.

        Returns:
            False when the pool cannot hold them (the caller preempts or waits); True otherwise.
        """
        rid = request.request_id
        total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if not new_computed_blocks and self._holds_room(rid, total_tokens):
            self._cache_blocks(request, total_tokens)  # most decode steps end here
            return True
        new_computed = new_computed_blocks or self._no_hits
        for m in self.managers:
            m.remove_skipped_blocks(rid, request.num_computed_tokens)
        needed = 0
        for m, hits in zip(self.managers, new_computed):
            needed += m.num_blocks_to_allocate(rid, total_tokens, hits)
        if needed and needed > self.pool.num_free_blocks:
            return False
        for m, hits in zip(self.managers, new_computed):
            if hits:
                m.save_new_computed_blocks(rid, hits)
            m.allocate_new_blocks(rid, total_tokens)
        if self.state_pool is not None and rid not in self.state_pool.slot_of:
            slot = self.state_pool.allocate(rid)
            snapshot = self._restore.pop(rid, None)
            if snapshot is not None and num_new_computed_tokens:
                self._state_copies.append((snapshot, slot))
        self._cache_blocks(request, total_tokens)
        return True

    def _holds_room(self, request_id: str, total_tokens: int) -> bool:
        """Whether the request already holds blocks for ``total_tokens`` tokens in every group,
        its state slot included, with none to drop: then ``allocate_slots`` has nothing to do but
        index the blocks that fill up."""
        if not self._blocks_only_grow:
            return False
        if self.state_pool is not None and request_id not in self.state_pool.slot_of:
            return False
        for m in self.managers:
            if len(m.block_ids_of(request_id)) * m.block_size < total_tokens:
                return False
        return True

    def _cache_blocks(self, request: CacheRequest, total_tokens: int) -> None:
        """Index the request's blocks that are full once this step runs; their content is written
        before any request of the same step reads it (each layer writes all new K/V, then attends)."""
        if self.enable_caching and request.cacheable:
            cached_len = min(total_tokens, request.num_tokens)
            for m in self.managers:
                m.cache_blocks(request.request_id, request.block_hashes, cached_len)

    def cache_known_blocks(self, request: CacheRequest) -> None:
        """Index the request's computed blocks that a token just appended has filled.

        ``allocate_slots`` indexes the blocks full of known tokens; with async scheduling a step
        is allocated while its input token is still in flight, so the block that token ends is
        indexed here, once it is back (its K/V is written by a step already launched, before any
        later step reads it). A no-op in the plain order, where allocation saw every token."""
        if not self.enable_caching or not request.cacheable or request.num_tokens % self.block_size:
            return
        computed = min(request.num_computed_tokens, request.num_tokens)
        for m in self.managers:
            m.cache_blocks(request.request_id, request.block_hashes, computed)

    def free(self, request: CacheRequest, uncache: bool = False) -> None:
        """Release the request's blocks (and state slot); ``uncache``: its blocks also leave the
        prefix-cache index, for a request whose step failed."""
        for m in self.managers:
            m.free(request.request_id, uncache)
        if self.state_pool is not None:
            self.state_pool.free(request.request_id)
            self._restore.pop(request.request_id, None)

    def state_slot(self, request_id: str) -> int:
        return self.state_pool.slot_of.get(request_id, 0) if self.state_pool is not None else 0

    def snapshot_state(self, request: CacheRequest) -> tuple[int, int] | None:
        """If the request's computed tokens end on a full block whose hash is known, keep a copy of
        its state (keyed by that hash) so a later prefix hit can restore it. The copy runs before
        the next forward, when the slot holds the state of exactly those tokens (every launched
        step has advanced it by the tokens it counted), so this is right between any two steps.

        Returns:
            (block hash, snapshot slot) of a new snapshot, or None.
        """
        if not self.snapshots_enabled or not request.cacheable:
            return None
        n = request.num_computed_tokens
        k = n // self.block_size
        if not n or n % self.block_size or k > len(request.block_hashes):
            return None
        slot = self.state_pool.slot_of.get(request.request_id)
        snapshot = self.state_pool.reserve_snapshot(request.block_hashes[k - 1]) if slot else None
        if snapshot is None:
            return None
        self._state_copies.append((slot, snapshot))
        return request.block_hashes[k - 1], snapshot

    def discard_restore(self, request_id: str) -> None:
        """The request's state comes from elsewhere (the offload tier): no snapshot restore."""
        self._restore.pop(request_id, None)

    def take_state_copies(self) -> tuple[tuple[int, int], ...]:
        """The (src, dst) state-slot copies the runner must make before the next forward."""
        copies, self._state_copies = tuple(self._state_copies), []
        return copies

    def block_ids(self, request_id: str) -> list[list[int]]:
        """A copy of the request's block ids per group."""
        return [list(m.block_ids_of(request_id)) for m in self.managers]

    def live_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block ids per group as the managers' own lists (no copy): they change
        when blocks are allocated, dropped or freed, so read them before the next schedule."""
        return [m.block_ids_of(request_id) for m in self.managers]

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks one sequence of ``num_tokens`` needs at once, over every group."""
        return sum(g.blocks_for(num_tokens) for g in self.groups)

    def check_integrity(self) -> None:
        """Pool consistency, and each block's ref count equals the requests that hold it."""
        owners: dict[int, int] = {}
        for m in self.managers:
            assert {rid: [b.block_id for b in blocks] for rid, blocks in m.req_to_blocks.items()} \
                == m.req_to_block_ids, "block id lists out of step with the blocks"
            for blocks in m.req_to_blocks.values():
                for b in blocks:
                    if not b.is_null:
                        owners[b.block_id] = owners.get(b.block_id, 0) + 1
        self.pool.check_integrity(owners)
        if self.state_pool is not None:
            self.state_pool.check_integrity()
            held = {rid for m in self.managers for rid in m.req_to_blocks}
            assert set(self.state_pool.slot_of) <= held, "a state slot outlived its request's blocks"
