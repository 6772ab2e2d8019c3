"""The run store: the interface every front end and the run service use to record runs, and the
types every store shares.

Two implementations: ``engine.journal.Journal`` (an embedded SQLite file, the default) and
``engine.kube_store.KubeRunStore`` (each run a ``RemediationRun`` custom resource, for cluster
mode). Both are written ahead of every effect: a method returns only once the record is durable
(SQLite: an fsync'ed WAL commit; Kubernetes: the API server's answer, i.e. etcd's commit), and
raises (``JournalError``, ``KubeError``) otherwise, so an ``action.intent`` that could not be
recorded means the action is never taken.

This module holds what is the same whatever the store: the interface (``RunStore``), the records
(``RunRecord``, ``EventRecord``, ``StepProgress``), the run states (``engine.model.RunState`` and
the groups derived from it), secret masking (``redact``, ``SecretMask``: one masking for every
store), owner detection (``current_owner``, ``process_alive``), the run-id format, a resume's
progress derived from the events (``progress_from_events``, so every store answers ``progress``
identically) and the executor's write-ahead sink (``JournalSink``). A store only implements
``RunStore`` (``StoreBase`` gives it masking and progress). ``engine.settings.STORES`` names the
stores a command can open (``--store sqlite|kubernetes``, ``--store-namespace``) and opens them.

This module defines; it never talks to SQLite or Kubernetes itself, and imports no store.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from engine.errors import StalePlan, UsageError
from engine.model import RunState

__all__ = [
    "ACTIVE_STATES",
    "DONE_STEP_STATUSES",
    "FINAL_STATES",
    "PHASES",
    "RESUMABLE_STATES",
    "SECRET_KEY_MARKERS",
    "EventRecord",
    "JournalSink",
    "RunRecord",
    "RunState",
    "RunStore",
    "SecretMask",
    "StepProgress",
    "StoreBase",
    "check_approvable",
    "check_retention",
    "current_owner",
    "iso_time",
    "new_run_id",
    "owned_by_another",
    "past_retention",
    "process_alive",
    "progress_from_events",
    "redact",
    "run_state",
]

# -- run states -------------------------------------------------------------------------------
# The groups, as tuples of state names (SQL ``IN``, list filters); what each state means is
# ``RunState.is_active`` / ``is_final`` / ``is_resumable``.
ACTIVE_STATES: tuple[str, ...] = tuple(s.value for s in RunState if s.is_active)
FINAL_STATES: tuple[str, ...] = tuple(s.value for s in RunState if s.is_final)
RESUMABLE_STATES: tuple[str, ...] = tuple(s.value for s in RunState if s.is_resumable)
# run state -> the phase a RemediationRun shows (`kubectl get rr`, `runbook runs`' PHASE column)
PHASES: dict[str, str] = {s.value: s.phase for s in RunState}
DONE_STEP_STATUSES = ("succeeded", "skipped")  # a step with one of these outcomes is never redone


def run_state(value: str | RunState) -> RunState:
    """``value`` as a ``RunState``; ``UsageError`` for a name that is not a run state (a store
    never records one)."""
    try:
        return RunState(value)
    except ValueError:
        raise UsageError(f"unknown run state {value!r} (one of: {', '.join(s.value for s in RunState)})") from None


# -- times and ids ----------------------------------------------------------------------------


def new_run_id() -> str:
    """Sortable by time, unique across machines: ``r-YYYYmmddHHMMSS-xxxxxx``."""
    return time.strftime("r-%Y%m%d%H%M%S-", time.gmtime()) + uuid.uuid4().hex[:6]


def iso_time(ts: float | None) -> str | None:
    """``2026-01-02T03:04:05.678Z`` (what the records show), None for None."""
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


# -- secrets ----------------------------------------------------------------------------------
SECRET_KEY_MARKERS = ("password", "secret", "token", "authorization", "become_pass")


def redact(value: Any, secrets: frozenset[str] = frozenset()) -> Any:
    """A copy of ``value`` with secret-looking keys and known secret strings masked."""
    if isinstance(value, Mapping):
        return {
            k: ("***" if any(m in str(k).lower() for m in SECRET_KEY_MARKERS) else redact(v, secrets))
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(v, secrets) for v in value]
    if isinstance(value, str):
        for s in secrets:
            if s and s in value:
                value = value.replace(s, "***")
        return value
    return value


class SecretMask:
    """The masking every store applies before it writes (one rule: ``redact``), with the secret
    values registered on it (become passwords, tokens)."""

    def __init__(self) -> None:
        self._secrets: set[str] = set()
        self._secrets_lock = threading.Lock()

    def add_secret(self, value: str | None) -> None:
        """Mask this exact value wherever it would be written."""
        if value:
            with self._secrets_lock:
                self._secrets.add(value)

    def redact(self, value: Any) -> Any:
        """``value`` with secret-looking keys and the registered secret values masked."""
        with self._secrets_lock:
            secrets = frozenset(self._secrets)
        return redact(value, secrets)


# -- owners -----------------------------------------------------------------------------------


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> str | None:
    """``BOOT_ID/START``: the machine's boot id and the kernel's start time of a process (field 22
    of /proc/PID/stat), to tell a reused PID apart, also after a reboot."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{_boot_id()}/{stat.rsplit(')', 1)[1].split()[19]}"


