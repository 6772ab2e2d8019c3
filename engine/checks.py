"""Evaluate checks against facts (pure), predict facts, and say which probes checks need.

``evaluate`` answers three-valued: ``holds`` is True, False, or None when the check could not be
evaluated (a probe failed, a fact is missing, an expression errored). Callers decide what None
means, always failing closed: in preconditions and guards None blocks; in ``skip_if`` None means
"not done", so the step runs (and its guards, evaluated the same way, protect it).

Combinators use Kleene logic: ``all`` is False if any part is False, else None if any part is
unknown; ``any`` is True if any part is True, else None if any is unknown; ``not None`` is None.

``establish`` returns the facts as they will be once a check holds: planning applies it to the
verify checks of each changing step, so a later guard sees the predicted state. Where the
outcome is unknowable (an expression, a journal line) it returns the facts unchanged.

``CheckResult.reads`` maps stable fact paths to the values the decision read (``depends_on`` of a
plan). Volatile readings (journal tails, heartbeat times) are deliberately not recorded.

``baseline`` (every function takes it as a keyword) is the plan-time facts as plain data
(``Plan.baseline``): templates and ``expr`` checks read it as ``baseline.host.cuda_processes`` to
compare "now" with "when the plan was made". Without one, a check that reads it is unknown.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel

from engine.facts import (
    Condition,
    Facts,
    FileFacts,
    GpuDevice,
    HostFacts,
    NodeFacts,
    ServiceFacts,
    SwapDevice,
    Taint,
)
from engine.model import (
    AllCheck,
    AllocatableCheck,
    AnyCheck,
    CudaProcessesCheck,
    ExprCheck,
    FileCheck,
    FstabActiveSwapCheck,
    GpuDriverCheck,
    JournalContainsCheck,
    NodeConditionCheck,
    NodeExistsCheck,
    NodeLabelCheck,
    NodeReadyCheck,
    NodeTaintCheck,
    NotCheck,
    ObjectsCheck,
    ObjectsSpec,
    ServiceCheck,
    SwapActiveCheck,
    is_template,
)

# A check, once parsed: any of the check models (kept loose to avoid a huge Union alias).
CheckModel = BaseModel

NODE = "node"
HOST = "host"

NODE_CHECKS = (NodeExistsCheck, NodeReadyCheck, NodeLabelCheck, NodeTaintCheck, NodeConditionCheck,
               AllocatableCheck)
HOST_CHECKS = (SwapActiveCheck, FstabActiveSwapCheck, ServiceCheck, JournalContainsCheck, GpuDriverCheck,
               CudaProcessesCheck, FileCheck)


@dataclass(frozen=True)
class ObjectsQuery:
    """One list call: ``list_objects(api_version, plural, namespace=, label_selector=)``."""

    api_version: str
    plural: str
    namespace: str | None = None
    selector: str | None = None

    @property
    def key(self) -> str:
        """The key of its results in ``Facts.objects``."""
        out = f"{self.api_version}/{self.plural}"
        if self.namespace:
            out += f"?namespace={self.namespace}"
        if self.selector:
            out += ("&" if self.namespace else "?") + f"selector={self.selector}"
        return out

    @classmethod
    def of(cls, spec: ObjectsSpec) -> ObjectsQuery:
        return cls(spec.api_version, spec.plural_name, spec.namespace, spec.selector)

    @classmethod
    def from_key(cls, key: str) -> ObjectsQuery | None:
        """The query behind a ``Facts.objects`` key (``kubevirt.io/v1/virtualmachines?namespace=x``)."""
        path, _, query = key.partition("?")
        api_version, _, plural = path.rpartition("/")
        if not api_version or not plural:
            return None
        args: dict[str, str] = {}
        for part in query.split("&") if query else ():
            k, sep, v = part.partition("=")
            if not sep or k not in ("namespace", "selector"):
                return None
            args[k] = v
        q = cls(api_version, plural, args.get("namespace") or None, args.get("selector") or None)
        return q if q.key == key else None


@dataclass(frozen=True)
class HostFile:
    """A file the host probe must report on (passed to the facts playbook as ``runbook_files``)."""

    path: str


Probe = str | ObjectsQuery | HostFile  # NODE, HOST, an objects query, or a host file (implies HOST)


@dataclass(frozen=True)
class CheckResult:
    holds: bool | None
    observed: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    reads: Mapping[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """Fail closed: only a definite True passes."""
        return self.holds is True


# --------------------------------------------------------------------------------------------
# Quantities
# --------------------------------------------------------------------------------------------

_SUFFIX = {
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
    "P": Decimal("1e15"), "E": Decimal("1e18"),
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40),
    "Pi": Decimal(2**50), "Ei": Decimal(2**60),
}
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


def parse_quantity(value: str | int | float) -> Decimal:
    """A Kubernetes quantity (``"1"``, ``"500m"``, ``"4Gi"``, ``"1e3"``) -> Decimal; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, int | float):
        return Decimal(str(value))
    m = _QUANTITY.match(value.strip())
    if not m:
        raise ValueError(f"not a quantity: {value!r}")
    try:
        return Decimal(m.group(1)) * _SUFFIX[m.group(2) or ""]
    except InvalidOperation as e:
        raise ValueError(f"not a quantity: {value!r}") from e


