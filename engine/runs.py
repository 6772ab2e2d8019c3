"""The run service: the one road from every front end to the executor.

``runbook run`` (one node or a fleet), ``runbook apply``, ``runbook resume`` and ``runbook serve``'s
starter all go through :class:`RunService`, so a run is planned, guarded, locked, executed and
recorded the same way whoever started it:

1. **targets**: a runbook and params for one node, or for every node a label selector matches
   (one node is a fleet of one);
2. **plan** (``plan_targets``): live facts, read-only, with the host-facts run started before the
   Kubernetes client is built, for one node or many (one facts run over every host);
3. **record**: a blocked plan is recorded as a blocked run and changes nothing; an approve-mode run
   is parked in ``waiting-approval`` with its plan digest (``park``);
4. **guard** (``engine.run_guards``): before a node's Lease is taken, the run guards (exclusion
   labels, kured's lock, NodeHealthCheck pause, GPU budget, unhealthy capacity) are evaluated; a
   blocking verdict blocks the node (a guard that cannot be evaluated blocks). A person may pass a
   named guard with a reason; the override is journaled with who and why. Automatic runs (the
   server) never pass overrides;
5. **execute**: take the node's Lease, run ``engine.execution.Executor`` with every event written to
   the journal first, record the final state, release the Lease. A fleet (``run_targets``) runs in
   rolling batches of ``max_parallel`` nodes, ``settle`` seconds apart, stopping new batches after
   ``max_failures`` failed nodes; the Ansible steps of one batch are one ``ansible-playbook``
   process over the batch's hosts (``engine.batch``).

Resuming (``execute(..., resume=True)``): the run is claimed atomically (two resumes of one run
never both proceed), the journal says which steps are done and which one was left half-way
(``RunStore.progress``), and the same run id takes over its own node Lease. A run that cannot
continue for now stays ``interrupted`` (resumable): the API server or a host went away mid-run,
its Lease is held by another run, a guard blocks it, or a non-idempotent step needs a confirmation
nobody could give.

What happens to a run once it is recorded (continue it, take it over, approve, reject, cancel) is
``engine.lifecycle``'s, over this service.

Printing and prompting belong to the front ends (``engine.app``, ``engine.serve_starter``): this
module returns values and writes the journal; it never imports ``kubernetes`` or ``ansible_runner``.
"""

from __future__ import annotations

import getpass
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

from engine import loader, planning, previews, probes
from engine.batch import SharedPlaybooks
from engine.budget import Claim, ClusterBudget, budget_configured, budget_verdicts, gpu_count, read_nodes
from engine.checks import HOST
from engine.errors import ExitCode, LockHeld, RunbookError, StalePlan, UsageError
from engine.escalation import escalate_after_failure
from engine.execution import Executor, Progress
from engine.integrity import RunIntegrity, approve_sealed, plan_problems
from engine.loader import LoadedRunbook
from engine.locks import DEFAULT_TTL_SECONDS, NodeLock, acquire_node_lock
from engine.model import AnsibleAction, Plan, PlanState, RunResult, RunState
from engine.output import Fanout
from engine.params import PreparedRun, prepare_fleet, prepare_run
from engine.rollback import roll_back_after_failure
from engine.run_guards import (
    REMEDIATION_SOURCE,
    GuardConfig,
    GuardVerdict,
    blocking,
    check_overrides,
    evaluate_run_guards,
    judge,
    read_guard_facts,
)
from engine.run_windows import run_window_verdict
from engine.store import JournalSink, RunStore, StepProgress, current_owner, new_run_id
from engine.windows import Clock, clock_from_env

if TYPE_CHECKING:
    from engine.budget import BudgetAPI
    from engine.connectors.base import KubeAPI, NodeAutomation
    from engine.settings import Settings

APPROVAL_POLL_SECONDS = 0.5
BUDGET_POLL_SECONDS = 2.0  # a run waiting for room in the cluster's budget looks this often (a read, no write)
BUDGET_HANDED_BACK = ("left to another process: the server stopped (it handed the run back) or the leader "
                      "adopted it while it waited for room in the cluster's budget")


def needs_hosts(loaded: LoadedRunbook, params: Mapping[str, Any]) -> bool:
    """Whether a runbook reads host facts or runs playbooks (and so needs an inventory)."""
    rb = loaded.runbook
    return HOST in probes.runbook_probes(rb, params) or any(isinstance(s.action, AnsibleAction) for s in rb.steps)


def current_user() -> str:
    try:
        return os.environ.get("USER") or getpass.getuser()
    except OSError:
        return f"uid-{os.getuid()}"


def select_nodes(kube: KubeAPI, selector: str) -> list[str]:
    """Names of the nodes matching a label selector, sorted (fleet runs)."""
    return sorted(n.name for n in kube.list_nodes(label_selector=selector))


# -- planning ---------------------------------------------------------------------------------------


