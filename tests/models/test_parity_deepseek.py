"""Parity with transformers for the MLA families (deepseek_v2, deepseek_v3, kimi_k2).

Four tiny random models (float32; MLA dims of /work/shared/tools/oracle_check.py: kv_lora_rank
32, rope 8, nope 16, v 16; layer 0 dense, the others DeepSeek MoE): V2-Lite (no q LoRA, softmax
greedy), V2 (q LoRA, group_limited_greedy, YaRN), V3 (q LoRA, sigmoid noaux_tc, n_group 2) and V3
without q LoRA with YaRN (mscale softmax correction). Each runs the four engine paths (plain,
chunked prefill, prefix-cache hits, preemption) against transformers' prompt logprobs (1e-4)
and 16 greedy tokens. Also: the latent cache holds what transformers caches, the
``ATTNSERVE_MLA_DISABLE=1`` fallback, Kimi-K2 as V3 under its own model type, and the accuracy
cost of the fp8 latent cache.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from attnserve import LLM, SamplingParams
from attnserve.arch import load_hf_config, read_arch
from attnserve.attention.backends.torch_mla import TorchMLABackend
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.core.forward_context import ForwardContext, forward_context
from attnserve.kvcache.fp8 import dequantize_mla_fp8, quantize_mla_fp8
from attnserve.models.registry import get_model_class
from attnserve.models.weights import iter_safetensors
from tests.models.parity import (
    VOCAB,
    assert_parity,
    build_hf_model,
    check_chunked_prefill,
    check_plain,
    check_preemption,
    check_prefix_hits,
    hf_reference,
    make_prompts,
    run_engine,
)

MLA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=256,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 64,
}
YARN_MAXPOS = 40 * 64

FAMILIES = {
    "v2_lite": ("deepseek_v2", dict(MLA, q_lora_rank=None, topk_method="greedy")),
    "v2": (
        "deepseek_v2",
        dict(
            MLA,
            q_lora_rank=32,
            topk_method="group_limited_greedy",
            n_group=2,
            topk_group=1,
            rope_parameters=dict(YARN),
            max_position_embeddings=YARN_MAXPOS,
        ),
    ),
    "v3": (
        "deepseek_v3",
        dict(MLA, q_lora_rank=32, n_group=2, topk_group=1, routed_scaling_factor=2.5),
    ),
    "v3_noq_yarn": (
        "deepseek_v3",
        dict(
            MLA,
            q_lora_rank=None,
            n_group=2,
            topk_group=1,
            rope_parameters=dict(YARN),
            max_position_embeddings=YARN_MAXPOS,
        ),
    ),
}

LENGTHS = [5, 12, 19, 27]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (name, path, HF model, prompts, reference), each family built once per module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            model_type, kwargs = FAMILIES[name]
            out = tmp_path_factory.mktemp(name)
            model = build_hf_model(model_type, kwargs, out)
            prompts = make_prompts(LENGTHS)
            cache[name] = name, out, model, prompts, hf_reference(model, prompts, MAX_TOKENS)
        return cache[name]

    return get


@pytest.fixture(params=sorted(FAMILIES))
def family(request, built):
    return built(request.param)


def params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3, **kw)


def test_plain(family):
    _, path, _, _, _ = family
    assert LLM(str(path), dtype="float32", block_size=4).llm_engine.parts.backend_names == ["TORCH_MLA"]
    check_plain(family)


def test_chunked_prefill(family):
    check_chunked_prefill(family)


def test_prefix_cache_hits(family):
    check_prefix_hits(family)


def test_preemption(family):
    check_preemption(family)


# ------------------------------------------------------------------ beyond the four paths


def _hf_model(tmp_path_factory, name: str, kwargs: dict | None = None):
    model_type, base = FAMILIES[name]
    out = tmp_path_factory.mktemp(name + "_extra")
    return out, build_hf_model(model_type, dict(base, **(kwargs or {})), out)


def _attnserve_prefill(path, prompt: list[int], block_size: int = 4):
    """attnserve's model over one prompt with a hand-made step: (arch, caches by layer, slots)."""
    arch = read_arch(load_hf_config(path))
    model = get_model_class(arch)(arch)
    model.load_weights(iter_safetensors(path))
    backend = TorchMLABackend(block_size)
    n = len(prompt)
    blocks = list(range(1 + -(-n // block_size), 0, -1))  # reversed: slots != positions
    slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(n)])
    dims = arch.layers[0].mla
    caches = {}
    for m in model.modules():
        if getattr(m, "layer_id", None) is not None:
            caches[m.layer_id] = torch.zeros(len(blocks) + 1, block_size, dims.latent_dim)
            m.kv_cache, m.backend, m.group_id = {"latent": caches[m.layer_id]}, backend, 0
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        positions=torch.arange(n),
        block_tables=[torch.tensor([blocks], dtype=torch.int32)],
        slot_mappings=[slots],
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
        num_decodes=0,
        max_query_len=n,
        max_seq_len=n,
    )
    ctx = ForwardContext(common, [backend.build_metadata(common, 0)], torch.full((n,), n))
    with torch.no_grad(), forward_context(ctx):
        model(torch.tensor(prompt), torch.arange(n))
    return arch, caches, slots