# --------------------------------------------------------------------------------------------
# Binding templates
# --------------------------------------------------------------------------------------------


def _has_template(value: Any) -> bool:
    if isinstance(value, str):
        return is_template(value)
    if isinstance(value, ExprCheck):
        return False
    if isinstance(value, BaseModel):
        return any(_has_template(getattr(value, name)) for name in type(value).model_fields)
    if isinstance(value, Mapping):
        return any(_has_template(k) or _has_template(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_has_template(v) for v in value)
    return False


def _render_model(value: Any, ctx: Mapping[str, Any]) -> Any:
    from engine.templating import render, render_value

    if isinstance(value, str):
        return render(value, ctx) if is_template(value) else value
    if isinstance(value, ExprCheck):
        return value  # an expression is evaluated, not rendered
    if isinstance(value, BaseModel):
        update = {name: _render_model(getattr(value, name), ctx) for name in type(value).model_fields
                  if _has_template(getattr(value, name))}
        return value.model_copy(update=update) if update else value
    if isinstance(value, tuple):
        return tuple(_render_model(v, ctx) for v in value)
    if isinstance(value, Mapping | list):
        return render_value(value, ctx)
    return value


def bind(model: Any, params: Mapping[str, Any], facts: Facts | None = None, *,
         baseline: Mapping[str, Any] | None = None) -> Any:
    """The model (check or action) with its templated strings rendered. TemplateError on failure."""
    if not _has_template(model):
        return model
    from engine.templating import context

    return _render_model(model, context(params, facts, baseline))


# --------------------------------------------------------------------------------------------
# Describing checks
# --------------------------------------------------------------------------------------------


def describe(check: Any) -> str:
    """A short human text: ``label nvidia.com/gpu.workload.config = container``."""
    c = check
    s: Any  # the check's spec; its type depends on the branch
    if isinstance(c, NodeExistsCheck):
        return "node exists" if c.node_exists else "node does not exist"
    if isinstance(c, NodeReadyCheck):
        return "node is Ready" if c.node_ready else "node is not Ready"
    if isinstance(c, NodeLabelCheck):
        s = c.node_label
        if s.equals is not None:
            return f"label {s.key} = {s.equals}"
        return f"label {s.key} absent" if s.absent else f"label {s.key} present"
    if isinstance(c, NodeTaintCheck):
        s = c.node_taint
        what = f"{s.key}:{s.effect}" if s.effect else s.key
        return f"taint {what} {'present' if s.present else 'absent'}"
    if isinstance(c, NodeConditionCheck):
        return f"condition {c.node_condition.type} = {c.node_condition.status}"
    if isinstance(c, AllocatableCheck):
        if c.allocatable.equals_host_gpus:
            return f"allocatable {c.allocatable.resource} equals the host's NVIDIA GPUs"
        return f"allocatable {c.allocatable.resource} >= {c.allocatable.min}"
    if isinstance(c, ObjectsCheck):
        s = c.objects
        where = f" with {s.field} = {s.equals}" if s.field else ""
        ns = f" in {s.namespace}" if s.namespace else ""
        sel = f" matching {s.selector}" if s.selector else ""
        if s.resource:
            sel += f" asking for {s.resource}"
        if s.count is not None:
            bound = f"exactly {s.count}"
        elif s.min is not None and s.max is not None:
            bound = f"{s.min}..{s.max}"
        elif s.max is not None:
            bound = f"at most {s.max}"
        else:
            bound = f"at least {s.min if s.min is not None else 1}"
        return f"{bound} {s.kind}{ns}{sel}{where}"
    if isinstance(c, SwapActiveCheck):
        return "swap is on" if c.swap_active else "swap is off"
    if isinstance(c, FstabActiveSwapCheck):
        return "fstab has an active swap entry" if c.fstab_active_swap else "fstab has no active swap entry"
    if isinstance(c, ServiceCheck):
        return f"service {c.service.name} is {'|'.join(c.service.states)}"
    if isinstance(c, JournalContainsCheck):
        return f"journal of {c.journal_contains.unit} contains {c.journal_contains.text!r}"
    if isinstance(c, GpuDriverCheck):
        return f"every GPU's driver is {c.driver}" if c.every_gpu else f"GPU driver is {c.driver}"
    if isinstance(c, CudaProcessesCheck):
        s = c.cuda_processes
        parts = ([f">= {s.min}"] if s.min is not None else []) + ([f"<= {s.max}"] if s.max is not None else [])
        text = f"CUDA processes {' and '.join(parts)}" if parts else ""
        if s.none_killed:
            text = (text + "; " if text else "") + "no host CUDA process killed since the plan"
        return text
    if isinstance(c, FileCheck):
        f = c.file
        if f.contains is not None:
            return f"file {f.path} contains {f.contains!r}"
        return f"file {f.path} {'exists' if f.exists is not False else 'does not exist'}"
    if isinstance(c, ExprCheck):
        return f"expr {c.expr}"
    if isinstance(c, AllCheck):
        return "all(" + "; ".join(describe(x) for x in c.all_) + ")"
    if isinstance(c, AnyCheck):
        return "any(" + "; ".join(describe(x) for x in c.any_) + ")"
    if isinstance(c, NotCheck):
        return f"not({describe(c.not_)})"
    return type(c).__name__


def describe_bound(check: Any, params: Mapping[str, Any], facts: Facts | None = None, *,
                   baseline: Mapping[str, Any] | None = None) -> str:
    """``describe`` with the check's templates rendered (``label k = container``), when they render."""
    try:
        return describe(bind(check, params, facts, baseline=baseline))
    except Exception:  # a description never fails; the evaluation reports the error
        return describe(check)


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------


def _probe_error(facts: Facts, probe: str) -> str:
    for e in facts.errors:
        if e.probe == probe or e.probe.startswith(probe + ":"):
            return e.message
    return "not gathered"


def _unknown(what: str, facts: Facts, probe: str) -> CheckResult:
    msg = _probe_error(facts, probe)
    return CheckResult(None, f"{what} unknown: {msg}", {"error": msg, "probe": probe})


def _result(holds: bool, observed: str, reads: Mapping[str, Any] | None = None,
            **evidence: Any) -> CheckResult:
    return CheckResult(holds, observed, dict(evidence), dict(reads or {}))


def _taint_text(t: Taint) -> str:
    return f"{t.key}={t.value}:{t.effect}" if t.value else f"{t.key}:{t.effect}"


def evaluate(check: Any, facts: Facts, params: Mapping[str, Any] | None = None, *,
             baseline: Mapping[str, Any] | None = None) -> CheckResult:
    """Whether ``check`` holds in ``facts``. Pure; never raises for bad facts (holds=None instead)."""
    params = params or {}
    if _has_template(check):
        try:
            check = bind(check, params, facts, baseline=baseline)
        except Exception as e:  # a template that cannot render makes the check unknowable
            return CheckResult(None, f"could not render check: {e}", {"error": str(e)})
    try:
        return _evaluate(check, facts, params, baseline)
    except Exception as e:  # fail closed on anything unexpected in the facts
        return CheckResult(None, f"could not evaluate {describe(check)}: {type(e).__name__}: {e}",
                           {"error": str(e)})


def _evaluate(c: Any, facts: Facts, params: Mapping[str, Any], baseline: Mapping[str, Any] | None) -> CheckResult:
    if isinstance(c, AllCheck | AnyCheck | NotCheck):
        return _evaluate_combinator(c, facts, params, baseline)
    if isinstance(c, CudaProcessesCheck) and c.cuda_processes.none_killed:
        return _evaluate_cuda_survivors(c, facts, baseline)
    if isinstance(c, AllocatableCheck) and c.allocatable.equals_host_gpus:
        return _evaluate_allocatable_host_gpus(c, facts)
    if isinstance(c, NODE_CHECKS):
        return _evaluate_node(c, facts)
    if isinstance(c, HOST_CHECKS):
        return _evaluate_host(c, facts)
    if isinstance(c, ObjectsCheck):
        return _evaluate_objects(c, facts)
    if isinstance(c, ExprCheck):
        from engine.templating import TemplateError, context, evaluate_expression

        try:
            value = evaluate_expression(c.expr, context(params, facts, baseline))
        except TemplateError as e:
            return CheckResult(None, str(e), {"error": str(e)})
        holds = bool(value)
        return _result(holds, f"{c.expr} -> {value!r}"[:300], {f"expr[{c.expr}]": holds})
    raise TypeError(f"not a check: {c!r}")


def _evaluate_combinator(c: AllCheck | AnyCheck | NotCheck, facts: Facts,
                         params: Mapping[str, Any], baseline: Mapping[str, Any] | None) -> CheckResult:
    holds: bool | None
    if isinstance(c, NotCheck):
        r = evaluate(c.not_, facts, params, baseline=baseline)
        holds = None if r.holds is None else not r.holds
        return CheckResult(holds, f"not ({r.observed})", r.evidence, r.reads)
    parts = [evaluate(x, facts, params, baseline=baseline) for x in (c.all_ if isinstance(c, AllCheck) else c.any_)]
    values = [p.holds for p in parts]
    if isinstance(c, AllCheck):
        holds = False if False in values else (None if None in values else True)
    else:
        holds = True if True in values else (None if None in values else False)
    reads: dict[str, Any] = {}
    for p in parts:
        reads.update(p.reads)
    observed = "; ".join(p.observed for p in parts)
    return CheckResult(holds, observed, {"parts": [{"holds": p.holds, "observed": p.observed} for p in parts]},
                       reads)


def _evaluate_node(c: Any, facts: Facts) -> CheckResult:
    node = facts.node
    if node is None:
        return _unknown("node", facts, NODE)
    if isinstance(c, NodeExistsCheck):
        return _result(node.exists == c.node_exists,
                       f"node {node.name} {'exists' if node.exists else 'does not exist'}",
                       {"node.exists": node.exists})
    if not node.exists:
        return CheckResult(None, f"node {node.name} does not exist", {"error": "node does not exist"},
                           {"node.exists": False})
    s: Any
    if isinstance(c, NodeReadyCheck):
        cond = node.condition("Ready")
        if cond is None:
            detail = "no Ready condition"
        else:
            detail = f"Ready={cond.status}" + (f" ({cond.reason})" if cond.reason else "")
        return _result(node.ready == c.node_ready, detail, {"node.ready": node.ready})
    if isinstance(c, NodeLabelCheck):
        s = c.node_label
        value = node.labels.get(s.key)
        observed = f"label {s.key}={value}" if value is not None else f"label {s.key} absent"
        reads = {f"node.labels[{s.key}]": value}
        if s.equals is not None:
            return _result(value == s.equals, observed, reads)
        return _result((value is None) == bool(s.absent), observed, reads)
    if isinstance(c, NodeTaintCheck):
        s = c.node_taint
        matching = [t for t in node.taints if t.key == s.key and (s.effect is None or t.effect == s.effect)]
        texts = sorted(_taint_text(t) for t in node.taints if t.key == s.key)
        observed = f"taints {', '.join(texts)}" if texts else f"no taint {s.key}"
        return _result(bool(matching) == s.present, observed, {f"node.taints[{s.key}]": texts})
    if isinstance(c, NodeConditionCheck):
        s = c.node_condition
        cond = node.condition(s.type)
        status = cond.status if cond else "Unknown"
        return _result(status == s.status, f"{s.type}={status}" + (f" ({cond.reason})" if cond and cond.reason
                                                                     else ""),
                       {f"node.conditions[{s.type}]": status})
    if isinstance(c, AllocatableCheck):
        s = c.allocatable
        raw = node.allocatable.get(s.resource)
        reads = {f"node.allocatable[{s.resource}]": raw}
        have = parse_quantity(raw) if raw is not None else Decimal(0)
        want = parse_quantity(s.min)
        return _result(have >= want, f"allocatable {s.resource}={raw if raw is not None else 0}", reads)
    raise TypeError(f"not a node check: {c!r}")


def _evaluate_host(c: Any, facts: Facts) -> CheckResult:
    host = facts.host
    if host is None:
        return _unknown("host facts", facts, HOST)
    s: Any
    if isinstance(c, SwapActiveCheck):
        devices = ", ".join(d.name for d in host.swap_devices)
        observed = f"swap on: {devices}" if devices else "swap off"
        return _result(host.swap_active == c.swap_active, observed, {"host.swap_active": host.swap_active},
                       swap_devices=[d.name for d in host.swap_devices])
    if isinstance(c, FstabActiveSwapCheck):
        active = bool(host.fstab_active_swap)
        observed = ("fstab active swap: " + "; ".join(host.fstab_active_swap)) if active \
            else "no active swap entry in fstab"
        return _result(active == c.fstab_active_swap, observed, {"host.fstab_active_swap": active},
                       fstab_lines=list(host.fstab_active_swap))
    if isinstance(c, ServiceCheck):
        s = c.service
        svc = host.service(s.name)
        holds = svc.state in s.states
        return _result(holds, f"{s.name} is {svc.state}",
                       {f"host.services[{s.name}].state in [{'|'.join(s.states)}]": holds}, state=svc.state)
    if isinstance(c, JournalContainsCheck):
        s = c.journal_contains
        tail = host.service(s.unit).journal_tail
        holds = s.text in tail
        line = next((ln for ln in tail.splitlines() if s.text in ln), "")
        observed = f"{s.unit} journal: {line.strip()[:200]}" if holds else \
            f"{s.unit} journal does not contain {s.text!r}"
        return _result(holds, observed, None, journal_line=line.strip()[:500])  # volatile: no reads
    if isinstance(c, GpuDriverCheck):
        if c.every_gpu:
            return _evaluate_every_gpu_driver(c.driver, host)
        return _result(host.gpu_driver == c.driver, f"GPU driver {host.gpu_driver}",
                       {"host.gpu_driver": host.gpu_driver})
    if isinstance(c, CudaProcessesCheck):
        s = c.cuda_processes
        n = len(host.cuda_processes)
        holds = (s.min is None or n >= s.min) and (s.max is None or n <= s.max)
        return _result(holds, f"{n} CUDA process{'es' if n != 1 else ''}",
                       {f"host.cuda_processes ({describe(c)})": holds},
                       processes=[f"{p.pid} {p.name}" for p in host.cuda_processes][:20])
    if isinstance(c, FileCheck):
        f = c.file
        ff: FileFacts | None = host.files.get(f.path)
        if ff is None:
            return CheckResult(None, f"file {f.path} not gathered", {"error": "file not gathered"})
        want_exists = f.exists if f.exists is not None else True
        holds = ff.exists == want_exists
        reads: dict[str, Any] = {f"host.files[{f.path}].exists": ff.exists}
        if f.contains is not None:
            found = ff.exists and f.contains in ff.content
            holds = holds and found
            reads[f"host.files[{f.path}] contains {f.contains!r}"] = found
            observed = f"file {f.path} {'contains' if found else 'does not contain'} {f.contains!r}" \
                if ff.exists else f"file {f.path} does not exist"
        else:
            observed = f"file {f.path} {'exists' if ff.exists else 'does not exist'}"
        return _result(holds, observed, reads, sha256=ff.sha256)
    raise TypeError(f"not a host check: {c!r}")


def _gpu_text(g: GpuDevice) -> str:
    return f"{g.slot} {g.name} ({g.driver})" if g.name else f"{g.slot} {g.vendor_device} ({g.driver})"


def _evaluate_every_gpu_driver(driver: str, host: HostFacts) -> CheckResult:
    """``gpu_driver: {driver: D, all: true}``: every GPU the host lists is on D, and it lists one."""
    drivers = {g.slot: g.driver for g in host.gpus}
    reads = {"host.gpus[].driver": drivers}
    gpus = [{"slot": g.slot, "model": g.vendor_device, "name": g.name, "driver": g.driver} for g in host.gpus]
    if not host.gpus:
        return _result(False, "the host lists no NVIDIA GPU (lspci -nnk -d 10de:)", reads, gpus=gpus)
    off = host.gpus_not_on(driver)
    if not off:
        return _result(True, f"all {len(host.gpus)} GPU{'s' if len(host.gpus) != 1 else ''} on {driver}", reads,
                       gpus=gpus)
    return _result(False, f"GPUs not on {driver}: " + ", ".join(_gpu_text(g) for g in off), reads,
                   gpus=gpus, not_on_driver=[g.slot for g in off])


def _evaluate_allocatable_host_gpus(c: AllocatableCheck, facts: Facts) -> CheckResult:
    """``allocatable: {resource, equals_host_gpus: true}``: the node advertises as many as the host lists."""
    node, host = facts.node, facts.host
    if node is None:
        return _unknown("node", facts, NODE)
    if host is None:
        return _unknown("host facts", facts, HOST)
    if not node.exists:
        return CheckResult(None, f"node {node.name} does not exist", {"error": "node does not exist"},
                           {"node.exists": False})
    s = c.allocatable
    raw = node.allocatable.get(s.resource)
    have = parse_quantity(raw) if raw is not None else Decimal(0)
    n = len(host.gpus)
    reads = {f"node.allocatable[{s.resource}]": raw, "host.gpus": n}
    observed = (f"allocatable {s.resource} {raw if raw is not None else 0}, the host lists {n} NVIDIA "
                f"GPU{'s' if n != 1 else ''}")
    holds = have == n
    off = host.gpus_not_on("nvidia")
    if not holds and off:
        observed += "; not on nvidia: " + ", ".join(f"{g.slot} ({g.driver})" for g in off)
    return _result(holds, observed, reads, host_gpus=[g.slot for g in host.gpus],
                   not_on_nvidia=[g.slot for g in off])


def _evaluate_cuda_survivors(c: CudaProcessesCheck, facts: Facts, baseline: Mapping[str, Any] | None) -> CheckResult:
    """``cuda_processes: {none_killed: true}`` (and its min/max): the baseline's CUDA pids all still run."""
    bounds = c.cuda_processes
    before = ((baseline or {}).get("host") or {}).get("cuda_processes")
    if before is None:
        return CheckResult(None, "no baseline host facts to compare with (the plan kept none)",
                           {"error": "no baseline"})
    host = facts.host
    if host is None:
        return _unknown("host facts", facts, HOST)
    now = {p.pid for p in host.cuda_processes}
    gone = [p for p in before if int(p.get("pid", -1)) not in now]
    pids = sorted(int(p.get("pid", -1)) for p in before)
    reads = {"baseline.host.cuda_processes": pids}
    n = len(host.cuda_processes)
    holds = not gone and (bounds.min is None or n >= bounds.min) and (bounds.max is None or n <= bounds.max)
    if gone:
        observed = "CUDA processes gone since the plan: " + ", ".join(f"{p.get('pid')} {p.get('name', '')}".strip()
                                                                      for p in gone)
    else:
        observed = f"{n} CUDA process{'es' if n != 1 else ''}; all {len(before)} from the plan still run"
    return _result(holds, observed, reads, killed=[f"{p.get('pid')} {p.get('name', '')}".strip() for p in gone],
                   processes=[f"{p.pid} {p.name}" for p in host.cuda_processes][:20])


def uses_baseline(check: Any) -> bool:
    """Whether a check compares with the plan's baseline (``cuda_processes: {none_killed: true}``);
    ``expr`` checks and templates reading ``baseline`` are found by ``planning.reads_baseline``."""
    return any(isinstance(x, CudaProcessesCheck) and x.cuda_processes.none_killed for x in iter_checks(check))


def field_value(obj: Mapping[str, Any], path: str) -> Any:
    """``status.printableStatus`` in a plain object mapping; None when absent."""
    cur: Any = obj
    for part in path.split("."):
        if isinstance(cur, Mapping) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list | tuple) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return None
    return cur


