"""One remediation per node: a ``coordination.k8s.io/v1`` Lease per node.

The Lease ``runbook-node-<node>`` in namespace ``kube-system`` (configurable) names its holder
``runbook/<run id>``. It has a TTL (``leaseDurationSeconds``), is renewed while the run lasts,
released at the end, and taken over only after it expired or by the same run (a resume).
CLI runs and server runs take the same Lease, so two servers, or a server and a person, never
remediate one node at once. Optimistic concurrency (resourceVersion, HTTP 409) settles races.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.connectors.base import KubeAPI, LeaseRecord
from engine.errors import Conflict, KubeError, LockHeld

DEFAULT_NAMESPACE = "kube-system"
DEFAULT_TTL_SECONDS = 120


def lease_name(node: str) -> str:
    return f"runbook-node-{node}"


def holder_for(run_id: str) -> str:
    return f"runbook/{run_id}"


@dataclass
class NodeLock:
    """A held Lease. ``release()`` is idempotent; a background thread renews it at TTL/3 and calls
    ``on_lost`` if it finds another holder (our renewals failed for longer than the TTL)."""

    kube: KubeAPI
    node: str
    run_id: str
    lease: LeaseRecord
    ttl: int
    _stop: threading.Event | None = None
    _thread: threading.Thread | None = None
    lost: str | None = None  # set when a renewal found another holder
    on_lost: Callable[[str], None] | None = None  # told the new holder (the run must stop acting)

    def start_renewing(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name=f"lease-{self.node}", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        assert self._stop is not None
        while not self._stop.wait(max(1.0, self.ttl / 3)):
            try:
                self.lease = self.kube.update_lease(self.lease, holder_for(self.run_id), self.ttl, acquire=False)
            except Conflict:
                current = self.kube.read_lease(self.lease.namespace, self.lease.name)
                if current is None or current.holder != holder_for(self.run_id):
                    self.lost = current.holder if current else "(deleted)"
                    if self.on_lost is not None:
                        self.on_lost(self.lost)
                    return
                self.lease = current
            except KubeError:
                continue  # API briefly away: keep trying until the TTL would run out

    def release(self) -> None:
        if self._stop is not None:
            self._stop.set()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._stop = None
        try:
            current = self.kube.read_lease(self.lease.namespace, self.lease.name)
            if current is not None and current.holder == holder_for(self.run_id):
                self.kube.delete_lease(current)
        except KubeError:
            pass  # the TTL frees it; never fail a finished run over its lock


def acquire_node_lock(kube: KubeAPI, node: str, run_id: str, *, namespace: str = DEFAULT_NAMESPACE,
                      ttl: int = DEFAULT_TTL_SECONDS, wait: float = 0.0,
                      clock: Callable[[], float] = time.time,
                      sleep: Callable[[float], None] = time.sleep) -> NodeLock:
    """Take the node's Lease for ``run_id`` or raise LockHeld naming the holder.

    Waits up to ``wait`` seconds for another holder's Lease to be released or to expire.
    An API error counts as "held" (guards fail closed).
    """
    deadline = clock() + wait
    name = lease_name(node)
    mine = holder_for(run_id)
    while True:
        try:
            current = kube.read_lease(namespace, name)
            if current is None:
                lease = kube.create_lease(namespace, name, mine, ttl)
                return NodeLock(kube, node, run_id, lease, ttl)
            expired = clock() > current.renew_time + current.duration_seconds
            if current.holder == mine or expired or not current.holder:
                lease = kube.update_lease(current, mine, ttl, acquire=current.holder != mine)
                return NodeLock(kube, node, run_id, lease, ttl)
            reason = (f"node {node} is being remediated by {current.holder} "
                      f"(Lease {namespace}/{name}, renewed {clock() - current.renew_time:.0f}s ago, "
                      f"TTL {current.duration_seconds}s)")
        except Conflict:
            reason = f"node {node}: another run took Lease {namespace}/{name} at the same moment"
        except KubeError as e:
            raise LockHeld(f"node {node}: cannot read Lease {namespace}/{name}: {e}") from e
        if clock() >= deadline:
            raise LockHeld(reason)
        sleep(min(1.0, max(0.05, deadline - clock())))
