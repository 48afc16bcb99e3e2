"""The engine end to end on the shipped tiny model (random weights): API shapes, stopping,
sampling options, errors, aborts and block accounting, with and without async scheduling."""

from __future__ import annotations

import random

import pytest

from attnserve import LLM, SamplingParams
from attnserve.engine.engine import PromptError
from attnserve.entrypoints.cli import main


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request):
    """Every test runs with and without async scheduling (the next step launched before the
    last one is read back), which must not change any output."""
    return LLM(max_model_len=256, block_size=8, async_scheduling=request.param)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def test_generate_shapes_and_logprobs(llm):
    outs = llm.generate(["def add(a, b):", {"prompt_token_ids": [5, 6, 7, 8]}],
                        greedy(max_tokens=6, logprobs=3, prompt_logprobs=2))
    assert len(outs) == 2
    a, b = outs
    assert b.prompt_token_ids == [5, 6, 7, 8] and b.prompt is None and a.prompt == "def add(a, b):"
    comp = a.outputs[0]
    assert len(comp.token_ids) == 6 and comp.finish_reason == "length"
    assert comp.text == llm.get_tokenizer().decode(comp.token_ids)
    assert len(comp.logprobs) == 6
    for tok, entry in zip(comp.token_ids, comp.logprobs):
        assert tok in entry and entry[tok].rank == 1  # greedy picks the top token
        assert 3 <= len(entry) <= 4
        assert all(isinstance(lp.decoded_token, str) for lp in entry.values())
    assert b.prompt_logprobs[0] is None and len(b.prompt_logprobs) == 4
    for pos in range(1, 4):
        assert b.prompt_token_ids[pos] in b.prompt_logprobs[pos]
    assert comp.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs)))


def test_greedy_is_deterministic_and_batch_independent(llm):
    p = greedy(max_tokens=8)
    alone = llm.generate("import os", p)[0].outputs[0].token_ids
    batched = llm.generate(["x = 1", "import os", "class A:"], p)[1].outputs[0].token_ids
    assert alone == batched


def test_seeded_sampling_reproducible_and_n(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=123, max_tokens=8, ignore_eos=True)
    a = llm.generate("hello", p)[0].outputs[0].token_ids
    b = llm.generate(["zzz", "hello"], p)[1].outputs[0].token_ids
    assert a == b
    many = llm.generate("hello", SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=8, ignore_eos=True))[0]
    assert [c.index for c in many.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in many.outputs}) > 1


def test_stop_strings_and_stop_tokens(llm):
    base = llm.generate("def f():", greedy(max_tokens=12))[0].outputs[0]
    text = base.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate("def f():", greedy(max_tokens=12, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = llm.generate("def f():", greedy(max_tokens=12, stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]
    tok = base.token_ids[4]
    out = llm.generate("def f():", greedy(max_tokens=12, stop_token_ids=[tok]))[0].outputs[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tok


def test_eos_and_min_tokens(llm):
    base = llm.generate("a", greedy(max_tokens=10))[0].outputs[0].token_ids
    eos = base[2]
    engine = llm.llm_engine
    saved = engine.arch
    object.__setattr__(saved, "eos_token_ids", (eos,))  # pretend that token is EOS
    try:
        p = SamplingParams(temperature=0.0, max_tokens=10)
        out = llm.generate("a", p)[0].outputs[0]
        assert out.token_ids == base[: base.index(eos) + 1] and out.finish_reason == "stop"
        out = llm.generate("a", SamplingParams(temperature=0.0, max_tokens=10, min_tokens=8))[0].outputs[0]
        assert eos not in out.token_ids[:8] and len(out.token_ids) >= 8
        out = llm.generate("a", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0].outputs[0]
        assert len(out.token_ids) == 10
    finally:
        object.__setattr__(saved, "eos_token_ids", ())


def test_bad_prompts_are_refused_and_nothing_is_queued(llm):
    engine = llm.llm_engine
    with pytest.raises(PromptError, match="max_model_len is 256"):
        llm.generate(["ok", {"prompt_token_ids": list(range(300))}], greedy(max_tokens=2))
    assert not engine.has_unfinished_requests()
    with pytest.raises(PromptError, match="empty"):
        llm.generate({"prompt_token_ids": []})
    with pytest.raises(PromptError, match="out of range"):
        llm.generate({"prompt_token_ids": [1, 10**6]})
    with pytest.raises(PromptError, match="must be integers"):
        llm.generate({"prompt_token_ids": [1, 2.5]})
    with pytest.raises(PromptError, match="must be integers"):  # the engine's own entry checks too
        engine.add_tokenized_request(None, None, [1, True], greedy(max_tokens=2))
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(TypeError, match="unknown engine option 'bogus'"):
        LLM(bogus=1)


def test_abort_frees_blocks_and_churn_keeps_integrity(llm):
    engine = llm.llm_engine
    rng = random.Random(0)
    ids = []
    for i in range(12):
        prompt = {"prompt_token_ids": [rng.randrange(3, 2000) for _ in range(rng.randrange(1, 40))]}
        ids.append(engine.add_request(f"churn{i}", prompt, greedy(max_tokens=rng.randrange(1, 12))))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.kv_manager.check_integrity()
        steps += 1
        if steps % 3 == 0:
            live = sorted(engine.states)
            if live:
                engine.abort_request(rng.choice(live))
                engine.kv_manager.check_integrity()
    pool = engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
    assert not engine.scheduler.requests


def test_final_only_steps_return_the_same_final_outputs(llm):
    # LLM.generate steps with final_only=True: no output for a request until it finishes, and
    # then the very output that the streaming steps end with
    engine = llm.llm_engine
    prompts = ["def f():", "import sys", "x = [", "class B:"]
    params = [greedy(max_tokens=n, logprobs=2, stop=[")"] if n == 9 else None) for n in (3, 9, 14, 6)]
    finals = []
    for final_only in (False, True):
        ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
        got = {}
        while engine.has_unfinished_requests():
            for out in engine.step(final_only=final_only):
                assert out.finished or not final_only
                got[out.request_id] = out
        finals.append([got[i] for i in ids])
    for a, b in zip(*finals):
        assert a.finished and b.finished
        assert a.outputs == b.outputs and a.prompt_token_ids == b.prompt_token_ids


def test_cli_generate_prints_completion_and_throughput(capsys):
    assert main(["generate", "--prompt", "def fibonacci(n):", "--max-tokens", "4", "--max-model-len", "128"]) == 0
    out = capsys.readouterr().out
    assert "def fibonacci(n):" in out and "Throughput:" in out and "generation" in out
