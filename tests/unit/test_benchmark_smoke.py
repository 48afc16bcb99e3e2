"""The GPU benchmark scripts run end to end at toy sizes on CPU (``--smoke``: Triton's
interpreter, float32), so a change that breaks one is caught here, not in a device session.
gpu_check runs one family on CPU. Each script exits non-zero when a correctness check fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {
    "gpu_gdn": ["--smoke"],
    "gpu_gemv": ["--smoke"],
    "gpu_graphs": ["--smoke"],
    "gpu_hybrid_prefix": ["--smoke"],
    "gpu_mechanisms": ["--smoke"],
    "gpu_mla": ["--smoke"],
    "gpu_moe": ["--smoke"],
    "gpu_offload": ["--smoke"],
    "gpu_small_kernels": ["--smoke"],
    "gpu_sparse_offload": ["--smoke"],
    "gpu_state_decode": ["--smoke"],
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
