"""Async scheduling (LLMEngine.async_scheduling): each step schedules and launches the next
forward before reading the last one back, feeding in-flight tokens from the device.

It must change no output: the same tokens, logprobs and finish reasons as the plain order,
for the three shipped demo models (GQA, MLA, DSA), with stop tokens, stop strings, seeded
sampling and n > 1, under preemption, and with requests aborted while their step runs. Steps
whose sampling reads host tokens (penalties, min_tokens) launch their forward ahead and sample
once the step before is back, and models it cannot serve refuse it by name.

A hybrid model (a tiny qwen3_next: Gated DeltaNet state layers) too: the same outputs with stop
tokens, EOS, seeded sampling and n > 1, then prefix hits that restore state snapshots taken
inside generated text (which only the snapshot taken when a step is scheduled catches, since
after a step the next one's input token is still in flight), and under preemption.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from attnserve import LLM, SamplingParams
from tests.models.parity import build_hf_model, make_prompts
from tests.models.test_parity_hybrid import HYBRID

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n    def push(self, x):", "x = [", "for i in range("]


def _params(stop_token: int | None = None) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                       stop_token_ids=[stop_token] if stop_token is not None else None),
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True, n=2),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[")"]),
        SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=5, ignore_eos=True, logprobs=1),
    ]


def _same(a, b, tol: float = 1e-5) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        assert [c.text for c in x.outputs] == [c.text for c in y.outputs]
        assert [c.finish_reason for c in x.outputs] == [c.finish_reason for c in y.outputs]
        for cx, cy in zip(x.outputs, y.outputs):
            for ex, ey in zip(cx.logprobs or [], cy.logprobs or []):
                assert ex.keys() == ey.keys()
                assert all(abs(ex[t].logprob - ey[t].logprob) <= tol for t in ex)


def _spy_inflight(llm: LLM) -> list[int]:
    """Count the decodes whose input token came from the device (the runner's in-flight path)."""
    runner = llm.llm_engine.runner
    calls: list[int] = []
    real = runner._inflight_row

    def spy(request_id: str) -> int:
        calls.append(1)
        return real(request_id)

    runner._inflight_row = spy
    return calls


@pytest.mark.parametrize("model", ["attnserve-demo-gqa", "attnserve-demo-mla", "attnserve-demo-dsa"])
def test_async_equals_sync(model):
    sync = LLM(model, dtype="float32", max_model_len=256, async_scheduling=False)
    base = sync.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
    stop_token = base[0].outputs[0].token_ids[6]
    expected = sync.generate(PROMPTS, _params(stop_token))
    assert expected[1].outputs[0].finish_reason == "stop"  # the stop token ends it early
    llm = LLM(model, dtype="float32", max_model_len=256, async_scheduling=True)
    assert llm.llm_engine.async_scheduling
    inflight = _spy_inflight(llm)
    _same(expected, llm.generate(PROMPTS, _params(stop_token)))
    assert inflight, "no decode read its input token from the device: nothing ran ahead"


def test_steps_run_one_ahead_and_drain():
    llm = LLM(max_model_len=256, block_size=8, async_scheduling=True)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert engine.step() == []  # the prefill is launched, nothing is read back yet
    assert engine._pending is not None
    outs = engine.step()  # the first decode runs while the prefill's token is read back
    assert [len(o.outputs[0].token_ids) for o in outs] == [1]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine._pending is None and not engine.states
    pool = engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_penalties_and_min_tokens_wait_only_in_their_sampling():
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, presence_penalty=0.5,
                             frequency_penalty=0.4),
              SamplingParams(temperature=0.0, max_tokens=10, min_tokens=6),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)]
    expected = LLM(max_model_len=256, block_size=8, async_scheduling=False).generate(PROMPTS[:4], params)
    llm = LLM(max_model_len=256, block_size=8, async_scheduling=True)
    inflight = _spy_inflight(llm)
    _same(expected, llm.generate(PROMPTS[:4], params))
    # the forwards run ahead (input tokens read on the device); the sampling of each step
    # waits for the step before's tokens, which the penalties and min_tokens read
    assert inflight


def test_preemption_under_async_scheduling():
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(10 + i, 40 + 3 * i))} for i in range(6)]
    # a recompute is a prefill where the first run decoded: float32 keeps its rounding from
    # flipping a greedy choice (in bf16 this model meets an exact tie at one position)
    small = dict(dtype="float32", max_model_len=128, block_size=4, num_gpu_blocks_override=40)
    roomy = LLM(dtype="float32", max_model_len=128, block_size=4, async_scheduling=False).generate(prompts, params)
    plain = LLM(**small, async_scheduling=False).generate(prompts, params)
    llm = LLM(**small, async_scheduling=True)
    engine = llm.llm_engine
    ids = [engine.add_request(None, p, params) for p in prompts]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out
        engine.kv_manager.check_integrity()
    assert engine.scheduler.stats.num_preemptions > 0
    _same(plain, [finals[i] for i in ids])
    _same(roomy, [finals[i] for i in ids])


