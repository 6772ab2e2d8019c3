"""Dedup and circuit breaker: in-memory bookkeeping that decides, never acts.

* **Dedup** prevents the same page from remediating twice: an alert fingerprint (or PagerDuty
  incident) that started a run within ``dedup.fingerprint_window`` starts nothing new; a node with
  an active run (pending, waiting for approval, running), or whose last run ended less than
  ``dedup.node_cooldown`` ago, starts nothing new. ``reserve`` checks and claims atomically, so 20
  identical alerts arriving together start exactly one run.
* **Circuit breaker** keeps automation from making an outage worse. It governs *automatic* runs
  only: at most ``breaker.max_auto_runs`` per runbook per ``breaker.window``; none while more than
  ``max_unhealthy_nodes`` nodes or ``max_unhealthy_gpus`` GPUs are unhealthy (a bigger outage: a
  human decides); none on a node whose last automatic run failed, until a person resets it. A
  tripped breaker turns the run into an ``approve``-mode run carrying the breaker's warning.
* **Approval budget**: at most ``breaker.max_pending_approvals`` approve-mode runs waiting at once,
  so a storm cannot bury the on-call engineer in plans.

With a shared store (several replicas) the dispatcher passes ``check_auto`` the store's verdict
(``SharedBreaker``: the node's last automatic run failed and was not reset; the automatic runs of the
runbook in the window, whoever started them), so every replica decides from the same runs; this
replica only adds the automatic runs it is creating right now (not in the store yet).

Open node breakers are written to ``breaker.state_file`` (when set) so a restart does not close
them. Everything else is rebuilt from the journal at start (``remember``: fingerprints of recent
runs). Memory is bounded whatever senders choose: dedup keys are kept as 16-byte digests, at most
``limits.max_dedup_entries`` of them (the oldest are forgotten first). Thread-safe; the clock is
injected.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from engine.model import RunState
from engine.serve.cluster import ClusterSnapshot
from engine.serve.config import ServeConfig
from engine.serve.starter import WEBHOOK_SOURCES

log = logging.getLogger(__name__)
_RESERVED = "(starting)"
_REFUSED = "(refused)"


def _k(key: str) -> bytes:
    """A fixed-size stand-in for a sender-chosen key (fingerprints may be long)."""
    return hashlib.blake2b(key.encode("utf-8", "backslashreplace"), digest_size=16).digest()


def _trim(entries: dict[Any, tuple[float, str]], now: float, window: float, limit: int) -> None:
    while entries:
        first = next(iter(entries))
        if len(entries) < limit and now - entries[first][0] < window:
            return
        del entries[first]


@dataclass(frozen=True)
class Reservation:
    """A claim on a dedup key and a node, taken before a run is submitted."""

    key: str
    node: str | None
    token: int


@dataclass(frozen=True)
class NodeBreaker:
    node: str
    run_id: str
    since: float
    reason: str


@dataclass(frozen=True)
class SharedBreaker:
    """The shared store's breaker verdict for one automatic candidate (several replicas)."""

    open_node: NodeBreaker | None  # the node's last automatic run failed and nobody reset it
    auto_runs: int  # automatic runs of the runbook in the window (not reset), from every replica


def epoch(iso: Any) -> float | None:
    """An ISO 8601 time of a run summary as epoch seconds (None when absent or unreadable)."""
    if not isinstance(iso, str) or not iso:
        return None
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def node_of(summary: Mapping[str, Any]) -> str | None:
    """The node of a run summary: its first node, else its ``node`` param."""
    nodes = summary.get("nodes") or ()
    if nodes:
        return str(nodes[0])
    node = (summary.get("params") or {}).get("node")
    return node if isinstance(node, str) else None


