"""fp8 checkpoints with per-channel and per-tensor scales, dequantised at load (``models/quantized.py``).

A tiny llama (hidden 72, intermediate 104: no multiple of 16) is written quantised by this test,
in each layout, and dequantised by this test, plain float32; attnserve loaded from each has
equal parameters, logits and greedy tokens:
- compressed-tensors ``float-quantized`` (llm-compressor's FP8-dynamic releases): every linear
  projection but ``lm_head`` (``ignore``) with ``weight_scale`` [out, 1], per-token dynamic
  activations; and the ``block`` strategy with [16, 16] ``weight_scale`` blocks;
- ``quant_method: fp8`` without ``weight_block_size`` (AutoFP8): one ``weight_scale`` per tensor,
  static ``input_scale`` tensors and ``k_scale``/``v_scale`` beside them (dropped at load);
- ``fbgemm_fp8``: ``weight_scale`` [out, 1] and ``input_scale_ub``.
Oracle: transformers with the compressed-tensors library loads the channel checkpoint
decompressed (``CompressedTensorsConfig(run_compressed=False)``): its weights equal our
dequantised ones and its prompt logprobs match attnserve's within 1e-4, same greedy tokens.

Errors: scales that do not fit their weight name the tensor and both shapes; integer,
asymmetric, mixed-granularity and sparse compressed-tensors configs fail before any weight is
read, naming the group and the value. ``inspect``'s checkpoint bytes count one float32 scale
per output channel (or per tensor).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnserve import LLM
from attnserve.models.quantized import QuantScheme, dequantize_fp8_blocks, dequantize_fp8_scaled
from tests.models.parity import (
    VOCAB,
    assert_parity,
    build_hf_model,
    greedy,
    hf_reference,
    make_prompts,
    run_engine,
)
from tests.models.test_quantized_checkpoints import (
    LENGTHS,
    _assert_same_model,
    _edit_shard,
    _with_config,
    quantize_fp8,
    write_checkpoint,
)

LLAMA = dict(vocab_size=VOCAB, hidden_size=72, intermediate_size=104, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=18, max_position_embeddings=256)
FP8_MAX = 448.0


def quantize_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (fp8 [out, in], float32 scale [out, 1]): each row's amax / 448."""
    scale = w.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return (w.float() / scale).to(torch.float8_e4m3fn), scale


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().amax().clamp_min(1e-12) / FP8_MAX
    return (w.float() / scale).to(torch.float8_e4m3fn), scale.reshape(())


def _quantised(name: str) -> bool:
    return name.endswith("proj.weight")  # every linear projection; lm_head, embeddings and norms stay


def _checkpoints(llama, root: Path, layout: str) -> tuple[Path, Path]:
    """(quantised dir, plain dequantised dir) of the tiny llama in ``layout``."""
    _, tensors, config = llama
    quantised, plain = {}, {}
    for name, w in tensors.items():
        if not _quantised(name):
            quantised[name] = plain[name] = w
            continue
        if layout == "ct_block":
            q, scale = quantize_fp8(w, (16, 16))
        elif layout == "fp8_tensor":
            q, scale = quantize_tensor(w)
        else:
            q, scale = quantize_channel(w)
        quantised[name], quantised[name[: -len("weight")] + "weight_scale"] = q, scale
        if layout == "ct_block":
            plain[name] = dequantize_fp8_blocks(q, scale, (16, 16), torch.float32)
        else:
            plain[name] = q.float() * scale
        module = name[: -len(".weight")]
        if layout == "fp8_tensor":  # AutoFP8's static activation scales, and KV scales
            quantised[module + ".input_scale"] = torch.tensor(0.02)
        if layout == "fbgemm":
            quantised[module + ".input_scale_ub"] = torch.tensor([1200.0])
    if layout == "fp8_tensor":
        for i in range(LLAMA["num_hidden_layers"]):
            quantised[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(1.0)
            quantised[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(1.0)
    qc = {
        "ct_channel": _ct_config("channel"),
        "ct_block": _ct_config("block", [16, 16]),
        "fp8_tensor": {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
        "fbgemm": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
    }[layout]
    first = {n for n in quantised if n.startswith("model.layers.0.") and n.endswith("_scale")}  # scales first
    write_checkpoint(root / layout, quantised, dict(config, quantization_config=qc), first)
    write_checkpoint(root / "plain", plain, config)
    return root / layout, root / "plain"


def _ct_config(strategy: str, block: list[int] | None = None, **weights) -> dict:
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
                        **({"block_structure": block} if block else {}), **weights},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                  "dynamic": True},
        }},
    }


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama")
    build_hf_model("llama", LLAMA, out)
    return out, load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("layout", ["ct_channel", "ct_block", "fp8_tensor", "fbgemm"])