def _evaluate_objects(c: ObjectsCheck, facts: Facts) -> CheckResult:
    s = c.objects
    q = ObjectsQuery.of(s)
    objs = facts.objects.get(q.key)
    if objs is None:
        return _unknown(f"{s.kind} list", facts, f"objects:{q.key}")

    def name(o: Mapping[str, Any]) -> str:
        md = o.get("metadata") or {}
        return f"{md.get('namespace', '')}/{md.get('name', '?')}".lstrip("/")

    candidates = list(objs) if not s.resource else [o for o in objs if asks_for(o, s.resource)]
    matching = candidates if s.field is None else [o for o in candidates if field_value(o, s.field) == s.equals]
    n = len(matching)
    if s.count is not None:
        holds = n == s.count
    else:
        lo = s.min if s.min is not None else (0 if s.max is not None else 1)
        holds = n >= lo and (s.max is None or n <= s.max)
    where = (f" asking for {s.resource}" if s.resource else "") + (f" with {s.field}={s.equals}" if s.field else "")
    observed = f"{n} of {len(objs)} {s.kind}{where}"
    if matching:
        observed += ": " + ", ".join(name(o) for o in matching[:5]) + (" ..." if n > 5 else "")
    return _result(holds, observed, {f"objects[{q.key}]{where}": n}, matching=[name(o) for o in matching][:50])


