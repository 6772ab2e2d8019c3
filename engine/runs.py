"""The life of one run, shared by the CLI and the server: record -> lock -> execute -> record.

A run is created in the journal with its plan and digest, takes the node's Lease, executes
through ``engine.execution.Executor`` with every event written to the journal before it takes
effect (write-ahead), and ends with its final state recorded and the Lease released. Approvals,
resumes after a crash and the server's ``RunStarter`` all go through :class:`RunService`, so
there is one path, not one per front-end. Printing belongs to the caller (``engine.app``).

Resuming (``execute(..., resume=True)``): the run is claimed atomically (two resumes of one run
never both proceed), the journal says which steps are done and which one was left half-way
(``Journal.progress``), and the same run id takes over its own node Lease. A run that cannot
continue for now stays ``interrupted`` (resumable): the API server or a host went away mid-run,
its Lease is held by another run, or a non-idempotent step needs a confirmation nobody could give.
"""

from __future__ import annotations

import getpass
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine import api
from engine.checks import HOST
from engine.errors import ExitCode, LockHeld, RunbookError, StalePlan, UsageError
from engine.journal import Journal, JournalSink, StepProgress
from engine.locks import DEFAULT_TTL_SECONDS, NodeLock, acquire_node_lock
from engine.model import AnsibleAction, Plan, RunResult, RunState
from engine.output import Fanout

if TYPE_CHECKING:
    from engine.connectors.base import KubeAPI, NodeAutomation
    from engine.settings import Settings

APPROVAL_POLL_SECONDS = 0.5


def needs_hosts(loaded: api.LoadedRunbook, params: Mapping[str, Any]) -> bool:
    """Whether a runbook reads host facts or runs playbooks (and so needs an inventory)."""
    from engine.probes import runbook_probes

    rb = loaded.runbook
    return HOST in runbook_probes(rb, params) or any(isinstance(s.action, AnsibleAction) for s in rb.steps)


def current_user() -> str:
    try:
        return os.environ.get("USER") or getpass.getuser()
    except OSError:
        return f"uid-{os.getuid()}"


