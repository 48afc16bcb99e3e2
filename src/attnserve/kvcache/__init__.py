"""The KV cache: specs (bytes per token or sequence), groups, the block pool and its managers."""

from attnserve.kvcache.groups import CacheEntry, KVCacheGroup, cache_entries, group_entries
from attnserve.kvcache.spec import (
    FullAttentionSpec,
    IndexerCacheSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    StateSpec,
    resolve_cache_dtype,
)

__all__ = [
    "CacheEntry",
    "FullAttentionSpec",
    "IndexerCacheSpec",
    "KVCacheGroup",
    "KVCacheSpec",
    "MLAAttentionSpec",
    "SlidingWindowSpec",
    "StateSpec",
    "cache_entries",
    "group_entries",
    "resolve_cache_dtype",
]