@dataclass(frozen=True)
class RunSummary:
    """A run as the shared breaker reads it, typed once from ``RunStarter.runs()``' summaries
    (``RunRecord.summary()``-shaped dicts): a state that is not a ``RunState`` is ``None`` and
    never counts as ended."""

    id: str
    runbook: str
    node: str | None
    state: RunState | None
    source: str
    approval_required: bool
    started: float | None
    finished: float | None
    exit_code: int | None

    @classmethod
    def of(cls, s: Mapping[str, Any]) -> RunSummary:
        try:
            state: RunState | None = RunState(str(s.get("state")))
        except ValueError:
            state = None
        code = s.get("exit_code")
        return cls(id=str(s.get("id", "")), runbook=str(s.get("runbook", "")), node=node_of(s), state=state,
                   source=str(s.get("source", "")), approval_required=bool(s.get("approval_required")),
                   started=epoch(s.get("started")), finished=epoch(s.get("finished")),
                   exit_code=code if isinstance(code, int) else None)

    @property
    def automatic(self) -> bool:
        """Started by a page without a person's approval: what the breaker counts."""
        return self.source in WEBHOOK_SOURCES and not self.approval_required


ResetCheck = Callable[[str, str], bool]  # (run id, scope "node" | "runbook") -> a person reset it


def automatic_runs(summaries: Iterable[Mapping[str, Any]]) -> list[RunSummary]:
    """The store's automatic webhook runs, typed, in the order given (newest first)."""
    return [r for r in map(RunSummary.of, summaries) if r.automatic]


def open_in_store(runs: Sequence[RunSummary], node: str, was_reset: ResetCheck) -> RunSummary | None:
    """The node's last ended automatic run, when it failed and nobody reset it (the node's breaker
    is open at every replica)."""
    for r in runs:
        if r.node == node and r.state is not None and r.state.is_final:
            failed = r.state is RunState.FAILED and not was_reset(r.id, "node")
            return r if failed else None
    return None


def in_window(runs: Sequence[RunSummary], runbook: str | None, now: float, window: float) -> list[RunSummary]:
    """The automatic runs (of ``runbook``, or of every runbook) started within ``window`` seconds."""
    return [r for r in runs if (runbook is None or r.runbook == runbook) and now - (r.started or now) < window]


def shared_verdict(runs: Sequence[RunSummary], runbook: str, node: str | None, *, now: float, window: float,
                   max_auto_runs: int, was_reset: ResetCheck) -> SharedBreaker:
    """The breaker over the store's runs (every replica's) for one automatic candidate."""
    failed = open_in_store(runs, node, was_reset) if node is not None else None
    open_node = None
    if failed is not None and node is not None:
        open_node = NodeBreaker(node, failed.id, failed.finished or now,
                                f"automatic run failed (exit {failed.exit_code})")
    recent = in_window(runs, runbook, now, window)
    if len(recent) >= max_auto_runs:  # tripped, unless a reset marked some
        recent = [r for r in recent if not was_reset(r.id, "runbook")]
    return SharedBreaker(open_node, len(recent))


