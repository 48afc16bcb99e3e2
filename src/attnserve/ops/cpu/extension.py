"""Building and loading attnserve's C++ CPU extensions, in a cache directory of attnserve's own.

``torch.utils.cpp_extension.load`` builds under ``$TORCH_EXTENSIONS_DIR/<name>`` by default: one
directory per name for every install on the machine, so two installs (two virtual environments,
two checkouts, two torch versions) rebuilt each other's library in turn, and nothing told a build
from a load. Here each build has a directory keyed by what it is built from::

    <cache root>/torch_extensions/<name>-<key>

The cache root is ``env.cache_root()`` (``$XDG_CACHE_HOME/attnserve``, by default
``~/.cache/attnserve``); ``key`` hashes the sources and their headers (the bytes), the compile and
link flags, the Python that loads it (implementation, version) and torch (version, git revision,
C++ ABI). A directory that holds a finished build (its marker, written once the library loaded)
is loaded as it is, without ninja or the compiler: installs with the same sources share it, and a
start pays milliseconds. Otherwise torch's ``load`` builds it there under its file baton (the
directory's ``lock``: concurrent starts wait for one build, then load it), and the marker is
written. ``load_extension`` says which of the two happened, and how long it took.

Not here: what an extension computes, or when it is worth building (``paged_decode.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from attnserve import env

__all__ = ["LoadedExtension", "build_directory", "build_key", "load_extension"]

_MARKER = "attnserve_build.json"  # written last: the build in this directory is whole


@dataclass(frozen=True, slots=True)
class LoadedExtension:
    """What ``load_extension`` did: ``built`` (compiled now, or by a concurrent start it waited
    for) or loaded a finished build, from ``directory``, in ``seconds``."""

    library: Path
    directory: Path
    built: bool
    seconds: float

    def describe(self) -> str:
        how = "built" if self.built else "loaded from the cache"
        return f"{how} in {self.seconds:.2f} s ({self.directory})"


def build_key(files: list[Path], cflags: list[str], ldflags: list[str]) -> str:
    """16 hex digits of a hash of everything the library depends on: ``files`` (sources and
    headers, by name and bytes), the flags, this Python and this torch."""
    h = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    facts = {
        "cflags": cflags,
        "ldflags": ldflags,
        "python": [sys.implementation.cache_tag, platform.machine()],
        "torch": [torch.__version__, getattr(torch.version, "git_version", ""),
                  bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", False))],
    }
    h.update(json.dumps(facts, sort_keys=True).encode())
    return h.hexdigest()[:16]


def build_directory(name: str, key: str) -> Path:
    """Where the build of ``name`` with ``key`` lives: ``<cache root>/torch_extensions/<name>-<key>``."""
    return Path(env.cache_root()) / "torch_extensions" / f"{name}-{key}"


def load_extension(name: str, sources: list[Path], headers: list[Path], cflags: list[str],
                   ldflags: list[str]) -> LoadedExtension:
    """Load the library of ``sources`` (registering its ops), building it first unless its
    directory holds a finished build.

    Raises:
        What torch's build raises (no compiler, no ninja, a compile error), or OSError.
    """
    start = time.perf_counter()
    directory = build_directory(name, build_key([*sources, *headers], cflags, ldflags))
    library = _cached_library(directory)
    if library is not None:
        try:
            torch.ops.load_library(str(library))
            return LoadedExtension(library, directory, False, time.perf_counter() - start)
        except OSError:  # unreadable or truncated: build it again
            (directory / _MARKER).unlink(missing_ok=True)
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    before = _mtime(directory / f"{name}{cpp_extension.LIB_EXT}")
    path = cpp_extension.load(name, [str(s) for s in sources], extra_cflags=cflags, extra_ldflags=ldflags,
                              build_directory=str(directory), is_python_module=False, verbose=False)
    library = Path(path)
    # ninja may find the library up to date (a process that stopped before writing its marker):
    # then nothing was built (a build by a concurrent start this one waited for counts as built)
    built = _mtime(library) != before
    tmp = directory / f"{_MARKER}.{os.getpid()}"
    tmp.write_text(json.dumps({"library": library.name, "torch": torch.__version__,
                               "python": sys.implementation.cache_tag}))
    os.replace(tmp, directory / _MARKER)  # atomically: a reader sees no marker or a whole one
    return LoadedExtension(library, directory, built, time.perf_counter() - start)


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _cached_library(directory: Path) -> Path | None:
    """The library of the finished build in ``directory``, if there is one."""
    try:
        library = directory / json.loads((directory / _MARKER).read_text())["library"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return library if library.is_file() else None