def plan_targets(targets: Sequence[PreparedRun], kube: KubeAPI | None, nodes: NodeAutomation | None, *,
                 now: datetime | None = None, ttl: float = planning.DEFAULT_TTL, preview: bool = True,
                 inventory_cmd_hint: str = "INVENTORY",
                 host_work: previews.HostWork | None = None) -> list[Plan]:
    """Plans for the targets (one runbook), in their order: live facts (read-only), the pure
    planner, and (``preview``) dry-run previews. Changes nothing.

    One node with previews: the check-mode runs of its playbook steps go first and their closing
    facts (every playbook ends with ``tasks/facts.yml``; check mode changed nothing) are the plan's
    host facts. Otherwise one host-facts run covers every target. ``host_work``: that Ansible work,
    already started by the caller (``previews.start_host_work`` with the same targets and
    ``preview``), so that it runs while the caller builds its Kubernetes client.
    """
    if not targets:
        return []
    loaded = targets[0].loaded
    now = now or datetime.now(UTC)
    work = host_work if host_work is not None else previews.start_host_work(list(targets), nodes, preview=preview)
    early = work.previews.result() if work.previews is not None else {}
    wanted: set[Any] = set()
    for t in targets:
        wanted |= probes.runbook_probes(t.runbook, t.params)
    facts = probes.gather_probes_many(wanted, [t.node for t in targets], kube, nodes,
                                      host_max_age=previews.PLAN_FACTS_MAX_AGE if early else 0.0,
                                      host_results=work.facts)
    out = []
    for t in targets:
        p = planning.plan_run(t.runbook, t.params, facts[t.node], runbook_digest=loaded.digest, now=now, ttl=ttl,
                              inventory_host=previews.inventory_host(nodes, t.node),
                              inventory_cmd_hint=inventory_cmd_hint)
        if preview:
            p = previews.preview_plan(p, t, kube, nodes, facts=facts[t.node], early=early if len(targets) == 1
                                      else None)
        out.append(p)
    return out


def check_saved_plan(saved: Plan, loaded: LoadedRunbook, kube: KubeAPI | None, nodes: NodeAutomation | None, *,
                     now: datetime | None = None) -> tuple[list[str], PreparedRun]:
    """Re-gather the facts a saved plan depends on; the reasons it is stale ([] = apply it)."""
    if saved.runbook != loaded.name:
        return [f"the plan is for runbook {saved.runbook}, not {loaded.name}"], PreparedRun(loaded, {}, saved.node)
    prepared = prepare_run(loaded, dict(saved.params.items()))
    now = now or datetime.now(UTC)
    facts = probes.gather(loaded.runbook, prepared.params, prepared.node, kube, nodes)
    fresh = planning.plan_run(loaded.runbook, prepared.params, facts, runbook_digest=loaded.digest, now=now,
                              inventory_host=saved.inventory_host or None)
    return planning.saved_plan_problems(saved, runbook_digest=loaded.digest, now=now, fresh=fresh), prepared


# -- what happened to each node ---------------------------------------------------------------------

# Outcomes of one node in a fleet (the summary's ``outcome`` column).
SUCCEEDED, NOTHING_TO_DO, FAILED, BLOCKED = "succeeded", "nothing-to-do", "failed", "blocked"
CANCELLED, NOT_STARTED = "cancelled", "not-started"
_OUTCOME_OF_STATE = {RunState.SUCCEEDED: SUCCEEDED, RunState.FAILED: FAILED, RunState.INTERRUPTED: FAILED,
                     RunState.BLOCKED: BLOCKED, RunState.WAITING_APPROVAL: BLOCKED,
                     RunState.CANCELLED: CANCELLED}


@dataclass(frozen=True)
class NodeOutcome:
    """One row of a fleet's summary: what happened to one node, and why."""

    node: str
    outcome: str  # succeeded | nothing-to-do | failed | blocked | cancelled | not-started
    run_id: str | None = None
    duration: float = 0.0
    reason: str = ""
    result: RunResult | None = None
    plan: Plan | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node": self.node, "outcome": self.outcome, "run_id": self.run_id,
                               "duration": round(self.duration, 3), "reason": self.reason}
        if self.result is not None:
            out["state"] = self.result.state.value
            out["exit_code"] = self.result.exit_code
        return out


@dataclass(frozen=True)
class FleetResult:
    """What a run over targets did, one row per node in target order."""

    runs: tuple[NodeOutcome, ...]
    cancelled: bool = False
    refused: str = ""  # --fail-fast: why nothing started

    @property
    def exit_code(self) -> int:
        """0 every node succeeded or had nothing to do; 1 any failed; 3 none failed, some blocked;
        4 cancelled (documented in README and docs/cli.md)."""
        outcomes = {r.outcome for r in self.runs}
        if FAILED in outcomes:
            return ExitCode.FAILED
        if self.cancelled or CANCELLED in outcomes:
            return ExitCode.CANCELLED
        if BLOCKED in outcomes or self.refused:
            return ExitCode.BLOCKED
        if NOT_STARTED in outcomes:
            return ExitCode.CANCELLED
        return ExitCode.OK

    def summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for r in self.runs:
            counts[r.outcome] = counts.get(r.outcome, 0) + 1
        out: dict[str, Any] = {"nodes": len(self.runs), **{k: counts[k] for k in sorted(counts)},
                               "exit_code": int(self.exit_code)}
        if self.refused:
            out["refused"] = self.refused
        return out

    def as_json(self) -> dict[str, Any]:
        return {"runs": [r.as_dict() for r in self.runs], "summary": self.summary()}


# Guards about capacity: a run whose plan changes nothing takes no capacity away, and a resumed run
# took its node's capacity when it started, so they do not stop those.
_CAPACITY_GUARDS = frozenset({"gpu-budget"})


def _stops(verdicts: Sequence[GuardVerdict], *, changes: bool) -> list[GuardVerdict]:
    """The verdicts that stop a run: every blocking one, except the capacity guards for a run that
    takes no new capacity (``changes`` False: nothing to do, or a resume); a guard that cannot be
    read still blocks."""
    return [v for v in blocking(verdicts) if changes or v.name not in _CAPACITY_GUARDS or not v.evaluated]


class _NodeCancel(threading.Event):
    """One node's cancel within a fleet: set by its own run (its Lease was lost) or by the fleet's
    (a signal), so that a node losing its Lease stops only itself."""

    def __init__(self, fleet: threading.Event) -> None:
        super().__init__()
        self._fleet = fleet

    def is_set(self) -> bool:
        return super().is_set() or self._fleet.is_set()


# -- the service ------------------------------------------------------------------------------------