@dataclass
class RunService:
    """Runs runbooks for one front-end (a CLI invocation or a server) with one journal."""

    settings: Settings
    live: Any = None  # an extra EventSink (the terminal's live view)
    lock_wait: float = 0.0
    lock_ttl: int = DEFAULT_TTL_SECONDS
    approval_timeout: float = 3600.0
    # Executor keyword arguments (clock, sleep, wall, poll_interval): tests run on fake time.
    executor_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.journal: Journal = self.settings.open_journal()

    # -- preparation ----------------------------------------------------------------------------

    def load(self, name_or_path: str) -> api.LoadedRunbook:
        return api.load(name_or_path, self.settings.runbooks_dir)

    def connectors(self, loaded: api.LoadedRunbook, params: Mapping[str, Any]
                   ) -> tuple[KubeAPI, NodeAutomation | None]:
        nodes = self.settings.nodes(loaded.playbooks_dir) if needs_hosts(loaded, params) else None
        return self.settings.kube(), nodes

    def plan(self, prepared: api.PreparedRun, *, preview: bool = True, ttl: float | None = None) -> Plan:
        nodes = self.settings.nodes(prepared.loaded.playbooks_dir) if needs_hosts(prepared.loaded, prepared.params) \
            else None
        # Ansible first: its run takes seconds, building the Kubernetes client (imports) a fraction
        # of one, done meanwhile.
        host_work = api.start_host_work(prepared, nodes, preview=preview)
        kube = self.settings.kube()
        hint = str(self.settings.inventory) if self.settings.inventory else "INVENTORY"
        kwargs: dict[str, Any] = {"preview": preview, "inventory_cmd_hint": hint, "host_work": host_work}
        if ttl is not None:
            kwargs["ttl"] = ttl
        return api.plan(prepared, kube, nodes, **kwargs)

    # -- records --------------------------------------------------------------------------------

    def create(self, prepared: api.PreparedRun, plan: Plan | None, *, source: str = "cli",
               approval_required: bool = False, note: Mapping[str, Any] | None = None,
               state: str = "pending", requested_by: str | None = None) -> str:
        run_id = self.journal.create_run(prepared.loaded.name, prepared.params, [prepared.node], source=source,
                                         approval_required=approval_required, state=state)
        # Why: "the requester cannot approve their own run" needs to know who asked (the CLI's user,
        # or the server's sender identity).
        self.journal.append(run_id, "run.requested", by=requested_by or current_user())
        if note:
            self.journal.append(run_id, "run.note", **dict(note))
        if plan is not None:
            self.record_plan(run_id, plan)
        return run_id

    def record_plan(self, run_id: str, plan: Plan) -> None:
        self.journal.set_plan(run_id, plan.model_dump(mode="json"), plan.digest)
        self.journal.append(run_id, "plan", plan_digest=plan.digest, state=plan.state.value,
                            steps=[{"id": s.id, "kind": s.kind, "summary": s.summary} for s in plan.steps])

    def stored_plan(self, run_id: str) -> Plan:
        rec = self.journal.get_run(run_id)
        if rec.plan is None:
            raise UsageError(f"run {run_id} has no recorded plan")
        return Plan.model_validate(rec.plan)

    def approve(self, run_id: str, plan_digest: str, approved_by: str | None = None) -> Mapping[str, Any]:
        return self.journal.record_approval(run_id, plan_digest, approved_by or current_user()).summary()

    # -- execution ------------------------------------------------------------------------------

    def wait_for_approval(self, run_id: str, digest: str, *, timeout: float | None = None,
                          cancel: threading.Event | None = None) -> bool | None:
        """Poll the journal until someone approves ``digest`` (True) or the timeout passes (None)."""
        deadline = time.monotonic() + (self.approval_timeout if timeout is None else timeout)
        self.journal.set_state(run_id, RunState.WAITING_APPROVAL.value)
        while True:
            rec = self.journal.get_run(run_id)
            if rec.approved_digest == digest:
                self.journal.set_state(run_id, RunState.RUNNING.value)
                return True
            if time.monotonic() >= deadline or (cancel is not None and cancel.is_set()):
                return None
            time.sleep(APPROVAL_POLL_SECONDS)

    def execute(self, run_id: str, prepared: api.PreparedRun, plan: Plan, *,
                cancel: threading.Event | None = None, approved: bool = False,
                wait_approval: bool = True, resume: bool = False,
                confirm_rerun: Callable[[str, str], bool] | None = None) -> RunResult:
        """Take the node's Lease, execute, record the final state, release the Lease."""
        kube, nodes = self.connectors(prepared.loaded, prepared.params)
        journal = self.journal
        progress = StepProgress(completed=frozenset())
        if resume:
            if not journal.claim(run_id):
                rec = journal.get_run(run_id)
                raise UsageError(f"run {run_id} is being executed by another process "
                                 f"(pid {rec.owner_pid} on {rec.owner_host})")
            progress = journal.progress(run_id)
            journal.append(run_id, "run.resume", completed=sorted(progress.completed),
                           started_without_outcome=progress.interrupted_step,
                           action_finished=progress.action_finished)
            if progress.rollback_started:
                return self._stop(run_id, prepared, plan, RunState.FAILED, ExitCode.FAILED,
                                  f"step {progress.interrupted_step} failed and the engine died while rolling "
                                  "it back; nothing was done on resume: check the node and finish by hand")
        journal.set_state(run_id, RunState.RUNNING.value)
        cancel = cancel if cancel is not None else threading.Event()
        lock: NodeLock | None = None
        try:
            lock = acquire_node_lock(kube, prepared.node, run_id, ttl=self.lock_ttl, wait=self.lock_wait)

            def lost(holder: str) -> None:
                # Someone else may remediate the node now: stop before the next action (the fence
                # refuses it anyway), then say so.
                cancel.set()
                journal.append(run_id, "lock.lost", node=prepared.node, holder=holder,
                               reason=lock.lost_reason if lock is not None else "")

            lock.on_lost = lost
            lock.start_renewing()
            journal.append(run_id, "lock.acquired", node=prepared.node, lease=lock.lease.name,
                           namespace=lock.lease.namespace, resumed=resume)
        except LockHeld as e:
            # A resume that finds the node taken stays resumable; a new run is simply blocked.
            state = RunState.INTERRUPTED if resume else RunState.BLOCKED
            return self._stop(run_id, prepared, plan, state, e.exit_code, str(e), event="run.blocked")

        def approver(step: str | None) -> bool | None:
            if not wait_approval:
                journal.set_state(run_id, RunState.WAITING_APPROVAL.value)
                return None
            if self.live is not None:
                self.live.emit("approval.waiting", reason=f"run `runbook approve {run_id} --plan-digest "
                               f"{plan.digest}` from another terminal")
            return self.wait_for_approval(run_id, plan.digest, cancel=cancel)

        sink = Fanout(JournalSink(journal, run_id), self.live)
        try:
            result = self._run_executor(prepared, plan, kube, nodes, sink, cancel=cancel, approve=approver,
                                        approved=approved, confirm_rerun=confirm_rerun, progress=progress,
                                        fence=lock.fence)
        except (KeyboardInterrupt, SystemExit) as e:
            # The operator insisted (a third Ctrl-C): the run is not finished, and resumable.
            journal.append(run_id, "run.error", error=f"{type(e).__name__}: stopped at once by the operator")
            journal.set_state(run_id, RunState.INTERRUPTED.value, exit_code=ExitCode.CANCELLED)
            raise
        except BaseException as e:
            # The journal could not record, or the engine itself broke: the run is not finished.
            journal.append(run_id, "run.error", error=f"{type(e).__name__}: {e}")
            if not isinstance(e, RunbookError):
                journal.set_state(run_id, RunState.FAILED.value, exit_code=1)
            raise
        finally:
            if lock is not None:
                lock.release()
                journal.append(run_id, "lock.released", node=prepared.node, lost_to=lock.lost)
        if result.state is RunState.WAITING_APPROVAL:
            journal.set_state(run_id, RunState.WAITING_APPROVAL.value)
            journal.disown(run_id)  # parked on purpose: not "interrupted" when this process exits
        elif result.state is RunState.BLOCKED and result.outcomes and \
                result.outcomes[-1].evidence.get("needs_confirmation"):
            journal.append(run_id, "run.resumable", reason=result.reason)
            journal.set_state(run_id, RunState.INTERRUPTED.value, exit_code=result.exit_code)
        else:
            journal.set_state(run_id, result.state.value, exit_code=result.exit_code)
        return result

    def _run_executor(self, prepared: api.PreparedRun, plan: Plan, kube: KubeAPI, nodes: NodeAutomation | None,
                      sink: Any, *, cancel: threading.Event | None, approve: Callable[[str | None], bool | None],
                      approved: bool, confirm_rerun: Callable[[str, str], bool] | None,
                      progress: StepProgress, fence: Callable[[], Mapping[str, Any]] | None = None) -> RunResult:
        """``engine.api.run``, plus where a resumed run's half-done step stands."""
        from engine.execution import Executor

        executor = Executor(kube, nodes, events=sink, playbooks_dir=prepared.loaded.playbooks_dir, cancel=cancel,
                            inventory_cmd_hint=str(self.settings.inventory or "INVENTORY"), fence=fence,
                            **dict(self.executor_options))
        return executor.execute(plan, prepared.runbook, prepared.params, completed_steps=progress.completed,
                                started_without_outcome=progress.interrupted_step, confirm_rerun=confirm_rerun,
                                approve=approve, approved=approved,
                                interrupted_action_finished=progress.action_finished)

    def _stop(self, run_id: str, prepared: api.PreparedRun, plan: Plan, state: RunState, exit_code: int,
              reason: str, *, event: str | None = None) -> RunResult:
        """End (or park, for ``interrupted``) a run before the executor starts."""
        default = {RunState.FAILED: "run.failed", RunState.BLOCKED: "run.blocked"}.get(state, "run.interrupted")
        self.journal.append(run_id, event or default, reason=reason)
        self.journal.set_state(run_id, state.value, exit_code=exit_code)
        return RunResult(state=state, exit_code=exit_code, runbook=prepared.loaded.name, node=prepared.node,
                         plan_digest=plan.digest, reason=reason)

    def prepare_from_record(self, run_id: str) -> tuple[api.PreparedRun, Plan]:
        """Rebuild a recorded run (resume, approvals): same runbook, params and plan."""
        rec = self.journal.get_run(run_id)
        plan = self.stored_plan(run_id)
        loaded = self.load(rec.runbook)
        if loaded.digest != plan.runbook_digest:
            raise StalePlan(f"runbook {rec.runbook} changed since run {run_id} was planned "
                            f"(planned {plan.runbook_digest[:12]}, now {loaded.digest[:12]})")
        prepared = api.prepare_run(loaded, dict(rec.params))
        return prepared, plan


def select_fleet(service: RunService, loaded: api.LoadedRunbook, selector: str,
                 raw_params: Sequence[str]) -> list[api.PreparedRun]:
    nodes = api.select_nodes(service.settings.kube(), selector)
    if not nodes:
        raise UsageError(f"no node matches the selector {selector!r}")
    return api.prepare_fleet(loaded, list(raw_params), nodes)


__all__ = ["RunService", "needs_hosts", "select_fleet"]


