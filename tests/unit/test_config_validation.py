"""Issue #39: a config.json with a non-finite or non-positive size, epsilon, scale or cap is
refused when it is read, with the field named, instead of building a model that runs and
generates "" (a NaN ``rms_norm_eps``, ``intermediate_size`` 0) or fails later with a bare
``ZeroDivisionError`` (``query_pre_attn_scalar`` 0, ``sliding_window_pattern`` 0).

Each case starts from a shipped config and changes one field, so the rest is a real model's.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest

from attnserve.arch import ArchError, read_arch
from attnserve.presets import resolve_config_path, resolve_model_preset

NAN, INF = math.nan, math.inf

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
CASES = [  # (shipped config, the field's changes, the field the error names)
    (LLAMA, {"rms_norm_eps": NAN}, "rms_norm_eps"),
    (LLAMA, {"rms_norm_eps": INF}, "rms_norm_eps"),
    (LLAMA, {"rms_norm_eps": 0.0}, "rms_norm_eps"),
    (LLAMA, {"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    (LLAMA, {"intermediate_size": 0}, "intermediate_size"),
    (LLAMA, {"head_dim": 0}, "head_dim"),
    (LLAMA, {"rope_theta": NAN}, "rope_theta"),
    (LLAMA, {"rope_theta": 0}, "rope_theta"),
    (LLAMA, {"rope_scaling": {"rope_type": "llama3", "factor": NAN, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     "rope_scaling.factor"),
    (LLAMA, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": INF,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     "rope_scaling.low_freq_factor"),
    ("Qwen/Qwen3-30B-A3B", {"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ("Qwen/Qwen3-30B-A3B", {"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ("Qwen/Qwen3-30B-A3B", {"num_experts_per_tok": 1000}, "num_experts_per_tok"),
    ("openai-community/gpt2", {"layer_norm_epsilon": NAN}, "layer_norm_epsilon"),
    ("bigcode/starcoder2-7b", {"norm_epsilon": 0}, "norm_epsilon"),
    ("google/gemma-2-9b", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ("google/gemma-2-9b", {"attn_logit_softcapping": NAN}, "attn_logit_softcapping"),
    ("google/gemma-2-9b", {"final_logit_softcapping": INF}, "final_logit_softcapping"),
    ("google/gemma-3-1b-it", {"sliding_window_pattern": 0}, "sliding_window_pattern"),
    ("deepseek-ai/DeepSeek-V3", {"kv_lora_rank": 0}, "kv_lora_rank"),
    ("deepseek-ai/DeepSeek-V3", {"routed_scaling_factor": NAN}, "routed_scaling_factor"),
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", {"partial_rotary_factor": NAN}, "partial_rotary_factor"),
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", {"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
    ("ai21labs/AI21-Jamba-1.5-Mini", {"mamba_d_state": 0}, "mamba_d_state"),
    ("mosaicml/mpt-7b-instruct", {"logit_scale": NAN}, "logit_scale"),
    ("openai/gpt-oss-20b", {"swiglu_limit": -1.0}, "swiglu_limit"),
]


def _config(name: str, **changes) -> dict:
    cfg = json.loads(resolve_config_path(name).read_text())
    text = cfg.get("text_config")
    (text if isinstance(text, dict) else cfg).update(changes)
    return cfg


@pytest.mark.parametrize("name, changes, field", CASES,
                         ids=[f"{n.split('/')[1]}-{next(iter(c))}={next(iter(c.values()))}"[:60]
                              for n, c, _ in CASES])
def test_bad_config_values_are_refused_with_the_field_named(name, changes, field):
    read_arch(_config(name))  # the shipped config itself reads
    with pytest.raises(ArchError, match=f"'?{field}"):
        read_arch(_config(name, **changes))


def test_zero_stays_allowed_where_it_means_none():
    """Fields whose 0 means "none" or "off" keep reading: no shared experts, no dense layers
    before the MoE ones, no window layers."""
    a = read_arch(_config("deepseek-ai/DeepSeek-V3", n_shared_experts=0, first_k_dense_replace=0))
    assert a.moe.num_shared_experts == 0 and all(s.moe for s in a.layers)
    assert read_arch(_config("Qwen/Qwen2.5-7B-Instruct", max_window_layers=0)).num_layers == 28


def _demo_with(tmp_path, **changes):
    """A copy of the shipped demo model with ``changes`` in its config.json (NaN written as
    JSON's ``NaN``, which Python's json reads back as a float)."""
    src = resolve_model_preset("attnserve-demo-gqa")
    model = tmp_path / "demo"
    shutil.copytree(src, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(changes)
    (model / "config.json").write_text(json.dumps(cfg))
    return model


@pytest.mark.parametrize("changes, field", [({"rms_norm_eps": NAN}, "rms_norm_eps"),
                                            ({"intermediate_size": 0}, "intermediate_size")])
def test_engine_and_cli_refuse_the_demo_model_with_a_bad_config(tmp_path, capsys, changes, field):
    """The two configs of the issue, on the model that generated "" with them: ``LLM`` raises
    before any weight is read, and ``attnserve inspect`` exits 2 with a one-line error."""
    from attnserve import LLM
    from attnserve.entrypoints.cli import main

    model = _demo_with(tmp_path, **changes)
    with pytest.raises(ArchError, match=field):
        LLM(str(model))
    assert main(["inspect", str(model)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and field in err[0], err