Owner = tuple[str | None, int | None, str | None]  # a run's owner: (host, pid, BOOT_ID/START)


_own_start: tuple[int, str | None] | None = None  # (pid, its ``BOOT_ID/START``): read once per process


def _this_process_start() -> str | None:
    """``_process_start`` of this process, read once (a fork has a pid of its own, and reads again).
    Why: every run a server lists is owned by it or a peer; two /proc reads per run add up in a burst."""
    global _own_start
    pid = os.getpid()
    if _own_start is None or _own_start[0] != pid:
        _own_start = (pid, _process_start(pid))
    return _own_start[1]


def current_owner() -> tuple[str, int, str | None]:
    """This process as a run's owner: (host, pid, ``BOOT_ID/START``)."""
    return socket.gethostname(), os.getpid(), _this_process_start()


def process_alive(host: str | None, pid: int | None, start: str | None) -> bool | None:
    """True/False for a process on this machine; None when it ran on another machine."""
    if host != socket.gethostname() or pid is None:
        return None
    now = _this_process_start() if pid == os.getpid() else _process_start(pid)
    if now is None:
        return False
    if start is not None and "/" not in start:  # recorded by an older version: no boot id
        return now.rsplit("/", 1)[1] == start
    return now == start


def read_state(stored: str | RunState, owner_host: str | None, owner_pid: int | None,
               owner_start: str | None) -> RunState:
    """The state a read reports: an active run whose owning process is known to be gone (killed,
    crashed, machine rebooted) is ``interrupted``, however it died."""
    state = run_state(stored)
    if state.is_active and process_alive(owner_host, owner_pid, owner_start) is False:
        return RunState.INTERRUPTED
    return state


def owned_by_another(owner: tuple[str | None, int | None, str | None]) -> bool:
    """Whether ``owner`` (host, pid, start) is a live process other than this one: then ``claim``
    changes nothing (two resumes of one run never both proceed)."""
    return tuple(owner) != current_owner() and process_alive(*owner) is True


# -- what every store decides the same way ------------------------------------------------------


def check_approvable(run_id: str, digest: str, current: str | None, state: str | RunState) -> None:
    """``StalePlan`` unless ``digest`` names the run's current plan and the run waits for approval."""
    if current is None or digest != current:
        raise StalePlan(f"run {run_id}: approval names plan {digest!r}, but the run's plan is "
                        f"{current!r}; re-read the plan and approve that digest")
    if str(state) != RunState.WAITING_APPROVAL.value:
        raise StalePlan(f"run {run_id} is {state}, not waiting for approval")