def object_resources(obj: Mapping[str, Any]) -> dict[str, Decimal]:
    """Extended resources an object asks for, with quantities.

    * Pods (and pod templates of workload kinds): per container, its request or, where none is
      given, its limit (extended resources are often limit-only); summed over containers, at least
      the largest init container's (the scheduler's effective request).
    * KubeVirt VirtualMachines / VirtualMachineInstances: one per ``hostDevices`` / ``gpus`` entry,
      by ``deviceName`` (the launcher pod will request them).
    """
    spec = obj.get("spec") or {}
    template = (spec.get("template") or {}).get("spec") or {}
    out: dict[str, Decimal] = {}
    for pod_spec in (spec, template):
        for resource, qty in _pod_spec_requests(pod_spec).items():
            out[resource] = out.get(resource, Decimal(0)) + qty
        devices = ((pod_spec.get("domain") or {}).get("devices") or {})
        for entry in [*(devices.get("hostDevices") or ()), *(devices.get("gpus") or ())]:
            name = (entry or {}).get("deviceName") if isinstance(entry, Mapping) else None
            if name:
                out[str(name)] = out.get(str(name), Decimal(0)) + 1
    return out


def _pod_spec_requests(pod_spec: Mapping[str, Any]) -> dict[str, Decimal]:
    def container_requests(c: Mapping[str, Any]) -> dict[str, Decimal]:
        res = (c.get("resources") or {}) if isinstance(c, Mapping) else {}
        merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        out: dict[str, Decimal] = {}
        for k, v in merged.items():
            try:
                out[str(k)] = parse_quantity(v)
            except ValueError:
                continue
        return out

    total: dict[str, Decimal] = {}
    for c in pod_spec.get("containers") or ():
        for k, v in container_requests(c).items():
            total[k] = total.get(k, Decimal(0)) + v
    for c in pod_spec.get("initContainers") or ():
        for k, v in container_requests(c).items():
            total[k] = max(total.get(k, Decimal(0)), v)
    return total


