"""Property-based fuzzing of ``LLM.generate`` on a tiny engine (issue #24, point 5).

Random batches of prompts (token id lists with ids out of the vocabulary, empty ones, ones too
long for the context, strings with odd unicode and lone surrogates, prompt dicts, None, numbers)
with random sampling parameters that ``SamplingParams`` accepts, including those only the model
bounds (``logprobs`` or ``prompt_logprobs`` above the vocabulary, stop / allowed / biased token
ids outside it, truncation). ``generate`` either raises a ValueError (a clear one, naming the problem) before anything
is queued or returns one well-formed output per prompt; either way the engine is idle afterwards
(no request, every block free, the pool consistent), and a fixed seeded request gives exactly
its first output after the whole run. Derandomized, so that CI is reproducible.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnserve import LLM, SamplingParams
from tests.server.conftest import build_tiny_llama

VOCAB, MAX_LEN = 2048, 48
FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
REF_PROMPTS = [[5, 9, 12, 40, 1000], "the river"]
REF_PARAMS = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=2)

ids = st.one_of(st.integers(0, VOCAB - 1), st.integers(-3, VOCAB + 3), st.sampled_from([2**63, -2**63 - 1, 10**30]))
odd_text = st.one_of(st.text(max_size=16), st.sampled_from(
    ["", " ", "\x00", "\ud800", "a\udfff b", "\U0010ffff" * 3, "é" * 30, "<|im_start|>", "x" * 400]))
token_lists = st.one_of(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12), st.lists(ids, max_size=12),
                        st.integers(MAX_LEN - 2, MAX_LEN + 4).map(lambda n: [7] * n))
prompts = st.one_of(token_lists, token_lists, odd_text, st.fixed_dictionaries({"prompt_token_ids": token_lists}),
                    st.fixed_dictionaries({"prompt": odd_text}), st.sampled_from([None, 5, 1.5, {"text": "x"}, [1.5]]))
small_ids = st.lists(st.integers(0, VOCAB + 40), min_size=1, max_size=4)
PARAM_FIELDS = {
    "n": st.integers(1, 3), "temperature": st.sampled_from([0.0, 0.7, 1.0, 1.5]), "top_p": st.floats(0.05, 1.0),
    "top_k": st.sampled_from([-1, 0, 1, 5, VOCAB, VOCAB + 1, 2**63 - 1]), "min_p": st.floats(0.0, 1.0),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 5), "seed": st.integers(0, 2**63 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2), "stop_token_ids": small_ids,
    "ignore_eos": st.booleans(), "max_tokens": st.integers(1, 6), "min_tokens": st.integers(0, 3),
    "logprobs": st.sampled_from([0, 2, 20, VOCAB + 1, 10**6]), "prompt_logprobs": st.sampled_from([0, 3, VOCAB + 1]),
    "skip_special_tokens": st.booleans(), "logit_bias": st.dictionaries(st.integers(0, VOCAB + 40),
                                                                         st.floats(-100, 100), max_size=3),
    "allowed_token_ids": small_ids, "bad_words": st.lists(st.text(min_size=1, max_size=5), max_size=2),
    "truncate_prompt_tokens": st.sampled_from([-1, 1, 3, MAX_LEN, 10**6]),
}


@st.composite
def sampling_params(draw) -> SamplingParams:
    fields = draw(st.fixed_dictionaries({}, optional=PARAM_FIELDS))
    fields.setdefault("max_tokens", 4)
    fields["min_tokens"] = min(fields.get("min_tokens", 0), fields["max_tokens"])
    return SamplingParams(**fields)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = build_tiny_llama(tmp_path_factory.mktemp("tiny-fuzz"))
    return LLM(str(path), dtype="float32", max_model_len=MAX_LEN, max_num_seqs=8, num_gpu_blocks_override=48,
               block_size=4)


def _assert_idle(llm) -> None:
    engine = llm.llm_engine
    assert not engine.states and not engine.scheduler.requests and not engine.has_unfinished_requests()
    engine.kv_manager.check_integrity()
    pool = engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1, "blocks still held"


def _outputs(outs):
    return [[(c.token_ids, c.text, [None if lp is None else sorted(lp) for lp in (c.logprobs or [])])
             for c in o.outputs] for o in outs]


def test_fuzzed_generate_refuses_before_queueing_or_serves(llm):
    before = _outputs(llm.generate(REF_PROMPTS, REF_PARAMS, use_tqdm=False))

    @FUZZ
    @given(st.lists(st.tuples(prompts, sampling_params()), min_size=1, max_size=3))
    def run(batch):
        ps, params = [p for p, _ in batch], [sp for _, sp in batch]
        try:
            outs = llm.generate(ps, params, use_tqdm=False)
        except ValueError as e:  # PromptError among them; a TypeError from deep inside is no clear error
            assert str(e), "an error without a message"
            _assert_idle(llm)
            return
        assert len(outs) == len(ps)
        for out, sp in zip(outs, params):
            assert len(out.outputs) == sp.n
            for c in out.outputs:
                assert c.finish_reason in ("length", "stop"), (c.finish_reason, c.stop_reason)
                assert 1 <= len(c.token_ids) <= sp.max_tokens or (c.finish_reason == "stop" and not c.token_ids)
                assert all(0 <= t < VOCAB for t in c.token_ids)
                if sp.allowed_token_ids is not None and c.finish_reason == "length":
                    assert set(c.token_ids) <= set(sp.allowed_token_ids)
                for lp in c.logprobs or []:
                    assert all(math.isfinite(v.logprob) or v.logprob == -math.inf for v in lp.values())
        _assert_idle(llm)

    run()
    assert _outputs(llm.generate(REF_PROMPTS, REF_PARAMS, use_tqdm=False)) == before
