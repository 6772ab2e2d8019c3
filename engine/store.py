"""The run store: the interface every front end and the run service use to record runs.

Two implementations: ``engine.journal.Journal`` (an embedded SQLite file, the default) and
``engine.kube_store.KubeRunStore`` (each run a ``RemediationRun`` custom resource, for cluster
mode). Both are written ahead of every effect: a method returns only once the record is durable
(SQLite: an fsync'ed WAL commit; Kubernetes: the API server's answer, i.e. etcd's commit), and
raises (``JournalError``, ``KubeError``) otherwise, so an ``action.intent`` that could not be
recorded means the action is never taken.

The records (``RunRecord``, ``EventRecord``, ``StepProgress``) and the run states are the same
whatever the store; ``progress_from_events`` derives a resume's progress from the events, so both
stores answer ``progress`` identically. ``Settings.open_journal`` picks the store of a command
(``--store sqlite|kubernetes``, ``--store-namespace``).

This module defines; it never talks to SQLite or Kubernetes itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from engine.journal import (
    ACTIVE_STATES,
    DONE_STEP_STATUSES,
    FINAL_STATES,
    RESUMABLE_STATES,
    EventRecord,
    RunRecord,
    StepProgress,
    progress_from_events,
)

if TYPE_CHECKING:
    from engine.journal import Journal
    from engine.kube_store import KubeRunStore

__all__ = [
    "ACTIVE_STATES",
    "DEFAULT_STORE",
    "DEFAULT_STORE_NAMESPACE",
    "DONE_STEP_STATUSES",
    "FINAL_STATES",
    "RESUMABLE_STATES",
    "STORES",
    "EventRecord",
    "RunRecord",
    "RunStore",
    "StepProgress",
    "opened",
    "progress_from_events",
]

STORES = ("sqlite", "kubernetes")
DEFAULT_STORE = "sqlite"
DEFAULT_STORE_NAMESPACE = "runbook-system"


@runtime_checkable
class RunStore(Protocol):
    """Where runs, their events and approvals are recorded. Every write is durable on return.

    Run states: ``pending``, ``waiting-approval``, ``running`` (active), ``succeeded``, ``failed``,
    ``blocked``, ``cancelled`` (final), ``interrupted`` (resumable). A read reports an active run
    whose owning process is known to be gone as ``interrupted``.
    """

    # -- secrets ------------------------------------------------------------------------------

    def add_secret(self, value: str | None) -> None:
        """Mask this exact value wherever it would be written."""
        ...

    def redact(self, value: Any) -> Any:
        """A copy of ``value`` as the store would write it: secret-looking keys and registered
        secret values masked (the event log shows what the store shows)."""
        ...

    # -- runs ---------------------------------------------------------------------------------

    def create_run(self, runbook: str, params: Mapping[str, Any], nodes: list[str], *,
                   source: str = "cli", state: str = "pending", run_id: str | None = None,
                   approval_required: bool = False,
                   events: Sequence[tuple[str, Mapping[str, Any]]] = ()) -> str:
        """Record a new run owned by this process, with its first ``events`` (kind, data); its id."""
        ...

    def claim(self, run_id: str) -> bool:
        """Make this process the run's owner; False (changing nothing) while another live owner has it.
        Atomic: two claims of one run never both succeed."""
        ...

    def disown(self, run_id: str) -> None:
        """The run is parked on purpose (waiting for an approval): no process owns it."""
        ...

    def set_plan(self, run_id: str, plan: Mapping[str, Any], digest: str) -> None: ...

    def set_state(self, run_id: str, state: str, *, exit_code: int | None = None) -> None:
        """Record the run's state (and a ``run.state`` event)."""
        ...

    def record_approval(self, run_id: str, digest: str, approved_by: str) -> RunRecord:
        """Approve the run's current plan. ``StalePlan`` for another digest or a run not waiting;
        ``UsageError`` for an unknown run."""
        ...

    def get_run(self, run_id: str) -> RunRecord:
        """``UsageError`` for an unknown run."""
        ...

    def list_runs(self, *, limit: int = 100, states: tuple[str, ...] | None = None) -> list[RunRecord]:
        """Newest first."""
        ...

    def prune(self, *, keep: int, max_age: float | None = None, now: float | None = None) -> list[str]:
        """Retention: delete finished runs (final states only) beyond the ``keep`` newest, and those
        that finished more than ``max_age`` seconds ago. Returns the deleted run ids. Active,
        waiting and interrupted runs are never deleted."""
        ...

    # -- events -------------------------------------------------------------------------------

    def append(self, run_id: str, kind: str, step: str | None = None, **data: Any) -> int:
        """Append one event durably; its sequence number (1, 2, ... per run, never reused)."""
        ...

    def events(self, run_id: str) -> list[EventRecord]: ...

    def progress(self, run_id: str) -> StepProgress:
        """Which steps are done and which one was left half-way (``progress_from_events``)."""
        ...

    def step_progress(self, run_id: str) -> tuple[set[str], str | None]:
        """(completed steps, the step whose action started without a successful outcome)."""
        ...

    def close(self) -> None: ...


@contextmanager
def opened(store: RunStore | Path | str | None) -> Iterator[RunStore]:
    """``store`` itself (left open: its owner closes it), or the SQLite journal at that path
    (``None``: the default path), opened for the block and closed after it."""
    if store is None or isinstance(store, Path | str):
        from engine.journal import Journal

        journal = Journal(store)
        try:
            yield journal
        finally:
            journal.close()
    else:
        yield store


def _journal_is_a_run_store(journal: Journal) -> RunStore:
    return journal  # mypy checks that the SQLite journal satisfies the interface


def _kube_store_is_a_run_store(store: KubeRunStore) -> RunStore:
    return store  # mypy checks that the Kubernetes store satisfies the interface
