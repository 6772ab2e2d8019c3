"""The contract between ``runbook serve`` and the run machinery: the ``RunStarter`` Protocol.

The server decides *whether* and *how* (mode, warnings) a run starts; a ``RunStarter`` owns
*what a run is*: params validation, the journal, planning, approvals, the node Lease, execution.
The real implementation lives with the engine (``engine.serve_starter.JournalRunStarter``, an
adapter over the run service); unit tests use ``tests.fakes.FakeRunStarter``. This module
holds types only: no I/O, no decisions.

Lifecycle of a paged run, and which side calls what::

    webhook -> guards pass -> submit(RunRequest)          fast (< ~20 ms): validate params, create the
                                                          journal run in state ``pending``; return its id
            -> worker pool -> execute(run_id)             slow, in a worker thread: plan; in ``approve``
                                                          mode record plan + digest, state
                                                          ``waiting-approval``, return; in ``auto`` mode
                                                          take the node Lease, run, verify, return
    POST /runs/{id}/approve -> approve(id, digest, by)    fast: record the approval (journal), or raise
    POST /ui/runs/{id}/decision -> reject(id, why, by)    fast: record the rejection, end the run cancelled
            -> worker pool -> execute(run_id)             continue the approved run to its end
    server start -> recover()                             claim what a previous server left; returns the
                                                          run ids to queue for ``execute``
    POST /ui/plans/request -> preview(runbook, params, node)   a plan with live facts and dry-run
                                                          previews, recorded nowhere (the plans page)

Rules every implementation must keep:

* ``submit`` must not plan, gather facts or touch the cluster: it runs on the request path.
  It raises ``engine.errors.UsageError`` for an unknown runbook or invalid params (params are
  validated like any param: ``engine.params.resolve_params``); the server answers with the reason.
* ``submit`` raises ``AlreadyStarted`` when replicas share the store and the same page (runbook and
  dedup key) already started a run within the fingerprint window, wherever it arrived.
* ``submit`` records ``request.warnings`` (breaker warnings) and ``request.reason`` with the run, so
  the reviewer of an ``approve``-mode plan sees why it was not automatic.
* ``request.require_diagnosis`` (the trigger's ``require_diagnosis``): before planning, ``execute``
  reads the node's facts (read-only) and evaluates the runbook's declared diagnosis. When it does
  not match, the run ends ``blocked`` (exit 3) with the evidence in its record and its reason:
  nothing is planned, nobody is paged for approval, nothing changes.
* ``execute`` never raises for a run that failed or was blocked: it returns a ``RunOutcome`` with the
  final state. An exception is reported as a failed run. It is safe to call again for a run that
  is ``waiting-approval`` and approved (it continues), and it returns the current state for a run
  that is already final.
* ``approve`` raises ``engine.errors.StalePlan`` when the digest is not the run's current plan or the
  run is not waiting for approval, and ``UsageError`` for an unknown run id.
* ``run``/``runs`` return ``RunRecord.summary()``-shaped dicts: at least ``id``, ``runbook``,
  ``params``, ``nodes``, ``state``, ``source``, ``plan_digest``, ``approval_required``; ``run`` also
  ``dedup_key`` (the server rebuilds its fingerprint windows from it at start) and ``requested_by``
  (who asked for the run: the sender identity, or the user of a CLI run).
* ``approve``'s ``approved_by`` is the identity bound to the approver's credential, never a name the
  caller typed.
* ``require_approval`` (a recovered automatic run the rules would no longer let run automatically)
  makes ``execute`` park that run for approval from then on, durably and tamper-evidently.
* ``preview`` changes nothing and records nothing: no journal run, no Lease, no mutation (facts are
  read, previews are Ansible check mode and server-side dry-runs, as ``runbook plan``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from engine.model import ParamValue, Trigger
from engine.windows import Window

Mode = Literal["auto", "approve"]
Source = Literal["alertmanager", "pagerduty", "node-condition", "remediation"]
# The server's own runs (pages, node conditions, RunbookRemediations): it resumes them and counts
# them in its breaker; a CLI run is its operator's.
WEBHOOK_SOURCES: tuple[str, ...] = ("alertmanager", "pagerduty", "node-condition", "remediation")
BREAKER_RESET = "breaker.reset"  # event on a run: a person reset the breaker that run held open


@dataclass(frozen=True)
class TriggerSpec:
    """One trigger declared by one runbook (``triggers:`` in the runbook YAML)."""

    runbook: str
    trigger: Trigger
    node_param: str | None = "node"  # the runbook's param naming the target node (Runbook.node_param)


@dataclass(frozen=True)
class RunRequest:
    """What the server asks for: a run of ``runbook`` with ``params`` on ``node`` in ``mode``."""

    runbook: str
    params: Mapping[str, ParamValue]  # rendered from the alert; not yet validated
    node: str | None
    mode: Mode
    source: Source
    reason: str  # one line: "alertmanager: KubeNodeNotReady{node=omen2} fingerprint 4f2a..."
    warnings: tuple[str, ...] = ()  # why an ``auto`` trigger became ``approve`` (breaker), shown with the plan
    dedup_key: str = ""  # alert fingerprint or PagerDuty incident id, for the record
    requested_by: str = ""  # the sender identity that paged (recorded; it can never approve)
    require_diagnosis: bool = False  # execute checks the runbook's diagnosis on the node before planning
    windows: tuple[Window, ...] = ()  # the trigger's maintenance windows (engine.run_windows)


@dataclass(frozen=True)
class RunTicket:
    """``submit``'s answer: the journal run id and its state (normally ``pending``)."""

    run_id: str
    state: str = "pending"


