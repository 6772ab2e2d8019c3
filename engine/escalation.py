"""Escalation: when a run cannot fix the node, the runbooks it names are tried in order.

A runbook's ``on_failure: {escalate: [A, B]}``: after a run of it ends ``failed`` (an action or a
verification failed; a blocked run never escalates: a guard that says "not now" is not a failure),
``A`` is planned for the same node (its node param set to the node; its other params their
defaults), guarded and verified like any run, as a child run linked to the parent: the parent gets
``run.escalated`` (runbook, run, reason), the child ``escalation.of`` (run, runbook, remaining).
When ``A`` needs approval (its own ``approval: true``, or the parent was an automatic run of the
server) the child is parked ``waiting-approval`` and the chain waits for a person; when ``A`` fails
in turn, ``B`` is tried (the remaining chain travels with the child). A child whose plan is blocked
ends blocked, and the chain stops there (nothing is forced).

``lineage(events)`` reads the links back for ``runbook runs show`` and the console. This module
links and decides; the run service plans and executes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.errors import RunbookError
from engine.model import PlanState, RunResult, RunState
from engine.params import PreparedRun, prepare_run

if TYPE_CHECKING:
    from engine.runs import RunService
    from engine.store import EventRecord

__all__ = ["ESCALATED", "ESCALATION_OF", "escalate_after_failure", "lineage"]

ESCALATED = "run.escalated"
ESCALATION_OF = "escalation.of"


def lineage(events: Sequence[EventRecord]) -> dict[str, Any]:
    """The run's parent (``escalation.of`` / ``rollback.of``) and children (``run.escalated`` /
    ``run.rolled_back``), as ``runbook runs show`` and the console print them."""
    out: dict[str, Any] = {"parent": None, "children": []}
    for e in events:
        if e.kind in (ESCALATION_OF, "rollback.of"):
            out["parent"] = {"run": e.data.get("run"), "why": "escalated from" if e.kind == ESCALATION_OF
                             else "rolls back"}
        elif e.kind in (ESCALATED, "run.rolled_back"):
            out["children"].append({"run": e.data.get("run"), "runbook": e.data.get("runbook"),
                                    "why": "escalated to" if e.kind == ESCALATED else "rolled back by"})
    return out


def _chain(service: RunService, run_id: str, prepared: PreparedRun) -> list[str]:
    """The runbooks still to try: the chain this run inherited as a child, else its own."""
    for e in service.journal.events(run_id):
        if e.kind == ESCALATION_OF:
            return [str(x) for x in e.data.get("remaining") or ()]
    own = prepared.runbook.on_failure
    return list(own.escalate) if own is not None else []


def escalate_after_failure(service: RunService, run_id: str, prepared: PreparedRun, result: RunResult) -> None:
    """Start the next runbook of the chain when ``result`` failed (see the module's docstring)."""
    if result.state is not RunState.FAILED:
        return
    chain = _chain(service, run_id, prepared)
    journal = service.journal
    while chain:
        name, chain = chain[0], chain[1:]
        reason = f"{prepared.runbook.name} failed on {prepared.node}: {result.reason}"
        try:
            loaded = service.load(name)
            node_param = loaded.runbook.node_param
            if node_param is None:
                raise RunbookError(f"runbook {name} has no node param")
            child = prepare_run(loaded, {node_param: prepared.node})
            plan = service.plan(child)
        except RunbookError as e:
            journal.append(run_id, "escalation.refused", runbook=name, reason=str(e))
            continue  # the next runbook of the chain
        child_id = service.create(child, plan, source="escalation", approval_required=_needs_approval(
            service, child, plan))
        journal.append(child_id, ESCALATION_OF, run=run_id, runbook=prepared.runbook.name, remaining=chain)
        journal.append(run_id, ESCALATED, runbook=name, run=child_id, reason=reason)
        if service.live is not None:
            service.live.emit("run.escalated", reason=f"{reason}; escalated to {name} (run {child_id})")
        if plan.state is PlanState.BLOCKED:
            service.record_blocked(child_id, "; ".join(plan.blocked_reasons))
            return
        if _needs_approval(service, child, plan):
            service.park(child_id, plan, f"escalation from run {run_id}: `runbook approve {child_id} "
                                         f"--plan-digest {plan.digest}`, then `runbook resume {child_id}`")
            return
        sub = service.execute(child_id, child, plan)  # a failure escalates on from there (its chain)
        del sub
        return


def _needs_approval(service: RunService, child: PreparedRun, plan: Any) -> bool:
    """The child's own mode; an automatic (server) parent never escalates without a person."""
    return bool(child.runbook.approval or service.automatic) and plan.state is not PlanState.NOTHING_TO_DO
