"""One remediation per node: a ``coordination.k8s.io/v1`` Lease per node.

The Lease ``runbook-node-<node>`` in namespace ``kube-system`` (configurable) names its holder
``runbook/<run id>``. It has a TTL (``leaseDurationSeconds``), is renewed while the run lasts,
released at the end, and taken over only after it expired or by the same run (a resume).
CLI runs and server runs take the same Lease, so two servers, or a server and a person, never
remediate one node at once. Optimistic concurrency (resourceVersion, HTTP 409) settles races.

Expiry is judged the way client-go's leader election judges it: by how long *this process* has
observed the Lease unchanged (same resourceVersion, holder and renewTime), on its own monotonic
clock. The holder's ``renewTime`` is another machine's wall clock: it is shown to people, never
compared with ours, so a machine whose clock runs minutes ahead cannot take a live Lease, and an
abandoned one is taken over after about its TTL of observation.

The holder side mirrors it. A renewal thread renews at TTL/3; every outcome of every attempt
ends in one of two states: renewed, or lost. An error (API away, a 409 whose re-read fails too,
anything unexpected, the thread itself failing) is retried until the *renew deadline* (2/3 of the
TTL since the last confirmed renewal); past it the Lease counts as lost, before anyone else could
have observed it unchanged for a whole TTL. Lost means ``on_lost`` is told once (the run journals
``lock.lost`` and is cancelled) and the fence refuses every further action.

Fencing: :meth:`NodeLock.fence` is called right before each action's intent is recorded. It
re-reads the Lease and checks it is still ours with the same ``leaseTransitions`` as when we took
it; it returns the token journaled with the intent, or raises ``LockLost``.

The same machinery serves any Lease with a holder identity of its own: ``try_take`` is one attempt
that keeps its observation (``LeaseObservation``) between calls, and a ``NodeLock`` built with
``identity`` renews, fences and ``step_down``s like a node's. ``engine.serve.leader`` elects the
``runbook-serve`` leader with it (no second Lease implementation).

What it must not do: compare its wall clock with a ``renewTime``, act on a Lease it is not sure
it still holds, or let the renewal thread end without saying so.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.connectors.base import KubeAPI, LeaseRecord
from engine.errors import Conflict, KubeError, LockHeld, LockLost

DEFAULT_NAMESPACE = "kube-system"
DEFAULT_TTL_SECONDS = 120
RENEW_DEADLINE_FRACTION = 2 / 3  # of the TTL, since the last confirmed renewal (client-go: 10 s of 15 s)


def lease_name(node: str) -> str:
    return f"runbook-node-{node}"


def holder_for(run_id: str) -> str:
    return f"runbook/{run_id}"


REPLICA_LEASE_PREFIX = "runbook-replica-"


def replica_lease_name(host: str, pid: int) -> str:
    """The liveness Lease of the ``runbook serve`` process ``pid`` on ``host`` (a run's recorded
    owner names it): ``runbook-replica-<host, made a DNS name>-<digest of the exact host>-<pid>``."""
    slug = re.sub(r"[^a-z0-9-]+", "-", host.lower()).strip("-")[:60].strip("-") or "host"
    digest = hashlib.blake2b(host.encode("utf-8", "backslashreplace"), digest_size=4).hexdigest()
    return f"{REPLICA_LEASE_PREFIX}{slug}-{digest}-{pid}"


def replica_holder(host: str | None, pid: int | None, start: str | None) -> str:
    """The holder a replica's liveness Lease names: the process exactly as runs record their owner."""
    return f"{host}/{pid}/{start or '-'}"


@dataclass(frozen=True)
class FenceToken:
    """Who may act on the node right now: our holder identity and the Lease's transition count."""

    lease: str  # namespace/name
    holder: str
    transitions: int
    resource_version: str

    def as_event(self) -> dict[str, Any]:
        return {"lease": self.lease, "holder": self.holder, "transitions": self.transitions,
                "resource_version": self.resource_version}


