"""Jinja2, sandboxed: the only place templates are compiled or rendered.

* ``ImmutableSandboxedEnvironment`` + ``StrictUndefined``, autoescape off;
* the globals Jinja adds (``lipsum``, ``cycler``, ``joiner``, ``namespace``, ``dict``) are removed,
  so the classic escapes (``cycler.__init__.__globals__``) have nothing to start from; ``range``
  stays (the sandbox bounds it);
* attribute walks to ``_private``/dunder names raise ``SecurityError`` (sandbox) and are also
  refused when a runbook is loaded (``template_problems``);
* work and size are bounded, not only ``*`` and ``**`` (issue #14): the rendered output
  (``MAX_OUTPUT``, counted while it is produced), every intermediate string or list an operator,
  filter or string method would build (``~``, ``+``, ``*``, ``%``, ``format``, ``center``,
  ``indent``, ``replace``, ``join``, ``batch``, ``str.ljust``...; ``MAX_STRING``, ``MAX_ITEMS``,
  ``MAX_WIDTH``), template steps (loop iterations and lines, ``MAX_STEPS``), macro/recursion depth
  (``MAX_DEPTH``) and time (``MAX_SECONDS``). Steps, depth and time are counted by a trace function
  on the template's own code, active only while it renders (this thread). Exceeding any is a
  ``TemplateLimitError`` naming the bound; ``MemoryError`` and ``RecursionError`` become
  ``TemplateError`` too. A template with nothing but constants is rendered at load time, and
  constant sub-expressions of the others are evaluated, so a bound that is static is reported by
  ``runbook validate``;
* the context is ``params``, ``facts`` and ``baseline`` only, all plain read-only data
  (``facts_context``): no object with a method that could reach I/O is ever handed to a template.
  ``baseline`` has the shape of ``facts`` and holds the facts gathered when the plan was made
  (``Plan.baseline``), so a verification can compare "now" with "before" (``facts.host.cuda_processes``
  against ``baseline.host.cuda_processes``: no host CUDA job was killed).

Param values are data: they are inserted into the output, never rendered themselves.
"""

from __future__ import annotations

import functools
import re
import sys
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from types import FrameType, MappingProxyType
from typing import Any

import jinja2
from jinja2 import nodes as jnodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from engine.errors import RunbookError
from engine.facts import Facts
from engine.hostfacts import host_data

MAX_OUTPUT = 100_000  # characters of rendered output
MAX_STRING = 1_000_000  # characters of any string a template builds on the way
MAX_ITEMS = 100_000  # items of any list it builds
MAX_WIDTH = 10_000  # a format width/precision, a padding or indent width
MAX_STEPS = 200_000  # lines of template code run (each loop iteration is at least one)
MAX_DEPTH = 50  # nested macro / recursive loop calls
MAX_SECONDS = 2.0  # per render
_MAX_REPEAT = 100_000
_MAX_EXPONENT = 1000
_MAX_POWER_BITS = 100_000
_TEMPLATE_CODE = "<template>"  # the file name Jinja gives code compiled from strings
FACT_ROOTS = frozenset({"node_name", "node", "host", "objects", "errors", "now"})
BASELINE_ROOTS = frozenset({"node_name", "node", "host", "errors"})  # objects are not kept in plans
# Readings that change on their own (journal lines): never recorded as what a plan depends on.
# ``now`` (when the facts were gathered) is the clock's: a record of a time, never a fact a plan depends on.
VOLATILE_KEYS = frozenset({"journal_tail", "now"})


class TemplateError(RunbookError):
    """A template does not parse, refers to an undefined name, or tried something unsafe."""

    exit_code = 2

    def __init__(self, message: str, *, source: str = "") -> None:
        super().__init__(message)
        self.source = source


class TemplateLimitError(TemplateError):
    """A template exceeded a bound on work or size (output, string, list, width, steps, depth, time)."""


class _Exceeded(BaseException):
    """Raised inside a render when a bound is exceeded. A BaseException, so no ``except Exception``
    in Jinja's runtime or a filter can swallow it; ``render`` turns it into TemplateLimitError."""


def _limit(what: str) -> _Exceeded:
    return _Exceeded(what)


