"""Structured output (xgrammar) and the token-level sampling options on the engine, with the
shipped demo model: its text is Python-flavoured junk, so whatever is valid comes from the
grammar or the option.

JSON output parses and validates against its schema (``jsonschema``), regex output
fullmatches, choice output is one of the choices; a grammar holds with n > 1, under
preemption and with async scheduling (whose sampling waits for a constrained request's last
token); an unconstrained request in the same batch is untouched; a schema that does not
compile is refused before anything is queued, and compiled once however often it comes.
"""

from __future__ import annotations

import json
import re

import pytest

from attnserve import LLM, SamplingParams
from attnserve.engine.engine import PromptError
from attnserve.sampling_params import StructuredOutputsParams as Structured

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

# strings are bounded by a pattern: xgrammar 0.2.9 lets a maxLength string hold raw control
# characters, which strict JSON parsers refuse (docs/architecture.md)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z_ ]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
}
SMALL_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                "b": {"enum": ["x", "y"]}}, "required": ["a", "b"]}
REGEX = r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"
CHOICES = ["yes", "no", "not sure"]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=128, block_size=8)


def _json(**kw) -> Structured:
    return Structured(json=SCHEMA, disable_any_whitespace=True, **kw)


def test_json_regex_choice_hold_and_leave_other_rows_alone(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    params = [
        SamplingParams(temperature=0.9, seed=1, max_tokens=50, structured_outputs=_json()),
        SamplingParams(temperature=0.9, seed=2, max_tokens=30, structured_outputs=Structured(regex=REGEX)),
        SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=Structured(choice=CHOICES)),
        # any JSON object: this model nests them for ever, unless "}" (token 93) gets a push
        SamplingParams(temperature=0.9, seed=2, max_tokens=30, logit_bias={93: 3.0},
                       structured_outputs=Structured(json_object=True, disable_any_whitespace=True)),
        plain,
    ]
    prompts = ["def f(x):", "import os", "class A:", "x = {", "for i in range("]
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert all(o.finish_reason == "stop" for o in outs[:4]), [(o.text, o.finish_reason) for o in outs]
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert re.fullmatch(REGEX, outs[1].text)
    assert outs[2].text in CHOICES
    assert isinstance(json.loads(outs[3].text), dict)
    assert outs[4].token_ids == llm.generate(prompts[4], plain)[0].outputs[0].token_ids


def test_n_preemption_and_async_scheduling():
    """A small cache preempts (and recomputes) requests mid-grammar; under async scheduling a
    constrained decode runs ahead of its last token, its sampling waiting for that token and
    the matcher's advance: every output stays valid."""
    llm = LLM(max_model_len=32, block_size=4, num_gpu_blocks_override=10, async_scheduling=True)
    engine = llm.llm_engine
    inflight = []
    real = engine.runner._inflight_row
    engine.runner._inflight_row = lambda rid: inflight.append(rid) or real(rid)
    params = SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=20,
                            structured_outputs=Structured(json=SMALL_SCHEMA, disable_any_whitespace=True))
    outs = llm.generate(["def f(x):", "import os"], params)
    assert engine.scheduler.stats.num_preemptions > 0
    assert inflight  # constrained decodes ran ahead of their last token
    for c in (c for o in outs for c in o.outputs):
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SMALL_SCHEMA)


def test_stop_strings_and_errors(llm):
    out = llm.generate("def f(x):", SamplingParams(temperature=0.9, seed=1, max_tokens=60, stop=['"age"'],
                                                   structured_outputs=_json()))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == '"age"' and out.text.startswith('{"name":')
    engine = llm.llm_engine
    compiled = engine.structured.num_compiled
    llm.generate("x", SamplingParams(max_tokens=2, structured_outputs=_json()))  # compiled above
    assert engine.structured.num_compiled == compiled
    for bad, msg in ((Structured(json={"type": "objec"}), "json does not compile"),
                     (Structured(regex="[a-"), "regex does not compile"),
                     (Structured(grammar="root ::= "), "grammar does not compile")):
        with pytest.raises(PromptError, match=msg):
            llm.generate(["x", "y"], [SamplingParams(), SamplingParams(structured_outputs=bad)])
        assert not engine.has_unfinished_requests()