@pytest.mark.parametrize("name", ["v2", "v3"])
def test_latent_cache_holds_normed_ckv_and_roped_kpe(name, built):
    """Every cached row is transformers' cached ``c_kv`` (after kv_a_layernorm) and ``k_pe``
    (after RoPE); transformers' V3 stores k_pe de-interleaved ([even | odd] pairs)."""
    _, path, model, _, _ = built(name)
    prompt = make_prompts([11], seed=3)[0]
    with torch.no_grad():
        hf_cache = model(torch.tensor([prompt]), use_cache=True).cache
    arch, caches, slots = _attnserve_prefill(path, prompt)
    rank = arch.layers[0].mla.kv_lora_rank
    for i, layer in enumerate(hf_cache.layers):
        rows = caches[i].view(-1, caches[i].shape[-1])[slots]  # [n, L + R]
        c_kv, k_pe = rows[:, :rank], rows[:, rank:]
        if name == "v3":
            k_pe = torch.cat([k_pe[:, 0::2], k_pe[:, 1::2]], dim=-1)
        torch.testing.assert_close(c_kv, layer.keys[0, 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k_pe, layer.values[0, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["v2", "v3"])
def test_mla_disabled_falls_back_to_expanded_cache(name, built, monkeypatch):
    _, path, _, prompts, ref = built(name)
    monkeypatch.setenv("ATTNSERVE_MLA_DISABLE", "1")
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=7)
    parts = llm.llm_engine.parts
    assert parts.backend_names == ["TORCH_SDPA"]
    spec = parts.groups[0].entries[0].spec
    assert (spec.num_kv_heads, spec.head_size, spec.head_size_v) == (4, 24, 16)
    outs = run_engine(llm, prompts, params(prompt_logprobs=3))
    assert_parity(ref, outs)


def test_kimi_k2_is_v3_under_its_own_type(built, tmp_path):
    _, path, _, prompts, ref = built("v3")
    kimi = tmp_path / "kimi"
    shutil.copytree(path, kimi)
    cfg = json.loads((kimi / "config.json").read_text())
    cfg["model_type"] = "kimi_k2"
    (kimi / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(kimi), dtype="float32", block_size=4)
    assert llm.llm_engine.arch.model_type == "kimi_k2"
    assert_parity(ref, run_engine(llm, prompts, params(prompt_logprobs=3)))


def _fp8_emulating_hf(model, monkeypatch) -> None:
    """Make transformers' V3 see what an fp8 latent cache holds: c_kv quantised per 128-tile
    (``kvcache/fp8.py``), k_pe rounded to bf16."""
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as hf_v3

    def quantised(module, args, c_kv):
        rows = quantize_mla_fp8(c_kv, c_kv.new_zeros(*c_kv.shape[:-1], 2))
        return dequantize_mla_fp8(rows, c_kv.shape[-1], 2)[0]

    for layer in model.model.layers:
        layer.self_attn.kv_a_layernorm.register_forward_hook(quantised)
    rope = hf_v3.apply_rotary_pos_emb_interleave

    def rope_bf16_keys(q, k, cos, sin, *args, **kwargs):
        q, k = rope(q, k, cos, sin, *args, **kwargs)
        return q, k.to(torch.bfloat16).to(k.dtype)

    monkeypatch.setattr(hf_v3, "apply_rotary_pos_emb_interleave", rope_bf16_keys)


def test_fp8_latent_cache(tmp_path_factory, monkeypatch):
    """kv_cache_dtype="fp8" with kv_lora_rank 128 (one tile: 128 e4m3 + one fp32 scale + 8 bf16
    rope values = 148 bytes, the 656-byte layout at tiny size). The engine equals transformers
    fed the same quantised latents (1e-4, same greedy tokens): the fp8 path is exactly the
    definition. Against plain float32 transformers it shows the cost of fp8, measured on this
    model (seed 0, 4 prompts, chunked): prompt-logprob deviation mean 3.9e-2, max 0.35;
    teacher-forced top-1 agreement 52/59; greedy sequences diverge after a few tokens, as any
    perturbation does on a random model's flat distributions (bf16 latents: mean ~1.6e-3)."""
    path, model = _hf_model(tmp_path_factory, "v3", dict(kv_lora_rank=128))
    prompts = make_prompts(LENGTHS)
    ref = hf_reference(model, prompts, MAX_TOKENS)
    llm = LLM(
        str(path), dtype="float32", block_size=4, kv_cache_dtype="fp8", max_num_batched_tokens=7
    )
    entry = llm.llm_engine.parts.groups[0].entries[0]
    assert (entry.name, entry.spec.dtype, entry.spec.bytes_per_token) == ("latent", "fp8", 148)
    outs = run_engine(llm, prompts, params(prompt_logprobs=3))
    deviations, top1, positions = [], 0, 0
    for i, out in enumerate(outs):
        for pos in range(1, len(prompts[i])):
            want = ref.prompt_logprobs[i][pos - 1]
            got = out.prompt_logprobs[pos]
            tid = prompts[i][pos]
            deviations.append(abs(got[tid].logprob - want[tid].item()))
            top1 += max(got, key=lambda t: got[t].logprob) == int(want.argmax())
            positions += 1
    dev = torch.tensor(deviations)
    print(
        f"\nfp8 latent vs float32: prompt-logprob deviation mean {dev.mean():.2e} max "
        f"{dev.max():.2e}; teacher-forced top-1 {top1}/{positions}"
    )
    assert 1e-3 < dev.mean() < 0.1  # quantisation is really applied, and stays small
    assert top1 >= 0.75 * positions
    _fp8_emulating_hf(model, monkeypatch)
    assert_parity(hf_reference(model, prompts, MAX_TOKENS), outs)


# glm4_moe with the whole head rotated and no biases is DeepSeek-V3's MoE decoder with plain
# attention: the reference for DeepSeek configs without MLA (issue #23)
GLM_AS_PLAIN_V3 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=1.0,
                       max_position_embeddings=256, n_routed_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1,
                       first_k_dense_replace=1, routed_scaling_factor=2.5)


