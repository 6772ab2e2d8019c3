"""The engine's ``RunStarter`` for ``runbook serve``: paged runs through the same RunService as the CLI.

``submit`` only validates params and records the run (``RunService.create``; it is on the
webhook's request path). ``execute`` (in a worker thread) is ``engine.lifecycle.continue_run`` as
an automatic front end: plan with live facts (the trigger's ``require_diagnosis`` gate first), a
blocked plan recorded as blocked, an ``approve``-mode run parked for its approval, an ``auto`` or
approved run executed by the run service (run guards never overridden, the node Lease, the
executor). ``approve``/``reject`` and the takeover of a silent replica's run are the lifecycle's
too. The store is the only state, so runs and pending approvals survive a server restart
(``recover``). This module translates the ``RunStarter`` protocol into those calls; what it decides
itself is the server's: which recorded runs a (leading) server picks up, when another replica's
executor counts as silent, and the shared dedup run ids.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from engine import lifecycle
from engine.errors import RunbookError, UsageError
from engine.integrity import ESCALATED_EVENT
from engine.loader import list_runbooks
from engine.locks import LeaseObservation, holder_for, lease_name, replica_holder, replica_lease_name
from engine.model import Runbook, RunState
from engine.params import prepare_run
from engine.runs import RunService
from engine.serve.starter import (
    BREAKER_RESET,
    WEBHOOK_SOURCES,
    AlreadyStarted,
    RunOutcome,
    RunRequest,
    RunTicket,
    TriggerSpec,
)
from engine.store import ACTIVE_STATES, RunStore

log = logging.getLogger("runbook.serve")

if TYPE_CHECKING:
    from engine.connectors.base import KubeAPI
    from engine.loader import LoadedRunbook
    from engine.run_guards import GuardConfig
    from engine.settings import Settings
    from engine.store import RunRecord


class JournalRunStarter:
    """Implements ``engine.serve.starter.RunStarter`` over ``RunService`` and the journal."""

    def __init__(self, settings: Settings, *, lock_wait: float = 0.0, guards: GuardConfig | None = None,
                 shared_dedup_window: float | None = None, clock: Callable[[], float] = time.time,
                 kube: Callable[[], KubeAPI] | None = None, monotonic: Callable[[], float] = time.monotonic) -> None:
        """``shared_dedup_window``: replicas share the store, so a page's run id is derived from it
        (``_shared_id``) and creating it is the atomic claim: a second replica's create fails; and
        ``recover`` takes over runs whose executor went silent (``_silent_executor``)."""
        self.service = RunService(settings, live=None, lock_wait=lock_wait, automatic=True, guards=guards)
        self._shared_window = shared_dedup_window
        self._clock = clock
        self._kube = kube or settings.kube
        self._lock_namespace = settings.lease_namespace
        self._store_namespace = settings.store_namespace  # the replicas' liveness Leases live there
        self._replicas: dict[str, LeaseObservation] = {}  # other replicas' liveness Leases, as watched here
        self._monotonic = monotonic
        self._watching: dict[str, LeaseObservation] = {}  # running runs of other replicas: their node Lease
        self._taken_over: set[str] = set()
        loaded, problems = list_runbooks(settings.runbooks_dir)
        if problems:
            raise UsageError("; ".join(loc.format(msg) for loc, msg in problems))
        self._runbooks = {lr.name: lr for lr in loaded}
        self._executing: set[str] = set()
        self._cancels: dict[str, threading.Event] = {}  # runs executing here: their cancel (``cancel``)
        self._guard = threading.Lock()
        self.service.preload()  # at server start, not in the first run's worker (docs/performance.md, P8)
        # Why: a burst's breaker reads and GET /runs list the store many times a second (P10 burst)
        self.journal.follow(event_kinds=(BREAKER_RESET,))
        self.service.integrity.keys()  # the run key: read, or created at first start (engine.integrity)

    @property
    def journal(self) -> RunStore:
        return self.service.journal

    def trigger_index(self) -> Sequence[TriggerSpec]:
        return [TriggerSpec(runbook=name, trigger=t, node_param=lr.runbook.node_param)
                for name, lr in sorted(self._runbooks.items()) for t in lr.runbook.triggers]

    def submit(self, request: RunRequest) -> RunTicket:
        loaded = self._runbooks.get(request.runbook)
        if loaded is None:
            raise UsageError(f"no runbook named {request.runbook!r}")
        prepared = prepare_run(loaded, dict(request.params), node=request.node)
        wanted = self._shared_id(request) if self._shared_window and request.dedup_key else None
        try:
            run_id = self.service.create(
                prepared, None, source=request.source, approval_required=request.mode == "approve",
                note={"mode": request.mode, "reason": request.reason, "warnings": list(request.warnings),
                      "dedup_key": request.dedup_key, "require_diagnosis": request.require_diagnosis,
                      **({"windows": [w.model_dump(mode="json", exclude_defaults=True) for w in request.windows]}
                         if request.windows else {})},
                requested_by=request.requested_by or request.source, run_id=wanted)
        except RunbookError:
            if wanted is not None and self._exists(wanted):
                raise AlreadyStarted(wanted, f"the same page already started run {wanted} "
                                     "(at another replica: dedup shared through the store)") from None
            raise
        return RunTicket(run_id=run_id, state=RunState.PENDING.value)

    def _shared_id(self, request: RunRequest) -> str:
        """The run id of this page in this fingerprint window: ``r-<digest of runbook and dedup key>-<window
        number>``. Every replica computes the same one, so the store's create lets one of them through.
        A run of the previous window younger than the window makes this page a duplicate too."""
        assert self._shared_window
        digest = hashlib.blake2b(f"{request.runbook}|{request.dedup_key}".encode("utf-8", "backslashreplace"),
                                 digest_size=8).hexdigest()
        now = self._clock()
        window = int(now // self._shared_window)
        previous = f"r-{digest}-{window - 1}"
        try:
            rec = self.journal.get_run(previous)
        except UsageError:
            pass
        else:
            if now - rec.created < self._shared_window:
                raise AlreadyStarted(previous, f"the same page started run {previous} "
                                     f"{now - rec.created:.0f}s ago (dedup shared through the store)")
        return f"r-{digest}-{window}"

    def _exists(self, run_id: str) -> bool:
        try:
            self.journal.get_run(run_id)
        except RunbookError:
            return False
        return True

    def execute(self, run_id: str) -> RunOutcome:
        with self._guard:
            if run_id in self._executing:
                rec = self.journal.get_run(run_id)
                return RunOutcome(run_id, rec.state, rec.plan_digest, rec.exit_code, "already executing")
            self._executing.add(run_id)
            self._cancels[run_id] = threading.Event()
        try:
            return self._execute(run_id)
        except RunbookError as e:
            self.journal.append(run_id, "run.failed", reason=str(e))
            self.journal.set_state(run_id, RunState.FAILED.value, exit_code=e.exit_code)
            return RunOutcome(run_id, RunState.FAILED.value, None, e.exit_code, str(e))
        finally:
            with self._guard:
                self._executing.discard(run_id)
                self._cancels.pop(run_id, None)

    def cancel(self, run_id: str, reason: str) -> str:
        """``RunStarter.cancel``: the executing run's cancel event (the executor stops before its next
        action), or a pending/waiting run ended ``cancelled``; recorded as ``run.cancel_requested``."""
        rec = self.journal.get_run(run_id)  # UsageError for an unknown id
        with self._guard:
            event = self._cancels.get(run_id)
        if rec.state.is_final:
            return rec.state.value
        self.journal.append(run_id, "run.cancel_requested", reason=reason)
        if event is not None:
            event.set()
            return "cancelling"
        if rec.state in (RunState.PENDING, RunState.WAITING_APPROVAL):
            return lifecycle.cancel(self.service, run_id, reason).state.value
        return "requested"

    def _cancel_event(self, run_id: str) -> threading.Event | None:
        with self._guard:
            return self._cancels.get(run_id)

    def _execute(self, run_id: str) -> RunOutcome:
        with self._guard:
            taken_over = run_id in self._taken_over
        rec = self.journal.get_run(run_id)
        if self._shared_window and rec.state is RunState.PENDING and rec.owner_pid is not None and \
                rec.owner_host != socket.gethostname():
            # Why: queued here, but adopted by the leader meanwhile (this replica's liveness Lease
            # went unrenewed): its new owner executes it; the claim below would take it back.
            return RunOutcome(run_id, rec.state.value, rec.plan_digest, None,
                              f"adopted by {rec.owner_host}/{rec.owner_pid}: executed there")
        window: list[RunOutcome] = []

        def window_gate(rec: RunRecord) -> lifecycle.Continued | None:
            """Maintenance windows (engine.run_windows): deferred or refused before anything else."""
            awaiting = lifecycle.requires_approval(self.service, rec) and rec.approved_digest is None
            outside = self._outside_window(run_id, self._runbooks[rec.runbook].runbook, awaiting)
            if outside is None:
                return None
            window.append(outside)
            return lifecycle.Continued(run_id, rec.state, outside.exit_code, outside.reason, outside.plan_digest)

        done = lifecycle.continue_run(self.service, run_id, automatic=True, taken_over=taken_over,
                                      runbooks=self._runbooks, after_claim=window_gate,
                                      before_plan=self._diagnosis_gate, cancel_event=self._cancel_event(run_id))
        if window:
            return window[0]  # its own outcome ("deferred", with the next opening)
        return RunOutcome(run_id, done.state.value, done.plan_digest, done.exit_code, done.reason)

    def _diagnosis_gate(self, rec: RunRecord) -> lifecycle.Continued | None:
        """The trigger's ``require_diagnosis`` before a run is planned (None: go on)."""
        if not self._requires_diagnosis(rec.id):
            return None
        return self._diagnose(rec.id, self._runbooks[rec.runbook], dict(rec.params))

    def require_approval(self, run_id: str, reason: str) -> None:
        """A recovered or taken-over automatic run that the server's rules would not let run
        automatically now (``force_mode``, ``mode_overrides``, the breaker): from now on it waits for
        a person, as a new run would (an ``approval.required`` event, sealed with the run)."""
        if self.service.refuse_unverified(run_id) is not None or self._escalated(run_id):
            return
        self.journal.append(run_id, ESCALATED_EVENT, reason=reason)
        self.service.integrity.seal(run_id, approval_required=True)

    def _escalated(self, run_id: str) -> bool:
        return lifecycle.requires_approval(self.service, self.journal.get_run(run_id))

    def _outside_window(self, run_id: str, runbook: Runbook, awaiting_approval: bool) -> RunOutcome | None:
        """An automatic run outside its maintenance windows (engine.run_windows): deferred (stays
        pending, ``run.deferred`` names the next opening; the server executes it again then) or
        refused (blocked). A run still to be approved is planned at any time: its window is checked
        when it may start."""
        if awaiting_approval:
            return None
        from engine.run_windows import deferral, note_of, trigger_windows

        found = deferral(runbook, self.service.clock(), trigger_windows(note_of(self.journal.events(run_id))))
        if found is None:
            return None
        if found.action == "refuse":
            self.service.record_blocked(run_id, found.reason)
            return RunOutcome(run_id, RunState.BLOCKED.value, None, 3, found.reason)
        events = self.journal.events(run_id)
        last = next((e for e in reversed(events) if e.kind == "run.deferred"), None)
        if last is None or last.data.get("until") != found.as_event()["until"]:
            self.journal.append(run_id, "run.deferred", **found.as_event())
        return RunOutcome(run_id, "deferred", None, None, found.reason, extra=found.as_event())

    def _requires_diagnosis(self, run_id: str) -> bool:
        notes = [e.data for e in self.journal.events(run_id) if e.kind == "run.note"]
        return bool(notes and notes[0].get("require_diagnosis"))

    def _diagnose(self, run_id: str, loaded: LoadedRunbook, params: dict[str, Any]) -> lifecycle.Continued | None:
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
        return lifecycle.Continued(run_id, RunState.BLOCKED, 3, reason)

    def approve(self, run_id: str, plan_digest: str, approved_by: str, *,
                roles: frozenset[str] = frozenset()) -> Mapping[str, Any]:
        return lifecycle.approve(self.service, run_id, plan_digest, approved_by, roles=roles)

    def reject(self, run_id: str, reason: str, rejected_by: str) -> Mapping[str, Any]:
        return lifecycle.reject(self.service, run_id, reason, rejected_by).summary()

    def runs(self, limit: int = 100, *, sources: tuple[str, ...] | None = None) -> Sequence[Mapping[str, Any]]:
        return [r.summary() for r in self.journal.list_runs(limit=limit, sources=sources)]

    def run(self, run_id: str) -> Mapping[str, Any]:
        rec = self.journal.get_run(run_id)
        events = self.journal.events(run_id)
        notes = [e.data for e in events if e.kind == "run.note"]
        requested = [e.data.get("by") for e in events if e.kind == "run.requested"]
        escalated = any(e.kind == ESCALATED_EVENT for e in events)
        return {**rec.summary(), "approval_required": rec.approval_required or escalated, "plan": rec.plan,
                "warnings": notes[0].get("warnings", []) if notes else [],
                "reason": notes[0].get("reason", "") if notes else "",
                "dedup_key": notes[0].get("dedup_key", "") if notes else "",
                "requested_by": requested[0] if requested else None,
                "outcome_reason": outcome_reason(events),
                "approvals": self._approvals(run_id, rec.state),
                "events": [e.as_dict() for e in events]}

    def events_of(self, run_id: str, kinds: tuple[str, ...]) -> Sequence[Mapping[str, Any]]:
        return [e.as_dict() for e in self.journal.events_of(run_id, kinds)]

    def _approvals(self, run_id: str, state: str) -> Mapping[str, Any] | None:
        """"1 of 2 approvals" for a waiting run (engine.approvals); None otherwise."""
        if state != RunState.WAITING_APPROVAL.value:
            return None
        from engine.approvals import policy_status

        status = policy_status(self.journal, run_id, self.service.settings.approval_config(),
                               labels=self.service.node_labels(run_id))
        return status.as_dict() if status is not None else None

    def record_event(self, run_id: str, kind: str, data: Mapping[str, Any]) -> None:
        self.journal.get_run(run_id)  # UsageError for an unknown id
        self.journal.append(run_id, kind, **dict(data))

    def runbook_names(self) -> Sequence[str]:
        return sorted(self._runbooks)

    def preview(self, runbook: str, params: Mapping[str, str], node: str) -> Mapping[str, Any]:
        """``runbook plan``'s plan (facts, previews) for the plans page; no journal record, no Lease."""
        if runbook not in self._runbooks:
            raise UsageError(f"no runbook named {runbook!r}")
        targets = self.service.targets(runbook, dict(params), node=node)
        plan = self.service.plan_targets(targets, preview=True)[0]
        return plan.model_dump(mode="json")

    def prune(self, keep: int, max_age: float | None) -> Sequence[str]:
        return self.journal.prune(keep=keep, max_age=max_age)

    def stopping(self) -> None:
        """``RunStarter.stopping``: runs waiting for room in the cluster's budget stop waiting."""
        self.service.stop_waiting()

    def hand_back(self, run_id: str) -> bool:
        """``RunStarter.hand_back``: a pending run this process owns and does not execute is disowned.
        Why: ``recover`` leaves a pending run whose owner is a process on another machine to that
        process (it cannot tell a queue from a dead one); a run with no owner is anyone's to resume."""
        with self._guard:
            executing = run_id in self._executing
        if executing and not self.service.hand_back_waiting(run_id):
            return False  # executing (a run waiting for room in the budget is not: it stops waiting)
        try:
            rec = self.journal.get_run(run_id)
        except RunbookError:
            return False
        if rec.state is not RunState.PENDING or \
                (rec.owner_host, rec.owner_pid) != (socket.gethostname(), os.getpid()):
            return False
        self.journal.disown(run_id)
        self.journal.append(run_id, "run.handed_back", reason="the server that queued it stopped before "
                            "executing it; the leader resumes it")
        return True

    def recover(self) -> Sequence[str]:
        """Runs a previous server left: the ids to execute (pending, interrupted, or approved while
        waiting). Runs still waiting for a person are left waiting (disowned), never re-planned or
        re-announced; runs another live process owns are left to it."""
        out = []
        running = set()
        leases: dict[str, Any] = {}  # this call's reads of replica Leases (a dead replica's runs: one read)
        self._ingest_store_approvals()
        for rec in self.journal.list_runs(limit=1000, states=(*ACTIVE_STATES, RunState.INTERRUPTED)):
            if rec.source not in WEBHOOK_SOURCES:
                continue  # a CLI run: its operator resumes it
            if rec.state is RunState.INTERRUPTED and not self._died_silently(rec.id):
                continue  # stopped on purpose (API away, Lease held, a confirmation needed): a person resumes it
            if rec.state is RunState.RUNNING:
                running.add(rec.id)
                if self._shared_window and self._silent_executor(rec) and \
                        lifecycle.take_over(self.service, rec, self._takeover_reason(rec)):
                    with self._guard:
                        self._taken_over.add(rec.id)
                    out.append(rec.id)
                continue  # else a live process is executing it
            approved = rec.plan_digest is not None and rec.approved_digest == rec.plan_digest
            if rec.approval_required and not approved and self._parked(rec.id):
                self.journal.disown(rec.id)
                continue
            if self._shared_window and rec.state is RunState.PENDING and rec.owner_pid is not None and (
                    rec.owner_host, rec.owner_pid) != (socket.gethostname(), os.getpid()):
                # Queued at another replica (another machine): its worker executes it, unless that
                # replica is dead by its liveness Lease; then it is adopted here, exactly once.
                why = self._dead_replica(rec, leases)
                if why is not None and self._adopt(rec, why):
                    out.append(rec.id)
                continue
            if (rec.state in (RunState.PENDING, RunState.INTERRUPTED) or approved) and \
                    self.service.refuse_unverified(rec.id) is None and self.journal.claim(rec.id):
                out.append(rec.id)
        for gone in set(self._watching) - running:
            del self._watching[gone]
        self._forget_dead_replicas(leases)
        return list(reversed(out))

    def _forget_dead_replicas(self, leases: dict[str, Any]) -> None:
        """Delete the liveness Leases of replicas judged dead in this call (their queues adopted), at
        the version observed: one that renewed meanwhile (a 409) keeps its Lease. A Lease held by
        another process (a reused host and pid) is that process's and is left alone."""
        for name, lease in leases.items():
            seen = self._replicas.get(name)
            if lease is None or seen is None or seen.unchanged_for(lease) < max(1, lease.duration_seconds):
                continue
            try:
                self._kube().delete_lease(lease)
            except Exception as e:  # Why: a Lease left behind only costs an object; the next sweep retries
                log.warning("liveness Lease %s/%s of a dead replica not deleted: %s", lease.namespace, name, e)
                continue
            self._replicas.pop(name, None)

    def _ingest_store_approvals(self) -> None:
        """Approvals made with ``runbook approve --store kubernetes`` (engine.store_approvals): each
        request whose author, as the API server recorded it, RBAC lets approve runs in the store
        namespace and who did not request the run, approves exactly the plan digest it names of a
        run waiting for it; recorded sealed, as an approval through the HTTP API."""
        from engine import store_approvals
        from engine.kube_store import KubeRunStore

        store = self.journal
        if not isinstance(store, KubeRunStore):
            return
        try:
            items = store.api.list_objects(store_approvals.API_VERSION, store_approvals.PLURAL,
                                           label_selector=f"{store_approvals.LABEL}=true")
        except Exception as e:  # Why: not served or not allowed: approvals through HTTP still work
            log.debug("store approvals not read: %s", e)
            return
        for item in items:
            found = store_approvals.parse(item)
            if found is None or found.namespace != store.namespace:
                continue
            try:
                rec = store.get_run(found.run_id)
            except RunbookError:
                continue
            if rec.state != RunState.WAITING_APPROVAL.value or rec.plan_digest != found.digest or \
                    rec.approved_digest == found.digest:
                continue
            why = self._store_approval_refused(found, rec.id)
            if why is not None:
                self.journal.append(rec.id, "approval.refused", by=found.username, request=found.name, reason=why)
                continue
            try:
                self.service.approve(rec.id, found.digest, found.username)
            except RunbookError as e:
                log.warning("run %s: approval %s not recorded: %s", rec.id, found.name, e)
                continue
            self.journal.append(rec.id, "approval.request", by=found.username, request=found.name)

    def _store_approval_refused(self, found: Any, run_id: str) -> str | None:
        """Why the author of a store approval may not approve this run (None: they may)."""
        from engine.cluster_auth import GROUP, RESOURCE, VERB

        requested = [e.data.get("by") for e in self.journal.events(run_id) if e.kind == "run.requested"]
        if requested and requested[0] == found.username:
            return f"{found.username} requested this run and may not approve it"
        reviews: Any = self._kube()
        try:
            answer = reviews.review_access(user=found.username, groups=found.groups, uid=found.uid,
                                           extra=found.extra, verb=VERB, resource=RESOURCE, group=GROUP,
                                           namespace=self.journal_namespace())
        except Exception as e:  # Why: RBAC could not be asked: no approval (fail closed)
            return f"the API server could not be asked whether {found.username} may approve: {e}"
        if not answer.allowed:
            return (f"{found.username} may not approve: RBAC allows no verb approve on remediationruns in "
                    f"namespace {self.journal_namespace()} ({answer.reason or 'no rule'})")
        return None

    def journal_namespace(self) -> str:
        return str(getattr(self.journal, "namespace", ""))

    def _silent_executor(self, rec: RunRecord) -> bool:
        """A ``running`` run of another replica whose executor is gone: its node Lease (held by
        ``runbook/<run id>`` while it executes, renewed at TTL/3) has been seen unchanged here for the
        Lease's whole duration, by this process's monotonic clock across ``recover`` calls (the
        leader calls it every sweep). A live executor renews it; one cut from the API server stops
        acting past its renew deadline (2/3 of the TTL), before this can say yes."""
        if not rec.nodes or (rec.owner_host, rec.owner_pid) == (socket.gethostname(), os.getpid()):
            return False
        try:
            lease = self._kube().read_lease(self._lock_namespace, lease_name(rec.nodes[0]))
        except Exception:  # the API away: nothing is judged silent (fail closed)
            return False
        if lease is None or lease.holder != holder_for(rec.id):
            self._watching.pop(rec.id, None)
            return False  # not holding its Lease: not yet or no longer acting; judged when it does
        seen = self._watching.setdefault(rec.id, LeaseObservation(self._monotonic))
        return seen.unchanged_for(lease) >= max(1, lease.duration_seconds)

    def _dead_replica(self, rec: RunRecord, leases: dict[str, Any]) -> str | None:
        """Why the replica that queued the pending run ``rec`` is dead, or None (alive, or it cannot be
        told). Its liveness Lease (``engine.serve.leader.ReplicaLease``): held by another process now
        (it stopped; its host and pid were reused), or seen unchanged here for its whole duration by
        this process's monotonic clock across ``recover`` calls (a live replica renews it at TTL/3).
        No Lease at all (a replica of an older version, or one that stopped cleanly and handed its
        queue back) or an API error: nothing is judged dead (fail closed; ``runbook resume`` remains)."""
        if rec.owner_host is None or rec.owner_pid is None:
            return None
        name = replica_lease_name(rec.owner_host, rec.owner_pid)
        where = f"{self._store_namespace}/{name}"
        if name not in leases:
            try:
                leases[name] = self._kube().read_lease(self._store_namespace, name)
            except Exception as e:  # the API away: nobody is judged dead
                log.warning("replica Lease %s not read: %s", where, e)
                leases[name] = None
        lease = leases[name]
        if lease is None:
            self._replicas.pop(name, None)
            return None
        if lease.holder != replica_holder(rec.owner_host, rec.owner_pid, rec.owner_start):
            return (f"its replica ({rec.owner_host}/{rec.owner_pid}) is gone: its liveness Lease {where} is held "
                    f"by {lease.holder or 'nobody'} now")
        seen = self._replicas.setdefault(name, LeaseObservation(self._monotonic))
        unchanged = seen.unchanged_for(lease)
        if unchanged < max(1, lease.duration_seconds):
            return None
        return (f"its replica ({rec.owner_host}/{rec.owner_pid}) died without handing it back: its liveness "
                f"Lease {where} was seen unchanged for {unchanged:.0f}s (duration {lease.duration_seconds}s)")

    def _adopt(self, rec: RunRecord, why: str) -> bool:
        """Claim a dead replica's queued run, only while that replica is still its recorded owner (a
        resourceVersion-guarded write: of two processes adopting it at once, one wins), and record
        ``run.adopted`` (whose it was, why). The caller continues it like any recovered run."""
        owner = (rec.owner_host, rec.owner_pid, rec.owner_start)
        if self.service.refuse_unverified(rec.id) is not None or \
                not self.journal.claim(rec.id, from_owner=owner):
            return False
        self.journal.append(rec.id, "run.adopted", reason=why, previous_owner=f"{rec.owner_host}/{rec.owner_pid}")
        log.warning("run %s adopted: %s", rec.id, why)
        return True

    def _takeover_reason(self, rec: RunRecord) -> str:
        return (f"its executor ({rec.owner_host}/{rec.owner_pid}) stopped renewing the node Lease of "
                f"{rec.nodes[0] if rec.nodes else '?'}: resumed here from the recorded progress")

    def _died_silently(self, run_id: str) -> bool:
        """An ``interrupted`` run whose executor recorded no interruption: its process died (the store
        reads it as interrupted; the Kubernetes store also writes phase Interrupted), so it is an
        orphan to resume, unlike a run the engine itself stopped and recorded as interrupted."""
        states = [e.data.get("state") for e in self.journal.events(run_id) if e.kind == "run.state"]
        return not states or states[-1] != RunState.INTERRUPTED.value

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
