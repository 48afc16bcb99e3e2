"""Offload tiers: where evicted-or-not KV blocks live outside the device cache.

A tier stores fixed-size byte blobs (one KV cache block of one group, all layers contiguous,
or one state snapshot) under a key, with least-recently-used eviction when full; slots are
numbered as they are first used, so the bookkeeping is proportional to what is held. ``host`` keeps
them in one preallocated (pinned, on CUDA machines) byte buffer; ``disk`` keeps one file per
blob under a directory, named by the model's identity and the key, with both and a checksum in
its header, so a corrupt, missing, moved or foreign file reads as a miss and the engine
recomputes instead of answering wrongly; engines of one model share the directory's blocks, and
a restarted engine finds its earlier ones. A tier knows bytes and keys, not models (the disk
tier is given the model's identity as an opaque string: ``engine/builder.model_identity``, which
covers everything that changes a block's bytes, backends and kernel variants included).

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
import secrets
import stat
import struct
import time
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
        # slots are numbered as first used: ``_next_slot`` is the high-water mark, ``_free`` the
        # released ones below it, so bookkeeping grows with what is stored, not with capacity
        self._next_slot = 0
        self._free: list[int] = []
        self.evictions = 0

    def __contains__(self, key: Key) -> bool:
        """Whether the blob is stored and readable (a reserved one is not yet)."""
        return key in self.index

    def _busy(self, key: Key) -> bool:
        return key in self.index or key in self.reserved

    def __len__(self) -> int:
        return len(self.index)

    def _has_free_slot(self) -> bool:
        return bool(self._free) or self._next_slot < self.capacity

    def _new_slot(self) -> int:
        """A slot no blob holds (call only when ``_has_free_slot``)."""
        if self._free:
            return self._free.pop()
        self._next_slot += 1
        return self._next_slot - 1

    def _take_slot(self, key: Key) -> int | None:
        """A free slot, or the least recently used one that no load holds; None if all are busy."""
        if self._has_free_slot():
            slot = self._new_slot()
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


_MAGIC = b"ATSVKV03"
# magic, payload length, crc32 of (model id, key digest, payload), the model's id, the key's digest
_HEADER = struct.Struct("<8sQI32s32s")
_IDS = slice(20, _HEADER.size)  # the model id and the key digest, as the checksum covers them
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)
_READ = os.O_RDONLY | _NO_FOLLOW | getattr(os, "O_NONBLOCK", 0)  # a planted FIFO does not block a read
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_HEX = frozenset("0123456789abcdef")


class _FailureLog:
    """Counts one kind of failure and logs the first at once, then at most one line per
    ``interval`` seconds with the count: a full or read-only disk fails every store, and a line
    per block would flood the log."""

    def __init__(self, what: str, interval: float = 60.0):
        self.what = what
        self.interval = interval
        self.count = 0
        self._logged_at: float | None = None
        self._logged_count = 0

    def record(self, detail: str) -> None:
        self.count += 1
        now = time.monotonic()
        if self._logged_at is not None and now - self._logged_at < self.interval:
            return
        logger.warning("offload: %s: %d so far (%d since the last report; latest: %s); those blocks are "
                       "recomputed", self.what, self.count, self.count - self._logged_count, detail)
        self._logged_at, self._logged_count = now, self.count


class _NotOurs(ValueError):
    """The file is not this engine's block (another model's, another key's, a link, a stray
    file): a miss, and never deleted."""


class DiskTier(OffloadTier):
    """One file per blob, named by its content: ``<dir>/<h[:2]>/<h[2:]>.kvb`` where ``h`` is the
    hex SHA-256 of ``namespace`` (the engine's model identity) and the key. The header holds the
    model's id (SHA-256 of the namespace), that key digest, the payload's length and a checksum
    over all three; every read checks them, so a corrupt file, or one another model's engine (or
    a swap, or a user) put there, reads as a miss, never as another prompt's or model's KV.

    Engines of the same model on one directory write the same name with the same bytes, so they
    share blocks: a lookup the in-memory index misses asks the directory, and a block found and
    verified there is adopted (it counts against this tier's capacity from then on). At start the
    tier counts this model's files left by an earlier run, keys unknown until a lookup names them,
    against its capacity (the oldest evicted first; beyond capacity the oldest are removed).

    Files are written to a unique temporary name and renamed into place, so a reader (this engine
    or another) sees a whole old file or a whole new one. No symbolic link is followed, read or
    written, below the directory. A file is deleted (on eviction, or when its checksum fails) only
    when its header names this model and its key; a failed write is counted (``failures``,
    ``write_failures``) and the block stays unstored. Failures are logged with their count, the
    first at once and then at most once a minute, not once per block.

    Bookkeeping grows with the blocks held, not with ``capacity``: a budget of a terabyte costs
    nothing until blocks are written.
    """

    def __init__(self, capacity: int, blob_bytes: int, directory: str | os.PathLike, pin_memory: bool = False,
                 namespace: str = ""):
        super().__init__(capacity, blob_bytes)
        self.dir = Path(directory)
        if self.dir.exists() and not self.dir.is_dir():
            raise ValueError(f"kv_offloading_dir '{self.dir}' exists and is not a directory")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._root = os.open(self.dir, os.O_RDONLY | _DIRECTORY)
        except OSError as e:
            raise ValueError(f"kv_offloading_dir '{self.dir}' cannot be created or opened: {e}") from e
        self.namespace = namespace.encode()
        self.model_id = hashlib.sha256(b"attnserve kv model\0" + self.namespace).digest()
        self.pin_memory = pin_memory  # staging buffers of stores (CUDA copies into them)
        self.failures = 0  # reads and writes that failed (each block is recomputed instead)
        self._write_failures = _FailureLog("disk writes failed")
        self._read_failures = _FailureLog("disk blocks missing or corrupt")
        self.adopted = 0  # blocks found in the directory (an earlier run's, another engine's)
        self._staging: dict[Key, torch.Tensor] = {}
        self._bad: set[Key] = set()  # keys whose file is not ours: absent until this tier writes them
        self._unclaimed: OrderedDict[str, int] = OrderedDict()  # this model's files, key unknown -> slot
        self._scan()
        with contextlib.suppress(OSError):
            st = os.statvfs(self.dir)
            room = st.f_bavail * st.f_frsize + len(self._unclaimed) * (_HEADER.size + blob_bytes)
            if capacity * (_HEADER.size + blob_bytes) > room:
                logger.warning("offload: the disk tier may hold %.1f GiB but %s has %.1f GiB free: writes "
                               "beyond that fail (counted, and logged once a minute)",
                               capacity * blob_bytes / 1024**3, self.dir, room / 1024**3)

    @property
    def write_failures(self) -> int:
        """Blocks whose file could not be written (a full, read-only or vanished directory)."""
        return self._write_failures.count

    def close(self) -> None:
        if self._root >= 0:
            os.close(self._root)
            self._root = -1

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    # --- names and files --------------------------------------------------------------------
    def _digest(self, key: Key) -> bytes:
        return hashlib.sha256(self.namespace + b"\0" + repr(key).encode()).digest()

    def _path(self, key: Key) -> Path:
        h = self._digest(key).hex()
        return self.dir / h[:2] / f"{h[2:]}.kvb"

    def _subdir(self, h: str, create: bool = False) -> int:
        """A descriptor of the fan-out directory of name ``h`` (not a link: that raises OSError)."""
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(h[:2], 0o700, dir_fd=self._root)
        return os.open(h[:2], os.O_RDONLY | _DIRECTORY | _NO_FOLLOW, dir_fd=self._root)

    def _read(self, h: str, limit: int) -> bytes:
        """At most ``limit`` bytes of file ``h``: a regular file, reached through no link."""
        sub = self._subdir(h)
        try:
            fd = os.open(f"{h[2:]}.kvb", _READ, dir_fd=sub)
        finally:
            os.close(sub)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise _NotOurs("not a regular file")
            return f.read(limit)

    def _check(self, raw: bytes, digest: bytes) -> bytes:
        """The payload of ``raw`` if it is this model's block of ``digest`` (raises otherwise)."""
        if len(raw) < _HEADER.size:
            raise _NotOurs("too short for a header")
        magic, length, crc, model_id, key_digest = _HEADER.unpack_from(raw)
        if magic != _MAGIC or model_id != self.model_id or key_digest != digest:
            raise _NotOurs("it holds another block (another model's, another key's, or moved)")
        payload = raw[_HEADER.size:]
        if length != len(payload) or zlib.crc32(payload, zlib.crc32(raw[_IDS])) != crc:
            raise ValueError("bad checksum or length")
        return payload

    def _unlink_if_ours(self, h: str) -> None:
        """Remove file ``h`` if its header names this model and that key; leave anything else."""
        with contextlib.suppress(OSError, ValueError):
            head = self._read(h, _HEADER.size)
            if len(head) == _HEADER.size and head[:8] == _MAGIC and \
                    head[_IDS] == self.model_id + bytes.fromhex(h):
                sub = self._subdir(h)
                try:
                    os.unlink(f"{h[2:]}.kvb", dir_fd=sub)
                finally:
                    os.close(sub)

    def _scan(self) -> None:
        """Count this model's files already in the directory against the capacity."""
        found: list[tuple[int, str]] = []
        for sub in sorted(os.listdir(self._root)):
            if len(sub) != 2 or not set(sub) <= _HEX:
                continue
            try:
                fd = self._subdir(sub)
            except OSError:
                continue
            try:
                names = os.listdir(fd)
                for name in names:
                    h = sub + name[:-4]
                    if len(h) != 64 or not name.endswith(".kvb") or not set(h) <= _HEX:
                        continue
                    with contextlib.suppress(OSError):
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                        head = self._read(h, _HEADER.size) if stat.S_ISREG(st.st_mode) else b""
                        if len(head) == _HEADER.size and head[:8] == _MAGIC and \
                                head[_IDS] == self.model_id + bytes.fromhex(h):
                            found.append((st.st_mtime_ns, h))
            finally:
                os.close(fd)
        found.sort()
        keep = len(found) - min(len(found), self.capacity)
        for _, h in found[:keep]:  # beyond capacity (a smaller budget than last time): the oldest go
            self._unlink_if_ours(h)
        for _, h in found[keep:]:
            self._unclaimed[h] = self._new_slot()
        if found:
            logger.info("offload: %d blocks of this model in %s (%d kept)", len(found), self.dir, len(found) - keep)

    # --- the tier -------------------------------------------------------------------------------
    def __contains__(self, key: Key) -> bool:
        """Stored here, or a file of that name in the directory (verified when read)."""
        if key in self.index:
            return True
        if key in self._bad or key in self.reserved:
            return False
        h = self._digest(key).hex()
        try:
            sub = self._subdir(h)
            try:
                return stat.S_ISREG(os.stat(f"{h[2:]}.kvb", dir_fd=sub, follow_symlinks=False).st_mode)
            finally:
                os.close(sub)
        except OSError:
            return False

    def _take_slot(self, key: Key) -> int | None:
        if not self._has_free_slot() and self._unclaimed:  # an earlier run's unclaimed files go first
            h, slot = self._unclaimed.popitem(last=False)
            self._unlink_if_ours(h)
            self._free.append(slot)
            self.evictions += 1
        return super()._take_slot(key)

    def _drop(self, key: Key, slot: int) -> None:
        self._unlink_if_ours(self._digest(key).hex())

    def reserve(self, key: Key, nbytes: int) -> torch.Tensor | None:
        if self._busy(key) or self._take_slot(key) is None:
            return None
        self._staging[key] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        return self._staging[key]

    def commit(self, key: Key) -> bool:
        super().commit(key)
        payload = self._staging.pop(key).numpy().tobytes()
        digest = self._digest(key)
        h = digest.hex()
        name, tmp = f"{h[2:]}.kvb", f".{h[2:]}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        sub = -1
        try:
            sub = self._subdir(h, create=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, 0o600, dir_fd=sub)
            with os.fdopen(fd, "wb") as f:
                crc = zlib.crc32(payload, zlib.crc32(self.model_id + digest))
                f.write(_HEADER.pack(_MAGIC, len(payload), crc, self.model_id, digest))
                f.write(payload)
            os.replace(tmp, name, src_dir_fd=sub, dst_dir_fd=sub)  # replaces a link at ``name``, not its target
        except OSError as e:  # a full or unwritable disk is a miss later, never a wrong answer
            self.failures += 1
            self._write_failures.record(f"{self._path(key)}: {e}")
            if sub >= 0:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=sub)
            self._free.append(self.index.pop(key))  # an older copy of the file, if any, stays
            return False
        finally:
            if sub >= 0:
                os.close(sub)
        self._bad.discard(key)
        if h in self._unclaimed:  # rewrote an earlier run's file: it is indexed now
            self._free.append(self._unclaimed.pop(h))
        return True

    def get(self, key: Key) -> torch.Tensor | None:
        digest = self._digest(key)
        h = digest.hex()
        indexed = key in self.index
        try:
            payload = self._check(self._read(h, _HEADER.size + self.blob_bytes + 1), digest)
        except FileNotFoundError as e:
            if indexed:  # removed under us (another engine evicted it, or a user)
                self._fail(key, e, delete=False)
            return None
        except _NotOurs as e:
            self._fail(key, e, delete=False)
            self._bad.add(key)
            return None
        except (OSError, ValueError, struct.error) as e:  # ours, but corrupt (or unreadable)
            self._fail(key, e, delete=not isinstance(e, OSError))
            if isinstance(e, OSError):
                self._bad.add(key)
            return None
        if indexed:
            self.index.move_to_end(key)
        else:
            self._adopt(key, h)
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def _fail(self, key: Key, error: Exception, delete: bool) -> None:
        self.failures += 1
        self._read_failures.record(f"{self._path(key)}: {error}")
        if delete and key in self.index:
            self._forget(key)
        elif delete:
            self._unlink_if_ours(self._digest(key).hex())
        elif key in self.index:  # the file is not ours to delete: only the slot goes back
            self._free.append(self.index.pop(key))

    def _adopt(self, key: Key, h: str) -> None:
        """Index a verified file found in the directory (it counts against capacity from now)."""
        slot = self._unclaimed.pop(h, None)
        if slot is None:
            if self._take_slot(key) is None:
                return  # every slot is held by a load: served, not kept
            slot = self.reserved.pop(key)
        self.index[key] = slot
        self.adopted += 1