@dataclass
class RunService:
    """Runs runbooks for one front end (a CLI invocation or a server) with one journal.

    ``automatic``: the server's runs; guard overrides are refused for them.
    ``guards``: the run guards' configuration (None: ``Settings.guard_config()``).
    """

    settings: Settings
    live: Progress | None = None  # an extra EventSink (the terminal's live view)
    lock_wait: float = 0.0
    lock_ttl: int = DEFAULT_TTL_SECONDS
    approval_timeout: float = 3600.0
    # Executor keyword arguments (clock, sleep, wall, poll_interval): tests run on fake time.
    executor_options: Mapping[str, Any] = field(default_factory=dict)
    automatic: bool = False
    guards: GuardConfig | None = None
    gather_window: float = 0.3  # a batch's facts requests wait this long for each other (engine.batch)
    clock: Clock = field(default_factory=clock_from_env)  # maintenance windows' time (RUNBOOK_CLOCK: the lab's)

    def __post_init__(self) -> None:
        self.journal: RunStore = self.settings.open_journal()
        self.integrity = RunIntegrity(self.journal)  # seals what it records; checks before acting
        self._guard_lock = threading.Lock()
        self._in_flight: set[str] = set()  # nodes this service remediates now (the GPU budget counts them)
        self._cluster_budget: ClusterBudget | None = None  # every run in flight in the cluster (engine.budget)
        self._budget_waits: dict[str, threading.Event] = {}  # runs waiting for room: set = handed back
        self._left: set[str] = set()  # runs whose wait ended handed back (nothing more is written for them)
        self._stopping = threading.Event()  # the server stops: no wait goes on, none starts
        # waiting runs wake when a run of this service gives its place back (others': the next look)
        self._budget_cond = threading.Condition(self._guard_lock)

    # -- targets and plans ----------------------------------------------------------------------

    def load(self, name_or_path: str) -> LoadedRunbook:
        return loader.load(name_or_path, self.settings.runbooks_dir)

    def targets(self, name: str, raw_params: Sequence[str] | Mapping[str, Any] = (), *, node: str | None = None,
                selector: str | None = None) -> list[PreparedRun]:
        """The runs to plan: one node (``--node`` or the node param), or every node a selector matches."""
        loaded = self.load(name)
        if node and selector:
            raise UsageError("give either --node or --selector, not both")
        if selector is not None:
            names = select_nodes(self.settings.kube(), selector)
            if not names:
                raise UsageError(f"no node matches the selector {selector!r}")
            return prepare_fleet(loaded, raw_params, names)
        return [prepare_run(loaded, raw_params, node=node)]

    def connectors(self, loaded: LoadedRunbook, params: Mapping[str, Any]
                   ) -> tuple[KubeAPI, NodeAutomation | None]:
        nodes = self.settings.nodes(loaded.playbooks_dir) if needs_hosts(loaded, params) else None
        return self.settings.kube(), nodes

    def _cmd_hint(self) -> str:
        return str(self.settings.inventory) if self.settings.inventory else "INVENTORY"

    def plan_targets(self, targets: Sequence[PreparedRun], *, preview: bool = True,
                     ttl: float | None = None) -> list[Plan]:
        """``plan_targets`` through this service's connectors: Ansible first (its run takes seconds;
        building the Kubernetes client, a fraction of one, is done meanwhile)."""
        if not targets:
            return []
        first = targets[0]
        nodes = self.settings.nodes(first.loaded.playbooks_dir) if any(
            needs_hosts(t.loaded, t.params) for t in targets) else None
        work = previews.start_host_work(list(targets), nodes, preview=preview)
        kube = self.settings.kube()
        return plan_targets(targets, kube, nodes, preview=preview, host_work=work,
                            inventory_cmd_hint=self._cmd_hint(),
                            ttl=planning.DEFAULT_TTL if ttl is None else ttl)

    def plan(self, prepared: PreparedRun, *, preview: bool = True, ttl: float | None = None) -> Plan:
        """The plan of one node (a fleet of one)."""
        return self.plan_targets([prepared], preview=preview, ttl=ttl)[0]

    def check_saved_plan(self, saved: Plan) -> tuple[list[str], PreparedRun]:
        """``runbook apply``: the saved plan's runbook, re-checked against live facts."""
        loaded = self.load(saved.runbook)
        kube, nodes = self.connectors(loaded, saved.params)
        return check_saved_plan(saved, loaded, kube, nodes)

    # -- records --------------------------------------------------------------------------------

    def preload(self) -> None:
        """Import now what planning and execution import on first use (the Ansible and Kubernetes
        connectors and their libraries: ~0.1 s of CPU). For a long-lived process (``runbook
        serve``): its first run must not spend that in a worker thread while pages are answered."""
        from engine.connectors import ansible, kube

        ansible.preload()
        del kube

    def create(self, prepared: PreparedRun, plan: Plan | None, *, source: str = "cli",
               approval_required: bool = False, note: Mapping[str, Any] | None = None,
               state: str = "pending", requested_by: str | None = None, run_id: str | None = None) -> str:
        """Record a new run; ``run_id`` chosen by the caller (the server's shared dedup) or a fresh one.
        A ``run_id`` that exists already raises the store's error and records nothing."""
        # Why: "the requester cannot approve their own run" needs to know who asked (the CLI's user,
        # or the server's sender identity). One transaction: the server creates runs on its webhook path.
        requester = requested_by or current_user()
        first: list[tuple[str, Mapping[str, Any]]] = [("run.requested", {"by": requester})]
        if note:
            first.append(("run.note", dict(note)))
        run_id = run_id or new_run_id()
        first.append(self.integrity.first_seal(run_id, runbook=prepared.loaded.name, nodes=[prepared.node],
                                               params=prepared.params, source=source,
                                               approval_required=approval_required, requested_by=requester))
        run_id = self.journal.create_run(prepared.loaded.name, prepared.params, [prepared.node], source=source,
                                         approval_required=approval_required, state=state, run_id=run_id,
                                         events=first)
        if plan is not None:
            self.record_plan(run_id, plan)
        return run_id

    def record_plan(self, run_id: str, plan: Plan) -> None:
        self.journal.set_plan(run_id, plan.model_dump(mode="json"), plan.digest)
        self.journal.append(run_id, "plan", plan_digest=plan.digest, state=plan.state.value,
                            steps=[{"id": s.id, "kind": s.kind, "summary": s.summary} for s in plan.steps])
        self.integrity.seal(run_id, plan_digest=plan.digest, runbook=plan.runbook, node=plan.node)

    def record_blocked(self, run_id: str, reason: str) -> None:
        """A run that ends before anything changed because its plan (or a guard) blocks it."""
        self.journal.append(run_id, "run.blocked", reason=reason)
        self.journal.set_state(run_id, RunState.BLOCKED.value, exit_code=ExitCode.BLOCKED)

    def park(self, run_id: str, plan: Plan, reason: str) -> None:
        """Leave a run in ``waiting-approval`` for ``plan`` (nobody owns it while it waits)."""
        self.journal.set_state(run_id, RunState.WAITING_APPROVAL.value)
        self.journal.append(run_id, "approval.waiting", plan_digest=plan.digest, reason=reason)
        self.journal.disown(run_id)  # parked on purpose: not "interrupted" when this process exits

    def stored_plan(self, run_id: str) -> Plan:
        rec = self.journal.get_run(run_id)
        if rec.plan is None:
            raise UsageError(f"run {run_id} has no recorded plan")
        return Plan.model_validate(rec.plan)

    def approve(self, run_id: str, plan_digest: str, approved_by: str | None = None, *,
                roles: frozenset[str] = frozenset(), requester_default: bool = True) -> Mapping[str, Any]:
        """Record an approval under the approval policy (``engine.approvals``); the run's approval
        is recorded once the policy counts enough distinct approvers. Verified first and sealed
        after (``engine.integrity.approve_sealed``): a forged run is never approved."""
        from engine.approvals import approve

        return approve_sealed(self.integrity, run_id, plan_digest, approved_by or current_user(), lambda who: approve(
            self.journal, run_id, plan_digest, who, config=self.settings.approval_config(), roles=roles,
            labels=self.node_labels(run_id), requester_default=requester_default), roles=roles)

    def node_labels(self, run_id: str) -> Callable[[], Mapping[str, str] | None]:
        """Reads the run's node's labels when the approval policy selects by them (None: unreadable)."""
        def read() -> Mapping[str, str] | None:
            rec = self.journal.get_run(run_id)
            try:
                node = self.settings.kube().read_node(rec.nodes[0]) if rec.nodes else None
            except RunbookError:
                return None
            return dict(node.labels) if node is not None else None
        return read

    def refuse_unverified(self, run_id: str, plan: Plan | None = None,
                          params: Mapping[str, Any] | None = None) -> str | None:
        """Before a run is planned, resumed, taken over or executed: the reason it may not be (its
        seal does not verify, or ``plan`` is not the run's recorded, approved plan for its node),
        recorded as ``blocked`` (``RunIntegrity.block``); None when it may go on."""
        try:
            why = self.integrity.problem(run_id)
            if why is None and plan is not None:
                problems = plan_problems(plan, self.journal.get_run(run_id), params)
                why = "; ".join(problems) if problems else None
        except RunbookError as e:  # no key to check with: fail closed
            why = f"it cannot be verified: {e}"
        if why is None:
            return None
        reason = f"run {run_id} refused, nothing done: {why}"
        self.integrity.block(run_id, reason)
        return reason

    # -- guards ---------------------------------------------------------------------------------

    def guard_config(self) -> GuardConfig:
        if self.guards is None:
            self.guards = self.settings.guard_config()
        return self.guards

    def check_overrides(self, overrides: Mapping[str, str]) -> None:
        """Refuse (exit 2) an override the service cannot take: unknown guard, no reason, automatic run."""
        if overrides and self.automatic:
            raise UsageError("guard overrides are for people: the server's automatic runs never pass a guard")
        check_overrides(dict(overrides))

    def guard_verdicts(self, node: str, overrides: Mapping[str, str] | None = None, *,
                       through_template: bool = False) -> list[GuardVerdict]:
        """Every run guard's verdict for ``node`` now (nodes this service remediates count as out of
        service for the GPU budget). Never raises for the cluster's state: an unreadable guard blocks.
        ``through_template``: a run started through runbook's remediation template (NHC holds the
        node's Medik8s Lease for it)."""
        given = {} if self.automatic else dict(overrides or {})
        try:
            kube = self.settings.kube()
        except RunbookError as e:
            return [GuardVerdict("exclusion", False, f"guards cannot be evaluated, so they block: {e}",
                                 evaluated=False, transient=True)]
        return evaluate_run_guards(kube, node, self.guard_config(), overrides=given,
                                   in_flight=sorted(self._in_flight), actor=current_user(),
                                   through_template=through_template)

    def guard_blocks(self, nodes: Sequence[str], overrides: Mapping[str, str] | None = None, *,
                     changing: Sequence[str] | None = None) -> dict[str, str]:
        """Which of ``nodes`` the guards refuse now, and why (one read of the cluster for all).
        Read-only, not journaled: ``execute`` evaluates them again before each node's Lease."""
        if not nodes:
            return {}
        given = {} if self.automatic else dict(overrides or {})
        try:
            kube = self.settings.kube()
        except RunbookError as e:
            return dict.fromkeys(nodes, f"guards cannot be evaluated, so they block: {e}")
        config = self.guard_config()
        facts = read_guard_facts(kube, config, lease_nodes=nodes)
        out = {}
        for n in nodes:
            stops = _stops(judge(facts, n, config, overrides=given, actor=current_user()),
                           changes=changing is None or n in changing)
            if stops:
                out[n] = "; ".join(f"guard {v.name}: {v.reason}" for v in stops)
        return out

    def _pass_guards(self, run_id: str, node: str, overrides: Mapping[str, str], *, changes: bool,
                     window: GuardVerdict | None = None) -> tuple[str | None, bool]:
        """Under the guard lock: evaluate, journal, and (when they pass) count the node in flight.
        ``window``: the maintenance-window verdict of the run's runbook (``engine.run_windows``).
        (why refused or None, whether only the cluster's budget was full: room may come)."""
        through_template = self.journal.get_run(run_id).source == REMEDIATION_SOURCE
        verdicts = [*self.guard_verdicts(node, overrides, through_template=through_template),
                    *([window] if window is not None else [])]
        self.journal.append(run_id, "guards", node=node, verdicts=[v.as_dict() for v in verdicts])
        for v in verdicts:
            if v.overridden is not None:
                self.journal.append(run_id, "guard.override", guard=v.name, by=v.overridden.by,
                                    reason=v.overridden.reason, finding=v.reason)
        stops = _stops(verdicts, changes=changes)
        if stops:
            return "; ".join(f"guard {v.name}: {v.reason}" for v in stops), False
        refused, full = self._claim_budget(run_id, node, overrides, changes=changes)
        if refused is not None:
            return refused, full
        self._in_flight.add(node)
        return None, False

    def _budget(self) -> ClusterBudget | None:
        """The cluster's budget (``engine.budget``), or None when no budget is configured."""
        if not budget_configured(self.guard_config()):
            return None
        if self._cluster_budget is None:
            self._cluster_budget = ClusterBudget(cast("BudgetAPI", self.settings.kube()),
                                                 self.settings.lease_namespace)
        return self._cluster_budget

    def _claim_budget(self, run_id: str, node: str, overrides: Mapping[str, str], *,
                      changes: bool) -> tuple[str | None, bool]:
        """Claim the run's place in the cluster's budget: the GPU budget and the concurrency limit
        judged with every run in flight anywhere (``engine.budget``), journaled as ``budget``.
        Refused: the reason. A run that takes no new capacity (nothing to do, a resume) is
        recorded but never refused; an unreadable budget refuses every run (fail closed). With the
        reason, whether the budget was read and full (room may come when a run ends)."""
        config = self.guard_config()
        given = {} if self.automatic else dict(overrides)

        try:
            budget = self._budget()
            if budget is None:
                return None, False
            nodes = read_nodes(budget.api)

            def decide(others: Sequence[Claim]) -> str | None:
                if not changes:
                    return None
                stops = [v for v in budget_verdicts(nodes, node, config, others, sorted(self._in_flight - {node}))
                         if v.blocks and v.name not in given]
                return "; ".join(f"guard {v.name}: {v.reason}" for v in stops) or None

            target = None if isinstance(nodes, Exception) else next((n for n in nodes if n.name == node), None)
            result = budget.claim(run_id, node, decide, gpus=gpu_count(target) if target is not None else 0)
        except RunbookError as e:
            reason = f"guard gpu-budget: the cluster's budget cannot be claimed, so it blocks: {e}"
            self.journal.append(run_id, "budget", granted=False, reason=reason)
            return reason, False
        self.journal.append(run_id, "budget", **result.as_event())
        return (None, False) if result.granted else (result.reason, bool(result.others))

    def _budget_has_room(self, node: str) -> bool:
        """Whether a claim for ``node`` would find room now: the claims read, decided, nothing written
        (a waiting run looks quietly; only a run that may pass claims, journaled, on the version it reads)."""
        try:
            budget = self._budget()
            if budget is None:
                return True
            claims = budget.claims()
            live = [c for c in claims if c not in budget.dead(claims)]
            nodes = read_nodes(budget.api)
            stops = [v for v in budget_verdicts(nodes, node, self.guard_config(), live,
                                                sorted(self._in_flight - {node})) if v.blocks]
        except RunbookError:
            return False
        return not stops

    def _wait_for_budget(self, run_id: str, node: str, refused: str, cancel: threading.Event | None,
                         attempt: Callable[[], tuple[str | None, bool]]) -> str | None:
        """A queued (automatic, never started) run whose turn came while the cluster's budget is full
        waits for room instead of ending blocked: ``pending`` again (``budget.waiting``, once), looking
        every ``BUDGET_POLL_SECONDS`` without writing (at once when a run of this service gives its
        place back); when there is room it claims (``attempt``: the
        guards and the claim again, journaled). Its worker is held meanwhile, so the runs queued after
        it stay after it. Past ``guards.budget_wait`` seconds: the reason it ends blocked. None: it
        passed. ``BUDGET_HANDED_BACK``: the server stops and handed it back (nothing more is written)."""
        wait = self.guard_config().budget_wait
        deadline = time.monotonic() + wait
        handed_back = threading.Event()
        with self._guard_lock:
            self._budget_waits[run_id] = handed_back
            if self._stopping.is_set():
                handed_back.set()
        try:
            self.journal.set_state(run_id, RunState.PENDING.value)
            self.journal.append(run_id, "budget.waiting", reason=refused, wait_s=wait,
                                message=f"the cluster's budget is full: this run waits up to {wait:.0f}s "
                                        "(guards.budget_wait) for room, pending, then ends blocked")
            while True:
                with self._guard_lock:
                    if not handed_back.is_set() and not (cancel is not None and cancel.is_set()):
                        self._budget_cond.wait(min(BUDGET_POLL_SECONDS, max(0.0, deadline - time.monotonic())))
                if handed_back.is_set():
                    with self._guard_lock:
                        self._left.add(run_id)
                    return BUDGET_HANDED_BACK
                if cancel is not None and cancel.is_set():
                    return f"{refused}; cancelled while it waited for room in the cluster's budget"
                if time.monotonic() >= deadline:
                    return (f"{refused}; waited {wait:.0f}s (guards.budget_wait) for room in the cluster's "
                            "budget and none came")
                if not self._budget_has_room(node):
                    continue
                rec = self.journal.get_run(run_id)
                if (rec.owner_host, rec.owner_pid, rec.owner_start) != current_owner():
                    return BUDGET_HANDED_BACK  # adopted by the leader meanwhile (this replica was silent)
                with self._guard_lock:
                    if handed_back.is_set():
                        self._left.add(run_id)
                        return BUDGET_HANDED_BACK
                    self._budget_waits.pop(run_id, None)  # from here on it is executing: not handed back
                self.journal.set_state(run_id, RunState.RUNNING.value)
                again, full = attempt()
                if again is None or not full:
                    return again
                refused = again
                self.journal.set_state(run_id, RunState.PENDING.value)
                with self._guard_lock:  # another process took the room first: wait on
                    self._budget_waits[run_id] = handed_back
                    if self._stopping.is_set():
                        handed_back.set()
        finally:
            with self._guard_lock:
                self._budget_waits.pop(run_id, None)

    def hand_back_waiting(self, run_id: str) -> bool:
        """The server stops: a run waiting for room in the budget stops waiting and writes nothing
        more (the caller disowns it for the leader). True also when its wait already ended so
        (``stop_waiting``); False when it is not waiting (it executes, or never waited)."""
        with self._guard_lock:
            if run_id in self._left:
                return True
            event = self._budget_waits.pop(run_id, None)
            if event is None:
                return False
            event.set()
            self._left.add(run_id)
            self._budget_cond.notify_all()
            return True

    def stop_waiting(self) -> None:
        """The server begins to stop: every run waiting for room in the budget stops waiting (and
        writes nothing more), and a run whose turn comes from now on does not wait (handed back)."""
        with self._guard_lock:
            self._stopping.set()
            for event in self._budget_waits.values():
                event.set()
            self._budget_cond.notify_all()

    def _release_budget(self, run_id: str) -> None:
        """Give the run's place in the cluster's budget back (best effort: a claim left behind is
        pruned once its run holds no Lease)."""
        budget = self._cluster_budget
        if budget is not None and budget.release(run_id):
            self.journal.append(run_id, "budget.released")
            with self._guard_lock:  # a run of this service waiting for room looks now
                self._budget_cond.notify_all()

    # -- execution ------------------------------------------------------------------------------

    def wait_for_approval(self, run_id: str, digest: str, *, timeout: float | None = None,
                          cancel: threading.Event | None = None) -> bool | None:
        """Poll the journal until someone approves ``digest`` (True) or the timeout passes (None)."""
        deadline = time.monotonic() + (self.approval_timeout if timeout is None else timeout)
        self.journal.set_state(run_id, RunState.WAITING_APPROVAL.value)
        while True:
            rec = self.journal.get_run(run_id)
            # an approval that does not verify (written into the store by hand) is no approval
            if rec.approved_digest == digest and self.integrity.problem(run_id) is None:
                self.journal.set_state(run_id, RunState.RUNNING.value)
                return True
            if time.monotonic() >= deadline or (cancel is not None and cancel.is_set()):
                return None
            time.sleep(APPROVAL_POLL_SECONDS)

    def execute(self, run_id: str, prepared: PreparedRun, plan: Plan, *,
                cancel: threading.Event | None = None, approved: bool = False,
                wait_approval: bool = True, resume: bool = False,
                confirm_rerun: Callable[[str, str], bool] | None = None,
                overrides: Mapping[str, str] | None = None,
                nodes_for_run: NodeAutomation | None = None) -> RunResult:
        """Pass the run guards, take the node's Lease, execute, record the final state, release the
        Lease. ``overrides``: guard name -> reason (a person's, journaled with who and why).
        ``nodes_for_run``: the node automation to execute with (a batch's ``SharedPlaybooks``)."""
        self.check_overrides(overrides or {})
        refused = self.refuse_unverified(run_id, plan, prepared.params)
        if refused is None and prepared.node != plan.node:
            refused = (f"run {run_id} refused, nothing done: the plan is for node {plan.node}, the run's Lease "
                       f"would be {prepared.node}")
            self.integrity.block(run_id, refused)
        if refused is not None:
            return RunResult(state=RunState.BLOCKED, exit_code=ExitCode.BLOCKED, runbook=prepared.loaded.name,
                             node=prepared.node, plan_digest=plan.digest, reason=refused)
        kube, nodes = self.connectors(prepared.loaded, prepared.params)
        if nodes_for_run is not None and nodes is not None:
            nodes = nodes_for_run
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
        with self._guard_lock:  # one node at a time, so that a batch's GPU budget counts its own nodes
            # A resumed run started before (its node's capacity is already taken): only new work
            # is held to the capacity guards. A recovered run that never started is new work
            # (resume=False) and is held to them, as every other guard holds every run.
            window = run_window_verdict(journal, run_id, prepared.loaded.runbook, self.clock(),
                                        overrides=overrides or {}, actor=current_user(), automatic=self.automatic)
            changes = not resume and plan.state is not PlanState.NOTHING_TO_DO
            refused, full = self._pass_guards(run_id, prepared.node, overrides or {}, window=window, changes=changes)
        if refused is not None and full and self.automatic and not resume and self.guard_config().budget_wait > 0:

            def attempt() -> tuple[str | None, bool]:
                with self._guard_lock:
                    return self._pass_guards(run_id, prepared.node, {}, window=window, changes=changes)

            refused = self._wait_for_budget(run_id, prepared.node, refused, cancel, attempt)
            if refused == BUDGET_HANDED_BACK:
                return RunResult(state=RunState.PENDING, exit_code=ExitCode.BLOCKED, runbook=prepared.loaded.name,
                                 node=prepared.node, plan_digest=plan.digest, reason=BUDGET_HANDED_BACK)
        if refused is not None:
            # A resume stopped by a guard stays resumable; a new run is simply blocked.
            state = RunState.INTERRUPTED if resume else RunState.BLOCKED
            return self._stop(run_id, prepared, plan, state, ExitCode.BLOCKED, refused, event="run.blocked")
        try:
            result = self._locked_execute(run_id, prepared, plan, kube, nodes, progress, cancel=cancel,
                                          approved=approved, wait_approval=wait_approval, resume=resume,
                                          confirm_rerun=confirm_rerun)
        finally:
            with self._guard_lock:
                self._in_flight.discard(prepared.node)
            self._release_budget(run_id)
        roll_back_after_failure(self, run_id, prepared, result)  # on_failure: {rollback: all} (engine.rollback)
        escalate_after_failure(self, run_id, prepared, result)  # on_failure: {escalate: [...]} (engine.escalation)
        return result

    def _locked_execute(self, run_id: str, prepared: PreparedRun, plan: Plan, kube: KubeAPI,
                        nodes: NodeAutomation | None, progress: StepProgress, *, cancel: threading.Event | None,
                        approved: bool, wait_approval: bool, resume: bool,
                        confirm_rerun: Callable[[str, str], bool] | None) -> RunResult:
        journal = self.journal
        cancel = cancel if cancel is not None else threading.Event()
        lock: NodeLock | None = None
        try:
            lock = acquire_node_lock(kube, prepared.node, run_id, ttl=self.lock_ttl, wait=self.lock_wait,
                                     namespace=self.settings.lease_namespace)

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
                                        fence=lock.fence, run_id=run_id)
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

    def _run_executor(self, prepared: PreparedRun, plan: Plan, kube: KubeAPI, nodes: NodeAutomation | None,
                      sink: Any, *, cancel: threading.Event | None, approve: Callable[[str | None], bool | None],
                      approved: bool, confirm_rerun: Callable[[str, str], bool] | None,
                      progress: StepProgress, fence: Callable[[], Mapping[str, Any]] | None = None,
                      run_id: str = "") -> RunResult:
        """The executor over this run's plan, told where a resumed run's half-done step stands; ``fence``
        re-checks the node's Lease right before each action (its token goes into ``action.intent``)."""
        executor = Executor(kube, nodes, events=sink, playbooks_dir=prepared.loaded.playbooks_dir, cancel=cancel,
                            inventory_cmd_hint=self._cmd_hint(), fence=fence, run_id=run_id,
                            **dict(self.executor_options))
        return executor.execute(plan, prepared.runbook, prepared.params, completed_steps=progress.completed,
                                started_without_outcome=progress.interrupted_step, confirm_rerun=confirm_rerun,
                                approve=approve, approved=approved,
                                interrupted_action_finished=progress.action_finished)

    def _stop(self, run_id: str, prepared: PreparedRun, plan: Plan, state: RunState, exit_code: int,
              reason: str, *, event: str | None = None) -> RunResult:
        """End (or park, for ``interrupted``) a run before the executor starts."""
        default = {RunState.FAILED: "run.failed", RunState.BLOCKED: "run.blocked"}.get(state, "run.interrupted")
        self.journal.append(run_id, event or default, reason=reason)
        self.journal.set_state(run_id, state.value, exit_code=exit_code)
        return RunResult(state=state, exit_code=exit_code, runbook=prepared.loaded.name, node=prepared.node,
                         plan_digest=plan.digest, reason=reason)

    def prepare_from_record(self, run_id: str) -> tuple[PreparedRun, Plan]:
        """Rebuild a recorded run (resume, approvals): same runbook, params and plan."""
        rec = self.journal.get_run(run_id)
        plan = self.stored_plan(run_id)
        loaded = self.load(rec.runbook)
        if loaded.digest != plan.runbook_digest:
            raise StalePlan(f"runbook {rec.runbook} changed since run {run_id} was planned "
                            f"(planned {plan.runbook_digest[:12]}, now {loaded.digest[:12]})")
        # Why the plan's params: they are what was reviewed and approved; the spec's could change after
        prepared = prepare_run(loaded, dict(plan.params))
        return prepared, plan

    # -- many nodes -----------------------------------------------------------------------------

    def run_targets(self, targets: Sequence[PreparedRun], plans: Sequence[Plan], *, max_parallel: int = 1,
                    settle: float = 0.0, max_failures: int = 1, fail_fast: bool = False,
                    cancel: threading.Event | None = None, overrides: Mapping[str, str] | None = None,
                    confirm: Callable[[Sequence[Plan]], None] | None = None,
                    execute_nothing_to_do: bool = False, source: str = "cli",
                    sleep: Callable[[float], None] | None = None) -> FleetResult:
        """Run planned targets: the fleet semantics of ``runbook run -l`` (one node is a fleet of one).

        * A node whose plan is blocked, or whose guards refuse it, is recorded as a blocked run with
          the reason and left untouched. ``fail_fast``: any such node refuses the whole fleet (every
          blocked node is still recorded; nothing starts).
        * A node with nothing to do is recorded as such (``execute_nothing_to_do``: executed anyway,
          re-checked live, as ``runbook run --node`` always did).
        * ``confirm(plans)`` is called once with the plans about to change something (it raises to refuse).
        * The others run in rolling batches of ``max_parallel``, ``settle`` seconds apart; after
          ``max_failures`` failed nodes no new batch starts (the running batch finishes). A batch's
          playbook steps run as one ``ansible-playbook`` process over its hosts.
        * ``cancel`` set: the running batch stops after its current actions; no new batch starts.
        """
        self.check_overrides(overrides or {})
        cancel = cancel if cancel is not None else threading.Event()
        rows: dict[str, NodeOutcome] = {}
        blocked_reasons: dict[str, str] = {}
        candidates: list[tuple[PreparedRun, Plan]] = []
        for prep, p in zip(targets, plans, strict=True):
            if p.state is PlanState.BLOCKED:
                blocked_reasons[p.node] = "; ".join(p.blocked_reasons) or "the plan is blocked"
            elif p.state is not PlanState.NOTHING_TO_DO or execute_nothing_to_do:
                candidates.append((prep, p))
        guarded = self.guard_blocks([prep.node for prep, _ in candidates], overrides,
                                    changing=[p.node for _, p in candidates if p.state is PlanState.READY])
        blocked_reasons.update(guarded)
        todo = [(prep, p) for prep, p in candidates if prep.node not in guarded]
        for prep, p in zip(targets, plans, strict=True):
            if p.node in blocked_reasons:
                run_id = self.create(prep, p, source=source)
                self.record_blocked(run_id, blocked_reasons[p.node])
                rows[p.node] = NodeOutcome(p.node, BLOCKED, run_id, 0.0, blocked_reasons[p.node], plan=p)
        refused = ""
        if fail_fast and blocked_reasons:
            refused = (f"--fail-fast: {len(blocked_reasons)} of {len(plans)} nodes are blocked "
                       f"({', '.join(sorted(blocked_reasons))}); nothing was started")
            todo = []
        for prep, p in zip(targets, plans, strict=True):
            if p.node in rows or any(t.node == p.node for t, _ in todo):
                continue
            if p.state is PlanState.NOTHING_TO_DO:
                run_id = self.create(prep, p, source=source)
                reason = self._nothing_to_do(run_id, p)
                rows[p.node] = NodeOutcome(p.node, NOTHING_TO_DO, run_id, 0.0, reason, plan=p)
            else:  # refused by --fail-fast before it started
                rows[p.node] = NodeOutcome(p.node, NOT_STARTED, None, 0.0, refused, plan=p)
        changing = [p for _, p in todo if p.state is PlanState.READY]
        if changing and confirm is not None:
            confirm(changing)
        failures = 0
        by_node = {prep.node: (prep, p) for prep, p in todo}
        batches = planning.fleet_batches([prep.node for prep, _ in todo], max_parallel)
        wait = sleep if sleep is not None else cancel.wait
        for i, batch in enumerate(batches):
            if cancel.is_set() or failures >= max_failures:
                why = "cancelled before its batch started" if cancel.is_set() else \
                    f"not started: {failures} node{'s' if failures != 1 else ''} failed (--max-failures {max_failures})"
                for n in batch:
                    rows[n] = NodeOutcome(n, CANCELLED if cancel.is_set() else NOT_STARTED, None, 0.0, why,
                                          plan=by_node[n][1])
                continue
            if i and settle > 0:
                wait(settle)
            for row in self._run_batch([by_node[n] for n in batch], cancel=cancel, overrides=overrides or {},
                                       source=source):
                rows[row.node] = row
                failures += row.outcome == FAILED
        return FleetResult(tuple(rows[p.node] for p in plans), cancelled=cancel.is_set(), refused=refused)

    def _nothing_to_do(self, run_id: str, plan: Plan) -> str:
        """Record a fleet node whose plan has nothing to do (no Lease, nothing executed)."""
        reasons = [s.reason for s in plan.steps if s.reason]
        reason = "nothing to do" + (f": {reasons[0]}" if reasons else "")
        self.journal.append(run_id, "run.finish", state=RunState.SUCCEEDED.value, reason=reason)
        self.journal.set_state(run_id, RunState.SUCCEEDED.value, exit_code=ExitCode.OK)
        return reason

    def _run_batch(self, batch: Sequence[tuple[PreparedRun, Plan]], *, cancel: threading.Event,
                   overrides: Mapping[str, str], source: str) -> list[NodeOutcome]:
        """One rolling batch: each node its own run (journal, guards, Lease, executor) in its own
        thread, their playbook runs shared (``SharedPlaybooks``)."""
        first = batch[0][0]
        shared: SharedPlaybooks | None = None
        if any(needs_hosts(prep.loaded, prep.params) for prep, _ in batch) and len(batch) > 1:
            shared = SharedPlaybooks(self.settings.nodes(first.loaded.playbooks_dir), [p.node for p, _ in batch],
                                     gather_window=self.gather_window)

        def one(prep: PreparedRun, p: Plan) -> NodeOutcome:
            t0 = time.monotonic()
            run_id: str | None = None
            try:
                run_id = self.create(prep, p, approval_required=p.approval, source=source)
                result = self.execute(run_id, prep, p, cancel=_NodeCancel(cancel), overrides=overrides,
                                      nodes_for_run=shared)
            except RunbookError as e:
                if run_id is not None:
                    self.journal.append(run_id, "run.failed", reason=str(e))
                    self.journal.set_state(run_id, RunState.FAILED.value, exit_code=e.exit_code)
                return NodeOutcome(prep.node, FAILED, run_id, time.monotonic() - t0, str(e), plan=p)
            finally:
                if shared is not None:
                    shared.leave(prep.node)
            outcome = _OUTCOME_OF_STATE.get(result.state, FAILED)
            if outcome == SUCCEEDED and p.state is PlanState.NOTHING_TO_DO:
                outcome = NOTHING_TO_DO
            return NodeOutcome(prep.node, outcome, run_id, time.monotonic() - t0, result.reason, result, plan=p)

        if len(batch) == 1:
            return [one(*batch[0])]
        with ThreadPoolExecutor(max_workers=len(batch), thread_name_prefix="fleet") as pool:
            futures = [pool.submit(one, prep, p) for prep, p in batch]
            return [f.result() for f in futures]


__all__ = ["FleetResult", "NodeOutcome", "RunService", "check_saved_plan", "current_user", "needs_hosts",
           "plan_targets", "select_nodes"]
