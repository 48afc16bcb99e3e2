"""The Jinja environment chat templates render in, and the bounds on a template nobody vetted.

Every chat template compiles in ``TemplateEnvironment``: Jinja's immutable sandbox (no
attribute access to internals, no mutation of lists and dicts) whose compiled code also calls
``tick()`` at the start of every block (each loop iteration, macro call, ``if`` branch) and
whose string concatenation (``~``), size-changing operators (``*``, ``+``, ``**``, ``%``),
method calls and filters go through checks. The checks do nothing unless the thread renders
under ``TemplateBounds`` (``bounded``): the model's own template and the operator's
``--chat-template`` render as before; a template sent in a request (``attnserve serve
--trust-request-chat-template``) renders bounded:

- time: ``tick`` raises once ``timeout_s`` has passed, so runaway loops and recursion stop
  (a thread cannot be killed; the template's own code stops itself);
- size: no value or output beyond ``max_output_chars`` characters (no integer beyond 2**65536).
  An operation that would build a larger string, list or integer is refused before it runs (``'x' * 10**9``, a
  ``replace`` or ``join`` that multiplies, a format width or any integer argument of a call or
  filter above the bound), and every call's result is checked after it; the output is
  produced with ``generate`` and counted as it grows.

A bound that is hit raises ``TemplateBoundsError`` (a ``TemplateError``, naming the bound).
Not here: choosing and loading templates (``tokenizer.py``), the server's limits
(``entrypoints/openai/protocol.py``'s ``ServerLimits``).
"""

from __future__ import annotations

import functools
import math
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.compiler import CodeGenerator, CompilerExit, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["TemplateBounds", "TemplateBoundsError", "TemplateEnvironment", "bounded", "render_bounded"]


_MAX_INT_BITS = 1 << 16  # integers a bounded template may build (Python prints at most 4300 digits)


class TemplateBoundsError(jinja2.TemplateError):
    """A template rendered under ``TemplateBounds`` went beyond one."""


@dataclass(frozen=True, slots=True)
class TemplateBounds:
    """How much one rendering of an untrusted template may take."""

    max_output_chars: int = 1 << 22  # the rendered prompt, and any value built on the way
    timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.max_output_chars, bool) or not isinstance(self.max_output_chars, int) \
                or self.max_output_chars < 1:
            raise ValueError(f"max_output_chars must be a positive integer, got {self.max_output_chars!r}")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be positive seconds, got {self.timeout_s!r}")


@dataclass(slots=True)
class _Active:
    deadline: float
    limit: int
    timeout_s: float


_active = threading.local()  # .bounds: the _Active of the rendering on this thread, or None


def _current() -> _Active | None:
    return getattr(_active, "bounds", None)


@contextmanager
def bounded(bounds: TemplateBounds | None) -> Iterator[None]:
    """Render under ``bounds`` on this thread while the block runs (None: unbounded)."""
    if bounds is None:
        yield
        return
    previous = _current()
    _active.bounds = _Active(time.monotonic() + bounds.timeout_s, bounds.max_output_chars, bounds.timeout_s)
    try:
        yield
    finally:
        _active.bounds = previous


def render_bounded(template: jinja2.Template, bounds: TemplateBounds | None, **variables: Any) -> str:
    """``template.render(**variables)``, under ``bounds`` when given: the output is built chunk
    by chunk and refused once longer than ``bounds.max_output_chars``."""
    if bounds is None:
        return template.render(**variables)
    with bounded(bounds):
        parts, size = [], 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > bounds.max_output_chars:
                raise TemplateBoundsError(f"the rendered template is longer than {bounds.max_output_chars} "
                                          "characters")
            parts.append(chunk)
        return "".join(parts)


def _too_large(what: str, limit: int) -> TemplateBoundsError:
    return TemplateBoundsError(f"{what} would be larger than the bound of {limit} characters")


def _check_ints(args: tuple, kwargs: dict, limit: int, what: str) -> None:
    """Widths, counts and repeats: an integer argument above the bound is refused."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit:
            raise _too_large(f"{what} with argument {value}", limit)


def _check_format(fmt: str, limit: int) -> None:
    """A format string whose widths or precisions exceed the bound (``'{:>999999999}'``)."""
    for digits in re.findall(r"\d+", fmt):
        if len(digits) > len(str(limit)) or int(digits) > limit:
            raise _too_large(f"a format with width {digits}", limit)


def _weight(value: Any, limit: int) -> int:
    """About the characters ``str(value)`` takes: string lengths, plus one per item, through
    nested lists, tuples, dicts and sets; the walk stops once past ``limit`` (a list that holds
    one long string many times weighs what printing it would cost)."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v)
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += len(v)
            stack.extend(v)
        elif isinstance(v, dict):
            total += len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
            total += v.bit_length() // 3
    return total


def _materialize(value: Any) -> Any:
    """An iterator (a ``map``, a generator) as a list, so that its size can be checked."""
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) or not hasattr(value, "__iter__"):
        return value
    return list(value)


def _check_replace(s: Any, new: Any, count: Any, limit: int) -> None:
    if isinstance(s, str) and isinstance(new, str):
        n = len(s) + 1 if not isinstance(count, int) or count < 0 else min(count, len(s) + 1)
        if len(s) + n * len(new) > limit:
            raise _too_large("a replace", limit)


