"""Chat templates nobody vetted render bounded (issue #24): runaway work stops with a clear error.

Each probe (nested loops, string repetition, doubling, big integers, format widths, filters and
methods that multiply, recursion) is refused under ``TemplateBounds`` within the time bound plus
a little; the demo model's own template renders the same text bounded and unbounded; without a
bound nothing changes (a trusted template may build what it likes).
"""

from __future__ import annotations

import time

import pytest

from attnserve.presets import resolve_model_preset
from attnserve.template_sandbox import TemplateBounds
from attnserve.tokenizer import load_tokenizer

BOUNDS = TemplateBounds(max_output_chars=1 << 20, timeout_s=0.3)
MSGS = [{"role": "user", "content": "hello"}]

PROBES = {  # template: what the error names
    # writes as it loops: whichever bound it meets first stops it (the output cap on a fast machine)
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
                     ("longer than 0.3 s", "rendered template is longer")),
    "silent nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                            "longer than 0.3 s"),
    "string repetition": ("{{ 'x' * 10**10 }}", "larger than the bound"),
    "list repetition": ("{{ [['x' * 500000] * 100] * 10 }}", "larger than the bound"),
    "doubling": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                 "{% endfor %}", "concatenation"),
    "repeated squaring": ("{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}"
                          "{% endfor %}", "bits"),
    "power": ("{{ 10 ** 10000000 }}", "bits"),
    "format width": ("{{ '{:>999999999}'.format(1) }}", "format"),
    "percent width": ("{{ '%0*d' % (10**9, 1) }}", "format"),
    "center": ("{{ 'x'|center(10**9) }}", "center"),
    "ljust": ("{{ 'x'.ljust(10**9) }}", "call"),
    "replace": ("{{ ('x' * 100000)|replace('x', 'yy' * 100) }}", "replace"),
    "join": ("{{ (range(1000)|map('string')|list)|join('x' * 5000) }}", "join"),
    "output": ("{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}", "rendered template is longer"),
    "recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_preset("attnserve-tiny-llama"))


@pytest.mark.parametrize("name", list(PROBES))
def test_runaway_templates_stop(tok, name):
    template, says = PROBES[name]
    start = time.perf_counter()
    with pytest.raises(ValueError, match="chat template") as err:
        tok.apply_chat_template(MSGS, chat_template=template, bounds=BOUNDS)
    assert any(s in str(err.value) for s in ((says,) if isinstance(says, str) else says)), str(err.value)
    assert time.perf_counter() - start < BOUNDS.timeout_s + 0.5, name


def test_bounds_change_nothing_for_a_real_template(tok):
    msgs = [{"role": "system", "content": "be brief"}, *MSGS, {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "x " * 1000}]
    plain = tok.apply_chat_template(msgs)
    assert tok.apply_chat_template(msgs, bounds=BOUNDS) == plain
    small = "{% for m in messages %}{{ m.role ~ ': ' ~ m.content }}\n{% endfor %}{{ 'ab' * 3 }}{{ 2 ** 10 }}"
    assert tok.apply_chat_template(msgs, chat_template=small, bounds=BOUNDS) \
        == tok.apply_chat_template(msgs, chat_template=small)
    # unbounded, a template may build what it likes (the operator vetted it)
    assert len(tok.apply_chat_template(MSGS, chat_template="{{ 'x' * 2000000 }}")) == 2_000_000


def test_bounds_are_checked():
    for bad in ({"max_output_chars": 0}, {"max_output_chars": True}, {"timeout_s": 0}, {"timeout_s": float("nan")}):
        with pytest.raises(ValueError):
            TemplateBounds(**bad)
