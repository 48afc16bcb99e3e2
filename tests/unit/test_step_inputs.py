"""The runner's step inputs against their slow twin, and the persistent block tables.

``ModelRunner._prepare`` builds positions, slot mappings and block tables with numpy from rows
kept across steps (``runner/block_table.py``). ``reference_inputs`` below is the former
per-token Python build; every step of engines that chunk prefills, hit the prefix cache, preempt,
abort and drop blocks out of sliding windows (two KV cache groups), and of a hybrid model with
state slots, must give identical inputs.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from attnserve import LLM, SamplingParams
from attnserve.runner.block_table import BlockTables

VOCAB = 256


def reference_inputs(scheduled, block_size: int, num_groups: int) -> dict:
    """The step's inputs one token at a time, in plain Python (the former ``_prepare``)."""
    ids, pos, qsl, seq_lens = [], [], [0], []
    slot_maps: list[list[int]] = [[] for _ in range(num_groups)]
    for s in scheduled:
        start, n = s.start, s.num_new_tokens
        ids.extend(s.request.all_token_ids[start:start + n])
        pos.extend(range(start, start + n))
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
        for g, blocks in enumerate(s.block_ids):
            slot_maps[g].extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, start + n))
    tables = []
    for g in range(num_groups):
        width = max(1, max(len(s.block_ids[g]) for s in scheduled))
        tables.append([s.block_ids[g] + [0] * (width - len(s.block_ids[g])) for s in scheduled])
    num_decodes = 0
    while num_decodes < len(scheduled) and scheduled[num_decodes].num_new_tokens == 1:
        num_decodes += 1
    state_decodes = 0
    while state_decodes < num_decodes and scheduled[state_decodes].start > 0:
        state_decodes += 1
    rope = [s.request.num_tokens for s in scheduled for _ in range(s.num_new_tokens)]
    return dict(input_ids=ids, positions=pos, query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables,
                slot_mappings=slot_maps, num_decodes=num_decodes, num_state_decodes=state_decodes,
                token_seq_lens=rope, state_slots=[s.state_slot for s in scheduled],
                has_initial_state=[s.start > 0 for s in scheduled])


def check_every_step(llm: LLM) -> list[int]:
    """Wrap the runner's ``_prepare`` so that each step is compared with the reference; returns
    a list that counts the steps checked."""
    runner = llm.llm_engine.runner
    prepare = runner._prepare
    checked: list[int] = []

    def checked_prepare(scheduled):
        input_ids, ctx = prepare(scheduled)
        ref = reference_inputs(scheduled, runner.block_size, len(runner.groups))
        c = ctx.common
        assert input_ids.dtype == torch.int64 and input_ids.tolist() == ref["input_ids"]
        assert c.positions.dtype == torch.int64 and c.positions.tolist() == ref["positions"]
        assert c.query_start_loc.dtype == torch.int32 and c.query_start_loc.tolist() == ref["query_start_loc"]
        assert c.seq_lens.dtype == torch.int32 and c.seq_lens.tolist() == ref["seq_lens"]
        assert c.query_start_loc_cpu == ref["query_start_loc"] and c.seq_lens_cpu == ref["seq_lens"]
        assert all(type(x) is int for x in c.query_start_loc_cpu + c.seq_lens_cpu)
        for g in range(len(runner.groups)):
            assert c.block_tables[g].dtype == torch.int32 and c.block_tables[g].tolist() == ref["block_tables"][g]
            assert c.slot_mappings[g].dtype == torch.int64 and c.slot_mappings[g].tolist() == ref["slot_mappings"][g]
        assert (c.num_decodes, c.max_query_len, c.max_seq_len) == \
            (ref["num_decodes"], max(np.diff(ref["query_start_loc"])), max(ref["seq_lens"]))
        assert ctx.token_seq_lens.dtype == torch.int64 and ctx.token_seq_lens.tolist() == ref["token_seq_lens"]
        if runner.state_caches:
            assert c.state_slots.tolist() == ref["state_slots"]
            assert c.has_initial_state.dtype == torch.bool and c.has_initial_state.tolist() == ref["has_initial_state"]
            assert c.num_state_decodes == ref["num_state_decodes"]
        checked.append(len(scheduled))
        return input_ids, ctx

    runner._prepare = checked_prepare
    return checked