@pytest.fixture(scope="module")
def glm_as_plain_v3(tmp_path_factory):
    """(checkpoint dir, its config, prompts, transformers' reference) of the tiny glm4_moe."""
    out = tmp_path_factory.mktemp("glm_as_plain_v3")
    model = build_hf_model("glm4_moe", GLM_AS_PLAIN_V3, out)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    model.save_pretrained(out)
    prompts = make_prompts([7, 19])
    return out, json.loads((out / "config.json").read_text()), prompts, hf_reference(model, prompts, 8)


@pytest.mark.parametrize("no_mla", [{"qk_nope_head_dim": 0, "qk_rope_head_dim": 0, "kv_lora_rank": 512},
                                    {"kv_lora_rank": None}], ids=["zero_head_dims", "kv_lora_rank_null"])
def test_deepseek_config_without_mla_runs_as_plain_attention(no_mla, glm_as_plain_v3, tmp_path):
    """vLLM serves a deepseek_v3 config whose qk_nope/qk_rope head dims are both 0, or whose
    kv_lora_rank is null, with plain attention (q/k/v/o, hidden / heads per head, NeoX RoPE over
    the whole head); before, the first raised ZeroDivisionError and the second an ArchError."""
    path, cfg, prompts, ref = glm_as_plain_v3
    for f in path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = dict(cfg, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], head_dim=0, q_lora_rank=None,
               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="noaux_tc",
               scoring_func="sigmoid", norm_topk_prob=True, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 10000.0})
    cfg.update(no_mla)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), dtype="float32", block_size=4)
    assert llm.llm_engine.arch.mechanism.value == "GQA"
    few = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    assert_parity(ref, run_engine(llm, prompts, few))
