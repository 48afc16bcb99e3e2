"""Structured output's bitmask is filled after the step's forward is launched (while the device
computes it) and applied just before sampling: the order is checked by recording the calls,
the tokens against the old order (bitmask filled before the launch) for constrained and
unconstrained requests mixed in one batch, seeded, with and without async scheduling; and the
runner's two halves (``launch_forward``, ``sample``) refuse to be used out of order.
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


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_bitmask_is_filled_after_the_launch_and_tokens_match_the_serial_order(async_scheduling):
    llm = LLM(max_model_len=128, block_size=8, async_scheduling=async_scheduling)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    calls: list[str] = []

    def record(obj, name):
        real = getattr(obj, name)

        def wrapped(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        setattr(obj, name, wrapped)

    for obj, name in ((runner, "launch_forward"), (runner, "sample"), (engine.structured, "fill_bitmask")):
        record(obj, name)
    overlapped = _summary(llm.generate(PROMPTS, PARAMS))
    fills = [i for i, c in enumerate(calls) if c == "fill_bitmask"]
    assert len(fills) >= 8 and calls.count("launch_forward") == calls.count("sample")
    # each fill runs between its step's forward launch and that step's sampling
    assert all(calls[i - 1] == "launch_forward" and calls[i + 1] == "sample" for i in fills), calls[:12]
    del runner.launch_forward, runner.sample, engine.structured.fill_bitmask

    # the old order: the whole bitmask filled before the step is launched
    real_launch = runner.launch
    order: list[str] = []

    def serial_launch(output, grammar_bitmask=None):
        mask = grammar_bitmask(output) if grammar_bitmask is not None else None
        order.append("fill" if mask is not None else "none")
        return real_launch(output, lambda _: mask)

    runner.launch = serial_launch
    serial = _summary(llm.generate(PROMPTS, PARAMS))
    assert order.count("fill") == len(fills)
    assert serial == overlapped
    constrained = [overlapped[i] for i in (0, 2, 4)]
    assert all(reason == "stop" for _, reason, _ in constrained), constrained


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
