"""KV cache offloading: tiers (host memory, disk) and the two-phase offload manager."""

from attnserve.kvcache.offload.manager import (
    LoadJob,
    OffloadManager,
    OffloadStats,
    StoreJob,
    TierHit,
)
from attnserve.kvcache.offload.tiers import DiskTier, HostTier, OffloadTier

__all__ = ["DiskTier", "HostTier", "LoadJob", "OffloadManager", "OffloadStats", "OffloadTier", "StoreJob", "TierHit"]
