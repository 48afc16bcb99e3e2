"""The engine's delta mode (``LLMEngine.step(deltas=True)``, ``RequestState.to_delta``) against its
cumulative outputs, and ``merge_deltas`` (the engine process's outbox while the frontend is behind).

Every step of a few requests (logprobs, prompt logprobs, n=2, a stop string that cuts text
already sent): the engine's delta equals ``OutputEncoder``'s delta of ``to_output`` (the twin),
applying the deltas rebuilds exactly the cumulative outputs, and so does applying them merged
in any grouping of consecutive steps.
"""

from __future__ import annotations

import itertools
import pickle

from attnserve.engine.engine_process import Outbox
from attnserve.engine.output_deltas import OutputAssembler, OutputEncoder, merge_deltas
from attnserve.outputs import CompletionOutput, Logprob, RequestOutput
from attnserve.sampling_params import SamplingParams


def _stop_that_cuts_sent_text(engine) -> str:
    """Two characters of a greedy "hello world" that straddle a step's boundary (the first is
    sent a step before the second completes the stop string), found first in the text."""
    engine.add_request("probe", "hello world", SamplingParams(temperature=0.0, max_tokens=9))
    lengths, text = [], ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            lengths.append(len(text))
    for b in lengths:
        if 0 < b < len(text) and text.find(text[b - 1:b + 1]) == b - 1:
            return text[b - 1:b + 1]
    raise AssertionError(f"no step boundary to cut at in {text!r}")


def _requests(stop: str) -> list[tuple[str, object, SamplingParams]]:
    return [
        ("text", "hello world", SamplingParams(temperature=0.0, max_tokens=9)),
        ("logprobs", [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)),
        ("prompt-logprobs", [11, 12, 13, 14, 15], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)),
        ("n2", "hi there", SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=5, logprobs=1)),
        ("stop", "hello world", SamplingParams(temperature=0.0, max_tokens=9, stop=[stop])),
    ]


def test_engine_deltas_rebuild_its_outputs_step_by_step(reference):
    engine = reference.llm_engine
    stop = _stop_that_cuts_sent_text(engine)
    for rid, prompt, params in _requests(stop):
        engine.add_request(rid, prompt, params)
    encoder, assemblers = OutputEncoder(), {}
    outbox, merged_assemblers, latest = Outbox(), {}, {}
    cut_sent_text = False
    for step in itertools.count():
        if not engine.has_unfinished_requests():
            break
        deltas = []
        for state in engine._step(False):
            out, delta = state.to_output(), state.to_delta()
            assert delta == encoder.encode(out.request_id, out)  # the twin's delta, field by field
            sent = assemblers[out.request_id].completions[0].text if out.request_id in assemblers else ""
            cut_sent_text |= delta[3][0][2] < len(sent)
            delta = pickle.loads(pickle.dumps(delta, protocol=5))
            assert assemblers.setdefault(out.request_id, OutputAssembler(out.request_id)).apply(delta) == out
            deltas.append(delta)
            latest[out.request_id] = out
        outbox.add_deltas(deltas)
        if step % 3 == 2 or not engine.has_unfinished_requests():  # the sender takes every third step's
            outbox.flush(None)
            for delta in outbox.take().deltas:
                rid = delta[0]
                got = merged_assemblers.setdefault(rid, OutputAssembler(rid)).apply(delta)
                assert got == latest[rid]
    assert cut_sent_text, stop
    assert set(latest) == {"text", "logprobs", "prompt-logprobs", "n2", "stop"}
    assert all(out.finished for out in latest.values()) and latest["stop"].outputs[0].stop_reason == stop
    assert engine.step(deltas=True) == [] and len(encoder) == 0


def test_the_engine_step_gives_deltas(reference):
    """``step(deltas=True)``: the first delta carries the prompt, the last is finished."""
    engine = reference.llm_engine
    engine.add_request("d", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step(deltas=True)
    assert deltas[0][1] == (None, [5, 6, 7]) and all(d[1] is None for d in deltas[1:])
    assert [d[4] for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert sum(len(d[3][0][1]) for d in deltas) == 4


def _outputs() -> list[RequestOutput]:
    """A request's cumulative outputs, n=2: text that grows, is cut inside what the step before
    added, is cut before it, grows again; logprobs and prompt logprobs that grow."""
    texts = [("ab", "x"), ("abcd", "xy"), ("abc", "xyz"), ("a", "xyz!"), ("axyz", "xyz!?")]
    outs, prompt_logprobs = [], [None]
    for i, (t0, t1) in enumerate(texts):
        prompt_logprobs = prompt_logprobs + [{3 + i: Logprob(-0.5 - i, 1, "p")}] * (i % 2)
        completions = []
        for index, text in enumerate((t0, t1)):
            tokens = list(range(10 * index, 10 * index + i + 1))
            logprobs = [{t: Logprob(-1.0 * t, 1, None)} for t in tokens]
            last = i == len(texts) - 1
            completions.append(CompletionOutput(index, text, tokens, -2.0 * i, logprobs,
                                                "stop" if last else None, "s" if last else None))
        metrics = {"arrival_time": 1.0, "last_token_time": 2.0 + i}
        outs.append(RequestOutput("r", "p", [1, 2], prompt_logprobs, completions, i == len(texts) - 1, i, metrics))
    return outs


def test_merged_deltas_apply_as_the_deltas_in_order():
    """Every grouping of consecutive deltas (the sender blocked for some steps), merged within
    each group, rebuilds the output at each group's end."""
    outs = _outputs()
    for cuts in itertools.product((False, True), repeat=len(outs) - 1):
        encoder, assembler = OutputEncoder(), OutputAssembler("r")
        waiting = None
        for out, cut in zip(outs, (*cuts, True)):
            delta = encoder.encode(0, out)
            waiting = delta if waiting is None else merge_deltas(waiting, delta)
            if cut:
                assert assembler.apply(waiting) == out, cuts
                waiting = None


def test_the_outbox_drops_the_deltas_of_an_ended_request():
    outbox, encoder = Outbox(), OutputEncoder()
    outs = _outputs()
    outbox.add_deltas([encoder.encode(0, outs[0]), encoder.encode(1, outs[0])])
    outbox.add_deltas([encoder.encode(0, outs[1])])
    outbox.add_event(("forget", 0))
    outbox.flush(None)
    msg = outbox.take()
    assert [d[0] for d in msg.deltas] == [1] and msg.errors == []