def text_size(value: Any, limit: int = MAX_STRING, _depth: int = 0) -> int:
    """About how many characters ``str(value)`` would have, without building it; stops counting
    once past ``limit`` (so a huge value costs no more than ``limit`` steps)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return value.bit_length() * 30103 // 100000 + 2
    if isinstance(value, float):
        return 24
    if isinstance(value, bytes | bytearray):
        return 4 * len(value) + 3
    if _depth > 100:
        raise _limit("data nested deeper than 100 levels")
    if isinstance(value, Mapping):
        total = 2
        for k, v in value.items():
            total += text_size(k, limit, _depth + 1) + text_size(v, limit, _depth + 1) + 4
            if total > limit:
                return total
        return total
    if isinstance(value, list | tuple | set | frozenset):
        total = 2
        for v in value:
            total += text_size(v, limit, _depth + 1) + 2
            if total > limit:
                return total
        return total
    if isinstance(value, range):
        return 30
    return 64  # Undefined, Markup-free objects of our context: short


def _check_text(value: Any, what: str, limit: int = MAX_STRING) -> None:
    if text_size(value, limit) > limit:
        raise _limit(f"{what} would be longer than {limit} characters")


_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")


def _check_printf(fmt: str, args: Any) -> None:
    """``'%0999999999d' % 1`` builds a gigabyte in one C call: bound widths and precisions first."""
    stars = 0
    for m in _PRINTF_SPEC.finditer(fmt):
        for part in m.groups():
            if part == "*":
                stars += 1
            elif part is not None and int(part) > MAX_WIDTH:
                raise _limit(f"format width {int(part)} exceeds {MAX_WIDTH}")
    if stars:
        values = args if isinstance(args, tuple) else (args,)
        if any(isinstance(v, int) and abs(v) > MAX_WIDTH for v in values):
            raise _limit(f"format width exceeds {MAX_WIDTH}")
    _check_text(fmt, "the format string")
    _check_text(args, "the formatted values")


def _check_width(width: Any, what: str) -> None:
    if isinstance(width, int) and width > MAX_WIDTH:
        raise _limit(f"{what} {width} exceeds {MAX_WIDTH}")
    if isinstance(width, str) and len(width) > MAX_WIDTH:
        raise _limit(f"{what} of {len(width)} characters exceeds {MAX_WIDTH}")


_STR_FORMAT_FIELD = re.compile(r"\d{5,}")  # a width or precision of 10,000 or more in a format spec


def _check_str_call(method: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Bound the str methods that grow a string: padding, zfill, expandtabs, replace, join, format."""
    target = getattr(method, "__wrapped__", method)
    owner = getattr(target, "__self__", None)
    if not isinstance(owner, str):
        return
    name = getattr(target, "__name__", "")
    values = [*args, *kwargs.values()]
    if name in ("center", "ljust", "rjust", "zfill", "expandtabs"):
        for v in values:
            _check_width(v, f"str.{name} width")
    elif name == "replace" and len(args) >= 2 and isinstance(args[1], str):
        count = args[2] if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0 else len(owner) + 1
        grow = max(0, len(args[1]) - (len(args[0]) if isinstance(args[0], str) else 0))
        if len(owner) + count * grow > MAX_STRING:
            raise _limit(f"str.replace would build more than {MAX_STRING} characters")
    elif name == "join" and args:
        items = list(args[0]) if not isinstance(args[0], list | tuple | str) else args[0]
        if text_size(items) + len(owner) * len(items) > MAX_STRING:
            raise _limit(f"str.join would build more than {MAX_STRING} characters")
    elif name in ("format", "format_map"):
        if any(int(w) > MAX_WIDTH for w in _STR_FORMAT_FIELD.findall(owner)):
            raise _limit(f"format width exceeds {MAX_WIDTH}")
        _check_text(values, "the formatted values")


