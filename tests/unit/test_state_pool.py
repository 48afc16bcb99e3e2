"""Hybrid models' state slots and block-boundary snapshots, without a model."""

from __future__ import annotations

import pytest

from attnserve.config import SchedulerConfig
from attnserve.core.request import Request
from attnserve.engine.scheduler import Scheduler
from attnserve.kvcache.manager import KVCacheManager
from attnserve.kvcache.state import StatePool
from attnserve.sampling_params import SamplingParams
from tests.unit.test_block_pool import BS, full_group


def req(rid, tokens, max_tokens=4):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), block_size=BS)


def test_pool_slots_and_lru_snapshots():
    pool = StatePool(num_running=2, num_snapshots=2)
    assert pool.num_slots == 5
    a, b = pool.allocate("a"), pool.allocate("b")
    assert {a, b} == {1, 2}
    with pytest.raises(RuntimeError, match="no free state slot"):
        pool.allocate("c")
    s1, s2 = pool.reserve_snapshot(11), pool.reserve_snapshot(22)
    assert {s1, s2} == {3, 4}
    assert pool.reserve_snapshot(11) is None  # already held; now the most recent
    s3 = pool.reserve_snapshot(33)  # evicts 22, the least recently used
    assert s3 == s2 and 22 not in pool.snapshots and pool.lookup(11) == s1
    pool.free("a")
    pool.check_integrity()
    assert pool.allocate("c") == a


def run_steps(sched: Scheduler, steps: int, token: int = 7):
    """Execute ``steps`` scheduler steps with a fake runner that samples ``token``."""
    seen = []
    for _ in range(steps):
        out = sched.schedule()
        if out.is_empty:
            break
        seen.append(out)
        sampled = {s.request.request_id: token for s in out.scheduled if s.samples}
        sched.update(out, sampled)
        sched.kv.check_integrity()
    return seen


def test_prefill_steps_end_on_block_boundaries_and_snapshot():
    kv = KVCacheManager([full_group()], num_blocks=64, state_pool=StatePool(4, 8))
    sched = Scheduler(SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=100), kv, max_model_len=200)
    r = req("a", range(3, 13))  # 10 tokens: the prompt's last boundary is 8
    sched.add_request(r)
    outs = run_steps(sched, 3)
    assert [s.num_new_tokens for s in outs[0].scheduled] == [8]  # stops at the boundary
    assert [s.num_new_tokens for s in outs[1].scheduled] == [2]
    assert outs[0].scheduled[0].state_slot == kv.state_slot("a") != 0
    # the state after 4 and 8 tokens was saved: (slot -> snapshot) copies ride on the next step
    copies = outs[1].state_copies
    assert len(copies) == 1 and copies[0][0] == kv.state_slot("a")
    assert r.block_hashes[1] in kv.state_pool.snapshots


def test_prefix_hit_restores_the_state_snapshot():
    kv = KVCacheManager([full_group()], num_blocks=64, state_pool=StatePool(4, 8))
    sched = Scheduler(SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=100), kv, max_model_len=200)
    sched.add_request(req("a", range(3, 13), max_tokens=1))
    run_steps(sched, 5)
    assert not sched.running
    b = req("b", list(range(3, 11)) + [50, 51, 52])  # shares 8 tokens (2 blocks) with "a"
    sched.add_request(b)
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.start == 8 and s.num_new_tokens == 3  # the hit covers 2 blocks; 3 tokens left
    snapshot = kv.state_pool.snapshots[b.block_hashes[1]]
    assert (snapshot, s.state_slot) in out.state_copies
    kv.check_integrity()


def test_without_snapshot_there_is_no_hit():
    kv = KVCacheManager([full_group()], num_blocks=64, state_pool=StatePool(4, 0))
    sched = Scheduler(SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=100), kv, max_model_len=200)
    sched.add_request(req("a", range(3, 13), max_tokens=1))
    run_steps(sched, 5)
    b = req("b", list(range(3, 11)) + [50, 51, 52])
    sched.add_request(b)
    (s,) = sched.schedule().scheduled
    assert s.start == 0  # the attention blocks are cached, but no state is


def test_preemption_frees_the_state_slot():
    kv = KVCacheManager([full_group()], num_blocks=9, state_pool=StatePool(2, 2))
    sched = Scheduler(SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=100), kv, max_model_len=32)
    for i in range(2):
        sched.add_request(req(f"r{i}", range(10 * i + 3, 10 * i + 15), max_tokens=16))
    run_steps(sched, 60)
    assert sched.stats.num_preemptions > 0
    kv.check_integrity()
    assert not kv.state_pool.slot_of


def test_num_state_snapshots_sizes_the_pool(tmp_path):
    """``num_state_snapshots`` sets the snapshot slots apart from ``max_num_seqs`` (default: as
    many as running slots); a bad value is refused where it enters."""
    from attnserve import LLM
    from attnserve.config import CacheConfig
    from tests.models.parity import build_hf_model
    from tests.models.test_parity_hybrid import HYBRID

    build_hf_model(*HYBRID["qwen3_5"], tmp_path)
    pools = {}
    for wanted in (None, 7):
        llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_num_seqs=3, max_model_len=64,
                  num_state_snapshots=wanted)
        pools[wanted] = llm.llm_engine.kv_manager.state_pool.num_slots
    assert pools == {None: 1 + 3 + 3, 7: 1 + 3 + 7}
    for bad in (-1, 2.5, True, 1 << 21):
        with pytest.raises(ValueError, match="num_state_snapshots"):
            CacheConfig(num_state_snapshots=bad)
