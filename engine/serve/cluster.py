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
one API round trip, not one per alert.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

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

__all__ = ["ClusterSnapshot", "ClusterUnavailable", "ClusterView", "KubeClusterView", "gpu_count",
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
    """A ``ClusterView`` over ``KubeAPI`` with a short cache (errors are cached for at most 1 s)."""

    def __init__(self, kube: Callable[[], KubeAPI], exclusions: ExclusionConfig, *, ttl: float = 5.0,
                 clock: Callable[[], float] = time.time) -> None:
        self._kube = kube
        self._exclusions = exclusions
        self._ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: tuple[float, ClusterSnapshot | ClusterUnavailable] | None = None

    def snapshot(self) -> ClusterSnapshot:
        with self._lock:  # one reader at a time: a storm waits for one API round trip
            now = self._clock()
            if self._cached is not None:
                at, value = self._cached
                fresh = self._ttl if isinstance(value, ClusterSnapshot) else min(self._ttl, 1.0)
                if now - at < fresh:
                    if isinstance(value, ClusterUnavailable):
                        raise ClusterUnavailable(str(value))
                    return value
            try:
                kube = self._kube()
                nodes = kube.list_nodes()
                kured = read_kured_locks(kube, self._exclusions.kured, now)
                result: ClusterSnapshot | ClusterUnavailable = snapshot_from(
                    nodes, self._exclusions, kured, now)
            except ClusterUnavailable as e:
                result = e
            except KubeError as e:
                result = ClusterUnavailable(f"cannot read the cluster: {e}")
            except Exception as e:  # a connector that cannot even be built: fail closed
                result = ClusterUnavailable(f"cannot read the cluster: {type(e).__name__}: {e}")
            self._cached = (now, result)
            if isinstance(result, ClusterUnavailable):
                raise result
            return result