@dataclass(frozen=True)
class RunOutcome:
    """``execute``'s answer: ``waiting-approval`` (with the digest) or a final run state."""

    run_id: str
    state: str  # waiting-approval | succeeded | failed | blocked | cancelled | interrupted | deferred
    plan_digest: str | None = None
    exit_code: int | None = None
    reason: str = ""  # one line: why it ended so (blocked precondition, failed step, lock holder)
    extra: Mapping[str, Any] = field(default_factory=dict)


class AlreadyStarted(Exception):
    """``submit``: the same page already started this run (at another replica sharing the store)."""

    def __init__(self, run_id: str, reason: str) -> None:
        super().__init__(reason)
        self.run_id = run_id


@runtime_checkable
class RunStarter(Protocol):
    """The run machinery as ``runbook serve`` sees it. All methods are called from threads."""

    def trigger_index(self) -> Sequence[TriggerSpec]:
        """Every trigger of every runbook the server may start (read at server start)."""
        ...

    def submit(self, request: RunRequest) -> RunTicket:
        """Validate and record a new run (state ``pending``) and return at once. UsageError if invalid."""
        ...

    def execute(self, run_id: str) -> RunOutcome:
        """Plan and, unless it must wait for approval, run. Blocking; called in a worker thread."""
        ...

    def approve(self, run_id: str, plan_digest: str, approved_by: str, *,
                roles: frozenset[str] = frozenset()) -> Mapping[str, Any]:
        """Record an approval of exactly ``plan_digest`` under the approval policy; the run's summary
        with ``approvals`` (count, required, satisfied, text) when a policy applies.
        StalePlan / UsageError / ApprovalRefused."""
        ...

    def reject(self, run_id: str, reason: str, rejected_by: str) -> Mapping[str, Any]:
        """A person declined the plan of a run waiting for approval: record who and why
        (``approval.rejected``) and end the run ``cancelled`` (exit 4); the run's summary.
        StalePlan when it is not waiting for approval, UsageError for an unknown id."""
        ...

    def require_approval(self, run_id: str, reason: str) -> None:
        """A recovered automatic run may no longer run automatically (the configuration or the
        breaker say so now): it waits for a person's approval from now on, recorded with ``reason``."""
        ...

    def runs(self, limit: int = 100, *, sources: tuple[str, ...] | None = None) -> Sequence[Mapping[str, Any]]:
        """Newest first, ``RunRecord.summary()`` dicts; ``sources``: only runs from those (the shared
        breaker reads the webhook sources' runs, label-selected on the Kubernetes store)."""
        ...

    def run(self, run_id: str) -> Mapping[str, Any]:
        """One run's summary (``UsageError`` if unknown); may add ``plan``, ``warnings``, ``events``."""
        ...

    def events_of(self, run_id: str, kinds: tuple[str, ...]) -> Sequence[Mapping[str, Any]]:
        """The run's events of those kinds, as ``run()`` shows them (``UsageError`` if unknown): what
        the shared breaker asks of every run in its window (a reset), without reading whole runs."""
        ...

    def record_event(self, run_id: str, kind: str, data: Mapping[str, Any]) -> None:
        """Append an event to the run's record (``alert.resolved``: the page that started it ended).
        Fast (one journal write); ``UsageError`` for an unknown run id."""
        ...

    def runbook_names(self) -> Sequence[str]:
        """Every runbook the server may plan or start, by name (sorted)."""
        ...

    def preview(self, runbook: str, params: Mapping[str, str], node: str) -> Mapping[str, Any]:
        """The plan of ``runbook`` for ``node`` now (a ``Plan``'s JSON shape, sealed with its digest):
        live facts and dry-run previews, recorded nowhere, changing nothing (``runbook plan``).
        Blocking (seconds: it gathers facts over SSH). ``UsageError`` for an unknown runbook or
        invalid params."""
        ...

    def cancel(self, run_id: str, reason: str) -> str:
        """Stop a run cleanly (a RunbookRemediation deleted or timed out): a run executing here finishes
        its step in flight (verified) and starts nothing new; a pending or waiting run ends
        ``cancelled`` at once. Returns what was done (``cancelling``, ``cancelled``, ``requested``:
        another process executes it, or the final state it already had). ``UsageError`` if unknown."""
        ...

    def stopping(self) -> None:
        """This server begins to stop: runs waiting for room in the cluster's budget stop waiting and
        start nothing (``hand_back`` then gives them up with the queue)."""
        ...

    def hand_back(self, run_id: str) -> bool:
        """This server stops and will not execute ``run_id``, queued here and not executing: give it up
        in the store (no owner), so the leader's ``recover`` takes it, whichever machine it runs on.
        True when it was handed back; a run that started, ended or belongs to another process is left
        as it is (False)."""
        ...

    def prune(self, keep: int, max_age: float | None) -> Sequence[str]:
        """Retention (the leader's duty): delete finished runs beyond the ``keep`` newest and those
        finished more than ``max_age`` seconds ago (``RunStore.prune``); the deleted ids."""
        ...

    def recover(self) -> Sequence[str]:
        """At server start: claim the runs a previous server process left (pending, interrupted,
        approved but not executed) and return the ids that should be queued for ``execute``.
        Waiting, unapproved runs keep waiting as they are (not re-planned, not announced again);
        runs another live process owns are left to it."""
        ...
