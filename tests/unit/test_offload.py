"""KV cache offloading: tiers, bit-exact round trips for standard, MLA, DSA, hybrid models
(whose state snapshots travel with the blocks) and sliding-window models (only the window's
blocks come back), churn without leaks, blobs held while a load copies them, and bad states
(corrupt or missing disk files, a full tier) that degrade to recomputation."""

from __future__ import annotations

import logging
import os
import random

import pytest
import torch

from attnserve import LLM, SamplingParams
from attnserve.kvcache.groups import CacheEntry, KVCacheGroup
from attnserve.kvcache.offload import DiskTier, HostTier, OffloadManager
from attnserve.kvcache.spec import FullAttentionSpec
from attnserve.runner.offload_io import OffloadIO
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
# layers alternate sliding (window 8 = two blocks of 4) and full attention
GEMMA2 = ("gemma2", dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         sliding_window=8))
MODELS = {
    "llama": LLAMA,
    "gemma2": GEMMA2,
    "mistral_window": ("mistral", dict(LLAMA[1], sliding_window=8)),  # every layer sliding
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
    a, b = tier._path(("a", 0)), tier._path(("b", 0))
    assert sorted(tmp_path.rglob("*.kvb")) == sorted([a, b])  # named by content, in fan-out directories
    raw = bytearray(a.read_bytes())
    raw[-1] ^= 0xFF  # flip bits in the payload
    a.write_bytes(bytes(raw))
    b.unlink()
    with caplog.at_level(logging.WARNING):
        assert tier.get(("a", 0)) is None and tier.get(("b", 0)) is None
    assert "corrupt" in caplog.text and tier.failures == 2 and len(tier) == 0
    assert not a.exists(), "a corrupt file of ours is removed"
    assert ("a", 0) not in tier and tier.get(("a", 0)) is None and tier.failures == 2  # a plain miss now


def test_disk_tier_files_belong_to_their_key_and_engine(tmp_path, caplog):
    """Issue #24: two engines on one directory wrote each other's slots and served each other's
    KV; two swapped files passed the checksum. Files are named by the model's identity and the
    key now, which the checksummed header repeats: a file moved onto another's name reads as a
    miss, and is not deleted."""
    data = torch.arange(16, dtype=torch.uint8)
    mine = DiskTier(capacity=2, blob_bytes=16, directory=tmp_path, namespace="model A")
    theirs = DiskTier(capacity=2, blob_bytes=16, directory=tmp_path, namespace="model B")
    mine.put(("p", 0), data)
    theirs.put(("p", 0), data + 7)  # same prompt key, another model: another file
    assert mine._path(("p", 0)) != theirs._path(("p", 0)) and len(list(tmp_path.rglob("*.kvb"))) == 2
    assert torch.equal(mine.get(("p", 0)), data) and torch.equal(theirs.get(("p", 0)), data + 7)
    foreign = theirs._path(("p", 0)).read_bytes()
    mine._path(("p", 0)).write_bytes(foreign)  # model B's bytes under model A's name
    with caplog.at_level(logging.WARNING):
        assert mine.get(("p", 0)) is None
    assert "another block" in caplog.text and mine.failures == 1
    assert mine._path(("p", 0)).read_bytes() == foreign, "a file that is not ours is not deleted"
    assert ("p", 0) not in mine  # and not looked at again until this tier writes the block
    mine.put(("p", 0), data)
    assert torch.equal(mine.get(("p", 0)), data)
    swapped = DiskTier(capacity=2, blob_bytes=16, directory=tmp_path / "s", namespace="A")
    swapped.put(("x", 0), data)
    swapped.put(("y", 0), data + 1)
    a, b = swapped._path(("x", 0)), swapped._path(("y", 0))
    raw_a, raw_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(raw_b)
    b.write_bytes(raw_a)
    assert swapped.get(("x", 0)) is None and swapped.get(("y", 0)) is None and swapped.failures == 2


def test_disk_tier_follows_no_link_and_counts_failed_writes(tmp_path, monkeypatch):
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    tier = DiskTier(capacity=1, blob_bytes=16, directory=tmp_path / "tier")
    path = tier._path(("k", 0))
    path.parent.mkdir()
    path.symlink_to(target)  # planted where the block's file goes
    assert ("k", 0) not in tier
    tier.put(("k", 0), torch.ones(16, dtype=torch.uint8))
    assert target.read_bytes() == b"keep me" and not path.is_symlink()
    assert torch.equal(tier.get(("k", 0)), torch.ones(16, dtype=torch.uint8))
    path.unlink()
    path.symlink_to(target)  # a link planted after the write is not read through, nor deleted
    assert tier.get(("k", 0)) is None and path.is_symlink() and target.read_bytes() == b"keep me"
    # a fan-out directory that is a link is not entered
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    linked = tier._path(("l", 0))
    linked.parent.symlink_to(elsewhere)
    tier.put(("l", 0), torch.ones(16, dtype=torch.uint8))
    assert ("l", 0) not in tier and not list(elsewhere.iterdir()) and tier.failures == 2
    # a full disk: the write fails, is counted, and the block is not stored
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, flags, *a, **kw: (_ for _ in ()).throw(OSError(28, "No space left"))
                        if str(path).endswith(".tmp") else real_open(path, flags, *a, **kw))
    buf = tier.reserve(("full", 0), 16)
    buf.fill_(3)
    assert tier.commit(("full", 0)) is False and ("full", 0) not in tier and tier.failures == 3
    assert not list((tmp_path / "tier").rglob("*.tmp"))


