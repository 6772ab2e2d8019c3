"""The durable record of runs: an embedded SQLite journal, written ahead of every effect.

Every run gets an id; every event (stage, step start, action intent, action result, verify
attempt, outcome, approval) is appended with a sequence number, each in its own committed
transaction. The database runs in WAL mode with ``synchronous=FULL``: a commit returns only after
the WAL is fsync'ed, so an event that was recorded survives a crash of the engine (SIGKILL) or of
the machine (power loss), and ``action.intent`` is on disk before the effect it announces starts.
This module stores; it never decides what to do next.

A run records its owner (host, pid, the process's start time and the machine's boot id). A run
left ``pending``/``running``/``waiting-approval`` by an owner that no longer exists on this
machine (killed, crashed, machine rebooted) reads as ``interrupted``, however it died; so does a
run the engine stopped because the API server or a host went away (stored ``interrupted``).
:meth:`Journal.progress` tells a resume which steps are done and which one was left half-way.

Faults (issue #14): a journal locked by another writer is waited for at most ``LOCK_TIMEOUT``
(30 s); past it, or when the disk is full, the file or its folder is read-only, or the file is
corrupt, every operation raises ``JournalError``: one line naming the file and the cause (exit 6,
no traceback without ``--debug``). A write that failed is rolled back, and the executor's sink
raising on ``action.intent`` means that action is never taken.

Secrets never reach the journal: :func:`redact` removes values whose keys look secret, and
callers register known secret values (become password, tokens) with :meth:`Journal.add_secret`
so they are masked wherever they appear.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.errors import JournalError, UsageError
from engine.model import RunState
from engine.store import (  # the store's types; re-exported for callers that named them here
    ACTIVE_STATES,
    DONE_STEP_STATUSES,
    FINAL_STATES,
    PHASES,
    RESUMABLE_STATES,
    EventRecord,
    JournalSink,
    Owner,
    RunRecord,
    RunStore,
    StepProgress,
    StoreBase,
    _process_start,
    check_approvable,
    check_retention,
    current_owner,
    new_run_id,
    owned_by_another,
    past_retention,
    process_alive,
    progress_from_events,
    read_state,
    redact,
    run_state,
)

__all__ = [
    "ACTIVE_STATES",
    "DONE_STEP_STATUSES",
    "FINAL_STATES",
    "LOCK_TIMEOUT",
    "PHASES",
    "RESUMABLE_STATES",
    "EventRecord",
    "Journal",
    "JournalSink",
    "RunRecord",
    "StepProgress",
    "_process_start",
    "current_owner",
    "default_journal_path",
    "journal_fault",
    "new_run_id",
    "opened",
    "process_alive",
    "progress_from_events",
    "redact",
]

LOCK_TIMEOUT = 30.0  # seconds a write waits for another writer's lock before giving up

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
  id TEXT PRIMARY KEY,
  runbook TEXT NOT NULL,
  params TEXT NOT NULL,
  nodes TEXT NOT NULL,
  state TEXT NOT NULL,
  source TEXT NOT NULL DEFAULT 'cli',
  plan_digest TEXT,
  plan TEXT,
  approval_required INTEGER NOT NULL DEFAULT 0,
  approved_by TEXT,
  approved_at REAL,
  approved_digest TEXT,
  created REAL NOT NULL,
  started REAL,
  finished REAL,
  exit_code INTEGER,
  owner_host TEXT,
  owner_pid INTEGER,
  owner_start TEXT,
  heartbeat REAL
);
CREATE TABLE IF NOT EXISTS events (
  run_id TEXT NOT NULL REFERENCES runs(id),
  seq INTEGER NOT NULL,
  ts REAL NOT NULL,
  kind TEXT NOT NULL,
  step TEXT,
  data TEXT NOT NULL,
  PRIMARY KEY (run_id, seq)
);
CREATE INDEX IF NOT EXISTS runs_created ON runs(created);
CREATE INDEX IF NOT EXISTS runs_state_created ON runs(state, created);
"""


def default_journal_path() -> Path:
    """``$RUNBOOK_JOURNAL``, else ``$XDG_STATE_HOME/runbook/journal.sqlite``."""
    env = os.environ.get("RUNBOOK_JOURNAL")
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "runbook" / "journal.sqlite"


