"""The Kubernetes run store (``--store kubernetes``): each run a ``RemediationRun`` custom resource.

A run is ``remediationruns.runbook.io/v1alpha1`` in the store namespace (``runbook-system`` by
default), named by its run id. ``spec`` is what was asked (runbook, node, params, source, mode) and
is written once, at creation; everything that changes (phase, owner, plan, approval, step summary,
the event log) lives in the **status subresource**. Every write is a PUT of the status with the
resourceVersion last seen as precondition: a conflict (409: another writer got there first) is
re-read and the change re-applied to what is there now, never written over it (an event gets the
next sequence number after the events already recorded). A write returns once the API server has
committed it, so ``action.intent`` is in etcd before the effect it announces starts; a write that
fails raises and the executor never takes that action.

Size: an object must stay far below etcd's request limit (1.5 MiB). Strings in event data are cut
at ``STRING_MAX`` characters, one event's data at ``EVENT_MAX`` bytes (the largest values are
replaced by a note saying how much was dropped), and when the whole object would pass
``OBJECT_BUDGET`` bytes the oldest events' data are compacted to what a resume and a report read
(status, ok, rollback, state, reason). A plan larger than ``PLAN_MAX`` is refused (it must be kept
whole: a resume checks its digest).

Ownership is as in the SQLite journal: the owning process (host, pid, start time); a run whose
owner on this machine is gone reads ``interrupted``, and the reader records that phase
(``Interrupted``) so ``kubectl get rr`` shows it too (a conditional write: it never races a resume
that claimed the run meanwhile). Retention: ``prune``.

This module talks to the API server only through ``engine.connectors.base.ObjectAPI`` (our Kubernetes
connector); it never imports ``kubernetes`` and decides nothing about runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

from engine.connectors.base import ObjectAPI
from engine.errors import Conflict, JournalError, KubeError, UsageError
from engine.kube_run_index import SLIM, RunIndex, WatchableObjects
from engine.model import RunState
from engine.store import (
    ACTIVE_STATES,
    FINAL_STATES,
    EventRecord,
    Owner,
    RunRecord,
    RunStore,
    StoreBase,
    check_approvable,
    check_retention,
    current_owner,
    new_run_id,
    owned_by_another,
    past_retention,
    process_alive,
    read_state,
    run_state,
)
from engine.store import PHASES as RUN_PHASES

API_VERSION = "runbook.io/v1alpha1"
KIND = "RemediationRun"
PLURAL = "remediationruns"
PHASES: Mapping[str, str] = RUN_PHASES
STATES: Mapping[str, str] = {v: k for k, v in PHASES.items()}
STRING_MAX = 2000  # characters of one string in an event's data
EVENT_MAX = 8 * 1024  # bytes of one event's data (JSON)
COMPACT_EVENT_MAX = 512  # bytes of an old event's data once the object is over budget
OBJECT_BUDGET = 512 * 1024  # bytes of the whole object: etcd refuses requests over 1.5 MiB
PLAN_MAX = 256 * 1024  # bytes of a plan (kept whole)
MESSAGE_MAX = 1024
CONFLICT_RETRIES = 50
# what a resume, the server and the reports read from old events: kept when compacting
KEPT_KEYS = ("status", "ok", "rollback", "state", "exit_code", "reason", "error", "by", "approved_by",
             "plan_digest", "started_at", "finished_at", "completed", "started_without_outcome")
_OUTCOME_EVENTS = ("run.blocked", "run.failed", "run.cancelled", "run.error", "run.finish", "run.resumable",
                   "approval.waiting", "approval.granted", "approval.rejected")

# Labels every RemediationRun carries, so that every list the server makes is label-selected:
PHASE_LABEL = "runbook.io/phase"  # kept in step with status.phase (one write behind at most)
TRIGGER_LABEL = "runbook.io/trigger"  # the run's source: cli, alertmanager, pagerduty, remediation, ...
NODE_LABEL = "runbook.io/node"
RUNBOOK_LABEL = "runbook.io/runbook"
UNLABELLED = f"!{PHASE_LABEL}"  # runs recorded before the labels existed: read by a second list
# When the run was created (UTC), at four widths: ``list_runs`` reads the newest runs first, bucket
# by bucket, instead of every RemediationRun (label selectors have no ranges; ``in`` lists buckets).
CREATED_LEVELS: tuple[tuple[str, int, str], ...] = (
    ("runbook.io/created-second", 1, "%Y%m%d%H%M%S"), ("runbook.io/created-minute", 60, "%Y%m%d%H%M"),
    ("runbook.io/created-hour", 3600, "%Y%m%d%H"), ("runbook.io/created-day", 86400, "%Y%m%d"))
NOT_BUCKETED = f"!{CREATED_LEVELS[0][0]}"  # runs recorded before the created labels existed
BUCKETS_PER_LIST = 60  # bucket values in one ``in (...)`` selector (the URL stays short)
NEWEST_HORIZON = 400 * 86400  # seconds back the buckets are walked; older runs: one list of the rest
DELETED_KEPT = 4096  # run ids this store deleted, hidden from watch-cache lists that may not have seen it
CLOCK_AHEAD = 120  # seconds after our clock a writer's clock may be: its newest buckets are read too

T = TypeVar("T")
log = logging.getLogger("runbook.store")


def format_time(epoch: float) -> str:
    """RFC 3339 with microseconds, UTC (the CRD's ``date-time``)."""
    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: Any) -> float | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _label_value(value: str) -> str | None:
    """``value`` when it is a valid label value (63 characters, alphanumerics and ``-_.``), else None."""
    ok = 0 < len(value) <= 63 and value[0].isalnum() and value[-1].isalnum() and \
        all(c.isalnum() or c in "-_." for c in value) and value.isascii()
    return value if ok else None


