"""KV cache specs: published per-token figures, written out by hand, against the code."""

from __future__ import annotations

import json

import pytest

from attnserve.arch import ModelArch, read_arch
from attnserve.config import CacheConfig
from attnserve.kvcache.groups import cache_entries, group_entries, sequence_bytes
from attnserve.kvcache.spec import (
    FullAttentionSpec,
    IndexerCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    StateSpec,
    resolve_cache_dtype,
)
from attnserve.presets import resolve_config_path


def arch(name: str, **overrides) -> ModelArch:
    cfg = json.loads(resolve_config_path(name).read_text())
    cfg.update(overrides)
    return read_arch(cfg)


def per_token(a: ModelArch, kv_cache_dtype: str = "auto", **kw) -> int:
    groups = group_entries(cache_entries(a, CacheConfig(kv_cache_dtype=kv_cache_dtype, **kw)))
    return sum(g.bytes_per_token for g in groups)


def test_llama31_8b_published_figure():
    a = arch("meta-llama/Llama-3.1-8B-Instruct")
    assert per_token(a) == 131_072  # 32 layers * 2 (K,V) * 8 heads * 128 * 2 B
    mha = arch("meta-llama/Llama-3.1-8B-Instruct", num_key_value_heads=32)
    assert per_token(mha) == 524_288  # 4x: 32 KV heads
    assert per_token(a, "fp8") == 65_536
    assert per_token(a, "float32") == 262_144


def test_deepseek_v3_mla_bytes():
    a = arch("deepseek-ai/DeepSeek-V3")
    entries = cache_entries(a, CacheConfig())
    assert entries[0].spec.bytes_per_token == 1152  # (512 + 64) * 2
    assert per_token(a) == 1152 * 61
    fp8 = cache_entries(a, CacheConfig(kv_cache_dtype="fp8"))
    assert fp8[0].spec.bytes_per_token == 656  # 512 e4m3 + 4 fp32 scales + 64 bf16 rope
    assert per_token(a, "fp8") == 656 * 61


def test_deepseek_v32_indexer_adds_132_bytes():
    a = arch("deepseek-ai/DeepSeek-V3.2")
    fp8 = cache_entries(a, CacheConfig(kv_cache_dtype="fp8"))
    assert [(e.name, e.spec.bytes_per_token) for e in fp8[:2]] == [("latent", 656), ("indexer", 132)]
    assert per_token(a, "fp8") == 788 * 61 == 48_068
    assert per_token(a) == (1152 + 256) * 61  # bf16 latent + bf16 indexer key
    assert per_token(a, "auto", indexer_cache_dtype="fp8") == (1152 + 132) * 61
    # one group: latent rows and indexer keys share the block table
    assert len(group_entries(fp8)) == 1


def test_glm5_shared_layers_keep_no_indexer_cache():
    a = arch("zai-org/GLM-5", indexer_types=["full", "shared", "shared"] * 26)
    assert per_token(a, "fp8") == 656 * 78 + 132 * 26


def test_mla_disabled_costs_expanded_kv():
    cfg = json.loads(resolve_config_path("deepseek-ai/DeepSeek-V3").read_text())
    a = read_arch(cfg, use_mla=False)
    assert cache_entries(a, CacheConfig())[0].spec.bytes_per_token == 81_920  # 128 * (192 + 128) * 2


def test_state_bytes_qwen3_next_and_jamba():
    nxt = arch("Qwen/Qwen3-Next-80B-A3B-Instruct")
    groups = group_entries(cache_entries(nxt, CacheConfig()))
    state = [g for g in groups if g.policy == "state"][0]
    # recurrent 32*128*128 fp32 + conv 3 * 8192 bf16, over 36 GDN layers
    assert state.bytes_per_sequence_state == 36 * (32 * 128 * 128 * 4 + 3 * 8192 * 2) == 77_266_944
    full = [g for g in groups if g.policy == "full"][0]
    assert full.bytes_per_token == 12 * 2 * 2 * 256 * 2  # 24 KiB per token
    jamba = arch("ai21labs/AI21-Jamba-1.5-Mini")
    jg = group_entries(cache_entries(jamba, CacheConfig(mamba_ssm_cache_dtype="bfloat16")))
    assert [g for g in jg if g.policy == "state"][0].bytes_per_sequence_state == 28 * (8192 * 3 * 2 + 8192 * 16 * 2)


