"""Jinja2, sandboxed: the only place templates are compiled or rendered.

* ``ImmutableSandboxedEnvironment`` + ``StrictUndefined``, autoescape off;
* the globals Jinja adds (``lipsum``, ``cycler``, ``joiner``, ``namespace``, ``dict``) are removed,
  so the classic escapes (``cycler.__init__.__globals__``) have nothing to start from; ``range``
  stays (the sandbox bounds it);
* attribute walks to ``_private``/dunder names raise ``SecurityError`` (sandbox) and are also
  refused when a runbook is loaded (``template_problems``);
* ``*`` and ``**`` are bounded so a template cannot allocate gigabytes;
* the context is ``params``, ``facts`` and ``baseline`` only, all plain read-only data
  (``facts_context``): no object with a method that could reach I/O is ever handed to a template.
  ``baseline`` has the shape of ``facts`` and holds the facts gathered when the plan was made
  (``Plan.baseline``), so a verification can compare "now" with "before" (``facts.host.cuda_processes``
  against ``baseline.host.cuda_processes``: no host CUDA job was killed).

Param values are data: they are inserted into the output, never rendered themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jinja2
from jinja2 import nodes as jnodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import RunbookError
from engine.facts import Facts

MAX_OUTPUT = 100_000
_MAX_REPEAT = 100_000
_MAX_EXPONENT = 1000
_MAX_POWER_BITS = 100_000
FACT_ROOTS = frozenset({"node_name", "node", "host", "objects", "errors"})
BASELINE_ROOTS = frozenset({"node_name", "node", "host", "errors"})  # objects are not kept in plans
# Readings that change on their own (journal lines): never recorded as what a plan depends on.
VOLATILE_KEYS = frozenset({"journal_tail"})


class TemplateError(RunbookError):
    """A template does not parse, refers to an undefined name, or tried something unsafe."""

    exit_code = 2

    def __init__(self, message: str, *, source: str = "") -> None:
        super().__init__(message)
        self.source = source


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**"])

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
                if isinstance(seq, str | list | tuple) and isinstance(n, int) and len(seq) * n > _MAX_REPEAT:
                    raise jinja2.sandbox.SecurityError("repetition too large")
            return left * right
        return super().call_binop(context, operator, left, right)


@functools.cache
def environment() -> jinja2.Environment:
    env = _Sandbox(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True)
    for name in ("lipsum", "cycler", "joiner", "namespace", "dict"):
        env.globals.pop(name, None)
    return env


@functools.lru_cache(maxsize=2048)
def _compile_template(source: str) -> jinja2.Template:
    return environment().from_string(source)


@functools.lru_cache(maxsize=1024)
def _compile_expression(source: str) -> Any:
    return environment().compile_expression(source, undefined_to_none=False)


def render(source: str, context: Mapping[str, Any]) -> str:
    """Render a template string. Any failure (syntax, undefined, security) is a TemplateError."""
    try:
        out = _compile_template(source).render(**context)
    except jinja2.TemplateError as e:
        raise TemplateError(f"template {source!r}: {_describe(e)}", source=source) from e
    except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError, IndexError,
            RecursionError, OverflowError) as e:
        raise TemplateError(f"template {source!r}: {type(e).__name__}: {e}", source=source) from e
    if len(out) > MAX_OUTPUT:
        raise TemplateError(f"template {source!r}: output longer than {MAX_OUTPUT} characters", source=source)
    return out


def evaluate_expression(source: str, context: Mapping[str, Any]) -> Any:
    """Evaluate a bare Jinja2 expression (``expr`` checks). Failures are TemplateError."""
    try:
        value = _compile_expression(source)(**context)
        if isinstance(value, jinja2.Undefined):
            str(value)  # StrictUndefined raises here, with the name that was missing
        return value
    except jinja2.TemplateError as e:
        raise TemplateError(f"expression {source!r}: {_describe(e)}", source=source) from e
    except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError, IndexError,
            RecursionError, OverflowError) as e:
        raise TemplateError(f"expression {source!r}: {type(e).__name__}: {e}", source=source) from e


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
        h = facts.host
        host = {
            "host": h.host,
            "swap_active": h.swap_active,
            "swap_devices": [{"name": d.name, "type": d.type, "size_bytes": d.size_bytes}
                             for d in h.swap_devices],
            "fstab_active_swap": list(h.fstab_active_swap),
            "unhandled_swap_sources": list(h.unhandled_swap_sources),
            "services": {k: {"name": s.name, "state": s.state, "journal_tail": s.journal_tail}
                         for k, s in h.services.items()},
            "gpus": [{"slot": g.slot, "vendor_device": g.vendor_device, "name": g.name, "driver": g.driver}
                     for g in h.gpus],
            "gpu_driver": h.gpu_driver,
            "cuda_processes": [{"pid": p.pid, "name": p.name} for p in h.cuda_processes],
            "cuda_process_count": len(h.cuda_processes),
        }
    return {
        "node_name": facts.node_name,
        "node": node,
        "host": host,
        "objects": {k: [_plain(o) for o in v] for k, v in facts.objects.items()},
        "errors": [{"probe": e.probe, "message": e.message} for e in facts.errors],
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
    try:
        # Unknown filters and tests are only found when compiling: the code generator raises them,
        # so generating the Python source from the parsed tree is enough (no second parse, no
        # bytecode compilation: ~3 ms per template, most of `runbook validate`).
        env.compile(ast, raw=True)
    except jinja2.TemplateError as e:
        return [f"template error: {getattr(e, 'message', None) or e}"]
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