def _size(value: Any) -> int:
    return len(json.dumps(value, default=str, separators=(",", ":")))


def bound(value: Any, string_max: int = STRING_MAX) -> Any:
    """``value`` with long strings cut (saying how much was dropped); plain JSON types only."""
    if isinstance(value, Mapping):
        return {str(k): bound(v, string_max) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [bound(v, string_max) for v in value]
    if isinstance(value, str):
        if len(value) > string_max:
            return value[:string_max] + f"... [{len(value) - string_max} characters truncated]"
        return value
    if value is None or isinstance(value, bool | int | float):
        return value
    return bound(str(value), string_max)


def shrink(data: Mapping[str, Any], limit: int) -> dict[str, Any]:
    """``data`` (JSON) within ``limit`` bytes: the largest values replaced by a truncation note, the
    kept keys (``KEPT_KEYS``) last of all."""
    out = dict(data)
    if _size(out) <= limit:
        return out
    order = sorted(out, key=lambda k: (k in KEPT_KEYS, -_size(out[k])))
    for key in order:
        if _size(out) <= limit:
            break
        n = _size(out[key])
        if key in KEPT_KEYS and isinstance(out[key], str):
            out[key] = bound(out[key], 200)
        else:
            out[key] = f"[truncated: {n} bytes]"
    out["truncated"] = True
    return out


class KubeRunStore(StoreBase):
    """``engine.store.RunStore`` over RemediationRun objects in one namespace. Thread-safe."""

    def __init__(self, api: ObjectAPI, namespace: str = "runbook-system", *,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self.api = api
        self.namespace = namespace
        self.clock = clock
        self._cache: dict[str, dict[str, Any]] = {}  # run id -> the object as last written/read
        # Read your own writes from the watch cache (``_newest``): the highest resourceVersion this
        # store wrote, and the runs it deleted (a delete's answer carries the version before it).
        self._written_version = 0
        self._deleted: dict[str, None] = {}  # insertion-ordered, the last DELETED_KEPT
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._index: RunIndex | None = None  # ``follow``: the runs kept from a watch (runbook serve)

    # -- secrets (masking: engine.store.SecretMask) ----------------------------------------------

    def _clean(self, value: Any) -> Any:
        """As it is stored: masked, plain JSON."""
        return json.loads(json.dumps(self.redact(value), default=str, sort_keys=True))

    def close(self) -> None:
        """Stop following (``follow``); the connector belongs to the caller."""
        index, self._index = self._index, None
        if index is not None:
            index.stop()

    def follow(self, *, event_kinds: tuple[str, ...] = ()) -> bool:
        """Keep the namespace's runs in memory from a watch (``engine.kube_run_index``), so the
        newest-first lists (the breaker's, ``GET /runs``) stop asking the API server: for a
        long-lived process (``runbook serve``). False when the connector cannot watch (lists then)."""
        if self._index is not None:
            return True
        if not all(hasattr(self.api, m) for m in ("list_objects_versioned", "watch_objects", "close_watch")):
            return False
        self._index = RunIndex(cast(WatchableObjects, self.api), API_VERSION, PLURAL, self.namespace,
                               sort_key=_newest_key, event_kinds=frozenset(event_kinds)).start()
        return True

    def events_of(self, run_id: str, kinds: tuple[str, ...]) -> list[EventRecord]:
        index = self._index
        if index is not None and index.event_kinds.issuperset(kinds) and run_id not in self._deleted:
            known, obj = index.one(run_id, at_least=self._written_version)
            if known and obj is not None:
                return [e for e in _event_records(run_id, obj) if e.kind in kinds]
        return super().events_of(run_id, kinds)

    # -- plumbing -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, run_id: str) -> Iterator[None]:
        with self._guard:
            lock = self._locks.setdefault(run_id, threading.Lock())
        with lock:
            yield

    def _read(self, run_id: str) -> dict[str, Any]:
        obj = self.api.read_object(API_VERSION, PLURAL, self.namespace, run_id)
        if obj is None:
            raise UsageError(f"unknown run id {run_id!r} (no RemediationRun {run_id} in namespace "
                             f"{self.namespace}; --store-namespace chooses another)")
        return obj

    def _update(self, run_id: str, mutate: Callable[[dict[str, Any]], tuple[bool, T]], *, fresh: bool = False) -> T:
        """Apply ``mutate`` to a copy of the run's status and write it with the resourceVersion it was
        read at; on a conflict, read again and apply it again to what is there now. ``mutate``
        returns (write?, result) and may raise (nothing is written then). ``fresh``: read first (a
        decision that may not write must not rest on this process's last copy)."""
        with self._locked(run_id):
            obj = (None if fresh else self._cache.get(run_id)) or self._read(run_id)
            for _ in range(CONFLICT_RETRIES):
                status = json.loads(json.dumps(obj.get("status") or {}))  # a deep copy, faster
                write, result = mutate(status)
                if not write:
                    return result
                self._fit(run_id, status)
                body = {**obj, "status": status}
                try:
                    obj = self._wrote(self.api.replace_object(API_VERSION, PLURAL, self.namespace, body,
                                                              subresource="status"))
                except Conflict:
                    obj = self._read(run_id)
                    continue
                self._cache[run_id] = obj
                return result
        raise KubeError(f"RemediationRun {self.namespace}/{run_id}: still changed by other writers after "
                        f"{CONFLICT_RETRIES} attempts; nothing written", retryable=True)

    def _fit(self, run_id: str, status: dict[str, Any]) -> None:
        """Keep the object within ``OBJECT_BUDGET``: compact old events' data, oldest first."""
        target = OBJECT_BUDGET - 16 * 1024  # room for metadata and spec
        total = _size(status)
        if total <= target:
            return
        events = status.get("events") or []
        for e in events[:-1]:
            if not isinstance(e.get("data"), dict) or e["data"].get("compacted") or e.get("kind") == "run.seal":
                continue  # a seal is kept whole: engine.integrity verifies the run with it
            before = _size(e["data"])
            if before <= COMPACT_EVENT_MAX:
                continue
            e["data"] = {**shrink({k: v for k, v in e["data"].items() if k in KEPT_KEYS}, COMPACT_EVENT_MAX),
                         "compacted": True}
            status["compactedEvents"] = int(status.get("compactedEvents") or 0) + 1
            total -= before - _size(e["data"])
            if total <= target:
                return
        if _size(status) > OBJECT_BUDGET:
            raise JournalError(f"RemediationRun {self.namespace}/{run_id}: the run's record would pass "
                               f"{OBJECT_BUDGET // 1024} KiB even with its old events compacted; not written")

    def _event(self, status: dict[str, Any], kind: str, step: str | None, data: Mapping[str, Any]) -> int:
        """Append one event to ``status`` (and the step summary, message, heartbeat); its seq."""
        events = status.setdefault("events", [])
        seq = int(events[-1].get("seq", len(events))) + 1 if events else 1
        now = self.clock()
        clean = self._clean(dict(data))
        body = bound(clean)
        if _size(body) > EVENT_MAX:
            body = shrink(body, EVENT_MAX)
        events.append({"seq": seq, "ts": now, "kind": kind, "step": step, "data": body})
        if kind in ("escalation.of", "rollback.of"):  # `kubectl get rr -o wide`: the run it came from
            status["parent"] = str(data.get("run"))
        status["heartbeatAt"] = format_time(now)
        if step and kind in ("step.start", "step.outcome"):
            steps = status.setdefault("steps", [])
            entry = next((s for s in steps if s.get("id") == step), None)
            if entry is None:
                entry = {"id": step}
                steps.append(entry)
            if kind == "step.start":
                entry.update({"status": "running", "startedAt": format_time(now)})
                entry.pop("finishedAt", None)
                entry.pop("reason", None)
            else:
                entry.update({"status": str(body.get("status", "")), "finishedAt": format_time(now),
                              "reason": bound(str(body.get("reason") or ""), 500)})
        if kind in _OUTCOME_EVENTS:
            reason = body.get("reason") or body.get("error")
            if reason:
                status["message"] = bound(str(reason), MESSAGE_MAX)
        return seq

    # -- runs ---------------------------------------------------------------------------------

    def create_run(self, runbook: str, params: Mapping[str, Any], nodes: list[str], *,
                   source: str = "cli", state: str = "pending", run_id: str | None = None,
                   approval_required: bool = False,
                   events: Sequence[tuple[str, Mapping[str, Any]]] = ()) -> str:
        run_id = run_id or new_run_id()
        state = run_state(state)
        node = nodes[0] if nodes else ""
        created = self.clock()
        labels = {"app.kubernetes.io/managed-by": "runbook", PHASE_LABEL: state.phase, **created_labels(created)}
        for key, value in ((RUNBOOK_LABEL, runbook), (NODE_LABEL, node), (TRIGGER_LABEL, source)):
            if _label_value(value):
                labels[key] = value
        body = {
            "apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": run_id, "namespace": self.namespace, "labels": labels},
            "spec": {"runbook": runbook, "node": node or "-", "nodes": list(nodes), "params": self._clean(dict(params)),
                     "source": source, "mode": "approve" if approval_required else "auto"},
        }
        obj = self._wrote(self.api.create_object(API_VERSION, PLURAL, self.namespace, body))
        self._cache[run_id] = obj
        host, pid, start = current_owner()
        now = format_time(created)

        def init(status: dict[str, Any]) -> tuple[bool, None]:
            status.update({"phase": state.phase, "createdAt": now, "heartbeatAt": now,
                           "owner": {"host": host, "pid": pid, "start": start}, "claimedBy": f"{host}/{pid}"})
            # Why in the same write: the server creates runs on its webhook path; a burst of 200
            # pages would otherwise cost five writes per run (object, status, one per first event)
            recorded = {e.get("kind") for e in status.get("events") or ()}  # a conflict re-applies this
            for kind, data in events:
                if kind not in recorded:
                    self._event(status, kind, None, data)
            return True, None

        self._update(run_id, init)
        return run_id

    def claim(self, run_id: str, *, from_owner: Owner | None = None) -> bool:
        me = current_owner()

        def take(status: dict[str, Any]) -> tuple[bool, bool]:
            owner = status.get("owner") or {}
            recorded = (owner.get("host"), owner.get("pid"), owner.get("start"))
            if from_owner is not None and recorded != tuple(from_owner):
                return False, False  # adopted (or resumed) by someone else since it was read
            if owned_by_another(recorded):
                return False, False
            status["owner"] = {"host": me[0], "pid": me[1], "start": me[2]}
            status["claimedBy"] = f"{me[0]}/{me[1]}"
            return True, True

        return self._update(run_id, take, fresh=True)

    def disown(self, run_id: str) -> None:
        def let_go(status: dict[str, Any]) -> tuple[bool, None]:
            owner = status.get("owner") or {}
            status["owner"] = {"host": owner.get("host"), "pid": None, "start": None}
            status.pop("claimedBy", None)
            return True, None

        self._update(run_id, let_go)

    def set_plan(self, run_id: str, plan: Mapping[str, Any], digest: str) -> None:
        clean = self._clean(dict(plan))
        if _size(clean) > PLAN_MAX:
            raise JournalError(f"RemediationRun {self.namespace}/{run_id}: the plan is {_size(clean) // 1024} KiB, "
                               f"more than the {PLAN_MAX // 1024} KiB a run record keeps; not recorded")

        def put(status: dict[str, Any]) -> tuple[bool, None]:
            status.update({"plan": clean, "planDigest": digest})
            return True, None

        self._update(run_id, put)

    def set_state(self, run_id: str, state: str, *, exit_code: int | None = None) -> None:
        state = run_state(state)
        now = format_time(self.clock())

        def put(status: dict[str, Any]) -> tuple[bool, None]:
            status["phase"] = state.phase
            if state is RunState.RUNNING:
                status.setdefault("startedAt", now)
                status.pop("finishedAt", None)
                status.pop("exitCode", None)
            elif state.is_final or state.is_resumable:
                status["finishedAt"] = now
                if exit_code is None:
                    status.pop("exitCode", None)
                else:
                    status["exitCode"] = int(exit_code)
                if state.is_resumable:  # stopped, and nobody executes it: any process may resume it
                    owner = status.get("owner") or {}
                    status["owner"] = {"host": owner.get("host"), "pid": None, "start": None}
                    status.pop("claimedBy", None)
            self._event(status, "run.state", None, {"state": state.value, "exit_code": exit_code})
            return True, None

        self._update(run_id, put)
        self._label_phase(run_id, state.phase)

    def _label_phase(self, run_id: str, phase: str) -> None:
        """Bring the ``runbook.io/phase`` label in step with the phase just written (a write of the
        object itself: labels are not in the status). Lists select by it and add the phases it can
        lag behind (``_phase_selector``). Best effort: a conflict is re-read and retried; an error
        (an older Role without ``update`` on remediationruns) leaves the label one phase behind."""
        with self._locked(run_id):
            obj = self._cache.get(run_id)
            try:
                for _ in range(CONFLICT_RETRIES):
                    if obj is None:
                        obj = self._read(run_id)
                    meta = dict(obj.get("metadata") or {})
                    labels = dict(meta.get("labels") or {})
                    if labels.get(PHASE_LABEL) == phase:
                        return
                    labels[PHASE_LABEL] = phase
                    try:
                        obj = self._wrote(self.api.replace_object(API_VERSION, PLURAL, self.namespace,
                                                                  {**obj, "metadata": {**meta, "labels": labels}}))
                    except Conflict:
                        obj = None
                        continue
                    self._cache[run_id] = obj
                    return
            except KubeError as e:
                log.warning("run %s: label %s=%s not written: %s", run_id, PHASE_LABEL, phase, e)

    def record_approval(self, run_id: str, digest: str, approved_by: str) -> RunRecord:
        now = self.clock()

        def approve(status: dict[str, Any]) -> tuple[bool, None]:
            check_approvable(run_id, digest, status.get("planDigest"), _phase_state(status))
            status["approval"] = {"by": self._clean(approved_by), "at": format_time(now), "digest": digest}
            self._event(status, "approval.granted", None, {"approved_by": approved_by, "plan_digest": digest})
            return True, None

        self._update(run_id, approve, fresh=True)
        return self.get_run(run_id)

    def get_run(self, run_id: str) -> RunRecord:
        return self._record(self._read(run_id))

    def _wrote(self, obj: dict[str, Any]) -> dict[str, Any]:
        """``obj`` as a write of this store answered: its version is one this store's next reads from
        the watch cache must include."""
        with contextlib.suppress(KeyError, TypeError, ValueError):
            self._written_version = max(self._written_version, int((obj.get("metadata") or {})["resourceVersion"]))
        return obj

    def _forget(self, run_id: str) -> None:
        """A run this store deleted: never listed again from a watch cache that has not seen it go."""
        with self._guard:
            self._deleted[run_id] = None
            while len(self._deleted) > DELETED_KEPT:
                self._deleted.pop(next(iter(self._deleted)))

    def _selected(self, states: tuple[str, ...] | None,
                  sources: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
        """The RemediationRuns that may be in ``states`` (all of them for None) and come from one of
        ``sources`` (any for None), read by label (``runbook.io/phase``, ``runbook.io/trigger``; the
        connector reads in pages): the phases asked for, plus those a label can lag behind (active,
        interrupted: the label follows the status by one write), plus the runs recorded before the
        labels existed. The status and spec decide afterwards."""
        selectors: list[str] = []
        if states:
            phases = sorted({PHASES[run_state(s).value] for s in states}
                            | {PHASES[s] for s in ACTIVE_STATES} | {RunState.INTERRUPTED.phase})
            selectors.append(f"{PHASE_LABEL} in ({','.join(phases)})")
        if sources:
            labelled = sorted(v for v in sources if _label_value(v))
            if len(labelled) < len(sources):  # a source no label can name: read them all (spec decides)
                selectors = selectors[:1]
            elif labelled:
                selectors.append(f"{TRIGGER_LABEL} in ({','.join(labelled)})")
        if not selectors:
            return [dict(o) for o in self.api.list_objects(API_VERSION, PLURAL, namespace=self.namespace)]
        out: dict[str, dict[str, Any]] = {}
        for selector in (",".join(selectors), UNLABELLED):
            for o in self.api.list_objects(API_VERSION, PLURAL, namespace=self.namespace, label_selector=selector):
                out[(o.get("metadata") or {}).get("name", "")] = dict(o)
        return list(out.values())

    def _newest(self, limit: int, sources: tuple[str, ...] | None) -> list[dict[str, Any]]:
        """At least the ``limit`` newest RemediationRuns (of ``sources``), read newest bucket first
        (``CREATED_LEVELS``) from the API server's watch cache, never every object: the seconds a
        writer's clock may be ahead of ours in one list, then buckets of one second back from now, as
        many per list as the runs found so far say are needed (doubling after an empty list, up to
        ``BUCKETS_PER_LIST``); a list that finds none moves to the next width once aligned with it
        (minutes, hours, days), so a sparse history costs a dozen small lists and a dense one reads
        about ``limit`` runs. Every run of a bucket is read, so the ``limit`` newest of what was read
        are the newest of all. Runs without the labels (older versions) are read by one list;
        beyond ``NEWEST_HORIZON``, the rest by one list."""
        index = self._index
        if index is not None:
            def keep(o: Mapping[str, Any]) -> bool:
                name = (o.get("metadata") or {}).get("name", "")
                return name not in self._deleted and (
                    not sources or (o.get("spec") or {}).get("source", "cli") in sources)

            kept = index.newest(limit, keep=keep, at_least=self._written_version)
            if kept is not None:
                return kept
        base: list[str] = []
        if sources:
            labelled = sorted(v for v in sources if _label_value(v))
            if len(labelled) < len(sources):  # a source no label can name: the spec decides
                return self._selected(None, sources)
            base.append(f"{TRIGGER_LABEL} in ({','.join(labelled)})")
        found: dict[str, dict[str, Any]] = {}

        since = str(self._written_version) if self._written_version else None  # our own writes included

        def read(selector: list[str]) -> int:
            before = len(found)
            for o in self.api.list_objects(API_VERSION, PLURAL, namespace=self.namespace,
                                           label_selector=",".join(selector), cached=True, not_older_than=since):
                name = (o.get("metadata") or {}).get("name", "")
                if name not in self._deleted:
                    found[name] = dict(o)
            return len(found) - before

        read([*base, NOT_BUCKETED])
        legacy = len(found)
        now = self.clock()
        t = int(now) + 1  # every bucket from t on has been read (aligned to the level's width)
        ahead = [time.strftime(CREATED_LEVELS[0][2], time.gmtime(t + i)) for i in range(CLOCK_AHEAD)]
        read([*base, f"{CREATED_LEVELS[0][0]} in ({','.join(ahead)})"])  # writers whose clock is ahead: one list
        level, k = 0, 4
        while t > now - NEWEST_HORIZON:
            label, width, fmt = CREATED_LEVELS[level]
            coarser = CREATED_LEVELS[level + 1][1] if level + 1 < len(CREATED_LEVELS) else 0
            if coarser:  # stop at the coarser width's boundary, to move up from there
                k = min(k, (t % coarser) // width or coarser // width)
            values = [time.strftime(fmt, time.gmtime(t - (i + 1) * width)) for i in range(k)]
            got = read([*base, f"{label} in ({','.join(values)})"])
            t -= k * width
            if len(found) - legacy >= limit:
                return list(found.values())
            if got == 0:
                if coarser and t % coarser == 0:
                    level, k = level + 1, 1
                else:  # doubling: a dense stretch after an empty one costs at most twice what it needs
                    k = min(BUCKETS_PER_LIST, k * 2)
            else:
                need = limit - (len(found) - legacy)
                k = max(1, min(BUCKETS_PER_LIST, k * 2, k * need // got))
        read(base)  # the runs older than the horizon (and all of them with an unreadable clock)
        return list(found.values())

    def list_runs(self, *, limit: int = 100, states: tuple[str, ...] | None = None,
                  sources: tuple[str, ...] | None = None) -> list[RunRecord]:
        items = self._selected(states, sources) if states else self._newest(limit, sources)
        if states:
            items = [o for o in items if _stored_state(o) in states]
        if sources:
            items = [o for o in items if (o.get("spec") or {}).get("source", "cli") in sources]
        items.sort(key=_newest_key, reverse=True)
        return [self._record(o) for o in items[:limit]]

    def _record(self, obj: dict[str, Any]) -> RunRecord:
        meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
        owner = status.get("owner") or {}
        host, pid, start = owner.get("host"), owner.get("pid"), owner.get("start")
        state = read_state(_stored_state(obj), host, pid, start)
        if state is not _stored_state(obj):  # the engine that owned it is gone, however it died
            self._record_interrupted(obj)
        approval = status.get("approval") or {}
        nodes = spec.get("nodes")
        return RunRecord(
            id=meta.get("name", ""), runbook=spec.get("runbook", ""), params=dict(spec.get("params") or {}),
            nodes=list(nodes) if isinstance(nodes, list) else [spec.get("node", "")], state=state,
            source=spec.get("source", "cli"), plan_digest=status.get("planDigest"), plan=status.get("plan"),
            approval_required=spec.get("mode") == "approve", approved_by=approval.get("by"),
            approved_at=parse_time(approval.get("at")), approved_digest=approval.get("digest"),
            created=_created(obj), started=parse_time(status.get("startedAt")),
            finished=parse_time(status.get("finishedAt")), exit_code=status.get("exitCode"),
            owner_host=host, owner_pid=pid, owner_start=start,
        )

    def _record_interrupted(self, obj: dict[str, Any]) -> None:
        """Write phase ``Interrupted`` for a run whose owner is gone (for ``kubectl get rr``). A
        conditional write, re-checked on every re-read: a run a resume claimed meanwhile, or that
        ended, is left alone. Best effort: a reader may lack the right, the API may be gone."""
        run_id = (obj.get("metadata") or {}).get("name", "")

        def mark(status: dict[str, Any]) -> tuple[bool, None]:
            owner = status.get("owner") or {}
            gone = process_alive(owner.get("host"), owner.get("pid"), owner.get("start")) is False
            if not _phase_state(status).is_active or not gone:
                return False, None
            status.update({"phase": RunState.INTERRUPTED.phase, "finishedAt": format_time(self.clock()),
                           "owner": {"host": owner.get("host"), "pid": None, "start": None},
                           "message": f"its process ({owner.get('host')}, pid {owner.get('pid')}) is gone; "
                                      f"`runbook resume {run_id}` continues it"})
            status.pop("claimedBy", None)
            return True, None

        if not obj.get(SLIM):  # a kept object has no events: never the base of a write
            self._cache[run_id] = obj  # the version just read: no second read unless it changed since
        try:
            self._update(run_id, mark, fresh=bool(obj.get(SLIM)))
        except KubeError as e:  # Why: a read-only identity or an outage must not fail a read
            log.warning("run %s: could not record phase Interrupted: %s", run_id, e)
            return
        if _stored_state(self._cache.get(run_id) or {}) is RunState.INTERRUPTED:
            self._label_phase(run_id, RunState.INTERRUPTED.phase)

    def prune(self, *, keep: int, max_age: float | None = None, now: float | None = None) -> list[str]:
        """Delete finished RemediationRuns beyond the ``keep`` newest and those finished more than
        ``max_age`` seconds ago (each only at the version read: a run changed meanwhile stays)."""
        check_retention(keep, max_age)
        now = self.clock() if now is None else now
        items = [o for o in self._selected(FINAL_STATES) if _stored_state(o) in FINAL_STATES]
        items.sort(key=_newest_key, reverse=True)
        deleted = []
        for i, obj in enumerate(items):
            status = obj.get("status") or {}
            end = parse_time(status.get("finishedAt")) or _created(obj)
            if not past_retention(i, end, keep=keep, max_age=max_age, now=now):
                continue
            meta = obj.get("metadata") or {}
            try:
                gone = self.api.delete_object(API_VERSION, PLURAL, self.namespace, meta.get("name", ""),
                                              resource_version=meta.get("resourceVersion"))
            except Conflict:
                continue  # changed since it was listed: left for the next round
            if gone:
                deleted.append(meta.get("name", ""))
                self._cache.pop(meta.get("name", ""), None)
                self._forget(meta.get("name", ""))
        return deleted

    # -- events -------------------------------------------------------------------------------

    def append(self, run_id: str, kind: str, step: str | None = None, **data: Any) -> int:
        def add(status: dict[str, Any]) -> tuple[bool, int]:
            return True, self._event(status, kind, step, data)

        return self._update(run_id, add)

    def events(self, run_id: str) -> list[EventRecord]:
        return _event_records(run_id, self._read(run_id))



def created_labels(epoch: float) -> dict[str, str]:
    """The created-time bucket labels of a run created at ``epoch`` (UTC)."""
    at = time.gmtime(int(epoch))
    return {label: time.strftime(fmt, at) for label, _, fmt in CREATED_LEVELS}


def _phase_state(status: Mapping[str, Any]) -> RunState:
    """The run state a status' phase records (no phase yet, or one we do not know: ``pending``)."""
    return RunState(STATES.get(str(status.get("phase")), RunState.PENDING.value))


def _stored_state(obj: Mapping[str, Any]) -> RunState:
    """The run state its phase records (no phase yet: ``pending``)."""
    return _phase_state(obj.get("status") or {})


def _event_records(run_id: str, obj: Mapping[str, Any]) -> list[EventRecord]:
    status = obj.get("status") or {}
    return [EventRecord(run_id, int(e.get("seq", 0)), float(e.get("ts", 0.0)), str(e.get("kind", "")),
                        e.get("step"), dict(e.get("data") or {}))
            for e in status.get("events") or ()]


def _newest_key(obj: Mapping[str, Any]) -> tuple[float, str]:
    """The order of ``list_runs``: created, then name (newest first when reversed)."""
    return _created(obj), (obj.get("metadata") or {}).get("name", "")


def _created(obj: Mapping[str, Any]) -> float:
    return (parse_time((obj.get("status") or {}).get("createdAt"))
            or parse_time((obj.get("metadata") or {}).get("creationTimestamp")) or 0.0)


def _kube_store_is_a_run_store(store: KubeRunStore) -> RunStore:
    return store  # mypy checks that the Kubernetes store satisfies the interface