def test_sliding_window_caps_sequence_bytes():
    a = arch("mistralai/Mistral-7B-v0.1")
    groups = group_entries(cache_entries(a, CacheConfig(block_size=16)))
    assert len(groups) == 1 and groups[0].policy == "sliding"
    per_block = 16 * 32 * 2 * 8 * 128 * 2
    # window 4096 = 256 blocks, plus the one a sequence may straddle
    assert sequence_bytes(groups, 100_000) == 257 * per_block
    assert sequence_bytes(groups, 160) == 10 * per_block
    oss = arch("openai/gpt-oss-20b")
    og = group_entries(cache_entries(oss, CacheConfig(block_size=16)))
    assert sorted(g.policy for g in og) == ["full", "sliding"]


def test_spec_classes_directly():
    assert FullAttentionSpec(block_size=16, dtype="bfloat16", num_kv_heads=8, head_size=128,
                             head_size_v=128).page_size_bytes == 16 * 4096
    assert SlidingWindowSpec(block_size=16, dtype="float16", num_kv_heads=1, head_size=64, head_size_v=64,
                             sliding_window=33).max_blocks_per_sequence() == 3
    assert MLAAttentionSpec(block_size=64, dtype="fp8").page_size_bytes == 64 * 656
    assert IndexerCacheSpec(block_size=64, dtype="fp8", head_dim=128).bytes_per_token == 132
    s = StateSpec(block_size=16, dtype="bfloat16", conv_shapes=((10, 3),), recurrent_shapes=((2, 4, 4),))
    assert s.bytes_per_token == 0 and s.bytes_per_sequence == 10 * 3 * 2 + 2 * 4 * 4 * 4
    with pytest.raises(ValueError, match="block_size"):
        FullAttentionSpec(block_size=0, dtype="bfloat16")


def test_resolve_cache_dtype():
    assert resolve_cache_dtype("auto", "bfloat16") == "bfloat16"
    assert resolve_cache_dtype("fp8_e4m3", "float32") == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4'"):
        resolve_cache_dtype("int4", "bfloat16")


def test_layout_shares_slots_between_sliding_and_full_groups():
    from attnserve.kvcache.groups import plan_layout

    oss = arch("openai/gpt-oss-20b")  # 12 sliding (window 128) + 12 full layers
    layout = plan_layout(cache_entries(oss, CacheConfig(block_size=16)))
    assert sorted(g.policy for g in layout.groups) == ["full", "sliding"]
    page = 16 * 2 * 8 * 64 * 2  # one layer's block: K and V, 8 heads of 64, bf16
    assert len(layout.slots) == 12 and layout.bytes_per_block == 12 * page
    n = 131_072
    full_blocks = n // 16
    window_blocks = 8 + 1  # ceil(127 / 16) + 1 block the window may straddle
    assert layout.sequence_bytes(n) == (full_blocks + window_blocks) * 12 * page
    g3 = arch("google/gemma-3-1b-it")  # 4 full + 22 sliding layers: chunks of 4 layers
    layout3 = plan_layout(cache_entries(g3, CacheConfig(block_size=16)))
    assert [len(g.entries) for g in layout3.groups] == [4, 4, 4, 4, 4, 2, 4] or \
        sorted(len(g.entries) for g in layout3.groups) == [2, 4, 4, 4, 4, 4, 4]
    assert layout3.bytes_per_block == 4 * 16 * 2 * 1 * 256 * 2
    mistral = plan_layout(cache_entries(arch("mistralai/Mistral-7B-v0.1"), CacheConfig()))
    assert len(mistral.slots) == 32 and len(mistral.groups) == 1  # one group: each layer its own slot
