"""Issue #39, the disk tier: its identity covers everything that changes a block's bytes (a
TORCH_SDPA engine's blocks read by a FLEX_ATTENTION engine changed an output); its bookkeeping
grows with the blocks it holds, not with its budget (``--kv-offloading-size 1000`` added 1.7 GB
of RSS before anything was stored); a disk that cannot be written is counted and logged with
the count, not once per block."""

from __future__ import annotations

import logging
import os
import tracemalloc

import pytest
import torch

from attnserve import LLM, SamplingParams
from attnserve.kvcache.offload import DiskTier, HostTier, OffloadManager
from attnserve.kvcache.offload import tiers as tiers_module

PROMPT = "def fibonacci(n):\n    " * 8  # 81 tokens: five full blocks of 16


def _disk(tmp_path, **kw) -> dict:
    return dict(kv_offloading_size=0.01, kv_offloading_backend="disk", kv_offloading_dir=str(tmp_path), **kw)


def _disk_hits(llm: LLM) -> tuple[int, int]:
    """Generate PROMPT once: (prompt tokens loaded from the disk tier, blocks adopted from it)."""
    llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    return llm.llm_engine.scheduler.stats.offload_hit_tokens, llm.llm_engine.runner.offload.tier.adopted


def test_engines_differing_only_in_attention_backend_share_no_disk_blocks(tmp_path):
    """The demo model in bf16 under TORCH_SDPA, then FLEX_ATTENTION, on one directory: the
    second engine neither counts nor reads the first one's files (a fresh engine's device
    cache is empty, so any hit would come from the disk); a second TORCH_SDPA engine does."""
    first = LLM(attention_backend="TORCH_SDPA", **_disk(tmp_path))
    assert _disk_hits(first) == (0, 0)
    assert len(list(tmp_path.rglob("*.kvb"))) >= 5
    flex = LLM(attention_backend="FLEX_ATTENTION", **_disk(tmp_path))
    assert not flex.llm_engine.runner.offload.tier._unclaimed, "another backend's files counted as its own"
    assert _disk_hits(flex) == (0, 0)
    same = LLM(attention_backend="TORCH_SDPA", **_disk(tmp_path))
    hits, adopted = _disk_hits(same)
    assert hits >= 5 * 16 and adopted >= 5  # the control: the same setup does share


def test_identity_names_backends_kernel_variants_and_device(tmp_path):
    """Every choice that changes the bytes a layer writes gives another identity: the backend,
    a kernel variant (the CPU decode extension turned off), CUDA graphs; the same choices give
    the same one."""
    from attnserve.arch import load_hf_config, read_arch
    from attnserve.config import EngineConfig
    from attnserve.engine.builder import model_identity, resolve_model_dir
    from attnserve.engine.plan import plan_engine
    from attnserve.platforms import get_platform

    model_dir = resolve_model_dir("attnserve-demo-gqa")
    arch = read_arch(load_hf_config(model_dir))
    cpu = torch.device("cpu")

    def identity(**kwargs) -> str:
        config = EngineConfig.from_kwargs(str(model_dir), block_size=16, **kwargs)
        return model_identity(config, model_dir, plan_engine(arch, config, get_platform("cpu")), cpu, 24576)

    base = identity()
    assert identity() == base
    variants = [identity(attention_backend="FLEX_ATTENTION"), identity(disabled_kernels="cpu_ext"),
                identity(enforce_eager=True), identity(kv_cache_dtype="float32"), identity(dtype="float32")]
    assert len({base, *variants}) == 1 + len(variants), "two setups that write different bytes share files"
    assert "cpu_ext" in base and "TORCH_SDPA" in base and torch.__version__ in base


def test_bookkeeping_grows_with_the_blocks_held_not_the_budget(tmp_path):
    """A tier of five million slots allocates nothing per slot until blocks come (the free
    list of every slot was 180 MB here, 1.7 GB for --kv-offloading-size 1000); slots are
    numbered as first used and reused once freed."""
    tracemalloc.start()
    try:
        tier = DiskTier(capacity=5_000_000, blob_bytes=16, directory=tmp_path)
        host = HostTier(capacity=5_000_000, blob_bytes=1)  # its buffer is torch's, not counted here
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes of bookkeeping for an empty tier"
    for t in (tier, host):
        assert t._next_slot == 0 and not t._free
    small = DiskTier(capacity=3, blob_bytes=16, directory=tmp_path / "small")
    for k in range(20):  # evicts from the fourth on: the same three slots go round
        small.put(("k", k), torch.full((16,), k, dtype=torch.uint8))
    assert small._next_slot == 3 and len(small) == 3 and small.evictions == 17
    assert sorted(small.index.values()) == [0, 1, 2]
    assert torch.equal(small.get(("k", 19)), torch.full((16,), 19, dtype=torch.uint8))


def test_failed_disk_writes_are_counted_and_logged_once_with_a_count(tmp_path, monkeypatch, caplog):
    """A disk that refuses every write: the manager's ``failed_stores`` and the tier's
    ``write_failures`` count each block; the log has one line for the first, then none until
    the interval has passed, then one line with the count."""
    real_open = os.open

    def refuse_tmp(path, flags, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise OSError(28, "No space left on device")
        return real_open(path, flags, *args, **kwargs)

    tier = DiskTier(capacity=100, blob_bytes=16, directory=tmp_path)
    manager = OffloadManager(tier, num_groups=1, block_size=4, has_state=False)
    clock = [1000.0]
    monkeypatch.setattr(tiers_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(os, "open", refuse_tmp)

    def store(n: int) -> None:
        for k in range(n):
            key = (f"block {clock[0]} {k}", 0)
            manager.store_buffer(key, 16).fill_(1)
            manager.complete_store(key, 16)

    with caplog.at_level(logging.WARNING, logger=tiers_module.__name__):
        store(50)
        assert tier.write_failures == manager.stats.failed_stores == 50 and len(tier) == 0
        assert len(caplog.records) == 1 and "disk writes failed: 1 so far" in caplog.text
        assert "No space left" in caplog.text
        clock[0] += 61
        store(1)
    assert len(caplog.records) == 2 and "51 so far (50 since the last report" in caplog.records[1].getMessage()
    assert tier.failures == 51 and not list(tmp_path.rglob("*.tmp"))


def test_failed_stores_are_a_metric():
    from prometheus_client.parser import text_string_to_metric_families

    from attnserve.engine.engine_client import EngineStats
    from attnserve.entrypoints.openai.metrics import ServerMetrics

    m = ServerMetrics("tiny", lambda: EngineStats(offload_failed_stores=7), max_model_len=64, cache_info={})
    samples = {s.name: s.value for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    assert samples["attnserve:offload_failed_stores_total"] == 7


@pytest.mark.parametrize("size", [1000.0])
def test_a_huge_disk_budget_holds_no_memory_per_slot(tmp_path, size):
    """The engine-level case of the issue: ``kv_offloading_size=1000`` GiB on the demo model is
    some forty million slots; the tier's bookkeeping stays empty until blocks are stored."""
    llm = LLM(**dict(_disk(tmp_path), kv_offloading_size=size))
    tier = llm.llm_engine.runner.offload.tier
    assert tier.capacity > 10_000_000 and tier._next_slot == 0 and not tier._free
    _disk_hits(llm)
    assert 0 < tier._next_slot == len(tier) <= 16
