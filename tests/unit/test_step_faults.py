"""A step that raises fails the request that caused it, and only that one (issue #24).

Faults are injected into the runner: ``execute`` (the plain loop) or ``collect`` (async
scheduling's read-back) raises whenever a chosen request is in the step, or once for a step
of several requests (a fault no request caused). Then:

- the culprit finishes with ``finish_reason`` "error" and the exception in ``stop_reason``;
- every other request finishes with the exact tokens of a run without the fault, and its
  logprobs to 1e-4 (the failed step's requests rerun from scratch one at a time, as after a
  preemption);
- the engine is idle afterwards (no request, no held block, the pool consistent) and serves
  the next ``generate`` exactly; nothing a failed step wrote is served from the prefix cache.
"""

from __future__ import annotations

import random

import pytest

from attnserve import LLM, SamplingParams
from tests.models.parity import build_hf_model

VOCAB = 256
PROMPTS = [[5, 9, 12, 40, 7, 7, 3], [7, 1, 99], [200, 13, 18, 44, 45, 46, 47, 48, 49, 50, 51], [2, 3]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, seed=5, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_hf_model("llama", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128), path)
    return path


def make_llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_model_len=64, max_num_seqs=4, block_size=4,
               max_num_batched_tokens=16, **kw)


class Summary(tuple):
    """(tokens, finish reason, top logprobs); equal when tokens and reasons are and logprobs agree
    to 1e-4 (a request rerun from scratch computes its earlier tokens in one prefill instead of
    step by step: last-bit float differences)."""

    def __eq__(self, other):
        if self[:2] != other[:2] or (self[2] is None) != (other[2] is None):
            return False
        return self[2] is None or all(
            a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
            for a, b in zip(self[2], other[2], strict=True))

    __hash__ = tuple.__hash__


def summary(out) -> Summary:
    c = out.outputs[0]
    lps = None if c.logprobs is None else [{t: v.logprob for t, v in e.items()} for e in c.logprobs]
    return Summary((c.token_ids, c.finish_reason, lps))


class Fault(RuntimeError):
    pass


def inject(llm: LLM, method: str, when):
    """Make ``runner.<method>`` raise for the steps whose request ids ``when`` accepts."""
    runner = llm.llm_engine.runner
    real = getattr(runner, method)
    calls = {"raised": 0}

    def wrapped(arg, *a, **kw):
        sched = arg if method != "collect" else wrapped.launched.get(id(arg))
        ids = [s.request.request_id for s in sched.scheduled] if sched is not None else []
        if when(ids):
            calls["raised"] += 1
            raise Fault(f"injected fault in a step of {ids}")
        return real(arg, *a, **kw)

    wrapped.launched = {}
    if method == "collect":  # remember which step each handle belongs to
        real_launch = runner.launch

        def launch(sched_out, *a, **kw):
            handle = real_launch(sched_out, *a, **kw)
            wrapped.launched[id(handle)] = sched_out
            return handle

        runner.launch = launch
    setattr(runner, method, wrapped)
    return calls