def check_retention(keep: int, max_age: float | None) -> None:
    """``UsageError`` for a retention no store can apply (``prune``'s arguments)."""
    if keep < 0 or (max_age is not None and max_age < 0):
        raise UsageError(f"retention: keep ({keep}) and max_age ({max_age}) must not be negative")


def past_retention(rank: int, finished: float, *, keep: int, max_age: float | None, now: float) -> bool:
    """Whether ``prune`` deletes the finished run of ``rank`` (0: the newest finished run), which
    finished at ``finished``: beyond the ``keep`` newest, or finished more than ``max_age`` s ago."""
    return rank >= keep or (max_age is not None and now - finished > max_age)


# -- records ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunRecord:
    id: str
    runbook: str
    params: dict[str, Any]
    nodes: list[str]
    state: RunState
    source: str
    plan_digest: str | None
    plan: dict[str, Any] | None
    approval_required: bool
    approved_by: str | None
    approved_at: float | None
    approved_digest: str | None
    created: float
    started: float | None
    finished: float | None
    exit_code: int | None
    owner_host: str | None
    owner_pid: int | None
    owner_start: str | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", run_state(self.state))  # a name given as text becomes the state

    def summary(self) -> dict[str, Any]:
        """The fields `runbook runs -o json` and `GET /runs` show."""
        return {
            "id": self.id, "runbook": self.runbook, "params": self.params, "nodes": self.nodes,
            "state": str(self.state), "source": self.source, "plan_digest": self.plan_digest,
            "approval_required": self.approval_required, "approved_by": self.approved_by,
            "started": iso_time(self.started or self.created), "finished": iso_time(self.finished),
            "exit_code": self.exit_code,
        }


@dataclass(frozen=True)
class EventRecord:
    run_id: str
    seq: int
    ts: float
    kind: str
    step: str | None
    data: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "time": iso_time(self.ts), "kind": self.kind, "step": self.step, **self.data}


@dataclass(frozen=True)
class StepProgress:
    """Where a run stands, from its events (for a resume).

    ``completed``: steps whose last outcome is succeeded or skipped (never redone).
    ``interrupted_step``: the step whose action was announced (``action.intent``) and that has no
    successful outcome: its effect may or may not have happened. ``action_finished``: that
    action's ``action.result`` was recorded ok after its last intent (it ran to its end; only its
    verification is missing). ``rollback_started``: the step had started rolling back.
    """

    completed: frozenset[str]
    interrupted_step: str | None = None
    action_finished: bool = False
    rollback_started: bool = False


def progress_from_events(events: Iterable[EventRecord]) -> StepProgress:
    """Which steps are done and which one was left half-way (see :class:`StepProgress`), from a
    run's events in order: the same answer from every store.

    Conservative on purpose: an intent from any earlier attempt of a step that never succeeded
    still counts, so a non-idempotent action announced once is never silently redone."""
    done: set[str] = set()
    intent: dict[str, bool] = {}  # step -> its action has finished ok after its last intent
    rollback: set[str] = set()
    order: list[str] = []
    for e in events:
        step = e.step
        if not step:
            continue
        if e.kind == "step.start" and step not in order:
            order.append(step)
        elif e.kind == "step.outcome":
            if e.data.get("status") in DONE_STEP_STATUSES:
                done.add(step)
                intent.pop(step, None)
                rollback.discard(step)
            else:
                done.discard(step)
        elif e.kind == "action.intent" and not e.data.get("rollback"):
            intent[step] = False
        elif e.kind == "action.result" and not e.data.get("rollback") and step in intent:
            intent[step] = bool(e.data.get("ok"))
        elif e.kind == "rollback.start":
            rollback.add(step)
    pending = [s for s in order if s in intent and s not in done]
    current = pending[-1] if pending else None
    return StepProgress(completed=frozenset(done), interrupted_step=current,
                        action_finished=bool(current and intent[current]),
                        rollback_started=current in rollback if current else False)