def journal_fault(path: Path, what: str, error: BaseException, *, lock_timeout: float = LOCK_TIMEOUT) -> JournalError:
    """One line naming the journal file, what was being done and why it failed."""
    name = str(getattr(error, "sqlite_errorname", "") or "")
    text = str(error) or type(error).__name__
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text:
        cause = f"locked by another process for more than {lock_timeout:g}s"
    elif name.startswith("SQLITE_FULL") or "disk is full" in text or _no_space_left(path) or \
            (isinstance(error, OSError) and error.errno == 28):
        cause = "the disk is full"
    elif name.startswith("SQLITE_READONLY") or "readonly" in text or "read-only" in text or _read_only(path) or \
            (isinstance(error, OSError) and error.errno == 30):
        cause = "the file or its folder is read-only"
    elif name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")) or "not a database" in text or "malformed" in text:
        cause = "the file is corrupt or not a runbook journal"
    elif name.startswith("SQLITE_CANTOPEN") or isinstance(error, PermissionError):
        cause = "the file cannot be opened (missing folder or permissions)"
    elif name.startswith("SQLITE_IOERR"):
        cause = "an I/O error (disk full or failing?)"
    else:
        cause = "an error"
    detail = " ".join(text.split())
    return JournalError(f"{path}: cannot {what}: {cause} ({detail})")


def _no_space_left(path: Path) -> bool:
    """The journal's file system has no free block (SQLite may report it as an I/O error)."""
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return False
    return st.f_bavail == 0 and st.f_blocks > 0


def _read_only(path: Path) -> bool:
    """The journal's file system is mounted read-only, or the file or its folder is not writable
    (SQLite may only say it "cannot open" the file)."""
    try:
        if os.statvfs(path.parent).f_flag & os.ST_RDONLY:
            return True
    except OSError:
        return False
    target = path if path.exists() else path.parent
    return not os.access(target, os.W_OK) or not os.access(path.parent, os.W_OK)


