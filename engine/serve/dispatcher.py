"""From a verified page to a run, through the guards: the server's decisions in one place.

For every firing alert (or incident) and every trigger it matches, in this order:

1. **dedup** (``Guards.reserve``): same fingerprint/incident recently, or the node busy or cooling
   down -> ``duplicate``;
2. **cluster snapshot** (``ClusterView``): unreadable -> ``blocked`` (fail closed: exclusions cannot
   be verified); node excluded by label or named by kured's lock -> ``blocked``;
3. **mode**: the trigger's mode, restricted by the configuration (``force_mode``, ``mode_overrides``);
   an ``auto`` run that trips the **breaker** becomes ``approve`` with the breaker's warnings;
4. **approval budget** for approve-mode runs, then a place in the **worker pool**;
5. ``RunStarter.submit`` (fast) -> ``started`` with the run id; execution goes to the worker pool.

Outcomes of runs come back through ``_finish``: notifications, metrics, and the node breaker for a
failed automatic run. A *resolved* alert whose firing started a run is recorded against that run
(event ``alert.resolved``), once; it never starts or stops anything.

With several replicas (an elected leader: a shared store) the breaker is **shared**: before an
automatic run is allowed, the node's breaker and the runbook's rate window are derived from the
store's runs (the node's last automatic run failed and carries no ``breaker.reset`` event; the
automatic runs of the runbook in the window, minus those a reset marked), so a run that failed at
any replica opens the node's breaker at every replica, and a reset at any replica (recorded in the
store as ``breaker.reset`` events) closes it at all of them. Only a page that may start a run reads
the store for this; duplicates never do.

Singleton duties (resuming orphaned runs, retention pruning) run only while ``leadership`` says this
replica leads (``engine.serve.leader``): once at start and, with an elected leader, at every sweep
and at once when leadership is won. A single replica (no election) resumes its orphans at start only.
This module holds no HTTP and no parsing; it must never block on a run.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from engine.errors import ApprovalRefused, RunbookError
from engine.model import RunState
from engine.serve.access import Identity
from engine.serve.alertmanager import Alert, WebhookPayload
from engine.serve.cluster import ClusterSnapshot, ClusterUnavailable, ClusterView, RefreshingClusterView
from engine.serve.config import ServeConfig
from engine.serve.guards import (
    Guards,
    Reservation,
    RunSummary,
    SharedBreaker,
    automatic_runs,
    in_window,
    node_of,
    open_in_store,
    shared_verdict,
)
from engine.serve.guards import epoch as _epoch
from engine.serve.leader import Leadership, SingleReplica
from engine.serve.metrics import ServeMetrics
from engine.serve.notify import Notification, Notifier, RefusalDigest, run_report, step_outcomes
from engine.serve.page_groups import PageGroups
from engine.serve.pagerduty import Incident
from engine.serve.starter import (
    BREAKER_RESET,
    WEBHOOK_SOURCES,
    AlreadyStarted,
    Mode,
    RunOutcome,
    RunRequest,
    RunStarter,
)
from engine.serve.triggers import Candidate, Matches, TriggerIndex
from engine.serve.worker import WorkerPool

log = logging.getLogger(__name__)
Outcome = Literal["started", "duplicate", "blocked", "rejected", "ignored"]
Verdict = Literal["started", "queued", "refused", "duplicate", "ignored"]
_BREAKER_SCAN = 500  # newest runs read for the shared breaker
INCIDENT_KEY = "pd-incident-"  # dedup key prefix of runs paged by a PagerDuty incident (triggers.py)


@dataclass(frozen=True)
class Decision:
    """What became of one (alert, trigger) pair; the webhook answer lists these."""

    outcome: Outcome
    reason: str
    runbook: str | None = None
    node: str | None = None
    run_id: str | None = None
    mode: Mode | None = None
    warnings: tuple[str, ...] = ()
    alert: str = ""
    transient: bool = False  # blocked for a passing reason: a re-sent page is considered again
    queue_position: int = 0  # a started run that waits for a worker: its place (1 = next); 0: executing

    @property
    def verdict(self) -> Verdict:
        """What became of the node, in the three words of a burst's answer (issue 32): ``started``
        (a worker executes its run now), ``queued`` (its run is recorded and waits for a worker at
        ``queue_position``), ``refused`` (blocked or rejected, with the reason); a ``duplicate`` or
        ``ignored`` page is neither."""
        if self.outcome == "started":
            return "queued" if self.queue_position > 0 else "started"
        if self.outcome == "duplicate" or self.outcome == "ignored":
            return self.outcome
        return "refused"  # blocked, rejected

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"outcome": self.outcome, "reason": self.reason}
        for key in ("runbook", "node", "run_id", "mode", "alert"):
            value = getattr(self, key)
            if value:
                out[key] = value
        if self.warnings:
            out["warnings"] = list(self.warnings)
        out["decision"] = self.verdict
        if self.queue_position:
            out["queue_position"] = self.queue_position
        return out


@dataclass
class _BreakerRead:
    """The shared breaker's read of the store for one delivery (see ``Dispatcher._delivery``)."""

    runs: list[RunSummary] | None = None
    at: float = 0.0
    created: dict[str, int] = field(default_factory=dict)  # ``Dispatcher._auto_created`` at the read
    not_reset: set[tuple[str, str]] = field(default_factory=set)  # (run id, scope) read and not reset


@dataclass
class _RunMeta:
    runbook: str
    node: str | None
    mode: Mode
    warnings: tuple[str, ...] = ()
    reason: str = ""
    approved: bool = False
    state: str = "pending"
    plan_digest: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    alert_key: str = ""
    group_key: str = ""
    alert_started: float | None = None
    incident_id: str = ""  # the PagerDuty incident that paged (REST notes)
    resolve_incident: bool = False  # the trigger resolves that incident when the run succeeded

    def note(self, event: str, run_id: str, **kw: Any) -> Notification:
        """A notification about this run, carrying the alert (or incident) it came from."""
        kw.setdefault("mode", self.mode)
        return Notification(event, self.runbook, node=self.node, run_id=run_id, alert_key=self.alert_key,
                            group_key=self.group_key, incident_id=self.incident_id, **kw)


def _run_state(value: Any) -> RunState | None:
    try:
        return RunState(str(value))
    except ValueError:
        return None


