"""Parity with transformers for the sparse-MLA (DSA) families: deepseek_v32 and glm_moe_dsa.

Tiny random models (float32; MLA dims of test_parity_deepseek.py with a q LoRA; 16 indexer heads
of 32 dims, so the indexer's scores have no ties; ``index_topk`` 6, far below the prompts):
DeepSeek-V3.2 (indexer on every layer, half-split indexer RoPE) and GLM-5 (indexer types
full/shared/full/shared: shared layers reuse the previous full layer's top-k and keep no
indexer cache; interleaved indexer RoPE). Each runs the four engine paths (plain batch of mixed
lengths, chunked prefill, prefix-cache hits, preemption) against transformers' prompt logprobs
(1e-4) and 16 greedy tokens. Also: sparsity is active (a top-k covering every key changes the
output and then equals dense MLA on the same weights), the indexer's RoPE layout matters, the
indexer uses the MLA's YaRN frequencies, and the accuracy cost of the fp8 indexer and fp8
latent caches against the exact path.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnserve import LLM, SamplingParams
from attnserve.kvcache.fp8 import dequantize_mla_fp8, quantize_mla_fp8
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

DSA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=256,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    index_n_heads=16,
    index_head_dim=32,
    index_topk=6,
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

FAMILIES = {
    "v32": ("deepseek_v32", dict(DSA)),
    # transformers hard-codes GLM-5's interleaved indexer RoPE; real GLM-5 configs say so in
    # indexer_rope_interleave, which is what attnserve reads
    "glm5": (
        "glm_moe_dsa",
        dict(
            DSA,
            num_hidden_layers=4,
            indexer_types=["full", "shared", "full", "shared"],
            indexer_rope_interleave=True,
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
    check_plain(family)


def test_cache_groups_and_indexers(family):
    name, path, _, _, _ = family
    parts = LLM(str(path), dtype="float32", block_size=4).llm_engine.parts
    assert parts.backend_names == ["TORCH_MLA_SPARSE"]
    # one group: every layer's latent rows, and indexer keys where an indexer runs (GLM-5's
    # shared layers 1 and 3 keep none)
    layers, indexed = (3, {0, 1, 2}) if name == "v32" else (4, {0, 2})
    want = [(i, n) for i in range(layers) for n in ("latent", "indexer") if n == "latent" or i in indexed]
    assert [(e.layer, e.name) for e in parts.groups[0].entries] == want
    attn = [layer.self_attn for layer in parts.runner.model.layers]
    assert [a.indexer is not None for a in attn] == [i in indexed for i in range(layers)]


def test_chunked_prefill(family):
    check_chunked_prefill(family)


def test_prefix_cache_hits(family):
    check_prefix_hits(family)


def test_preemption(family):
    check_preemption(family)


# ------------------------------------------------------------------ beyond the four paths


def _variant(src, dst, config: dict, drop=()):
    """A copy of a saved model with config fields replaced and tensors matching ``drop`` gone."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    if drop:
        tensors = load_file(dst / "model.safetensors")
        kept = {k: v for k, v in tensors.items() if not any(d in k for d in drop)}
        save_file(kept, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _prompt_logprobs(path, prompts, **engine) -> list[torch.Tensor]:
    """Per prompt [L - 1] the engine's logprob of each next prompt token (chunked prefill)."""
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=7, **engine)
    outs = run_engine(llm, prompts, params(prompt_logprobs=1))
    return [
        torch.tensor([o.prompt_logprobs[p][tok].logprob for p, tok in enumerate(pr) if p])
        for o, pr in zip(outs, prompts)
    ]


def _max_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_sparsity_is_active_and_full_topk_is_dense_mla(built, tmp_path):
    """index_topk 6 vs a top-k covering every key: the outputs differ; the covering one equals
    the same weights run as dense DeepSeek-V3 MLA (TORCH_MLA, indexer weights dropped)."""
    _, path, _, prompts, _ = built("v32")
    full = _variant(path, tmp_path / "full", {"index_topk": 256})
    dense = _variant(
        path,
        tmp_path / "dense",
        {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]},
        drop=("indexer.",),
    )
    assert LLM(str(dense), dtype="float32", block_size=4).llm_engine.parts.backend_names == [
        "TORCH_MLA"
    ]
    sparse_lp = _prompt_logprobs(path, prompts)
    full_lp, dense_lp = _prompt_logprobs(full, prompts), _prompt_logprobs(dense, prompts)
    assert _max_gap(full_lp, dense_lp) < 1e-4
    # the first 6 positions of a prompt see at most 6 keys: dense there, sparse after
    assert _max_gap([x[:5] for x in sparse_lp], [x[:5] for x in dense_lp]) < 1e-4
    assert _max_gap(sparse_lp, dense_lp) > 1e-2


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_indexer_rope_layout_matters(name, built, tmp_path):
    """The other RoPE layout in the indexer (half-split <-> interleaved) changes the selection:
    parity depends on reading ``indexer_rope_interleave`` (missing means half-split)."""
    _, path, model, prompts, ref = built(name)
    flipped = _variant(path, tmp_path / "flipped", {"indexer_rope_interleave": name == "v32"})
    got = _prompt_logprobs(flipped, prompts)
    want = [
        r[torch.arange(len(p) - 1), torch.tensor(p[1:])]
        for r, p in zip(ref.prompt_logprobs, prompts)
    ]
    assert _max_gap(got, want) > 1e-2
    assert _max_gap(_prompt_logprobs(path, prompts), want) < 1e-4