def test_disk_tier_shares_blocks_and_keeps_them_across_restarts(tmp_path):
    """Engines of one model on one directory find each other's blocks; a new tier on the
    directory counts this model's files against its capacity and evicts them first; another
    model's files are neither counted nor deleted."""
    blob = lambda k: torch.full((16,), k, dtype=torch.uint8)  # noqa: E731
    first = DiskTier(capacity=3, blob_bytes=16, directory=tmp_path, namespace="A")
    for k in range(3):
        first.put(("b", k), blob(k))
        os.utime(first._path(("b", k)), ns=(k * 10**9, k * 10**9))  # written in this order
    other = DiskTier(capacity=2, blob_bytes=16, directory=tmp_path, namespace="B")
    other.put(("b", 0), blob(9))
    second = DiskTier(capacity=3, blob_bytes=16, directory=tmp_path, namespace="A")  # a restart, or a peer
    assert len(second._unclaimed) == 3 and len(second) == 0 and not second._free
    assert ("b", 1) in second and ("b", 5) not in second
    assert torch.equal(second.get(("b", 1)), blob(1)) and second.adopted == 1 and len(second) == 1
    second.put(("new", 0), blob(7))  # full: an unclaimed file goes, oldest first
    assert not first._path(("b", 0)).exists() and first._path(("b", 2)).exists() and second.evictions == 1
    assert other._path(("b", 0)).exists(), "another model's file is not ours to evict"
    second.put(("new", 1), blob(8))  # then the least recently used
    assert not first._path(("b", 2)).exists() and first._path(("b", 1)).exists()
    assert torch.equal(first.get(("new", 1)), blob(8)) and first.adopted == 1  # and back the other way
    small = DiskTier(capacity=1, blob_bytes=16, directory=tmp_path, namespace="A")  # a smaller budget
    assert len(small._unclaimed) == 1 and len(list(tmp_path.rglob("*.kvb"))) == 2  # B's and one of A's


def test_disk_tier_directory_that_is_a_file_is_a_clear_error(tmp_path):
    path = tmp_path / "not_a_dir"
    path.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        DiskTier(capacity=1, blob_bytes=16, directory=path)


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
        assert out[0].num_cached_tokens == 36, f"{backend}: tier hits count as cached tokens (as in vLLM)"
        assert outputs(out) == outputs(ref_device), f"{backend}: a tier hit differs from a device hit"
        offload = llm.llm_engine.runner.offload
        assert offload.stats.bytes_loaded > 0 and offload.stats.bytes_stored > 0
    # and, within float32 rounding, the same as computing everything from scratch
    scratch = run_engine(LLM(str(path), **kw, enable_prefix_caching=False), later, greedy())
    assert scratch[0].outputs[0].token_ids == ref_device[0].outputs[0].token_ids


