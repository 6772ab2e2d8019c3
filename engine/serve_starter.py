"""The engine's ``RunStarter`` for ``runbook serve``: paged runs through the same RunService as the CLI.

``submit`` only validates params and records the run (it is on the webhook's request path).
``execute`` (in a worker thread) plans with live facts and previews through ``RunService``; a
blocked plan is recorded as blocked (``RunService.record_blocked``); an ``approve``-mode run is
parked in ``waiting-approval`` with its plan digest (``RunService.park``); an ``auto`` or approved
run goes through ``RunService.execute``: the run guards (never overridden here: the service is
``automatic``), the node Lease, the executor. The journal is the only state, so runs and pending
approvals survive a server restart (``recover``). This module adapts; it decides nothing the
service decides for the CLI too.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from engine.errors import RunbookError, StalePlan, UsageError
from engine.journal import ACTIVE_STATES, FINAL_STATES
from engine.loader import list_runbooks
from engine.model import PlanState, RunState
from engine.params import prepare_run
from engine.runs import RunService
from engine.serve.starter import WEBHOOK_SOURCES, RunOutcome, RunRequest, RunTicket, TriggerSpec

if TYPE_CHECKING:
    from engine.loader import LoadedRunbook
    from engine.run_guards import GuardConfig
    from engine.settings import Settings


class JournalRunStarter:
    """Implements ``engine.serve.starter.RunStarter`` over ``RunService`` and the journal."""

    def __init__(self, settings: Settings, *, lock_wait: float = 0.0, guards: GuardConfig | None = None) -> None:
        self.service = RunService(settings, live=None, lock_wait=lock_wait, automatic=True, guards=guards)
        loaded, problems = list_runbooks(settings.runbooks_dir)
        if problems:
            raise UsageError("; ".join(loc.format(msg) for loc, msg in problems))
        self._runbooks = {lr.name: lr for lr in loaded}
        self._executing: set[str] = set()
        self._guard = threading.Lock()

    @property
    def journal(self) -> Any:
        return self.service.journal

    def trigger_index(self) -> Sequence[TriggerSpec]:
        return [TriggerSpec(runbook=name, trigger=t, node_param=lr.runbook.node_param)
                for name, lr in sorted(self._runbooks.items()) for t in lr.runbook.triggers]

    def submit(self, request: RunRequest) -> RunTicket:
        loaded = self._runbooks.get(request.runbook)
        if loaded is None:
            raise UsageError(f"no runbook named {request.runbook!r}")
        prepared = prepare_run(loaded, dict(request.params), node=request.node)
        run_id = self.service.create(
            prepared, None, source=request.source, approval_required=request.mode == "approve",
            note={"mode": request.mode, "reason": request.reason, "warnings": list(request.warnings),
                  "dedup_key": request.dedup_key, "require_diagnosis": request.require_diagnosis},
            requested_by=request.requested_by or request.source)
        return RunTicket(run_id=run_id, state=RunState.PENDING.value)

    def execute(self, run_id: str) -> RunOutcome:
        with self._guard:
            if run_id in self._executing:
                rec = self.journal.get_run(run_id)
                return RunOutcome(run_id, rec.state, rec.plan_digest, rec.exit_code, "already executing")
            self._executing.add(run_id)
        try:
            return self._execute(run_id)
        except RunbookError as e:
            self.journal.append(run_id, "run.failed", reason=str(e))
            self.journal.set_state(run_id, RunState.FAILED.value, exit_code=e.exit_code)
            return RunOutcome(run_id, RunState.FAILED.value, None, e.exit_code, str(e))
        finally:
            with self._guard:
                self._executing.discard(run_id)

    def _execute(self, run_id: str) -> RunOutcome:
        rec = self.journal.get_run(run_id)
        if rec.state in FINAL_STATES:
            return RunOutcome(run_id, rec.state, rec.plan_digest, rec.exit_code, "already finished")
        interrupted = rec.state == "interrupted"  # read before the claim makes it look alive again
        # Why: a run parked for approval has no owner; whoever executes it owns it from now on, so
        # if this server dies mid-run the run reads "interrupted" and the next server resumes it.
        if not self.journal.claim(run_id):
            return RunOutcome(run_id, rec.state, rec.plan_digest, rec.exit_code,
                              f"executed by another process (pid {rec.owner_pid} on {rec.owner_host})")
        loaded = self._runbooks[rec.runbook]
        if rec.plan is None and self._requires_diagnosis(run_id):
            refused = self._diagnose(run_id, loaded, dict(rec.params))
            if refused is not None:
                return refused
        if rec.plan is None:
            prepared = prepare_run(loaded, dict(rec.params))
            plan = self.service.plan(prepared, preview=rec.approval_required)
            self.service.record_plan(run_id, plan)
            resume = False
        else:
            prepared, plan = self.service.prepare_from_record(run_id)
            resume = interrupted or bool(self.journal.step_progress(run_id)[0])
        if plan.state is PlanState.BLOCKED:
            reason = "; ".join(plan.blocked_reasons)
            self.service.record_blocked(run_id, reason)
            return RunOutcome(run_id, RunState.BLOCKED.value, plan.digest, 3, reason)
        if rec.approval_required and rec.approved_digest != plan.digest:
            self.service.park(run_id, plan, "approve-mode run: POST /runs/{id}/approve with this plan_digest")
            return RunOutcome(run_id, RunState.WAITING_APPROVAL.value, plan.digest, None, "waiting for approval")
        result = self.service.execute(run_id, prepared, plan, approved=True, wait_approval=False, resume=resume)
        return RunOutcome(run_id, result.state.value, plan.digest, result.exit_code, result.reason)

    def _requires_diagnosis(self, run_id: str) -> bool:
        notes = [e.data for e in self.journal.events(run_id) if e.kind == "run.note"]
        return bool(notes and notes[0].get("require_diagnosis"))

    def _diagnose(self, run_id: str, loaded: LoadedRunbook, params: dict[str, Any]) -> RunOutcome | None:
        """The trigger's ``require_diagnosis``: the runbook's declared diagnosis on the node, from facts
        read now. Recorded either way (``diagnosis``, with every piece of evidence); a diagnosis
        that does not match ends the run blocked before any plan: None when it matches."""
        from engine import diagnose

        prepared = prepare_run(loaded, params)
        kube, nodes = self.service.connectors(loaded, prepared.params)
        match = diagnose.check_runbook(loaded.runbook, prepared.node, kube, nodes)
        reason = diagnose.match_reason(match, prepared.node)
        self.journal.append(run_id, "diagnosis", reason=reason, **match.as_json())
        if match.matched:
            return None
        self.service.record_blocked(run_id, reason)
        return RunOutcome(run_id, RunState.BLOCKED.value, None, 3, reason)

    def approve(self, run_id: str, plan_digest: str, approved_by: str) -> Mapping[str, Any]:
        return self.service.approve(run_id, plan_digest, approved_by)

    def reject(self, run_id: str, reason: str, rejected_by: str) -> Mapping[str, Any]:
        rec = self.journal.get_run(run_id)
        if rec.state != RunState.WAITING_APPROVAL.value:
            raise StalePlan(f"run {run_id} is {rec.state}, not waiting for approval")
        self.journal.append(run_id, "approval.rejected", by=rejected_by, reason=reason)
        # Why cancelled wins over a racing approval: execute() returns at once for a final state
        self.journal.set_state(run_id, RunState.CANCELLED.value, exit_code=4)
        self.journal.append(run_id, "run.cancelled", reason=f"rejected by {rejected_by}: {reason}")
        return self.journal.get_run(run_id).summary()

    def runs(self, limit: int = 100) -> Sequence[Mapping[str, Any]]:
        return [r.summary() for r in self.journal.list_runs(limit=limit)]

    def run(self, run_id: str) -> Mapping[str, Any]:
        rec = self.journal.get_run(run_id)
        events = self.journal.events(run_id)
        notes = [e.data for e in events if e.kind == "run.note"]
        requested = [e.data.get("by") for e in events if e.kind == "run.requested"]
        return {**rec.summary(), "plan": rec.plan, "warnings": notes[0].get("warnings", []) if notes else [],
                "reason": notes[0].get("reason", "") if notes else "",
                "dedup_key": notes[0].get("dedup_key", "") if notes else "",
                "requested_by": requested[0] if requested else None,
                "outcome_reason": outcome_reason(events),
                "events": [e.as_dict() for e in events]}

    def record_event(self, run_id: str, kind: str, data: Mapping[str, Any]) -> None:
        self.journal.get_run(run_id)  # UsageError for an unknown id
        self.journal.append(run_id, kind, **dict(data))

    def recover(self) -> Sequence[str]:
        """Runs a previous server left: the ids to execute (pending, interrupted, or approved while
        waiting). Runs still waiting for a person are left waiting (disowned), never re-planned or
        re-announced; runs another live process owns are left to it."""
        out = []
        for rec in self.journal.list_runs(limit=1000, states=ACTIVE_STATES):
            if rec.source not in WEBHOOK_SOURCES or rec.state == "running":
                continue  # a CLI run, or one a live process is executing
            approved = rec.plan_digest is not None and rec.approved_digest == rec.plan_digest
            if rec.approval_required and not approved and self._parked(rec.id):
                self.journal.disown(rec.id)
                continue
            if (rec.state in ("pending", "interrupted") or approved) and self.journal.claim(rec.id):
                out.append(rec.id)
        return list(reversed(out))

    def _parked(self, run_id: str) -> bool:
        """The run's last recorded state is ``waiting-approval`` (whatever became of its owner)."""
        states = [e.data.get("state") for e in self.journal.events(run_id) if e.kind == "run.state"]
        return bool(states) and states[-1] == RunState.WAITING_APPROVAL.value


_OUTCOME_EVENTS = ("run.blocked", "run.failed", "run.cancelled", "run.error", "run.finish",
                   "approval.waiting", "approval.granted")


def outcome_reason(events: Sequence[Any]) -> str:
    """Why the run is where it is: the reason of its last blocked/failed/finished/waiting event
    (e.g. the Lease holder that blocked it), or "" while nothing decided it yet."""
    for e in reversed(events):
        if e.kind in _OUTCOME_EVENTS:
            return str(e.data.get("reason") or e.data.get("error") or "")
    return ""
