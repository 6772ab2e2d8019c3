"""Plan -> StepOutcomes: per step, re-check live, act, verify; on failure roll back and stop.

For each step of the plan, in order:

1. ``step.start``; approval first if the runbook or the step asks for it;
2. re-gather the facts the step's ``skip_if`` and guards need, **live**; work already done -> skipped;
   a guard that does not hold or cannot be evaluated -> blocked (exit 3), before anything acts;
3. ``action.intent`` is emitted **before** acting. The sink is synchronous and may raise: a journal
   that cannot record the intent aborts the run before the action (write-ahead);
4. act (a kube verb through ``engine.kube_verbs``: a node patch, a drain or evictions, a wait; or a
   playbook run with its task lines streamed);
   ``action.result``;
5. verify each check within its timeout: node checks through ``KubeAPI.wait_for_node`` (a watch,
   no sleeping), host checks first against the facts the step's own playbook returned, then by
   polling (tenacity, with injected clock and sleep so unit tests never sleep); ``verify.attempt``
   per attempt;
6. on failure: the step's ``on_failure`` rollback actions, evidence, state failed (exit 1).

Cancellation (``cancel`` event, set on SIGINT/SIGTERM) is checked between actions: the current
action finishes (or, when the operator insists, the connector stops it), its outcome is recorded,
nothing is rolled back, and the run ends ``cancelled`` (exit 4).

Outages: when the API server or the node's host cannot be reached *during* an action or its
verification (a connection error, an unreachable host, a check that stayed unknown until its
timeout because its probe kept failing), nothing is rolled back blindly: the step's evidence is
recorded and the run ends ``interrupted`` (exit 1), to be resumed once the outage is over. A
guard that cannot be evaluated still blocks (fail closed, exit 3).

Resuming: ``completed_steps`` are not redone. For the step whose intent was recorded without a
successful outcome (``started_without_outcome``): ``skip_if`` first; if its action is known to have
run to its end (``interrupted_action_finished``), only its verification runs (with its timeouts);
otherwise one verify pass decides, and a step whose verify does not hold is re-run when it is
idempotent, or only after ``confirm_rerun`` approves (no callback: blocked, evidence
``needs_confirmation``; refused: cancelled).

Test hook (inert unless set): ``RUNBOOK_TEST_KILL_AT=STEP:PHASE[,STEP:PHASE...]`` makes the engine
SIGKILL itself at that point of that step, so fault-injection tests stop it exactly at a step
boundary. Phases: ``before-action`` (``action.intent`` recorded, the effect not started),
``after-action`` (``action.result`` recorded, verification not started), ``after-verify`` (every
verify check held, ``step.outcome`` not recorded), ``after-outcome`` (``step.outcome`` recorded,
the next step not started). Read once per Executor; without the variable nothing happens.

This module never imports ``kubernetes`` or ``ansible_runner``: it talks to the Protocols only.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from engine import checks as chk
from engine import kube_verbs as kv
from engine import node_events
from engine.actions import NoOp, ansible_command, kube_effect
from engine.connectors.base import KubeAPI, NodeAutomation, PlaybookResult
from engine.errors import ExitCode, HostError, KubeError, LockLost, PlanError, RunbookError
from engine.facts import Facts, HostFacts, NodeFacts
from engine.model import (
    AnsibleAction,
    CheckAction,
    KubeAction,
    Plan,
    PlannedStep,
    PlanState,
    Runbook,
    RunResult,
    RunState,
    Step,
    StepOutcome,
    StepStatus,
    Verify,
    parse_duration,
)
from engine.planning import NOTHING_TO_DO, jsonable, render_text, verify_timeout
from engine.probes import gather_probes


class EventSink(Protocol):
    """Receives every event of a run, synchronously. Raising aborts the run (write-ahead journal).

    Kinds and their data (``step`` is set for every step-scoped event):

    * ``run.start``: runbook, version, node, plan_digest, params, resumed, completed
    * ``approval.waiting``: step (None for the runbook), plan_digest, reason
    * ``approval.result``: step, approved
    * ``step.start``: step, planned (change|no-op|blocked), why, resumed
    * ``probe.reused``: step (None for the report), probe, node, age_s: host facts that young (the
      closing facts of the previous Ansible run) were used instead of a new facts run
    * ``guard.result``: step, check, holds, observed
    * ``action.intent``: step, action (kube|ansible), verb, command, summary, rollback
    * ``ansible.task``: step, host, task, status, msg
    * ``action.result``: step, ok, changed, summary, error, rollback, evidence
    * ``verify.attempt``: step, check, attempt, holds, observed, source (playbook|watch|poll), elapsed
    * ``verify.result``: step, check, holds, attempts, elapsed, timed_out
    * ``rollback.start``: step, reason;  ``rollback.result``: step, ok
    * ``step.outcome``: step, status, reason, attempts, started_at, finished_at, evidence
    * ``run.blocked`` / ``run.failed`` / ``run.cancelled`` / ``run.interrupted``: reason
    * ``run.finish``: state, exit_code, reason
    """

    def emit(self, kind: str, **data: Any) -> None: ...


class Progress(EventSink, Protocol):
    """The terminal's view of runs (``engine.live``): every event, plus what the front end tells it."""

    def expect(self, plans: Sequence[Plan], max_parallel: int = 1) -> None:
        """The runs about to start (their nodes and steps), before the first event."""
        ...

    def stop(self) -> None:
        """End the display (its last frame stays) before the closing table is printed."""
        ...


