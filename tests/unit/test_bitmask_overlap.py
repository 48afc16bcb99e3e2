"""Structured output's bitmask is filled after the step's forward is launched (while the device
computes it) and applied just before sampling: the order is checked by recording the calls,
the tokens against the old order (bitmask filled before the launch) for constrained and
unconstrained requests mixed in one batch, seeded, with and without async scheduling (whose
constrained decodes run ahead, their sampling after the step before is back); and the runner's
two halves (``launch_forward``, ``sample``) refuse to be used out of order.
"""

from __future__ import annotations

import pytest
import torch

from attnserve import LLM, SamplingParams
from attnserve.core.step import GrammarBitmask
from attnserve.sampling_params import StructuredOutputsParams as Structured

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"enum": ["x", "y"]}}, "required": ["a", "b"]}
PROMPTS = ["def f(x):", "import os", "class A:", "x = {", "for i in range(", "# note"]
PARAMS = [
    SamplingParams(temperature=0.9, seed=1, max_tokens=24,
                   structured_outputs=Structured(json=SCHEMA, disable_any_whitespace=True)),
    SamplingParams(temperature=0.9, seed=2, max_tokens=12, ignore_eos=True),  # unconstrained
    SamplingParams(temperature=0.8, seed=3, max_tokens=16,
                   structured_outputs=Structured(regex=r"[a-z]{2,5}@[a-z]{2,3}\.(com|org)")),
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),  # unconstrained, greedy
    SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=Structured(choice=["yes", "no", "maybe"])),
    SamplingParams(temperature=1.0, seed=5, max_tokens=14, ignore_eos=True, logprobs=2),
]


def _summary(outs):
    return [(c.token_ids, c.finish_reason, None if c.logprobs is None else
             [{t: round(v.logprob, 5) for t, v in e.items()} for e in c.logprobs])
            for o in outs for c in o.outputs]


def _record(llm: LLM) -> list[str]:
    """Record the calls of the runner's two halves and of the bitmask's fill, in order."""
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    calls: list[str] = []
    for obj, name in ((runner, "launch_forward"), (runner, "sample"), (engine.structured, "fill_bitmask"),
                      (runner, "_inflight_row")):
        real = getattr(obj, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        setattr(obj, name, wrapped)
    return calls


def _check_order(calls: list[str]) -> None:
    steps = [c for c in calls if c != "_inflight_row"]
    fills = [i for i, c in enumerate(steps) if c == "fill_bitmask"]
    assert len(fills) >= 8 and steps.count("launch_forward") == steps.count("sample")
    # each fill runs between its step's forward launch and that step's sampling
    assert all(steps[i - 1] == "launch_forward" and steps[i + 1] == "sample" for i in fills), steps[:12]


def test_bitmask_is_filled_after_the_launch_and_tokens_match_the_serial_order():
    # the old order: the whole bitmask filled before the step is launched, plain steps
    serial_llm = LLM(max_model_len=128, block_size=8, async_scheduling=False)
    runner = serial_llm.llm_engine.runner
    real_launch, order = runner.launch, []

    def fill_first(output, grammar_bitmask=None):
        mask = grammar_bitmask(output) if grammar_bitmask is not None else None
        order.append("fill" if mask is not None else "none")
        return real_launch(output, lambda _: mask)

    runner.launch = fill_first
    serial = _summary(serial_llm.generate(PROMPTS, PARAMS))
    assert order.count("fill") >= 8
    assert all(reason == "stop" for i, (_, reason, _) in enumerate(serial) if i in (0, 2, 4)), serial

    llm = LLM(max_model_len=128, block_size=8, async_scheduling=False)
    calls = _record(llm)
    assert _summary(llm.generate(PROMPTS, PARAMS)) == serial
    _check_order(calls)
    assert calls.count("fill_bitmask") == order.count("fill")

    # async scheduling: constrained decodes run ahead of their last token (read on the device);
    # only their sampling waits for the step before, whose tokens advance the matchers first
    llm = LLM(max_model_len=128, block_size=8, async_scheduling=True)
    calls = _record(llm)
    assert _summary(llm.generate(PROMPTS, PARAMS)) == serial
    _check_order(calls)
    assert calls.count("_inflight_row") >= 8


def test_async_sampling_after_the_read_back_equals_sync():
    """Requests whose sampling reads host tokens, mixed: a grammar cut by a stop string (it ends
    while the next step is already launched), penalties with a grammar, min_tokens, bad words of
    several tokens, prompt logprobs (whose step waits before its launch), n = 2, seeded."""
    json_so = Structured(json=SCHEMA, disable_any_whitespace=True)
    params = [
        SamplingParams(temperature=0.9, seed=1, max_tokens=24, stop=['"b"'], structured_outputs=json_so),
        SamplingParams(temperature=0.9, seed=2, max_tokens=20, repetition_penalty=1.3, presence_penalty=0.5,
                       structured_outputs=Structured(regex=r"[a-z]{2,5}@[a-z]{2,3}\.(com|org)")),
        SamplingParams(temperature=0.0, max_tokens=10, min_tokens=6, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, bad_words=["import os"]),
        SamplingParams(temperature=0.7, seed=3, max_tokens=8, ignore_eos=True, prompt_logprobs=2, logprobs=1),
        SamplingParams(temperature=1.0, seed=4, max_tokens=16, n=2, structured_outputs=json_so),
    ]
    prompts = PROMPTS[:4] + ["import os\nimport sys", "x = {"]
    sync = LLM(max_model_len=128, block_size=8, async_scheduling=False).generate(prompts, params)
    llm = LLM(max_model_len=128, block_size=8, async_scheduling=True)
    calls = _record(llm)
    got = llm.generate(prompts, params)
    assert _summary(got) == _summary(sync)
    assert [o.prompt_logprobs for o in got] == [o.prompt_logprobs for o in sync]
    first = got[0].outputs[0]
    assert first.finish_reason == "stop" and first.stop_reason == '"b"', first
    assert calls.count("_inflight_row") >= 8


def test_runner_halves_refuse_the_wrong_order():
    llm = LLM(max_model_len=64, block_size=8, async_scheduling=True)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    engine.add_request("r", "def f(x):", SamplingParams(max_tokens=4, ignore_eos=True))
    first = engine.scheduler.schedule()
    handle = runner.launch_forward(first)
    with pytest.raises(RuntimeError, match="not sampled"):
        runner.collect(handle)
    # the next step's decode reads this step's sampled token on the device: not there yet
    with pytest.raises(RuntimeError, match="launched but not sampled"):
        runner.launch_forward(engine.scheduler.schedule())
    words = (engine.arch.vocab_size + 31) // 32
    with pytest.raises(ValueError, match="do not sample in this step"):
        runner.sample(handle, GrammarBitmask(("other",), torch.zeros(1, words, dtype=torch.int32)))
    with pytest.raises(ValueError, match="one row per request"):
        runner.sample(handle, GrammarBitmask(("r",), torch.zeros(2, words, dtype=torch.int32)))
    # only token 7 allowed: the sampler takes it
    mask = torch.zeros(1, words, dtype=torch.int32)
    mask[0, 0] = 1 << 7
    runner.sample(handle, GrammarBitmask(("r",), mask))
    with pytest.raises(RuntimeError, match="sampled already"):
        runner.sample(handle)
    assert runner.collect(handle).sampled == {"r": 7}