def assert_idle(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.states and not engine.scheduler.requests and not engine.scheduler.suspects
    pool = engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1, "a block is still held"
    engine.kv_manager.check_integrity()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_request_that_faults_fails_alone(model_dir, params, async_scheduling):
    ref_llm = make_llm(model_dir, async_scheduling=async_scheduling)
    ref = [summary(o) for o in ref_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    llm = make_llm(model_dir, async_scheduling=async_scheduling)
    engine = llm.llm_engine

    def when(ids):  # a request of the third prompt, in any step, once it has 3 output tokens
        reqs = [engine.scheduler.requests[i] for i in ids if i in engine.scheduler.requests]
        return any(r.prompt_token_ids == PROMPTS[2] and r.num_output_tokens >= 3 for r in reqs)

    calls = inject(llm, "collect" if async_scheduling else "execute", when)
    rids = [engine.add_request(None, {"prompt_token_ids": p}, params) for p in PROMPTS]
    finals = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step(final_only=True):
            finals[out.request_id] = out
    assert calls["raised"] >= 1 and set(finals) == set(rids)
    got = [summary(finals[r]) for r in rids]
    bad = finals[rids[2]].outputs[0]
    assert bad.finish_reason == "error" and "injected fault" in bad.stop_reason
    assert len(bad.token_ids) >= 3  # what it produced before the fault is kept
    assert [g for i, g in enumerate(got) if i != 2] == [r for i, r in enumerate(ref) if i != 2]
    assert_idle(llm)
    again = [summary(o) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert again[:2] == ref[:2] and again[3] == ref[3]  # the culprit's prompt still faults
    assert again[2][1] == "error"
    assert_idle(llm)


def test_a_fault_no_request_caused_loses_nothing(model_dir):
    """One failed step of several requests (say, a transient error): all of them rerun, one at a
    time, and every output is exact; a prompt sharing the failed step's prefix is exact too."""
    ref_llm = make_llm(model_dir)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = [summary(o) for o in ref_llm.generate(prompts, GREEDY)]
    llm = make_llm(model_dir)
    state = {"steps": 0}

    def when(ids):
        state["steps"] += 1
        return state["steps"] == 3 and len(ids) > 1  # the third step, once

    calls = inject(llm, "execute", when)
    assert [summary(o) for o in llm.generate(prompts, GREEDY)] == ref
    assert calls["raised"] == 1
    assert_idle(llm)
    assert [summary(o) for o in llm.generate(prompts, GREEDY)] == ref  # prefix hits, exact


def test_recovery_under_cache_pressure(model_dir):
    """16 usable blocks of 4 tokens (one max_model_len sequence) for 4 requests of 30 tokens
    each: preemptions before and after two failed steps in a row, every output still exact
    and nothing leaked."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)
    ref = [summary(o) for o in make_llm(model_dir, num_gpu_blocks_override=17).generate(prompts, params)]
    llm = make_llm(model_dir, num_gpu_blocks_override=17)
    state = {"steps": 0}

    def when(ids):
        state["steps"] += 1
        return 6 <= state["steps"] <= 7 and len(ids) > 1

    calls = inject(llm, "execute", when)
    assert [summary(o) for o in llm.generate(prompts, params)] == ref
    assert calls["raised"] >= 1 and llm.llm_engine.scheduler.stats.num_preemptions > 0
    assert_idle(llm)


class FaultyDetokenizer:
    """A detokenizer that raises at its ``at``-th token (a tokenizer bug on one output)."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def step(self, ids):
        self.calls += 1
        if self.calls >= self.at:
            raise Fault(f"injected detokenizer fault at token {self.calls}")
        return "x"

    def flush(self):
        return ""


class FaultyTokenizer:
    """Formatting a logprob entry decodes each token: this decode raises."""

    def decode(self, ids, skip_special_tokens=False):
        raise Fault("injected logprob formatting fault")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_output_processing_fault_fails_its_request_alone(model_dir, async_scheduling):
    """Detokenising (one request, at its 3rd token) and formatting logprobs (another, at its
    first) raise: those two finish with "error" and the message, keeping the tokens they had;
    the others finish exactly; the engine is idle afterwards and serves the next generate."""
    ref_llm = make_llm(model_dir, async_scheduling=async_scheduling)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = [summary(o) for o in ref_llm.generate(prompts, GREEDY)]
    llm = make_llm(model_dir, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    rids = [engine.add_request(None, p, GREEDY) for p in prompts]
    engine.states[rids[1]].completions[0].detok = FaultyDetokenizer(at=3)
    engine.states[rids[2]].tokenizer = FaultyTokenizer()
    finals = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step(final_only=True):
            finals[out.request_id] = out
    assert set(finals) == set(rids)
    detok_failed, lp_failed = finals[rids[1]].outputs[0], finals[rids[2]].outputs[0]
    assert detok_failed.finish_reason == "error" and "detokenizer fault" in detok_failed.stop_reason
    assert detok_failed.token_ids == ref[1][0][:3]  # what it produced is kept, nothing after
    assert lp_failed.finish_reason == "error" and "logprob formatting fault" in lp_failed.stop_reason
    assert [summary(finals[rids[i]]) for i in (0, 3)] == [ref[0], ref[3]]
    assert_idle(llm)
    assert [summary(o) for o in llm.generate(prompts, GREEDY)] == ref
    assert_idle(llm)


def test_a_suspect_short_of_blocks_preempts_the_others_not_itself(model_dir):
    # Many running requests, a step budget that leaves some of them out of a step, and a pool
    # too small for all: after a poisoned request fails a step of several, each suspect reruns
    # alone and needs blocks the waiting-out running requests hold. It used to preempt itself
    # (the last admitted) every step, recomputing from scratch for ever (found by the
    # fault-injected load test, tests/server/test_load_faults.py).
    rng = random.Random(0)
    prefixes = [[rng.randrange(20, VOCAB) for _ in range(rng.choice([8, 16, 24]))] for _ in range(4)]
    prompts = []
    for i in range(24):
        p = rng.choice(prefixes) + [rng.randrange(20, VOCAB) for _ in range(rng.randint(1, 10))]
        prompts.append([13, *p[:5]] if i % 7 == 3 else p)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 6)) for _ in prompts]
    good = [i for i, p in enumerate(prompts) if p[0] != 13]
    kw = dict(dtype="float32", max_model_len=64, block_size=4, max_num_seqs=16, max_num_batched_tokens=32,
              num_gpu_blocks_override=24)
    expected = {i: o.outputs[0].token_ids for i, o in zip(good, LLM(str(model_dir), **kw).generate(
        [{"prompt_token_ids": prompts[i]} for i in good], [params[i] for i in good], use_tqdm=False))}
    llm = LLM(str(model_dir), **kw)
    engine = llm.llm_engine
    calls = inject(llm, "execute", lambda ids: any(engine.scheduler.requests[i].prompt_token_ids[0] == 13
                                                   for i in ids if i in engine.scheduler.requests))
    rids = [engine.add_request(None, {"prompt_token_ids": p}, sp) for p, sp in zip(prompts, params)]
    finals = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step(final_only=True):
            finals[out.request_id] = out
    else:
        raise AssertionError(f"the engine did not finish: suspects {[r.request_id for r in engine.scheduler.suspects]}")
    assert calls["raised"] >= 2  # a step of several, then the poisoned request alone
    for i, rid in enumerate(rids):
        if i in expected:
            assert finals[rid].outputs[0].token_ids == expected[i], i
        else:
            assert finals[rid].outputs[0].finish_reason == "error"
    assert_idle(llm)