def test_abort_while_its_step_runs():
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = LLM(max_model_len=256, block_size=8, async_scheduling=False).generate(PROMPTS, params)
    llm = LLM(max_model_len=256, block_size=8, async_scheduling=True)
    engine = llm.llm_engine
    ids = [engine.add_request(None, p, params) for p in PROMPTS]
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        steps += 1
        if steps in (2, 5):  # a step with the victim's token in flight is pending now
            assert engine._pending is not None
            engine.abort_request(ids[steps // 2])
        engine.kv_manager.check_integrity()
    kept = [i for k, i in enumerate(ids) if k not in (1, 2)]
    assert sorted(finals) == sorted(kept)
    _same([e for k, e in enumerate(expected) if k not in (1, 2)], [finals[i] for i in kept])
    pool = engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_models_it_cannot_serve_refuse_it(tmp_path):
    with pytest.raises(ValueError, match="async_scheduling is not supported with a length-dependent RoPE"):
        LLM(max_model_len=256, streaming_sinks=4, streaming_window=64, async_scheduling=True)
    assert not LLM(max_model_len=256).llm_engine.async_scheduling  # off by default on CPU


# --- a hybrid model -------------------------------------------------------------------------

@contextlib.contextmanager
def _one_thread():
    """Tiny tensors gain nothing from intra-op threads; on a busy 2-core machine their
    synchronisation made these runs twice as slow (as in test_parity_hybrid.py)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A tiny qwen3_next (3 GDN layers, 1 attention layer, MoE), an EOS token its greedy runs
    meet (written into config.json) and a stop token: (path, stop token)."""
    path = tmp_path_factory.mktemp("qwen3_next")
    with _one_thread():
        build_hf_model(*HYBRID["qwen3_next"], path)
        base = _hybrid(path, async_scheduling=False).generate(
            [{"prompt_token_ids": p} for p in HYBRID_PROMPTS[:2]],
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = base[1].outputs[0].token_ids[7]
    (path / "config.json").write_text(json.dumps(config))
    return path, base[0].outputs[0].token_ids[5]


@pytest.fixture
def one_thread():
    with _one_thread():
        yield


HYBRID_PROMPTS = make_prompts([13, 6, 21, 10], seed=5)


def _hybrid(path, **engine) -> LLM:
    return LLM(str(path), dtype="float32", block_size=4, **{"max_model_len": 96, **engine})


def _hybrid_params(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_token], logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=12),  # ends on the EOS token
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=9, ignore_eos=True, n=2),
        SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=11, ignore_eos=True, logprobs=1),
    ]


def _prefix_prompts(first) -> list[list[int]]:
    """Prompts that share a prefix with a first run's requests: their prompt and some of the
    tokens they generated (snapshots at block boundaries inside the generated text), then
    other tokens."""
    return [list(o.prompt_token_ids) + o.outputs[0].token_ids[:k] + [9, 8, 7]
            for o, k in zip(first, (8, 5, 9, 11))]


def test_hybrid_async_equals_sync(hybrid, one_thread):
    path, stop = hybrid
    runs = {}
    for mode in (False, True):
        llm = _hybrid(path, async_scheduling=mode)
        assert llm.llm_engine.async_scheduling is mode
        inflight = _spy_inflight(llm)
        first = llm.generate([{"prompt_token_ids": p} for p in HYBRID_PROMPTS], _hybrid_params(stop))
        later = llm.generate([{"prompt_token_ids": p} for p in _prefix_prompts(first)],
                             SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2))
        runs[mode] = first, later, [o.num_cached_tokens for o in later], bool(inflight)
        llm.llm_engine.kv_manager.check_integrity()
    (first, later, hits, _), (a_first, a_later, a_hits, ran_ahead) = runs[False], runs[True]
    assert [o.outputs[0].finish_reason for o in first[:2]] == ["stop", "stop"]  # the stop token, the EOS
    assert len(first[0].outputs[0].token_ids) < 12 and len(first[1].outputs[0].token_ids) < 12
    _same(first, a_first)
    _same(later, a_later)
    assert ran_ahead, "no decode read its input token from the device: nothing ran ahead"
    # every later prompt restored a snapshot past its first run's prompt, in both orders
    assert a_hits == hits and all(h > len(p) for h, p in zip(hits, HYBRID_PROMPTS)), (hits, a_hits)


def test_hybrid_preemption_under_async_scheduling(hybrid, one_thread):
    path, _ = hybrid
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in make_prompts([9, 14, 11, 17], seed=11)]
    small = dict(max_model_len=48, num_gpu_blocks_override=16)
    plain = _hybrid(path, **small, async_scheduling=False).generate(prompts, params)
    llm = _hybrid(path, **small, async_scheduling=True)
    engine = llm.llm_engine
    ids = [engine.add_request(None, p, params) for p in prompts]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out
        engine.kv_manager.check_integrity()
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.kv_manager.state_pool.num_hits > 0  # a resumed request restored its own snapshot
    _same(plain, [finals[i] for i in ids], tol=1e-4)
