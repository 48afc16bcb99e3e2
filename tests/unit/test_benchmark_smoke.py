"""The GPU benchmark scripts run end to end at toy sizes on CPU (``--smoke``: Triton's
interpreter, float32), so a change that breaks one is caught here, not in a device session.
gpu_check runs one family on CPU. Each script exits non-zero when a correctness check fails.
The ceilings the scripts measure (``benchmarks/ceilings.py``) are measured here on CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ceilings  # noqa: E402

SCRIPTS = {
    "gpu_attention": ["--smoke"],
    "gpu_decode_breakdown": ["--smoke"],
    "gpu_gdn": ["--smoke"],
    "gpu_gemv": ["--smoke"],
    "gpu_graphs": ["--smoke"],
    "gpu_hybrid_prefix": ["--smoke"],
    "gpu_indexer_gluon": ["--smoke"],
    "gpu_mechanisms": ["--smoke"],
    "gpu_mla": ["--smoke"],
    "gpu_mla_gluon": ["--smoke"],
    "gpu_mla_sparse_gluon": ["--smoke"],
    "gpu_moe": ["--smoke"],
    "gpu_offload": ["--smoke"],
    "gpu_prefill_gluon": ["--smoke"],
    "gpu_small_kernels": ["--smoke"],
    "gpu_sparse_offload": ["--smoke"],
    "gpu_state_decode": ["--smoke"],
    "gpu_state_prefill": ["--smoke"],
    "gpu_serve": ["--smoke", "--rates", "inf,40", "--num-clients", "2"],
    "gpu_check": ["--device", "cpu", "--only", "llama3_gqa", "--dtypes", "float32"],
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_benchmark_runs_at_toy_sizes(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["OUT"] = str(tmp_path)  # the scripts write their JSON there
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), *SCRIPTS[script]],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert list(tmp_path.glob("*.json")), f"{script} wrote no JSON"


def run_gpu_attention(tmp_path, args: list[str], twin_off: str | None = None,
                      failing: tuple[str, ...] = ()) -> dict:
    """``gpu_attention.py --smoke *args``: its JSON. ``twin_off``: a feature keyword whose checks
    compare against a twin made wrong (its output + 1), so those checks must fail; ``failing``:
    the check cases that then fail.

    In a smoke run the script exits 1 exactly when a check fails (2 is for no GPU without
    ``--smoke``), else 0. An uncaught exception exits 1 too, so a run is also required to reach
    its end: no traceback, the JSON written, and the last line naming the failed checks, if any."""
    script = str(ROOT / "benchmarks" / "gpu_attention.py")
    wrapper = (
        "import runpy, sys\n"
        f"sys.path[:0] = [{str(ROOT / 'src')!r}, {str(ROOT / 'benchmarks')!r}]\n"
        "import attnserve.attention.reference as ref\n"
        "twin = ref.paged_attention\n"
        f"ref.paged_attention = lambda *a, **kw: twin(*a, **kw) + ({twin_off!r} in kw)\n"
        f"sys.argv = [{script!r}, '--smoke', *{args!r}]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    env = {**os.environ, "OUT": str(tmp_path / "out")}  # OUT: made by it; TRITON_INTERPRET from conftest
    proc = subprocess.run([sys.executable, "-c", wrapper], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    log = proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.returncode == (1 if failing else 0) and "Traceback" not in proc.stderr, log
    path = tmp_path / "out" / "gpu_attention.json"
    assert f"wrote {path}" in proc.stdout.splitlines(), log
    last = proc.stdout.rstrip().splitlines()[-1]
    if failing:
        assert last.startswith(f"checks FAILED: {', '.join(failing)} (bound "), log
    else:
        assert "checks FAILED" not in proc.stdout, log
    return json.loads(path.read_text())


def test_gpu_attention_prefill_only_times_one_shape_without_checks(tmp_path):
    got = run_gpu_attention(tmp_path, ["--only", "prefill", "--prefill-tokens", "48"])
    assert (got["only"], got["checks"], got["checks_ok"]) == (["prefill"], [], None)
    assert (got["decode_shapes"], got["prefill_tokens"]) == ([], [48])
    assert [(r["kind"], r["tokens"]) for r in got["rows"]] == [("prefill", 48)]
    assert got["rows"][0]["ours"] > 0 and got["ceilings"]["copy_bw"] > 0


def test_gpu_attention_only_checks_times_nothing_and_a_failure_exits_1(tmp_path):
    """Only the window check meets a wrong twin: it fails, the other 13 pass, nothing is timed (no
    ceilings either), and the run exits 1."""
    got = run_gpu_attention(tmp_path, ["--only", "checks"], twin_off="window", failing=("window",))
    assert got["checks_ok"] is False and len(got["checks"]) == 14
    assert [c["case"] for c in got["checks"] if not c["ok"]] == ["window"]
    assert (got["only"], got["rows"], got["ceilings"], got["prefill_tokens"]) == (["checks"], [], None, [])


def test_gpu_attention_options_parse_and_reject_bad_input():
    import gpu_attention as ga  # not run as a script: the H200 defaults

    args = ga.parse_args(["--decode-shapes", "1x32768,16X4096", "--prefill-tokens", "16384"])
    assert args.only == ["checks", "decode", "prefill"]
    assert (args.decode_shapes, args.prefill_tokens) == ([(1, 32768), (16, 4096)], [16384])
    args = ga.parse_args(["--only", "prefill", "--only", "checks"])
    assert (args.only, args.decode_shapes, args.prefill_tokens) == (["checks", "prefill"], [], list(ga.PREFILL_TOKENS))
    assert (1, 32768) in ga.parse_args([]).decode_shapes  # issue #22's batch-1 row is in the default
    for bad in (["--only", "decode,bogus"], ["--only", ""], ["--decode-shapes", "1x"], ["--decode-shapes", "0x8"],
                ["--prefill-tokens", "16,-3"], ["--only", "decode", "--prefill-tokens", "16"],
                ["--only", "checks", "--decode-shapes", "1x16"]):
        with pytest.raises(SystemExit):
            ga.parse_args(bad)


def test_ceilings_measured_on_cpu():
    got = ceilings.measure_ceilings("cpu", copy_bytes=1 << 20, gemm_n=64)
    assert {"copy_bw", "matmul_flops", "copy_us", "gemm_us", "copy_bytes", "gemm_n", "gemm_dtype",
            "nominal_bw", "nominal_flops", "timer", "device", "note"} <= set(got)
    for key in ("copy_bw", "matmul_flops", "copy_us", "gemm_us"):
        assert math.isfinite(got[key]) and got[key] > 0, key
    assert (got["copy_bytes"], got["gemm_n"], got["gemm_dtype"]) == (1 << 20, 64, "float32")
    assert got["copy_bw"] == pytest.approx(2 * got["copy_bytes"] / (got["copy_us"] * 1e-6))
    assert got["matmul_flops"] == pytest.approx(2 * 64**3 / (got["gemm_us"] * 1e-6))
    assert (got["nominal_bw"], got["nominal_flops"]) == (ceilings.NOMINAL_BW, ceilings.NOMINAL_FLOPS)
    pct = ceilings.fractions(got, bw=got["copy_bw"], flops=got["matmul_flops"] / 2)
    assert pct["pct_bw_measured"] == pytest.approx(100)
    assert pct["pct_flops_measured"] == pytest.approx(50)
    assert pct["pct_bw"] == pytest.approx(100 * got["copy_bw"] / ceilings.NOMINAL_BW)
    assert set(ceilings.fractions(got, bw=1.0)) == {"pct_bw", "pct_bw_measured"}


def test_ceilings_cpu_timer_measures_and_inputs_are_checked():
    seconds = ceilings.median_seconds(lambda: time.sleep(0.002), torch.device("cpu"), rep_ms=20)
    assert 0.002 <= seconds < 0.5
    for bad in ({"copy_bytes": 0}, {"gemm_n": -1}, {"gemm_n": 2.0}):
        with pytest.raises(ValueError, match="positive int"):
            ceilings.measure_ceilings("cpu", **bad)
    with pytest.raises(ValueError, match="cuda or cpu"):
        ceilings.measure_ceilings("meta")


def test_gpu_mechanisms_budget_starts_groups_and_finishes_them(tmp_path):
    """``--budget-s 0``: the first (case, context) group still runs its prefill and every decode
    cell (all past the budget); the second group does not start, its cells skipped by the budget."""
    env = {**os.environ, "OUT": str(tmp_path)}
    args = ["--smoke", "--cases", "llama8b", "--contexts", "32,64", "--batches", "1,2", "--budget-s", "0"]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_mechanisms.py"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    cells = json.loads((tmp_path / "gpu_mechanisms.json").read_text())["cells"]
    got = {(c["context"], c["cell"], c["batch"]): (c["status"], c.get("reason")) for c in cells}
    spent = "not started: the run's time budget (--budget-s 0) was spent"
    assert got == {(32, "prefill", 2): ("ok", None), (32, "decode", 1): ("ok", None), (32, "decode", 2): ("ok", None),
                   (64, "prefill", 2): ("skipped", spent), (64, "decode", 1): ("skipped", spent),
                   (64, "decode", 2): ("skipped", spent)}
