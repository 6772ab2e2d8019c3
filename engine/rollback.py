"""Whole-run rollback: the inverses of what a recorded run changed, as a normal guarded, verified run.

``rollback_target(service, run_id)`` reads the run's journal: the steps whose action changed
something (``action.result`` changed, and not already undone by the step's own ``on_failure``
rollback), newest first. Each step's declared inverse (``Step.rollback``) becomes one step of a
rollback runbook, planned like any runbook against the node's facts now:

* ``auto`` (label, unlabel, annotate, cordon, uncordon): restore the values the run found (the
  recorded plan's changes, byte for byte) and verify them;
* ``{action, guards, verify, why}``: that action, taken only if its guards hold now (a guard that
  does not hold blocks the rollback plan: it is refused with the reason), then verified;
* ``none`` / ``{none: why}``: nothing to undo; listed as skipped with the reason.

A changed step without a declared inverse refuses the whole rollback (fail closed: a partial undo
would leave the node in a state nobody planned). The rollback run is recorded as its own run
(source ``rollback``), linked both ways: ``rollback.of`` on the new run and ``run.rolled_back``
on the original. This module builds values and links records; the run service executes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.errors import StalePlan, UsageError
from engine.loader import LoadedRunbook
from engine.model import (
    Inverse,
    KubeAction,
    NoInverse,
    Plan,
    PlannedStep,
    Precondition,
    Runbook,
    RunResult,
    RunState,
    Step,
    StepStatus,
)
from engine.params import PreparedRun, prepare_run

if TYPE_CHECKING:
    from engine.runs import RunService
    from engine.store import EventRecord, RunStore

__all__ = ["RollbackTarget", "changed_steps", "inverse_steps", "link", "rollback_target"]

ROLLBACK_OF = "rollback.of"
ROLLED_BACK = "run.rolled_back"
_KEYED = re.compile(r"^node\.(labels|annotations)\[(.+)\]$")


@dataclass(frozen=True)
class RollbackTarget:
    """What ``runbook rollback RUN_ID`` will plan: the rollback runbook for the run's node, the
    steps it skips (no inverse, with why) and the refusals (nothing runs when there is one)."""

    run_id: str
    prepared: PreparedRun
    skipped: tuple[str, ...] = ()
    refused: tuple[str, ...] = field(default_factory=tuple)


def changed_steps(events: Sequence[EventRecord]) -> list[str]:
    """The steps whose action changed something and stayed changed, in the order they ran."""
    changed: list[str] = []
    for e in events:
        if e.kind == "action.result" and e.data.get("changed") and e.step and e.step not in changed:
            changed.append(e.step)
        if e.kind == "step.outcome" and e.data.get("status") == "rolled-back" and e.step in changed:
            changed.remove(e.step)  # the step's own rollback undid it already
    return changed


def _auto_inverse(step: Step, planned: PlannedStep | None) -> tuple[list[Step], str | None]:
    """The kube verb's own inverse from the changes the run planned (their ``before`` values)."""
    assert isinstance(step.action, KubeAction) and step.action.kube.AUTO_INVERSE
    if planned is None or not planned.changes:
        return [], f"step {step.id}: the recorded plan lists no changes to restore"
    out: list[Step] = []
    for n, c in enumerate(planned.changes):
        sid = f"undo-{step.id}"[:60] + (f"-{n}" if len(planned.changes) > 1 else "")
        if c.path == "node.unschedulable":
            verb = {"uncordon": True} if not c.before else {"cordon": True}
            out.append(Step.model_validate({
                "id": sid, "why": f"restore node.unschedulable={bool(c.before)} ({step.id} changed it)",
                "action": {"kube": verb},
                "verify": [{"check": {"expr": f"facts.node.unschedulable == {bool(c.before)}"}, "timeout": "30s"}]}))
            continue
        m = _KEYED.match(c.path)
        if m is None:
            return [], f"step {step.id}: cannot restore {c.path} automatically"
        section, key = m.groups()
        if c.before is None:
            action: dict[str, Any] = {"unlabel": [key]} if section == "labels" else {"patch": {
                "type": "merge", "body": {"metadata": {"annotations": {key: None}}}}}
        else:
            action = {"label": {key: str(c.before)}} if section == "labels" else {"annotate": {key: str(c.before)}}
        verify = []
        if section == "labels":
            spec = {"key": key, "absent": True} if c.before is None else {"key": key, "equals": str(c.before)}
            verify = [{"check": {"node_label": spec}, "timeout": "30s"}]
        shown = "absent" if c.before is None else repr(c.before)
        out.append(Step.model_validate({"id": sid, "why": f"restore {c.path} to {shown} ({step.id} changed it)",
                                        "action": {"kube": action}, "verify": verify}))
    return out, None


