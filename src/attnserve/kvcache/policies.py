"""One block-table manager per KV cache group, behind a per-policy interface.

The policies differ in two places only: which cached blocks make a prefix hit
(``find_longest_cache_hit``) and which blocks a request may drop while it runs
(``remove_skipped_blocks``). Everything else (allocate, cache, free) is shared.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from attnserve.kvcache.block_pool import BlockHash, BlockPool, KVCacheBlock
from attnserve.kvcache.groups import KVCacheGroup
from attnserve.kvcache.spec import CachePolicy

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["FullAttentionManager", "SingleTypeManager", "SlidingWindowManager", "create_manager",
           "window_blocks_needed"]


def window_blocks_needed(window: int, block_size: int) -> int:
    """Blocks a prefix hit of a sliding-window group needs right before its end: those that
    hold the ``window - 1`` tokens the next token attends to besides itself; earlier ones may
    be gone (the null block). The offload tier's lookup uses the same rule."""
    return max(1, math.ceil((window - 1) / block_size))


class SingleTypeManager:
    def __init__(self, group: KVCacheGroup, pool: BlockPool):
        self.group = group
        self.group_id = group.group_id
        self.block_size = group.block_size
        self.pool = pool
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # the same blocks' ids, kept in step with req_to_blocks: the scheduler hands these lists
        # to the runner each step instead of building them anew
        self.req_to_block_ids: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}

    # --- policy hooks ----------------------------------------------------------------------
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[KVCacheBlock]:
        """Cached blocks for the longest prefix of at most ``max_length`` tokens (whole blocks)."""
        raise NotImplementedError

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks no future token of the request can attend to (none for full attention)."""

    def num_skippable_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks ``remove_skipped_blocks`` would free now."""
        return 0

    # --- shared mechanics --------------------------------------------------------------------
    def blocks_of(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def block_ids_of(self, request_id: str) -> list[int]:
        """The ids of the request's blocks: the manager's own list, changed as blocks come and go."""
        return self.req_to_block_ids.get(request_id, [])

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed: list[KVCacheBlock]) -> int:
        """Free-pool blocks that giving the request ``num_tokens`` tokens would consume."""
        required = -(-num_tokens // self.block_size)
        have = len(self.req_to_blocks.get(request_id, ())) + len(new_computed)
        if not new_computed:
            return max(required - have, 0)
        # cache hits that sit in the free queue leave it when taken
        evictable_hits = sum(1 for b in new_computed if b.ref_cnt == 0 and not b.is_null)
        return max(required - have, 0) + evictable_hits

    def save_new_computed_blocks(self, request_id: str, new_computed: list[KVCacheBlock]) -> None:
        if not new_computed:
            return
        assert request_id not in self.req_to_blocks or not self.req_to_blocks[request_id], \
            "cache hits are only taken by requests that hold no blocks yet"
        self.pool.touch(new_computed)
        self.req_to_blocks[request_id] = list(new_computed)
        self.req_to_block_ids[request_id] = [b.block_id for b in new_computed]
        self.num_cached_blocks[request_id] = len(new_computed)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
            self.req_to_block_ids[request_id] = []
        num_new = -(-num_tokens // self.block_size) - len(blocks)
        if num_new <= 0:  # a running request's next tokens mostly fit its last block
            return []
        new = self.pool.get_new_blocks(num_new)
        blocks.extend(new)
        self.req_to_block_ids[request_id].extend(b.block_id for b in new)
        return new

    def cache_blocks(self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Index the request's blocks that are full once ``num_tokens`` tokens are computed."""
        start = self.num_cached_blocks.get(request_id, 0)
        if num_tokens // self.block_size <= start:  # no block filled up since the last call
            return
        blocks = self.blocks_of(request_id)
        end = min(num_tokens // self.block_size, len(block_hashes), len(blocks))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], block_hashes[i], self.group_id)
        self.num_cached_blocks[request_id] = max(start, end)

    def _drop(self, request_id: str, indices: Sequence[int]) -> list[KVCacheBlock]:
        """Put the null block at ``indices`` of the request's blocks; returns the blocks taken out."""
        blocks, ids = self.blocks_of(request_id), self.req_to_block_ids.get(request_id)
        dropped = []
        for i in indices:
            dropped.append(blocks[i])
            blocks[i] = self.pool.null_block
            ids[i] = 0
        return dropped

    def free(self, request_id: str, uncache: bool = False) -> None:
        """Release the request's blocks; ``uncache`` also drops them from the prefix-cache index
        (a failed step may have left them half written)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.req_to_block_ids.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        if uncache:
            self.pool.uncache(blocks)
        self.pool.free_blocks(reversed(blocks))  # tail first: the prefix stays cached longest


class FullAttentionManager(SingleTypeManager):
    def find_longest_cache_hit(self, block_hashes, max_length):
        hits = []
        for h in block_hashes[: max_length // self.block_size]:
            block = self.pool.get_cached_block(h, self.group_id)
            if block is None:
                break
            hits.append(block)
        return hits


class SlidingWindowManager(SingleTypeManager):
    def __init__(self, group: KVCacheGroup, pool: BlockPool):
        super().__init__(group, pool)
        assert group.window is not None
        self.window = group.window
        # a hit needs the blocks covering the window before its end; earlier ones may be gone
        self.contiguous_needed = window_blocks_needed(self.window, self.block_size)

    def find_longest_cache_hit(self, block_hashes, max_length):
        n = min(max_length // self.block_size, len(block_hashes))
        hits: list[KVCacheBlock] = [self.pool.null_block] * n
        run = 0
        for i in range(n - 1, -1, -1):
            block = self.pool.get_cached_block(block_hashes[i], self.group_id)
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run >= self.contiguous_needed:
                return hits[: i + run]
        # no run long enough: only a hit that starts at the first block counts
        return hits[:run] if run and hits[0] is not self.pool.null_block else []

    def _skippable(self, request_id: str, num_computed_tokens: int) -> list[int]:
        first_useful_block = (num_computed_tokens - self.window + 1) // self.block_size
        blocks = self.blocks_of(request_id)
        out = []
        for i in range(min(first_useful_block, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break  # everything before was dropped on an earlier step
            out.append(i)
        return out

    def num_skippable_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        # only blocks this request alone holds go back to the free pool
        blocks = self.blocks_of(request_id)
        return sum(1 for i in self._skippable(request_id, num_computed_tokens) if blocks[i].ref_cnt == 1)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        self.pool.free_blocks(self._drop(request_id, self._skippable(request_id, num_computed_tokens)))


class StreamingManager(SingleTypeManager):
    """StreamingLLM: keeps the sink blocks and the window; never serves prefix hits (a kept
    block's meaning depends on what was dropped before it)."""

    def __init__(self, group: KVCacheGroup, pool: BlockPool):
        super().__init__(group, pool)
        spec = group.entries[0].spec
        self.sinks, self.window = spec.sinks, spec.window

    def find_longest_cache_hit(self, block_hashes, max_length):
        return []

    def _skippable(self, request_id: str, num_computed_tokens: int) -> list[int]:
        first_sinkless = -(-self.sinks // self.block_size)  # blocks holding only non-sink tokens
        first_useful = (num_computed_tokens - self.window + 1) // self.block_size
        blocks = self.blocks_of(request_id)
        return [i for i in range(first_sinkless, min(first_useful, len(blocks))) if not blocks[i].is_null]

    def num_skippable_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        blocks = self.blocks_of(request_id)
        return sum(1 for i in self._skippable(request_id, num_computed_tokens) if blocks[i].ref_cnt == 1)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        skipped = self._skippable(request_id, num_computed_tokens)
        self.pool.free_blocks(self._drop(request_id, skipped[::-1]))


def create_manager(group: KVCacheGroup, pool: BlockPool) -> SingleTypeManager:
    managers = {CachePolicy.FULL: FullAttentionManager, CachePolicy.SLIDING: SlidingWindowManager,
                CachePolicy.STREAMING: StreamingManager}
    if group.policy not in managers:
        raise NotImplementedError(f"KV cache groups with policy '{group.policy.value}' have no block manager")
    return managers[group.policy](group, pool)