@pytest.mark.parametrize("name,backend", [("llama", "disk"), ("gemma2", "host"), ("gemma2", "disk")])
def test_churn_with_aborts_stays_consistent(tmp_path, name, backend):
    path = tmp_path / name
    build_hf_model(*MODELS[name], path)
    rng = random.Random(0)
    bases = make_prompts([16, 20, 24], seed=3)
    prompts = [rng.choice(bases) + make_prompts([rng.randrange(1, 8)], seed=i)[0] for i in range(24)]
    kw = dict(dtype="float32", block_size=4, max_model_len=64)
    reference = {i: o for i, o in enumerate(run_engine(LLM(str(path), **kw), prompts, greedy()))}
    # a tier of ~50-100 blocks: it evicts too
    llm = LLM(str(path), **kw, num_gpu_blocks_override=24, kv_offloading_size=1e-4,
              kv_offloading_backend=backend, kv_offloading_dir=str(tmp_path / "tier"))
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
    tier = engine.runner.offload.tier
    assert tier.evictions > 0 and not tier.held and not tier.reserved, "the tier leaked holds or reservations"
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
    files = sorted(tier_dir.rglob("*.kvb"))
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


# --- sliding windows ---------------------------------------------------------------------------


def sliding_group(llm) -> int:
    (g,) = [g for g, c in enumerate(llm.llm_engine.runner.offload.window_blocks) if c is not None]
    return g


def test_sliding_window_hit_loads_only_the_window_and_matches_recompute(tmp_path):
    path = tmp_path / "gemma2"
    build_hf_model(*GEMMA2, path)
    prefix = make_prompts([36], seed=5)[0]
    later = [prefix + [7, 8, 9]]
    kw = dict(dtype="float32", block_size=4, max_model_len=64, num_gpu_blocks_override=40)
    device = LLM(str(path), **kw)
    run_engine(device, [prefix], greedy())
    ref_device = run_engine(device, later, greedy())
    assert ref_device[0].num_cached_tokens == 36
    # recomputation in the same chunks (the 36 prefix tokens, then the rest) is bit for bit the same
    recompute = run_engine(LLM(str(path), **kw, enable_prefix_caching=False, max_num_batched_tokens=36),
                           later, greedy())
    assert outputs(recompute) == outputs(ref_device)
    for backend in ("host", "disk"):
        llm = LLM(str(path), **kw, kv_offloading_size=0.01, kv_offloading_backend=backend,
                  kv_offloading_dir=str(tmp_path / backend))
        run_engine(llm, [prefix], greedy())
        evict_device_cache(llm)
        offload, io = llm.llm_engine.runner.offload, llm.llm_engine.runner.offload_io
        sliding = sliding_group(llm)
        assert offload.window_blocks[sliding] == 2  # window 8, blocks of 4: the next token reaches 7 back
        before = offload.stats.bytes_loaded
        out = run_engine(llm, later, greedy())
        assert llm.llm_engine.scheduler.stats.offload_hit_tokens == 36, f"{backend}: not a tier hit"
        # nine blocks of the full group, only the last two of the sliding one
        expected = 9 * io.block_bytes(1 - sliding) + 2 * io.block_bytes(sliding)
        assert offload.stats.bytes_loaded - before == expected, f"{backend}: loaded more than the window"
        assert outputs(out) == outputs(recompute), f"{backend}: a tier hit differs from recomputation"
        assert not offload.tier.held and not offload.tier.reserved


def test_loading_less_than_the_window_changes_the_answer(tmp_path):
    """The check above can fail: load one block fewer than the window needs and the output moves."""
    path = tmp_path / "gemma2"
    build_hf_model(*GEMMA2, path)
    prefix = make_prompts([36], seed=5)[0]
    kw = dict(dtype="float32", block_size=4, max_model_len=64, num_gpu_blocks_override=40)
    ref = run_engine(LLM(str(path), **kw, enable_prefix_caching=False, max_num_batched_tokens=36),
                     [prefix + [7, 8, 9]], greedy())
    llm = LLM(str(path), **kw, kv_offloading_size=0.01)
    run_engine(llm, [prefix], greedy())
    evict_device_cache(llm)
    llm.llm_engine.runner.offload.window_blocks[sliding_group(llm)] = 1
    out = run_engine(llm, [prefix + [7, 8, 9]], greedy())
    assert llm.llm_engine.scheduler.stats.offload_hit_tokens == 36
    assert outputs(out) != outputs(ref)


