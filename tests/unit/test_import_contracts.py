"""The package's import rules, checked: the layers and forbidden imports of pyproject.toml's
``[tool.importlinter]`` contracts (``lint-imports``), every module inside a layer, no cycle.

A new upward import (a layer reaching one above it), a module outside every layer, or an
import cycle anywhere in the package (TYPE_CHECKING and function-level imports included) fails
here, so CI enforces ``docs/architecture.md``'s "who may import whom".
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "attnserve"


def _contracts() -> list[dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["importlinter"]["contracts"]


def test_lint_imports_keeps_every_contract():
    """``lint-imports`` with the project's contracts; its report is the failure message."""
    lint = Path(sys.executable).with_name("lint-imports")
    command = [str(lint)] if lint.exists() else [sys.executable, "-m", "importlinter.cli"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_module_sits_in_a_layer():
    (layers,) = [c for c in _contracts() if c["type"] == "layers"]
    named = {m.strip() for layer in layers["layers"] for m in layer.replace(":", "|").split("|")}
    children = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    children |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert children - named == set(), "modules outside every layer of the import contract"
    assert named - children == set(), "layers naming modules that do not exist"


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    modules = sorted(graph.modules)
    edges = {m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i in graph.modules)
             for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            for nxt in edges[node]:
                if nxt in on_stack:
                    low[node] = min(low[node], low[nxt])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle():
    graph = grimp.build_graph("attnserve", cache_dir=None)
    assert len(graph.modules) > 100
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    """The check above can fail: a three-module cycle in a scratch package is found."""
    pkg = tmp_path / "cyclepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyclepkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from cyclepkg import c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cyclepkg import a\n")
    (pkg / "d.py").write_text("from cyclepkg import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cyclepkg", cache_dir=None)
    assert _cycles(graph) == [["cyclepkg.a", "cyclepkg.b", "cyclepkg.c"]]


def test_an_upward_import_breaks_the_layers(tmp_path):
    """lint-imports fails on a copy of the package where a kvcache module imports the engine."""
    import shutil

    copy = tmp_path / "src" / "attnserve"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "presets"))
    (copy / "presets").mkdir()
    shutil.copy(PACKAGE / "presets" / "__init__.py", copy / "presets" / "__init__.py")
    spec = copy / "kvcache" / "spec.py"
    spec.write_text(spec.read_text() + "\nfrom attnserve.engine.engine import LLMEngine\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    lint = Path(sys.executable).with_name("lint-imports")
    command = [str(lint)] if lint.exists() else [sys.executable, "-m", "importlinter.cli"]
    env = {"PYTHONPATH": str(tmp_path / "src"), "PATH": str(Path(sys.executable).parent)}
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode != 0
    assert "attnserve.kvcache.spec -> attnserve.engine.engine" in run.stdout, run.stdout


def _private_imports(root: Path) -> list[str]:
    """``from attnserve... import _name`` anywhere under ``root`` (a file reaching into another
    file's private names), as "file: module._name"."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attnserve"):
                found += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and a.name != "__version__"]
    return found


def test_no_file_imports_another_files_private_names():
    """Helpers two files share are public names of a named module (the ops' Hopper and launch
    helpers, the engine's command vocabulary), never ``_private`` ones, in the package, its
    tests and its benchmarks."""
    for root in (PACKAGE, ROOT / "tests", ROOT / "benchmarks"):
        assert _private_imports(root) == [], root


def test_the_private_import_finder_finds_one(tmp_path):
    (tmp_path / "m.py").write_text("from attnserve.engine.builder import _secret, public\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert _private_imports(tmp_path) == ["m.py: attnserve.engine.builder._secret"]
    finally:
        ROOT = saved


def test_env_reads_at_most_ten_attnserve_variables_and_lists_them():
    """STYLE.md: env.py holds at most ten debug variables; every one it reads is in its list."""
    import re

    from attnserve import env

    read = set(re.findall(r'(?:environ(?:\.get)?[(\[]|_flag\()"(ATTNSERVE_[A-Z_]+)"', (PACKAGE / "env.py").read_text()))
    assert read == set(env.ATTNSERVE_VARIABLES)
    assert len(read) <= 10
    others = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
              if p.name != "env.py" and re.search(r"os\.environ|getenv\(", p.read_text())]
    assert others == []
    # and no docstring, help text or document names a variable that is gone
    files = [*PACKAGE.rglob("*.py"), ROOT / "README.md", ROOT / "docs" / "architecture.md"]
    named = {m for p in files for m in re.findall(r"ATTNSERVE_[A-Z][A-Z_]*[A-Z]", p.read_text())}
    assert named - read - {"ATTNSERVE_VARIABLES"} == set()
