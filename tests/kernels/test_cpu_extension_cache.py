"""Where the C++ CPU extension is built (``ops/cpu/extension.py``): a directory of attnserve's
cache keyed by its sources and header, flags, Python and torch, so that installs do not rebuild
each other's library; a finished build is loaded without ninja or the compiler, and the log says
whether it was built or loaded.

The key and the two paths (load a finished build; build, then mark it finished) are checked
without a compiler (``cpp_extension.load`` replaced); the last test loads the real kernel in a
fresh interpreter and checks that it was not built again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnserve.ops.cpu import extension
from attnserve.ops.cpu import paged_decode as cpu_paged_decode

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["-O3", "-mavx2"]


@pytest.fixture()
def sources(tmp_path) -> tuple[list[Path], list[Path]]:
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "op.cpp").write_text("// the op\n")
    (src / "op.h").write_text("// its header\n")
    return [src / "op.cpp"], [src / "op.h"]


def test_the_key_changes_with_sources_headers_flags_and_torch(sources, monkeypatch):
    (cpp,), (header,) = sources
    key = extension.build_key([cpp, header], FLAGS, [])
    assert len(key) == 16 and key == extension.build_key([header, cpp], FLAGS, [])  # same inputs: same key
    assert extension.build_key([cpp, header], [*FLAGS, "-DX"], []) != key  # a flag
    assert extension.build_key([cpp, header], FLAGS, ["-fopenmp"]) != key  # a link flag
    header.write_text("// its header, changed\n")
    assert extension.build_key([cpp, header], FLAGS, []) != key  # a header's bytes
    header.write_text("// its header\n")
    assert extension.build_key([cpp, header], FLAGS, []) == key
    monkeypatch.setattr(torch, "__version__", "0.0.1+other")
    assert extension.build_key([cpp, header], FLAGS, []) != key  # another torch


def test_the_directory_is_in_attnserves_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert extension.build_directory("ext", "0123456789abcdef") == \
        tmp_path / "cache" / "attnserve" / "torch_extensions" / "ext-0123456789abcdef"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert extension.build_directory("ext", "k") == Path.home() / ".cache" / "attnserve" / "torch_extensions" / "ext-k"


def test_a_finished_build_is_loaded_a_missing_one_built_then_marked(sources, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (cpp,), headers = sources
    builds, loads = [], []

    def fake_build(name, srcs, build_directory, **kwargs):  # what torch's load leaves: the library
        builds.append((name, srcs, kwargs["extra_cflags"]))
        library = Path(build_directory) / f"{name}.so"
        library.write_bytes(b"\x7fELF")
        return str(library)

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", fake_build)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: loads.append(path))
    first = extension.load_extension("ext", [cpp], headers, FLAGS, [])
    assert first.built and len(builds) == 1 and loads == []
    assert first.directory.parent == tmp_path / "cache" / "attnserve" / "torch_extensions"
    assert json.loads((first.directory / "attnserve_build.json").read_text())["library"] == "ext.so"
    assert "built in" in first.describe()
    again = extension.load_extension("ext", [cpp], headers, FLAGS, [])  # the same inputs: loaded as built
    assert not again.built and len(builds) == 1 and loads == [str(first.library)]
    assert again.directory == first.directory and "loaded from the cache" in again.describe()
    other = extension.load_extension("ext", [cpp], headers, [*FLAGS, "-DX"], [])  # another flag: its own build
    assert other.built and other.directory != first.directory and len(builds) == 2
    (first.directory / "attnserve_build.json").write_text("{trunc")  # a broken marker: built again
    assert extension.load_extension("ext", [cpp], headers, FLAGS, []).built and len(builds) == 3


def test_a_second_start_loads_the_kernel_without_building(tmp_path):
    """The real kernel: built (or found) here, then a fresh interpreter loads it from the cache
    with the compiler path made to fail, and logs that it loaded it."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the CPU decode kernel cannot be built")
    why = cpu_paged_decode.cpu_support()
    if why is not None:
        pytest.skip(f"the CPU decode kernel needs x86-64 with AVX2: {why}")
    assert cpu_paged_decode.prepare() is None, "the CPU decode kernel failed to build (see the log)"
    code = ("from torch.utils import cpp_extension\n"
            "def no_build(*a, **k):\n    raise AssertionError('built again')\n"
            "cpp_extension.load = no_build\n"
            "from attnserve.ops.cpu import paged_decode\n"
            "assert paged_decode.prepare() is None\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_LOG")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**env, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr
    assert "CPU decode kernel: the " in out.stderr and "loaded from the cache in " in out.stderr, out.stderr
    assert "attnserve/torch_extensions/attnserve_cpu_paged_decode-" in out.stderr, out.stderr
