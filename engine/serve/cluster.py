"""What the guards need to know about the cluster, read through ``KubeAPI`` and cached briefly.

One snapshot holds: how many nodes are unhealthy (Ready is not True) and how many GPUs they carry
(``nvidia.com/gpu.count`` label, else ``nvidia.com/gpu`` capacity, else the sum of other
``nvidia.com/*`` capacities such as passthrough devices); which nodes carry an exclusion label
(ours ``runbook.io/exclude=true``, Medik8s' ``remediation.medik8s.io/exclude-from-remediation=true``);
and which nodes kured's reboot lock names (the ``weave.works/kured-node-lock`` annotation of the
kured DaemonSet, single or multi-owner form, with its TTL). The reading and counting rules are
``engine.run_guards``'s (the guards every run obeys); this module adds the server's cache and the
snapshot its dispatcher and breaker look at.

Reads only, never writes. An API error or an unreadable lock raises ``ClusterUnavailable``: the
caller fails closed. A snapshot is reused for ``cluster_cache_ttl`` seconds so an alert storm costs
one API round trip, not one per alert. Started (``start``, by the dispatcher at server start), a
background thread reads at once (building the client) and then every ``refresh`` seconds (less
than the TTL), so a page finds a fresh snapshot and its webhook answer
waits on no API round trip; a snapshot older than the TTL is never used (the page then reads the
cluster itself, as without the refresher).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from engine import run_guards
from engine.connectors.base import KubeAPI
from engine.errors import KubeError
from engine.facts import NodeFacts
from engine.run_guards import (
    ExclusionConfig,
    GuardUnreadable,
    KuredConfig,
    exclusion_reason,
    gpu_count,
    kured_locks,
    unhealthy,
)
from engine.serve.background import BackgroundLoop

log = logging.getLogger(__name__)

__all__ = ["ClusterSnapshot", "ClusterUnavailable", "ClusterView", "KubeClusterView", "RefreshingClusterView",
           "gpu_count",
           "kured_locks", "read_kured_locks", "snapshot_from"]


class ClusterUnavailable(Exception):
    """The cluster could not be read (or a lock could not be understood): guards fail closed."""


@dataclass(frozen=True)
class ClusterSnapshot:
    total_nodes: int
    unhealthy_nodes: tuple[str, ...]
    unhealthy_gpus: int
    excluded: Mapping[str, str] = field(default_factory=dict)  # node -> why (label)
    kured_locked: Mapping[str, str] = field(default_factory=dict)  # node -> lock description
    taken_at: float = 0.0

    def exclusion(self, node: str | None) -> str | None:
        """Why ``node`` must not be remediated by us now, or None."""
        if node is None:
            return None
        return self.excluded.get(node) or self.kured_locked.get(node)


class ClusterView(Protocol):
    def snapshot(self) -> ClusterSnapshot:
        """The current (possibly cached) snapshot; ``ClusterUnavailable`` when it cannot be read."""
        ...


@runtime_checkable
class RefreshingClusterView(Protocol):
    """A ``ClusterView`` that can keep its snapshot fresh in the background (``KubeClusterView``)."""

    def snapshot(self) -> ClusterSnapshot: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


def read_kured_locks(kube: KubeAPI, cfg: KuredConfig, now: float) -> dict[str, str]:
    """Kured's live locks (``engine.run_guards``); an unreadable lock is ``ClusterUnavailable``."""
    try:
        return run_guards.read_kured_locks(kube, cfg, now)
    except GuardUnreadable as e:
        raise ClusterUnavailable(str(e)) from e


def snapshot_from(nodes: list[NodeFacts], exclusions: ExclusionConfig,
                  kured: Mapping[str, str], now: float) -> ClusterSnapshot:
    sick, sick_gpus = unhealthy(nodes)
    excluded = {n.name: r for n in nodes if (r := exclusion_reason(n, exclusions.labels))}
    return ClusterSnapshot(
        total_nodes=len(nodes), unhealthy_nodes=tuple(sick),
        unhealthy_gpus=sick_gpus, excluded=excluded,
        kured_locked=dict(kured), taken_at=now)


class KubeClusterView:
    """A ``ClusterView`` over ``KubeAPI`` with a short cache (errors are cached for at most 1 s) and,
    once started, a background refresher every ``refresh`` seconds (0: none; default: half the TTL)."""

    def __init__(self, kube: Callable[[], KubeAPI], exclusions: ExclusionConfig, *, ttl: float = 5.0,
                 refresh: float | None = None, clock: Callable[[], float] = time.time) -> None:
        self._kube = kube
        self._exclusions = exclusions
        self._ttl = ttl
        self.refresh_interval = ttl / 2 if refresh is None else refresh
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: tuple[float, ClusterSnapshot | ClusterUnavailable] | None = None
        self._refresher = BackgroundLoop("runbook-serve-cluster", self.refresh, lambda: self.refresh_interval,
                                         at_start=True, log=log, what="cluster view: refresh")

    def _fresh(self, now: float) -> ClusterSnapshot | ClusterUnavailable | None:
        if self._cached is None:
            return None
        at, value = self._cached
        fresh = self._ttl if isinstance(value, ClusterSnapshot) else min(self._ttl, 1.0)
        return value if 0 <= now - at < fresh else None

    def _read(self, now: float) -> ClusterSnapshot | ClusterUnavailable:
        """One API round trip (nodes, then kured's lock); an error is returned, not raised."""
        try:
            kube = self._kube()
            nodes = kube.list_nodes()
            kured = read_kured_locks(kube, self._exclusions.kured, now)
            return snapshot_from(nodes, self._exclusions, kured, now)
        except ClusterUnavailable as e:
            return e
        except KubeError as e:
            return ClusterUnavailable(f"cannot read the cluster: {e}")
        except Exception as e:  # a connector that cannot even be built: fail closed
            return ClusterUnavailable(f"cannot read the cluster: {type(e).__name__}: {e}")

    def _store(self, at: float, result: ClusterSnapshot | ClusterUnavailable) -> None:
        if self._cached is None or self._cached[0] <= at:  # a slower, older read never wins
            self._cached = (at, result)

    def snapshot(self) -> ClusterSnapshot:
        with self._lock:  # one reader at a time: a storm waits for one API round trip
            now = self._clock()
            value = self._fresh(now)
            if value is None:
                value = self._read(now)
                self._store(now, value)
            if isinstance(value, ClusterUnavailable):
                raise ClusterUnavailable(str(value))
            return value

    def refresh(self) -> None:
        """Read the cluster now and cache the result (what the background thread does). The read is
        made without the lock, so pages are answered from the previous snapshot meanwhile."""
        now = self._clock()
        result = self._read(now)
        with self._lock:
            self._store(now, result)

    def start(self) -> None:
        """Start the daemon thread that reads at once (building the client and filling the cache
        before the first page, without delaying the server's start) and then every
        ``refresh_interval`` seconds (with 0: only the first read)."""
        self._refresher.start()

    def stop(self) -> None:
        self._refresher.stop()
