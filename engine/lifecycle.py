"""A run's life after it was recorded: continue, take over, approve, reject, cancel.

``engine.runs.RunService`` creates, plans, records, parks, guards, locks and executes; this module
holds the decisions about a run that is already in the store, each written once for every front
end (``runbook resume`` and ``runbook approve`` in ``engine.app``, the server's starter in
``engine.serve_starter``, a takeover of a silent replica's run, and next remediation objects and
escalation):

* :func:`continue_run`: continue a recorded run where it stands: plan it if it was never planned
  (a server that died with a queued run), else rebuild it from the record (same runbook digest,
  params and plan); a blocked plan ends it blocked; an approve-mode run without an approval of
  this plan waits (the server parks it; a person is told); then the run service executes it,
  resuming from the recorded progress;
* :func:`take_over`: claim a run another replica stopped executing, and record why;
* :func:`approve`, :func:`reject`, :func:`cancel`: a person's decision on a parked run.

Every check that must hold before a recorded run goes on (its integrity, who may continue it)
belongs in :func:`continue_run` and :func:`take_over`, the single doors. Printing and prompting stay
with the front ends: they pass callbacks (``on_planned``, ``before_execute``) and read the returned
:class:`Continued`. This module never imports ``kubernetes`` or ``ansible_runner``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import ExitCode, StalePlan, UsageError
from engine.integrity import ESCALATED_EVENT
from engine.model import Plan, PlanState, RunResult, RunState
from engine.params import prepare_run

if TYPE_CHECKING:
    from engine.loader import LoadedRunbook
    from engine.params import PreparedRun
    from engine.runs import RunService
    from engine.store import RunRecord, StepProgress

__all__ = ["Continuation", "Continued", "approve", "cancel", "continue_run", "reject", "take_over"]


@dataclass(frozen=True)
class Continuation:
    """A recorded run about to be executed again: what a front end shows before it confirms."""

    record: RunRecord
    prepared: PreparedRun
    plan: Plan
    progress: StepProgress
    approved: bool  # a person approved this very plan
    resume: bool  # continue from the recorded progress (claims the run, takes over its own Lease)

    @property
    def steps_left(self) -> list[str]:
        return [s.id for s in self.plan.steps if s.id not in self.progress.completed]


@dataclass(frozen=True)
class Continued:
    """What :func:`continue_run` did: the run's state now, its exit code (None while it waits),
    why, and the executor's result when it ran."""

    run_id: str
    state: RunState
    exit_code: int | None
    reason: str
    plan_digest: str | None = None
    result: RunResult | None = None
    executed: bool = False


def continue_run(service: RunService, run_id: str, *, automatic: bool, taken_over: bool = False,
                 runbooks: Mapping[str, LoadedRunbook] | None = None,
                 cancel_scope: Callable[[], AbstractContextManager[threading.Event | None]] | None = None,
                 overrides: Mapping[str, str] | None = None,
                 confirm_rerun: Callable[[str, str], bool] | None = None,
                 on_planned: Callable[[Plan], None] | None = None,
                 before_execute: Callable[[Continuation], None] | None = None,
                 before_plan: Callable[[RunRecord], Continued | None] | None = None,
                 after_claim: Callable[[RunRecord], Continued | None] | None = None,
                 cancel_event: threading.Event | None = None) -> Continued:
    """Continue the recorded run ``run_id`` (see the module's docstring); the one function every
    front end calls for it.

    ``automatic`` (the server): the run is claimed before anything else (another live process
    executing it is answered, not fought), an unplanned run is planned with previews only for
    approve-mode runs, an approve-mode run without an approval of this plan is parked for one, and
    the run goes on without anyone to ask. A person (``runbook resume``): a run still ``pending`` or
    ``running`` is refused (``UsageError``); one waiting for an approval it does not have is left
    waiting (exit 3); guard ``overrides`` and ``confirm_rerun`` (re-running a non-idempotent step)
    are the person's, and ``cancel_scope()`` (signal handling) is entered around the execution only,
giving the event that cancels it. ``taken_over``: the run was claimed from a silent replica (:func:`take_over`).
    ``runbooks``: runbooks already loaded by name (the server's, loaded at its start).
    ``after_claim``: a gate on any run once it may go on (claimed; for a person, once it is not
    another process's): the server's maintenance windows; a ``Continued`` ends it there.
    ``before_plan``: a gate on a never-planned run (the trigger's ``require_diagnosis``): a
    ``Continued`` ends the continuation there. ``on_planned(plan)``: an unplanned run was just
    planned. ``before_execute(continuation)``: last word before execution (show, confirm; raise to
    refuse). ``cancel_event`` (automatic): the run's cancel event (a remediation object deleted or timed
    out): set before execution, the run ends ``cancelled``; set during it, the executor finishes the
    step in flight and starts nothing new."""
    rec = service.journal.get_run(run_id)
    if rec.state.is_final:
        return Continued(run_id, rec.state, rec.exit_code, "already finished", rec.plan_digest)
    # Why first: a run the server did not create, or whose sealed fields changed (engine.integrity),
    # is never planned, resumed, taken over or executed; it is marked blocked and nothing else happens.
    unverified = service.refuse_unverified(run_id)
    if unverified is not None:
        return Continued(run_id, RunState.BLOCKED, ExitCode.BLOCKED, unverified, rec.plan_digest)
    approval_required = requires_approval(service, rec)
    interrupted = rec.state.is_resumable or taken_over  # read before a claim makes it look alive again
    if automatic:
        # Why: a run parked for approval has no owner; whoever executes it owns it from now on, so
        # if this process dies mid-run the run reads "interrupted" and the next server resumes it.
        if not service.journal.claim(run_id):
            return Continued(run_id, rec.state, rec.exit_code,
                             f"executed by another process (pid {rec.owner_pid} on {rec.owner_host})",
                             rec.plan_digest)
    elif rec.state in (RunState.RUNNING, RunState.PENDING):
        raise UsageError(f"run {run_id} is still {rec.state} (pid {rec.owner_pid} on {rec.owner_host})")
    if after_claim is not None:
        stopped = after_claim(rec)
        if stopped is not None:
            return stopped
    if rec.plan is None:
        if before_plan is not None:
            stopped = before_plan(rec)
            if stopped is not None:
                return stopped
        # Never planned (a server that died with a queued run, or a queued page): plan now.
        loaded = runbooks[rec.runbook] if runbooks is not None and rec.runbook in runbooks else \
            service.load(rec.runbook)
        prepared = prepare_run(loaded, dict(rec.params))
        plan = service.plan(prepared, preview=approval_required if automatic else True)
        service.record_plan(run_id, plan)
        if on_planned is not None:
            on_planned(plan)
        resume = not automatic
    else:
        prepared, plan = service.prepare_from_record(run_id)
        resume = True if not automatic else interrupted or bool(service.journal.step_progress(run_id)[0])
    if plan.state is PlanState.BLOCKED:
        reason = "; ".join(plan.blocked_reasons)
        service.record_blocked(run_id, reason)
        return Continued(run_id, RunState.BLOCKED, ExitCode.BLOCKED, reason, plan.digest)
    approved = rec.approved_digest == plan.digest
    if automatic and approval_required and not approved:
        service.park(run_id, plan, "approve-mode run: POST /runs/{id}/approve with this plan_digest")
        return Continued(run_id, RunState.WAITING_APPROVAL, None, "waiting for approval", plan.digest)
    if not automatic and rec.state is RunState.WAITING_APPROVAL and not approved:
        return Continued(run_id, RunState.WAITING_APPROVAL, ExitCode.BLOCKED,
                         f"run {run_id} is waiting for approval of plan {plan.digest}", plan.digest)
    if before_execute is not None:
        before_execute(Continuation(rec, prepared, plan, service.journal.progress(run_id), approved, resume))
    if automatic:
        if cancel_event is not None and cancel_event.is_set():
            reason = "cancelled before it started: " + _cancel_reason(service, run_id)
            done = cancel(service, run_id, reason)
            return Continued(run_id, done.state, done.exit_code, reason, plan.digest)
        result = service.execute(run_id, prepared, plan, approved=True, wait_approval=False, resume=resume,
                                 cancel=cancel_event)
    else:
        with (cancel_scope or nullcontext)() as event:
            result = service.execute(run_id, prepared, plan, cancel=event, approved=approved, resume=resume,
                                     confirm_rerun=confirm_rerun, overrides=overrides)
    return Continued(run_id, result.state, result.exit_code, result.reason, plan.digest, result, executed=True)