def test_logit_bias_allowed_bad_words_truncation(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tok = llm.get_tokenizer()
    prompt = tok.encode("import os\nimport sys\nimport re")
    base, forced, short, ref = llm.generate(
        ["def f(x):", "def f(x):", {"prompt_token_ids": prompt}, {"prompt_token_ids": prompt[-4:]}],
        [greedy, SamplingParams(**{**_fields(greedy), "logit_bias": {"300": 100}}),
         SamplingParams(**{**_fields(greedy), "truncate_prompt_tokens": 4}), greedy])
    base = base.outputs[0]
    assert forced.outputs[0].token_ids == [300] * 6
    assert short.prompt_token_ids == prompt[-4:] and short.outputs[0].token_ids == ref.outputs[0].token_ids
    # only the allowed ids; and a banned word (one the greedy output has) never appears
    allowed = [base.token_ids[0], 500, 600]
    word = tok.decode(base.token_ids[1:3]).lstrip()
    banned = tok.encode(word, add_special_tokens=False)
    kept, unbad = llm.generate(["def f(x):"] * 2, [SamplingParams(**{**_fields(greedy), "allowed_token_ids": allowed}),
                                                   SamplingParams(**{**_fields(greedy), "bad_words": [word]})])
    ids = kept.outputs[0].token_ids
    assert ids[0] == base.token_ids[0] and set(ids) <= set(allowed)
    ids = unbad.outputs[0].token_ids
    assert ids != base.token_ids and all(ids[i:i + len(banned)] != banned for i in range(len(ids)))


def _fields(p: SamplingParams) -> dict:
    return {k: getattr(p, k) for k in p.__dataclass_fields__ if not k.startswith("_")}


def test_byte_tokenizer_vocabulary():
    """A model without tokenizer.json (bytes): ids 0..255 are the bytes, the rest special."""
    from attnserve.engine.structured_output import StructuredOutputManager
    from attnserve.tokenizer import ByteTokenizer

    assert not StructuredOutputManager(None, 300, [299]).warm_up()  # no tokenizer: none
    manager = StructuredOutputManager(ByteTokenizer(300, eos_token_id=299), 300, [299])
    assert manager.warm_up()
    grammar = manager.grammar_for(Structured(choice=["ab", "c"]))
    assert grammar.advance(list(b"a")) is None
    row = manager.fill_bitmask([grammar])[0]
    allowed = [t for t in range(300) if (int(row[t // 32]) >> (t % 32)) & 1]
    assert allowed == [ord("b")]
    assert grammar.advance(list(b"ab") + [299]) is None and grammar.terminated
    assert manager.grammar_for(Structured(regex="[0-9]")).advance([ord("x")]) is not None


def test_json_whitespace_is_bounded_unless_disabled():
    """Issue 38: JSON allows at most MAX_JSON_WHITESPACE whitespace characters in each gap (the
    demo model otherwise writes newlines until max_tokens); disable_any_whitespace allows none
    beyond the one-line separators ", " and ": "."""
    from attnserve.engine.structured_output import MAX_JSON_WHITESPACE, StructuredOutputManager
    from attnserve.tokenizer import ByteTokenizer

    manager = StructuredOutputManager(ByteTokenizer(257, eos_token_id=256), 257, [256])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def accepts(text: str, **kw) -> bool:
        for params in (Structured(json=schema, **kw), Structured(json_object=True, **kw)):
            grammar = manager.grammar_for(params)
            if grammar.advance(list(text.encode()) + [256]) is not None or not grammar.terminated:
                return False
        return True

    ws = " \n\t "[:MAX_JSON_WHITESPACE]
    assert accepts('{"a":1}') and accepts(f'{{{ws}"a"{ws}:{ws}1{ws}}}')
    assert not accepts(' {"a":1}') and not accepts('{"a":1}\n')  # none around the value
    assert not accepts('{"a":' + " " * (MAX_JSON_WHITESPACE + 1) + "1}")
    assert not accepts('{"a":1' + "\n" * (MAX_JSON_WHITESPACE + 1) + "}")
    assert accepts('{"a": 1}', disable_any_whitespace=True)
    assert not accepts('{"a":\n1}', disable_any_whitespace=True)
    assert not accepts('{"a":  1}', disable_any_whitespace=True)