@dataclass
class NodeLock:
    """A held Lease. ``release()`` is idempotent. ``start_renewing()`` starts the renewal thread;
    ``fence()`` is asked before each action. ``lost`` names the new holder (or the cause) once the
    Lease is no longer ours; ``on_lost`` is told so once, from whichever thread found out."""

    kube: KubeAPI
    node: str
    run_id: str
    lease: LeaseRecord
    ttl: int
    clock: Callable[[], float] = time.monotonic
    _stop: threading.Event | None = None
    _thread: threading.Thread | None = None
    lost: str | None = None  # set when the Lease is no longer ours: the new holder, or "(unknown)"
    lost_reason: str = ""
    on_lost: Callable[[str], None] | None = None  # told the new holder (the run must stop acting)
    renewed_at: float = field(default=0.0)  # our monotonic time of the last confirmed renewal
    transitions: int = field(default=0, init=False)  # leaseTransitions of our tenure
    _state_lock: threading.Lock = field(default_factory=threading.Lock)
    identity: str = ""  # the holder identity when it is not ``runbook/<run id>`` (the serve leader)

    def __post_init__(self) -> None:
        self.renewed_at = self.clock()
        self.transitions = self.lease.transitions  # our tenure: another holder's take-over changes it

    @property
    def holder(self) -> str:
        return self.identity or holder_for(self.run_id)

    @property
    def subject(self) -> str:
        return f"node {self.node}" if self.node else f"Lease {self._where()}"

    @property
    def renew_interval(self) -> float:
        return max(1.0, self.ttl / 3)

    @property
    def retry_interval(self) -> float:
        return max(0.5, self.ttl / 15)

    @property
    def renew_deadline(self) -> float:
        return self.ttl * RENEW_DEADLINE_FRACTION

    # -- renewal --------------------------------------------------------------------------------

    def start_renewing(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name=f"lease-{self.node or self.lease.name}",
                                        daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        stop = self._stop
        assert stop is not None
        try:
            wait = self.renew_interval
            while not stop.wait(wait):
                if self.lost is not None:
                    return
                ok = self.renew_once()
                if self.lost is not None:
                    return
                wait = self.renew_interval if ok else self.retry_interval
        except BaseException as e:  # never die silently: a thread that cannot renew has lost the Lease
            self._lose("(unknown)", f"the renewal thread failed: {type(e).__name__}: {e}")

    def renew_once(self) -> bool:
        """One renewal attempt. True: renewed. False: not renewed this time (the Lease is still ours
        if ``lost`` is None, and the next attempt comes after ``retry_interval``)."""
        error = ""
        try:
            self._adopt(self.kube.update_lease(self.lease, self.holder, self.ttl, acquire=False), renewed=True)
            return True
        except Conflict:
            # Someone wrote the Lease since our last renewal, or our own last write went through
            # unanswered. Read it: another holder (or another tenure) means lost.
            try:
                current = self.kube.read_lease(self.lease.namespace, self.lease.name)
            except Exception as e:  # the API went away during the re-read: retry until the deadline
                error = f"409 on renewal, then the re-read failed: {type(e).__name__}: {e}"
            else:
                if not self._still_ours(current) or current is None:
                    return False
                self.lease = current  # ours still: renew on the fresh resourceVersion at once
                try:
                    self._adopt(self.kube.update_lease(current, self.holder, self.ttl, acquire=False),
                                renewed=True)
                    return True
                except Exception as e:
                    error = f"renewal after a 409 failed: {type(e).__name__}: {e}"
        except Exception as e:  # KubeError (API away) or anything unexpected: retried, never ignored
            error = f"{type(e).__name__}: {e}"
        self._check_deadline(error)
        return False

    def _adopt(self, lease: LeaseRecord, *, renewed: bool) -> None:
        with self._state_lock:
            if self.lost is None:
                self.lease = lease
                if renewed:
                    self.renewed_at = self.clock()

    def _still_ours(self, current: LeaseRecord | None) -> bool:
        """False (and the Lease marked lost) when ``current`` is not our tenure any more."""
        if current is None:
            self._lose("(deleted)", f"Lease {self._where()} was deleted")
            return False
        if current.holder != self.holder:
            self._lose(current.holder or "(released)", f"Lease {self._where()} is now held by "
                       f"{current.holder or 'nobody'}")
            return False
        if current.transitions != self.transitions:
            self._lose(current.holder, f"Lease {self._where()} changed hands since we took it "
                       f"(leaseTransitions {self.transitions} -> {current.transitions})")
            return False
        return True

    def _check_deadline(self, error: str) -> None:
        since = self.clock() - self.renewed_at
        if since >= self.renew_deadline:
            self._lose("(unknown)", f"Lease {self._where()} not renewed for {since:.0f}s (renew deadline "
                       f"{self.renew_deadline:.0f}s of its {self.ttl}s TTL): another run may take it; "
                       f"last error: {error or 'none'}")

    def _lose(self, holder: str, reason: str) -> None:
        with self._state_lock:
            if self.lost is not None:
                return
            self.lost, self.lost_reason = holder, reason
        if self._stop is not None:
            self._stop.set()
        if self.on_lost is not None:
            # A failing callback (journal full) changes nothing: the fence refuses every action.
            with contextlib.suppress(Exception):
                self.on_lost(holder)

    def _where(self) -> str:
        return f"{self.lease.namespace}/{self.lease.name}"

    # -- fencing --------------------------------------------------------------------------------

    def fence(self) -> dict[str, Any]:
        """The token to journal with the next action, if the Lease is still ours; else ``LockLost``.

        The Lease is re-read: another holder, another ``leaseTransitions`` or no Lease means lost.
        If the read fails, our own record decides: a renewal confirmed less than the renew deadline
        ago means nobody can have taken the Lease yet (they must observe it unchanged for a TTL)."""
        if self.lost is None:
            try:
                current = self.kube.read_lease(self.lease.namespace, self.lease.name)
            except Exception as e:
                self._check_deadline(f"fence read failed: {type(e).__name__}: {e}")
            else:
                if self._still_ours(current):
                    self._check_deadline("")
        if self.lost is not None:
            who = "the run" if self.node else self.holder
            raise LockLost(f"{self.subject}: {who} no longer holds its Lease ({self.lost_reason}); "
                           "nothing more is done")
        return FenceToken(self._where(), self.holder, self.transitions, self.lease.resource_version).as_event()

    # -- release --------------------------------------------------------------------------------

    def _stop_renewing(self) -> None:
        if self._stop is not None:
            self._stop.set()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout=5)
            self._stop = None

    def step_down(self) -> None:
        """Give the Lease up without deleting it (client-go's ReleaseOnCancel): holder emptied, TTL 1 s,
        written on our resourceVersion, so a contender takes it at once; needs only ``update``. A
        Lease that is no longer ours is left alone; an API error leaves it to expire."""
        self._stop_renewing()
        with contextlib.suppress(KubeError):
            current = self.kube.read_lease(self.lease.namespace, self.lease.name)
            if current is not None and current.holder == self.holder and current.transitions == self.transitions:
                self.kube.update_lease(current, "", 1, acquire=False)
        self._lose("(released)", f"Lease {self._where()} given up")

    def release(self) -> None:
        self._stop_renewing()
        try:
            current = self.kube.read_lease(self.lease.namespace, self.lease.name)
            if current is not None and current.holder == self.holder and current.transitions == self.transitions:
                self.kube.delete_lease(current)
        except KubeError:
            pass  # the TTL frees it; never fail a finished run over its lock