def _bounded_concat(parts: tuple[Any, ...]) -> str:
    """``a ~ b``: like Jinja's ``str_join``, refusing a result longer than MAX_STRING."""
    _check_text(list(parts), "a ~ concatenation")
    return "".join(str(p) for p in parts)


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles ``~`` to ``environment.bounded_concat`` (Jinja's own ``str_join`` has no bound)."""

    def visit_Concat(self, node: jnodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "+", "%"])
    code_generator_class = _BoundedCodeGenerator

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        # Why: 'x' * 10**9 or 9**9**9 would exhaust memory/CPU inside a "safe" sandbox.
        if operator == "**":
            if isinstance(right, int | float) and abs(right) > _MAX_EXPONENT:
                raise jinja2.sandbox.SecurityError("exponent too large")
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                    and left.bit_length() * right > _MAX_POWER_BITS:
                raise jinja2.sandbox.SecurityError("power too large")
            return left**right
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple | bytes) and isinstance(n, int) and len(seq) * n > _MAX_REPEAT:
                    raise jinja2.sandbox.SecurityError("repetition too large")
            return left * right
        if operator == "+":
            if isinstance(left, str | bytes) and isinstance(right, str | bytes) and \
                    len(left) + len(right) > MAX_STRING:
                raise _limit(f"a + concatenation would be longer than {MAX_STRING} characters")
            if isinstance(left, list | tuple) and isinstance(right, list | tuple) and \
                    len(left) + len(right) > MAX_ITEMS:
                raise _limit(f"a + concatenation would have more than {MAX_ITEMS} items")
            return left + right
        if operator == "%" and isinstance(left, str):
            _check_printf(left, right)
            return left % right
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_str_call(__obj, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


def _bounded_filters(env: jinja2.Environment) -> None:
    """Wrap the filters that can build large strings or lists with a check of their arguments."""
    f = env.filters

    def wrap(name: str, check: Callable[..., None]) -> None:
        original = f[name]

        @functools.wraps(original)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            # Jinja passes an eval context or the environment first to some filters (and to every
            # filter that has an async variant): the checks see the filter's own arguments.
            first = 1 if args and isinstance(args[0], jinja2.nodes.EvalContext | jinja2.Environment) else 0
            if len(args) > first and not isinstance(args[first], list | tuple | str | Mapping):
                # a generator (map, select...): its size is only known by consuming it, bounded
                args = (*args[:first], _bounded_list(args[first]), *args[first + 1:])
            check(*args[first:], **kwargs)
            return original(*args, **kwargs)

        f[name] = bounded

    def center(value: Any, width: int = 80) -> None:
        _check_width(width, "center width")

    def indent(s: Any, width: Any = 4, *_: Any, **__: Any) -> None:
        _check_width(width, "indent width")
        lines = str(s).count("\n") + 1 if isinstance(s, str) else 1
        w = width if isinstance(width, int) else len(str(width))
        if text_size(s) + lines * max(0, w) > MAX_STRING:
            raise _limit(f"indent would build more than {MAX_STRING} characters")

    def fmt(value: Any, *args: Any, **kwargs: Any) -> None:
        _check_printf(str(value), tuple(args) or kwargs)

    def replace(s: Any, old: Any, new: Any, count: Any = None) -> None:
        n = count if isinstance(count, int) and count >= 0 else text_size(s) + 1
        grow = max(0, text_size(new) - text_size(old))
        if text_size(s) + n * grow > MAX_STRING:
            raise _limit(f"replace would build more than {MAX_STRING} characters")

    def join(value: Any, d: Any = "", attribute: Any = None) -> None:
        if text_size(value) + text_size(d) * len(value) > MAX_STRING:
            raise _limit(f"join would build more than {MAX_STRING} characters")

    def count_arg(what: str) -> Callable[..., None]:
        def check(value: Any, n: Any = 1, *_: Any, **__: Any) -> None:
            if isinstance(n, int) and n > MAX_ITEMS:
                raise _limit(f"{what} {n} exceeds {MAX_ITEMS}")
        return check

    def total(iterable: Any, attribute: Any = None, start: Any = 0) -> None:
        if not isinstance(start, int | float):  # sum(start=[]) concatenates lists: quadratic
            raise _limit("sum only adds numbers")

    def whole(*args: Any, **kwargs: Any) -> None:
        _check_text(list(args), "the filter's result")

    def wordwrap(s: Any, width: Any = 79, break_long_words: Any = True,
                 wrapstring: Any = None, *_: Any, **__: Any) -> None:
        if isinstance(width, int) and width < 1:
            raise _limit("wordwrap width below 1")
        if wrapstring is not None and text_size(s) * (1 + text_size(wrapstring)) > MAX_STRING:
            raise _limit(f"wordwrap would build more than {MAX_STRING} characters")

    wrap("center", center)
    wrap("indent", indent)
    wrap("format", fmt)
    wrap("replace", replace)
    wrap("join", join)
    wrap("batch", count_arg("batch size"))
    wrap("slice", count_arg("slice count"))
    wrap("sum", total)
    wrap("wordwrap", wordwrap)
    for name in ("string", "pprint", "tojson", "list"):
        wrap(name, whole)


def _bounded_list(value: Any) -> Any:
    """A list of an iterable's items, refusing more than MAX_ITEMS; other values unchanged."""
    if isinstance(value, jinja2.Undefined | range) or not hasattr(value, "__iter__"):
        return value  # a range is small (the sandbox bounds it) and cheap to repeat
    items = []
    size = 0
    for item in value:
        items.append(item)
        kind = type(item)
        size += len(item) if kind is str else 8 if kind is int else text_size(item)
        if len(items) > MAX_ITEMS:
            raise _limit(f"more than {MAX_ITEMS} items")
        if size > MAX_STRING:
            raise _limit(f"items longer than {MAX_STRING} characters in all")
    return items


def _finalize(value: Any) -> Any:
    """Every ``{{ value }}`` before it becomes text: refuse a value whose text is too long."""
    _check_text(value, "an output value", MAX_OUTPUT)
    return value


@functools.cache
def environment() -> jinja2.Environment:
    env = _Sandbox(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True,
                   finalize=_finalize)
    for name in ("lipsum", "cycler", "joiner", "namespace", "dict"):
        env.globals.pop(name, None)
    env.bounded_concat = _bounded_concat  # type: ignore[attr-defined]
    _bounded_filters(env)
    return env


class _Budget:
    """Counts the lines and nested calls of template code (``<template>`` frames only) and the time
    of one render; raises ``_Exceeded`` past a bound. Installed with ``sys.settrace`` for one render."""

    def __init__(self) -> None:
        self.steps = 0
        self.depth = 0
        self.deadline = time.monotonic() + MAX_SECONDS

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code.co_filename == _TEMPLATE_CODE:
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise _limit(f"macro or recursive loop calls nested deeper than {MAX_DEPTH}")
            return self._local
        return None

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self.steps += 1
            if self.steps > MAX_STEPS:
                raise _limit(f"more than {MAX_STEPS} template steps (loop iterations)")
            if not self.steps & 1023 and time.monotonic() > self.deadline:
                raise _limit(f"rendering took longer than {MAX_SECONDS:g}s")
        elif event == "return":
            self.depth -= 1
        return self._local


def _bounded(work: Callable[[], Any]) -> Any:
    """Run ``work`` (a render or an evaluation) under a fresh budget, in this thread."""
    previous = sys.gettrace()
    sys.settrace(_Budget())
    try:
        return work()
    finally:
        sys.settrace(previous)


def _stream(template: jinja2.Template, context: Mapping[str, Any]) -> str:
    parts: list[str] = []
    size = 0
    for chunk in template.generate(**context):
        size += len(chunk)
        if size > MAX_OUTPUT:
            raise _limit(f"output longer than {MAX_OUTPUT} characters")
        parts.append(chunk)
    return "".join(parts)


@functools.lru_cache(maxsize=2048)
def _compile_template(source: str) -> jinja2.Template:
    return environment().from_string(source)


@functools.lru_cache(maxsize=1024)
def _compile_expression(source: str) -> Any:
    return environment().compile_expression(source, undefined_to_none=False)


@functools.lru_cache(maxsize=2048)
def _loops(source: str, expression: bool = False) -> bool:
    """Whether a template can repeat work (a loop, a macro, a call block): only those pay for the
    step/depth/time trace (~50 us a render); the size bounds apply to every template."""
    try:
        ast = environment().parse("{{ " + source + " }}" if expression else source)
    except (jinja2.TemplateSyntaxError, RecursionError, MemoryError):
        return True
    return ast.find((jnodes.For, jnodes.Macro, jnodes.CallBlock)) is not None  # type: ignore[arg-type]


def _shown(source: str) -> str:
    return repr(source if len(source) <= 200 else source[:200] + "...")


def render(source: str, context: Mapping[str, Any]) -> str:
    """Render a template string. Any failure (syntax, undefined, security, a bound) is a TemplateError."""
    return _guarded("template", source, lambda: _stream(_compile_template(source), context),
                    budget=_loops(source))


def evaluate_expression(source: str, context: Mapping[str, Any]) -> Any:
    """Evaluate a bare Jinja2 expression (``expr`` checks). Failures are TemplateError."""

    def work() -> Any:
        value = _compile_expression(source)(**context)
        if isinstance(value, jinja2.Undefined):
            str(value)  # StrictUndefined raises here, with the name that was missing
        return value

    return _guarded("expression", source, work, budget=_loops(source, expression=True))


def _guarded(kind: str, source: str, work: Callable[[], Any], *, budget: bool = True) -> Any:
    try:
        return _bounded(work) if budget else work()
    except _Exceeded as e:
        raise TemplateLimitError(f"{kind} {_shown(source)}: exceeds a bound: {e}", source=source) from None
    except SecurityError as e:
        limit = TemplateLimitError if "too large" in str(e) else TemplateError
        raise limit(f"{kind} {_shown(source)}: {_describe(e)}", source=source) from None
    except jinja2.TemplateError as e:
        raise TemplateError(f"{kind} {_shown(source)}: {_describe(e)}", source=source) from e
    except (MemoryError, RecursionError) as e:
        # never a traceback: the bounds above should stop the template first
        raise TemplateLimitError(f"{kind} {_shown(source)}: exceeds a bound: {type(e).__name__}",
                                 source=source) from None
    except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError, IndexError,
            OverflowError) as e:
        raise TemplateError(f"{kind} {_shown(source)}: {type(e).__name__}: {e}", source=source) from e