def asks_for(obj: Mapping[str, Any], resource: str) -> bool:
    """Whether the object asks for ``resource`` (``object_resources``); finished pods hold nothing."""
    if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return False
    return object_resources(obj).get(resource, Decimal(0)) > 0


# --------------------------------------------------------------------------------------------
# Prediction
# --------------------------------------------------------------------------------------------


def establish(check: Any, facts: Facts, params: Mapping[str, Any] | None = None, *,
              baseline: Mapping[str, Any] | None = None) -> Facts:
    """The facts as they will be once ``check`` holds (identity where that is unknowable, e.g. an
    ``expr`` comparing with ``baseline``: planning never predicts from it)."""
    params = params or {}
    if _has_template(check):
        try:
            check = bind(check, params, facts, baseline=baseline)
        except Exception:
            return facts
    c = check
    if isinstance(c, AllCheck):
        for part in c.all_:
            facts = establish(part, facts, params, baseline=baseline)
        return facts
    if isinstance(c, ObjectsCheck):
        return _establish_objects(c, facts)
    if isinstance(c, AnyCheck | NotCheck | ExprCheck | JournalContainsCheck | NodeExistsCheck):
        return facts
    if isinstance(c, AllocatableCheck) and c.allocatable.equals_host_gpus:
        if facts.node is None or not facts.node.exists or facts.host is None:
            return facts
        alloc = {**facts.node.allocatable, c.allocatable.resource: str(len(facts.host.gpus))}
        return replace(facts, node=replace(facts.node, allocatable=MappingProxyType(alloc)))
    if isinstance(c, NODE_CHECKS):
        node = facts.node
        if node is None or not node.exists:
            return facts  # unknown stays unknown: predictions never turn an error into a pass
        return replace(facts, node=_establish_node(c, node))
    if isinstance(c, HOST_CHECKS):
        if facts.host is None:
            return facts
        return replace(facts, host=_establish_host(c, facts.host))
    return facts