def test_loads_as_its_dequantised_weights(llama, tmp_path, layout):
    quantised, plain = _checkpoints(llama, tmp_path, layout)
    _assert_same_model(quantised, plain)
    original = llama[1]["model.layers.0.mlp.down_proj.weight"]
    dequantised = load_file(plain / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert 0 < (original - dequantised).abs().max() < 0.1 * original.abs().max()  # quantised, not garbage


def test_compressed_tensors_matches_transformers(llama, tmp_path):
    pytest.importorskip("compressed_tensors", reason="transformers reads compressed-tensors checkpoints through it")
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    quantised, plain = _checkpoints(llama, tmp_path, "ct_channel")
    hf = AutoModelForCausalLM.from_pretrained(quantised, dtype=torch.float32, attn_implementation="eager",
                                              quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    ours = load_file(plain / "model.safetensors")
    hf_params = dict(hf.named_parameters())
    names = [n for n in ours if _quantised(n)]
    assert len(names) == 14
    for name in names:
        assert torch.equal(hf_params[name].detach().float(), ours[name]), name
    prompts = make_prompts(LENGTHS)
    llm = LLM(str(quantised), dtype="float32", block_size=4)
    assert_parity(hf_reference(hf, prompts), run_engine(llm, prompts, greedy(prompt_logprobs=3)))


def test_schemes_from_configs():
    assert QuantScheme.from_config(_ct_config("channel")) == QuantScheme("fp8", None, "channel", "_scale")
    assert QuantScheme.from_config(_ct_config("tensor")) == QuantScheme("fp8", None, "tensor", "_scale")
    assert QuantScheme.from_config(_ct_config("block", [128, 128])) == QuantScheme("fp8", (128, 128), "block", "_scale")
    assert QuantScheme.from_config({"quant_method": "fp8"}) == QuantScheme("fp8", None, "tensor", "_scale")
    assert QuantScheme.from_config({"quant_method": "fbgemm_fp8"}) == QuantScheme("fp8", None, "channel", "_scale")
    # DeepSeek's block format keeps its own scale name and activation check
    assert QuantScheme.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]}) == QuantScheme("fp8", (128, 128))


def _int8() -> dict:
    qc = _ct_config("channel")
    qc["config_groups"]["group_0"]["weights"].update(num_bits=8, type="int")
    qc["format"] = "int-quantized"
    return qc


def _asymmetric() -> dict:
    qc = _ct_config("channel")
    qc["config_groups"]["group_0"]["weights"]["symmetric"] = False
    return qc


def _mixed() -> dict:
    qc = _ct_config("channel")
    qc["config_groups"]["group_1"] = dict(qc["config_groups"]["group_0"], targets=["re:.*mlp.*"],
                                          weights=dict(qc["config_groups"]["group_0"]["weights"], strategy="tensor"))
    return qc


def _packed() -> dict:
    qc = _ct_config("group")
    qc["format"] = "pack-quantized"
    return qc


@pytest.mark.parametrize(("qc", "expected"), [
    (_int8(), ["format 'int-quantized' is not supported", "fp8"]),
    (_packed(), ["format 'pack-quantized' is not supported"]),
    (_asymmetric(), ["group 'group_0'", "asymmetric"]),
    (_mixed(), ["mix weight scales", "channel", "tensor"]),
    (dict(_ct_config("channel"), sparsity_config={"format": "sparse-24-bitmask"}), ["sparsity_config"]),
    ({"quant_method": "fp8", "activation_scheme": "per_row"}, ["activation_scheme 'per_row' is not supported"]),
])
def test_unsupported_configs_fail_before_reading_weights(llama, tmp_path, qc, expected):
    path = _with_config(llama[0], tmp_path / "bad", qc)
    with pytest.raises(ValueError) as info:
        LLM(str(path), dtype="float32", block_size=4)
    for text in expected:
        assert text in str(info.value)
    assert "cannot read safetensors" not in str(info.value)