class Journal(StoreBase):
    """One SQLite file, safe for several processes (WAL) and threads (a lock per connection)."""

    def __init__(self, path: Path | str | None = None, *, lock_timeout: float = LOCK_TIMEOUT) -> None:
        super().__init__()
        self.path = Path(path) if path else default_journal_path()
        self.lock_timeout = lock_timeout
        self._lock = threading.RLock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise journal_fault(self.path, "create the journal's folder", e) from e
        db: sqlite3.Connection | None = None
        try:
            db = sqlite3.connect(self.path, timeout=lock_timeout, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            if db.execute("SELECT COUNT(*) FROM sqlite_master WHERE name IN ('runs', 'events')").fetchone()[0] < 2:
                db.executescript(_SCHEMA)
            db.execute("SELECT id FROM runs LIMIT 1").fetchall()  # a corrupt file fails here, at open
        except (sqlite3.Error, OSError) as e:
            if db is not None:
                with contextlib.suppress(sqlite3.Error):
                    db.close()
            raise journal_fault(self.path, "open the journal", e, lock_timeout=lock_timeout) from e
        self._db = db

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _fault(self, what: str, error: BaseException) -> JournalError:
        return journal_fault(self.path, what, error, lock_timeout=self.lock_timeout)

    @contextmanager
    def _reading(self, what: str) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._db
            except sqlite3.Error as e:
                raise self._fault(what, e) from e

    def _dump(self, value: Any) -> str:
        return json.dumps(self.redact(value), default=str, sort_keys=True)

    @contextmanager
    def _tx(self, what: str = "write to the journal") -> Iterator[sqlite3.Connection]:
        """One write transaction (waits ``lock_timeout`` for another writer). Any failure, the
        commit's included, rolls it back and raises ``JournalError`` (or the caller's exception)."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as e:
                raise self._fault(what, e) from e
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException as e:
                if self._db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                if isinstance(e, sqlite3.Error):
                    raise self._fault(what, e) from e
                raise

    # -- runs ---------------------------------------------------------------------------------

    def create_run(self, runbook: str, params: Mapping[str, Any], nodes: list[str], *,
                   source: str = "cli", state: str = "pending", run_id: str | None = None,
                   approval_required: bool = False,
                   events: Sequence[tuple[str, Mapping[str, Any]]] = ()) -> str:
        """Record a new run and its first ``events`` (kind, data), numbered from 1, in one transaction:
        one commit (one fsync) instead of one per event, for the server's webhook path."""
        run_id = run_id or new_run_id()
        state = run_state(state)
        pid = os.getpid()
        with self._tx("record a new run") as db:
            now = time.time()
            db.execute(
                "INSERT INTO runs (id, runbook, params, nodes, state, source, approval_required, created,"
                " owner_host, owner_pid, owner_start, heartbeat) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (run_id, runbook, self._dump(dict(params)), json.dumps(nodes), state.value, source,
                 int(approval_required), now, socket.gethostname(), pid, _process_start(pid), now),
            )
            for seq, (kind, data) in enumerate(events, start=1):
                db.execute("INSERT INTO events (run_id, seq, ts, kind, step, data) VALUES (?,?,?,?,?,?)",
                           (run_id, seq, now, kind, None, self._dump(dict(data))))
        return run_id

    def claim(self, run_id: str, *, from_owner: Owner | None = None) -> bool:
        """Make this process the run's owner (a resume, a server recovering its runs).

        Atomic: returns False, changing nothing, while another live process on this machine owns
        the run (two resumes of one run never both proceed)."""
        me = current_owner()
        with self._tx() as db:
            row = db.execute("SELECT owner_host, owner_pid, owner_start FROM runs WHERE id=?",
                             (run_id,)).fetchone()
            if row is None:
                raise UsageError(f"unknown run id {run_id!r}")
            if from_owner is not None and tuple(row) != tuple(from_owner):
                return False  # claimed by someone else since it was read
            if owned_by_another(tuple(row)):
                return False
            db.execute("UPDATE runs SET owner_host=?, owner_pid=?, owner_start=? WHERE id=?", (*me, run_id))
        return True

    def disown(self, run_id: str) -> None:
        """The run is parked on purpose (waiting for an approval): no process owns it, so its
        owner exiting does not make it ``interrupted``."""
        with self._tx() as db:
            db.execute("UPDATE runs SET owner_pid=NULL, owner_start=NULL WHERE id=?", (run_id,))

    def set_plan(self, run_id: str, plan: Mapping[str, Any], digest: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE runs SET plan=?, plan_digest=? WHERE id=?", (self._dump(plan), digest, run_id))

    def set_state(self, run_id: str, state: str, *, exit_code: int | None = None) -> None:
        state = run_state(state)
        now = time.time()
        with self._tx(f"record state {state} of run {run_id}") as db:
            if state is RunState.RUNNING:
                db.execute("UPDATE runs SET state=?, started=COALESCE(started, ?), finished=NULL,"
                           " exit_code=NULL WHERE id=?", (state.value, now, run_id))
            elif state.is_final:
                db.execute("UPDATE runs SET state=?, finished=?, exit_code=? WHERE id=?",
                           (state.value, now, exit_code, run_id))
            elif state.is_resumable:  # stopped, and nobody executes it: any process may resume it
                db.execute("UPDATE runs SET state=?, finished=?, exit_code=?, owner_pid=NULL, owner_start=NULL"
                           " WHERE id=?", (state.value, now, exit_code, run_id))
            else:
                db.execute("UPDATE runs SET state=? WHERE id=?", (state.value, run_id))
        self.append(run_id, "run.state", state=state.value, exit_code=exit_code)

    def record_approval(self, run_id: str, digest: str, approved_by: str) -> RunRecord:
        """Approve the run's current plan. Raises StalePlan for another digest, UsageError if unknown."""
        with self._tx() as db:
            row = db.execute("SELECT plan_digest, state FROM runs WHERE id=?", (run_id,)).fetchone()
            if row is None:
                raise UsageError(f"unknown run id {run_id!r}")
            current, state = row
            check_approvable(run_id, digest, current, state)
            db.execute("UPDATE runs SET approved_by=?, approved_at=?, approved_digest=? WHERE id=?",
                       (approved_by, time.time(), digest, run_id))
        self.append(run_id, "approval.granted", approved_by=approved_by, plan_digest=digest)
        return self.get_run(run_id)

    def get_run(self, run_id: str) -> RunRecord:
        with self._reading(f"read run {run_id}") as db:
            row = db.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
            cols = [d[0] for d in db.execute("SELECT * FROM runs LIMIT 0").description]
        if row is None:
            raise UsageError(f"unknown run id {run_id!r}")
        return self._record(dict(zip(cols, row, strict=True)))

    def list_runs(self, *, limit: int = 100, states: tuple[str, ...] | None = None,
                  sources: tuple[str, ...] | None = None) -> list[RunRecord]:
        q = "SELECT * FROM runs"
        args: list[Any] = []
        where = []
        if states:
            where.append(f"state IN ({','.join('?' * len(states))})")
            args.extend(run_state(s).value for s in states)
        if sources:
            where.append(f"source IN ({','.join('?' * len(sources))})")
            args.extend(sources)
        if where:
            q += " WHERE " + " AND ".join(where)
        q += " ORDER BY created DESC LIMIT ?"
        args.append(limit)
        with self._reading("list runs") as db:
            cur = db.execute(q, args)
            cols = [d[0] for d in cur.description]
            rows = cur.fetchall()
        return [self._record(dict(zip(cols, r, strict=True))) for r in rows]

    def _record(self, row: dict[str, Any]) -> RunRecord:
        # an active run whose engine is gone, however it died, reads interrupted
        state = read_state(row["state"], row["owner_host"], row["owner_pid"], row["owner_start"])
        return RunRecord(
            id=row["id"], runbook=row["runbook"], params=json.loads(row["params"]),
            nodes=json.loads(row["nodes"]), state=state, source=row["source"],
            plan_digest=row["plan_digest"], plan=json.loads(row["plan"]) if row["plan"] else None,
            approval_required=bool(row["approval_required"]), approved_by=row["approved_by"],
            approved_at=row["approved_at"], approved_digest=row["approved_digest"],
            created=row["created"], started=row["started"], finished=row["finished"],
            exit_code=row["exit_code"], owner_host=row["owner_host"], owner_pid=row["owner_pid"],
            owner_start=row["owner_start"],
        )

    def prune(self, *, keep: int, max_age: float | None = None, now: float | None = None) -> list[str]:
        """Delete finished runs (and their events) beyond the ``keep`` newest finished ones, and
        those finished more than ``max_age`` seconds ago; the deleted ids. Runs not in a final
        state are never deleted."""
        check_retention(keep, max_age)
        now = time.time() if now is None else now
        with self._tx("prune old runs") as db:
            rows = db.execute(f"SELECT id, COALESCE(finished, created) FROM runs WHERE state IN "
                              f"({','.join('?' * len(FINAL_STATES))}) ORDER BY created DESC, id DESC",
                              FINAL_STATES).fetchall()
            doomed = [rid for i, (rid, end) in enumerate(rows)
                      if past_retention(i, float(end), keep=keep, max_age=max_age, now=now)]
            for rid in doomed:
                db.execute("DELETE FROM events WHERE run_id=?", (rid,))
                db.execute("DELETE FROM runs WHERE id=?", (rid,))
        return doomed

    # -- events -------------------------------------------------------------------------------

    def append(self, run_id: str, kind: str, step: str | None = None, **data: Any) -> int:
        """Append one event durably; returns its sequence number."""
        with self._tx(f"record event {kind} of run {run_id}") as db:
            (seq,) = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM events WHERE run_id=?",
                                (run_id,)).fetchone()
            db.execute("INSERT INTO events (run_id, seq, ts, kind, step, data) VALUES (?,?,?,?,?,?)",
                       (run_id, seq, time.time(), kind, step, self._dump(data)))
            db.execute("UPDATE runs SET heartbeat=? WHERE id=?", (time.time(), run_id))
        return int(seq)

    def events(self, run_id: str) -> list[EventRecord]:
        with self._reading(f"read the events of run {run_id}") as db:
            rows = db.execute(
                "SELECT run_id, seq, ts, kind, step, data FROM events WHERE run_id=? ORDER BY seq",
                (run_id,)).fetchall()
        return [EventRecord(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in rows]


@contextmanager
def opened(store: RunStore | Path | str | None) -> Iterator[RunStore]:
    """``store`` itself (left open: its owner closes it), or the SQLite journal at that path
    (``None``: the default path), opened for the block and closed after it."""
    if store is None or isinstance(store, Path | str):
        journal = Journal(store)
        try:
            yield journal
        finally:
            journal.close()
    else:
        yield store


def _journal_is_a_run_store(journal: Journal) -> RunStore:
    return journal  # mypy checks that the SQLite journal satisfies the interface
