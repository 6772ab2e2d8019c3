"""Jinja2, sandboxed: the only place templates are compiled or rendered.

* ``ImmutableSandboxedEnvironment`` + ``StrictUndefined``, autoescape off;
* the globals Jinja adds (``lipsum``, ``cycler``, ``joiner``, ``namespace``, ``dict``) are removed,
  so the classic escapes (``cycler.__init__.__globals__``) have nothing to start from; ``range``
  stays (the sandbox bounds it);
* attribute walks to ``_private``/dunder names raise ``SecurityError`` (sandbox) and are also
  refused when a runbook is loaded (``template_problems``);
* ``*`` and ``**`` are bounded so a template cannot allocate gigabytes;
* the context is ``params`` and ``facts`` only, both plain read-only data (``facts_context``):
  no object with a method that could reach I/O is ever handed to a template.

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


def facts_context(facts: Facts | None) -> Mapping[str, Any]:
    """Facts as plain, read-only data for templates (no methods that could reach anything)."""
    if facts is None:
        return MappingProxyType({})
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
    return _frozen({
        "node_name": facts.node_name,
        "node": node,
        "host": host,
        "objects": {k: [dict(o) for o in v] for k, v in facts.objects.items()},
        "errors": [{"probe": e.probe, "message": e.message} for e in facts.errors],
    })


def context(params: Mapping[str, Any], facts: Facts | None = None) -> dict[str, Any]:
    """The whole template context: ``params`` and ``facts``, nothing else."""
    return {"params": MappingProxyType(dict(params)), "facts": facts_context(facts)}


# --------------------------------------------------------------------------------------------
# Static checks at load time
# --------------------------------------------------------------------------------------------


def template_problems(source: str, *, params: Mapping[str, Any], expression: bool = False,
                      extra_names: frozenset[str] = frozenset()) -> list[str]:
    """Problems of one template (or bare expression): syntax, unknown names, unsafe attributes.

    Allowed names: ``params.<declared>``, ``facts.<node_name|node|host|objects|errors>``, the
    sandbox's globals (``range``) and whatever the template itself binds (loop variables, set).
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
    problems: list[str] = []
    from jinja2 import meta

    allowed = {"params", "facts"} | set(env.globals) | set(extra_names)
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
    return problems


def _attr_name(node: jnodes.Node) -> str | None:
    if isinstance(node, jnodes.Getattr):
        return str(node.attr)
    if isinstance(node, jnodes.Getitem) and isinstance(node.arg, jnodes.Const) and isinstance(node.arg.value, str):
        return node.arg.value
    return None
