"""``attnserve inspect`` in JSON and table form, its errors, and its plot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attnserve.arch import LayerKind, load_hf_config, read_arch
from attnserve.config import EngineConfig
from attnserve.engine.plan import plan_engine
from attnserve.entrypoints.cli import main
from attnserve.platforms import get_platform
from attnserve.presets import preset_names, resolve_config_path

GIB = 1024**3


def run_json(capsys, *args) -> dict:
    assert main(["inspect", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_llama(capsys):
    out = run_json(capsys, "meta-llama/Llama-3.1-8B-Instruct", "--platform", "cpu", "--memory", "16",
                   "--max-model-len", "8192", "--dtype", "bfloat16")  # "auto" on a CPU follows its flags
    assert out["model_type"] == "llama" and out["mechanism"] == "GQA" and out["num_layers"] == 32
    assert out["kv_cache_dtype"] == "bfloat16"
    assert out["kv_bytes_per_token"] == 131_072 and out["state_bytes_per_sequence"] == 0
    assert out["max_tokens"] == 16 * GIB // 131_072 == 131_072
    assert out["max_sequences"] == 16 * GIB // (8192 * 131_072) == 16
    (group,) = out["layer_groups"]
    assert group == {**group, "kind": "full", "num_layers": 32, "bytes_per_token_per_layer": 4096,
                     "state_bytes_per_sequence_per_layer": 0, "window": None, "backend": "TORCH_SDPA"}


def test_json_deepseek_v32_fp8(capsys):
    out = run_json(capsys, "deepseek-ai/DeepSeek-V3.2", "--kv-cache-dtype", "fp8", "--platform", "cpu")
    assert out["mechanism"] == "SPARSE_MLA" and out["kv_cache_dtype"] == "fp8"
    assert out["kv_bytes_per_token"] == 788 * 61
    (group,) = out["layer_groups"]
    assert group["bytes_per_token_per_layer"] == 788
    assert group["components"] == {"latent": 656, "indexer": 132}


def test_json_hybrid_and_windows(capsys):
    out = run_json(capsys, "Qwen/Qwen3-Next-80B-A3B-Instruct", "--platform", "cpu")
    assert out["mechanism"] == "HYBRID"
    kinds = {g["kind"]: g for g in out["layer_groups"]}
    assert kinds["gdn"]["num_layers"] == 36 and kinds["gdn"]["bytes_per_token_per_layer"] == 0
    assert kinds["gdn"]["state_bytes_per_sequence_per_layer"] == 32 * 128 * 128 * 4 + 3 * 8192 * 2
    assert kinds["full"]["bytes_per_token_per_layer"] == 2048
    assert out["state_bytes_per_sequence"] == 36 * (32 * 128 * 128 * 4 + 3 * 8192 * 2)
    oss = run_json(capsys, "openai/gpt-oss-20b", "--platform", "cpu")
    windows = sorted((g["window"] or 0) for g in oss["layer_groups"])
    assert windows == [0, 128]
    # sliding layers counted at their full rate in the per-token figure
    assert oss["kv_bytes_per_token"] == 24 * 2 * 8 * 64 * 2


def test_offload_column_covers_sliding_windows(capsys):
    oss = run_json(capsys, "openai/gpt-oss-20b", "--platform", "cpu")
    offload = {g["window"]: g["offload"] for g in oss["layer_groups"]}
    assert offload[None] == "prefix blocks"
    assert offload[128].startswith("prefix blocks") and "window" in offload[128]
    assert not any("not yet" in o for o in offload.values())


@pytest.mark.parametrize("platform", ["cpu", "cuda", "rocm"])
@pytest.mark.parametrize("name", preset_names())
def test_every_shipped_config_on_every_platform(capsys, name, platform):
    """What inspect shows is the engine's plan for the config: every layer's kind, window, bytes
    and backend (with the ones passed over), and the totals."""
    out = run_json(capsys, name, "--platform", platform)
    path, plat = resolve_config_path(name), get_platform(platform)
    plan = plan_engine(read_arch(load_hf_config(path)), EngineConfig.from_kwargs(str(path.parent)), plat)
    assert out["platform"] == platform
    assert (out["dtype"], out["kv_cache_dtype"], out["block_size"], out["max_model_len"]) == (
        plan.dtype, plan.kv_cache_dtype, plan.block_size, plan.max_model_len)
    assert (out["kv_bytes_per_token"], out["state_bytes_per_sequence"], out["bytes_per_sequence"]) == (
        plan.kv_bytes_per_token, plan.state_bytes_per_sequence, plan.bytes_per_sequence)
    rows = out["layer_groups"]
    row_of = {i: g for g in rows for i in g["layers"]}
    assert sorted(row_of) == [lp.layer for lp in plan.layers] and len(row_of) == out["num_layers"]
    assert sum(g["num_layers"] for g in rows) == out["num_layers"]  # each layer in one row
    for spec, lp in zip(plan.rank_arch.layers, plan.layers, strict=True):
        g, own = row_of[lp.layer], [e.spec for e in plan.entries if e.layer == lp.layer]
        assert (g["kind"], g["window"]) == (lp.kind.value, spec.window)
        assert g["bytes_per_token_per_layer"] == sum(s.bytes_per_token for s in own)
        assert g["state_bytes_per_sequence_per_layer"] == sum(s.bytes_per_sequence for s in own)
        assert g["backend"] == lp.backend.name
        assert g["passed_over"] == {n: list(r) for n, r in lp.backend.passed_over}
    assert out["kv_bytes_per_token"] == sum(g["bytes_per_token_per_layer"] * g["num_layers"] for g in rows)
    assert out["state_bytes_per_sequence"] == sum(
        g["state_bytes_per_sequence_per_layer"] * g["num_layers"] for g in rows)
    for g in rows:  # passed over: the platform's list ahead of the backend, each with its reasons
        priority = list(plat.backend_priority(LayerKind(g["kind"])))
        ahead = priority if g["backend"] == "none" else priority[:priority.index(g["backend"])]
        assert list(g["passed_over"]) == ahead and all(g["passed_over"].values())
    # the table names the same backend for each kind
    assert main(["inspect", name, "--platform", platform]) == 0
    backends = capsys.readouterr().out.split("\nBackends:\n", 1)[1].splitlines()
    for g in rows:
        assert any(line.startswith(f"  {g['kind']}: {g['backend']}") for line in backends), g


def test_table_form_explains_backends(capsys):
    assert main(["inspect", "mistralai/Mistral-7B-v0.1", "--platform", "cuda", "--memory", "24"]) == 0
    text = capsys.readouterr().out
    assert "mechanism GQA" in text and "4096" in text
    assert "FLASH_ATTN: library 'flash_attn' is not installed" in text
    assert "tokens of KV cache" in text


def test_wrong_explicit_backend_exits_nonzero_with_reasons(capsys):
    code = main(["inspect", "deepseek-ai/DeepSeek-V3", "--platform", "cpu", "--attention-backend", "TORCH_SDPA"])
    assert code != 0
    err = capsys.readouterr().err
    assert "TORCH_SDPA cannot run mla layers" in err and "does not handle mla layers" in err


def test_config_path_and_missing_model(tmp_path, capsys):
    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 3, "vocab_size": 100, "torch_dtype": "float16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = run_json(capsys, str(tmp_path), "--platform", "cpu", "--dtype", "float16")
    assert out["kv_bytes_per_token"] == 3 * 2 * 2 * 16 * 2
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "neither a model directory" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_plot_writes_png(tmp_path, capsys):
    path = tmp_path / "kv.png"
    assert main(["inspect", "meta-llama/Llama-3.1-8B-Instruct", "--plot", str(path)]) == 0
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_python_dash_m_is_the_same_command():
    # dtype given: "auto" on a CPU depends on its flags (bfloat16 with AVX512_BF16, else float32)
    proc = subprocess.run([sys.executable, "-m", "attnserve", "inspect", "openai-community/gpt2", "--json",
                           "--dtype", "float32"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["kv_bytes_per_token"] == 12 * 2 * 12 * 64 * 4


# --- a whole device (issue #23): the weights first, the KV cache from what is left ----------------


def test_device_memory_subtracts_the_weights(capsys):
    """Llama-3.1-8B: 8,030,261,248 parameters (its model card) in bfloat16, then the KV cache."""
    out = run_json(capsys, "meta-llama/Llama-3.1-8B-Instruct", "--platform", "cpu", "--device-memory", "80GiB",
                   "--max-model-len", "8192", "--memory", "16")
    device = out["device"]
    assert device["num_parameters"] == 8_030_261_248 and device["weight_bytes"] == 2 * 8_030_261_248
    assert device["checkpoint_weight_bytes"] == device["weight_bytes"] and device["quantization"] is None
    usable = int(80 * GIB * 0.9)
    assert device["usable_bytes"] == usable and device["weights_fit"]
    assert device["kv_cache_bytes"] == usable - 2 * 8_030_261_248
    assert device["max_tokens"] == (usable - 2 * 8_030_261_248) // 131_072
    assert device["max_sequences"] == (usable - 2 * 8_030_261_248) // (8192 * 131_072)
    assert out["max_tokens"] == 16 * GIB // 131_072  # the KV-budget answer stays
    # the table says the same: the weights, then the KV cache left after them
    assert main(["inspect", "meta-llama/Llama-3.1-8B-Instruct", "--platform", "cpu", "--device-memory", "80GiB",
                 "--max-model-len", "8192"]) == 0
    text = capsys.readouterr().out
    assert "weights: 8.03B parameters" in text and "in bfloat16" in text
    assert f"after the weights: {device['max_tokens']:,} tokens; {device['max_sequences']:,} sequences" in text


def test_deepseek_v32_weights_do_not_fit_in_80_gib(capsys):
    out = run_json(capsys, "deepseek-ai/DeepSeek-V3.2", "--platform", "cpu", "--gpu-memory", "80",
                   "--kv-cache-dtype", "fp8", "--memory", "80")
    device = out["device"]
    assert device["quantization"] == "fp8" and not device["weights_fit"]
    assert device["kv_cache_bytes"] == 0 and device["max_tokens"] == 0
    assert device["weight_bytes"] > 600 * 2 * GIB > device["checkpoint_weight_bytes"] > 600 * GIB
    assert not device["with_checkpoint_weights"]["weights_fit"]
    assert out["max_tokens"] == 80 * GIB // out["kv_bytes_per_token"]  # the KV budget alone
    assert main(["inspect", "deepseek-ai/DeepSeek-V3.2", "--platform", "cpu", "--device-memory", "80GiB"]) == 0
    assert "do not fit" in capsys.readouterr().out


def test_checkpoint_bytes_equal_the_released_checkpoints():
    """Quantised weights as stored, against released checkpoints: gpt-oss-20b's
    model.safetensors.index.json total_size (MXFP4 experts), and the fp8 DeepSeek-V3/R1
    checkpoint's tensor list (shape and dtype of every tensor of layers 0-60; the MTP layer 61,
    which attnserve does not load, left out)."""
    from attnserve.arch import load_hf_config, read_arch
    from attnserve.entrypoints.weight_footprint import weight_footprint
    from attnserve.presets import resolve_config_path

    def footprint(name: str):
        return weight_footprint(read_arch(load_hf_config(resolve_config_path(name))), "bfloat16")

    assert footprint("openai/gpt-oss-20b").checkpoint_bytes == 13_761_264_768
    h, v = 7168, 129280
    rows = [  # (tensors, elements each, bytes per element)
        (2, v * h, 2),  # embed_tokens, lm_head
        (3 * 3, h * 18432, 1), (3 * 3, 56 * 144, 4),  # dense MLPs of layers 0-2, fp8 + block scales
        (61 * 2, h, 2), (61, 512, 2), (61, 1536, 2),  # norms
        (61, 576 * h, 1), (61, 5 * 56, 4), (61, 32768 * 512, 1), (61, 256 * 4, 4),  # kv_a, kv_b
        (61, h * 16384, 1), (61, 56 * 128, 4), (61, 1536 * h, 1), (61, 12 * 56, 4),  # o, q_a
        (61, 24576 * 1536, 1), (61, 192 * 12, 4),  # q_b
        (58 * 256 * 3, 2048 * h, 1), (58 * 256 * 3, 16 * 56, 4),  # routed experts
        (58, 256, 4), (58, 256 * h, 2),  # router: correction bias (float32), gate
        (58 * 3, 2048 * h, 1), (58 * 3, 16 * 56, 4),  # shared experts
        (1, h, 2),  # final norm
    ]
    v3 = footprint("deepseek-ai/DeepSeek-V3")
    assert v3.checkpoint_bytes == sum(n * e * b for n, e, b in rows)
    assert v3.loaded_bytes > 2 * v3.num_parameters  # dequantised to bf16 (routers in float32)


def test_memory_sizes_parse():
    from attnserve.entrypoints.inspect import parse_gib

    assert parse_gib("80") == parse_gib("80GiB") == parse_gib("80 g") == 80.0
    assert parse_gib("80GB") == pytest.approx(80e9 / GIB)
    for bad in ("lots", "-1", "0GiB"):
        with pytest.raises(ValueError):
            parse_gib(bad)


def test_device_memory_of_a_family_attnserve_does_not_build(tmp_path, capsys):
    cfg = {"model_type": "qwen2_moe", "vocab_size": 100, "num_hidden_layers": 2, "hidden_size": 64,
           "num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = run_json(capsys, str(tmp_path), "--platform", "cpu", "--device-memory", "24")
    assert "device" not in out and any("cannot be counted" in n for n in out["notes"])
