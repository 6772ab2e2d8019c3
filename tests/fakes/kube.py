"""The fake Kubernetes API (``KubeAPI``) for unit tests: one in-memory API server on fake time.

``make_node`` builds a node as the API shows it. ``FakeKube`` keeps nodes as ``NodeFacts``;
``patch_node`` applies merge and JSON patches (honouring ``test`` ops) and records every call;
``wait_for_node`` evaluates the predicate on the current state and, until the deadline, on every
scheduled change (a watch on fake time); ``wait_for_pods_gone`` likewise for evicted pods (which go
at once, or ``pods_linger`` seconds later). Objects (RemediationRuns, DaemonSets, any kind) have an
API server's semantics: resourceVersions, 409 on a stale one, a status subresource. Leases and Node
Events too. Every call is recorded in ``calls`` (``calls_to(method)`` counts them); ``fail`` scripts
one method's failures, ``error`` makes every call fail (the API server is unreachable).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from engine.connectors.base import LeaseRecord, NodeEvent, PodRef
from engine.errors import Conflict, KubeError, NotFound
from engine.facts import Condition, NodeFacts, Taint
from tests.fakes.clock import FakeClock, raise_scripted

GPU_COUNT_LABEL = "nvidia.com/gpu.count"  # the GPU Operator's; what the server's cluster view counts first


def make_node(name: str = "omen2", *, ready: bool = True, labels: Mapping[str, str] | None = None,
              taints: Sequence[Taint] = (), allocatable: Mapping[str, str] | None = None,
              unschedulable: bool = False, gpus: int = 0) -> NodeFacts:
    """A node as the API shows it; ``gpus`` > 0 adds the ``nvidia.com/gpu.count`` label."""
    all_labels = {**({GPU_COUNT_LABEL: str(gpus)} if gpus else {}), **dict(labels or {})}
    return NodeFacts(
        name=name,
        labels=MappingProxyType(all_labels),
        conditions=(Condition("Ready", "True" if ready else "False",
                              reason="KubeletReady" if ready else "KubeletNotReady"),),
        taints=tuple(taints),
        allocatable=MappingProxyType(dict(allocatable or {"cpu": "16", "memory": "64Gi"})),
        capacity=MappingProxyType(dict(allocatable or {"cpu": "16", "memory": "64Gi"})),
        unschedulable=unschedulable,
        resource_version="1",
    )


def _selected(labels: Mapping[str, str], selector: str | None) -> bool:
    """Whether ``labels`` match an equality label selector (``a=b,c=d``); no selector matches all."""
    wanted = dict(part.split("=", 1) for part in (selector or "").split(",") if "=" in part)
    return all(labels.get(k) == v for k, v in wanted.items())


class FakeKube:
    """``KubeAPI`` in memory (see the module docstring). ``objects``: the objects the API server
    holds at the start, by (api_version, plural), e.g. ``{("apps/v1", "daemonsets"): [kured]}``."""

    def __init__(self, nodes: Iterable[NodeFacts] = (), *, clock: FakeClock | None = None,
                 objects: Mapping[tuple[str, str], Iterable[Mapping[str, Any]]] | None = None) -> None:
        self.clock = clock or FakeClock()
        self.nodes: dict[str, NodeFacts] = {n.name: n for n in nodes}
        self.objects: dict[tuple[str, str], list[Mapping[str, Any]]] = {
            kind: [copy.deepcopy(dict(o)) for o in objs] for kind, objs in (objects or {}).items()}
        self.pods: list[PodRef] = []
        self.calls: list[tuple[str, Any]] = []
        self.patches: list[tuple[str, Any, str]] = []
        self.evicted: list[PodRef] = []
        self.deleted: list[PodRef] = []
        self.leases: dict[tuple[str, str], LeaseRecord] = {}
        self.events: list[NodeEvent] = []  # create_node_event; fail["create_node_event"] raises instead
        # api_version -> served plurals; an api_version not named here serves the kinds of ``objects``
        self.served: dict[str, set[str]] = {}
        self.fail: dict[str, Any] = {}  # method -> exception (every call) or list (one a call; None: passes)
        self.error: Exception | None = None  # every call raises it: the API server is unreachable
        self.on_patch: Callable[[str, Any], None] | None = None  # e.g. an operator that reverts a label
        self.eviction_api = "policy/v1"  # what eviction_version() discovers
        self.pods_linger = 0.0  # seconds an evicted/deleted pod stays (terminating) before it is gone
        # replace_object calls it with the body before checking it (a concurrent writer, for conflicts)
        self.before_write: Callable[[dict[str, Any]], None] | None = None
        self.writes: list[dict[str, Any]] = []  # every object replace_object wrote, in order
        self._lock = threading.Lock()

    def _request(self, method: str, args: Any = None, *, record: bool = True) -> None:
        """One API call: recorded in ``calls`` (``record``), then ``error`` or a scripted failure raises."""
        if record:
            self.calls.append((method, args))
        if self.error is not None:
            raise self.error
        raise_scripted(self.fail, method)

    def calls_to(self, method: str) -> int:
        """How many times ``method`` was called (e.g. ``list_nodes``: the cluster reads)."""
        return sum(1 for name, _ in list(self.calls) if name == method)

    # -- state helpers for tests --
    def set_node(self, node: NodeFacts) -> None:
        self.nodes[node.name] = node

    def set_ready(self, name: str, ready: bool) -> None:
        n = self.nodes[name]
        others = tuple(c for c in n.conditions if c.type != "Ready")
        ready_condition = Condition("Ready", "True" if ready else "False")
        self.nodes[name] = self._bump(replace(n, conditions=(*others, ready_condition)))

    def set_label(self, name: str, key: str, value: str | None) -> None:
        n = self.nodes[name]
        labels = dict(n.labels)
        if value is None:
            labels.pop(key, None)
        else:
            labels[key] = value
        self.nodes[name] = self._bump(n.with_labels(labels))

    def set_allocatable(self, name: str, resource: str, value: str) -> None:
        n = self.nodes[name]
        alloc = dict(n.allocatable)
        alloc[resource] = value
        self.nodes[name] = self._bump(replace(n, allocatable=MappingProxyType(alloc)))

    @staticmethod
    def _bump(n: NodeFacts) -> NodeFacts:
        rv = str(int(n.resource_version or "0") + 1)
        return replace(n, resource_version=rv)

    # -- KubeAPI --
    def read_node(self, name: str) -> NodeFacts | None:
        self._request("read_node", name)
        return self.nodes.get(name)

    def list_nodes(self, label_selector: str | None = None) -> list[NodeFacts]:
        self._request("list_nodes", label_selector)
        return [n for n in self.nodes.values() if _selected(n.labels, label_selector)]

    def patch_node(self, name: str, patch: Any, *, patch_type: str = "merge", dry_run: bool = False) -> NodeFacts:
        self._request("patch_node", (name, copy.deepcopy(patch), patch_type, dry_run))
        with self._lock:
            node = self.nodes.get(name)
            if node is None:
                raise NotFound(f"node {name} not found", status=404)
            new = self._apply(node, patch, patch_type)
            if not dry_run:
                self.patches.append((name, copy.deepcopy(patch), patch_type))
                self.nodes[name] = new
        if self.on_patch is not None and not dry_run:
            self.on_patch(name, patch)
        return self.nodes.get(name, new)

    def _apply(self, node: NodeFacts, patch: Any, patch_type: str) -> NodeFacts:
        if patch_type == "json":
            taints = list(node.taints)
            for op in patch:
                if op["op"] == "test":
                    if op["path"] == "/metadata/resourceVersion" and op["value"] != node.resource_version:
                        raise KubeError("the server rejected our request: test operation failed", status=422)
                    if op["path"] == "/spec/taints":
                        current = [dataclasses.asdict(t) for t in node.taints]
                        wanted = [{"key": t["key"], "effect": t["effect"], "value": t.get("value", "")}
                                  for t in op["value"]]
                        if current != wanted:
                            raise KubeError("test operation failed", status=422)
                elif op["path"] == "/spec/taints" and op["op"] in ("add", "replace"):
                    taints = [Taint(t["key"], t["effect"], t.get("value", "")) for t in op["value"]]
                elif op["path"] == "/spec/taints" and op["op"] == "remove":
                    taints = []
                else:
                    raise KubeError(f"fake: unsupported json patch op {op}", status=422)
            return self._bump(replace(node, taints=tuple(taints)))
        md = patch.get("metadata") or {}
        labels = dict(node.labels)
        annotations = dict(node.annotations)
        for target, section in ((labels, "labels"), (annotations, "annotations")):
            for k, v in (md.get(section) or {}).items():
                if v is None:
                    target.pop(k, None)
                else:
                    target[k] = str(v)
        spec = patch.get("spec") or {}
        unschedulable = bool(spec["unschedulable"]) if "unschedulable" in spec else node.unschedulable
        return self._bump(replace(node, labels=MappingProxyType(labels), annotations=MappingProxyType(annotations),
                                  unschedulable=unschedulable))

    def list_pods(self, *, node: str | None = None, label_selector: str | None = None,
                  namespace: str | None = None) -> list[PodRef]:
        self._request("list_pods", (node, label_selector, namespace))
        return [p for p in self.pods
                if (node is None or p.node == node) and (namespace is None or p.namespace == namespace)
                and _selected(p.labels, label_selector)]

    def evict_pod(self, pod: PodRef, *, dry_run: bool = False, grace_seconds: int | None = None) -> None:
        self._request("evict_pod", pod)
        if not dry_run:
            self._pod_goes(pod, self.evicted)

    def _pod_goes(self, pod: PodRef, record: list[PodRef]) -> None:
        """An evicted or deleted pod: recorded, and gone at once or ``pods_linger`` s later."""
        record.append(pod)
        if self.pods_linger:
            self.clock.after(self.pods_linger, lambda: self._remove_pod(pod))
        else:
            self._remove_pod(pod)

    def _remove_pod(self, pod: PodRef) -> None:
        if pod in self.pods:
            self.pods.remove(pod)

    def eviction_version(self) -> str:
        self._request("eviction_version", None)
        return self.eviction_api

    def wait_for_pods_gone(self, pods: Sequence[PodRef], timeout: float) -> list[PodRef]:
        """A watch on fake time: scheduled changes fire until none of ``pods`` is left or the deadline."""
        self._request("wait_for_pods_gone", ([p.key for p in pods], timeout))

        def left() -> list[PodRef]:
            return [p for p in pods if any(q.key == p.key and q.uid == p.uid for q in self.pods)]

        self.clock.until(lambda: not left(), timeout)
        return left()

    def delete_pod(self, pod: PodRef, *, dry_run: bool = False, grace_seconds: int | None = None) -> None:
        self._request("delete_pod", pod)
        if not dry_run:
            self._pod_goes(pod, self.deleted)

    def list_objects(self, api_version: str, kind_plural: str, *, namespace: str | None = None,
                     label_selector: str | None = None, cached: bool = False,
                     not_older_than: str | None = None) -> list[Mapping[str, Any]]:
        self._request("list_objects", (api_version, kind_plural, namespace, label_selector))
        objs = self.objects.get((api_version, kind_plural), [])
        if namespace:
            objs = [o for o in objs if (o.get("metadata") or {}).get("namespace") == namespace]
        return copy.deepcopy(objs)

    def served_resources(self, api_version: str) -> frozenset[str] | None:
        self._request("served_resources", api_version)
        if api_version in self.served:
            return frozenset(self.served[api_version])
        if api_version == "v1":
            return frozenset({"nodes", "pods"})
        kinds = {k for (v, k) in self.objects if v == api_version}
        return frozenset(kinds) if kinds else None

    def wait_for_node(self, name: str, predicate: Callable[[NodeFacts | None], bool],
                      timeout: float) -> tuple[bool, NodeFacts | None]:
        self._request("wait_for_node", (name, timeout))
        held = self.clock.until(lambda: predicate(self.nodes.get(name)), timeout)
        return held, self.nodes.get(name)

    # -- objects (the run store's RemediationRuns): an API server's semantics, in memory --
    def _find(self, api_version: str, kind_plural: str, namespace: str, name: str) -> tuple[int, Any]:
        objs = self.objects.setdefault((api_version, kind_plural), [])
        for i, o in enumerate(objs):
            meta = o.get("metadata") or {}
            if meta.get("namespace") == namespace and meta.get("name") == name:
                return i, o
        return -1, None

    def _next_rv(self) -> str:
        self._rv = getattr(self, "_rv", 100) + 1
        return str(self._rv)

    def read_object(self, api_version: str, kind_plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        self._request("read_object", (api_version, kind_plural, namespace, name))
        _, obj = self._find(api_version, kind_plural, namespace, name)
        return copy.deepcopy(dict(obj)) if obj is not None else None

    def create_object(self, api_version: str, kind_plural: str, namespace: str,
                      body: Mapping[str, Any]) -> dict[str, Any]:
        self._request("create_object", (api_version, kind_plural, namespace))
        obj = copy.deepcopy(dict(body))
        obj.pop("status", None)  # a status subresource: POST ignores the status
        name = obj["metadata"]["name"]
        with self._lock:
            if self._find(api_version, kind_plural, namespace, name)[1] is not None:
                raise Conflict(f"{kind_plural} {name!r} already exists", status=409)
            obj["metadata"].update({"namespace": namespace, "resourceVersion": self._next_rv(),
                                    "creationTimestamp": "2026-01-01T00:00:00Z"})
            self.objects.setdefault((api_version, kind_plural), []).append(obj)
        return copy.deepcopy(obj)

    def replace_object(self, api_version: str, kind_plural: str, namespace: str, body: Mapping[str, Any], *,
                       subresource: str | None = None) -> dict[str, Any]:
        self._request("replace_object", (api_version, kind_plural, namespace, subresource))
        if self.before_write is not None:
            self.before_write(dict(body))  # e.g. another writer getting there first
        name = body["metadata"]["name"]
        with self._lock:
            i, cur = self._find(api_version, kind_plural, namespace, name)
            if cur is None:
                raise NotFound(f"{kind_plural} {name!r} not found", status=404)
            rv = (body.get("metadata") or {}).get("resourceVersion")
            if rv and rv != cur["metadata"]["resourceVersion"]:
                raise Conflict(f"Operation cannot be fulfilled on {kind_plural} {name!r}: the object has been "
                               "modified; please apply your changes to the latest version and try again", status=409)
            new = copy.deepcopy(dict(cur))
            if subresource == "status":
                new["status"] = copy.deepcopy(body.get("status"))
            else:  # the main resource: spec and metadata (finalizers, annotations, labels); status is ignored
                new["spec"] = copy.deepcopy(body.get("spec"))
                for key in ("finalizers", "annotations", "labels"):
                    value = (body.get("metadata") or {}).get(key)
                    if value is None:
                        new["metadata"].pop(key, None)
                    else:
                        new["metadata"][key] = copy.deepcopy(value)
            new["metadata"]["resourceVersion"] = self._next_rv()
            self.objects[(api_version, kind_plural)][i] = new
            self.writes.append(copy.deepcopy(new))
        return copy.deepcopy(new)

    def delete_object(self, api_version: str, kind_plural: str, namespace: str, name: str, *,
                      resource_version: str | None = None) -> bool:
        self._request("delete_object", (api_version, kind_plural, namespace, name))
        with self._lock:
            i, cur = self._find(api_version, kind_plural, namespace, name)
            if cur is None:
                return False
            if resource_version and resource_version != cur["metadata"]["resourceVersion"]:
                raise Conflict(f"precondition failed for {name}", status=409)
            del self.objects[(api_version, kind_plural)][i]
        return True

    # -- leases --
    def read_lease(self, namespace: str, name: str) -> LeaseRecord | None:
        self._request("read_lease", record=False)
        return self.leases.get((namespace, name))

    def create_lease(self, namespace: str, name: str, holder: str, duration_seconds: int) -> LeaseRecord:
        self._request("create_lease", record=False)
        if (namespace, name) in self.leases:
            raise Conflict("lease exists", status=409)
        rec = LeaseRecord(namespace, name, holder, duration_seconds, self.clock.wall(), self.clock.wall(), "1")
        self.leases[(namespace, name)] = rec
        return rec

    def update_lease(self, lease: LeaseRecord, holder: str, duration_seconds: int, *, acquire: bool) -> LeaseRecord:
        self._request("update_lease", record=False)
        cur = self.leases.get((lease.namespace, lease.name))
        if cur is None or cur.resource_version != lease.resource_version:
            raise Conflict("stale lease", status=409)
        rec = replace(cur, holder=holder, duration_seconds=duration_seconds,
                      acquire_time=self.clock.wall() if acquire else cur.acquire_time, renew_time=self.clock.wall(),
                      resource_version=str(int(cur.resource_version) + 1),
                      transitions=cur.transitions + (1 if acquire and holder != cur.holder else 0))
        self.leases[(lease.namespace, lease.name)] = rec
        return rec

    def delete_lease(self, lease: LeaseRecord) -> None:
        self._request("delete_lease", record=False)
        self.leases.pop((lease.namespace, lease.name), None)

    # -- events --
    def create_node_event(self, event: NodeEvent) -> None:
        self._request("create_node_event", record=False)
        self.events.append(event)