def test_lookup_needs_only_the_blocks_a_window_reaches():
    hashes = [f"h{i}" for i in range(10)]

    def manager(full: list[int], sliding: list[int]) -> OffloadManager:
        tier = HostTier(capacity=32, blob_bytes=1)
        for k in full:
            tier.put((hashes[k], 0), torch.tensor([k], dtype=torch.uint8))
        for k in sliding:
            tier.put((hashes[k], 1), torch.tensor([100 + k], dtype=torch.uint8))
        return OffloadManager(tier, 2, block_size=4, has_state=False, windows=[None, 8])  # 2 blocks

    everything = list(range(10))
    hit = manager(everything, [0, 1, 2, 3, 5, 8, 9]).lookup(hashes, 0, 10)
    assert hit.num_blocks == 10 and hit.num_null_blocks(0) == 0 and hit.num_null_blocks(1) == 8
    assert [b[1] for b in hit.blobs[8:]] == [torch.tensor([108]), torch.tensor([109])]
    assert manager(everything, [0, 1, 2, 3, 5, 7, 8]).lookup(hashes, 0, 10).num_blocks == 9
    assert manager(everything, [0, 1, 2, 3, 5, 7]).lookup(hashes, 0, 10).num_blocks == 4  # 4 is missing
    assert manager(everything[:6], everything).lookup(hashes, 0, 10).num_blocks == 6  # full: every block
    assert manager(everything, [0, 2]).lookup(hashes, 0, 10).num_blocks == 1  # short: from the first block
    assert manager(everything, [5]).lookup(hashes, 5, 1).num_blocks == 1  # block 4 is a device hit


def test_a_blob_being_loaded_is_not_evicted_by_a_store():
    """Two-phase safety: blobs a load copies are held; a store in the same step that needs room
    must not evict (and overwrite) them, even with no other slot free."""
    spec = FullAttentionSpec(block_size=4, dtype="float32", num_kv_heads=1, head_size=2, head_size_v=2)
    group = KVCacheGroup(0, "full", None, (CacheEntry(0, "kv", spec),))
    k, v = torch.randn(8, 4, 1, 2), torch.randn(8, 4, 1, 2)
    io = OffloadIO([group], {(0, "kv"): (k, v)}, [])
    tier = HostTier(capacity=3, blob_bytes=io.block_bytes(0))
    manager = OffloadManager(tier, 1, block_size=4, has_state=False)
    manager.prepare_store("a", ["a0", "a1"], [[1, 2]], num_computed_tokens=8)
    io.run(manager, *manager.take_jobs())
    hit = manager.lookup(["a0", "a1"], 0, 2)
    assert hit.num_blocks == 2
    manager.prepare_store("b", ["b0", "b1"], [[3, 4]], num_computed_tokens=8)  # needs two slots, one is free
    manager.prepare_load("c", hit, [[5, 6]], 0, 0)
    io.run(manager, *manager.take_jobs())
    assert torch.equal(k[5:7], k[1:3]) and torch.equal(v[5:7], v[1:3])
    assert ("a0", 0) in tier and ("a1", 0) in tier and ("b0", 0) in tier and ("b1", 0) not in tier
    assert not tier.held and not tier.reserved
    assert manager.stats.bytes_loaded == 2 * io.block_bytes(0) == 2 * 2 * 4 * 2 * 4


# --- copies on a side stream (CUDA) --------------------------------------------------------------