def requires_approval(service: RunService, rec: RunRecord) -> bool:
    """The run waits for a person's approval: created so, or escalated to it since (a recovered
    automatic run the server's rules no longer let run alone: ``integrity.ESCALATED_EVENT``, sealed)."""
    return rec.approval_required or any(e.kind == ESCALATED_EVENT for e in service.journal.events(rec.id))


def _cancel_reason(service: RunService, run_id: str) -> str:
    """Why the run was asked to stop: the newest ``run.cancel_requested`` event's reason."""
    asked = [e for e in service.journal.events(run_id) if e.kind == "run.cancel_requested"]
    return str(asked[-1].data.get("reason") or "") if asked else ""


def take_over(service: RunService, rec: RunRecord, reason: str) -> bool:
    """Claim a run whose executor (another replica) went silent, and record that this process
    continues it (``run.taken_over``: why, and the previous owner). False, changing nothing, when
    another live process holds it. The caller then continues it (``continue_run(taken_over=True)``)."""
    if service.refuse_unverified(rec.id) is not None or not service.journal.claim(rec.id):
        return False
    service.journal.append(rec.id, "run.taken_over", reason=reason,
                           previous_owner=f"{rec.owner_host}/{rec.owner_pid}")
    return True


def approve(service: RunService, run_id: str, plan_digest: str, approved_by: str, *,
            roles: frozenset[str] = frozenset()) -> Mapping[str, Any]:
    """Record an approval of the run's current plan under the approval policy (``RunService.approve``,
    ``engine.approvals``): ``StalePlan`` for another digest or a run not waiting for approval,
    ``UsageError`` for an unknown run. ``approved_by`` (and ``roles``) are the identity the front end
    established (a credential's, the kubeconfig's, the operating-system user's), never a name typed
    into a request. The run's summary, with ``approvals`` (how many the policy counts)."""
    return service.approve(run_id, plan_digest, approved_by, roles=roles)


def cancel(service: RunService, run_id: str, reason: str) -> RunRecord:
    """End a run that is not executing (waiting for approval) as ``cancelled`` (exit 4). A racing
    approval loses: ``continue_run`` returns at once for a final state."""
    service.journal.set_state(run_id, RunState.CANCELLED, exit_code=ExitCode.CANCELLED)
    service.journal.append(run_id, "run.cancelled", reason=reason)
    return service.journal.get_run(run_id)


def reject(service: RunService, run_id: str, reason: str, rejected_by: str) -> RunRecord:
    """A person refuses the plan of a run waiting for approval: recorded, and the run cancelled."""
    rec = service.journal.get_run(run_id)
    if rec.state is not RunState.WAITING_APPROVAL:
        raise StalePlan(f"run {run_id} is {rec.state}, not waiting for approval")
    service.journal.append(run_id, "approval.rejected", by=rejected_by, reason=reason)
    return cancel(service, run_id, f"rejected by {rejected_by}: {reason}")

