"""Check kinds that read the node object (``facts.node``): exists, Ready, labels, taints,
conditions, allocatable (``equals_host_gpus`` compares it with the host's GPUs: the host too).

One class per kind: its spec, ``describe``, ``evaluate_node`` (against a node that exists),
``establish_node`` (the node once the check holds). ``NodeCheck`` does what they share: unknown
without node facts, unknown on a node that does not exist, predictions only for a node that does.
Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, model_validator

from engine.checkkind import (
    HOST,
    NODE,
    CheckKind,
    CheckResult,
    Env,
    FormatModel,
    Probe,
    Reads,
    register_check,
    result,
    unknown,
)
from engine.facts import Condition, Facts, HostFacts, NodeFacts, Taint
from engine.model import Duration, parse_duration
from engine.resources import parse_quantity


class NodeCheck(CheckKind):
    """A check over ``facts.node``. Subclasses implement ``evaluate_node`` and ``establish_node``."""

    READS: ClassVar[Reads] = "node"

    def evaluate(self, facts: Facts, env: Env) -> CheckResult:
        node = facts.node
        if node is None:
            return unknown("node", facts, NODE)
        if not node.exists:
            return CheckResult(None, f"node {node.name} does not exist", {"error": "node does not exist"},
                               {"node.exists": False})
        return self.evaluate_node(node)

    def evaluate_node(self, node: NodeFacts) -> CheckResult:
        raise NotImplementedError

    def establish(self, facts: Facts, env: Env) -> Facts:
        node = facts.node
        if node is None or not node.exists:
            return facts  # unknown stays unknown: predictions never turn an error into a pass
        return replace(facts, node=self.establish_node(node))

    def establish_node(self, node: NodeFacts) -> NodeFacts:
        return node


def _bool_to_status(value: Any) -> Any:
    # YAML reads `status: True` as a boolean; Kubernetes condition statuses are strings.
    if isinstance(value, bool):
        return "True" if value else "False"
    return value


def _set_condition(node: NodeFacts, type_: str, status: str) -> NodeFacts:
    others = tuple(c for c in node.conditions if c.type != type_)
    old = node.condition(type_)
    reason = "Predicted" if old is None or old.status != status else old.reason
    return replace(node, conditions=(*others, Condition(type_, status, reason=reason)))


def _taint_text(t: Taint) -> str:
    return f"{t.key}={t.value}:{t.effect}" if t.value else f"{t.key}:{t.effect}"


@register_check
class NodeExistsCheck(NodeCheck):
    KEY: ClassVar[str] = "node_exists"
    node_exists: bool

    def describe(self) -> str:
        return "node exists" if self.node_exists else "node does not exist"

    def evaluate(self, facts: Facts, env: Env) -> CheckResult:
        node = facts.node
        if node is None:
            return unknown("node", facts, NODE)
        return result(node.exists == self.node_exists,
                      f"node {node.name} {'exists' if node.exists else 'does not exist'}",
                      {"node.exists": node.exists})

    def establish(self, facts: Facts, env: Env) -> Facts:
        return facts  # a node cannot be predicted into (or out of) existence


@register_check
class NodeReadyCheck(NodeCheck):
    KEY: ClassVar[str] = "node_ready"
    node_ready: bool

    def describe(self) -> str:
        return "node is Ready" if self.node_ready else "node is not Ready"

    def evaluate_node(self, node: NodeFacts) -> CheckResult:
        cond = node.condition("Ready")
        if cond is None:
            detail = "no Ready condition"
        else:
            detail = f"Ready={cond.status}" + (f" ({cond.reason})" if cond.reason else "")
        return result(node.ready == self.node_ready, detail, {"node.ready": node.ready})

    def establish_node(self, node: NodeFacts) -> NodeFacts:
        return _set_condition(node, "Ready", "True" if self.node_ready else "False")


class NodeLabelSpec(FormatModel):
    key: str = Field(min_length=1)
    equals: str | None = None
    absent: bool | None = None

    @model_validator(mode="after")
    def _one_condition(self) -> NodeLabelSpec:
        if (self.equals is None) == (self.absent is None):
            raise ValueError("node_label needs exactly one of 'equals' or 'absent'")
        return self


@register_check
class NodeLabelCheck(NodeCheck):
    KEY: ClassVar[str] = "node_label"
    node_label: NodeLabelSpec

    def describe(self) -> str:
        s = self.node_label
        if s.equals is not None:
            return f"label {s.key} = {s.equals}"
        return f"label {s.key} absent" if s.absent else f"label {s.key} present"

    def evaluate_node(self, node: NodeFacts) -> CheckResult:
        s = self.node_label
        value = node.labels.get(s.key)
        observed = f"label {s.key}={value}" if value is not None else f"label {s.key} absent"
        reads = {f"node.labels[{s.key}]": value}
        if s.equals is not None:
            return result(value == s.equals, observed, reads)
        return result((value is None) == bool(s.absent), observed, reads)

    def establish_node(self, node: NodeFacts) -> NodeFacts:
        s = self.node_label
        labels = dict(node.labels)
        if s.equals is not None:
            labels[s.key] = s.equals
        elif s.absent:
            labels.pop(s.key, None)
        else:
            labels.setdefault(s.key, "")
        return node.with_labels(labels)


class AnnotationTimeSpec(FormatModel):
    key: str = Field(min_length=1)  # an annotation holding an RFC 3339 time (``{{ facts.now }}`` wrote it)
    within: Duration  # "168h": the time is at most this long before the facts were gathered
    # Read the annotation as the plan found it (``Plan.baseline``), not live: a record the run itself
    # (re)writes must not count as an earlier one.
    baseline: bool = False


def parse_time(text: str) -> datetime | None:
    """An RFC 3339 time (``2026-12-07T14:00:00Z``) as an aware datetime; None when it is not one."""
    try:
        t = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


@register_check
class NodeAnnotationTimeCheck(CheckKind):
    """Whether a node annotation records a time within a window before now (the facts' gathering time,
    from the injected clock): "this node lost a GPU less than 7 days ago" (gpu-fallen-off-bus)."""

    KEY: ClassVar[str] = "node_annotation_time"
    READS: ClassVar[Reads] = "node"
    node_annotation_time: AnnotationTimeSpec

    def describe(self) -> str:
        s = self.node_annotation_time
        return f"annotation {s.key}{' (at plan time)' if s.baseline else ''} records a time within {s.within}"

    def uses_baseline(self) -> bool:
        return self.node_annotation_time.baseline

    def evaluate(self, facts: Facts, env: Env) -> CheckResult:
        s = self.node_annotation_time
        if s.baseline:
            node = (env.baseline or {}).get("node")
            if not env.baseline or node is None:
                return CheckResult(None, "no plan-time node facts (baseline) to read the record from",
                                   {"error": "no baseline"})
            value, where = (node.get("annotations") or {}).get(s.key), f"baseline.node.annotations[{s.key}]"
        else:
            if facts.node is None:
                return unknown("node", facts, NODE)
            value, where = facts.node.annotations.get(s.key), f"node.annotations[{s.key}]"
        if not facts.gathered_at:
            return CheckResult(None, "the time of the facts is unknown", {"error": "no gathering time"})
        if value is None:
            return result(False, f"no annotation {s.key}", {where: None})
        t = parse_time(str(value))
        if t is None:
            return CheckResult(None, f"annotation {s.key}={value!r} is not an RFC 3339 time",
                               {"error": "not a time"}, {where: value})
        age = facts.gathered_at - t.timestamp()
        window = parse_duration(s.within)
        # a record "from the future" (clock skew between writers) counts as recent
        holds = age <= window
        ago = f"{age / 3600:.1f}h ago" if age >= 0 else "in the future"
        return result(holds, f"annotation {s.key}={value} ({ago}; window {s.within})", {where: value},
                      age_seconds=round(age, 3), window_seconds=window)


class NodeTaintSpec(FormatModel):
    key: str = Field(min_length=1)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    present: bool = True


@register_check
class NodeTaintCheck(NodeCheck):
    KEY: ClassVar[str] = "node_taint"
    node_taint: NodeTaintSpec

    def describe(self) -> str:
        s = self.node_taint
        what = f"{s.key}:{s.effect}" if s.effect else s.key
        return f"taint {what} {'present' if s.present else 'absent'}"

    def evaluate_node(self, node: NodeFacts) -> CheckResult:
        s = self.node_taint
        matching = [t for t in node.taints if t.key == s.key and (s.effect is None or t.effect == s.effect)]
        texts = sorted(_taint_text(t) for t in node.taints if t.key == s.key)
        observed = f"taints {', '.join(texts)}" if texts else f"no taint {s.key}"
        return result(bool(matching) == s.present, observed, {f"node.taints[{s.key}]": texts})

    def establish_node(self, node: NodeFacts) -> NodeFacts:
        s = self.node_taint
        if s.present:
            if any(t.key == s.key and (s.effect is None or t.effect == s.effect) for t in node.taints):
                return node
            return replace(node, taints=(*node.taints, Taint(s.key, s.effect or "NoSchedule")))
        kept = tuple(t for t in node.taints if not (t.key == s.key and (s.effect is None or t.effect == s.effect)))
        return replace(node, taints=kept)


class NodeConditionSpec(FormatModel):
    type: str = Field(min_length=1)
    status: Annotated[Literal["True", "False", "Unknown"], BeforeValidator(_bool_to_status)]


@register_check
class NodeConditionCheck(NodeCheck):
    KEY: ClassVar[str] = "node_condition"
    node_condition: NodeConditionSpec

    def describe(self) -> str:
        return f"condition {self.node_condition.type} = {self.node_condition.status}"

    def evaluate_node(self, node: NodeFacts) -> CheckResult:
        s = self.node_condition
        cond = node.condition(s.type)
        status = cond.status if cond else "Unknown"
        return result(status == s.status, f"{s.type}={status}" + (f" ({cond.reason})" if cond and cond.reason
                                                                    else ""),
                      {f"node.conditions[{s.type}]": status})

    def establish_node(self, node: NodeFacts) -> NodeFacts:
        return _set_condition(node, self.node_condition.type, self.node_condition.status)


class AllocatableSpec(FormatModel):
    resource: str = Field(min_length=1)
    min: int | str = 1  # a Kubernetes quantity: 1, "500m", "4Gi"
    # true: allocatable equals the number of NVIDIA GPUs the host lists (reads the node and the host)
    equals_host_gpus: bool = False

    @model_validator(mode="after")
    def _one_bound(self) -> AllocatableSpec:
        if self.equals_host_gpus and "min" in self.model_fields_set:
            raise ValueError("allocatable takes 'min' or 'equals_host_gpus: true', not both")
        return self


@register_check
class AllocatableCheck(NodeCheck):
    """``allocatable: {resource, min}``: at least ``min``; ``allocatable: {resource, equals_host_gpus:
    true}``: exactly as many as the NVIDIA GPUs the host lists (lspci), whatever their driver, so
    that a node back with one GPU of eight does not pass. That form reads the host too."""

    KEY: ClassVar[str] = "allocatable"
    allocatable: AllocatableSpec

    def describe(self) -> str:
        if self.allocatable.equals_host_gpus:
            return f"allocatable {self.allocatable.resource} equals the host's NVIDIA GPUs"
        return f"allocatable {self.allocatable.resource} >= {self.allocatable.min}"

    def probes(self, env: Env) -> set[Probe]:
        return {NODE, HOST} if self.allocatable.equals_host_gpus else {NODE}

    def evaluate(self, facts: Facts, env: Env) -> CheckResult:
        if self.allocatable.equals_host_gpus and facts.node is not None and facts.node.exists:
            if facts.host is None:
                return unknown("host facts", facts, HOST)
            return self._equals_host_gpus(facts.node, facts.host)
        return super().evaluate(facts, env)

    def _equals_host_gpus(self, node: NodeFacts, host: HostFacts) -> CheckResult:
        s = self.allocatable
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
        return result(holds, observed, reads, host_gpus=[g.slot for g in host.gpus],
                      not_on_nvidia=[g.slot for g in off])

    def evaluate_node(self, node: NodeFacts) -> CheckResult:
        s = self.allocatable
        raw = node.allocatable.get(s.resource)
        reads = {f"node.allocatable[{s.resource}]": raw}
        have = parse_quantity(raw) if raw is not None else Decimal(0)
        want = parse_quantity(s.min)
        return result(have >= want, f"allocatable {s.resource}={raw if raw is not None else 0}", reads)

    def establish(self, facts: Facts, env: Env) -> Facts:
        if not self.allocatable.equals_host_gpus:
            return super().establish(facts, env)
        node, host = facts.node, facts.host
        if node is None or not node.exists or host is None:
            return facts  # unknown stays unknown
        alloc = {**node.allocatable, self.allocatable.resource: str(len(host.gpus))}
        return replace(facts, node=replace(node, allocatable=MappingProxyType(alloc)))

    def establish_node(self, node: NodeFacts) -> NodeFacts:
        s = self.allocatable
        raw = node.allocatable.get(s.resource)
        if raw is not None and parse_quantity(raw) >= parse_quantity(s.min):
            return node
        alloc = dict(node.allocatable)
        alloc[s.resource] = str(s.min)
        return replace(node, allocatable=MappingProxyType(alloc))
