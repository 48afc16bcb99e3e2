"""Quantised checkpoints (``models/quantized.py``): block-wise fp8 and MXFP4, dequantised at load.

fp8: a tiny deepseek_v3 (hidden 72, intermediate 104, expert 40, q LoRA 24, kv_a 40: none a
multiple of 16) is written twice: quantised block-wise in [16, 16] blocks by this test (so the
edge blocks are partial), in two shards that put some scales before their weights and some
after, with one projection and the router, embeddings, norms and lm_head left unquantised; and
dequantised by this test, plain float32. attnserve loaded from each has equal parameters, equal
logits (torch.equal) and the same greedy tokens.
Oracle: transformers 5 loads block-wise fp8 on CPU with ``FineGrainedFP8Config(dequantize=True)``
(it needs ``accelerate``), but only when every weight dim is a multiple of the block: its
``Fp8Dequantize`` derives the block from the shapes and refuses partial edge blocks ("Weight
shape (72, 104) not divisible by scale grid (5, 7)"). The comparison with transformers therefore
uses [8, 8] blocks, which divide every dim of the same model: its dequantised weights equal ours
bit for bit, and prompt logprobs agree within 1e-4 with the same greedy tokens.

mxfp4: a tiny gpt_oss whose experts this test quantises to MXFP4 (per 32 values along ``in``
the exponent ceil(log2(amax / 6)), the nearest e2m1 code, the even column in the low nibble),
and writes dequantised, plain. attnserve loaded from each: equal parameters, logits and greedy
tokens. Oracle: transformers 5 loads the MXFP4 checkpoint on CPU with
``Mxfp4Config(dequantize=True)`` (no kernels, no triton): its expert weights equal this test's
dequantised ones bit for bit (the packing, nibble order and transposition are the real
format's), and its logprobs match attnserve's within 1e-4 with the same greedy tokens.

The shipped DeepSeek-V3/V3.2 and gpt-oss-20b configs are accepted, and a multimodal wrapper's
``quantization_config`` reaches ``ModelArch``.

Errors: an unsupported quant_method or fp8 variant fails when the engine is configured, before any weight is read (the directories hold an unreadable weights
file); ``load_format="dummy"`` ignores quantisation; scales that do not fit their weight and
tensors left without their partner fail at load, naming the tensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnserve import LLM
from attnserve.arch import load_hf_config, read_arch
from attnserve.models.quantized import QuantScheme, dequantize_fp8_blocks, dequantized_weights
from attnserve.presets import resolve_config_path
from tests.models.parity import (
    VOCAB,
    assert_parity,
    build_hf_model,
    greedy,
    hf_reference,
    make_prompts,
    run_engine,
)

V3 = dict(
    vocab_size=VOCAB,
    hidden_size=72,
    intermediate_size=104,
    moe_intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    q_lora_rank=24,
    max_position_embeddings=256,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
)
GPT_OSS = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                     "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False},
)
LENGTHS = [5, 12, 19]
UNQUANTISED = "model.layers.0.self_attn.o_proj.weight"  # a projection the fp8 checkpoints keep float32
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


# ----------------------------------------------------------------- the test's own quantisers


def _tiles(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[rows, cols] zero-padded to whole blocks -> [R, bm, C, bn]."""
    bm, bn = block
    rows, cols = w.shape
    r, c = -(-rows // bm), -(-cols // bn)
    padded = torch.zeros(r * bm, c * bn, dtype=w.dtype)
    padded[:rows, :cols] = w
    return padded.view(r, bm, c, bn)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (fp8 e4m3 [out, in], scale_inv [ceil(out/bm), ceil(in/bn)]): amax / 448."""
    tiles = _tiles(w.float(), block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0  # [R, C]
    q = (tiles / scale[:, None, :, None]).flatten(2).flatten(0, 1)  # [R * bm, C * bn]
    return q[: w.shape[0], : w.shape[1]].to(torch.float8_e4m3fn), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    tiles = _tiles(q.float(), block) * scale[:, None, :, None]
    return tiles.flatten(2).flatten(0, 1)[: q.shape[0], : q.shape[1]]


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[E, out, in] -> (blocks [E, out, in/32, 16], scales [E, out, in/32], dense [E, out, in])."""
    e, o, i = w.shape
    groups = w.float().view(e, o, i // 32, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)  # [E, O, G]
    scaled = groups / torch.exp2(exp)[..., None]
    codes = (scaled[..., None] - FP4_VALUES).abs().argmin(-1).to(torch.uint8)  # nearest e2m1 code
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # even column in the low nibble
    dense = FP4_VALUES[codes.long()] * torch.exp2(exp)[..., None]
    return blocks, (exp + 127).to(torch.uint8), dense.view(e, o, i)


def write_checkpoint(out: Path, tensors: dict[str, torch.Tensor], config: dict,
                     first: set[str] | None = None) -> None:
    """``config`` as config.json; the tensors in model.safetensors, or ``first`` in shard 1 and the
    rest in shard 2, with an index."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    if first is None:
        save_file({n: t.contiguous() for n, t in tensors.items()}, out / "model.safetensors")
        return
    shards = {"model-00001-of-00002.safetensors": {n: t for n, t in tensors.items() if n in first},
              "model-00002-of-00002.safetensors": {n: t for n, t in tensors.items() if n not in first}}
    for fname, part in shards.items():
        save_file({n: t.contiguous() for n, t in part.items()}, out / fname, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))


# ----------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """(original dir, its tensors, its config) of the tiny deepseek_v3."""
    out = tmp_path_factory.mktemp("v3")
    build_hf_model("deepseek_v3", V3, out)
    return out, load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text())


def _fp8_checkpoints(v3, root: Path, block: tuple[int, int]) -> tuple[Path, Path]:
    """(fp8 dir, plain dequantised dir) from the tiny deepseek_v3."""
    _, tensors, config = v3
    quantised, plain = {}, {}
    for name, w in tensors.items():
        if w.dim() == 2 and name.endswith("proj.weight") and name != UNQUANTISED:
            q, scale = quantize_fp8(w, block)
            quantised[name], quantised[name + "_scale_inv"] = q, scale
            plain[name] = dequantize_fp8(q, scale, block)
        else:
            quantised[name] = plain[name] = w
    # layer 0's scales and layer 1's weights first: some partners wait across shards either way
    first = {n for n in quantised if n.startswith("model.layers.0.") and n.endswith("_scale_inv")}
    first |= {n for n, t in quantised.items()
              if n.startswith("model.layers.1.") and t.dtype == torch.float8_e4m3fn}
    qconfig = dict(config, quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)})
    write_checkpoint(root / "fp8", quantised, qconfig, first)
    write_checkpoint(root / "plain", plain, config)
    return root / "fp8", root / "plain"


@pytest.fixture(scope="module")
def fp8_16(v3, tmp_path_factory):
    return _fp8_checkpoints(v3, tmp_path_factory.mktemp("fp8_16"), (16, 16))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(mxfp4 dir, plain dequantised dir, plain tensors) of the tiny gpt_oss."""
    root = tmp_path_factory.mktemp("gpt_oss")
    build_hf_model("gpt_oss", GPT_OSS, root / "orig")
    tensors = load_file(root / "orig" / "model.safetensors")
    config = json.loads((root / "orig" / "config.json").read_text())
    quantised, plain = {}, {}
    for name, w in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # stored [E, in, out]
            blocks, scales, dense = quantize_mxfp4(w.transpose(1, 2))
            quantised[name + "_blocks"], quantised[name + "_scales"] = blocks, scales
            plain[name] = dense.transpose(1, 2)
        else:
            quantised[name] = plain[name] = w
    first = {n for n in quantised if n.endswith("_scales")}  # every scale before its blocks
    qconfig = dict(config, quantization_config={
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"]})
    write_checkpoint(root / "mxfp4", quantised, qconfig, first)
    write_checkpoint(root / "plain", plain, config)
    return root / "mxfp4", root / "plain", plain


# ----------------------------------------------------------------- attnserve runs


def _run(path: Path, prompts: list[list[int]]):
    """(model, logits of every step, outputs) of attnserve loaded from ``path``."""
    llm = LLM(str(path), dtype="float32", block_size=4)
    model = llm.llm_engine.parts.runner.model
    logits: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda mod, args, out: logits.append(out.detach().clone()))
    return model, logits, run_engine(llm, prompts, greedy(prompt_logprobs=3))


def _assert_same_model(quantised: Path, plain: Path) -> None:
    prompts = make_prompts(LENGTHS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two engines in one process may differ by an ulp at several threads
    try:
        mq, lq, oq = _run(quantised, prompts)
        mp, lp, op = _run(plain, prompts)
    finally:
        torch.set_num_threads(threads)
    pq, pp = dict(mq.named_parameters()), dict(mp.named_parameters())
    assert pq.keys() == pp.keys()
    for name in pq:
        assert torch.equal(pq[name], pp[name]), f"parameter {name} differs"
    assert len(lq) == len(lp) > 0
    for step, (a, b) in enumerate(zip(lq, lp)):
        assert torch.equal(a, b), f"logits of step {step} differ"
    assert [o.outputs[0].token_ids for o in oq] == [o.outputs[0].token_ids for o in op]


# ----------------------------------------------------------------- fp8


def test_fp8_checkpoint_has_partial_edge_blocks(fp8_16):
    fp8, _ = fp8_16
    shard1 = load_file(fp8 / "model-00001-of-00002.safetensors")
    shard2 = load_file(fp8 / "model-00002-of-00002.safetensors")
    w, s = shard2["model.layers.0.mlp.down_proj.weight"], shard1["model.layers.0.mlp.down_proj.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and tuple(w.shape) == (72, 104) and tuple(s.shape) == (5, 7)
    assert shard1["model.layers.1.self_attn.q_b_proj.weight"].dtype == torch.float8_e4m3fn  # its scale in shard 2
    assert shard2[UNQUANTISED].dtype == torch.float32 and UNQUANTISED + "_scale_inv" not in shard2


def test_fp8_loads_as_its_dequantised_weights(v3, fp8_16):
    fp8, plain = fp8_16
    _assert_same_model(fp8, plain)
    original = load_file(v3[0] / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    dequantised = load_file(plain / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert 0 < (original - dequantised).abs().max() < 0.1 * original.abs().max()  # quantised, not garbage


def test_fp8_matches_transformers_fine_grained_fp8(v3, tmp_path):
    pytest.importorskip("accelerate", reason="transformers loads fp8 checkpoints only with accelerate")
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    fp8, plain = _fp8_checkpoints(v3, tmp_path, (8, 8))  # 8 divides every dim: transformers can load it
    hf = AutoModelForCausalLM.from_pretrained(fp8, quantization_config=FineGrainedFP8Config(dequantize=True),
                                              dtype=torch.float32, attn_implementation="eager").eval()
    ours = load_file(plain / "model.safetensors")
    hf_params = dict(hf.named_parameters())
    names = [n for n in ours if n in hf_params and n.endswith("proj.weight")]
    assert len(names) > 10
    for name in names:
        assert torch.equal(hf_params[name].detach(), ours[name]), name
    experts = hf.model.layers[1].mlp.experts.gate_up_proj  # [E, 2I, H]: gate then up
    for e in range(V3["n_routed_experts"]):
        prefix = f"model.layers.1.mlp.experts.{e}."
        fused = torch.cat([ours[prefix + "gate_proj.weight"], ours[prefix + "up_proj.weight"]])
        assert torch.equal(experts[e].detach(), fused)
    prompts = make_prompts(LENGTHS)
    llm = LLM(str(fp8), dtype="float32", block_size=4)
    assert_parity(hf_reference(hf, prompts), run_engine(llm, prompts, greedy(prompt_logprobs=3)))


def test_fp8_bfloat16_and_e8m0_scales():
    """Dequantised in float32, then cast; e8m0 scales (``scale_fmt`` ue8m0) as float8_e8m0fnu or
    uint8 exponents give what their float32 values give."""
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(40, 24, generator=g) * 100).to(torch.float8_e4m3fn)
    exps = torch.randint(-20, 5, (3, 2), generator=g)
    scale = torch.exp2(exps.float())
    ref = dequantize_fp8(q, scale, (16, 16))
    as_float = dequantize_fp8_blocks(q, scale, (16, 16), torch.float32)
    assert torch.equal(as_float, ref)
    assert torch.equal(dequantize_fp8_blocks(q, scale.to(torch.float8_e8m0fnu), (16, 16), torch.float32), ref)
    assert torch.equal(dequantize_fp8_blocks(q, (exps + 127).to(torch.uint8), (16, 16), torch.float32), ref)
    bf16 = dequantize_fp8_blocks(q, scale, (16, 16), torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, ref.to(torch.bfloat16))


# ----------------------------------------------------------------- mxfp4


def test_mxfp4_loads_as_its_dequantised_weights(gpt_oss):
    mxfp4, plain, _ = gpt_oss
    _assert_same_model(mxfp4, plain)


def test_mxfp4_matches_transformers_dequantize(gpt_oss):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    mxfp4, _, dense = gpt_oss
    hf = AutoModelForCausalLM.from_pretrained(mxfp4, quantization_config=Mxfp4Config(dequantize=True),
                                              dtype=torch.float32, attn_implementation="eager").eval()
    for i, layer in enumerate(hf.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            theirs = getattr(layer.mlp.experts, proj).detach()
            assert torch.equal(theirs, dense[f"model.layers.{i}.mlp.experts.{proj}"]), f"layer {i} {proj}"
    prompts = make_prompts(LENGTHS)
    llm = LLM(str(mxfp4), dtype="float32", block_size=4)
    assert_parity(hf_reference(hf, prompts), run_engine(llm, prompts, greedy(prompt_logprobs=3)))


def test_shipped_quantised_configs_are_supported():
    """DeepSeek-V3 / V3.2 (fp8, [128, 128]) and gpt-oss-20b (mxfp4) as shipped; a multimodal
    wrapper's top-level ``quantization_config`` reaches ``ModelArch`` too."""
    def scheme(name: str) -> QuantScheme | None:
        return QuantScheme.from_config(read_arch(load_hf_config(resolve_config_path(name))).quantization_config)

    assert scheme("deepseek-ai/DeepSeek-V3") == QuantScheme("fp8", (128, 128))
    assert scheme("deepseek-ai/DeepSeek-V3.2") == QuantScheme("fp8", (128, 128))
    assert scheme("openai/gpt-oss-20b") == QuantScheme("mxfp4")
    assert scheme("Qwen/Qwen3-8B") is None
    wrapper = load_hf_config(resolve_config_path("Qwen/Qwen3.5-27B"))
    assert "text_config" in wrapper and "quantization_config" not in wrapper["text_config"]
    wrapper["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert QuantScheme.from_config(read_arch(wrapper).quantization_config) == QuantScheme("fp8", (128, 128))


# ----------------------------------------------------------------- errors


def _with_config(src: Path, dst: Path, quantization_config: dict | None, weights: bool = False) -> Path:
    """``src``'s config.json with ``quantization_config``; its weights, or an unreadable file."""
    if weights:
        shutil.copytree(src, dst)
    else:
        dst.mkdir()
        (dst / "model.safetensors").write_bytes(b"not a safetensors file")
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(("qc", "expected"), [
    ({"quant_method": "awq", "bits": 4}, ["quant_method 'awq' is not supported", "fp8", "mxfp4"]),
    ({"quant_method": "gptq", "bits": 4}, ["quant_method 'gptq' is not supported", "compressed-tensors"]),
    ({"quant_method": "fp8", "weight_block_size": [128]}, ["weight_block_size must be two positive integers"]),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "e4m3"},
     ["scale_fmt 'e4m3' is not supported"]),
])
def test_unsupported_config_fails_before_reading_weights(v3, tmp_path, qc, expected):
    path = _with_config(v3[0], tmp_path / "bad", qc)
    with pytest.raises(ValueError) as info:
        LLM(str(path), dtype="float32", block_size=4)
    for text in expected:
        assert text in str(info.value)
    assert "cannot read safetensors" not in str(info.value)


def test_dummy_weights_ignore_quantisation(v3, tmp_path):
    path = _with_config(v3[0], tmp_path / "awq", {"quant_method": "awq", "bits": 4})
    llm = LLM(str(path), dtype="float32", block_size=4, load_format="dummy")
    outs = run_engine(llm, make_prompts([6]), greedy())
    assert len(outs[0].outputs[0].token_ids) == 16
    with pytest.raises(ValueError, match="cannot read safetensors"):  # a supported scheme: the weights are read
        LLM(str(_with_config(v3[0], tmp_path / "fp8", {"quant_method": "fp8", "weight_block_size": [16, 16]})),
            dtype="float32", block_size=4)


def _edit_shard(path: Path, shard: str, edit) -> None:
    tensors = load_file(path / shard)
    edit(tensors)
    save_file(tensors, path / shard, metadata={"format": "pt"})


def test_scale_shape_mismatch_names_the_tensors(fp8_16, tmp_path):
    path = shutil.copytree(fp8_16[0], tmp_path / "fp8")
    name = "model.layers.1.self_attn.q_b_proj.weight_scale_inv"  # [6, 2] for a [96, 24] weight

    def edit(t):
        t[name] = torch.ones(6, 3)
    _edit_shard(path, "model-00002-of-00002.safetensors", edit)
    with pytest.raises(ValueError) as info:
        LLM(str(path), dtype="float32", block_size=4)
    msg = str(info.value)
    assert name in msg and "(6, 3)" in msg and "(6, 2)" in msg


def test_unpaired_tensors_are_named(fp8_16, gpt_oss, tmp_path):
    path = shutil.copytree(fp8_16[0], tmp_path / "fp8")
    lost = "model.layers.1.self_attn.q_b_proj.weight_scale_inv"  # its weight is left without a scale
    stray = "model.layers.0.self_attn.o_proj.weight_scale_inv"  # a scale whose weight is float32

    def edit(t):
        del t[lost]
        t[stray] = torch.ones(5, 5)
    _edit_shard(path, "model-00002-of-00002.safetensors", edit)
    with pytest.raises(ValueError) as info:
        LLM(str(path), dtype="float32", block_size=4)
    msg = str(info.value)
    assert "without their partner" in msg
    assert f"'model.layers.1.self_attn.q_b_proj.weight' (torch.float8_e4m3fn) has no '{lost}'" in msg
    assert f"'{stray}' has no fp8 'model.layers.0.self_attn.o_proj.weight'" in msg

    mx = shutil.copytree(gpt_oss[0], tmp_path / "mxfp4")
    _edit_shard(mx, "model-00002-of-00002.safetensors",
                lambda t: t.pop("model.layers.1.mlp.experts.down_proj_blocks"))
    with pytest.raises(ValueError, match="'model.layers.1.mlp.experts.down_proj_scales' has no uint8 "
                                         "'model.layers.1.mlp.experts.down_proj_blocks'"):
        LLM(str(mx), dtype="float32", block_size=4)


def test_mxfp4_shape_mismatch_and_stream_order():
    """Blocks that do not fit their scales are named; pairs complete in either order, one at a time."""
    scheme = QuantScheme.from_config({"quant_method": "mxfp4"})
    blocks, scales, dense = quantize_mxfp4(torch.randn(2, 3, 64))
    stream = [("a_scales", scales), ("norm", torch.ones(3)), ("a_blocks", blocks), ("b_blocks", blocks),
              ("b_scales", scales)]
    out = list(dequantized_weights(iter(stream), scheme, torch.bfloat16))
    assert [n for n, _ in out] == ["norm", "a", "b"]
    for _, t in out[1:]:
        assert t.dtype == torch.bfloat16 and torch.equal(t, dense.transpose(1, 2).to(torch.bfloat16))
    with pytest.raises(ValueError, match="'x_blocks' and 'x_scales'.*do not fit"):
        bad = [("x_blocks", blocks), ("x_scales", scales[:, :, :1])]
        list(dequantized_weights(iter(bad), scheme, torch.float32))