class Guards:
    def __init__(self, config: ServeConfig, *, clock: Callable[[], float] = time.time) -> None:
        self._cfg = config
        self._clock = clock
        self._lock = threading.RLock()
        self._seen: dict[bytes, tuple[float, str]] = {}  # _k(dedup key) -> (time, run id or reserved)
        self._max = config.limits.max_dedup_entries
        self._active: dict[str, str] = {}  # node -> run id (or _RESERVED)
        self._cooldown: dict[str, tuple[float, str]] = {}  # node -> (ended at, run id)
        self._auto_starts: dict[str, deque[float]] = {}  # runbook -> start times in the window
        self._inflight: dict[str, int] = {}  # runbook -> automatic runs allowed here, not created yet
        self._open: dict[str, NodeBreaker] = {}  # node -> failed automatic run
        self._approvals: set[str] = set()  # approve-mode runs not yet final
        self._approval_reservations = 0
        self._tokens = 0
        self._state_file = config.breaker.state_file
        self._load_state()

    # -- dedup ------------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        # Both maps are in insertion (= time) order: drop from the front what expired, and the oldest
        # while full. Amortised O(1) per call.
        _trim(self._seen, now, self._cfg.dedup.fingerprint_window, self._max)
        _trim(self._cooldown, now, self._cfg.dedup.node_cooldown, self._max)

    def _put(self, key: bytes, value: tuple[float, str]) -> None:
        self._seen.pop(key, None)  # re-inserted: the newest, so eviction takes the oldest first
        self._seen[key] = value

    def entries(self) -> int:
        with self._lock:
            return len(self._seen) + len(self._cooldown)

    def remember(self, key: str, at: float, run_id: str) -> None:
        """A run found in the journal at start: its fingerprint stays a duplicate for the window."""
        with self._lock:
            self._expire(self._clock())
            prev = self._seen.get(_k(key))
            if prev is None or prev[0] < at:
                self._put(_k(key), (at, run_id))

    def _duplicate(self, key: str, node: str | None, now: float) -> str | None:
        seen = self._seen.get(_k(key))
        if seen is not None and now - seen[0] < self._cfg.dedup.fingerprint_window:
            what = "nothing was started then" if seen[1] == _REFUSED else f"it started {seen[1]}"
            return f"duplicate: {key} was handled {now - seen[0]:.0f}s ago ({what})"
        if node is not None:
            active = self._active.get(node)
            if active is not None:
                return f"duplicate: node {node} already has run {active} in progress"
            ended = self._cooldown.get(node)
            if ended is not None and now - ended[0] < self._cfg.dedup.node_cooldown:
                return (f"duplicate: run {ended[1]} on node {node} ended {now - ended[0]:.0f}s ago "
                        f"(cooldown {self._cfg.dedup.node_cooldown:.0f}s)")
        return None

    def peek(self, key: str, node: str | None) -> str | None:
        """The duplicate reason, without claiming anything (the fast path of a webhook)."""
        with self._lock:
            return self._duplicate(key, node, self._clock())

    def reserve(self, key: str, node: str | None) -> Reservation | str:
        """Claim ``key`` and ``node``; or the reason this is a duplicate."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            reason = self._duplicate(key, node, now)
            if reason is not None:
                return reason
            if node is not None:
                self._active[node] = _RESERVED
            self._put(_k(key), (now, _RESERVED))
            self._tokens += 1
            return Reservation(key, node, self._tokens)

    def release(self, r: Reservation, *, keep_key: bool = False) -> None:
        """Nothing was started after all: free the node; forget the key unless ``keep_key``."""
        with self._lock:
            seen = self._seen.get(_k(r.key))
            if seen is not None and seen[1] == _RESERVED:
                if keep_key:
                    self._seen[_k(r.key)] = (seen[0], _REFUSED)
                else:
                    del self._seen[_k(r.key)]
            if r.node is not None and self._active.get(r.node) == _RESERVED:
                del self._active[r.node]

    def bind(self, r: Reservation, run_id: str) -> None:
        """The run was created: the claim now names it."""
        with self._lock:
            self._seen[_k(r.key)] = (self._seen.get(_k(r.key), (self._clock(), ""))[0], run_id)
            if r.node is not None:
                self._active[r.node] = run_id

    def track_active(self, node: str | None, run_id: str, *, approve: bool) -> None:
        """A run found in the journal at start (or approved later) that is not final yet."""
        with self._lock:
            if node is not None:
                self._active[node] = run_id
            if approve:
                self._approvals.add(run_id)

    def track_ended(self, node: str | None, run_id: str, ended_at: float) -> None:
        with self._lock:
            if node is not None and self._active.get(node) in (None, run_id):
                self._active.pop(node, None)
                prev = self._cooldown.get(node)
                if prev is None or prev[0] < ended_at:
                    self._cooldown.pop(node, None)
                    self._cooldown[node] = (ended_at, run_id)

    def finished(self, node: str | None, run_id: str, *, state: str, automatic: bool, reason: str = "") -> bool:
        """A run reached a final state. Returns True when this opened the node's breaker."""
        with self._lock:
            self._approvals.discard(run_id)
            self.track_ended(node, run_id, self._clock())
            if state == "failed" and automatic and node is not None:
                self._open[node] = NodeBreaker(node, run_id, self._clock(), reason or "automatic run failed")
                self._save_state()
                return True
            return False

    # -- breaker ----------------------------------------------------------------------------

    def _window(self, runbook: str, now: float) -> deque[float]:
        starts = self._auto_starts.setdefault(runbook, deque())
        while starts and now - starts[0] >= self._cfg.breaker.window:
            starts.popleft()
        return starts

    def check_auto(self, runbook: str, node: str | None, cluster: ClusterSnapshot,
                   shared: SharedBreaker | None = None) -> list[str]:
        """Why an automatic run must not happen now (empty: it may, and a rate slot is taken).

        ``shared``: the shared store's verdict (several replicas); it replaces this replica's own
        record of the node's breaker and of the runbook's window (plus the runs being created here)."""
        b = self._cfg.breaker
        warnings: list[str] = []
        if len(cluster.unhealthy_nodes) > b.max_unhealthy_nodes:
            shown = ", ".join(cluster.unhealthy_nodes[:10])
            warnings.append(
                f"breaker: {len(cluster.unhealthy_nodes)} of {cluster.total_nodes} nodes are unhealthy "
                f"({shown}); automatic runs stop above {b.max_unhealthy_nodes}")
        if cluster.unhealthy_gpus > b.max_unhealthy_gpus:
            warnings.append(f"breaker: {cluster.unhealthy_gpus} GPUs are on unhealthy nodes; "
                            f"automatic runs stop above {b.max_unhealthy_gpus}")
        with self._lock:
            if shared is not None and node is not None:
                if shared.open_node is not None and self._open.get(node) != shared.open_node:
                    self._open[node] = shared.open_node
                    self._save_state()
                elif shared.open_node is None and node in self._open:
                    del self._open[node]  # reset (or superseded) at another replica: the store says so
                    self._save_state()
            if node is not None and node in self._open:
                nb = self._open[node]
                warnings.append(f"breaker: the last automatic run on {node} ({nb.run_id}) failed: "
                                f"{nb.reason}; automatic runs on {node} stay off until a person resets it")
            now = self._clock()
            starts = self._window(runbook, now)
            count = len(starts) if shared is None else shared.auto_runs + self._inflight.get(runbook, 0)
            if count >= b.max_auto_runs:
                warnings.append(f"breaker: {count} automatic runs of {runbook} in the last "
                                f"{b.window:.0f}s (limit {b.max_auto_runs})")
            if not warnings:
                starts.append(now)
                self._inflight[runbook] = self._inflight.get(runbook, 0) + 1
        return warnings

    def auto_created(self, runbook: str) -> None:
        """The automatic run whose slot ``check_auto`` took is in the store now (it counts there)."""
        with self._lock:
            if self._inflight.get(runbook, 0) > 0:
                self._inflight[runbook] -= 1

    def undo_auto(self, runbook: str) -> None:
        """The automatic run whose slot ``check_auto`` took was not created after all."""
        with self._lock:
            starts = self._auto_starts.get(runbook)
            if starts:
                starts.pop()
            if self._inflight.get(runbook, 0) > 0:
                self._inflight[runbook] -= 1

    def note_auto_start(self, runbook: str, at: float) -> None:
        """An automatic run found in the journal at start counts against the window."""
        with self._lock:
            if self._clock() - at < self._cfg.breaker.window:
                starts = self._window(runbook, self._clock())
                starts.append(at)
                self._auto_starts[runbook] = deque(sorted(starts))

    def reserve_approval(self) -> str | None:
        """Take an approval slot, or the reason there is none."""
        with self._lock:
            limit = self._cfg.breaker.max_pending_approvals
            if len(self._approvals) + self._approval_reservations >= limit:
                return f"{len(self._approvals)} runs are already waiting for approval (limit {limit})"
            self._approval_reservations += 1
            return None

    def bind_approval(self, run_id: str | None) -> None:
        """Turn the reservation into a waiting run (``run_id``) or give it back (None)."""
        with self._lock:
            self._approval_reservations = max(0, self._approval_reservations - 1)
            if run_id is not None:
                self._approvals.add(run_id)

    def reset(self, node: str | None = None, runbook: str | None = None) -> list[str]:
        """Close node breakers (one node or all) and/or a runbook's rate window; what was reset."""
        done: list[str] = []
        with self._lock:
            if runbook is not None:
                if self._auto_starts.pop(runbook, None):
                    done.append(f"runbook:{runbook}")
            elif node is not None:
                if self._open.pop(node, None):
                    done.append(f"node:{node}")
            else:
                done += [f"node:{n}" for n in self._open]
                done += [f"runbook:{r}" for r, s in self._auto_starts.items() if s]
                self._open.clear()
                self._auto_starts.clear()
            self._save_state()
        return done

    def state(self) -> dict[str, Any]:
        with self._lock:
            now = self._clock()
            return {
                "open_nodes": {n: {"run_id": b.run_id, "since": b.since, "reason": b.reason}
                               for n, b in self._open.items()},
                "auto_runs_in_window": {r: len(self._window(r, now)) for r in list(self._auto_starts)},
                "max_auto_runs": self._cfg.breaker.max_auto_runs,
                "active_nodes": dict(self._active),
                "waiting_approval": sorted(self._approvals),
            }

    def open_nodes(self) -> Iterable[str]:
        with self._lock:
            return list(self._open)

    def open_breaker(self, node: str) -> NodeBreaker | None:
        """The node's open breaker as this replica knows it (None: closed here)."""
        with self._lock:
            return self._open.get(node)

    def rate_tripped(self) -> Mapping[str, bool]:
        with self._lock:
            now = self._clock()
            limit = self._cfg.breaker.max_auto_runs
            return {r: len(self._window(r, now)) >= limit for r in list(self._auto_starts)}

    # -- persistence ------------------------------------------------------------------------

    def _load_state(self) -> None:
        if self._state_file is None or not self._state_file.exists():
            return
        try:
            data = json.loads(self._state_file.read_text())
            for node, b in (data.get("open_nodes") or {}).items():
                self._open[node] = NodeBreaker(node, str(b["run_id"]), float(b["since"]), str(b["reason"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            # Why: an unreadable state must not silently close breakers; refuse to start instead.
            raise RuntimeError(f"{self._state_file}: cannot read the breaker state: {e}") from e

    def _save_state(self) -> None:
        if self._state_file is None:
            return
        data = {"open_nodes": {n: {"run_id": b.run_id, "since": b.since, "reason": b.reason}
                               for n, b in self._open.items()}}
        path = Path(self._state_file)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".breaker-")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            log.error("cannot write the breaker state to %s: %s", path, e)
            with contextlib.suppress(OSError, UnboundLocalError):
                os.unlink(tmp)


class ReplayGuard:
    """PagerDuty deliveries seen within ``window`` seconds: content keys and ``X-Webhook-Id`` values
    (deliveries are retried), kept as 16-byte digests, at most ``max_ids`` of them."""

    def __init__(self, window: float, *, clock: Callable[[], float] = time.time, max_ids: int = 20_000) -> None:
        self._window = window
        self._clock = clock
        self._max = max_ids
        self._seen: dict[bytes, float] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def claim(self, webhook_id: str) -> bool:
        """True the first time an id is seen in the window; False for a replay."""
        key = _k(webhook_id)
        with self._lock:
            now = self._clock()
            while self._seen:
                first = next(iter(self._seen))
                if len(self._seen) < self._max and now - self._seen[first] < self._window:
                    break
                del self._seen[first]
            at = self._seen.get(key)
            if at is not None and now - at < self._window:
                return False
            self._seen.pop(key, None)
            self._seen[key] = now
            return True

    def release(self, webhook_id: str) -> None:
        """Processing failed (the sender will retry): forget the id."""
        with self._lock:
            self._seen.pop(_k(webhook_id), None)