def _check_join(sep: Any, items: Any, limit: int) -> None:
    if isinstance(items, (list, tuple)) and len(sep if isinstance(sep, str) else "") * len(items) \
            + _weight(items, limit) > limit:
        raise _too_large("a join", limit)


def _bounded_filter(name: str, fn: Any) -> Any:
    """Filter ``fn`` with the size checks of an active bound (a no-op without one)."""

    @functools.wraps(fn)  # keeps jinja's pass_context/pass_eval_context marker
    def checked(*args: Any, **kwargs: Any) -> Any:
        active = _current()
        if active is None:
            return fn(*args, **kwargs)
        limit = active.limit
        values = [a for a in args if not isinstance(a, (jinja2.runtime.Context, jinja2.nodes.EvalContext,
                                                        jinja2.Environment))]
        _check_ints(tuple(values), kwargs, limit, f"the {name} filter")
        if name == "replace" and len(values) >= 3:
            _check_replace(values[0], values[2], values[3] if len(values) > 3 else kwargs.get("count"), limit)
        elif name == "join" and values:
            i = args.index(values[0])
            args = (*args[:i], _materialize(values[0]), *args[i + 1:])
            _check_join(values[1] if len(values) > 1 else kwargs.get("d", ""), args[i], limit)
        elif name == "format" and values and isinstance(values[0], str):
            _check_format(values[0], limit)
        elif name == "indent" and values and isinstance(values[0], str):
            width = values[1] if len(values) > 1 else kwargs.get("width", 4)
            if isinstance(width, str) and len(width) * (values[0].count("\n") + 1) + len(values[0]) > limit:
                raise _too_large("an indent", limit)
        result = fn(*args, **kwargs)
        if _weight(result, limit) > limit:
            raise _too_large(f"the {name} filter's result", limit)
        return result

    return checked


class _TickingCodeGenerator(CodeGenerator):
    """Jinja's code generator, with ``environment.tick()`` opening every block and ``~``
    through ``environment.concat``."""

    def blockvisit(self, nodes: Any, frame: Frame) -> None:
        try:
            self.writeline("environment.tick()")  # where Jinja writes "pass"
            for node in nodes:
                self.visit(node, frame)
        except CompilerExit:
            pass

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            return super().visit_Concat(node, frame)
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class TemplateEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox chat templates compile in; bounded where a ``TemplateBounds`` is active."""

    code_generator_class = _TickingCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(finalize=self.finalize_output, **kwargs)
        self.filters = {name: _bounded_filter(name, fn) for name, fn in self.filters.items()}

    def tick(self) -> None:
        active = _current()
        if active is not None and time.monotonic() > active.deadline:
            raise TemplateBoundsError(f"rendering the template took longer than {active.timeout_s:g} s")

    def finalize_output(self, value: Any) -> Any:
        """Each ``{{ value }}`` before it becomes text: checked against the bound."""
        active = _current()
        if active is not None and _weight(value, active.limit) > active.limit:
            raise _too_large("an output value", active.limit)
        return value

    def concat(self, parts: tuple) -> str:
        active = _current()
        if active is not None and sum(_weight(p, active.limit) for p in parts) > active.limit:
            raise _too_large("a concatenation", active.limit)
        return "".join(p if isinstance(p, str) else str(p) for p in parts)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        active = _current()
        if active is not None:
            self._check_binop(operator, left, right, active.limit)
        return super().call_binop(context, operator, left, right)

    @staticmethod
    def _check_binop(op: str, left: Any, right: Any, limit: int) -> None:
        ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (left, right))
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) \
                        and max(_weight(seq, limit), 1) * n > limit:
                    raise _too_large(f"repeating a value of length {len(seq)} {n} times", limit)
            if ints and left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                raise TemplateBoundsError(f"an integer product of more than {_MAX_INT_BITS} bits")
        elif op == "+" and _weight(left, limit) + _weight(right, limit) > limit:
            raise _too_large("a sum", limit)
        elif op == "**" and ints and right > 0 and abs(left) > 1 and right * math.log2(abs(left)) > _MAX_INT_BITS:
            raise TemplateBoundsError(f"{left} ** {right} has more than {_MAX_INT_BITS} bits")
        elif op == "%" and isinstance(left, str):
            _check_format(left, limit)
            _check_ints(right if isinstance(right, tuple) else (right,), {}, limit, "a % format")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - as jinja's
        active = _current()
        if active is None:
            return super().call(__context, __obj, *args, **kwargs)
        limit = active.limit
        _check_ints(args, kwargs, limit, "a call")
        target = getattr(__obj, "__wrapped__", __obj)
        owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
        if isinstance(owner, str):
            if name in ("format", "format_map"):
                _check_format(owner, limit)
            elif name == "replace" and len(args) >= 2:
                _check_replace(owner, args[1], args[2] if len(args) > 2 else kwargs.get("count", -1), limit)
            elif name == "join" and args:
                args = (_materialize(args[0]), *args[1:])
                _check_join(owner, args[0], limit)
        result = super().call(__context, __obj, *args, **kwargs)
        if _weight(result, limit) > limit:
            raise _too_large(f"the result of {name or 'a call'}", limit)
        return result