class NullSink:
    def emit(self, kind: str, **data: Any) -> None:
        return None


ConfirmRerun = Callable[[str, str], bool]  # (step id, why a confirmation is needed) -> re-run?
Approver = Callable[[str | None], bool | None]  # (step id or None for the runbook) -> yes/no/still waiting

TEST_KILL_ENV = "RUNBOOK_TEST_KILL_AT"
KILL_PHASES = ("before-action", "after-action", "after-verify", "after-outcome")


def fault_injection_points(value: str | None = None) -> frozenset[tuple[str, str]]:
    """The (step, phase) pairs of ``RUNBOOK_TEST_KILL_AT`` (a fault-injection test hook)."""
    raw = os.environ.get(TEST_KILL_ENV, "") if value is None else value
    points = set()
    for item in raw.split(","):
        step, sep, phase = item.strip().rpartition(":")
        if sep and step and phase in KILL_PHASES:
            points.add((step, phase))
    return frozenset(points)


EXIT_FOR_STATE = {
    RunState.SUCCEEDED: ExitCode.OK,
    RunState.FAILED: ExitCode.FAILED,
    RunState.BLOCKED: ExitCode.BLOCKED,
    RunState.CANCELLED: ExitCode.CANCELLED,
    RunState.WAITING_APPROVAL: ExitCode.BLOCKED,
    RunState.INTERRUPTED: ExitCode.FAILED,
}


@dataclass
class _ActResult:
    ok: bool
    summary: str
    changed: bool = False
    noop: bool = False
    error: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    host_facts: HostFacts | None = None
    outage: bool = False  # the API server or the host could not be reached: the effect is unknown
    refused: bool = False  # the effect refused and left nothing behind (EffectFailed.refused): blocked


@dataclass
class _VerifyResult:
    holds: bool
    attempts: int
    timed_out: bool
    observed: str
    check: str
    evidence: dict[str, Any] = field(default_factory=dict)
    outage: bool = False  # still unknown at the deadline because its probe kept failing


class _StepEnd(Exception):  # control flow inside one step, never escapes
    def __init__(self, status: StepStatus, reason: str, evidence: Mapping[str, Any] | None = None,
                 attempts: int = 0) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.evidence = dict(evidence or {})
        self.attempts = attempts