def test_written_blocks_and_the_fence_rule():
    """The forward waits for copies in flight only when it reads a load, or writes what a store
    (of blocks, or of state snapshots) still reads."""
    from types import SimpleNamespace

    from attnserve.kvcache.offload.manager import LoadJob
    from attnserve.runner.offload_io import Transfer, fence_for, written_blocks

    scheduled = [SimpleNamespace(start=5, num_new_tokens=6, block_ids=[[11, 12, 13, 14], [21, 22, 23, 24]]),
                 SimpleNamespace(start=8, num_new_tokens=1, block_ids=[[31, 32, 33], [41, 42, 43]])]
    assert written_blocks(scheduled, 4) == {(0, 12), (0, 13), (1, 22), (1, 23), (0, 33), (1, 43)}
    first, second = Transfer(reads={(0, 5)}), Transfer(reads={(0, 7)})
    inflight = [first, second]  # oldest first
    assert fence_for(inflight, {(0, 5), (1, 7)}) is first and fence_for(inflight, {(0, 7)}) is second
    assert fence_for(inflight, {(0, 9)}) is None and fence_for(inflight, set()) is None
    inflight.append(Transfer(reads_state=True))
    assert fence_for(inflight, set()) is inflight[-1]
    inflight.append(Transfer(loads=[LoadJob("r")]))
    assert fence_for(inflight, set()) is inflight[-1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_store_survives_an_overwrite_that_follows_it():
    """A store in flight on the side stream, then the compute stream overwrites its blocks (a
    forward writing reallocated blocks): the fence makes the overwrite wait, so the tier keeps the
    old bytes; loaded back into other blocks they match bit for bit."""
    dev = torch.device("cuda")
    n, layers = 128, 8
    spec = FullAttentionSpec(block_size=16, dtype="bfloat16", num_kv_heads=8, head_size=128, head_size_v=128)
    group = KVCacheGroup(0, "full", None, tuple(CacheEntry(i, "kv", spec) for i in range(layers)))
    caches = {(i, "kv"): (torch.randn(2 * n + 1, 16, 8, 128, dtype=torch.bfloat16, device=dev),
                          torch.randn(2 * n + 1, 16, 8, 128, dtype=torch.bfloat16, device=dev)) for i in range(layers)}
    original = {k: (a.clone(), b.clone()) for k, (a, b) in caches.items()}
    io = OffloadIO([group], caches, [], dev)
    manager = OffloadManager(HostTier(n, io.block_bytes(0), pin_memory=True), 1, 16, has_state=False)
    hashes = [("h", j) for j in range(n)]
    manager.prepare_store("r", hashes, [list(range(1, n + 1))], n * 16)
    io.run(manager, *manager.take_jobs(), writes={(0, b) for b in range(1, n + 1)})
    for a, b in caches.values():  # the "forward": overwrites the blocks being stored
        a[1:n + 1].zero_()
        b[1:n + 1].zero_()
    io.poll(manager, wait=True)
    hit = manager.lookup(hashes, 0, n)
    assert hit.num_blocks == n
    manager.prepare_load("s", hit, [list(range(n + 1, 2 * n + 1))], 0, 0)
    io.run(manager, *manager.take_jobs())
    torch.cuda.synchronize()
    for key, (a, b) in caches.items():
        assert torch.equal(a[n + 1:], original[key][0][1:n + 1]) and torch.equal(b[n + 1:], original[key][1][1:n + 1])


# --- a disk tier shared between engines and kept across restarts (issue #24) ----------------------


def test_engines_on_one_directory_share_blocks_and_a_restart_keeps_them(tmp_path):
    """A second engine of the same model on the directory, then a restarted one, get the first
    engine's prefix from the disk as exact hits (the same outputs and logprobs as computing it
    in the same chunks); an engine of another model on the directory gets no hit, and leaves
    the first model's files alone."""
    path, other_path = tmp_path / "llama", tmp_path / "other"
    build_hf_model(*LLAMA, path)
    build_hf_model(*LLAMA, other_path, seed=1)
    prefix = make_prompts([32], seed=5)[0]
    later = [prefix + [7, 8, 9]]
    kw = dict(dtype="float32", block_size=4, max_model_len=64, num_gpu_blocks_override=40)
    disk = dict(kv_offloading_size=0.01, kv_offloading_backend="disk", kv_offloading_dir=str(tmp_path / "tier"))
    scratch = dict(kw, enable_prefix_caching=False, max_num_batched_tokens=32)  # the prefix, then the rest
    reference = outputs(run_engine(LLM(str(path), **scratch), later, greedy()))
    first = LLM(str(path), **kw, **disk)
    run_engine(first, [prefix], greedy())
    files = sorted((tmp_path / "tier").rglob("*.kvb"))
    assert len(files) >= 8, "the prefix's eight blocks (and more) are on the disk"

    def served_from_disk(llm) -> None:
        out = run_engine(llm, later, greedy())
        assert llm.llm_engine.scheduler.stats.offload_hit_tokens == 32, "the prefix did not come from the disk"
        assert out[0].num_cached_tokens == 32 and outputs(out) == reference
        tier = llm.llm_engine.runner.offload.tier
        assert tier.adopted >= 8 and tier.failures == 0

    served_from_disk(LLM(str(path), **kw, **disk))  # a second engine, while the first runs
    del first
    restarted = LLM(str(path), **kw, **disk)
    assert len(restarted.llm_engine.runner.offload.tier._unclaimed) >= 8  # counted against its capacity
    served_from_disk(restarted)
    other = LLM(str(other_path), **kw, **disk)
    assert not other.llm_engine.runner.offload.tier._unclaimed
    out = run_engine(other, later, greedy())
    assert other.llm_engine.scheduler.stats.offload_hit_tokens == 0
    assert outputs(out) != reference  # the models differ: a hit across them would have shown
    assert all(f.exists() for f in files) and other.llm_engine.runner.offload.tier.failures == 0


def test_block_hashes_are_the_same_in_every_process():
    """A restarted engine finds its blocks only if a prompt hashes the same in a new process
    (Python's ``hash(None)``, the first block's parent, changes between processes before 3.12)."""
    import subprocess
    import sys
    from pathlib import Path

    from attnserve.kvcache import block_pool

    code = ("import importlib.util as u, sys; s = u.spec_from_file_location('bp', sys.argv[1]); "
            "m = sys.modules['bp'] = u.module_from_spec(s); s.loader.exec_module(m); "
            "print(m.hash_block_tokens(m.hash_block_tokens(None, [5, 6, 7, 8]), [9, 10, 11, 12]))")
    here = block_pool.hash_block_tokens(block_pool.hash_block_tokens(None, [5, 6, 7, 8]), [9, 10, 11, 12])
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code, str(Path(block_pool.__file__))], capture_output=True,
                             text=True, check=True, env={**os.environ, "PYTHONHASHSEED": seed})
        assert int(out.stdout) == here
    assert block_pool.hash_block_tokens(None, [5, 6, 7, 8]) != block_pool.hash_block_tokens(None, [5, 6, 7, 9])


