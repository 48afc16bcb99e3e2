"""Property-based fuzzing of ``SamplingParams`` (issue #24, point 5): any value in any field.

Every field gets, at random, a value of its own type near its edges or an arbitrary one (ints
of any size, NaN and infinities, strings, None, lists, dicts, huge lists). Construction either
succeeds, and then the object holds only what a step can run (the checks the sampler relies
on), or raises ValueError/TypeError whose message names a field the draw set; never another
exception type. Derandomized, so that CI is reproducible.
"""

from __future__ import annotations

import dataclasses
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnserve.sampling_params import INT64_MAX, SamplingParams

FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.init]
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

big_ints = st.one_of(st.integers(), st.integers(-2**70, 2**70), st.sampled_from(
    [0, 1, -1, 2, INT64_MAX, INT64_MAX + 1, -INT64_MAX - 2, 10**19, 10**30, 2**64]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, -0.0, 1.0, 0.5, 1e-300, 1e300, math.nan, math.inf, -math.inf]))
odd_text = st.one_of(st.text(max_size=8), st.sampled_from(["", " ", "\x00", "\ud800", "a\udfff", "\U0010ffff"]))
scalars = st.one_of(st.none(), st.booleans(), big_ints, floats, odd_text,
                    st.binary(max_size=4))
huge_lists = st.builds(lambda n, v: [v] * n, st.integers(0, 200_000), st.one_of(big_ints, st.text(max_size=3)))
anything = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.tuples(inner, inner),
    st.dictionaries(st.one_of(st.text(max_size=4), big_ints), inner, max_size=3)), max_leaves=8)
deep_json = st.builds(lambda n, o, c: o * n + c * n, st.integers(1, 100_000), st.sampled_from(["[", '{"a":']),
                      st.sampled_from(["]", "}"]))  # nesting deeper than a parser's stack
anything = st.one_of(anything, huge_lists)



def _nested(depth: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


token_ids = st.lists(st.one_of(st.integers(0, 300), big_ints), max_size=6)
TYPED = {  # plausible values of each field's own type, so that valid draws happen too
    "n": st.integers(-2, 5), "temperature": floats, "top_p": floats, "top_k": big_ints, "min_p": floats,
    "presence_penalty": floats, "frequency_penalty": floats, "repetition_penalty": floats,
    "seed": st.one_of(st.none(), big_ints), "stop": st.one_of(odd_text, st.lists(odd_text)),
    "stop_token_ids": st.one_of(big_ints, token_ids), "include_stop_str_in_output": st.booleans(),
    "ignore_eos": st.booleans(), "max_tokens": st.one_of(st.none(), st.integers(-2, 40), big_ints),
    "min_tokens": st.integers(-2, 40), "logprobs": st.one_of(st.none(), st.integers(-1, 30)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(-1, 30)), "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(), "detokenize": st.booleans(),
    "logit_bias": st.dictionaries(st.one_of(st.integers(-5, 10**20), st.text(max_size=6)),
                                  st.one_of(floats, big_ints), max_size=3),
    "allowed_token_ids": token_ids, "bad_words": st.lists(odd_text, max_size=4),
    "truncate_prompt_tokens": st.one_of(st.none(), st.integers(-3, 10), big_ints),
    "structured_outputs": st.one_of(
        st.fixed_dictionaries({}, optional={"json": st.one_of(st.text(max_size=10), deep_json, st.builds(_nested, st.integers(1, 5000)), st.dictionaries(
            st.text(max_size=3), scalars, max_size=2)), "regex": anything, "choice": anything,
            "grammar": anything, "json_object": anything, "disable_any_whitespace": anything}),
        st.dictionaries(st.text(max_size=6), scalars, max_size=2)),
}
assert set(TYPED) == set(FIELDS), set(FIELDS) ^ set(TYPED)


@st.composite
def field_values(draw) -> dict:
    names = draw(st.lists(st.sampled_from(FIELDS), unique=True, max_size=5))
    return {n: draw(st.one_of(TYPED[n], anything) if draw(st.booleans()) else TYPED[n]) for n in names}


def _names_a_field(msg: str, fields: dict) -> bool:
    first = msg.split(" ", 1)[0].split(".", 1)[0].rstrip(":")
    return first in fields


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _assert_runnable(p: SamplingParams) -> None:
    """What the sampler and the scheduler take for granted of a constructed request."""
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        v = getattr(p, name)
        assert isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), (name, v)
    for name in ("n", "top_k", "min_tokens"):
        assert _is_int(getattr(p, name)) and abs(getattr(p, name)) <= INT64_MAX, name
    for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
        v = getattr(p, name)
        assert v is None or (_is_int(v) and abs(v) <= INT64_MAX), (name, v)
    assert p.n >= 1 and (p.max_tokens is None or p.max_tokens >= 1)
    assert isinstance(p.stop, list) and all(isinstance(s, str) and s for s in p.stop)
    for ids in (p.stop_token_ids, p.allowed_token_ids or []):
        assert isinstance(ids, list) and all(_is_int(t) and 0 <= t <= INT64_MAX for t in ids)
    if p.logit_bias is not None:
        assert all(_is_int(t) and 0 <= t <= INT64_MAX and math.isfinite(b) for t, b in p.logit_bias.items())
    for i in range(min(p.n, 3)):
        s = p.child_seed(i)
        assert s is None or 0 <= s <= INT64_MAX


@FUZZ
@given(field_values())
def test_sampling_params_accept_or_refuse_by_name(fields):
    try:
        params = SamplingParams(**fields)
    except (ValueError, TypeError) as e:
        assert _names_a_field(str(e), fields), f"{type(e).__name__} names no field of {sorted(fields)}: {e}"
        return
    _assert_runnable(params)
    _ = params.greedy, params.edits_logits  # properties a step reads


@settings(FUZZ, max_examples=100)
@given(st.sampled_from(FIELDS), anything)
def test_one_arbitrary_field(name, value):
    """One field at a time, anything in it (the error must name that very field)."""
    try:
        params = SamplingParams(**{name: value})
    except (ValueError, TypeError) as e:
        assert str(e).split(" ", 1)[0].split(".", 1)[0].rstrip(":") == name, e
        return
    _assert_runnable(params)


@settings(FUZZ, max_examples=60)
@given(st.sampled_from(["json", "regex", "choice", "grammar", "json_object"]),
       st.one_of(deep_json, st.builds(_nested, st.integers(1, 5000)), anything))
def test_structured_outputs_of_any_shape(kind, value):
    """A grammar of any shape, nested deeper than a parser's stack included, is accepted or a
    ValueError naming ``structured_outputs``."""
    try:
        params = SamplingParams(structured_outputs={kind: value})
    except (ValueError, TypeError) as e:
        assert str(e).startswith("structured_outputs"), e
        return
    assert params.structured_outputs.kind == kind and params.structured_outputs.cache_key()