class Executor:
    """Executes plans through the connectors, emitting every event to ``events``."""

    def __init__(self, kube: KubeAPI | None, nodes: NodeAutomation | None, *, events: EventSink,
                 playbooks_dir: Path, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, wall: Callable[[], float] = time.time,
                 cancel: threading.Event | None = None, poll_interval: float = 2.0,
                 max_poll_interval: float = 10.0, watch_chunk: float = 15.0,
                 inventory_cmd_hint: str = "INVENTORY", host_facts_max_age: float = 10.0,
                 fence: Callable[[], Mapping[str, Any]] | None = None, run_id: str = "") -> None:
        self.kube = kube
        self.run_id = run_id  # stamped on what the run leaves behind (a cordon's runbook.io/cordoned-by)
        self.nodes = nodes
        self.events = node_events.wrap(events, kube)  # issue 15: step outcomes as Node Events too
        self.playbooks_dir = Path(playbooks_dir)
        self.clock = clock
        self.sleep = sleep
        self.wall = wall
        self.cancel = cancel if cancel is not None else threading.Event()
        self.poll_interval = poll_interval
        self.max_poll_interval = max_poll_interval
        self.watch_chunk = watch_chunk
        self.inventory_cmd_hint = inventory_cmd_hint
        # Host facts this young (the closing facts of the playbook that just ran, or the plan's) are
        # used for a step's skip_if/guards and for the report instead of a new Ansible facts run.
        # Node and object reads are always live; verification polls always gather anew. 0: off.
        self.host_facts_max_age = host_facts_max_age
        # Fencing (engine.locks.NodeLock.fence): asked right before each action's intent; returns
        # the token journaled with it, or raises LockLost (the node's Lease is no longer ours).
        self.fence = fence
        # per run
        self._runbook_steps: dict[str, Step] | None = None
        self._plan: Plan | None = None
        self._params: dict[str, Any] = {}
        self._node = ""
        self._baseline: dict[str, Any] = {}  # the plan's baseline: plan-time facts for ``baseline.*`` templates
        # secrets a kube step hands to the run's later playbooks (a bootstrap token: KubeContext.handoff);
        # memory only: passed as extra vars ``runbook_secret_<key>``, never in an event or the command line
        self._handoff: dict[str, str] = {}
        self._kill_points = fault_injection_points()

    def _test_kill(self, step_id: str, phase: str) -> None:
        """The fault-injection hook (module docstring): SIGKILL this process at a step boundary."""
        if (step_id, phase) in self._kill_points:
            os.kill(os.getpid(), signal.SIGKILL)

    # ----------------------------------------------------------------------------------------
    # Run
    # ----------------------------------------------------------------------------------------

    def execute(self, plan: Plan, runbook: Runbook, params: Mapping[str, Any], *,
                completed_steps: set[str] | frozenset[str] = frozenset(),
                started_without_outcome: str | None = None, confirm_rerun: ConfirmRerun | None = None,
                approve: Approver | None = None, approved: bool = False,
                interrupted_action_finished: bool = False) -> RunResult:
        """Run ``plan`` (made from ``runbook`` and ``params``). Returns the result; raises only when the
        event sink raises (the journal could not record) or the plan does not belong to the runbook.

        ``approve`` is asked before the first mutating step when the runbook requires approval, and
        before each step marked ``approval: true``; without it (or when it answers None) the run
        stops in state ``waiting-approval``. ``approved=True`` says the runbook-level approval was
        already given (a resumed, approved run). ``started_without_outcome`` and
        ``interrupted_action_finished`` describe the step a dead engine left half-way (module
        docstring, "Resuming").
        """
        if plan.runbook != runbook.name or {s.id for s in plan.steps} != {s.id for s in runbook.steps}:
            raise PlanError(f"plan for {plan.runbook} does not match runbook {runbook.name}")
        # Why: the digest is what was reviewed and approved; a plan whose content no longer hashes to
        # it (edited in a store, or in memory) is not that plan (issue 25 item 2)
        if plan.digest and plan.compute_digest() != plan.digest:
            raise PlanError(f"plan {plan.digest[:12]}: its content hashes to {plan.compute_digest()[:12]}; "
                            "not the plan that was reviewed, nothing done")
        self._plan, self._params, self._node = plan, dict(params), plan.node
        self._baseline = dict(plan.baseline)
        self._handoff = {}
        self._runbook_steps = {s.id: s for s in runbook.steps}
        emit = self.events.emit
        emit("run.start", runbook=runbook.name, version=runbook.version, node=plan.node,
             plan_digest=plan.digest, params=dict(params), resumed=bool(completed_steps or started_without_outcome),
             completed=sorted(completed_steps))
        if plan.state is PlanState.BLOCKED:
            reason = "; ".join(plan.blocked_reasons) or "the plan is blocked"
            return self._finish(runbook, RunState.BLOCKED, [], reason)

        outcomes: list[StepOutcome] = []
        runbook_approved = approved or not runbook.approval
        for step in runbook.steps:
            if step.id in completed_steps:
                continue
            planned = plan.step(step.id)
            if self.cancel.is_set():
                return self._finish(runbook, RunState.CANCELLED, outcomes, f"cancelled before step {step.id}")
            wants_approval = planned.kind == "change" and (
                step.approval or (not runbook_approved and step.mutating))
            if wants_approval:
                which = step.id if step.approval else None
                answer = self._ask_approval(approve, which)
                if answer is None:
                    return self._finish(runbook, RunState.WAITING_APPROVAL, outcomes,
                                        f"waiting for approval of plan {plan.digest[:12]} before step {step.id}")
                if answer is False:
                    return self._finish(runbook, RunState.CANCELLED, outcomes,
                                        f"approval refused before step {step.id}")
                if which is None:
                    runbook_approved = True
            resumed = step.id == started_without_outcome
            emit("step.start", step=step.id, planned=planned.kind, why=planned.why, resumed=resumed)
            outcome = self._run_step(step, planned.kind, planned.reason, resumed, confirm_rerun,
                                     action_finished=resumed and interrupted_action_finished,
                                     skipped_by_plan=planned_skip_held(planned))
            outcomes.append(outcome)
            emit("step.outcome", step=step.id, status=outcome.status.value, reason=outcome.reason,
                 attempts=outcome.attempts, started_at=outcome.started_at, finished_at=outcome.finished_at,
                 evidence=outcome.evidence)
            self._test_kill(step.id, "after-outcome")
            status = outcome.status
            if outcome.evidence.get("outage"):
                return self._finish(runbook, RunState.INTERRUPTED, outcomes,
                                    f"step {step.id}: {outcome.reason}; resume the run once "
                                    "the API server and the host answer again")
            if status in (StepStatus.FAILED, StepStatus.TIMED_OUT, StepStatus.ROLLED_BACK):
                return self._finish(runbook, RunState.FAILED, outcomes, f"step {step.id}: {outcome.reason}")
            if status is StepStatus.BLOCKED:
                return self._finish(runbook, RunState.BLOCKED, outcomes, f"step {step.id}: {outcome.reason}")
            if status is StepStatus.CANCELLED:
                return self._finish(runbook, RunState.CANCELLED, outcomes, f"step {step.id}: {outcome.reason}")
        if completed_steps or started_without_outcome:
            reason = "resumed: every remaining step succeeded or was already done"
        elif outcomes and all(o.status is StepStatus.SKIPPED for o in outcomes):
            reason = "nothing to do: every step was already done"
        else:
            reason = "every step succeeded or was already done"
        return self._finish(runbook, RunState.SUCCEEDED, outcomes, reason)

    def _ask_approval(self, approve: Approver | None, step: str | None) -> bool | None:
        assert self._plan is not None
        self.events.emit("approval.waiting", step=step, plan_digest=self._plan.digest,
                         reason=f"approval required before {'step ' + step if step else 'the first change'}")
        answer = approve(step) if approve is not None else None
        if answer is not None:
            self.events.emit("approval.result", step=step, approved=bool(answer))
        return answer

    def _finish(self, runbook: Runbook, state: RunState, outcomes: list[StepOutcome], reason: str) -> RunResult:
        assert self._plan is not None
        emit = self.events.emit
        if state is RunState.BLOCKED:
            emit("run.blocked", reason=reason)
        elif state is RunState.FAILED:
            emit("run.failed", reason=reason)
        elif state is RunState.CANCELLED:
            emit("run.cancelled", reason=reason)
        elif state is RunState.INTERRUPTED:
            emit("run.interrupted", reason=reason)
        report = self._report(runbook, outcomes) if state is not RunState.WAITING_APPROVAL else ""
        code = EXIT_FOR_STATE[state]
        emit("run.finish", state=state.value, exit_code=code, reason=reason)
        return RunResult(state=state, exit_code=code, runbook=runbook.name, node=self._node,
                         plan_digest=self._plan.digest, outcomes=tuple(outcomes), report=report, reason=reason)

    def _report(self, runbook: Runbook, outcomes: list[StepOutcome]) -> str:
        if not runbook.report:
            return ""
        probes: set[chk.Probe] = {chk.NODE} | chk.template_probes(runbook.report)  # objects the report names too
        if "facts.host" in runbook.report:
            probes.add(chk.HOST)
        facts = self._gather(probes, host_max_age=self.host_facts_max_age)
        try:
            return render_text(runbook.report, self._params, facts, baseline=self._baseline)
        except RunbookError as e:
            return f"(report could not be rendered: {e})"

    # ----------------------------------------------------------------------------------------
    # One step
    # ----------------------------------------------------------------------------------------

    def _gather(self, probes: set[chk.Probe], *, step: str | None = None, host_max_age: float = 0.0) -> Facts:
        """Live facts; with ``host_max_age``, host facts that young already held by the connector
        are used instead of a new facts run, and the journal says so (``probe.reused``)."""
        facts = gather_probes(probes, self._node, self.kube, self.nodes, clock=self.wall, host_max_age=host_max_age)
        if facts.host_age is not None:
            self.events.emit("probe.reused", step=step, probe=chk.HOST, node=self._node,
                             age_s=round(facts.host_age, 3))
        return facts

    def _run_step(self, step: Step, planned_kind: str, planned_reason: str, resumed: bool,
                  confirm_rerun: ConfirmRerun | None, *, action_finished: bool = False,
                  skipped_by_plan: bool = False) -> StepOutcome:
        started = self.wall()
        attempts = 0
        try:
            status, reason, evidence, attempts = self._step_body(step, planned_kind, planned_reason, resumed,
                                                                 confirm_rerun, action_finished,
                                                                 skipped_by_plan=skipped_by_plan)
        except _StepEnd as end:
            status, reason, evidence, attempts = end.status, end.reason, end.evidence, end.attempts
        except LockLost as e:  # the fence refused the action: nothing was done, the run stops
            self.cancel.set()
            status, reason, evidence = StepStatus.CANCELLED, f"not acted: {e}", {"lock_lost": str(e)}
        return StepOutcome(step=step.id, status=status, reason=reason, attempts=attempts, started_at=started,
                           finished_at=self.wall(), evidence=jsonable(evidence))

    def _step_body(self, step: Step, planned_kind: str, planned_reason: str, resumed: bool,
                   confirm_rerun: ConfirmRerun | None, action_finished: bool = False, *,
                   skipped_by_plan: bool = False) -> tuple[StepStatus, str, dict[str, Any], int]:
        params = self._params
        probes = chk.required_probes([*step.skip_if, *step.guards], params)
        if isinstance(step.action, KubeAction) and step.action.kube.READS_NODE:
            probes.add(chk.NODE)
        facts = self._gather(probes, step=step.id, host_max_age=self.host_facts_max_age)
        evidence: dict[str, Any] = {}
        if facts.host_age is not None:
            evidence["host_facts_age_s"] = round(facts.host_age, 3)
        if facts.errors:
            evidence["probe_errors"] = [f"{e.probe}: {e.message}" for e in facts.errors]

        skip = [chk.evaluate(c, facts, params, baseline=self._baseline) for c in step.skip_if]
        if skip and all(r.holds is True for r in skip):
            return StepStatus.SKIPPED, "already done: " + "; ".join(r.observed for r in skip), evidence, 0

        if resumed and action_finished:
            # The interrupted attempt's action ran to its end (its result is in the journal): only
            # its verification is missing. Verify with the step's timeouts; never act again.
            evidence["resumed"] = "the action had finished before the interruption; verifying it"
            return self._verified_outcome(step, None, None, evidence, "completed by the interrupted attempt "
                                          "(verified on resume)")
        if resumed:
            verified = self._verify_all(step, None, wait=False)
            if verified is None:
                return (StepStatus.SUCCEEDED, "completed by the interrupted attempt (verified on resume)",
                        evidence, len(step.verify))
            if not step.idempotent:
                why = (f"step {step.id} is not idempotent and its action started before the interruption "
                       f"without a recorded outcome; verify does not hold ({verified.observed})")
                if confirm_rerun is None:
                    evidence["needs_confirmation"] = True
                    return StepStatus.BLOCKED, why + "; re-running it needs confirmation", evidence, 0
                if not confirm_rerun(step.id, why):
                    return StepStatus.CANCELLED, "re-run of a non-idempotent step refused", evidence, 0

        check_noop = planned_kind == "no-op" and isinstance(step.action, CheckAction)
        if check_noop and planned_reason.startswith(NOTHING_TO_DO):
            # The plan found nothing to do (a nothing_to_do precondition): a check step changes nothing and
            # has nothing to verify in a run that did nothing; waiting for it would only fail that run.
            return StepStatus.SKIPPED, planned_reason, evidence, 0
        if check_noop and not skipped_by_plan:
            # A check step is a no-op when its verify already held at plan time: it only waits and
            # changes nothing, so it is re-checked live (no waiting): still holds -> skipped; no longer
            # holds -> it waits for its verify like a planned wait (there is nothing to improvise).
            # Why the plan's no-op reason decides, not whether the step has a skip_if: a check step
            # with a skip_if that did not hold at plan time (gpu-fallen-off-bus's gpus-back after the
            # reboot: "not a repeat") was planned a no-op by its verify, and its skip_if not holding
            # live is no news; only a no-op the plan took from its skip_if is refused once that changed.
            if self._verify_all(step, None, wait=False) is None:
                return StepStatus.SKIPPED, planned_reason, evidence, 0
        elif planned_kind == "no-op":
            observed = "; ".join(r.observed for r in skip) or "the action's effect is needed"
            return (StepStatus.BLOCKED, f"planned as no-op ({planned_reason}) but live facts show work is needed "
                    f"({observed}); make a new plan", evidence, 0)
        if planned_kind == "blocked":
            return StepStatus.BLOCKED, f"planned as blocked: {planned_reason}", evidence, 0

        failing = []
        for g in step.guards:
            r = chk.evaluate(g, facts, params, baseline=self._baseline)
            self.events.emit("guard.result", step=step.id,
                             check=chk.describe_bound(g, params, facts, baseline=self._baseline), holds=r.holds,
                             observed=r.observed)
            if r.holds is not True:
                failing.append((g, r))
        if failing:
            evidence["guards"] = [{"check": chk.describe_bound(g, params, facts, baseline=self._baseline),
                                   "holds": r.holds, "observed": r.observed, "evidence": dict(r.evidence)}
                                  for g, r in failing]
            reason = "; ".join(f"guard {chk.describe_bound(g, params, facts, baseline=self._baseline)} "
                               + ("could not be evaluated: " if r.holds is None else "does not hold: ")
                               + r.observed for g, r in failing)
            return StepStatus.BLOCKED, reason, evidence, 0

        try:
            action = chk.bind(step.action, params, facts, baseline=self._baseline)
        except RunbookError as e:
            return StepStatus.FAILED, f"action cannot be rendered: {e}", evidence, 0

        act: _ActResult | None = None
        if not isinstance(action, CheckAction):
            act = self._act(step.id, action, facts, rollback=False)
            evidence["action"] = {"summary": act.summary, "ok": act.ok, "changed": act.changed, **act.evidence}
            if act.error:
                evidence["action"]["error"] = act.error
            if not act.ok and self.cancel.is_set():
                # The operator stopped the action (the connector ended it): record, roll nothing back.
                return StepStatus.CANCELLED, f"cancelled during the action: {act.error or act.summary}", evidence, 0
            if not act.ok and act.outage:
                # Nobody knows what the action did: no blind rollback; a resume re-evaluates the step.
                evidence["outage"] = act.error or act.summary
                return StepStatus.FAILED, f"action failed: {act.error or act.summary}", evidence, 0
            if not act.ok and act.refused:
                # it undid what it had begun (nothing to roll back): the run is refused, as a plan would be
                return StepStatus.BLOCKED, f"refused: {act.error or act.summary}", evidence, 0
            if not act.ok:
                self._on_failure(step, StepStatus.FAILED, f"action failed: {act.error or act.summary}", evidence)
            if not act.noop:
                self._test_kill(step.id, "after-action")

        if self.cancel.is_set() and act is not None and not act.noop:
            quick = self._verify_all(step, act.host_facts, wait=False)
            note = "verification held" if quick is None else f"not verified yet ({quick.observed})"
            return StepStatus.CANCELLED, f"cancelled after the action finished; {note}", evidence, 1

        return self._verified_outcome(step, act, act.host_facts if act else None, evidence,
                                      act.summary if act else "verified")

    def _verified_outcome(self, step: Step, act: _ActResult | None, host_facts: HostFacts | None,
                          evidence: dict[str, Any], summary: str) -> tuple[StepStatus, str, dict[str, Any], int]:
        """Verify the step (with its timeouts) and turn the result into the step's outcome."""
        failure = self._verify_all(step, host_facts, wait=True, evidence=evidence)
        attempts = int(evidence.get("verify_attempts", 0))
        if failure is not None and failure.outage:
            # The check could not be observed (API server or host away), which is not a failure
            # of the step: no rollback; the run is interrupted and a resume verifies again.
            evidence["outage"] = failure.observed
            return (StepStatus.FAILED, f"verify {failure.check} could not be evaluated: {failure.observed}",
                    evidence, attempts)
        if failure is not None:
            status = StepStatus.TIMED_OUT if failure.timed_out else StepStatus.FAILED
            what = "timed out" if failure.timed_out else "failed"
            self._on_failure(step, status, f"verify {failure.check} {what}: {failure.observed}", evidence,
                             attempts=attempts)
        self._test_kill(step.id, "after-verify")
        if act is not None and act.noop:
            return StepStatus.SKIPPED, f"no-op: {act.summary}", evidence, attempts
        return StepStatus.SUCCEEDED, summary, evidence, attempts

    def _on_failure(self, step: Step, status: StepStatus, reason: str, evidence: dict[str, Any],
                    attempts: int = 0) -> None:
        """Run the step's rollback actions (if any), then end the step as failed."""
        rollback = step.rollback_actions
        if not rollback:
            raise _StepEnd(status, reason, evidence, attempts)
        self.events.emit("rollback.start", step=step.id, reason=reason)
        results = []
        ok = True
        for a in rollback:
            probes: set[chk.Probe] = {chk.NODE} if isinstance(a, KubeAction) else set()
            facts = self._gather(probes)
            try:
                bound = chk.bind(a, self._params, facts, baseline=self._baseline)
            except RunbookError as e:
                results.append({"ok": False, "error": f"cannot render rollback action: {e}"})
                ok = False
                continue
            if isinstance(bound, CheckAction):
                continue
            r = self._act(step.id, bound, facts, rollback=True)
            results.append({"summary": r.summary, "ok": r.ok, "error": r.error})
            ok = ok and r.ok
        self.events.emit("rollback.result", step=step.id, ok=ok)
        evidence["failure_status"] = status.value
        evidence["rollback"] = results
        if ok:
            raise _StepEnd(StepStatus.ROLLED_BACK, f"{reason}; rolled back", evidence, attempts)
        raise _StepEnd(status, f"{reason}; rollback failed", evidence, attempts)

    # ----------------------------------------------------------------------------------------
    # Acting
    # ----------------------------------------------------------------------------------------

    def _intent(self, step_id: str, **data: Any) -> None:
        """``action.intent``, after the fence: the node's Lease is still ours (its token goes with it)."""
        if self.fence is not None:
            data["fence"] = dict(self.fence())
        self.events.emit("action.intent", step=step_id, **data)

    def _act(self, step_id: str, action: Any, facts: Facts, *, rollback: bool) -> _ActResult:
        if isinstance(action, KubeAction):
            return self._act_kube(step_id, action, facts, rollback=rollback)
        if isinstance(action, AnsibleAction):
            return self._act_ansible(step_id, action, rollback=rollback)
        return _ActResult(ok=True, summary="nothing to do", noop=True)

    def _kube_context(self, step_id: str) -> kv.KubeContext:
        def wait_until(check: Any, timeout: float) -> tuple[bool, str, Mapping[str, Any]]:
            r = self._verify(step_id, Verify(check=check, timeout=f"{timeout}s"), None, wait=True)
            return r.holds, r.observed, r.evidence

        return kv.KubeContext(self.kube, self._node, self.clock, self.sleep, self.cancel, wait_until,
                              run_id=self.run_id, handoff=self._handoff)

    def _act_kube(self, step_id: str, action: KubeAction, facts: Facts, *, rollback: bool) -> _ActResult:
        emit = self.events.emit
        verb = action.kube
        if self.kube is None and verb.READS_NODE:
            return _ActResult(ok=False, summary="no Kubernetes connection", error="no Kubernetes connection")
        node = facts.node
        if not verb.READS_NODE:
            node = NodeFacts(name=self._node)  # a wait reads no node facts to decide
        intent_sent = False
        last_error = ""
        outage = refused = False
        evidence: dict[str, Any] = {}
        for attempt in range(1, 4):
            if node is None or not node.exists:
                err = "node does not exist" if node is not None else \
                    "node facts unavailable: " + "; ".join(e.message for e in facts.errors)
                return _ActResult(ok=False, summary=err, error=err)
            effect_or_noop = kube_effect(verb, node)
            if isinstance(effect_or_noop, NoOp):
                if intent_sent:
                    emit("action.result", step=step_id, ok=True, changed=False, summary=effect_or_noop.reason,
                         error="", rollback=rollback, evidence={})
                return _ActResult(ok=True, summary=effect_or_noop.reason, noop=True)
            effect = effect_or_noop
            if not intent_sent:
                self._intent(step_id, action="kube", verb=effect.verb, command=effect.command,
                             summary=effect.summary, rollback=rollback)
                intent_sent = True
                if not rollback:
                    self._test_kill(step_id, "before-action")
            try:
                evidence = kv.apply(effect, self._kube_context(step_id))
            except kv.EffectFailed as e:
                last_error, evidence, outage, refused = str(e), e.evidence, e.outage, e.refused
                break
            except RunbookError as e:
                last_error = str(e)
                outage = isinstance(e, KubeError) and e.retryable
                status = getattr(e, "status", None)
                # 409 Conflict / 422 failed `test` op: someone changed the node; re-read and recompute.
                if status in (409, 422) and attempt < 3 and self.kube is not None:
                    try:
                        node = self.kube.read_node(self._node)
                    except RunbookError as e2:
                        last_error = f"{last_error}; re-read failed: {e2}"
                        break
                    continue
                break
            except Exception as e:  # a connector bug must still end as a recorded failure
                last_error = f"{type(e).__name__}: {e}"
                break
            changed = not isinstance(effect, kv.Wait)
            emit("action.result", step=step_id, ok=True, changed=changed, summary=effect.summary, error="",
                 rollback=rollback, evidence=evidence)
            return _ActResult(ok=True, summary=effect.summary, changed=changed, evidence=evidence)
        if outage:
            evidence = {**evidence, "outage": True}
        emit("action.result", step=step_id, ok=False, changed=False, summary="kube action failed", error=last_error,
             rollback=rollback, evidence=evidence)
        return _ActResult(ok=False, summary="kube action failed", error=last_error, evidence=evidence, outage=outage,
                          refused=refused)

    def _act_ansible(self, step_id: str, action: AnsibleAction, *, rollback: bool) -> _ActResult:
        emit = self.events.emit
        spec = action.ansible
        host = self._plan.inventory_host if self._plan and self._plan.inventory_host else self._node
        extravars = dict(spec.vars)
        files = self._files_for_step(step_id)
        if files:
            extravars.setdefault("runbook_files", files)
        command = ansible_command(spec, host, inventory=self.inventory_cmd_hint, extravars=extravars)
        summary = f"run playbook {spec.playbook} on {host}" + (" as root" if spec.become else "")
        # after the command line is made (it is journaled): the secrets a kube step handed over
        extravars.update({f"runbook_secret_{k}": v for k, v in self._handoff.items()})
        self._intent(step_id, action="ansible", verb="playbook", command=command, summary=summary,
                     rollback=rollback)
        if not rollback:
            self._test_kill(step_id, "before-action")
        if self.nodes is None:
            err = "no inventory: playbook steps need --inventory"
            emit("action.result", step=step_id, ok=False, changed=False, summary=summary, error=err,
                 rollback=rollback, evidence={})
            return _ActResult(ok=False, summary=summary, error=err)

        def on_event(ev: Mapping[str, Any]) -> None:
            emit("ansible.task", step=step_id, host=str(ev.get("host", "")), task=str(ev.get("task", "")),
                 status=str(ev.get("status", "")), msg=str(ev.get("msg", ""))[:500])

        try:
            result = self.nodes.run_playbook(self.playbooks_dir / spec.playbook, [self._node], extravars=extravars,
                                             become=spec.become, timeout=parse_duration(spec.timeout),
                                             on_event=on_event)
        except RunbookError as e:
            unreachable = isinstance(e, HostError) and e.unreachable
            emit("action.result", step=step_id, ok=False, changed=False, summary=summary, error=str(e),
                 rollback=rollback, evidence={"outage": True} if unreachable else {})
            return _ActResult(ok=False, summary=summary, error=str(e), outage=unreachable)
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
            emit("action.result", step=step_id, ok=False, changed=False, summary=summary, error=err,
                 rollback=rollback, evidence={})
            return _ActResult(ok=False, summary=summary, error=err)
        evidence = _playbook_evidence(result)
        error = "" if result.ok else _playbook_error(result)
        changed = any(result.changed.values())
        emit("action.result", step=step_id, ok=result.ok, changed=changed, summary=summary, error=error,
             rollback=rollback, evidence=evidence)
        host_facts = result.host_facts.get(self._node) or result.host_facts.get(host)
        return _ActResult(ok=result.ok, summary=summary, changed=changed, error=error, evidence=evidence,
                          host_facts=host_facts, outage=not result.ok and bool(result.unreachable_hosts))

    def _files_for_step(self, step_id: str) -> list[str]:
        """Host files the step's verify checks ask about, for the playbook's closing facts run."""
        if self._runbook_steps is None:
            return []
        step = self._runbook_steps.get(step_id)
        if step is None:
            return []
        probes = chk.required_probes([v.check for v in step.verify], self._params)
        return sorted(p.path for p in probes if isinstance(p, chk.HostFile))

    # ----------------------------------------------------------------------------------------
    # Verifying
    # ----------------------------------------------------------------------------------------

    def _verify_all(self, step: Step, host_facts: HostFacts | None, *, wait: bool,
                    evidence: dict[str, Any] | None = None) -> _VerifyResult | None:
        """None when every verify check holds, else the first failure."""
        total = 0
        results = []
        for v in step.verify:
            r = self._verify(step.id, v, host_facts, wait=wait)
            total += r.attempts
            results.append({"check": r.check, "holds": r.holds, "attempts": r.attempts, "observed": r.observed,
                            **r.evidence})
            if not r.holds:
                if evidence is not None:
                    evidence["verify"] = results
                    evidence["verify_attempts"] = total
                return r
        if evidence is not None:
            evidence["verify"] = results
            evidence["verify_attempts"] = total
        return None

    def _verify(self, step_id: str, v: Verify, host_facts: HostFacts | None, *, wait: bool) -> _VerifyResult:
        params = self._params
        text = chk.describe_bound(v.check, params, baseline=self._baseline)
        try:
            timeout = verify_timeout(v.timeout, params, baseline=self._baseline) if wait else 0.0
        except RunbookError as e:
            return _VerifyResult(False, 0, False, str(e), text)
        emit = self.events.emit
        start = self.clock()
        deadline = start + timeout
        probes = chk.required_probes([v.check], params)
        attempts = 0
        last = chk.CheckResult(None, "not evaluated")
        probe_failed = False  # the last attempt could not observe: its probe (watch, facts) failed

        def report(r: chk.CheckResult, source: str) -> None:
            emit("verify.attempt", step=step_id, check=text, attempt=attempts, holds=r.holds, observed=r.observed,
                 source=source, elapsed=round(self.clock() - start, 3))

        def done(holds: bool, timed_out: bool) -> _VerifyResult:
            emit("verify.result", step=step_id, check=text, holds=holds, attempts=attempts,
                 elapsed=round(self.clock() - start, 3), timed_out=timed_out)
            ev = {"evidence": dict(last.evidence)} if not holds and last.evidence else {}
            return _VerifyResult(holds, attempts, timed_out, last.observed, text, ev,
                                 outage=not holds and wait and last.holds is None and probe_failed)

        host_only = probes and all(p == chk.HOST or isinstance(p, chk.HostFile) for p in probes)
        if host_facts is not None and host_only:
            attempts += 1
            last = chk.evaluate(v.check, Facts(node_name=self._node, host=host_facts, gathered_at=self.wall()), params,
                                baseline=self._baseline)
            report(last, "playbook")
            if last.holds is True:
                return done(True, False)

        # A check over the node and the host (allocatable equal to the host's GPUs) waits on the node's
        # events with the host as the step's playbook just left it; when that wait ends without it, one
        # poll on fresh facts (below) decides.
        node_and_playbook_host = probes == {chk.NODE, chk.HOST} and host_facts is not None
        if (probes == {chk.NODE} or node_and_playbook_host) and self.kube is not None:
            seen: list[chk.CheckResult] = []
            fixed_host = host_facts if node_and_playbook_host else None

            def predicate(node: NodeFacts | None) -> bool:
                nf = node if node is not None else NodeFacts(name=self._node, exists=False)
                r = chk.evaluate(v.check, Facts(node_name=self._node, node=nf, host=fixed_host,
                                                gathered_at=self.wall()), params, baseline=self._baseline)
                seen.append(r)
                return r.holds is True

            while True:
                remaining = max(0.0, deadline - self.clock())
                chunk = min(remaining, self.watch_chunk)
                seen.clear()
                attempts += 1
                probe_failed = False
                try:
                    ok, node = self.kube.wait_for_node(self._node, predicate, chunk)
                except RunbookError as e:
                    ok, node = False, None
                    probe_failed = True
                    seen.append(chk.CheckResult(None, f"watch failed: {e}", {"error": str(e)}))
                    if chunk > 0:
                        self.sleep(min(self.poll_interval, max(0.0, deadline - self.clock())))
                if seen:
                    last = seen[-1]
                elif node is not None:
                    last = chk.evaluate(v.check, Facts(node_name=self._node, node=node, host=fixed_host,
                                                       gathered_at=self.wall()), params, baseline=self._baseline)
                report(last, "watch")
                if ok:
                    return done(True, False)
                if node_and_playbook_host and (self.clock() >= deadline or self.cancel.is_set()):
                    break  # the host may have changed since its playbook ran: one fresh poll decides
                if self.clock() >= deadline or self.cancel.is_set():
                    return done(False, timeout > 0)

        # Poll (host facts over Ansible, object lists, mixed checks), with tenacity.
        import tenacity

        def attempt_once() -> chk.CheckResult:
            nonlocal attempts, last, probe_failed
            attempts += 1
            facts = self._gather(probes)
            last = chk.evaluate(v.check, facts, params, baseline=self._baseline)
            probe_failed = bool(facts.errors)
            report(last, "poll")
            return last

        def stop(_: tenacity.RetryCallState) -> bool:
            return self.clock() >= deadline or self.cancel.is_set()

        backoff = tenacity.wait_exponential(multiplier=self.poll_interval, min=self.poll_interval,
                                            max=self.max_poll_interval)

        def wait_fn(rs: tenacity.RetryCallState) -> float:
            return max(0.0, min(backoff(rs), deadline - self.clock()))

        retrying = tenacity.Retrying(stop=stop, wait=wait_fn, sleep=self.sleep,
                                     retry=tenacity.retry_if_result(lambda r: r.holds is not True),
                                     retry_error_callback=lambda rs: rs.outcome.result() if rs.outcome else last)
        result = retrying(attempt_once)
        holds = result.holds is True
        return done(holds, not holds and timeout > 0)


def _playbook_evidence(result: PlaybookResult) -> dict[str, Any]:
    ev: dict[str, Any] = {"status": result.status, "rc": result.rc, "changed": dict(result.changed)}
    if result.failed_hosts:
        ev["failed_hosts"] = dict(result.failed_hosts)
    if result.unreachable_hosts:
        ev["unreachable_hosts"] = dict(result.unreachable_hosts)
    if result.diffs:
        ev["diffs"] = {h: list(d) for h, d in result.diffs.items()}
    return ev


def _playbook_error(result: PlaybookResult) -> str:
    parts = [f"unreachable {h}: {m}" for h, m in result.unreachable_hosts.items()]
    parts += [f"failed {h}: {m}" for h, m in result.failed_hosts.items()]
    if not parts:
        parts.append(f"playbook {result.status} (rc {result.rc})")
    return "; ".join(parts)


def planned_skip_held(planned: PlannedStep) -> bool:
    """Whether the plan made this step a no-op because every one of its ``skip_if`` held."""
    return planned.kind == "no-op" and bool(planned.skip_if) and all(e.holds is True for e in planned.skip_if)