def test_model_identity_names_the_weights(tmp_path):
    """Weights replaced in place, another seed of random weights, another cache dtype or block
    layout: another identity, so the disk tier's files of the old one are never read (backends,
    kernel variants and the device: tests/unit/test_offload_disk.py)."""
    import json
    from dataclasses import replace

    from attnserve.arch import read_arch
    from attnserve.config import CacheConfig, EngineConfig, ModelConfig
    from attnserve.engine.builder import model_identity
    from attnserve.engine.plan import plan_engine
    from attnserve.platforms import get_platform

    cfg = dict(LLAMA[1], model_type="llama")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    arch, cpu = read_arch(cfg), torch.device("cpu")

    def identity(config: EngineConfig, blob: int = 1024) -> str:
        config = replace(config, cache=replace(config.cache, block_size=16))
        return model_identity(config, tmp_path, plan_engine(arch, config, get_platform("cpu")), cpu, blob)

    config = EngineConfig(ModelConfig(str(tmp_path)))
    same = identity(config)
    assert identity(config) == same
    assert identity(config, 2048) != same
    assert identity(EngineConfig(ModelConfig(str(tmp_path)), CacheConfig(kv_cache_dtype="fp8"))) != same
    dummy = [identity(EngineConfig(ModelConfig(str(tmp_path), load_format="dummy", seed=s))) for s in (0, 1)]
    assert dummy[0] != dummy[1]
    (tmp_path / "model.safetensors").write_bytes(b"retrained")
    assert identity(config) != same
