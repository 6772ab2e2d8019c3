"""Node Events: every step outcome of a run also becomes a Kubernetes Event on the Node (issue 15).

``NodeEventSink`` wraps the run's event sink (the journal first: write-ahead). After the wrapped sink
has recorded an event, the ones an operator reads with ``kubectl describe node`` /
``kubectl get events`` are posted through ``KubeAPI.create_node_event``:

* ``step.outcome`` -> ``RemediationStepSucceeded`` (Normal), ``RemediationStepSkipped`` (Normal),
  ``RemediationStepFailed`` (Warning: failed, timed-out, rolled-back), ``RemediationBlocked``
  (Warning: blocked), ``RemediationStepCancelled`` (Warning);
* ``run.blocked`` (a run stopped before its first step) -> ``RemediationBlocked`` (Warning).

Each note names the run id, the runbook and the step. Reporting controller: ``runbook``.

Must not: fail or slow down a run because an Event could not be created (it is logged on
``runbook.node_events`` and the run goes on), reorder or drop events of the wrapped sink, or talk
to Kubernetes other than through ``KubeAPI``.
"""

from __future__ import annotations

import logging
import socket
from typing import Any, Literal

from engine.connectors.base import KubeAPI, NodeEvent

log = logging.getLogger("runbook.node_events")

REPORTING_CONTROLLER = "runbook"

_STEP_REASONS: dict[str, tuple[str, Literal["Normal", "Warning"]]] = {
    "succeeded": ("RemediationStepSucceeded", "Normal"),
    "skipped": ("RemediationStepSkipped", "Normal"),
    "failed": ("RemediationStepFailed", "Warning"),
    "timed-out": ("RemediationStepFailed", "Warning"),
    "rolled-back": ("RemediationStepFailed", "Warning"),
    "blocked": ("RemediationBlocked", "Warning"),
    "cancelled": ("RemediationStepCancelled", "Warning"),
}


def node_event_for(kind: str, data: dict[str, Any], *, run_id: str, runbook: str, node: str,
                   instance: str) -> NodeEvent | None:
    """The Event for one run event, or None when that kind is not reported on the Node (pure)."""
    if kind == "step.outcome":
        status = str(data.get("status", ""))
        reason, type_ = _STEP_REASONS.get(status, ("RemediationStepFailed", "Warning"))
        step = data.get("step") or "?"
        why = f": {data['reason']}" if data.get("reason") else ""
        note = f"run {run_id}: runbook {runbook}, step {step} {status}{why}"
    elif kind == "run.blocked":
        reason, type_ = "RemediationBlocked", "Warning"
        why = f": {data['reason']}" if data.get("reason") else ""
        note = f"run {run_id}: runbook {runbook} blocked before any step{why}"
    else:
        return None
    return NodeEvent(node=node, reason=reason, note=note, type=type_, action="Remediate",
                     reporting_controller=REPORTING_CONTROLLER, reporting_instance=instance)


def find_run_id(sink: Any) -> str | None:
    """The run id of a sink: ``JournalSink.run_id``, or that of the first sink of a ``Fanout`` that has one."""
    run_id = getattr(sink, "run_id", None)
    if isinstance(run_id, str) and run_id:
        return run_id
    for inner in getattr(sink, "sinks", ()) or ():
        found = find_run_id(inner)
        if found:
            return found
    return None


def wrap(inner: Any, kube: KubeAPI | None) -> Any:
    """``inner`` with Node Events added (the Executor's hook), or ``inner`` itself without Kubernetes."""
    if kube is None or isinstance(inner, NodeEventSink):
        return inner
    return NodeEventSink(inner, kube)


class NodeEventSink:
    """An EventSink: ``inner`` first, then a Node Event for step outcomes (best effort).

    ``run_id`` defaults to the inner sink's (``find_run_id``); ``runbook`` and ``node`` default to
    what the run's ``run.start`` event says.
    """

    def __init__(self, inner: Any, kube: KubeAPI, *, run_id: str | None = None, runbook: str = "",
                 node: str = "", instance: str | None = None) -> None:
        self.inner = inner
        self.kube = kube
        self.run_id = run_id or find_run_id(inner) or "?"
        self.runbook = runbook
        self.node = node
        self.instance = instance or f"runbook@{socket.gethostname()}"
        self.steps_reported = 0

    def emit(self, kind: str, **data: Any) -> None:
        self.inner.emit(kind, **dict(data))  # write-ahead: a journal failure still aborts the run
        if kind == "run.start":
            self.runbook = str(data.get("runbook") or self.runbook)
            self.node = str(data.get("node") or self.node)
            return
        if not self.node or (kind == "run.blocked" and self.steps_reported):
            return  # a blocked step already said so on the Node
        if kind == "step.outcome":
            self.steps_reported += 1
        event = node_event_for(kind, data, run_id=self.run_id, runbook=self.runbook, node=self.node,
                               instance=self.instance)
        if event is None:
            return
        try:
            self.kube.create_node_event(event)
        except Exception as e:  # best effort by contract: an Event never fails a run
            log.warning("could not record Event %s on node %s for run %s: %s",
                        event.reason, self.node, self.run_id, e)
