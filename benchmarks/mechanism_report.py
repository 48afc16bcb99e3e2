"""The output half of ``gpu_mechanisms.py``: the run's environment, the markdown table of its
cells, the rewrite of the section between the ``gpu_mechanisms`` markers of a markdown file,
the JSON outputs of earlier runs merged for ``--render``, and the smoke run's checks of these.

Not here: the cases (``mechanism_cases.py``), running and timing them
(``mechanism_timing.py``), the command line (``gpu_mechanisms.py``).
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from mechanism_cases import CASES, size_label

MARK_BEGIN = "<!-- gpu_mechanisms:begin -->"
MARK_END = "<!-- gpu_mechanisms:end -->"
DOCS_TITLE = "## Per-mechanism decode and prefill (benchmarks/gpu_mechanisms.py)"
JSON_NAME = "gpu_mechanisms.json"
DEFAULT_EXPERTS = 16  # the DeepSeek/GLM cuts' routed experts unless --experts says otherwise


# --- output -------------------------------------------------------------------------------


def environment() -> dict:
    """Versions, device and commit of this run."""
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    cuda = torch.cuda.is_available()
    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "commit": commit,
            "date": datetime.date.today().isoformat(), "command": command_line()}


def command_line() -> str:
    return " ".join(["python", "benchmarks/gpu_mechanisms.py", *sys.argv[1:]])


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown_table(cells: list[dict]) -> str:
    """One row per decode cell, the prefill figures on the row of the batch that was prefilled;
    then the reasons of the cells that did not run."""
    prefill = {cell_key(c)[1:]: c for c in cells if c["cell"] == "prefill"}
    lines = ["| case | mechanism | backend | batch | context | decode ms | HBM floor ms | % of HBM floor "
             "| FLOP floor ms | % of max floor | graphs | prefill tok/s | prefill % of 790 TF |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    notes: list[str] = []
    for c in (c for c in in_grid_order(cells) if c["cell"] == "decode"):
        p = prefill.get(cell_key(c)[1:], {})
        if c["status"] == "ok":
            frac = c["floor_fraction"]
            bound = c.get("bound_fraction")
            decode = [f"{c['decode_ms']:.2f}", f"{c['floor_ms']:.2f}", _fmt(frac and 100 * frac, ".0f"),
                      _fmt(c.get("flop_floor_ms"), ".2f"), _fmt(bound and 100 * bound, ".0f"),
                      "yes" if c["graphs"] else "no"]
        else:
            note = c.get("reason") or c.get("error")
            if note not in notes:
                notes.append(note)
            decode = [f"{c['status']} ({notes.index(note) + 1})", "", "", "", "", ""]
        pre = [f"{p['tok_s']:,.0f}", f"{100 * p['fraction_of_peak']:.1f}"] if p.get("status") == "ok" else ["", ""]
        lines.append("| " + " | ".join([c["case"], c["mechanism"], backend_label(c), str(c["batch"]),
                                         size_label(c["context"]), *decode, *pre]) + " |")
    if notes:
        lines += [""] + [f"({i}) {n}" for i, n in enumerate(notes, 1)]
    return "\n".join(lines)


def docs_block(table: str, env: dict, cells: list[dict]) -> str:
    """The text between the markers: a one-line header, then the table."""
    asyncs = sorted({c["async_scheduling"] for c in cells if c.get("async_scheduling") is not None})
    mode = {(True,): "on", (False,): "off"}.get(tuple(asyncs), "mixed")
    header = (f"{env['device']}, {env['date']}, `{env['command']}` ({env.get('weights', 'dummy')} weights, "
              f"async scheduling {mode}; decode ms per step on prefix hits, floor = bytes read at 4.25 TB/s):")
    return f"{header}\n\n{table}"


def rewrite_docs(path: str | Path, block: str) -> None:
    """Put ``block`` between the markers of the markdown file at ``path``, or append a new section
    with the markers when they are missing."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    start, end = text.find(MARK_BEGIN), text.find(MARK_END)
    body = f"{MARK_BEGIN}\n{block}\n{MARK_END}"
    if start >= 0 and end > start:
        text = text[:start] + body + text[end + len(MARK_END):]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + f"{DOCS_TITLE}\n\n{body}\n"
    path.write_text(text)


