"""Which replica of ``runbook serve`` is the leader: the ``coordination.k8s.io/v1`` Lease ``runbook-serve``.

Several replicas serve webhooks at once; the duties that must run once per cluster (resuming orphaned
runs, retention pruning, the breaker's accounting) run only on the replica holding this Lease in the
store namespace. The Lease machinery is ``engine.locks``'s (no second implementation): ``try_take``
with a ``LeaseObservation`` kept across attempts, so expiry is judged as client-go judges it, by how
long *this process* has seen the Lease unchanged on its own monotonic clock, never by comparing our
wall clock with the holder's ``renewTime``. Held, it is a ``NodeLock`` with our identity: renewed at
TTL/3, lost past the renew deadline (2/3 of the TTL) or when another holder appears; ``stop`` gives
it up at once (holder emptied, TTL 1 s) so another replica takes over without waiting a TTL.

``ReplicaLease`` is each replica's liveness record, which the leader reads: the Lease
``runbook-replica-<host>-<digest>-<pid>`` (``engine.locks.replica_lease_name``) held by this process
exactly as a run records its owner (host/pid/start), renewed like the leader Lease, deleted at a clean
stop. A run queued at a replica whose Lease the leader has seen unchanged for its whole duration (or
held by another process now) is adopted by the leader (``engine.serve_starter``).

``SingleReplica`` is the leadership of a server that elects nothing (the SQLite store: one replica).

What it must not do: act as leader on a Lease it is not sure it holds (``is_leader`` turns false the
moment the renewal gives up), write any Lease but its own, or die silently (an error while
following is retried every retry period; while leading, the renewal thread reports the loss).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from engine.connectors.base import KubeAPI, LeaseRecord
from engine.errors import Conflict
from engine.locks import Held, LeaseObservation, NodeLock, replica_holder, replica_lease_name, try_take
from engine.store import current_owner

log = logging.getLogger(__name__)
LEASE_NAME = "runbook-serve"
DEFAULT_TTL_SECONDS = 15  # client-go's leaseDuration; renew deadline 10 s, retry 2 s


def default_identity() -> str:
    """``<pod or host name>_<random>``: unique per process, readable in ``kubectl get lease``."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


class Leadership(Protocol):
    def is_leader(self) -> bool:
        """True only while this replica may do the singleton duties."""
        ...

    def describe(self) -> dict[str, Any]:
        """``{"role": "leader"|"follower"|"single", ...}`` for ``/readyz`` and ``/healthz``."""
        ...


class SingleReplica:
    """No election: the only replica does every duty."""

    def is_leader(self) -> bool:
        return True

    def describe(self) -> dict[str, Any]:
        return {"role": "single"}

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None