def drive(llm: LLM, num_requests: int = 24, seed: int = 0) -> None:
    """Requests that share prefixes, of mixed lengths; two are aborted half-way."""
    engine = llm.llm_engine
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(12)]
    ids = []
    for i in range(num_requests):
        prompt = (prefix if i % 2 else []) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))]
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(1, 24))
        ids.append(engine.add_request(None, {"prompt_token_ids": prompt}, params))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 6:
            engine.abort_request(ids[3:5])
        engine.kv_manager.check_integrity()


def model_dir(tmp_path, model_type: str, **kwargs) -> str:
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type](vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=16, max_position_embeddings=256, **kwargs)
    cfg.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("engine", [
    dict(max_num_batched_tokens=16, max_num_seqs=8),  # chunked prefills, requests waiting
    dict(num_gpu_blocks_override=40, max_num_seqs=16),  # preemption by recompute
])
def test_inputs_match_the_reference_with_sliding_windows(tmp_path, engine):
    # gemma2 alternates sliding (window 8) and full layers: two KV cache groups, one of which
    # puts the null block where blocks fall out of the window
    d = model_dir(tmp_path, "gemma2", num_hidden_layers=2, sliding_window=8)
    llm = LLM(d, load_format="dummy", dtype="float32", block_size=4, max_model_len=96, **engine)
    assert {g.policy for g in llm.llm_engine.runner.groups} == {"full", "sliding"}
    checked = check_every_step(llm)
    drive(llm)
    assert len(checked) > 10 and max(checked) > 1
    if "num_gpu_blocks_override" in engine:
        assert llm.llm_engine.scheduler.stats.num_preemptions > 0


def test_inputs_match_the_reference_with_state_slots(tmp_path):
    d = model_dir(tmp_path, "qwen3_5_text", num_hidden_layers=2, linear_key_head_dim=8, linear_value_head_dim=8,
                  linear_num_key_heads=1, linear_num_value_heads=2, layer_types=["linear_attention", "full_attention"])
    llm = LLM(d, load_format="dummy", dtype="float32", block_size=4, max_model_len=96, max_num_batched_tokens=16)
    assert llm.llm_engine.runner.state_caches
    checked = check_every_step(llm)
    drive(llm, num_requests=12)
    assert len(checked) > 10


class _Scheduled:
    def __init__(self, rid: str, block_ids: list[list[int]]):
        self.request = type("R", (), {"request_id": rid})()
        self.block_ids = block_ids


def test_block_tables_follow_the_lists_through_every_change():
    """Random appends, in-place drops (sliding groups), reallocations with fewer blocks,
    requests leaving and joining, and growth past the initial capacity: the gathered table is
    always the zero-padded rows of the current lists."""
    rng = random.Random(0)
    tables = BlockTables([True, False], num_rows=2, num_cols=2)
    lists: dict[str, list[list[int]]] = {}
    for step in range(400):
        for rid in list(lists):
            op = rng.random()
            if op < 0.1:
                del lists[rid]  # finished
            elif op < 0.2:
                lists[rid] = [[rng.randrange(1, 99) for _ in range(rng.randint(0, 3))] for _ in range(2)]  # reallocated
            else:
                for ids in lists[rid]:
                    ids.extend(rng.randrange(1, 99) for _ in range(rng.randint(0, 2)))
                sliding = lists[rid][1]
                if sliding and rng.random() < 0.3:
                    sliding[rng.randrange(len(sliding))] = 0  # dropped out of the window, in place
        while len(lists) < 6 and rng.random() < 0.5:
            lists[f"r{step}-{len(lists)}"] = [[rng.randrange(1, 99) for _ in range(rng.randint(0, 5))] for _ in range(2)]
        scheduled = [_Scheduled(rid, ids) for rid, ids in lists.items() if rng.random() < 0.9]
        if not scheduled:
            continue
        rows, widths = tables.update(scheduled)
        for g in range(2):
            width = max(1, max(len(s.block_ids[g]) for s in scheduled))
            expected = [s.block_ids[g] + [0] * (width - len(s.block_ids[g])) for s in scheduled]
            assert widths[g] == width
            assert tables.gather(g, rows, width).tolist() == expected
            positions = np.array([rng.randrange(4 * max(len(s.block_ids[g]), 1)) for s in scheduled])
            slots = [s.block_ids[g][p // 4] * 4 + p % 4 if p // 4 < len(s.block_ids[g]) else p % 4
                     for s, p in zip(scheduled, positions.tolist())]
            assert tables.slots(g, rows, positions, 4).tolist() == slots
    assert tables.tables[0].shape[0] >= 6 and tables.tables[0].shape[1] > 2  # it grew