def inverse_steps(runbook: Runbook, plan: Plan, changed: Sequence[str]) -> tuple[list[Step], list[str], list[str]]:
    """(rollback steps newest first, skipped notes, refusals) for the steps ``changed``."""
    planned = {s.id: s for s in plan.steps}
    steps: list[Step] = []
    skipped: list[str] = []
    refused: list[str] = []
    for sid in reversed(changed):
        try:
            step = runbook.step(sid)
        except KeyError:  # a step the runbook no longer has
            refused.append(f"step {sid}: not in runbook {runbook.name} any more")
            continue
        inv = step.rollback
        if inv is None:
            refused.append(f"step {sid} changed the node but declares no inverse (rollback: ...); "
                           "nothing is rolled back")
        elif inv == "none" or isinstance(inv, NoInverse):
            why = inv.none if isinstance(inv, NoInverse) else "declared without an inverse"
            skipped.append(f"step {sid}: no inverse: {why}")
        elif inv == "auto" or (isinstance(inv, Inverse) and inv.auto):
            made, problem = _auto_inverse(step, planned.get(sid))
            if problem is not None:
                refused.append(problem)
            if isinstance(inv, Inverse):
                made = [s.model_copy(update={"guards": inv.guards, "why": inv.why or s.why}) for s in made]
            steps += made
        else:
            assert isinstance(inv, Inverse) and inv.action is not None
            steps.append(Step(id=f"undo-{sid}"[:63], why=inv.why or f"undo {sid}", action=inv.action,
                              guards=inv.guards, verify=inv.verify))
    return steps, skipped, refused


def rollback_target(service: RunService, run_id: str) -> RollbackTarget:
    """The rollback of recorded run ``run_id`` (UsageError / StalePlan when it cannot be one)."""
    from engine.store import ACTIVE_STATES

    journal = service.journal
    rec = journal.get_run(run_id)
    if rec.state in ACTIVE_STATES:
        raise UsageError(f"run {run_id} is {rec.state}: roll back a run once it has ended")
    events = journal.events(run_id)
    # A rollback that a guard or its plan blocked changed nothing: it does not count.
    done = [str(e.data.get("run")) for e in events if e.kind == ROLLED_BACK]
    done = [r for r in done if journal.get_run(r).state != "blocked"]
    if done:
        raise UsageError(f"run {run_id} was rolled back already by run {done[-1]} "
                         f"({journal.get_run(done[-1]).state})")
    if any(e.kind == ROLLBACK_OF for e in events):
        raise UsageError(f"run {run_id} is itself a rollback; it is not rolled back in turn")
    plan = service.stored_plan(run_id)
    loaded = service.load(rec.runbook)
    if loaded.digest != plan.runbook_digest:
        raise StalePlan(f"runbook {rec.runbook} changed since run {run_id} was planned (planned "
                        f"{plan.runbook_digest[:12]}, now {loaded.digest[:12]}): its inverses may differ")
    changed = changed_steps(events)
    if not changed:
        raise UsageError(f"run {run_id} changed nothing: there is nothing to roll back")
    steps, skipped, refused = inverse_steps(loaded.runbook, plan, changed)
    node_param = loaded.runbook.node_param or "node"
    book = loaded.runbook.model_copy(update={
        "name": f"{loaded.runbook.name}-rollback"[:63].rstrip("-"),
        "description": f"rollback of run {run_id} ({loaded.runbook.name})",
        "approval": False, "triggers": (), "diagnosis": None, "report": None, "windows": loaded.runbook.windows,
        "preconditions": (Precondition.model_validate({
            "id": "node-exists", "check": {"node_exists": True},
            "message": f"node {{{{ params.{node_param} }}}} is not a node of this cluster"}),),
        "steps": tuple(steps) or (Step.model_validate({"id": "nothing", "action": {"check": {}}}),)})
    synth = LoadedRunbook(runbook=book, path=loaded.path, digest=loaded.digest, playbooks_dir=loaded.playbooks_dir)
    prepared = prepare_run(synth, dict(rec.params))
    return RollbackTarget(run_id, prepared, tuple(skipped), tuple(refused))


def link(journal: RunStore, original: str, rollback_run: str, *, reason: str) -> None:
    """Record the link both ways: the rollback names its original and the original its rollback."""
    journal.append(rollback_run, ROLLBACK_OF, run=original, reason=reason)
    journal.append(original, ROLLED_BACK, run=rollback_run, reason=reason)


def roll_back_after_failure(service: RunService, run_id: str, prepared: PreparedRun, result: RunResult) -> None:
    """``on_failure: {rollback: all}``: after the failing step's own rollback, roll the whole run
    back as a linked run (refusals are journaled on the failed run; nothing is forced)."""
    if result.state is not RunState.FAILED:
        return
    failed = [o for o in result.outcomes if o.status in (StepStatus.FAILED, StepStatus.TIMED_OUT,
                                                          StepStatus.ROLLED_BACK)]
    try:
        wants = bool(failed) and prepared.runbook.step(failed[-1].step).rollback_all
    except KeyError:
        wants = False
    if not wants:
        return
    journal = service.journal
    try:
        target = rollback_target(service, run_id)
        the_plan = service.plan(target.prepared)
    except (UsageError, StalePlan) as e:
        journal.append(run_id, "rollback.refused", reason=str(e))
        return
    if target.refused or the_plan.state.value == "blocked":
        why = "; ".join([*target.refused, *the_plan.blocked_reasons])
        journal.append(run_id, "rollback.refused", reason=why)
        return
    new_id = service.create(target.prepared, the_plan, source="rollback")
    link(journal, run_id, new_id, reason=f"on_failure: rollback all (step {failed[-1].step} failed)")
    sub = service.execute(new_id, target.prepared, the_plan)
    journal.append(run_id, "rollback.finished", run=new_id, state=sub.state.value, reason=sub.reason)