def test_yarn_indexer_frequencies(tmp_path):
    """With YaRN the indexer rotates with the MLA's scaled frequencies (and MLA gets the mscale
    softmax correction): parity through chunked prefill."""
    kwargs = dict(DSA, rope_parameters=dict(YARN), max_position_embeddings=40 * 64)
    model = build_hf_model("deepseek_v32", kwargs, tmp_path)
    prompts = make_prompts(LENGTHS, seed=3)
    ref = hf_reference(model, prompts, MAX_TOKENS)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, max_num_batched_tokens=7)
    assert_parity(ref, run_engine(llm, prompts, params(prompt_logprobs=3)))


def _deviation(path, prompts, exact, label, **engine):
    got = _prompt_logprobs(path, prompts, **engine)
    dev = torch.cat([(g - e).abs() for g, e in zip(got, exact)])
    changed = (dev > 1e-4).float().mean().item()
    print(
        f"\n{label} vs exact: prompt-logprob deviation mean {dev.mean():.2e} max "
        f"{dev.max():.2e}; positions changed (> 1e-4) {changed:.0%} of {dev.numel()}"
    )
    return dev


def test_fp8_indexer_cache(built):
    """indexer_cache_dtype="fp8": 36-byte rows (32 e4m3 + fp32 scale) scored the fp8 way; the
    latent stays float32. fp8 scores only move selections at near-ties, but a random tiny model
    with top-6 of up to 27 keys has many: measured on this model (seed 0, 4 prompts, chunked),
    prompt-logprob deviation mean 5.7e-2, max 0.65, 29% of the 59 positions changed (the 20
    positions with <= 6 keys are dense and never change; one swapped key of 6 moves a logprob
    by up to a few tenths on random weights)."""
    _, path, _, prompts, _ = built("v32")
    llm = LLM(str(path), dtype="float32", block_size=4, indexer_cache_dtype="fp8")
    specs = {e.name: e.spec for e in llm.llm_engine.parts.groups[0].entries}
    assert (specs["indexer"].dtype, specs["indexer"].bytes_per_token) == ("fp8", 36)
    assert specs["latent"].dtype == "float32"
    exact = _prompt_logprobs(path, prompts)
    dev = _deviation(path, prompts, exact, "fp8 indexer", indexer_cache_dtype="fp8")
    assert 0 < (dev > 1e-4).float().mean() < 0.6  # fp8 really ran; most selections agree
    assert dev.mean() < 0.1


def _fp8_latent_emulating_hf(model, monkeypatch) -> None:
    """Make transformers' V3.2 attend over what an fp8 latent cache holds: c_kv quantised per
    128-tile (``kvcache/fp8.py``), k_pe rounded to bf16. Its indexer stays exact."""
    import transformers.models.deepseek_v32.modeling_deepseek_v32 as hf_v32

    def quantised(module, args, c_kv):
        rows = quantize_mla_fp8(c_kv, c_kv.new_zeros(*c_kv.shape[:-1], 2))
        return dequantize_mla_fp8(rows, c_kv.shape[-1], 2)[0]

    for layer in model.model.layers:
        layer.self_attn.kv_a_layernorm.register_forward_hook(quantised)
    rope = hf_v32.apply_rotary_pos_emb_interleave  # the MLA's; the indexer uses another

    def rope_bf16_keys(q, k, cos, sin, *args, **kwargs):
        q, k = rope(q, k, cos, sin, *args, **kwargs)
        return q, k.to(torch.bfloat16).to(k.dtype)

    monkeypatch.setattr(hf_v32, "apply_rotary_pos_emb_interleave", rope_bf16_keys)


def test_fp8_kv_cache_latent_and_indexer(tmp_path, monkeypatch):
    """kv_cache_dtype="fp8" makes both entries fp8 (kv_lora_rank 128: a 148-byte latent row,
    the 656-byte layout at tiny size, and a 36-byte indexer row). With the indexer kept exact,
    the fp8 latent path equals transformers fed the same quantised latents (1e-4, same greedy
    tokens). Both fp8 against the exact path, measured on this model (seed 0, 4 prompts,
    chunked): prompt-logprob deviation mean 0.11, max 1.1. It is larger than dense MLA's fp8
    cost (mean 3.9e-2 in test_parity_deepseek) because a perturbed hidden state also moves the
    next layers' top-6 selections at near-ties (a bf16 latent alone: mean 1.1e-2, max 0.26)."""
    model = build_hf_model("deepseek_v32", dict(DSA, kv_lora_rank=128), tmp_path)
    prompts = make_prompts(LENGTHS)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, kv_cache_dtype="fp8")
    entries = llm.llm_engine.parts.groups[0].entries
    assert [(e.name, e.spec.bytes_per_token) for e in entries[:2]] == [
        ("latent", 148),
        ("indexer", 36),
    ]
    cache = llm.llm_engine.parts.runner.model.layers[0].self_attn.kv_cache
    assert cache["indexer"].dtype == cache["latent"].dtype == torch.uint8
    exact = _prompt_logprobs(tmp_path, prompts)
    dev = _deviation(tmp_path, prompts, exact, "fp8 latent + fp8 indexer", kv_cache_dtype="fp8")
    assert 1e-3 < dev.mean() < 0.2  # quantisation is really applied, and stays bounded
    _fp8_latent_emulating_hf(model, monkeypatch)
    ref = hf_reference(model, prompts, MAX_TOKENS)
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=7,
        kv_cache_dtype="fp8",
        indexer_cache_dtype="float32",
    )
    assert_parity(ref, run_engine(llm, prompts, params(prompt_logprobs=3)))
