"""Offload tiers: where evicted-or-not KV blocks live outside the device cache.

A tier stores fixed-size byte blobs (one KV cache block of one group, all layers contiguous,
or one state snapshot) under a key, with least-recently-used eviction when full. ``host`` keeps
them in one preallocated (pinned, on CUDA machines) byte buffer; ``disk`` keeps one file per
blob under a directory, with a checksum, so a corrupt or missing file reads as a miss and the
engine recomputes instead of answering wrongly. A tier knows bytes and keys, not models.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections import OrderedDict
from pathlib import Path

import torch

__all__ = ["DiskTier", "HostTier", "OffloadTier"]

logger = logging.getLogger(__name__)
Key = tuple


class OffloadTier:
    """Base: LRU bookkeeping over ``capacity`` blobs of at most ``blob_bytes`` each."""

    def __init__(self, capacity: int, blob_bytes: int):
        if capacity < 1:
            raise ValueError(f"the offload tier holds no block of {blob_bytes} bytes: give it more space")
        self.capacity = capacity
        self.blob_bytes = blob_bytes
        self.index: OrderedDict[Key, int] = OrderedDict()  # key -> slot, oldest first
        self._free = list(range(capacity - 1, -1, -1))
        self.evictions = 0

    def __contains__(self, key: Key) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def _take_slot(self, key: Key) -> int:
        if key in self.index:
            self.index.move_to_end(key)
            return self.index[key]
        if not self._free:
            old, slot = self.index.popitem(last=False)
            self._drop(old, slot)
            self.evictions += 1
        else:
            slot = self._free.pop()
        self.index[key] = slot
        return slot

    def _forget(self, key: Key) -> None:
        slot = self.index.pop(key, None)
        if slot is not None:
            self._drop(key, slot)
            self._free.append(slot)

    def _drop(self, key: Key, slot: int) -> None:
        """Release what ``slot`` held (files, for the disk tier)."""

    def put(self, key: Key, data: torch.Tensor) -> None:
        raise NotImplementedError

    def get(self, key: Key) -> torch.Tensor | None:
        """The blob (uint8, on CPU) or None if absent or unreadable."""
        raise NotImplementedError


class HostTier(OffloadTier):
    def __init__(self, capacity: int, blob_bytes: int, pin_memory: bool = False):
        super().__init__(capacity, blob_bytes)
        self.buffer = torch.empty(capacity, blob_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        self.lengths: dict[int, int] = {}

    def put(self, key: Key, data: torch.Tensor) -> None:
        slot = self._take_slot(key)
        n = data.numel()
        self.buffer[slot, :n].copy_(data, non_blocking=True)
        self.lengths[slot] = n

    def get(self, key: Key) -> torch.Tensor | None:
        slot = self.index.get(key)
        if slot is None:
            return None
        self.index.move_to_end(key)
        return self.buffer[slot, : self.lengths[slot]]


_MAGIC = b"ATSVKV01"
_HEADER = struct.Struct("<8sQI")  # magic, payload length, crc32


class DiskTier(OffloadTier):
    """One file per blob: header (magic, length, crc32) then the raw bytes."""

    def __init__(self, capacity: int, blob_bytes: int, directory: str | os.PathLike):
        super().__init__(capacity, blob_bytes)
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.failures = 0

    def _path(self, slot: int) -> Path:
        return self.dir / f"block_{slot:08d}.kvb"

    def put(self, key: Key, data: torch.Tensor) -> None:
        slot = self._take_slot(key)
        payload = data.contiguous().cpu().numpy().tobytes()
        try:
            with open(self._path(slot), "wb") as f:
                f.write(_HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload)))
                f.write(payload)
        except OSError as e:  # a full disk is a miss later, never a wrong answer
            logger.warning("offload: cannot write %s (%s); the block will be recomputed", self._path(slot), e)
            self._forget(key)

    def get(self, key: Key) -> torch.Tensor | None:
        slot = self.index.get(key)
        if slot is None:
            return None
        path = self._path(slot)
        try:
            raw = path.read_bytes()
            magic, length, crc = _HEADER.unpack_from(raw)
            payload = raw[_HEADER.size:]
            if magic != _MAGIC or length != len(payload) or zlib.crc32(payload) != crc:
                raise ValueError("bad header or checksum")
        except (OSError, ValueError, struct.error) as e:
            self.failures += 1
            logger.warning("offload: %s is missing or corrupt (%s); recomputing instead", path, e)
            self._forget(key)
            return None
        self.index.move_to_end(key)
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def _drop(self, key: Key, slot: int) -> None:
        try:
            self._path(slot).unlink(missing_ok=True)
        except OSError:
            pass
