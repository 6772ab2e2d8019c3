"""Detection of its own: Node conditions that page ``runbook serve`` without Prometheus.

A runbook trigger may declare ``node_conditions`` (``[{type: Ready, status: [False, Unknown], for: 5m}]``,
NodeHealthCheck's ``unhealthyConditions`` shape) and a ``node_selector`` (labels every watched node
must carry). The leader reads the nodes every ``interval`` seconds; a selected node whose condition
has had one of the statuses for at least ``for`` (by its ``lastTransitionTime``) pages itself: a
``Candidate`` of source ``node-condition`` goes through the dispatcher exactly like an alert (dedup,
cluster snapshot, exclusions, breaker, approval mode, ``require_diagnosis``). Its dedup key names the
node, the condition and the transition, so one episode pages once; a new transition pages anew.

Params: the trigger's ``params`` rendered through the engine's sandbox with ``node`` (``name``,
``labels``) and ``condition`` (``type``, ``status``, ``reason``, ``message``, ``since``) in the context;
the runbook's node param is the node. This module reads nodes; it starts nothing itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Protocol

from engine import templating
from engine.connectors.base import KubeAPI
from engine.facts import Condition, NodeFacts
from engine.model import NodeConditionMatch, ParamValue, is_template
from engine.serve.background import BackgroundLoop
from engine.serve.leader import Leadership
from engine.serve.starter import TriggerSpec
from engine.serve.triggers import Candidate

log = logging.getLogger(__name__)
SOURCE = "node-condition"


class Starts(Protocol):
    def handle_candidates(self, candidates: Sequence[Candidate], label: str, requested_by: str) -> list[Any]: ...


def condition_triggers(specs: Sequence[TriggerSpec]) -> list[TriggerSpec]:
    """The triggers that watch Node conditions."""
    return [s for s in specs if s.trigger.node_conditions]


def selected(node: NodeFacts, selector: Mapping[str, str]) -> bool:
    return all(node.labels.get(k) == v for k, v in selector.items())


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if epoch else ""


def firing(node: NodeFacts, match: NodeConditionMatch, now: float) -> Condition | None:
    """The node's condition when it has had one of the statuses for at least ``for`` (else None).
    A condition without a transition time never fires: how long is unknown."""
    c = next((c for c in node.conditions if c.type == match.type), None)
    if c is None or c.status not in match.status or not c.since:
        return None
    return c if now - c.since >= match.seconds() else None


def candidate(spec: TriggerSpec, node: NodeFacts, c: Condition) -> Candidate:
    """The page a firing condition makes (``ValueError``/``TemplateError`` when a param cannot render)."""
    t = spec.trigger
    ctx = MappingProxyType({
        "node": MappingProxyType({"name": node.name, "labels": MappingProxyType(dict(node.labels))}),
        "condition": MappingProxyType({"type": c.type, "status": c.status, "reason": c.reason,
                                       "message": c.message, "since": _iso(c.since)}),
    })
    params: dict[str, ParamValue] = {k: templating.render(v, ctx) if is_template(v) else v
                                     for k, v in t.params.items()}
    params[spec.node_param or "node"] = node.name
    return Candidate(
        runbook=spec.runbook, params=params, node=node.name, mode=t.mode, source=SOURCE,  # type: ignore[arg-type]
        reason=f"node-condition: {node.name} {c.type}={c.status} since {_iso(c.since)} ({c.reason or 'no reason'})",
        dedup_key=f"node-condition-{node.name}-{c.type}-{c.status}-{int(c.since)}",
        require_diagnosis=t.require_diagnosis)


@dataclass
class NodeConditionWatcher:
    """Reads the nodes every ``interval`` seconds (leader only) and pages for firing conditions."""

    kube: Callable[[], KubeAPI]
    dispatcher: Starts
    specs: Sequence[TriggerSpec]
    leadership: Leadership
    interval: float = 10.0
    clock: Callable[[], float] = time.time
    paged: list[str] = field(default_factory=list)  # dedup keys paged by this process (newest last)
    _seen: set[str] = field(default_factory=set)
    _loop: BackgroundLoop = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._loop = BackgroundLoop("runbook-node-conditions", self.check, lambda: self.interval, at_start=False,
                                    log=log, what="node conditions: check")

    def start(self) -> None:
        """Check every ``interval`` seconds (the first check after one interval); without specs, nothing."""
        if self.specs:
            self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def check(self) -> list[Any]:
        """One look at the nodes; the dispatcher's decisions for what paged (empty on a follower)."""
        if not self.specs or not self.leadership.is_leader():
            return []
        nodes = self.kube().list_nodes()
        now = self.clock()
        out: list[Any] = []
        for spec in self.specs:
            for node in nodes:
                if not selected(node, spec.trigger.node_selector):
                    continue
                for match in spec.trigger.node_conditions:
                    c = firing(node, match, now)
                    if c is None:
                        continue
                    try:
                        cand = candidate(spec, node, c)
                    except (templating.TemplateError, ValueError) as e:
                        log.warning("node conditions: runbook %s: params for %s: %s", spec.runbook, node.name, e)
                        continue
                    if cand.dedup_key in self._seen:
                        break  # this episode paged already (the dispatcher's own dedup would say so too)
                    if len(self._seen) > 10000:
                        self._seen.clear()  # bounded; the dispatcher's fingerprint window still dedups
                    self._seen.add(cand.dedup_key)
                    self.paged.append(cand.dedup_key)
                    del self.paged[:-200]
                    decisions = self.dispatcher.handle_candidates([cand], cand.reason, SOURCE)
                    if decisions and all(getattr(d, "transient", False) for d in decisions):
                        self._seen.discard(cand.dedup_key)  # blocked for a passing reason: page again next time
                    out += decisions
                    break  # one page per node and trigger
        return out