def _establish_objects(c: ObjectsCheck, facts: Facts) -> Facts:
    """"No such object" (``max: 0`` / ``count: 0``) is predictable: the matching objects are gone (an
    evicted pod). Objects cannot be invented, so every other bound leaves the facts as they are."""
    s = c.objects
    if not (s.max == 0 or s.count == 0):
        return facts
    key = ObjectsQuery.of(s).key
    objs = facts.objects.get(key)
    if objs is None:
        return facts  # unknown stays unknown

    def matches(o: Mapping[str, Any]) -> bool:
        if s.resource and not asks_for(o, s.resource):
            return False
        return s.field is None or field_value(o, s.field) == s.equals

    kept = tuple(o for o in objs if not matches(o))
    return facts if len(kept) == len(objs) else replace(facts, objects={**facts.objects, key: kept})


def _set_condition(node: NodeFacts, type_: str, status: str) -> NodeFacts:
    others = tuple(c for c in node.conditions if c.type != type_)
    old = node.condition(type_)
    reason = "Predicted" if old is None or old.status != status else old.reason
    return replace(node, conditions=(*others, Condition(type_, status, reason=reason)))


def _establish_node(c: Any, node: NodeFacts) -> NodeFacts:
    s: Any
    if isinstance(c, NodeReadyCheck):
        return _set_condition(node, "Ready", "True" if c.node_ready else "False")
    if isinstance(c, NodeConditionCheck):
        return _set_condition(node, c.node_condition.type, c.node_condition.status)
    if isinstance(c, NodeLabelCheck):
        s = c.node_label
        labels = dict(node.labels)
        if s.equals is not None:
            labels[s.key] = s.equals
        elif s.absent:
            labels.pop(s.key, None)
        else:
            labels.setdefault(s.key, "")
        return node.with_labels(labels)
    if isinstance(c, NodeTaintCheck):
        s = c.node_taint
        if s.present:
            if any(t.key == s.key and (s.effect is None or t.effect == s.effect) for t in node.taints):
                return node
            return replace(node, taints=(*node.taints, Taint(s.key, s.effect or "NoSchedule")))
        kept = tuple(t for t in node.taints if not (t.key == s.key and (s.effect is None or t.effect == s.effect)))
        return replace(node, taints=kept)
    if isinstance(c, AllocatableCheck):
        s = c.allocatable
        raw = node.allocatable.get(s.resource)
        if raw is not None and parse_quantity(raw) >= parse_quantity(s.min):
            return node
        alloc = dict(node.allocatable)
        alloc[s.resource] = str(s.min)
        return replace(node, allocatable=MappingProxyType(alloc))
    return node


