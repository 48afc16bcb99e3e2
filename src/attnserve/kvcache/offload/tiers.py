"""Offload tiers: where evicted-or-not KV blocks live outside the device cache.

A tier stores fixed-size byte blobs (one KV cache block of one group, all layers contiguous,
or one state snapshot) under a key, with least-recently-used eviction when full. ``host`` keeps
them in one preallocated (pinned, on CUDA machines) byte buffer; ``disk`` keeps one file per
blob under a directory, with a checksum and the key's digest, so a corrupt, missing, moved or
foreign file reads as a miss and the engine recomputes instead of answering wrongly. A tier knows bytes and keys, not models.

Copies into and out of a tier may be asynchronous (``runner/offload_io.py``), so a store is two
steps: ``reserve`` gives the buffer to copy into (the host tier's own slot, or a staging buffer
for the disk), and ``commit`` makes the blob visible once the copy is done; until then the key
is neither readable nor reserved twice. A blob being loaded is ``hold``-ed
until its copy is done, and eviction passes over held blobs, so no store overwrites a slot a
load is still reading.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import zlib
from collections import Counter, OrderedDict
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
        self.index: OrderedDict[Key, int] = OrderedDict()  # committed key -> slot, oldest first
        self.reserved: dict[Key, int] = {}  # key -> slot being written, not readable yet
        self.held: Counter[Key] = Counter()  # keys whose blob a load is still copying
        self._free = list(range(capacity - 1, -1, -1))
        self.evictions = 0

    def __contains__(self, key: Key) -> bool:
        """Whether the blob is stored and readable (a reserved one is not yet)."""
        return key in self.index

    def _busy(self, key: Key) -> bool:
        return key in self.index or key in self.reserved

    def __len__(self) -> int:
        return len(self.index)

    def _take_slot(self, key: Key) -> int | None:
        """A free slot, or the least recently used one that no load holds; None if all are busy."""
        if self._free:
            slot = self._free.pop()
        else:
            old = next((k for k in self.index if not self.held[k]), None)
            if old is None:
                return None
            slot = self.index.pop(old)
            self._drop(old, slot)
            self.evictions += 1
        self.reserved[key] = slot
        return slot

    def _forget(self, key: Key) -> None:
        slot = self.index.pop(key, None)
        if slot is not None:
            self._drop(key, slot)
            self._free.append(slot)

    def _drop(self, key: Key, slot: int) -> None:
        """Release what ``slot`` held (files, for the disk tier)."""

    def reserve(self, key: Key, nbytes: int) -> torch.Tensor | None:
        """A uint8 buffer of ``nbytes`` to copy the blob into, then ``commit``; None when the key
        is already stored (or on its way) or every slot is busy."""
        raise NotImplementedError

    def commit(self, key: Key) -> bool:
        """The copy into ``reserve``'s buffer is done: the blob becomes readable. Returns False
        when it could not be stored after all (the disk tier's write failed)."""
        slot = self.reserved.pop(key)
        self.index[key] = slot
        return True

    def put(self, key: Key, data: torch.Tensor) -> None:
        """Store a blob now (reserve, copy, commit); an existing key is only marked used."""
        if key in self.index:
            self.index.move_to_end(key)
            return
        buf = self.reserve(key, data.numel())
        if buf is not None:
            buf.copy_(data)
            self.commit(key)

    def get(self, key: Key) -> torch.Tensor | None:
        """The blob (uint8, on CPU) or None if absent or unreadable."""
        raise NotImplementedError

    def hold(self, keys: list[Key]) -> None:
        self.held.update(keys)

    def release(self, keys: list[Key]) -> None:
        self.held.subtract(keys)
        self.held = +self.held  # drop the zero counts


class HostTier(OffloadTier):
    def __init__(self, capacity: int, blob_bytes: int, pin_memory: bool = False):
        super().__init__(capacity, blob_bytes)
        self.buffer = torch.empty(capacity, blob_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        self.lengths: dict[int, int] = {}

    def reserve(self, key: Key, nbytes: int) -> torch.Tensor | None:
        if self._busy(key):
            return None
        slot = self._take_slot(key)
        if slot is None:
            return None
        self.lengths[slot] = nbytes
        return self.buffer[slot, :nbytes]  # copied into directly: no staging

    def get(self, key: Key) -> torch.Tensor | None:
        slot = self.index.get(key)
        if slot is None:
            return None
        self.index.move_to_end(key)
        return self.buffer[slot, : self.lengths[slot]]


_MAGIC = b"ATSVKV02"
_HEADER = struct.Struct("<8sQI32s")  # magic, payload length, crc32 of key digest + payload, key digest
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)


class DiskTier(OffloadTier):
    """One file per blob: header (magic, length, crc32, the key's digest) then the raw bytes.

    The digest is SHA-256 of ``namespace`` (the engine's model identity) and the key, checked on
    every read along with the checksum: a file another engine wrote into the same directory, or
    two files swapped, read as misses, never as another prompt's or another model's KV. Files are
    written to a temporary name and renamed into place (a reader never sees half a block), and no
    symbolic link is followed, read or written. A failed write is counted (``failures``) and the
    block stays unstored.
    """

    def __init__(self, capacity: int, blob_bytes: int, directory: str | os.PathLike, pin_memory: bool = False,
                 namespace: str = ""):
        super().__init__(capacity, blob_bytes)
        self.dir = Path(directory)
        if self.dir.exists() and not self.dir.is_dir():
            raise ValueError(f"kv_offloading_dir '{self.dir}' exists and is not a directory")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_offloading_dir '{self.dir}' cannot be created: {e}") from e
        self.namespace = namespace.encode()
        self.pin_memory = pin_memory  # staging buffers of stores (CUDA copies into them)
        self.failures = 0
        self._staging: dict[Key, torch.Tensor] = {}

    def _path(self, slot: int) -> Path:
        return self.dir / f"block_{slot:08d}.kvb"

    def _digest(self, key: Key) -> bytes:
        return hashlib.sha256(self.namespace + b"\0" + repr(key).encode()).digest()

    def reserve(self, key: Key, nbytes: int) -> torch.Tensor | None:
        if self._busy(key) or self._take_slot(key) is None:
            return None
        self._staging[key] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        return self._staging[key]

    def commit(self, key: Key) -> bool:
        super().commit(key)
        slot = self.index[key]
        payload = self._staging.pop(key).numpy().tobytes()
        digest = self._digest(key)
        path = self._path(slot)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NO_FOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload, zlib.crc32(digest)), digest))
                f.write(payload)
            os.replace(tmp, path)  # replaces a link planted at ``path``, never its target
        except OSError as e:  # a full or unwritable disk is a miss later, never a wrong answer
            self.failures += 1
            logger.warning("offload: cannot write %s (%s); the block will be recomputed", path, e)
            with contextlib.suppress(OSError):
                tmp.unlink()
            self._forget(key)
            return False
        return True

    def get(self, key: Key) -> torch.Tensor | None:
        slot = self.index.get(key)
        if slot is None:
            return None
        path = self._path(slot)
        foreign = False
        try:
            fd = os.open(path, os.O_RDONLY | _NO_FOLLOW)
            with os.fdopen(fd, "rb") as f:
                raw = f.read()
            magic, length, crc, digest = _HEADER.unpack_from(raw)
            payload = raw[_HEADER.size:]
            if magic != _MAGIC or length != len(payload):
                raise ValueError("bad header")
            if digest != self._digest(key):
                foreign = True
                raise ValueError("it holds another block (another engine's, or moved)")
            if zlib.crc32(payload, zlib.crc32(digest)) != crc:
                raise ValueError("bad checksum")
        except (OSError, ValueError, struct.error) as e:
            self.failures += 1
            logger.warning("offload: %s is missing or corrupt (%s); recomputing instead", path, e)
            if foreign:  # the file is not ours to delete: only the slot goes back
                self._free.append(self.index.pop(key))
            else:
                self._forget(key)
            return None
        self.index.move_to_end(key)
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def _drop(self, key: Key, slot: int) -> None:
        try:
            self._path(slot).unlink(missing_ok=True)
        except OSError:
            pass