def _observed_key(lease: LeaseRecord) -> tuple[Any, ...]:
    return (lease.resource_version, lease.holder, lease.renew_time, lease.transitions, lease.duration_seconds)


@dataclass
class LeaseObservation:
    """How long this process has seen one Lease unchanged, on its own monotonic clock (client-go's
    observedRecord/observedTime). Keep one per Lease across attempts."""

    clock: Callable[[], float] = time.monotonic
    key: tuple[Any, ...] | None = None
    since: float = 0.0

    def unchanged_for(self, lease: LeaseRecord) -> float:
        now = self.clock()
        if _observed_key(lease) != self.key:
            self.key, self.since = _observed_key(lease), now
        return now - self.since

    def forget(self) -> None:
        self.key = None


@dataclass(frozen=True)
class Held:
    """``try_take``'s answer when another holder's Lease is live."""

    lease: LeaseRecord
    unchanged_for: float


def try_take(kube: KubeAPI, namespace: str, name: str, holder: str, ttl: int,
             seen: LeaseObservation) -> LeaseRecord | Held:
    """One attempt at a Lease for ``holder``: created if absent; taken if free, released, already
    ``holder``'s, or observed unchanged (``seen``) for its whole ``leaseDurationSeconds``; else
    ``Held``. ``Conflict`` (someone wrote it meanwhile) and ``KubeError`` propagate."""
    current = kube.read_lease(namespace, name)
    if current is None:
        return kube.create_lease(namespace, name, holder, ttl)
    unchanged_for = seen.unchanged_for(current)
    expired = unchanged_for >= max(1, current.duration_seconds)
    if current.holder == holder or expired or not current.holder:
        return kube.update_lease(current, holder, ttl, acquire=current.holder != holder)
    return Held(current, unchanged_for)


def acquire_node_lock(kube: KubeAPI, node: str, run_id: str, *, namespace: str = DEFAULT_NAMESPACE,
                      ttl: int = DEFAULT_TTL_SECONDS, wait: float = 0.0,
                      clock: Callable[[], float] = time.monotonic,
                      sleep: Callable[[float], None] = time.sleep,
                      wall: Callable[[], float] = time.time) -> NodeLock:
    """Take the node's Lease for ``run_id`` or raise LockHeld naming the holder.

    A free, released or own Lease is taken at once. Another holder's Lease is taken only once this
    process has observed it unchanged for its whole ``leaseDurationSeconds`` on ``clock`` (monotonic):
    that needs ``wait`` of at least the TTL. ``wall`` only words the message ("renewed 30s ago" by
    our clock). An API error counts as "held" (guards fail closed).
    """
    deadline = clock() + wait
    name = lease_name(node)
    mine = holder_for(run_id)
    seen = LeaseObservation(clock)
    while True:
        try:
            got = try_take(kube, namespace, name, mine, ttl, seen)
            if isinstance(got, LeaseRecord):
                return NodeLock(kube, node, run_id, got, ttl, clock=clock)
            current = got.lease
            reason = (f"node {node} is being remediated by {current.holder} "
                      f"(Lease {namespace}/{name}, renewed {wall() - current.renew_time:.0f}s ago, "
                      f"TTL {current.duration_seconds}s; seen unchanged for {got.unchanged_for:.0f}s here: it is "
                      f"taken over after {current.duration_seconds}s unchanged, --lock-wait)")
        except Conflict:
            reason = f"node {node}: another run took Lease {namespace}/{name} at the same moment"
            seen.forget()
        except KubeError as e:
            raise LockHeld(f"node {node}: cannot read Lease {namespace}/{name}: {e}") from e
        if clock() >= deadline:
            raise LockHeld(reason)
        sleep(min(1.0, max(0.05, deadline - clock())))