def smoke_checks(cells: list[dict], block: str, out: str | None) -> None:
    """The docs rewrite on a temporary file (appended once, then replaced in place), the JSON
    output read back through ``--render``'s loader, and a floor and a FLOP count in every cell."""
    for c in cells:
        if c["status"] == "ok" and not (c.get("floor_ms", 0) > 0 or c.get("flops", 0) > 0):
            raise SystemExit(f"no floor or FLOP count in {cell_key(c)}")
    if out:
        again, _ = load_results([str(Path(out, JSON_NAME))])
        if sorted(map(cell_key, again)) != sorted(map(cell_key, cells)):
            raise SystemExit("the JSON output does not read back to the same cells")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d, "performance.md")
        path.write_text("# Performance notes\n\nSome text.\n")
        rewrite_docs(path, "placeholder")
        rewrite_docs(path, block)
        text = path.read_text()
        if text.count(MARK_BEGIN) != 1 or text.count(DOCS_TITLE) != 1 or block not in text or "placeholder" in text:
            raise SystemExit("the docs rewrite did not replace the section between the markers")
        if not text.startswith("# Performance notes\n\nSome text.\n"):
            raise SystemExit("the docs rewrite changed the text before the section")


def cell_key(cell: dict) -> tuple:
    """Cells of other block sizes, cache dtypes or state backends are other measurements, not
    replacements."""
    return (cell["cell"], cell["case"], cell["context"], cell["batch"], cell.get("block_size"),
            cell.get("kv_cache_dtype"), cell.get("state_backend"), cell.get("routed_experts"))


def backend_label(cell: dict) -> str:
    """The backend, with the block size, cache dtype and routed experts of a DeepSeek/GLM cut
    when they are not the defaults (block size: the engine's on CUDA, 64 for the MLA backends)."""
    default_block = 64 if cell.get("backend", "").startswith("TRITON_MLA") else 16  # the engine's, on CUDA
    extra = [f"block {cell['block_size']}"] if cell.get("block_size") not in (None, default_block) else []
    if cell.get("routed_experts") not in (None, DEFAULT_EXPERTS):
        extra.append(f"{cell['routed_experts']} experts")
    if cell.get("kv_cache_dtype") == "fp8":
        extra.append("fp8 cache")
    return cell["backend"] + (f" ({', '.join(extra)})" if extra else "")


def in_grid_order(cells) -> list[dict]:
    """Cells by case (in CASES order), state backend, context, prefill first, batch."""
    order = list(CASES)
    return sorted(cells, key=lambda c: (order.index(c["case"]) if c["case"] in order else len(order),
                                        c.get("state_backend") or "", c["context"], c["cell"] != "prefill",
                                        c["batch"]))


def load_results(paths: list[str]) -> tuple[list[dict], dict]:
    """The cells of earlier JSON outputs, a later file's cell replacing an earlier one's at the
    same (cell, case, context, batch), in grid order; and an environment naming every command
    (the device and versions of the last file)."""
    merged: dict[tuple, dict] = {}
    envs = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        envs.append(data["environment"])
        for cell in data["cells"]:
            merged[cell_key(cell)] = cell
    cells = in_grid_order(merged.values())
    env = dict(envs[-1])
    env["date"] = max(e["date"] for e in envs)
    env["command"] = "; ".join(dict.fromkeys(e["command"] for e in envs))
    env["cases"] = {k: v for e in envs for k, v in e.get("cases", {}).items()}
    env["merged_from"] = list(paths)
    return cells, env
