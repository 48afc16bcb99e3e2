"""The block pool: block ids, reference counts, the free queue, and the prefix-cache index.

One pool serves every KV cache group. A block is free when its reference count is 0; a free
block may still hold cached content (its hash stays in the index) until it is evicted, least
recently freed first. Block 0 is the null block: it is never allocated and stands in for
blocks a sliding window has dropped. This file knows block ids and hashes, not tensors.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["BlockHash", "BlockPool", "KVCacheBlock", "hash_block_tokens"]

BlockHash = int


def hash_block_tokens(parent: BlockHash | None, token_ids: Iterable[int], extra: tuple = ()) -> BlockHash:
    """Chained hash of one full block: its parent's hash, its tokens, and extra keys.

    A 128-bit BLAKE2b digest, not Python's ``hash``: the same tokens give the same hash in every
    process (the disk tier finds blocks another engine, or this one before a restart, wrote;
    ``hash(None)`` changes between processes before Python 3.12), and no prompt can be crafted
    to collide with another's blocks (a shared prefix cache would serve it the other's KV)."""
    tokens = tuple(token_ids)
    try:
        packed = b"q" + array("q", tokens).tobytes()
    except (OverflowError, TypeError):  # ids beyond int64 are refused at the door; stay correct anyway
        packed = b"r" + repr(tokens).encode()
    h = hashlib.blake2b(b"-" if parent is None else b"%d" % parent, digest_size=16)
    h.update(b"|%d|" % len(packed))
    h.update(packed)
    if extra:
        h.update(repr(extra).encode())
    return int.from_bytes(h.digest(), "little")


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: tuple[BlockHash, int] | None = None  # (hash, group id) once the block is full and cached
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == 0


class _FreeQueue:
    """Doubly linked list of free blocks: pop from the front (LRU), remove from the middle in O(1)."""

    def __init__(self):
        self.num_free = 0
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self.tail.prev_free = self.tail, block
        self.num_free += 1

    def __iter__(self):
        b = self.head.next_free
        while b is not self.tail:
            yield b
            b = b.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"the block pool needs at least 2 blocks (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Blocks are made on first use: a small model on a large GPU has millions of blocks, and
        # building them all up front took seconds. Never-used blocks sit, in id order, before every
        # freed block in the LRU order, so they are handed out first, as a full queue would.
        self.blocks = [KVCacheBlock(0)]
        self.free_queue = _FreeQueue()
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # never freed
        self.cached: dict[tuple[BlockHash, int], KVCacheBlock] = {}
        self.num_hits = 0
        self.num_queries = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free + self.num_blocks - len(self.blocks)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash, group_id: int) -> KVCacheBlock | None:
        if not self.enable_caching:
            return None
        return self.cached.get((block_hash, group_id))

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` free blocks (evicting cached content), each with ref_cnt 1."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if len(self.blocks) < self.num_blocks:  # a never-used block
                block = KVCacheBlock(len(self.blocks))
                self.blocks.append(block)
            else:
                block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue in the given order
        (callers pass a request's blocks tail first, so its prefix is evicted last)."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise AssertionError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    self._evict(block)
                self.free_queue.append(block)

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take blocks out of the prefix-cache index (their content is not to be trusted)."""
        for block in blocks:
            if not block.is_null:
                self._evict(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, group_id: int) -> None:
        """Index a full block by its hash; an earlier block with the same hash keeps the entry."""
        if not self.enable_caching or block.is_null or block.block_hash is not None:
            return
        key = (block_hash, group_id)
        block.block_hash = key
        self.cached.setdefault(key, block)

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.blocks[1:]:
            block.block_hash = None
        self.cached.clear()
        return True

    def check_integrity(self, owners: dict[int, int] | None = None) -> None:
        """Every block is either referenced or free, never both; the index points at blocks that
        carry its key; with ``owners`` (block id -> number of holders), ref counts match exactly.

        Raises:
            AssertionError: describing the first inconsistency found.
        """
        free = list(self.free_queue)
        free_ids = [b.block_id for b in free]
        assert len(free_ids) == len(set(free_ids)) == self.free_queue.num_free, "free queue corrupt"
        assert all(b.block_id == i for i, b in enumerate(self.blocks)), "blocks out of id order"
        assert 0 not in free_ids, "the null block is in the free queue"
        for b in self.blocks[1:]:
            in_free = b.prev_free is not None
            assert in_free == (b.ref_cnt == 0), f"block {b.block_id}: ref_cnt {b.ref_cnt}, in free queue {in_free}"
            assert b.ref_cnt >= 0, f"block {b.block_id} has negative ref_cnt"
        for key, block in self.cached.items():
            assert block.block_hash == key, f"cache index entry {key} points at block {block.block_id} " \
                                            f"with hash {block.block_hash}"
        if owners is not None:
            for b in self.blocks[1:]:
                assert b.ref_cnt == owners.get(b.block_id, 0), \
                    f"block {b.block_id}: ref_cnt {b.ref_cnt} but {owners.get(b.block_id, 0)} holders"
