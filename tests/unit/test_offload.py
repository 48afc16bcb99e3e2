"""KV cache offloading: tiers, bit-exact round trips for standard, MLA, DSA and hybrid models
(whose state snapshots travel with the blocks), churn
without leaks, and bad states (corrupt or missing disk files, a full tier) that degrade to
recomputation."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from attnserve import LLM, SamplingParams
from attnserve.kvcache.offload import DiskTier, HostTier
from tests.models.parity import VOCAB, build_hf_model, make_prompts, run_engine

LLAMA = ("llama", dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
MLA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, max_position_embeddings=256, n_routed_experts=4, num_experts_per_tok=2,
           n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, n_group=2, topk_group=1)
QWEN3_NEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  layer_types=["linear_attention"] * 3 + ["full_attention"])
MODELS = {
    "llama": LLAMA,
    "qwen3_next": ("qwen3_next", QWEN3_NEXT),
    "deepseek_v3": ("deepseek_v3", MLA),
    "deepseek_v32": ("deepseek_v32", dict(MLA, index_topk=6, index_n_heads=16, index_head_dim=16)),
}


def test_host_tier_lru():
    tier = HostTier(capacity=2, blob_bytes=8)
    for k in range(3):
        tier.put(("h", k), torch.full((8,), k, dtype=torch.uint8))
    assert ("h", 0) not in tier and tier.evictions == 1
    assert torch.equal(tier.get(("h", 2)), torch.full((8,), 2, dtype=torch.uint8))


def test_disk_tier_roundtrip_and_corruption(tmp_path, caplog):
    tier = DiskTier(capacity=4, blob_bytes=16, directory=tmp_path)
    data = torch.arange(16, dtype=torch.uint8)
    tier.put(("a", 0), data)
    tier.put(("b", 0), data + 1)
    assert torch.equal(tier.get(("a", 0)), data)
    files = sorted(tmp_path.iterdir())
    raw = bytearray(files[0].read_bytes())
    raw[-1] ^= 0xFF  # flip bits in the payload
    files[0].write_bytes(bytes(raw))
    files[1].unlink()
    with caplog.at_level(logging.WARNING):
        assert tier.get(("a", 0)) is None and tier.get(("b", 0)) is None
    assert "corrupt" in caplog.text and tier.failures == 2 and len(tier) == 0


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request, tmp_path_factory):
    model_type, kwargs = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    build_hf_model(model_type, kwargs, path)
    return request.param, path


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)


def outputs(outs):
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs])
            for o in outs]


def evict_device_cache(llm, n: int = 6):
    """Fill the small device cache with unrelated prompts, so earlier blocks are evicted."""
    run_engine(llm, make_prompts([40] * n, seed=99), greedy())


def test_tier_hit_is_bit_exact_and_matches_a_device_hit(model_dir, tmp_path):
    name, path = model_dir
    prefix = make_prompts([36], seed=5)[0]
    later = [prefix + [7, 8, 9]]
    kw = dict(dtype="float32", block_size=4, max_model_len=64, num_gpu_blocks_override=40)
    # reference 1: the prefix served from the device prefix cache
    device = LLM(str(path), **kw)
    run_engine(device, [prefix], greedy())
    ref_device = run_engine(device, later, greedy())
    assert ref_device[0].num_cached_tokens == 36
    # the same after the prefix was evicted from the device and restored from each tier
    for backend in ("host", "disk"):
        llm = LLM(str(path), **kw, kv_offloading_size=0.01, kv_offloading_backend=backend,
                  kv_offloading_dir=str(tmp_path / name))
        run_engine(llm, [prefix], greedy())
        evict_device_cache(llm)
        stats = llm.llm_engine.scheduler.stats
        before = stats.offload_hit_tokens
        out = run_engine(llm, later, greedy())
        assert stats.offload_hit_tokens - before == 36, f"{backend}: the prefix did not come from the tier"
        assert outputs(out) == outputs(ref_device), f"{backend}: a tier hit differs from a device hit"
        offload = llm.llm_engine.runner.offload
        assert offload.stats.bytes_loaded > 0 and offload.stats.bytes_stored > 0
    # and, within float32 rounding, the same as computing everything from scratch
    scratch = run_engine(LLM(str(path), **kw, enable_prefix_caching=False), later, greedy())
    assert scratch[0].outputs[0].token_ids == ref_device[0].outputs[0].token_ids


def test_churn_with_aborts_stays_consistent(tmp_path):
    path = tmp_path / "llama"
    build_hf_model(*LLAMA, path)
    rng = random.Random(0)
    bases = make_prompts([16, 20, 24], seed=3)
    prompts = [rng.choice(bases) + make_prompts([rng.randrange(1, 8)], seed=i)[0] for i in range(24)]
    kw = dict(dtype="float32", block_size=4, max_model_len=64)
    reference = {i: o for i, o in enumerate(run_engine(LLM(str(path), **kw), prompts, greedy()))}
    llm = LLM(str(path), **kw, num_gpu_blocks_override=24, kv_offloading_size=0.002,
              kv_offloading_backend="disk", kv_offloading_dir=str(tmp_path / "tier"))
    engine = llm.llm_engine
    ids = {engine.add_request(f"r{i}", {"prompt_token_ids": p}, greedy()): i for i, p in enumerate(prompts)}
    aborted, done = set(), {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out
        engine.kv_manager.check_integrity()
        if rng.random() < 0.1 and engine.states:
            rid = rng.choice(sorted(engine.states))
            engine.abort_request(rid)
            aborted.add(ids[rid])
    pool = engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
    assert engine.scheduler.stats.offload_hit_tokens > 0
    for i, out in done.items():
        assert out.outputs[0].token_ids == reference[i].outputs[0].token_ids, f"request {i} changed"
    assert set(done) | aborted == set(range(len(prompts)))


def test_corrupt_and_missing_files_fall_back_to_recompute(tmp_path, caplog):
    path = tmp_path / "llama"
    build_hf_model(*LLAMA, path)
    prefix = make_prompts([32], seed=5)[0]
    kw = dict(dtype="float32", block_size=4, max_model_len=64, num_gpu_blocks_override=40)
    reference = run_engine(LLM(str(path), **kw), [prefix + [3]], greedy())
    tier_dir = tmp_path / "tier"
    llm = LLM(str(path), **kw, kv_offloading_size=0.01, kv_offloading_backend="disk", kv_offloading_dir=str(tier_dir))
    run_engine(llm, [prefix], greedy())
    evict_device_cache(llm)
    files = sorted(tier_dir.iterdir())
    assert files
    for f in files[::2]:  # corrupt some blocks, delete others
        f.write_bytes(b"garbage")
    for f in files[1::2]:
        f.unlink()
    with caplog.at_level(logging.WARNING):
        out = run_engine(llm, [prefix + [3]], greedy())
    assert "recomput" in caplog.text and llm.llm_engine.runner.offload.tier.failures > 0
    assert outputs(out) == outputs(reference)  # recomputed from scratch, as the reference was


def test_offloading_needs_prefix_caching_and_a_dir(tmp_path):
    path = tmp_path / "llama"
    build_hf_model(*LLAMA, path)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(str(path), kv_offloading_size=0.01, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offloading_dir"):
        LLM(str(path), kv_offloading_size=0.01, kv_offloading_backend="disk")
