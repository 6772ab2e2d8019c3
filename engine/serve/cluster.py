"""What the guards need to know about the cluster, read through ``KubeAPI`` and cached briefly.

One snapshot holds: how many nodes are unhealthy (Ready is not True) and how many GPUs they carry
(``nvidia.com/gpu.count`` label, else ``nvidia.com/gpu`` capacity, else the sum of other
``nvidia.com/*`` capacities such as passthrough devices); which nodes carry an exclusion label
(ours ``runbook.io/exclude=true``, Medik8s' ``remediation.medik8s.io/exclude-from-remediation=true``);
and which nodes kured's reboot lock names (the ``weave.works/kured-node-lock`` annotation of the
kured DaemonSet, single or multi-owner form, with its TTL).

Reads only, never writes. An API error or an unreadable lock raises ``ClusterUnavailable``: the
caller fails closed. A snapshot is reused for ``cluster_cache_ttl`` seconds so an alert storm costs
one API round trip, not one per alert.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from engine.connectors.base import KubeAPI
from engine.errors import KubeError
from engine.facts import NodeFacts
from engine.serve.config import ExclusionConfig, KuredConfig


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


def _int(value: Any) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return 0


def gpu_count(node: NodeFacts) -> int:
    """GPUs a node carries, from GPU Feature Discovery's label or the advertised capacity."""
    label = _int(node.labels.get("nvidia.com/gpu.count"))
    if label:
        return label
    cap = _int(node.capacity.get("nvidia.com/gpu"))
    if cap:
        return cap
    return sum(_int(v) for k, v in node.capacity.items() if k.startswith("nvidia.com/"))


def exclusion_reason(node: NodeFacts, labels: Mapping[str, str]) -> str | None:
    for key, value in labels.items():
        actual = node.labels.get(key)
        if actual is not None and actual.strip().lower() == value.lower():
            return f"node {node.name} is excluded from remediation by label {key}={actual}"
    return None


def _parse_go_time(text: str) -> float:
    # Go writes RFC 3339 with up to 9 fractional digits; Python reads at most 6.
    if "." in text:
        head, _, tail = text.partition(".")
        digits = "".join(c for c in tail if c.isdigit())
        zone = tail[len(digits):]
        text = f"{head}.{digits[:6]}{zone}"
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def kured_locks(value: str, now: float) -> dict[str, str]:
    """Nodes named by a live kured lock annotation (single or multi-owner); ValueError if unreadable."""
    data = json.loads(value)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    entries = data.get("locks", [data])
    if not isinstance(entries, list):
        raise ValueError("'locks' is not a list")
    out: dict[str, str] = {}
    for entry in entries or ():
        node = entry.get("nodeID") if isinstance(entry, dict) else None
        if not isinstance(node, str) or not node:
            raise ValueError("a lock without nodeID")
        ttl_ns = _int(entry.get("TTL"))
        created = entry.get("created")
        if ttl_ns > 0 and isinstance(created, str) and now - _parse_go_time(created) >= ttl_ns / 1e9:
            continue  # expired: kured itself would take it over
        out[node] = f"kured holds its reboot lock for node {node} (since {created or 'unknown'})"
    return out


def read_kured_locks(kube: KubeAPI, cfg: KuredConfig, now: float) -> dict[str, str]:
    if not cfg.enabled:
        return {}
    for ds in kube.list_objects("apps/v1", "daemonsets", namespace=cfg.namespace):
        meta = ds.get("metadata") or {}
        if meta.get("name") != cfg.daemonset:
            continue
        value = (meta.get("annotations") or {}).get(cfg.annotation)
        if not value:
            return {}
        try:
            return kured_locks(value, now)
        except (ValueError, KeyError, TypeError) as e:
            raise ClusterUnavailable(
                f"cannot read kured's lock ({cfg.namespace}/{cfg.daemonset} {cfg.annotation}): {e}") from e
    return {}  # no kured installed: no lock


def snapshot_from(nodes: list[NodeFacts], exclusions: ExclusionConfig,
                  kured: Mapping[str, str], now: float) -> ClusterSnapshot:
    unhealthy = [n for n in nodes if not n.ready]
    excluded = {n.name: r for n in nodes if (r := exclusion_reason(n, exclusions.labels))}
    return ClusterSnapshot(
        total_nodes=len(nodes), unhealthy_nodes=tuple(sorted(n.name for n in unhealthy)),
        unhealthy_gpus=sum(gpu_count(n) for n in unhealthy), excluded=excluded,
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