def _establish_host(c: Any, host: HostFacts) -> HostFacts:
    if isinstance(c, SwapActiveCheck):
        if c.swap_active == host.swap_active:
            return host
        return replace(host, swap_devices=(SwapDevice("(predicted)"),) if c.swap_active else ())
    if isinstance(c, FstabActiveSwapCheck):
        if c.fstab_active_swap == bool(host.fstab_active_swap):
            return host
        return replace(host, fstab_active_swap=("(predicted)",) if c.fstab_active_swap else ())
    if isinstance(c, ServiceCheck):
        s = c.service
        if host.service(s.name).state in s.states:
            return host
        services = dict(host.services)
        old = host.service(s.name)
        services[s.name] = ServiceFacts(s.name, s.states[0], journal_tail=old.journal_tail)
        return replace(host, services=services)
    if isinstance(c, GpuDriverCheck):
        if c.every_gpu:  # GPUs cannot be invented: a host that lists none stays so
            return replace(host, gpus=tuple(replace(g, driver=c.driver) for g in host.gpus))
        if not host.gpus or host.gpu_driver == c.driver:
            return host
        first = replace(host.gpus[0], driver=c.driver)
        return replace(host, gpus=(first, *host.gpus[1:]))
    if isinstance(c, FileCheck):
        f = c.file
        old_file = host.files.get(f.path)
        if f.exists is False:
            new = FileFacts(f.path, exists=False)
        else:
            content = old_file.content if old_file is not None and old_file.exists else ""
            if f.contains is not None and f.contains not in content:
                content = (content + ("\n" if content and not content.endswith("\n") else "") + f.contains)
            new = FileFacts(f.path, exists=True, content=content)
        if old_file == new:
            return host
        return replace(host, files={**host.files, f.path: new})
    if isinstance(c, CudaProcessesCheck):
        if c.cuda_processes.max is not None and len(host.cuda_processes) > c.cuda_processes.max:
            return replace(host, cuda_processes=host.cuda_processes[: c.cuda_processes.max])
        return host
    return host


