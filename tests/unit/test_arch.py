"""read_arch on every shipped config and on the quirks DESIGN.md lists.

Expected values are written out by hand from the config files, not computed by the code
under test.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from attnserve.arch import (
    FAMILIES,
    ArchError,
    DeepNorm,
    GDNDims,
    GptOssOptions,
    KDADims,
    LayerKind,
    LightningDims,
    LlamaOptions,
    MambaDims,
    Mechanism,
    ModelArch,
    read_arch,
)
from attnserve.presets import HF_CONFIG_DIR, preset_names, resolve_config_path


def arch(name: str, **overrides) -> ModelArch:
    cfg = json.loads(resolve_config_path(name).read_text())
    cfg.update(overrides)
    return read_arch(cfg)


def kinds(a: ModelArch) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in a.layers:
        out[s.kind.value] = out.get(s.kind.value, 0) + 1
    return out


# name -> (model_type, mechanism, layers, kind counts, heads, kv heads, head size)
EXPECTED = {
    "meta-llama/Llama-3.1-8B-Instruct": ("llama", "GQA", 32, {"full": 32}, 32, 8, 128),
    "meta-llama/Llama-2-7b-hf": ("llama", "MHA", 32, {"full": 32}, 32, 32, 128),
    "Qwen/Qwen2.5-7B-Instruct": ("qwen2", "GQA", 28, {"full": 28}, 28, 4, 128),
    "Qwen/Qwen3-0.6B": ("qwen3", "GQA", 28, {"full": 28}, 16, 8, 128),
    "Qwen/Qwen3-8B": ("qwen3", "GQA", 36, {"full": 36}, 32, 8, 128),
    "Qwen/Qwen3-30B-A3B": ("qwen3_moe", "GQA", 48, {"full": 48}, 32, 4, 128),
    "Qwen/Qwen3-Next-80B-A3B-Instruct": ("qwen3_next", "HYBRID", 48, {"gdn": 36, "full": 12}, 16, 2, 256),
    "Qwen/Qwen3.5-27B": ("qwen3_5", "HYBRID", 64, {"gdn": 48, "full": 16}, 24, 4, 256),
    "ai21labs/AI21-Jamba-1.5-Mini": ("jamba", "HYBRID", 32, {"mamba": 28, "full": 4}, 32, 8, 128),
    "bigcode/starcoder2-7b": ("starcoder2", "GQA", 32, {"sliding": 32}, 36, 4, 128),
    "deepseek-ai/DeepSeek-V3": ("deepseek_v3", "MLA", 61, {"mla": 61}, 128, 1, 192),
    "deepseek-ai/DeepSeek-V3.2": ("deepseek_v32", "SPARSE_MLA", 61, {"sparse_mla": 61}, 128, 1, 192),
    "zai-org/GLM-5": ("glm_moe_dsa", "SPARSE_MLA", 78, {"sparse_mla": 78}, 64, 1, 256),
    "google/gemma-2-9b": ("gemma2", "GQA", 42, {"sliding": 21, "full": 21}, 16, 8, 256),
    "google/gemma-3-1b-it": ("gemma3_text", "MQA", 26, {"sliding": 22, "full": 4}, 4, 1, 256),
    "microsoft/Phi-3-mini-4k-instruct": ("phi3", "MHA", 32, {"sliding": 32}, 32, 32, 96),
    "mistralai/Mistral-7B-v0.1": ("mistral", "GQA", 32, {"sliding": 32}, 32, 8, 128),
    "mistralai/Mixtral-8x7B-v0.1": ("mixtral", "GQA", 32, {"full": 32}, 32, 8, 128),
    "moonshotai/Kimi-Linear-48B-A3B-Instruct": ("kimi_linear", "HYBRID", 27, {"kda": 20, "mla": 7}, 32, 1, 192),
    "mosaicml/mpt-7b-instruct": ("mpt", "MHA", 32, {"full": 32}, 32, 32, 128),
    "openai-community/gpt2": ("gpt2", "MHA", 12, {"full": 12}, 12, 12, 64),
    "openai/gpt-oss-20b": ("gpt_oss", "GQA", 24, {"sliding": 12, "full": 12}, 64, 8, 64),
}


def test_every_shipped_config_is_covered():
    assert sorted(EXPECTED) == preset_names()
    assert (HF_CONFIG_DIR / "SOURCES.md").exists()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shipped_config(name):
    mt, mech, n, kind_counts, heads, kv, hd = EXPECTED[name]
    a = arch(name)
    assert a.model_type == mt
    assert a.mechanism.value == mech
    assert a.num_layers == n == len(a.layers)
    assert kinds(a) == kind_counts
    assert (a.num_heads, a.num_kv_heads, a.head_size) == (heads, kv, hd)
    assert [s.index for s in a.layers] == list(range(n))


def test_qwen25_sliding_window_off_means_no_window():
    a = arch("Qwen/Qwen2.5-7B-Instruct")
    assert all(s.window is None for s in a.layers)  # sliding_window 131072 ships with use_sliding_window false
    on = arch("Qwen/Qwen2.5-7B-Instruct", use_sliding_window=True, sliding_window=4096, max_window_layers=20)
    assert [s.window for s in on.layers] == [None] * 20 + [4096] * 8


def test_gemma_and_gpt_oss_alternate():
    g2 = arch("google/gemma-2-9b")
    assert [s.window for s in g2.layers[:4]] == [4096, None, 4096, None]
    assert g2.layers[0].softcap == 50.0
    assert g2.layers[0].scale == pytest.approx(256 ** -0.5)
    g3 = arch("google/gemma-3-1b-it")
    # every 6th layer is global; sliding layers use the local RoPE base 10000, global ones 1e6
    assert [i for i, s in enumerate(g3.layers) if s.window is None] == [5, 11, 17, 23]
    assert g3.layers[0].window == 512 and g3.layers[0].rope.theta == 10000.0
    assert g3.layers[5].rope.theta == 1_000_000.0
    oss = arch("openai/gpt-oss-20b")
    assert [s.window for s in oss.layers[:4]] == [128, None, 128, None]
    assert all(s.sinks for s in oss.layers)
    assert oss.layers[0].rope.rope_type == "yarn" and oss.layers[0].rope.factor == 32.0
    assert oss.moe.num_experts == 32 and oss.moe.top_k == 4


def test_mistral_phi3_starcoder2_windows():
    assert {s.window for s in arch("mistralai/Mistral-7B-v0.1").layers} == {4096}
    assert {s.window for s in arch("microsoft/Phi-3-mini-4k-instruct").layers} == {2047}
    assert {s.window for s in arch("bigcode/starcoder2-7b").layers} == {4096}
    assert {s.window for s in arch("mistralai/Mixtral-8x7B-v0.1").layers} == {None}


def test_dsa_indexers():
    v32 = arch("deepseek-ai/DeepSeek-V3.2")
    idx = v32.layers[0].indexer
    assert (idx.n_heads, idx.head_dim, idx.topk) == (64, 128, 2048)
    assert idx.rope_interleaved is False  # field missing: NeoX half-split
    assert all(s.indexer.has_cache for s in v32.layers)
    glm = arch("zai-org/GLM-5")
    assert glm.layers[0].indexer.rope_interleaved is True
    assert glm.layers[0].indexer.n_heads == 32
    shared = arch("zai-org/GLM-5", indexer_types=["full", "shared"] * 39)
    assert [s.indexer.has_cache for s in shared.layers[:4]] == [True, False, True, False]
    pattern = arch("zai-org/GLM-5", index_topk_pattern="FSS" * 26)
    assert [s.indexer.has_cache for s in pattern.layers[:6]] == [True, False, False, True, False, False]
    with pytest.raises(ArchError, match="indexer_types"):
        arch("zai-org/GLM-5", indexer_types=["shared"] * 78)


def test_deepseek_v3_mla_dims_rope_and_scale():
    a = arch("deepseek-ai/DeepSeek-V3")
    s = a.layers[0]
    assert (s.mla.kv_lora_rank, s.mla.qk_rope_head_dim, s.mla.qk_nope_head_dim, s.mla.v_head_dim) == (512, 64, 128, 128)
    assert s.mla.q_lora_rank == 1536
    assert s.rope.rope_type == "yarn" and s.rope.interleaved and s.rope.rotary_dim == 64
    assert s.scale == pytest.approx(0.1352338, abs=1e-7)  # 192^-0.5 * (0.1*ln 40 + 1)^2
    assert arch("zai-org/GLM-5").layers[0].scale == pytest.approx(256 ** -0.5)
    # first_k_dense_replace=3: layers 0-2 are dense MLPs, the rest MoE with noaux_tc routing
    assert [x.moe for x in a.layers[:4]] == [False, False, False, True]
    assert a.moe.scoring == "sigmoid" and a.moe.topk_method == "noaux_tc"
    assert (a.moe.n_group, a.moe.topk_group, a.moe.routed_scaling_factor) == (8, 4, 2.5)


def test_mla_disable_expands():
    cfg = json.loads(resolve_config_path("deepseek-ai/DeepSeek-V3").read_text())
    a = read_arch(cfg, use_mla=False)
    assert a.mechanism is Mechanism.MHA
    assert a.layers[0].kind is LayerKind.FULL and a.layers[0].num_kv_heads == 128


def test_hybrid_layouts():
    nxt = arch("Qwen/Qwen3-Next-80B-A3B-Instruct")
    assert [i for i, s in enumerate(nxt.layers) if s.kind is LayerKind.FULL] == list(range(3, 48, 4))
    assert nxt.layers[3].rope.rotary_dim == 64  # partial_rotary_factor 0.25 of 256
    assert nxt.layers[0].state.recurrent == ((32, 128, 128),)
    assert nxt.layers[0].state.conv == ((2 * 16 * 128 + 32 * 128, 3),)
    jamba = arch("ai21labs/AI21-Jamba-1.5-Mini")
    assert [i for i, s in enumerate(jamba.layers) if s.kind is LayerKind.FULL] == [4, 12, 20, 28]
    assert jamba.layers[4].rope is None  # no positional encoding at all
    assert jamba.layers[0].state.recurrent == ((8192, 16),)
    assert [s.moe for s in jamba.layers[:4]] == [False, True, False, True]
    kimi = arch("moonshotai/Kimi-Linear-48B-A3B-Instruct")  # 1-based layer lists in the checkpoint
    assert [i for i, s in enumerate(kimi.layers) if s.kind is LayerKind.MLA] == [3, 7, 11, 15, 19, 23, 26]
    assert kimi.layers[3].rope is None  # mla_use_nope
    minimax = read_arch({"model_type": "minimax", "hidden_size": 64, "num_hidden_layers": 4,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
                                 "intermediate_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "attn_type_list": [0, 0, 0, 1]})
    assert [s.kind.value for s in minimax.layers] == ["lightning"] * 3 + ["full"]
    assert minimax.mechanism is Mechanism.HYBRID


def test_multimodal_wrapper_reads_text_config():
    a = arch("Qwen/Qwen3.5-27B")
    assert a.hidden_size == 5120 and a.vocab_size == 248320


def test_rope_spellings_agree():
    old = arch("meta-llama/Llama-3.1-8B-Instruct")
    cfg = json.loads(resolve_config_path("meta-llama/Llama-3.1-8B-Instruct").read_text())
    scaling = cfg.pop("rope_scaling")
    cfg["rope_parameters"] = dict(scaling, rope_theta=cfg.pop("rope_theta"))
    new = read_arch(cfg)
    assert old.layers[0].rope == new.layers[0].rope
    r = new.layers[0].rope
    assert (r.rope_type, r.theta, r.factor, r.low_freq_factor, r.high_freq_factor,
            r.original_max_position_embeddings) == ("llama3", 500000.0, 8.0, 1.0, 4.0, 8192)


def _tiny(model_type: str, **kw) -> dict:
    base = {"model_type": model_type, "vocab_size": 100, "num_hidden_layers": 2}
    base.update(kw)
    return base


def test_falcon_bloom_bigcode_kv_heads_and_alibi():
    mq = read_arch(_tiny("falcon", hidden_size=64, num_attention_heads=8, multi_query=True))
    assert mq.mechanism is Mechanism.MQA and mq.layers[0].rope is not None
    gqa = read_arch(_tiny("falcon", hidden_size=64, num_attention_heads=8, new_decoder_architecture=True,
                                  num_kv_heads=2))
    assert gqa.mechanism is Mechanism.GQA and gqa.num_kv_heads == 2
    mha = read_arch(_tiny("falcon", hidden_size=64, num_attention_heads=8, multi_query=False, alibi=True))
    assert mha.mechanism is Mechanism.MHA and mha.layers[0].alibi and mha.layers[0].rope is None
    bloom = read_arch(_tiny("bloom", hidden_size=64, n_head=8, n_layer=2))
    assert bloom.mechanism is Mechanism.MHA and bloom.layers[0].alibi and bloom.tie_word_embeddings
    big = read_arch(_tiny("gpt_bigcode", n_embd=64, n_head=8, n_layer=2))
    assert big.mechanism is Mechanism.MQA
    big_mha = read_arch(_tiny("gpt_bigcode", n_embd=64, n_head=8, n_layer=2, multi_query=False))
    assert big_mha.mechanism is Mechanism.MHA
    mpt = arch("mosaicml/mpt-7b-instruct")
    assert mpt.layers[0].alibi and mpt.layers[0].rope is None


def test_glm4_moe_partial_rotary_and_shared_expert():
    a = read_arch(_tiny("glm4_moe", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                n_shared_experts=1, first_k_dense_replace=1))
    assert a.layers[0].rope.rotary_dim == 16  # partial_rotary_factor 0.5 by default
    assert [s.moe for s in a.layers] == [False, True]
    assert a.moe.num_shared_experts == 1 and a.moe.scoring == "sigmoid"


@pytest.mark.parametrize("cfg, match", [
    ({"vocab_size": 10}, "model_type"),
    (_tiny("not_a_model", hidden_size=8), "not_a_model.*not supported"),
    (_tiny("llama", num_attention_heads=4, vocab_size=10), "llama: missing required field 'hidden_size'"),
    (_tiny("llama", hidden_size=64, num_attention_heads=8, num_key_value_heads=3), "num_key_value_heads"),
    (_tiny("llama", hidden_size=64, num_attention_heads=6), "not divisible by num_attention_heads=6"),
    (_tiny("llama", hidden_size=64, num_attention_heads=4, rope_scaling={"rope_type": "weird", "factor": 2}),
     "unsupported rope type 'weird'"),
    (_tiny("llama", hidden_size=64, num_attention_heads=4, torch_dtype="int8"), "torch_dtype"),
    (_tiny("qwen3_next", hidden_size=64, num_attention_heads=4, layer_types=["full_attention", "moe"],
           linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8),
     "unsupported layer types"),
    (_tiny("llama", hidden_size="big", num_attention_heads=4), "hidden_size.*integer"),
    # zero and absurd sizes (issue #24): refused before a layer is built, the field named
    (_tiny("llama", hidden_size=0, num_attention_heads=4), "'hidden_size' must be in \\[1, "),
    (_tiny("llama", hidden_size=64, num_attention_heads=4, vocab_size=0), "'vocab_size' must be in \\[1, "),
    (_tiny("llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=10**9), "'num_hidden_layers' must"),
    (_tiny("llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=0), "'num_hidden_layers' must"),
])
def test_bad_configs_name_the_field(cfg, match):
    with pytest.raises(ArchError, match=match):
        read_arch(cfg)


def test_family_facts_carry_each_familys_default():
    """norm epsilon, activation and MLP width as each family's model reads them when the config
    leaves them out (transformers' config class of that family)."""
    llama = read_arch(_tiny("llama", hidden_size=64, num_attention_heads=4))
    assert (llama.norm_eps, llama.hidden_act, llama.intermediate_size) == (1e-6, "silu", None)
    star = read_arch(_tiny("starcoder2", hidden_size=64, num_attention_heads=4, intermediate_size=96))
    assert (star.norm_eps, star.hidden_act, star.intermediate_size) == (1e-5, "gelu_pytorch_tanh", 96)
    assert star.options == LlamaOptions(qkv_bias=True, o_bias=True, mlp_bias=True, gated_mlp=False,
                                        layer_norm=True)
    qwen2 = read_arch(_tiny("qwen2", hidden_size=64, num_attention_heads=4, attention_bias=True))
    assert qwen2.options == LlamaOptions(qkv_bias=True, o_bias=False)
    oss = arch("openai/gpt-oss-20b", rms_norm_eps=None, swiglu_limit=None)
    assert oss.norm_eps == 1e-5 and oss.options == GptOssOptions(True, 7.0, 1.702)
    gemma = read_arch(_tiny("gemma", hidden_size=64, num_attention_heads=4, hidden_act="gelu"))
    assert (gemma.hidden_act, gemma.final_softcap, gemma.tie_word_embeddings) == ("gelu_pytorch_tanh", None, True)
    gemma2 = arch("google/gemma-2-9b")
    assert gemma2.final_softcap == 30.0 and arch("google/gemma-2-9b", final_logit_softcapping=None).final_softcap is None
    falcon = read_arch(_tiny("falcon", hidden_size=64, num_attention_heads=8))
    assert (falcon.norm_eps, falcon.hidden_act, falcon.intermediate_size) == (1e-5, "gelu", 256)
    gpt2, big = arch("openai-community/gpt2"), read_arch(_tiny("gpt_bigcode", n_embd=64, n_head=8, n_layer=2))
    assert (gpt2.hidden_act, big.hidden_act, big.intermediate_size) == ("gelu_new", "gelu_pytorch_tanh", 256)
    mpt = arch("mosaicml/mpt-7b-instruct", logit_scale="inv_sqrt_d_model")
    assert (mpt.hidden_act, mpt.intermediate_size, mpt.logit_scale) == ("gelu", 4 * 4096, 4096 ** -0.5)


def test_state_mixer_constants_and_hybrid_defaults():
    jamba = arch("ai21labs/AI21-Jamba-1.5-Mini")
    assert jamba.layers[0].mixer == MambaDims(dt_rank=256, conv_bias=True, proj_bias=False, norm_eps=1e-6)
    qn = arch("Qwen/Qwen3-Next-80B-A3B-Instruct")
    assert qn.layers[0].mixer == GDNDims(num_k_heads=16, conv_kernel=4, norm_eps=1e-6)
    kimi = arch("moonshotai/Kimi-Linear-48B-A3B-Instruct", rms_norm_eps=None)
    assert kimi.norm_eps == 1e-5 and kimi.layers[0].mixer == KDADims(norm_eps=1e-6)
    assert all(s.rope is None for s in kimi.layers if s.kind is LayerKind.MLA)  # mla_use_nope
    minimax = read_arch(_tiny("minimax", hidden_size=64, num_attention_heads=4, num_local_experts=2,
                              num_experts_per_tok=1, intermediate_size=32, linear_attn_beta_factor=0.5))
    assert minimax.norm_eps == 1e-5 and minimax.layers[1].mixer == LightningDims(block_size=256)
    assert minimax.options.lightning == DeepNorm(beta_attn=0.5) and minimax.options.full == DeepNorm()


def test_unbuildable_configs_still_read():
    """What the model cannot run is said on the arch (``inspect`` still reads the config); the
    model refuses it when built."""
    a = read_arch(_tiny("gemma3_text", hidden_size=64, num_attention_heads=4, use_bidirectional_attention=True))
    assert "use_bidirectional_attention" in a.unsupported
    assert read_arch(_tiny("gpt2", n_embd=64, n_head=8, n_layer=2, add_cross_attention=True)).unsupported
    assert arch("mosaicml/mpt-7b-instruct").unsupported is None


def test_the_raw_config_stays_in_arch():
    a = arch("deepseek-ai/DeepSeek-V3")
    assert "hf_config" not in {f.name for f in dataclasses.fields(ModelArch)}
    assert a.quantization_config["quant_method"] == "fp8"
    assert arch("meta-llama/Llama-3.1-8B-Instruct").quantization_config is None


def test_one_table_of_families():
    from attnserve.models.registry import get_model_class, supported_model_types

    assert "qwen2_moe" in FAMILIES and "qwen2_moe" not in supported_model_types()
    assert sorted(t for t, f in FAMILIES.items() if f.tied_by_default) == [
        "bloom", "falcon", "gemma", "gemma2", "gemma3_text", "gpt2", "gpt_bigcode", "mpt"]
    planned = sorted(t for t, f in FAMILIES.items() if f.shard_plan is not None)
    assert planned == ["deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "kimi_k2", "llama", "mistral",
                       "phi3", "qwen2", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next", "starcoder2"]
    for name in EXPECTED:
        a = arch(name)
        assert get_model_class(a).__name__ == FAMILIES[a.model_type].model.partition(":")[2]


def test_layers_past_the_config_are_skipped_only_where_checkpoints_carry_mtp():
    """A tensor of a layer the config does not have is DeepSeek's MTP layer (skipped) but, for
    Llama, a config that does not fit its checkpoint: an error that names the tensor."""
    from attnserve.models.registry import get_model_class

    llama = read_arch(dict(model_type="llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, vocab_size=32))
    model = get_model_class(llama)(llama)
    assert model.rename("model.layers.0.mlp.down_proj.weight") == "layers.0.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight.*1 layers"):
        model.rename("model.layers.1.mlp.down_proj.weight")
    v3 = read_arch(dict(model_type="deepseek_v3", hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                        num_hidden_layers=1, num_attention_heads=2, vocab_size=32, kv_lora_rank=16,
                        q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1))
    assert get_model_class(v3)(v3).rename("model.layers.1.mlp.down_proj.weight") is None


@pytest.mark.parametrize("rope, expected", [
    (None, 4096),
    ({"rope_type": "linear", "factor": 4.0}, 16384),
    ({"rope_type": "dynamic", "factor": 2.0}, 8192),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, 4096),
    ({"rope_type": "yarn", "factor": 4.0}, 16384),  # no original: max_position_embeddings
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 512}, 4096),  # already the extended length
])
def test_default_max_model_len_applies_the_rope_factor(rope, expected):
    """vLLM's default max_model_len: max_position_embeddings times the factor of linear, dynamic
    and YaRN scaling (YaRN: times original_max_position_embeddings); llama3, longrope and
    Gemma 3 state the extended length themselves (issue #23)."""
    kw = {"rope_scaling": rope} if rope else {}
    a = read_arch(_tiny("llama", hidden_size=64, num_attention_heads=4, max_position_embeddings=4096, **kw))
    assert a.derived_max_model_len == expected


def test_default_max_model_len_of_shipped_configs():
    assert arch("deepseek-ai/DeepSeek-V3").derived_max_model_len == 4096 * 40 == 163_840  # YaRN
    gemma3 = arch("google/gemma-3-1b-it", rope_scaling={"rope_type": "linear", "factor": 8.0})  # as the 4B
    assert next(s.rope.factor for s in gemma3.layers if s.window is None) == 8.0
    assert gemma3.derived_max_model_len == 32_768
    assert arch("microsoft/Phi-3-mini-4k-instruct").derived_max_model_len == 4096
