"""What every caller does with a check, whatever its kind: bind, describe, evaluate, predict,
say which probes it needs.

``evaluate`` answers three-valued: ``holds`` is True, False, or None when the check could not be
evaluated (a probe failed, a fact is missing, an expression errored). Callers decide what None
means, always failing closed: in preconditions and guards None blocks; in ``skip_if`` None means
"not done", so the step runs (and its guards, evaluated the same way, protect it).

``establish`` returns the facts as they will be once a check holds: planning applies it to the
verify checks of each changing step, so a later guard sees the predicted state. Where the
outcome is unknowable (an expression, a journal line) it returns the facts unchanged.

``CheckResult.reads`` maps stable fact paths to the values the decision read (``depends_on`` of a
plan). Volatile readings (journal tails, heartbeat times) are deliberately not recorded.

``baseline`` (every function takes it as a keyword) is the plan-time facts as plain data
(``Plan.baseline``): templates and ``expr`` checks read it as ``baseline.host.cuda_processes`` to
compare "now" with "when the plan was made". Without one, a check that reads it is unknown.

The kind-specific logic lives in the kinds (``engine.checks.node`` / ``host`` / ``objects`` /
``logic``); this module only dispatches to them, renders templates and fails closed. No I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel

from engine.checkkind import HOST, NODE, CheckKind, CheckResult, Env, ObjectsQuery, Probe, iter_checks
from engine.facts import Facts
from engine.model import is_template
from engine.templating import context, objects_keys, render, render_value


def has_template(value: Any) -> bool:
    """Whether a model (check, action, spec) or value holds a templated string to render."""
    if isinstance(value, str):
        return is_template(value)
    if isinstance(value, CheckKind) and not value.RENDERED:
        return False
    if isinstance(value, BaseModel):
        return any(has_template(getattr(value, name)) for name in type(value).model_fields)
    if isinstance(value, Mapping):
        return any(has_template(k) or has_template(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(has_template(v) for v in value)
    return False


def _render_model(value: Any, ctx: Mapping[str, Any]) -> Any:
    if isinstance(value, str):
        return render(value, ctx) if is_template(value) else value
    if isinstance(value, CheckKind) and not value.RENDERED:
        return value  # an expression is evaluated, not rendered
    if isinstance(value, BaseModel):
        update = {name: _render_model(getattr(value, name), ctx) for name in type(value).model_fields
                  if has_template(getattr(value, name))}
        return value.model_copy(update=update) if update else value
    if isinstance(value, tuple):
        return tuple(_render_model(v, ctx) for v in value)
    if isinstance(value, Mapping | list):
        return render_value(value, ctx)
    return value


def bind(model: Any, params: Mapping[str, Any], facts: Facts | None = None, *,
         baseline: Mapping[str, Any] | None = None) -> Any:
    """The model (check or action) with its templated strings rendered. TemplateError on failure."""
    if not has_template(model):
        return model
    return _render_model(model, context(params, facts, baseline))


def describe(check: CheckKind) -> str:
    """A short human text: ``label nvidia.com/gpu.workload.config = container``."""
    return check.describe()


def describe_bound(check: CheckKind, params: Mapping[str, Any], facts: Facts | None = None, *,
                   baseline: Mapping[str, Any] | None = None) -> str:
    """``describe`` with the check's templates rendered (``label k = container``), when they render."""
    try:
        return describe(bind(check, params, facts, baseline=baseline))
    except Exception:  # a description never fails; the evaluation reports the error
        return describe(check)


def evaluate(check: CheckKind, facts: Facts, params: Mapping[str, Any] | None = None, *,
             baseline: Mapping[str, Any] | None = None) -> CheckResult:
    """Whether ``check`` holds in ``facts``. Pure; never raises for bad facts (holds=None instead)."""
    params = params or {}
    if has_template(check):
        try:
            check = bind(check, params, facts, baseline=baseline)
        except Exception as e:  # a template that cannot render makes the check unknowable
            return CheckResult(None, f"could not render check: {e}", {"error": str(e)})
    try:
        return check.evaluate(facts, Env(params, baseline))
    except Exception as e:  # fail closed on anything unexpected in the facts
        return CheckResult(None, f"could not evaluate {describe(check)}: {type(e).__name__}: {e}",
                           {"error": str(e)})


def establish(check: CheckKind, facts: Facts, params: Mapping[str, Any] | None = None, *,
              baseline: Mapping[str, Any] | None = None) -> Facts:
    """The facts as they will be once ``check`` holds (identity where that is unknowable, e.g. an
    ``expr`` comparing with ``baseline``: planning never predicts from it)."""
    params = params or {}
    if has_template(check):
        try:
            check = bind(check, params, facts, baseline=baseline)
        except Exception:
            return facts
    return check.establish(facts, Env(params, baseline))


def uses_baseline(check: CheckKind) -> bool:
    """Whether a check compares with the plan's baseline (``cuda_processes: {none_killed: true}``);
    ``expr`` checks and templates reading ``baseline`` are found by ``planning.reads_baseline``."""
    return any(x.uses_baseline() for x in iter_checks(check))


def required_probes(checks: Iterable[CheckKind], params: Mapping[str, Any] | None = None) -> set[Probe]:
    """Which probes (NODE, HOST, ObjectsQuery, HostFile) are needed to evaluate ``checks``."""
    env = Env(params or {})
    out: set[Probe] = set()
    for c in checks:
        for x in iter_checks(c):
            out |= x.probes(env)
    return out


def template_probes(source: str) -> set[Probe]:
    """The probes a template (a report, a message) reads: the node, the host, and the object lists
    it names literally (``facts.objects['kubevirt.io/v1/virtualmachines']``)."""
    out: set[Probe] = set()
    if "facts.node" in source:
        out.add(NODE)
    if "facts.host" in source:
        out.add(HOST)
    for key in objects_keys(source):
        q = ObjectsQuery.from_key(key)
        if q is not None:
            out.add(q)
    return out
