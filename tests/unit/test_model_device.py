"""The model the engine builds lives on the engine's device, whatever the process did before.

transformers' ``from_pretrained`` can spoil torch's cached table of factory functions when it is
the first thing in a process to use a device context: afterwards ``torch.linspace`` ignores
``with torch.device(...)`` and Gated DeltaNet's ``A_log`` was built on the CPU, so an engine on
CUDA failed in its first step ("Expected all tensors to be on the same device"); found by
``benchmarks/gpu_hybrid_drift.py`` on the H200. Run in a fresh interpreter (the table is
process-wide and the test session has long since filled it), with the meta device standing in
for CUDA.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import json, sys, tempfile
    from pathlib import Path
    import torch
    from transformers import AutoModelForCausalLM, Qwen3NextConfig
    from attnserve.arch import load_hf_config, read_arch
    from attnserve.config import EngineConfig
    from attnserve.engine.builder import _build_model

    d = tempfile.mkdtemp()
    cfg = Qwen3NextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                          layer_types=["linear_attention", "full_attention"], mlp_only_layers=[0, 1])
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)  # the first device-context user
    with torch.device("meta"):
        spoiled = torch.linspace(1.0, 2.0, 8).device.type != "meta"
    arch = read_arch(load_hf_config(d))
    model = _build_model(arch, Path(d), EngineConfig.from_kwargs(d, dtype="float32", check_weights_finite=False),
                         torch.device("meta"),
                         torch.float32)
    off = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != "meta"]
    print(json.dumps({"spoiled": spoiled, "off_device": off}))
""")


def test_model_is_on_the_engine_device_after_transformers_from_pretrained():
    src = str(Path(__file__).resolve().parents[2] / "src")
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": src, "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # (with transformers 5.x, result["spoiled"] is True: the case is real, not hypothetical)
    assert result["off_device"] == []