@runtime_checkable
class RunStore(Protocol):
    """Where runs, their events and approvals are recorded. Every write is durable on return.

    Run states: ``engine.model.RunState`` (``pending``, ``waiting-approval``, ``running`` are
    active; ``succeeded``, ``failed``, ``blocked``, ``cancelled`` final; ``interrupted``
    resumable). A read reports an active run whose owning process is known to be gone as
    ``interrupted`` (``read_state``); ``set_state``/``create_run`` refuse a name that is not a run
    state (``UsageError``).
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

    def claim(self, run_id: str, *, from_owner: Owner | None = None) -> bool:
        """Make this process the run's owner; False (changing nothing) while another live owner has it.
        Atomic: two claims of one run never both succeed. ``from_owner`` (host, pid, start): only
        while that is still the recorded owner (adopting a dead replica's run: of two processes
        adopting it at once, the second finds the owner changed and gets False)."""
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

    def list_runs(self, *, limit: int = 100, states: tuple[str, ...] | None = None,
                  sources: tuple[str, ...] | None = None) -> list[RunRecord]:
        """Newest first; ``states``/``sources``: only runs in one of those states / from one of those
        sources (``alertmanager``, ``cli``, ...)."""
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

    def follow(self, *, event_kinds: tuple[str, ...] = ()) -> bool:
        """For a long-lived reader (``runbook serve``): keep what newest-first lists need, and the
        events of ``event_kinds`` (``events_of``), up to date in memory instead of reading the store
        each time (True), when the store can."""
        ...

    def events_of(self, run_id: str, kinds: tuple[str, ...]) -> list[EventRecord]:
        """The run's events of those kinds (``UsageError`` for an unknown run id): from memory when
        following them (``follow``), with the freshness of the newest-first lists."""
        ...


class StoreBase(SecretMask):
    """What every store shares on top of its own ``events``: masking, and a resume's progress
    derived from the events (so both stores answer it identically)."""

    def events(self, run_id: str) -> list[EventRecord]:
        raise NotImplementedError

    def progress(self, run_id: str) -> StepProgress:
        """Which steps are done and which one was left half-way (see :func:`progress_from_events`)."""
        return progress_from_events(self.events(run_id))

    def step_progress(self, run_id: str) -> tuple[set[str], str | None]:
        """(completed steps, the step whose action started without a successful outcome)."""
        p = self.progress(run_id)
        return set(p.completed), p.interrupted_step

    def follow(self, *, event_kinds: tuple[str, ...] = ()) -> bool:
        """``RunStore.follow``: a store read in place (a file) has nothing to follow."""
        return False

    def events_of(self, run_id: str, kinds: tuple[str, ...]) -> list[EventRecord]:
        """``RunStore.events_of``: a read of every event, filtered."""
        return [e for e in self.events(run_id) if e.kind in kinds]


_events_log = logging.getLogger("runbook.events")


class JournalSink:
    """An EventSink that writes to the run store before returning (write-ahead), then logs the
    event on ``runbook.events`` (what ``--log-format json`` shows; masked like the store)."""

    def __init__(self, journal: RunStore, run_id: str) -> None:
        self.journal = journal
        self.run_id = run_id
        self._who: tuple[str, str | None] | None = None

    def emit(self, kind: str, **data: Any) -> None:
        step = data.pop("step", None)
        self.journal.append(self.run_id, kind, step=step, **data)
        if _events_log.isEnabledFor(logging.INFO):
            self._log(kind, step, data)

    def _log(self, kind: str, step: str | None, data: dict[str, Any]) -> None:
        if self._who is None:
            rec = self.journal.get_run(self.run_id)
            self._who = (rec.runbook, rec.nodes[0] if rec.nodes else None)
        safe = self.journal.redact({k: data.get(k) for k in ("status", "reason")})
        _events_log.info("%s%s", kind, f" {step}" if step else "", extra={
            "run_id": self.run_id, "runbook": self._who[0], "node": self._who[1], "step": step, "event": kind,
            "status": safe["status"], "reason": safe["reason"]})