def _describe(e: jinja2.TemplateError) -> str:
    if isinstance(e, jinja2.sandbox.SecurityError):
        return f"refused by the sandbox: {e}"
    if isinstance(e, jinja2.UndefinedError):
        return f"undefined: {e.message}"
    if isinstance(e, jinja2.TemplateSyntaxError):
        return f"syntax error: {e.message}"
    return f"{type(e).__name__}: {e}"


def render_value(value: Any, context: Mapping[str, Any]) -> Any:
    """Render every templated string inside a JSON-like value (dict keys included)."""
    from engine.model import is_template

    if isinstance(value, str):
        return render(value, context) if is_template(value) else value
    if isinstance(value, Mapping):
        return {render_value(k, context): render_value(v, context) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [render_value(v, context) for v in value]
    return value


# --------------------------------------------------------------------------------------------
# Context
# --------------------------------------------------------------------------------------------


def _frozen(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): _frozen(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


def facts_data(facts: Facts | None) -> dict[str, Any]:
    """Facts as plain JSON-like data (dicts, lists, scalars): the shape templates see as ``facts``."""
    if facts is None:
        return {}
    node: dict[str, Any] | None = None
    if facts.node is not None:
        n = facts.node
        node = {
            "name": n.name,
            "exists": n.exists,
            "ready": n.ready,
            "labels": dict(n.labels),
            "annotations": dict(n.annotations),
            "taints": [{"key": t.key, "value": t.value, "effect": t.effect} for t in n.taints],
            "conditions": {c.type: {"status": c.status, "reason": c.reason, "message": c.message}
                           for c in n.conditions},
            "capacity": dict(n.capacity),
            "allocatable": dict(n.allocatable),
            "unschedulable": n.unschedulable,
        }
    host: dict[str, Any] | None = None
    if facts.host is not None:
        host = host_data(facts.host)
    return {
        "node_name": facts.node_name,
        "node": node,
        "host": host,
        "objects": {k: [_plain(o) for o in v] for k, v in facts.objects.items()},
        "errors": [{"probe": e.probe, "message": e.message} for e in facts.errors],
        # when these facts were gathered (the injected clock), RFC 3339 UTC: what a runbook writes
        # into a record (gpu-fallen-off-bus's runbook.io/gpu-fallen-off-bus-at); None when unknown
        "now": (datetime.fromtimestamp(facts.gathered_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                if facts.gathered_at else None),
    }


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def facts_context(facts: Facts | None) -> Mapping[str, Any]:
    """Facts as plain, read-only data for templates (no methods that could reach anything)."""
    if facts is None:
        return MappingProxyType({})
    return _frozen(facts_data(facts))


def baseline_data(facts: Facts | None) -> dict[str, Any]:
    """What a plan keeps of its gathered facts as ``baseline`` (``Plan.baseline``): the node and the
    host, in the shape of ``facts``; object lists are left out (they can be large)."""
    data = facts_data(facts)
    return {k: v for k, v in data.items() if k in BASELINE_ROOTS}


def context(params: Mapping[str, Any], facts: Facts | None = None,
            baseline: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The whole template context: ``params``, ``facts`` and ``baseline`` (plan-time facts), nothing else.

    ``baseline`` is plain data (``baseline_data``); without one it is empty, so a template that
    reads it fails (and a check over it is unknown: fail closed)."""
    return {"params": MappingProxyType(dict(params)), "facts": facts_context(facts),
            "baseline": _frozen(dict(baseline or {}))}


# --------------------------------------------------------------------------------------------
# Static checks at load time
# --------------------------------------------------------------------------------------------


def template_problems(source: str, *, params: Mapping[str, Any], expression: bool = False,
                      extra_names: frozenset[str] = frozenset()) -> list[str]:
    """Problems of one template (or bare expression): syntax, unknown names, unsafe attributes.

    Allowed names: ``params.<declared>``, ``facts.<node_name|node|host|objects|errors>``,
    ``baseline.<node_name|node|host|errors>``, the sandbox's globals (``range``) and whatever the
    template itself binds (loop variables, set).
    """
    env = environment()
    try:
        if expression:
            parser_source = "{{ " + source + " }}"
            ast = env.parse(parser_source)
        else:
            ast = env.parse(source)
    except jinja2.TemplateSyntaxError as e:
        return [f"template syntax error: {e.message}"]
    except (RecursionError, MemoryError):
        return ["template nested too deeply to parse"]
    try:
        # Unknown filters and tests are only found when compiling: the code generator raises them,
        # so generating the Python source from the parsed tree is enough (no second parse, no
        # bytecode compilation: ~3 ms per template, most of `runbook validate`).
        env.compile(ast, raw=True)
    except jinja2.TemplateError as e:
        return [f"template error: {getattr(e, 'message', None) or e}"]
    except _Exceeded as e:  # Jinja folds constant expressions while compiling: the bounds apply
        return [f"template exceeds a bound: {e}"]
    except (RecursionError, MemoryError):
        return ["template nested too deeply to compile"]
    problems: list[str] = []
    from jinja2 import meta

    for f in ast.find_all(jnodes.Filter):
        if f.name == "attr":
            problems.append("template uses the 'attr' filter (attribute walks are not allowed)")
    for call in ast.find_all(jnodes.Call):
        callee = call.node
        if isinstance(callee, jnodes.Getattr) and callee.attr in ("format", "format_map"):
            # '{0.__class__}'.format(x) walks attributes inside the format string, where the
            # checks above cannot see them (the sandbox refuses it when rendered; this says so
            # at load time). The `format` filter (printf-style) formats without attribute access.
            problems.append(f"template calls str.{callee.attr} (format strings can walk attributes; "
                            "use the 'format' filter)")

    if not problems:
        problems += _static_bound_problems(env, ast)

    allowed = {"params", "facts", "baseline"} | set(env.globals) | set(extra_names)
    for name in sorted(meta.find_undeclared_variables(ast)):
        if name not in allowed:
            problems.append(f"template refers to undefined name {name!r} (only params and facts)")
    for node in ast.find_all((jnodes.Getattr, jnodes.Getitem)):
        attr = _attr_name(node)
        if attr is not None and attr.startswith("_"):
            problems.append(f"template accesses private attribute {attr!r}")
            continue
        target = getattr(node, "node", None)
        if isinstance(target, jnodes.Name) and attr is not None:
            if target.name == "params" and attr not in params:
                problems.append(f"template refers to undeclared param {attr!r}")
            elif target.name == "facts" and attr not in FACT_ROOTS:
                problems.append(f"template refers to unknown fact {attr!r} "
                                f"(facts has {', '.join(sorted(FACT_ROOTS))})")
            elif target.name == "baseline" and attr not in BASELINE_ROOTS:
                problems.append(f"template refers to unknown baseline fact {attr!r} "
                                f"(baseline has {', '.join(sorted(BASELINE_ROOTS))}; plans keep no object lists)")
    return problems


_RISKY = (jnodes.Filter, jnodes.Call, jnodes.Mul, jnodes.Mod, jnodes.Add, jnodes.Pow, jnodes.Concat)


def _constant(node: jnodes.Node, env: jinja2.Environment) -> bool:
    names = [node] if isinstance(node, jnodes.Name) else list(node.find_all(jnodes.Name))
    return all(n.name in env.globals for n in names) and not any(
        isinstance(n, jnodes.Filter) and n.node is None for n in [node, *node.find_all(jnodes.Filter)])


def _risky_constants(node: jnodes.Node, env: jinja2.Environment) -> list[jnodes.Node]:
    """The largest sub-expressions that build something (filters, calls, ``* % + ** ~``) and read
    nothing but constants and globals: their cost is known at load time."""
    if isinstance(node, _RISKY) and _constant(node, env):
        return [node]
    return [c for child in node.iter_child_nodes() for c in _risky_constants(child, env)]


_WIDTH_FILTERS = {"center": MAX_WIDTH, "indent": MAX_WIDTH, "batch": MAX_ITEMS, "slice": MAX_ITEMS}
_WIDTH_METHODS = ("center", "ljust", "rjust", "zfill", "expandtabs")


def _constant_widths(ast: jnodes.Template) -> list[str]:
    """Constant widths and format strings given to padding filters and methods, whatever the value."""
    problems = []
    for f in ast.find_all(jnodes.Filter):
        limit = _WIDTH_FILTERS.get(f.name)
        for arg in [*f.args, *(k.value for k in f.kwargs)]:
            if limit and isinstance(arg, jnodes.Const) and isinstance(arg.value, int) and arg.value > limit:
                problems.append(f"template exceeds a bound: {f.name} {arg.value} exceeds {limit}")
    for call in ast.find_all(jnodes.Call):
        if isinstance(call.node, jnodes.Getattr) and call.node.attr in _WIDTH_METHODS:
            for arg in call.args:
                if isinstance(arg, jnodes.Const) and isinstance(arg.value, int) and arg.value > MAX_WIDTH:
                    problems.append(f"template exceeds a bound: str.{call.node.attr} width {arg.value} "
                                    f"exceeds {MAX_WIDTH}")
    formats = [f.node for f in ast.find_all(jnodes.Filter) if f.name == "format"] + \
        [m.left for m in ast.find_all(jnodes.Mod)]
    for node in formats:
        if isinstance(node, jnodes.Const) and isinstance(node.value, str):
            for m in _PRINTF_SPEC.finditer(node.value):
                for part in m.groups():
                    if part and part.isdigit() and int(part) > MAX_WIDTH:
                        problems.append(f"template exceeds a bound: format width {int(part)} exceeds {MAX_WIDTH}")
    return problems


def _static_bound_problems(env: jinja2.Environment, ast: jnodes.Template) -> list[str]:
    """Bounds a template exceeds whatever its context: constant widths; a template of constants is
    rendered, the constant sub-expressions of the others evaluated, under the run time's bounds."""
    from jinja2 import meta

    widths = _constant_widths(ast)
    if widths:
        return widths[:1]

    if not meta.find_undeclared_variables(ast) - set(env.globals):
        trees: list[jnodes.Template] = [ast]
    else:
        trees = []
        for expr in _risky_constants(ast, env):
            tree = jnodes.Template([jnodes.Assign(jnodes.Name("_", "store"), expr)])
            tree.set_environment(env)
            tree.set_lineno(expr.lineno)
            trees.append(tree)
    for tree in trees:
        try:
            _bounded(lambda t=tree: _stream(env.from_string(t), {}))  # type: ignore[misc]
        except _Exceeded as e:
            return [f"template exceeds a bound: {e}"]
        except SecurityError as e:
            if "too large" in str(e):
                return [f"template exceeds a bound: {e}"]
        except (MemoryError, RecursionError) as e:
            return [f"template exceeds a bound: {type(e).__name__}"]
        except Exception:  # other errors depend on the run (or are reported above)
            continue
    return []


def _parse(source: str, expression: bool) -> jnodes.Template | None:
    try:
        return environment().parse("{{ " + source + " }}" if expression else source)
    except jinja2.TemplateSyntaxError:
        return None


def _chain(node: jnodes.Node) -> tuple[str, list[str]] | None:
    """``baseline.host.cuda_processes`` -> ("baseline", ["host", "cuda_processes"]); None otherwise."""
    parts: list[str] = []
    while isinstance(node, jnodes.Getattr | jnodes.Getitem):
        attr = _attr_name(node)
        if attr is None:
            return None
        parts.append(attr)
        node = node.node
    if not isinstance(node, jnodes.Name):
        return None
    return node.name, parts[::-1]


def names_used(source: str, *, expression: bool = False) -> set[str]:
    """The context names a template reads (``params``, ``facts``, ``baseline``)."""
    ast = _parse(source, expression)
    if ast is None:
        return set()
    from jinja2 import meta

    return set(meta.find_undeclared_variables(ast))


def baseline_paths(source: str, *, expression: bool = False) -> set[tuple[str, ...]]:
    """The longest constant paths into ``baseline`` a template reads: ``{("host", "cuda_processes")}``."""
    ast = _parse(source, expression)
    if ast is None:
        return set()
    chains = [c for n in ast.find_all((jnodes.Getattr, jnodes.Getitem)) if (c := _chain(n)) and c[0] == "baseline"]
    paths = {tuple(parts) for _, parts in chains if parts}
    # keep only maximal paths: ("host",) is implied by ("host", "cuda_processes")
    return {p for p in paths if not any(len(q) > len(p) and q[:len(p)] == p for q in paths)}


def objects_keys(source: str, *, expression: bool = False) -> set[str]:
    """Literal keys a template reads from ``facts.objects`` (``facts.objects['kubevirt.io/v1/...']`` or
    ``facts.objects.get('kubevirt.io/v1/...', [])``)."""
    ast = _parse(source, expression)
    if ast is None:
        return set()
    out: set[str] = set()
    for n in ast.find_all(jnodes.Getitem):
        c = _chain(n)
        if c is not None and c[0] == "facts" and len(c[1]) >= 2 and c[1][0] == "objects":
            out.add(c[1][1])
    for call in ast.find_all(jnodes.Call):  # facts.objects.get('key', [])
        target = call.node
        if isinstance(target, jnodes.Getattr) and target.attr == "get" and call.args \
                and isinstance(call.args[0], jnodes.Const) and isinstance(call.args[0].value, str):
            c = _chain(target.node)
            if c is not None and c == ("facts", ["objects"]):
                out.add(call.args[0].value)
    return out


def lookup(data: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    """The value at ``path`` in plain data, or None; volatile keys (journal lines) are dropped."""
    cur: Any = data
    for part in path:
        if isinstance(cur, Mapping) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list | tuple) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return None
    return _without_volatile(cur)


def _without_volatile(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _without_volatile(v) for k, v in value.items() if k not in VOLATILE_KEYS}
    if isinstance(value, list | tuple):
        return [_without_volatile(v) for v in value]
    return value


def _attr_name(node: jnodes.Node) -> str | None:
    if isinstance(node, jnodes.Getattr):
        return str(node.attr)
    if isinstance(node, jnodes.Getitem) and isinstance(node.arg, jnodes.Const) and isinstance(node.arg.value, str):
        return node.arg.value
    return None
