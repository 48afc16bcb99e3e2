"""Block pool and KV cache manager logic, without a model: integrity after every operation."""

from __future__ import annotations

import random

import pytest

from attnserve.config import CacheConfig
from attnserve.core.request import Request
from attnserve.kvcache.block_pool import BlockPool
from attnserve.kvcache.groups import CacheEntry, KVCacheGroup
from attnserve.kvcache.manager import KVCacheManager
from attnserve.kvcache.spec import FullAttentionSpec, SlidingWindowSpec
from attnserve.sampling_params import SamplingParams

BS = 4


def full_group(gid=0):
    spec = FullAttentionSpec(block_size=BS, dtype="float32", num_kv_heads=1, head_size=8, head_size_v=8)
    return KVCacheGroup(gid, "full", None, (CacheEntry(0, "kv", spec),))


def window_group(window, gid=0):
    spec = SlidingWindowSpec(block_size=BS, dtype="float32", num_kv_heads=1, head_size=8, head_size_v=8,
                             sliding_window=window)
    return KVCacheGroup(gid, "sliding", window, (CacheEntry(1, "kv", spec),))


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=100), block_size=BS)


def test_pool_basics_and_null_block():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4 and pool.null_block.block_id == 0
    blocks = pool.get_new_blocks(3)
    assert 0 not in [b.block_id for b in blocks]
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    pool.check_integrity({})
    with pytest.raises(AssertionError):
        pool.free_blocks(blocks[:1])  # freed twice
    with pytest.raises(ValueError):
        BlockPool(1)


def test_lru_eviction_keeps_most_recent_prefix():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    for blk, h in ((a, 1), (b, 2), (c, 3)):
        pool.cache_block(blk, h, 0)
    pool.free_blocks([c, b, a])  # freed tail first: a is the most recently freed
    (new,) = pool.get_new_blocks(1)
    assert new is c and pool.get_cached_block(3, 0) is None  # c was evicted first
    assert pool.get_cached_block(1, 0) is a
    pool.touch([a])
    assert a.ref_cnt == 1
    pool.check_integrity({a.block_id: 1, new.block_id: 1})


def test_prefix_hits_share_blocks_and_stop_before_the_last_token():
    kv = KVCacheManager([full_group()], num_blocks=32)
    r1 = req("a", range(10))
    assert kv.get_computed_blocks(r1) == ([[]], 0)
    assert kv.allocate_slots(r1, 10)
    r1.num_computed_tokens = 10
    kv.check_integrity()
    r2 = req("b", list(range(8)) + [99, 98, 97])
    hits, n = kv.get_computed_blocks(r2)
    assert n == 8 and [b.block_id for b in hits[0]] == kv.block_ids("a")[0][:2]
    assert kv.allocate_slots(r2, 3, n, hits)
    kv.check_integrity()
    assert hits[0][0].ref_cnt == 2
    # a prompt that is exactly cached still recomputes its last token
    r3 = req("c", range(8))
    _, n3 = kv.get_computed_blocks(r3)
    assert n3 == 4
    kv.free(r1)
    kv.free(r2)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 31


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager([full_group()], num_blocks=4)
    r = req("a", range(20))
    assert not kv.allocate_slots(r, 20)  # needs 5 blocks, 3 usable
    assert kv.block_ids("a") == [[]]
    kv.check_integrity()


def test_sliding_window_frees_blocks_outside_the_window():
    kv = KVCacheManager([window_group(6)], num_blocks=32)
    r = req("a", range(30))
    assert kv.allocate_slots(r, 30)
    r.num_computed_tokens = 30
    r.append_output_token(5)
    assert kv.allocate_slots(r, 1)
    ids = kv.block_ids("a")[0]
    # keys visible to position 30 are 25..30: blocks 6 and 7; earlier blocks are null
    assert ids[:6] == [0] * 6 and 0 not in ids[6:]
    kv.check_integrity()
    kv.free(r)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 31


def test_sliding_window_cache_hit_needs_only_the_window():
    kv = KVCacheManager([window_group(5)], num_blocks=64)
    r1 = req("a", range(40))
    kv.allocate_slots(r1, 40)
    r1.num_computed_tokens = 40
    kv.free(r1)  # blocks stay cached in the free queue
    r2 = req("b", list(range(36)) + [1000, 1001])
    hits, n = kv.get_computed_blocks(r2)
    assert n == 36
    assert sum(1 for b in hits[0] if not b.is_null) >= 1
    assert kv.allocate_slots(r2, 2, n, hits)
    kv.check_integrity()


def test_random_churn_keeps_integrity():
    rng = random.Random(0)
    kv = KVCacheManager([full_group(0), window_group(7, 1)], num_blocks=40)
    live: dict[str, Request] = {}
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    for step in range(400):
        op = rng.random()
        if op < 0.4 and len(live) < 8:
            rid = f"r{step}"
            r = req(rid, rng.choice(prefixes)[: rng.randrange(1, 12)] + [rng.randrange(50) for _ in range(rng.randrange(1, 9))])
            hits, n = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, r.num_tokens - n, n, hits):
                r.num_computed_tokens = r.num_tokens
                live[rid] = r
        elif op < 0.8 and live:
            r = live[rng.choice(sorted(live))]
            r.append_output_token(rng.randrange(50))
            if kv.allocate_slots(r, 1):
                r.num_computed_tokens += 1
        elif live:
            kv.free(live.pop(rng.choice(sorted(live))))
        kv.check_integrity()
    for r in live.values():
        kv.free(r)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 39


def test_cache_config_rejects_bad_block_sizes():
    with pytest.raises(ValueError, match="power of two"):
        CacheConfig(block_size=12)


def test_huge_pool_is_built_lazily_and_hands_out_fresh_blocks_first():
    """A tiny model on a large GPU has millions of blocks: the pool must not build them up front,
    and never-used blocks come before freed ones (whose cached content is kept longer)."""
    import time

    start = time.perf_counter()
    pool = BlockPool(50_000_000)
    assert time.perf_counter() - start < 0.5
    assert pool.num_free_blocks == 50_000_000 - 1
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [1, 2, 3]
    pool.cache_block(a[0], 111, 0)
    pool.free_blocks(reversed(a))
    assert pool.num_free_blocks == 50_000_000 - 1
    assert [b.block_id for b in pool.get_new_blocks(2)] == [4, 5]  # fresh before freed
    assert pool.get_cached_block(111, 0) is a[0]
    pool.check_integrity()
    small = BlockPool(4)
    got = small.get_new_blocks(3)
    small.free_blocks([got[1], got[0], got[2]])
    assert [b.block_id for b in small.get_new_blocks(3)] == [2, 1, 3]  # then LRU order of freeing