def _active(value: Any) -> bool:
    """Someone runs it or will (pending, waiting for approval, running)."""
    state = _run_state(value)
    return state is not None and state.is_active


def _final(value: Any) -> bool:
    """It ended for good (succeeded, failed, blocked, cancelled)."""
    state = _run_state(value)
    return state is not None and state.is_final


def _not_active(value: Any) -> bool:
    """Nobody executes it here any more: final, or stopped resumable (interrupted)."""
    state = _run_state(value)
    return state is not None and not state.is_active


class NotFound(Exception):
    """No run with that id (HTTP 404)."""


class SelfApproval(Exception):
    """The approver is the identity that requested the run (HTTP 403, ``auth.requester_cannot_approve``),
    or the approval policy does not count this approver (``engine.approval_policy``)."""


def _cut(text: str, limit: int) -> str:
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    return data[: limit - 14].decode("utf-8", "ignore") + "...[truncated]"


def incident_of(summary: Mapping[str, Any]) -> str:
    """The PagerDuty incident id a recorded run was paged by (its dedup key), or ``""``."""
    key = summary.get("dedup_key")
    return key[len(INCIDENT_KEY):] if isinstance(key, str) and key.startswith(INCIDENT_KEY) else ""


def plan_summary(run: Mapping[str, Any]) -> str:
    """``"relabel-container -> swap-off -> restart-kubelet"``: the steps of a recorded run's plan."""
    plan = run.get("plan")
    steps = plan.get("steps") if isinstance(plan, Mapping) else None
    if not isinstance(steps, list | tuple):
        return ""
    return " -> ".join(str(s.get("id")) for s in steps if isinstance(s, Mapping))[:1000]