class ReplicaLease:
    """This process's liveness Lease (see the module doc): ``keep`` takes it (or takes it again after
    it was lost: the API away past the renew deadline), ``stop`` deletes it. Errors are logged and
    retried by the next ``keep``, never fatal: without it, the leader leaves this replica's queue alone."""

    def __init__(self, kube: Callable[[], KubeAPI], *, namespace: str, ttl: int = DEFAULT_TTL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._kube = kube
        self.namespace, self.ttl, self._clock = namespace, ttl, clock
        host, pid, start = current_owner()
        self.name = replica_lease_name(host, pid)
        self.holder = replica_holder(host, pid, start)
        self._held: NodeLock | None = None
        self._seen = LeaseObservation(clock)
        self.last_error = ""

    def alive(self) -> bool:
        held = self._held
        return held is not None and held.lost is None

    def keep(self) -> bool:
        """Hold the Lease (renewed in its own thread); True while it is held."""
        if self.alive():
            return True
        try:
            kube = self._kube()
            got = try_take(kube, self.namespace, self.name, self.holder, self.ttl, self._seen)
        except Exception as e:  # API away, RBAC, a 409: the next keep() tries again
            self.last_error = f"{type(e).__name__}: {e}"
            log.warning("replica Lease %s/%s not held: %s", self.namespace, self.name, self.last_error)
            return False
        if isinstance(got, Held):  # a previous process of this host and pid: free once it expired
            return False
        held = NodeLock(kube, "", "", got, self.ttl, clock=self._clock, identity=self.holder)
        held.start_renewing()
        self._held, self.last_error = held, ""
        return True

    def stop(self) -> None:
        """Delete the Lease (after the queued runs were handed back): nothing is left to adopt."""
        held, self._held = self._held, None
        if held is not None:
            held.release()


class LeaderElector:
    """Campaign for the Lease ``namespace/name`` in a daemon thread; ``is_leader()`` tells the outcome.

    ``on_change(True)`` is called (from the election thread) when this replica becomes leader,
    ``on_change(False)`` when it stops being one; a failing callback is logged, never fatal."""

    def __init__(self, kube: Callable[[], KubeAPI], *, namespace: str, name: str = LEASE_NAME,
                 identity: str | None = None, ttl: int = DEFAULT_TTL_SECONDS, retry: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[bool], None] | None = None, replica_lease: bool = False) -> None:
        """``replica_lease``: also hold this process's liveness Lease (``ReplicaLease``), kept by the
        same loop, so the leader can adopt the queue of a replica that died without stopping."""
        self._kube = kube
        self.namespace, self.name = namespace, name
        self.identity = identity or default_identity()
        self.ttl = ttl
        self.retry = retry if retry is not None else max(0.2, ttl * 2 / 15)  # client-go: 2 s of 15 s
        self._clock = clock
        self._seen = LeaseObservation(clock)
        self._held: NodeLock | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_change = on_change
        self.observed_holder = ""  # the leader as last read (ours or another's)
        self.last_error = ""
        self.replica = ReplicaLease(kube, namespace=namespace, ttl=ttl, clock=clock) if replica_lease else None

    # -- state ----------------------------------------------------------------------------------

    def is_leader(self) -> bool:
        with self._lock:
            held = self._held
        return held is not None and held.lost is None

    def describe(self) -> dict[str, Any]:
        leader = self.is_leader()
        out: dict[str, Any] = {"role": "leader" if leader else "follower", "identity": self.identity,
                               "lease": f"{self.namespace}/{self.name}",
                               "leader": self.identity if leader else self.observed_holder}
        if self.last_error and not leader:
            out["error"] = self.last_error
        if self.replica is not None:
            out["replica_lease"] = f"{self.namespace}/{self.replica.name}"
        return out

    # -- campaign -------------------------------------------------------------------------------

    def try_once(self) -> bool:
        """One election step: take (or keep) the Lease if we may. True when we lead afterwards."""
        if self.is_leader():
            return True
        try:
            kube = self._kube()
            got = try_take(kube, self.namespace, self.name, self.identity, self.ttl, self._seen)
        except Conflict:
            self._seen.forget()  # another replica wrote it at the same moment: look again next time
            return False
        except Exception as e:  # API away, RBAC: stay a follower, try again in a retry period
            self.last_error = f"{type(e).__name__}: {e}"
            return False
        self.last_error = ""
        if isinstance(got, Held):
            self.observed_holder = got.lease.holder
            return False
        self._lead(kube, got)
        return True

    def _lead(self, kube: KubeAPI, lease: LeaseRecord) -> None:
        held = NodeLock(kube, "", "", lease, self.ttl, clock=self._clock, identity=self.identity)
        held.on_lost = self._lost
        with self._lock:
            self._held = held
        self.observed_holder = self.identity
        held.start_renewing()
        log.info("leader of Lease %s/%s: %s", self.namespace, self.name, self.identity)
        self._tell(True)

    def _lost(self, holder: str) -> None:
        log.warning("no longer the leader of Lease %s/%s (%s)", self.namespace, self.name, holder)
        self._seen.forget()
        self._tell(False)

    def _tell(self, leading: bool) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(leading)
        except Exception:
            log.exception("leadership change handler failed")

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.replica is not None:
                self.replica.keep()
            self.try_once()
            self._stop.wait(self.retry)

    def start(self) -> None:
        if self.replica is not None:
            self.replica.keep()  # before the first page is queued here
        self._thread = threading.Thread(target=self._loop, name="runbook-serve-leader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop campaigning; a held Lease is given up at once (the next leader need not wait a TTL)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            held = self._held
        if held is not None and held.lost is None:
            held.step_down()
        if self.replica is not None:
            self.replica.stop()