# --------------------------------------------------------------------------------------------
# Probes a set of checks needs
# --------------------------------------------------------------------------------------------


def required_probes(checks: Iterable[Any], params: Mapping[str, Any] | None = None) -> set[Probe]:
    """Which probes (NODE, HOST, ObjectsQuery) are needed to evaluate ``checks``."""
    out: set[Probe] = set()
    for c in checks:
        _collect_probes(c, params or {}, out)
    return out


def _collect_probes(c: Any, params: Mapping[str, Any], out: set[Probe]) -> None:
    if isinstance(c, AllCheck):
        for x in c.all_:
            _collect_probes(x, params, out)
    elif isinstance(c, AnyCheck):
        for x in c.any_:
            _collect_probes(x, params, out)
    elif isinstance(c, NotCheck):
        _collect_probes(c.not_, params, out)
    elif isinstance(c, NODE_CHECKS):
        out.add(NODE)
        if isinstance(c, AllocatableCheck) and c.allocatable.equals_host_gpus:
            out.add(HOST)
    elif isinstance(c, FileCheck):
        out.add(HOST)
        path = c.file.path
        if is_template(path):
            try:
                path = bind(c, params).file.path
            except Exception:
                return
        out.add(HostFile(path))
    elif isinstance(c, HOST_CHECKS):
        out.add(HOST)
    elif isinstance(c, ObjectsCheck):
        spec = c.objects
        if _has_template(spec):
            try:
                spec = bind(spec, params)
            except Exception:
                return  # evaluation will report the render error (fails closed)
        out.add(ObjectsQuery.of(spec))
    elif isinstance(c, ExprCheck):
        src = c.expr
        if "facts" in src:
            wants_node = "node" in src
            wants_host = "host" in src
            if wants_node or not wants_host:
                out.add(NODE)
            if wants_host or not wants_node:
                out.add(HOST)


def template_probes(source: str) -> set[Probe]:
    """The probes a template (a report, a message) reads: the node, the host, and the object lists
    it names literally (``facts.objects['kubevirt.io/v1/virtualmachines']``)."""
    from engine.templating import objects_keys

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


def iter_checks(c: Any) -> Iterable[Any]:
    """The check and every check nested in it."""
    yield c
    if isinstance(c, AllCheck):
        for x in c.all_:
            yield from iter_checks(x)
    elif isinstance(c, AnyCheck):
        for x in c.any_:
            yield from iter_checks(x)
    elif isinstance(c, NotCheck):
        yield from iter_checks(c.not_)