class Dispatcher:
    def __init__(self, config: ServeConfig, starter: RunStarter, cluster: ClusterView, *,
                 index: TriggerIndex, guards: Guards, worker: WorkerPool, notifier: Notifier,
                 metrics: ServeMetrics, clock: Callable[[], float] = time.time,
                 leadership: Leadership | None = None) -> None:
        self.config = config
        self.leadership: Leadership = leadership or SingleReplica()
        self.starter = starter
        self.cluster = cluster
        self.index = index
        self.guards = guards
        self.worker = worker
        self.notifier = notifier
        self.metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()
        self._runs: dict[str, _RunMeta] = {}  # runs this server owns and has not seen end
        self._known_breaker_keys: set[tuple[str, str]] = set()
        self._last_cluster: ClusterSnapshot | None = None
        self._alert_runs: dict[str, str] = {}  # alert dedup key -> the run its firing started
        self._resets: set[tuple[str, str]] = set()  # (run id, scope) known reset in the store (final)
        self._auto_created: dict[str, int] = {}  # runbook -> automatic runs this replica created (ever)
        self._reads = threading.local()  # .breaker: the delivery's _BreakerRead (None: read each time)
        self._stop = threading.Event()
        self._wake = threading.Event()  # leadership won: do the singleton duties now
        self._sweeper: threading.Thread | None = None
        self.digest = RefusalDigest(config.dedup.node_cooldown, clock=clock)
        self.pages = PageGroups()  # Alertmanager groups: their nodes, recovered or not

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, *, sweep_interval: float = 30.0) -> None:
        """Claim what a previous server left, rebuild dedup/breaker windows from the journal, start
        queued runs, and start the sweeper that notices approvals timing out. A cluster view that
        refreshes itself starts refreshing first, so the first page finds a snapshot ready.
        Only the leader (every server when it elects nothing) claims and resumes runs."""
        if isinstance(self.cluster, RefreshingClusterView):
            self.cluster.start()
        queue_ids = list(self.starter.recover()) if self.leadership.is_leader() else []
        now = self._clock()
        for s in self.starter.runs(limit=500, sources=WEBHOOK_SOURCES):
            if s.get("source") not in WEBHOOK_SOURCES:
                continue
            run_id, state, node = str(s["id"]), str(s.get("state")), node_of(s)
            mode: Mode = "approve" if s.get("approval_required") else "auto"
            started = _epoch(s.get("started")) or now
            if mode == "auto":
                self.guards.note_auto_start(str(s.get("runbook")), started)
            if _active(state) or run_id in queue_ids:
                with self._lock:
                    self._runs[run_id] = _RunMeta(str(s.get("runbook")), node, mode, state=state,
                                                  approved=bool(s.get("approved_by")),
                                                  plan_digest=s.get("plan_digest"), incident_id=incident_of(s))
                self.guards.track_active(node, run_id, approve=mode == "approve")
            elif _not_active(state):
                self.guards.track_ended(node, run_id, _epoch(s.get("finished")) or started)
            if now - started < self.config.dedup.fingerprint_window:
                # Why: the alert's fingerprint window promised in docs/serve.md outlives the process
                key = s.get("dedup_key")
                if key is None:
                    try:
                        key = self.starter.run(run_id).get("dedup_key")
                    except RunbookError:
                        key = None
                if isinstance(key, str) and key:
                    self.guards.remember(f"{s.get('runbook')}|{key}", started, run_id)
        with self._delivery():  # the readmissions' breaker: the store read once for all of them
            for run_id in queue_ids:
                if self._readmit(run_id) is None:
                    continue
                if not self.worker.submit(functools.partial(self._execute, run_id), reserved=False):
                    log.warning("worker pool full at start: run %s stays pending until the next start", run_id)
        if sweep_interval > 0:
            self._sweeper = threading.Thread(target=self._sweep_loop, args=(sweep_interval,),
                                             name="runbook-serve-sweeper", daemon=True)
            self._sweeper.start()

    def stop(self) -> None:
        self._stop.set()
        # Why first: a run waiting for room in the budget must not start during the grace and die
        # with the process half-way (running, owned by a dead process); it is handed back instead
        self.starter.stopping()
        if isinstance(self.cluster, RefreshingClusterView):
            self.cluster.stop()
        self._wake.set()
        self.worker.shutdown(self.config.shutdown_grace)
        self._hand_back_queued()
        self.notifier.flush(timeout=2.0)
        self.notifier.close(timeout=2.0)

    def _hand_back_queued(self) -> None:
        """The runs still queued here (the pool dropped them at shutdown) are given up in the store, so
        the leader resumes them, on whichever replica (``RunStarter.hand_back``): a burst's queue is
        not lost when its replica restarts. Runs that started executing are not touched (a run still
        executing past the grace is the leader's to take over once its node Lease goes silent)."""
        with self._lock:
            ids = list(self._runs)
        handed = 0
        for run_id in ids:
            try:
                handed += self.starter.hand_back(run_id)
            except Exception as e:  # Why: one unreachable record must not keep the others from the leader
                log.warning("run %s: not handed back at shutdown (a restart here resumes it): %s", run_id, e)
        if handed:
            log.warning("handed %d queued runs back to the store for the leader to resume", handed)

    def _sweep_loop(self, interval: float) -> None:
        while True:
            self._wake.wait(interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.reconcile()
                self.flush_refusals()
            except Exception:
                log.exception("reconcile failed")
            if self.leadership.describe().get("role") != "single":
                try:
                    self.singleton_duties()
                except Exception:
                    log.exception("singleton duties failed")

    def on_leadership(self, leading: bool) -> None:
        """The elector's callback: a new leader does its singleton duties at once."""
        if leading:
            self._wake.set()

    def singleton_duties(self) -> dict[str, Any]:
        """The leader's duties (nothing on a follower): queue the runs nobody executes any more
        (``RunStarter.recover``: pending or interrupted runs whose owner is gone), then prune the
        store by the retention (``retention.keep`` / ``retention.max_age``). What was done."""
        if not self.leadership.is_leader():
            return {"leader": False}
        with self._delivery():  # the readmissions' shared breaker: one read of the store for all
            queued = self._resume_orphans()
        pruned: Sequence[str] = ()
        try:
            pruned = self.starter.prune(self.config.retention.keep, self.config.retention.max_age)
        except Exception as e:  # Why: retention failing must not stop the resumption of orphans
            log.warning("retention pruning failed: %s", e)
        if pruned:
            log.info("retention: pruned %d finished runs", len(pruned))
        return {"leader": True, "resumed": queued, "pruned": list(pruned)}

    def _resume_orphans(self) -> list[str]:
        """Queue the runs ``RunStarter.recover`` claimed for this replica; the ids queued."""
        queued = []
        for run_id in self.starter.recover():
            with self._lock:
                known = self._runs.get(run_id)
                # Why not every known run: one this replica planned and still shows waiting for approval
                # was approved elsewhere and executed by a replica now gone; recover() claimed it for us
                if known is not None and known.state != "waiting-approval":
                    continue  # already queued or executing here
            try:
                s = self.starter.run(run_id)
            except RunbookError:
                continue
            if _final(s.get("state")):
                continue  # finished meanwhile (by whoever executed it)
            readmitted = self._readmit(run_id, s)
            if readmitted is None:
                continue
            node = node_of(s)
            mode: Mode = readmitted
            with self._lock:
                self._runs[run_id] = _RunMeta(str(s.get("runbook")), node, mode, state=str(s.get("state")),
                                              approved=bool(s.get("approved_by")),
                                              plan_digest=s.get("plan_digest"), source=str(s.get("source", "")),
                                              incident_id=incident_of(s))
            self.guards.track_active(node, run_id, approve=mode == "approve")
            if self.worker.submit(functools.partial(self._execute, run_id), reserved=False):
                queued.append(run_id)
                log.warning("resuming orphaned run %s (its executor is gone)", run_id)
            else:
                with self._lock:
                    self._runs.pop(run_id, None)
        return queued

    def _readmit(self, run_id: str, s: Mapping[str, Any] | None = None) -> Mode | None:
        """A run the leader resumes or takes over passes the rules a new run passes (issue 25 item 4):
        its page stays a duplicate for the dedup window here too; an automatic run that
        ``force_mode``/``mode_overrides`` or the breaker (the shared one too) would not let run
        automatically now waits for a person instead (``RunStarter.require_approval``), within
        ``max_pending_approvals``. The run's mode from now on, or None: not now (it stays
        claimed and is looked at again at the next sweep). Guards and the GPU budget are
        evaluated again by the run service before its Lease, as for any run."""
        try:
            s = s if s is not None else self.starter.run(run_id)
        except RunbookError:
            return None
        runbook, node = str(s.get("runbook")), node_of(s)
        key = s.get("dedup_key")
        if isinstance(key, str) and key:
            self.guards.remember(f"{runbook}|{key}", _epoch(s.get("started")) or self._clock(), run_id)
        if s.get("approval_required") or s.get("approved_by"):
            return "approve"
        reasons: list[str] = []
        place: int | None = None  # the run's place in the rate window (None: not in it)
        if self.config.mode_for(runbook, "auto") == "approve":
            reasons.append("the configuration (force_mode / mode_overrides) makes this runbook approve-mode")
        else:
            try:
                snapshot = self.cluster.snapshot()
                shared = self.shared_breaker(runbook, node)
                place = self._place_in_window(run_id, runbook)
                if place is not None:
                    # Why: the run took its place in the rate window when it was created; held to the
                    # window again it would count itself and the runs after it (a burst's queue,
                    # handed back by a stopped replica, would never resume)
                    shared = SharedBreaker(self.guards.open_breaker(node) if node else None, place) \
                        if shared is None else replace(shared, auto_runs=min(shared.auto_runs, place))
                reasons += self.guards.check_auto(runbook, node, snapshot, shared)
            except Exception as e:  # Why: the breaker fails closed, as for a new run
                reasons.append(f"breaker: cannot be evaluated ({type(e).__name__}: {str(e)[:200]})")
        if not reasons:
            self.guards.auto_created(runbook)  # the in-flight slot check_auto took: the run is in the store already
            return "auto"
        why = self.guards.reserve_approval()
        if why is not None:
            log.warning("run %s not resumed now: it needs an approval and %s", run_id, why)
            return None
        try:
            self.starter.require_approval(run_id, "; ".join(reasons))
        except Exception:
            self.guards.bind_approval(None)
            raise
        self.guards.bind_approval(run_id)
        self.metrics.runs_blocked.labels(runbook=runbook, reason="breaker").inc()
        return "approve"

    def _place_in_window(self, run_id: str, runbook: str) -> int | None:
        """How many automatic runs of ``runbook`` in the breaker's window were created before the
        automatic run ``run_id`` (None: it is not one of them)."""
        read: _BreakerRead | None = getattr(self._reads, "breaker", None)
        if read is not None and read.runs is None:
            self._read_for_breaker(read)
        runs = read.runs if read is not None and read.runs is not None else self._automatic()
        recent = in_window(runs, runbook, self._clock(), self.config.breaker.window)  # newest first
        ids = [r.id for r in recent]
        return len(ids) - ids.index(run_id) - 1 if run_id in ids else None

    def readiness(self) -> dict[str, Any]:
        """``/readyz``: the store answers (one read), and this replica's role (leader or follower)."""
        out: dict[str, Any] = {**self.leadership.describe()}
        try:
            self.starter.runs(limit=1)
        except Exception as e:
            out.update(ready=False, store=f"unreachable: {type(e).__name__}: {str(e)[:300]}")
            return out
        out.update(ready=True, store="ok")
        # Why here and not /healthz: a dead notification target is worth seeing, never worth a restart
        out["notify"] = self.notifier.health()
        return out

    def flush_refusals(self, *, force: bool = False) -> None:
        """Send the aggregate "N alerts refused" notification when its window is over."""
        summary = self.digest.due(force=force)
        if summary is not None:
            self.notifier.notify(summary)

    def refused_excess(self, count: int) -> Decision:
        """Alerts beyond ``limits.max_alerts`` in one delivery: one decision, counted in the aggregate."""
        self.digest.count(count, "over-max-alerts")
        return Decision("rejected", f"{count} alerts beyond limits.max_alerts "
                        f"({self.config.limits.max_alerts}) in this delivery were not considered")

    def _refusal_notice(self, runbook: str, node: str | None, kind: str, n: Notification) -> None:
        if self.digest.admit(runbook, node, kind):
            self.notifier.notify(n)

    def reconcile(self) -> None:
        """Runs waiting for approval may time out or be cancelled elsewhere: notice their end."""
        with self._lock:
            waiting = [(rid, m) for rid, m in self._runs.items() if m.state == "waiting-approval"]
        for run_id, meta in waiting:
            try:
                state = str(self.starter.run(run_id).get("state"))
            except RunbookError:
                state = "cancelled"
            if _not_active(state):
                self._finish(run_id, meta, RunOutcome(run_id, state, reason="ended while waiting for approval"))

    # -- pages --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _delivery(self) -> Iterator[None]:
        """The shared breaker reads the store's automatic runs for a delivery (or a sweep) once to
        *refuse*: once the breaker is tripped, a burst of 200 alerts in one delivery costs no more
        lists. Letting an automatic run through reads the store again (``shared_breaker``), so the
        bound between replicas is the one without this read (one extra run per replica at most).

        What the read cannot see is added back: the automatic runs this replica created after it
        (``_auto_created``; the runs being created now are the guards' in-flight count), and a node
        breaker this replica opened after it."""
        if getattr(self._reads, "breaker", None) is not None:
            yield  # nested: the outer delivery's read
            return
        self._reads.breaker = _BreakerRead()
        try:
            yield
        finally:
            self._reads.breaker = None

    def handle_alerts(self, payload: WebhookPayload, requested_by: str = "alertmanager") -> list[Decision]:
        with self._delivery():
            return self._handle_alerts(payload, requested_by)

    def _handle_alerts(self, payload: WebhookPayload, requested_by: str) -> list[Decision]:
        self.flush_refusals()
        decisions: list[Decision] = []
        matched = [(alert, self.index.for_alert(alert) if alert.firing else None) for alert in payload.alerts]
        # Why first: a run may end before this delivery is answered; the page's nodes must be known then
        self._observe_page(payload, matched)
        for i, (alert, matches) in enumerate(matched):
            if i % 20 == 19:
                time.sleep(0)  # Why: yield the interpreter so the event loop answers in between
            label = _cut(alert.describe(), 512)
            if matches is None:
                decisions.append(self._resolved(alert, label))
                continue
            decisions += self._decide(matches, label, requested_by, group_key=payload.group_key,
                                      alert_started=alert.starts_at.timestamp() if alert.starts_at else None)
        return decisions

    def _observe_page(self, payload: WebhookPayload, matched: Sequence[tuple[Alert, Matches | None]]) -> None:
        """Record the nodes of the delivery's group (``PageGroups``): firing and recovered."""
        if not payload.group_key:
            return
        firing = [next((c.node for c in m.candidates if c.node), None) or self._node_of_alert(a)
                  for a, m in matched if m is not None]
        resolved = [self._node_of_alert(a) for a, m in matched if m is None]
        self.pages.observe(payload.group_key, firing, resolved)
        nodes = set(firing) | set(resolved)
        if len(nodes) > 1 and self.pages.first_mixed(payload.group_key):
            log.warning("Alertmanager group %s holds the alerts of %d nodes (%s): its page is resolved only when "
                        "every one recovered; route with group_by: [alertname, node] for one page per node "
                        "(docs/serve.md)", payload.group_key[:200], len(nodes), ", ".join(sorted(nodes)[:5]))

    def _node_of_alert(self, alert: Alert) -> str:
        """The node an alert is about: as its trigger renders it (a resolved alert: as its firing
        did), else its ``node`` label, else the alert itself (a target runbook cannot recover)."""
        firing = alert if alert.firing else alert.model_copy(update={"status": "firing"})
        try:
            node = next((c.node for c in self.index.for_alert(firing).candidates if c.node), None)
        except Exception:  # Why: bookkeeping must never fail a delivery
            node = None
        return node or alert.labels.get("node") or f"alert {alert.dedup_key}"

    def _resolved(self, alert: Alert, label: str) -> Decision:
        """Record a resolved alert against the run its firing started (once), then ignore it."""
        with self._lock:
            run_id = self._alert_runs.pop(alert.dedup_key, None)
        if run_id is None:
            return Decision("ignored", "resolved alerts never start runs", alert=label)
        try:
            self.starter.record_event(run_id, "alert.resolved", {
                "alert": label, "fingerprint": alert.dedup_key,
                "ends_at": alert.ends_at.isoformat() if alert.ends_at else None})
        except Exception as e:  # Why: a journal hiccup must not turn the webhook into an error
            self.metrics.journal_errors.labels(operation="record-event").inc()
            log.warning("could not record the resolved alert %s against run %s: %s", label, run_id, e)
            return Decision("ignored", "resolved alerts never start runs", alert=label, run_id=run_id)
        return Decision("ignored", f"resolved alerts never start runs; recorded against run {run_id}",
                        alert=label, run_id=run_id)

    def handle_candidates(self, candidates: Sequence[Candidate], label: str, requested_by: str) -> list[Decision]:
        """Runs asked for by something other than a webhook (a RunbookRemediation, a Node condition):
        the same decisions as a page's (dedup, cluster, breaker, mode, approvals, workers)."""
        with self._delivery():
            return self._decide(Matches(candidates=list(candidates)), _cut(label, 512), requested_by)

    def handle_incident(self, incident: Incident) -> list[Decision]:
        self.flush_refusals()
        with self._delivery():
            return self._decide(self.index.for_incident(incident), f"incident {incident.id[:100]}", "pagerduty")

    def quick_alerts(self, payload: WebhookPayload) -> list[Decision] | None:
        """The answer when nothing can start (resolved, unmatched, duplicates), computed without
        I/O so the event loop may call it; None when some candidate needs the full path.

        Why: an alert storm is mostly re-sends of what already started; answering those inline
        keeps them out of the thread pool, where they would queue behind real work."""
        decisions: list[Decision] = []
        matched = [(a, self.index.for_alert(a) if a.firing else None) for a in payload.alerts]
        for alert, matches in matched:
            label = _cut(alert.describe(), 512)
            if matches is None:
                with self._lock:
                    started_a_run = alert.dedup_key in self._alert_runs
                if started_a_run:
                    return None  # recording it is I/O: the full path does it
                decisions.append(Decision("ignored", "resolved alerts never start runs", alert=label))
                continue
            quick = self._quick(matches, label)
            if quick is None:
                return None
            decisions += quick
        self._observe_page(payload, matched)  # a node may have recovered (its alert resolved)
        return decisions

    def quick_incident(self, incident: Incident) -> list[Decision] | None:
        """``quick_alerts`` for a PagerDuty incident."""
        return self._quick(self.index.for_incident(incident), f"incident {incident.id[:100]}")

    def _quick(self, matches: Matches, label: str) -> list[Decision] | None:
        if matches.refusals:
            return None  # refusals are counted for the aggregate notification: the full path
        out: list[Decision] = []
        if not matches.candidates and not matches.refusals:
            out.append(Decision("ignored", "no runbook trigger matches", alert=label))
        for c in matches.candidates:
            reason = self.guards.peek(f"{c.runbook}|{c.dedup_key}", c.node)
            if reason is None:
                return None
            out.append(Decision("duplicate", reason, runbook=c.runbook, node=c.node, alert=label))
        return out

    def _decide(self, matches: Matches, label: str, requested_by: str, *, group_key: str = "",
                alert_started: float | None = None) -> list[Decision]:
        out: list[Decision] = []
        for r in matches.refusals:
            reason = _cut(r.reason, self.config.limits.max_reason_bytes)
            self._refusal_notice(r.runbook, None, "rejected:" + reason[:80], Notification(
                "blocked", r.runbook, reason=f"refused: {reason} (page: {label})"))
            out.append(Decision("rejected", reason, runbook=r.runbook, alert=label))
        if not matches.candidates and not matches.refusals:
            out.append(Decision("ignored", "no runbook trigger matches", alert=label))
        for c in matches.candidates:
            c = replace(c, reason=_cut(c.reason, self.config.limits.max_reason_bytes), group_key=group_key,
                        alert_started=alert_started)
            try:
                d = self._consider(c, requested_by)
            except Exception as e:  # Why: one broken candidate must not lose the others' answers
                log.exception("deciding on %s failed", c.reason)
                d = Decision("rejected", f"internal error: {type(e).__name__}", runbook=c.runbook, node=c.node)
            out.append(replace(d, alert=label))
        return out

    def _blocked(self, c: Candidate, kind: str, reason: str, mode: Mode | None = None, *,
                 transient: bool = False) -> Decision:
        self.metrics.runs_blocked.labels(runbook=c.runbook, reason=kind).inc()
        self._refusal_notice(c.runbook, c.node, kind, Notification(
            "blocked", c.runbook, node=c.node, mode=mode, reason=f"{reason} (page: {c.reason})",
            state="refused", alert_key=c.dedup_key, group_key=c.group_key))
        return Decision("blocked", reason, runbook=c.runbook, node=c.node, mode=mode, transient=transient)

    def _consider(self, c: Candidate, requested_by: str = "") -> Decision:
        mode = self.config.mode_for(c.runbook, c.mode)
        claim = self.guards.reserve(f"{c.runbook}|{c.dedup_key}", c.node)
        if isinstance(claim, str):
            return Decision("duplicate", claim, runbook=c.runbook, node=c.node)
        try:
            decision = self._guarded(c, mode, claim, requested_by)
        except BaseException:
            self.guards.release(claim)
            raise
        if decision.outcome != "started":
            # Why: a page refused for a lasting reason (excluded node, invalid params) is refused
            # once per dedup window, not once per re-send; a passing reason lets a re-send retry.
            self.guards.release(claim, keep_key=not decision.transient)
        return decision

    def _guarded(self, c: Candidate, mode: Mode, claim: Reservation, requested_by: str = "") -> Decision:
        try:
            snapshot = self.cluster.snapshot()
        except ClusterUnavailable as e:
            return self._blocked(c, "cluster-unreadable", f"cannot check exclusions and health, "
                                 f"so nothing starts: {e}", mode, transient=True)
        self._last_cluster = snapshot
        excluded = snapshot.exclusion(c.node)
        if excluded is not None:
            kind = "kured-lock" if c.node in snapshot.kured_locked else "excluded"
            return self._blocked(c, kind, excluded, mode)
        warnings: tuple[str, ...] = ()
        if mode == "auto":
            try:
                shared = self.shared_breaker(c.runbook, c.node)
            except Exception as e:  # Why: the breaker fails closed: no shared verdict, no automatic run
                log.warning("shared breaker: cannot read the run store: %s", e)
                warnings = (f"breaker: the shared run store did not answer ({type(e).__name__}: "
                            f"{str(e)[:200]}); no automatic run without the other replicas' runs",)
            else:
                warnings = tuple(self.guards.check_auto(c.runbook, c.node, snapshot, shared))
            if warnings:
                mode = "approve"
                self.metrics.runs_blocked.labels(runbook=c.runbook, reason="breaker").inc()
        auto_slot = mode == "auto"
        if mode == "approve":
            why = self.guards.reserve_approval()
            if why is not None:
                return self._blocked(c, "approvals-limit", f"not paging for approval: {why}", mode,
                                     transient=True)
        if not self.worker.try_reserve():
            self._undo(c, auto_slot, mode)
            return self._blocked(c, "queue-full", f"the worker pool is full "
                                 f"({self.worker.stats()['capacity']} runs queued or running)", mode,
                                 transient=True)
        request = RunRequest(runbook=c.runbook, params=dict(c.params), node=c.node, mode=mode,
                             source=c.source, reason=c.reason, warnings=warnings, dedup_key=c.dedup_key,
                             requested_by=requested_by, require_diagnosis=c.require_diagnosis,
                             windows=c.windows)
        try:
            ticket = self.starter.submit(request)
        except AlreadyStarted as e:  # another replica took this page first (shared store)
            self.worker.release()
            self._undo(c, auto_slot, mode)
            return Decision("duplicate", str(e), runbook=c.runbook, node=c.node, run_id=e.run_id, mode=mode)
        except RunbookError as e:
            self.worker.release()
            self._undo(c, auto_slot, mode)
            why = _cut(str(e).splitlines()[0] if str(e) else type(e).__name__, self.config.limits.max_reason_bytes)
            self._refusal_notice(c.runbook, c.node, "rejected", Notification(
                "blocked", c.runbook, node=c.node, mode=mode, reason=f"refused: {why} (page: {c.reason})",
                state="refused", alert_key=c.dedup_key, group_key=c.group_key))
            return Decision("rejected", why, runbook=c.runbook, node=c.node, mode=mode)
        except BaseException:
            self.worker.release()
            self._undo(c, auto_slot, mode)
            raise
        run_id = ticket.run_id
        if auto_slot:
            with self._lock:  # first: counted after the delivery's read before it leaves the in-flight count
                self._auto_created[c.runbook] = self._auto_created.get(c.runbook, 0) + 1
            self.guards.auto_created(c.runbook)
        self.guards.bind(claim, run_id)
        if mode == "approve":
            self.guards.bind_approval(run_id)
        with self._lock:
            self._runs[run_id] = _RunMeta(c.runbook, c.node, mode, warnings, c.reason, state=ticket.state,
                                          source=c.source, alert_key=c.dedup_key, group_key=c.group_key,
                                          alert_started=c.alert_started, incident_id=c.incident_id,
                                          resolve_incident=c.resolve_incident)
            if c.source == "alertmanager":
                if len(self._alert_runs) >= 10000:  # bounded: forget the oldest
                    self._alert_runs.pop(next(iter(self._alert_runs)))
                self._alert_runs[c.dedup_key] = run_id
        self.metrics.runs_started.labels(runbook=c.runbook, mode=mode).inc()
        if c.alert_started is not None:
            self.metrics.alert_to_run_start.labels(runbook=c.runbook).observe(
                max(0.0, self._clock() - c.alert_started))
        if mode == "auto":
            with self._lock:
                meta = self._runs[run_id]
            self.notifier.notify(meta.note("started", run_id, reason=c.reason, state="running"))
        place = self.worker.enqueue(lambda: self._execute(run_id)) or 0
        if place:
            # Why say so: in a burst the pool holds more runs than workers; the run is recorded
            # (pending in the store), so a restart or the leader's sweep resumes it (recover).
            reason = (f"run created; it waits for a worker at place {place} in this replica's queue "
                      f"({self.worker.workers} workers busy) and then "
                      + ("executes" if mode == "auto" else "prepares a plan for approval"))
        else:
            reason = "run created; it executes now" if mode == "auto" else \
                "run created; a plan is being prepared for approval"
        if c.require_diagnosis:
            reason += (" if the runbook's diagnosis matches the node (checked first, read-only; "
                       "otherwise the run ends blocked with the evidence and nothing changes)")
        return Decision("started", reason, runbook=c.runbook, node=c.node, run_id=run_id, mode=mode,
                        warnings=warnings, queue_position=place)

    def _undo(self, c: Candidate, auto_slot: bool, mode: Mode) -> None:
        if auto_slot:
            self.guards.undo_auto(c.runbook)
        if mode == "approve":
            self.guards.bind_approval(None)

    # -- runs -----------------------------------------------------------------------------------

    def _execute(self, run_id: str) -> None:
        with self._lock:
            meta = self._runs.get(run_id)
        if meta is None:
            return
        try:
            outcome = self.starter.execute(run_id)
        except Exception as e:
            log.exception("run %s raised", run_id)
            outcome = RunOutcome(run_id, "failed", reason=f"{type(e).__name__}: {e}")
        if outcome.state == "deferred":
            # Outside its maintenance windows (engine.run_windows): ask again after deferred_poll;
            # the starter executes it once a window is open (a restart re-queues it: still pending).
            with self._lock:
                meta.state = "deferred"
            self._defer(run_id)
            return
        if outcome.state == "waiting-approval":
            with self._lock:
                meta.state, meta.plan_digest = outcome.state, outcome.plan_digest
            extra: dict[str, Any] = {"plan_digest": outcome.plan_digest}
            if (plan := self._plan_summary(run_id)):
                extra["plan"] = plan
            self.notifier.notify(meta.note(
                "waiting-approval", run_id, reason=meta.reason, warnings=meta.warnings, state=outcome.state,
                extra=extra))
            return
        if outcome.state == "pending" and self._stop.is_set():
            # Why: it stopped waiting for room in the budget because the server stops, and the stop's
            # hand-back pass may have gone by while it still executed: nobody else gives it back
            try:
                if self.starter.hand_back(run_id):
                    log.warning("run %s handed back to the store for the leader to resume", run_id)
                    return
            except Exception as e:
                log.warning("run %s: not handed back at shutdown (a restart here resumes it): %s", run_id, e)
        if not _not_active(outcome.state):
            log.warning("run %s returned state %s; treating it as still active", run_id, outcome.state)
            with self._lock:
                meta.state = outcome.state
            return
        self._finish(run_id, meta, outcome)

    def _defer(self, run_id: str) -> None:
        def again() -> None:
            if not self._stop.is_set() and not self.worker.submit(functools.partial(self._execute, run_id),
                                                                  reserved=False):
                self._defer(run_id)  # the pool is full: ask again later

        timer = threading.Timer(self.config.deferred_poll, again)
        timer.daemon = True
        timer.start()

    def _plan_summary(self, run_id: str) -> str:
        """The recorded plan's steps, for notes and messages (``""`` when unreadable or not planned)."""
        try:
            return plan_summary(self.starter.run(run_id))
        except Exception:  # Why: the notification is still sent without the plan
            return ""

    def _resolves(self, meta: _RunMeta, outcome: RunOutcome) -> tuple[bool, str]:
        """Whether this run's success resolves its page, and what the final note adds.

        A PagerDuty incident: only when the trigger says so. An Alertmanager group: only when every
        node of its alerts has recovered (a run reports success for its own node only)."""
        if outcome.state != "succeeded":
            return False, ""
        if meta.incident_id:
            return (True, "") if meta.resolve_incident else \
                (False, "; the trigger does not resolve the incident (resolve_incident: false)")
        if meta.source == "alertmanager" and meta.group_key:
            left = self.pages.recovered(meta.group_key, meta.node)
            if left:
                shown = ", ".join(left[:10]) + (f" and {len(left) - 10} more" if len(left) > 10 else "")
                return False, (f"; success for {meta.node} only: this page's alerts also name {shown}, "
                               "not recovered yet, so the page stays open")
        return True, ""

    def _finish(self, run_id: str, meta: _RunMeta, outcome: RunOutcome) -> None:
        with self._lock:
            if self._runs.pop(run_id, None) is None:
                return  # already finished (sweeper and worker raced)
        automatic = meta.mode == "auto" and not meta.approved
        opened = self.guards.finished(meta.node, run_id, state=outcome.state, automatic=automatic,
                                      reason=outcome.reason)
        if outcome.state == "succeeded":
            self.metrics.runs_succeeded.labels(runbook=meta.runbook).inc()
            event = "finished"
        elif outcome.state == "blocked":
            self.metrics.runs_blocked.labels(runbook=meta.runbook, reason="run-blocked").inc()
            event = "blocked"
        else:
            self.metrics.runs_failed.labels(runbook=meta.runbook).inc()
            event = "failed"
        reason = outcome.reason or outcome.state
        if opened:
            reason += f"; the breaker for {meta.node} is open: no automatic run there until reset"
        resolve, why = self._resolves(meta, outcome)
        reason += why
        self.metrics.runs_finished.labels(runbook=meta.runbook, state=outcome.state,
                                          trigger=meta.source or "unknown").inc()
        if outcome.state == "succeeded" and meta.alert_started is not None:
            self.metrics.alert_to_recovery.labels(runbook=meta.runbook).observe(
                max(0.0, self._clock() - meta.alert_started))
        events: list[Mapping[str, Any]] = []
        try:
            events = list(self.starter.run(run_id).get("events") or ())
        except Exception as e:  # Why: the outcome is still notified without the details
            self.metrics.journal_errors.labels(operation="read-run").inc()
            log.warning("could not read the events of run %s: %s", run_id, e)
        self.metrics.observe_run(meta.runbook, events)
        for step in step_outcomes(events):
            self.notifier.notify(meta.note("step", run_id, state="running", reason=step["reason"],
                                           extra={"step": step["step"], "status": step["status"]}))
        self.notifier.notify(meta.note(event, run_id, reason=reason, state=outcome.state,
                                       report=run_report(events, outcome.state, reason),
                                       extra={"exit_code": outcome.exit_code}, resolve=resolve))

    # -- API --------------------------------------------------------------------------------------

    def runs(self, limit: int = 100) -> list[Mapping[str, Any]]:
        return list(self.starter.runs(limit=limit))

    def run(self, run_id: str) -> Mapping[str, Any]:
        try:
            return self.starter.run(run_id)
        except RunbookError as e:
            raise NotFound(str(e)) from e

    def approve(self, run_id: str, plan_digest: str, who: Identity) -> dict[str, Any]:
        """Record ``who``'s approval (StalePlan / UsageError propagate) and queue the run if it is ours.

        The approver recorded is the identity bound to the credential, nothing the caller wrote."""
        current = self.run(run_id)  # NotFound first, so an unknown id is a 404 and not a 409
        if self.config.auth.requester_cannot_approve and current.get("requested_by") == who.name:
            raise SelfApproval(f"run {run_id} was requested by {who.name}; another person must approve it "
                               "(auth.requester_cannot_approve)")
        approved_by = who.name
        try:
            summary = dict(self.starter.approve(run_id, plan_digest, approved_by,
                                                roles=frozenset({who.role}) - {"any", "none"}))
        except ApprovalRefused as e:
            raise SelfApproval(str(e)) from e
        approvals = summary.get("approvals")
        if isinstance(approvals, Mapping) and not approvals.get("satisfied", True):
            # The policy wants more distinct approvers: the run keeps waiting (engine.approvals).
            return {"run": summary, "queued": False, "approvals": dict(approvals),
                    "note": f"approval recorded ({approvals.get('text')}); the run starts when the policy "
                            "is satisfied"}
        with self._lock:
            meta = self._runs.get(run_id)
            if meta is not None:
                meta.approved = True
                meta.state = "approved"
        if meta is None:
            return {"run": summary, "queued": False,
                    "note": "approval recorded; the process that owns this run continues it"}
        if not self.worker.submit(lambda: self._execute(run_id), reserved=False):
            return {"run": summary, "queued": False,
                    "note": "approval recorded, but the worker pool is full: the run is queued at the next start"}
        plan = plan_summary(summary) or self._plan_summary(run_id)
        self.notifier.notify(meta.note("started", run_id, reason=f"approved by {approved_by}",
                                       warnings=meta.warnings, state="approved",
                                       extra={"plan": plan} if plan else {}))
        return {"run": summary, "queued": True}

    def reject(self, run_id: str, reason: str, who: Identity) -> dict[str, Any]:
        """``who`` declines the plan of a waiting run: recorded with the reason, the run ends cancelled
        (StalePlan if it is not waiting, NotFound if unknown)."""
        self.run(run_id)
        summary = dict(self.starter.reject(run_id, reason, who.name))
        with self._lock:
            meta = self._runs.get(run_id)
        if meta is not None:
            self._finish(run_id, meta, RunOutcome(run_id, "cancelled", summary.get("plan_digest"), 4,
                                                  f"rejected by {who.name}: {reason}"))
        return {"run": summary}

    def reset_breaker(self, node: str | None = None, runbook: str | None = None, by: str = "") -> list[str]:
        """Close node breakers / rate windows (``Guards.reset`` semantics); with a shared store the
        reset is recorded there (``breaker.reset`` events) so every replica sees it."""
        done = self.guards.reset(node=node, runbook=runbook)
        if self._shared():
            done = sorted(set(done) | set(self._reset_in_store(node, runbook, by)))
        self.refresh_gauges()
        return done

    # -- the shared breaker (several replicas) --------------------------------------------------------

    def _shared(self) -> bool:
        return self.leadership.describe().get("role") != "single"

    def _automatic(self) -> list[RunSummary]:
        """The store's automatic webhook runs, newest first (one read, label-selected by source on the
        Kubernetes store), typed."""
        return automatic_runs(self.starter.runs(limit=_BREAKER_SCAN, sources=WEBHOOK_SOURCES))

    def _was_reset(self, run_id: str, scope: str) -> bool:
        if (run_id, scope) in self._resets:
            return True
        events = self.starter.events_of(run_id, (BREAKER_RESET,))
        if any(e.get("kind") == BREAKER_RESET and e.get("scope") == scope for e in events):
            with self._lock:
                self._resets.add((run_id, scope))  # a reset is never undone: no need to read it again
            return True
        return False

    def shared_breaker(self, runbook: str, node: str | None) -> SharedBreaker | None:
        """The store's breaker verdict for an automatic candidate (None: one replica, no shared store).
        Raises when the store does not answer (the caller fails closed)."""
        if not self._shared():
            return None
        b = self.config.breaker
        read: _BreakerRead | None = getattr(self._reads, "breaker", None)
        if read is None:
            return shared_verdict(self._automatic(), runbook, node, now=self._clock(), window=b.window,
                                  max_auto_runs=b.max_auto_runs, was_reset=self._was_reset)
        fresh = read.runs is None
        if fresh:
            self._read_for_breaker(read)
        verdict = self._delivery_verdict(read, runbook, node)
        if not fresh and verdict.open_node is None and verdict.auto_runs < b.max_auto_runs:
            # Why read again: the delivery's read may only refuse. Letting a run through rests on the
            # store as it is now, so two replicas' concurrent deliveries exceed the window by at most
            # one run each, as without the shared read; a tripped breaker (a burst) reads no more.
            self._read_for_breaker(read)
            verdict = self._delivery_verdict(read, runbook, node)
        return verdict

    def _read_for_breaker(self, read: _BreakerRead) -> None:
        with self._lock:
            read.created = dict(self._auto_created)
        read.at = self._clock()
        read.runs = self._automatic()

    def _delivery_verdict(self, read: _BreakerRead, runbook: str, node: str | None) -> SharedBreaker:
        """The shared breaker's verdict from the delivery's read, plus what this replica did since."""
        b = self.config.breaker
        assert read.runs is not None

        def was_reset(run_id: str, scope: str) -> bool:
            if (run_id, scope) in read.not_reset:
                return False
            if self._was_reset(run_id, scope):
                return True
            read.not_reset.add((run_id, scope))  # Why: a tripped window would read every run per candidate
            return False

        verdict = shared_verdict(read.runs, runbook, node, now=self._clock(), window=b.window,
                                 max_auto_runs=b.max_auto_runs, was_reset=was_reset)
        with self._lock:
            since = self._auto_created.get(runbook, 0) - read.created.get(runbook, 0)
        if since:
            verdict = replace(verdict, auto_runs=verdict.auto_runs + since)
        local = self.guards.open_breaker(node) if node is not None else None
        if verdict.open_node is None and local is not None and local.since >= read.at:
            verdict = replace(verdict, open_node=local)  # opened here after the read: it stays open
        return verdict

    def _reset_in_store(self, node: str | None, runbook: str | None, by: str) -> list[str]:
        runs = self._automatic()
        done: list[str] = []
        if runbook is None:
            nodes = [node] if node is not None else sorted({r.node for r in runs if r.node is not None})
            for n in nodes:
                failed = open_in_store(runs, n, self._was_reset)
                if failed is not None:
                    self.starter.record_event(failed.id, BREAKER_RESET, {"scope": "node", "by": by})
                    with self._lock:
                        self._resets.add((failed.id, "node"))
                    done.append(f"node:{n}")
        if node is None:
            for r in in_window(runs, runbook, self._clock(), self.config.breaker.window):
                if not self._was_reset(r.id, "runbook"):
                    self.starter.record_event(r.id, BREAKER_RESET, {"scope": "runbook", "by": by})
                    with self._lock:
                        self._resets.add((r.id, "runbook"))
                    done.append(f"runbook:{r.runbook}")
        return sorted(set(done))

    def refresh_gauges(self) -> None:
        """Bring ``breaker_open`` up to date (called before ``/metrics`` is rendered)."""
        current: dict[tuple[str, str], bool] = {("node", n): True for n in self.guards.open_nodes()}
        current.update({("runbook", r): t for r, t in self.guards.rate_tripped().items()})
        snap, b = self._last_cluster, self.config.breaker
        if snap is not None:
            current[("cluster", "unhealthy")] = (len(snap.unhealthy_nodes) > b.max_unhealthy_nodes
                                                 or snap.unhealthy_gpus > b.max_unhealthy_gpus)
        for gone in self._known_breaker_keys - set(current):
            current[gone] = False
        for (kind, key), is_open in current.items():
            self.metrics.set_breaker(kind, key, is_open)
        self._known_breaker_keys = set(current)

    def status(self) -> dict[str, Any]:
        """``/healthz`` (open, any ``Host``): that the server lives, and counts. Never a node name, a
        run id, the breaker's state or a replica's identity: those are for readers (``/breaker``,
        ``/runs``, ``/readyz``)."""
        with self._lock:
            owned = len(self._runs)
        return {"triggers": len(self.index), "runs_tracked": owned, "workers": self.worker.stats(),
                "role": str(self.leadership.describe().get("role", ""))}


def summarize(decisions: Sequence[Decision]) -> tuple[int, str]:
    """HTTP status and metrics outcome for a list of decisions."""
    if any(d.outcome == "started" for d in decisions):
        return 202, "started"
    if decisions and all(d.outcome == "duplicate" for d in decisions):
        return 200, "duplicate"
    if decisions and all(d.outcome == "ignored" for d in decisions):
        return 200, "ignored"
    return 200, "nothing-started"