def test_scale_shape_mismatch_names_the_tensors(llama, tmp_path):
    quantised, _ = _checkpoints(llama, tmp_path, "ct_channel")
    path = shutil.copytree(quantised, tmp_path / "bad")
    name = "model.layers.1.mlp.down_proj.weight_scale"  # [72, 1] for a [72, 104] weight

    def edit(t):
        t[name] = torch.ones(104, 1)
    _edit_shard(path, "model-00002-of-00002.safetensors", edit)
    with pytest.raises(ValueError) as info:
        LLM(str(path), dtype="float32", block_size=4)
    msg = str(info.value)
    assert name in msg and "(104, 1)" in msg and "(72, 104)" in msg and "[72, 1]" in msg


def test_scaled_dequantisation_shapes():
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(3, 8, 16, generator=g) * 50).to(torch.float8_e4m3fn)  # three experts in one tensor
    per_expert = torch.tensor([0.5, 2.0, 4.0])
    want = q.float() * per_expert[:, None, None]
    assert torch.equal(dequantize_fp8_scaled(q, per_expert, "tensor", torch.float32), want)
    assert torch.equal(dequantize_fp8_scaled(q, per_expert.view(3, 1, 1), "tensor", torch.float32), want)
    rows = torch.rand(3, 8, generator=g)
    assert torch.equal(dequantize_fp8_scaled(q, rows, "channel", torch.float32), q.float() * rows[..., None])
    with pytest.raises(ValueError, match="non-finite"):
        dequantize_fp8_scaled(q[0], torch.tensor(float("nan")), "tensor", torch.float32)
    with pytest.raises(ValueError, match=r"channel scales needs"):
        dequantize_fp8_scaled(q[0], torch.ones(16, 1), "channel", torch.float32)


def test_checkpoint_bytes_count_channel_and_tensor_scales():
    from attnserve.arch import load_hf_config, read_arch
    from attnserve.entrypoints.weight_footprint import weight_footprint
    from attnserve.presets import resolve_config_path

    hf = load_hf_config(resolve_config_path("meta-llama/Llama-3.1-8B-Instruct"))
    plain = weight_footprint(read_arch(hf), "bfloat16")
    layers, hidden, inter = hf["num_hidden_layers"], hf["hidden_size"], hf["intermediate_size"]
    kv = hf["num_key_value_heads"] * hidden // hf["num_attention_heads"]
    linear = layers * (hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter)  # q, k, v, o, gate, up, down
    outs = layers * (2 * hidden + 2 * kv + 2 * inter + hidden)  # output channels of those
    channel = weight_footprint(read_arch(dict(hf, quantization_config=_ct_config("channel"))), "bfloat16")
    assert channel.quantization == "fp8" and channel.loaded_bytes == plain.loaded_bytes
    assert channel.checkpoint_bytes == plain.checkpoint_bytes - linear + 4 * outs
    tensor = weight_footprint(read_arch(dict(hf, quantization_config={"quant_method": "fp8"})), "bfloat16")
    assert tensor.checkpoint_bytes == plain.checkpoint_bytes - linear + 4 * 7 * layers


def test_quantization_option_names_the_checkpoints_method(llama, tmp_path):
    """vLLM's ``quantization``: the checkpoint's own method is accepted, another one or an
    unquantised checkpoint is refused before any weight is read, naming both."""
    quantised, plain = _checkpoints(llama, tmp_path, "ct_channel")
    llm = LLM(str(quantised), dtype="float32", block_size=4, quantization="compressed-tensors")
    assert len(run_engine(llm, make_prompts([5]), greedy())[0].outputs[0].token_ids) > 0
    with pytest.raises(ValueError, match="quantization='fp8' does not match .* quant_method is 'compressed-tensors'"):
        LLM(str(quantised), dtype="float32", block_size=4, quantization="fp8")
    with pytest.raises(ValueError, match="quantization='fp8': this checkpoint is not quantised"):
        LLM(str(plain), dtype="float32", block_size=4, quantization="fp8")
    with pytest.raises(ValueError, match="quantization='awq' is not supported"):
        LLM(str(plain), dtype="float32", block_size=4, quantization="awq")
