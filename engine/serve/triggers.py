"""Match alerts and incidents to runbook triggers, and render the params a run would get.

Alertmanager alerts match a runbook's ``triggers[]`` by alert name and label matchers; params are
rendered from the alert through the engine's Jinja2 sandbox (``engine.templating``) with
``labels``, ``annotations`` and ``alert`` (name, fingerprint, starts_at) in the context. PagerDuty
incidents match by service and a title regex (a runbook's ``trigger.pagerduty`` or the server's
``pagerduty.mappings``); the regex's named groups become params, ``incident`` and ``labels`` (the
groups) are the template context.

Label values are data: they are inserted into params, never rendered themselves, so a label
``{{ 7*7 }}`` stays those characters and is later refused by param validation. Everything is
compiled once, when the index is built; a bad trigger is a ``UsageError`` at server start. This
module does not validate params (the starter does) and knows nothing of guards.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from engine import templating
from engine.errors import UsageError
from engine.model import ParamValue, control_character, is_node_name, is_template
from engine.serve.alertmanager import Alert
from engine.serve.config import PagerDutyMapping
from engine.serve.matchers import Matcher, MatcherError, all_match, parse_all
from engine.serve.pagerduty import Incident
from engine.serve.starter import Mode, Source, TriggerSpec
from engine.windows import Window

_CONTEXT_NAMES = frozenset({"labels", "annotations", "alert", "incident"})
_MAX_TITLE = 1024  # titles are matched against operator regexes: bound the input


@dataclass(frozen=True)
class Candidate:
    """A run an alert asks for, before the guards had their say."""

    runbook: str
    params: Mapping[str, ParamValue]
    node: str | None
    mode: Mode  # as the trigger declares it (config overrides are applied later)
    source: Source
    reason: str
    dedup_key: str
    group_key: str = ""  # Alertmanager's groupKey of the delivery (PagerDuty Events dedup_key)
    alert_started: float | None = None  # the alert's startsAt (epoch seconds), for metrics
    require_diagnosis: bool = False  # the run plans only if the runbook's diagnosis matches the node
    windows: tuple[Window, ...] = ()  # the trigger's maintenance windows
    incident_id: str = ""  # the PagerDuty incident that paged (its REST notes, acknowledge, resolve)
    resolve_incident: bool = False  # the trigger resolves that incident when the run succeeded


@dataclass(frozen=True)
class Refusal:
    """A trigger that matched but cannot produce a run (e.g. a param template failed)."""

    runbook: str
    reason: str


@dataclass(frozen=True)
class _AlertTrigger:
    spec: TriggerSpec
    names: frozenset[str]
    matchers: tuple[Matcher, ...]


@dataclass(frozen=True)
class _IncidentTrigger:
    runbook: str
    service: str | None
    pattern: re.Pattern[str]
    fixed: Mapping[str, ParamValue]
    templates: Mapping[str, str]
    mode: Mode
    node_param: str | None
    origin: str  # "runbook" | "config"
    require_diagnosis: bool = False
    resolve_incident: bool = False


@dataclass
class Matches:
    candidates: list[Candidate] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)


def _check_templates(where: str, params: Mapping[str, str], problems: list[str]) -> None:
    for key, source in params.items():
        if not isinstance(source, str) or not is_template(source):
            continue
        for p in templating.template_problems(source, params={}, extra_names=_CONTEXT_NAMES):
            problems.append(f"{where}: params.{key}: {p}")


def _render(templates: Mapping[str, str], ctx: Mapping[str, Any]) -> dict[str, ParamValue]:
    out: dict[str, ParamValue] = {}
    for key, source in templates.items():
        out[key] = templating.render(source, ctx) if is_template(source) else source
    return out


def _node_of(params: Mapping[str, ParamValue], node_param: str | None) -> str | None:
    value = params.get(node_param or "node")
    return value if isinstance(value, str) and value else None


def _check_node(params: Mapping[str, ParamValue], node_param: str | None) -> None:
    """The node param must be a whole, valid node name before it becomes a dedup or guard key."""
    name = node_param or "node"
    value = params.get(name)
    if isinstance(value, str):
        bad = control_character(value)
        if bad is not None:
            raise ValueError(f"param {name}: {value[:80]!r} contains a control character ({bad})")
        if not is_node_name(value):
            raise ValueError(f"param {name}: {value[:80]!r} is not a valid node name (RFC 1123)")


MATCH_CACHE_SIZE = 1024  # distinct alerts whose matches are remembered (a storm re-sends the same ones)


def _alert_key(alert: Alert) -> tuple[Any, ...]:
    """Everything ``for_alert`` reads of an alert: equal keys give equal matches."""
    return (alert.status, tuple(sorted(alert.labels.items())), tuple(sorted(alert.annotations.items())),
            alert.fingerprint, alert.starts_at)


class TriggerIndex:
    """Compiled triggers; ``for_alert`` / ``for_incident`` are pure and thread-safe.

    ``for_alert`` remembers its answers for the last ``MATCH_CACHE_SIZE`` distinct alerts: rendering
    a trigger's params (a sandboxed Jinja template) is most of the cost of answering a duplicate
    page, and a function of the alert alone. Answers holding a refusal are not remembered (a
    template may have hit a time bound that a retry would not)."""

    def __init__(self, specs: Sequence[TriggerSpec], mappings: Sequence[PagerDutyMapping] = ()) -> None:
        problems: list[str] = []
        alert_triggers: list[_AlertTrigger] = []
        incident_triggers: list[_IncidentTrigger] = []
        self.node_params: dict[str, str | None] = {}
        self._conditions: list[TriggerSpec] = []
        self._cache: OrderedDict[tuple[Any, ...], Matches] = OrderedDict()
        self._cache_lock = threading.Lock()
        for i, spec in enumerate(specs):
            t = spec.trigger
            where = f"runbook {spec.runbook}: triggers[{i}]"
            self.node_params.setdefault(spec.runbook, spec.node_param)
            _check_templates(where, t.params, problems)
            names = frozenset([t.alert] if isinstance(t.alert, str) else t.alert) - {""}
            try:
                matchers = tuple(parse_all(t.matchers))
            except MatcherError as e:
                problems.append(f"{where}: matchers: {e}")
                continue
            if names or matchers:
                alert_triggers.append(_AlertTrigger(spec, names, matchers))
            if t.pagerduty is not None:
                try:
                    pattern = re.compile(t.pagerduty.title_pattern or "")
                except re.error as e:
                    problems.append(f"{where}: pagerduty.title_pattern: {e}")
                    continue
                incident_triggers.append(_IncidentTrigger(
                    spec.runbook, t.pagerduty.service, pattern, {}, dict(t.params), t.mode,
                    spec.node_param, "runbook", t.require_diagnosis, t.pagerduty.resolve_incident))
            if t.node_conditions:
                self._conditions.append(spec)  # watched by engine.serve.node_conditions
            if not names and not matchers and t.pagerduty is None and not t.node_conditions:
                problems.append(f"{where}: needs 'alert', 'matchers', 'pagerduty' or 'node_conditions' "
                                "(it would match everything)")
        for j, m in enumerate(mappings):
            incident_triggers.append(_IncidentTrigger(
                m.runbook, m.service, re.compile(m.title_pattern), dict(m.params), {}, m.mode,
                self.node_params.get(m.runbook, "node"), f"config pagerduty.mappings[{j}]",
                resolve_incident=m.resolve_incident))
        if problems:
            raise UsageError("invalid triggers:\n" + "\n".join(problems))
        self._alerts = tuple(alert_triggers)
        self._incidents = tuple(incident_triggers)

    def __len__(self) -> int:
        return len(self._alerts) + len(self._incidents) + len(self._conditions)

    def condition_triggers(self) -> list[TriggerSpec]:
        """The triggers that watch Node conditions (``engine.serve.node_conditions``)."""
        return list(self._conditions)

    def node_labels(self) -> dict[str, str | None]:
        """Per Alertmanager-triggered runbook, the label its node param is rendered from
        (``{{ labels.node }}`` -> ``node``); None when it is not one label."""
        out: dict[str, str | None] = {}
        for t in self._alerts:
            source = t.spec.trigger.params.get(t.spec.node_param or "node", "")
            m = re.fullmatch(r"\{\{\s*labels\.([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", source.strip())
            out.setdefault(t.spec.runbook, m.group(1) if m else None)
        return out

    def describe(self) -> list[dict[str, Any]]:
        """The index as JSON for ``GET /triggers``."""
        out: list[dict[str, Any]] = [
            {"source": "alertmanager", "runbook": t.spec.runbook, "alerts": sorted(t.names),
             "matchers": [str(m) for m in t.matchers], "mode": t.spec.trigger.mode,
             "require_diagnosis": t.spec.trigger.require_diagnosis}
            for t in self._alerts]
        out += [{"source": "pagerduty", "runbook": t.runbook, "service": t.service,
                 "title_pattern": t.pattern.pattern, "mode": t.mode, "from": t.origin,
                 "require_diagnosis": t.require_diagnosis, "resolve_incident": t.resolve_incident}
                for t in self._incidents]
        out += [{"source": "node-condition", "runbook": s.runbook,
                 "node_conditions": [{"type": c.type, "status": list(c.status), "for": c.for_}
                                     for c in s.trigger.node_conditions],
                 "node_selector": dict(s.trigger.node_selector), "mode": s.trigger.mode,
                 "require_diagnosis": s.trigger.require_diagnosis}
                for s in self._conditions]
        return out

    def for_alert(self, alert: Alert) -> Matches:
        """Candidates for one firing alert (resolved alerts never produce any)."""
        if not alert.firing:
            return Matches()
        key = _alert_key(alert)
        with self._cache_lock:
            known = self._cache.get(key)
            if known is not None:
                self._cache.move_to_end(key)
        if known is None:
            known = self._match_alert(alert)
            if not known.refusals:
                with self._cache_lock:
                    self._cache[key] = known
                    while len(self._cache) > MATCH_CACHE_SIZE:
                        self._cache.popitem(last=False)
        return Matches(list(known.candidates), list(known.refusals))  # the caller's own lists

    def _match_alert(self, alert: Alert) -> Matches:
        found = Matches()
        ctx: Mapping[str, Any] | None = None
        for t in self._alerts:
            if t.names and alert.name not in t.names:
                continue
            if not all_match(t.matchers, alert.labels):
                continue
            if ctx is None:
                ctx = MappingProxyType({
                    "labels": MappingProxyType(dict(alert.labels)),
                    "annotations": MappingProxyType(dict(alert.annotations)),
                    "alert": MappingProxyType({
                        "name": alert.name, "fingerprint": alert.dedup_key,
                        "starts_at": alert.starts_at.isoformat() if alert.starts_at else ""}),
                })
            try:
                params = _render(t.spec.trigger.params, ctx)
                _check_node(params, t.spec.node_param)
            except (templating.TemplateError, ValueError) as e:
                found.refusals.append(Refusal(t.spec.runbook, f"params: {e}"))
                continue
            found.candidates.append(Candidate(
                runbook=t.spec.runbook, params=params, node=_node_of(params, t.spec.node_param),
                mode=t.spec.trigger.mode, source="alertmanager",
                reason=f"alertmanager: {alert.describe()} fingerprint {alert.dedup_key}",
                dedup_key=alert.dedup_key, require_diagnosis=t.spec.trigger.require_diagnosis,
                windows=t.spec.trigger.windows))
        return found

    def for_incident(self, incident: Incident) -> Matches:
        """Candidates for one PagerDuty incident, by service (id or name) and title pattern."""
        found = Matches()
        title = incident.title[:_MAX_TITLE]
        for t in self._incidents:
            if t.service is not None and t.service not in (incident.service.id, incident.service.summary):
                continue
            m = t.pattern.search(title)
            if m is None:
                continue
            groups = {k: v for k, v in m.groupdict().items() if v is not None}
            ctx = MappingProxyType({
                "labels": MappingProxyType(dict(groups)),
                "incident": MappingProxyType({
                    "id": incident.id, "title": incident.title, "urgency": incident.urgency,
                    "service": incident.service.summary, "service_id": incident.service.id}),
            })
            try:
                params: dict[str, ParamValue] = {**t.fixed, **groups, **_render(t.templates, ctx)}
                _check_node(params, t.node_param)
            except (templating.TemplateError, ValueError) as e:
                found.refusals.append(Refusal(t.runbook, f"params: {e}"))
                continue
            found.candidates.append(Candidate(
                runbook=t.runbook, params=params, node=_node_of(params, t.node_param), mode=t.mode,
                source="pagerduty",
                reason=f"pagerduty: incident {incident.id} {incident.title[:200]!r} "
                       f"(service {incident.service.summary or incident.service.id})",
                dedup_key=f"pd-incident-{incident.id}", require_diagnosis=t.require_diagnosis,
                incident_id=incident.id, resolve_incident=t.resolve_incident))
        return found
