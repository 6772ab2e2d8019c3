"""Our own fake connectors for unit tests: in-memory Kubernetes and node hosts on a fake clock.

* ``FakeClock``: ``now()`` (monotonic), ``wall()`` (epoch), ``sleep(dt)`` advances time and fires
  scheduled changes (``clock.at(t, fn)``) — unit tests never really sleep.
* ``FakeKube`` (``KubeAPI``): nodes as ``NodeFacts``; ``patch_node`` applies merge and JSON patches
  (honouring ``test`` ops) and records every call; ``wait_for_node`` evaluates the predicate on the
  current state and, until the deadline, on every scheduled change (a watch on fake time);
  ``wait_for_pods_gone`` likewise for evicted pods (which go at once, or ``pods_linger`` seconds later).
* ``FakeNodes`` (``NodeAutomation``): scripted ``HostFacts`` per host; ``run_playbook`` records the
  run, applies a scripted effect (a function of the facts) and returns fresh facts like
  ``tasks/facts.yml`` does.
* ``install_gpu_host``: the shipped flagship's playbooks on a fake omen2, kubelet coming back by
  itself after swap-off or not, and vfio-manager killing the host's CUDA jobs when kubelet comes back
  before the relabel.

Failures are scripted with ``fail`` mappings (method name -> exception or list of exceptions).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from engine.approval_policy import Approval, ApprovalConfig, judge, refusal, rule_for
from engine.connectors.base import LeaseRecord, NodeEvent, PlaybookResult, PodRef, TaskEvent
from engine.errors import ApprovalRefused, Conflict, HostError, KubeError, NotFound, StalePlan, UsageError
from engine.facts import (
    Condition,
    CudaProcess,
    GpuDevice,
    HostFacts,
    NodeFacts,
    ServiceFacts,
    SwapDevice,
    Taint,
)
from engine.model import Plan, Trigger, is_node_name
from engine.serve.cluster import ClusterSnapshot, ClusterUnavailable, snapshot_from
from engine.serve.config import ExclusionConfig
from engine.serve.starter import RunOutcome, RunRequest, RunTicket, TriggerSpec


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self._scheduled: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    __call__ = now

    def wall(self) -> float:
        return 1_700_000_000.0 + self.t

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` when fake time reaches ``t`` (absolute)."""
        self._seq += 1
        self._scheduled.append((t, self._seq, fn))
        self._scheduled.sort(key=lambda x: (x[0], x[1]))
        self._fire()

    def after(self, dt: float, fn: Callable[[], None]) -> None:
        self.at(self.t + dt, fn)

    def next_event(self) -> float | None:
        return self._scheduled[0][0] if self._scheduled else None

    def advance_to(self, t: float) -> None:
        self.t = max(self.t, t)
        self._fire()

    def sleep(self, dt: float) -> None:
        self.sleeps.append(dt)
        self.advance_to(self.t + max(0.0, dt))

    def _fire(self) -> None:
        while self._scheduled and self._scheduled[0][0] <= self.t:
            _, _, fn = self._scheduled.pop(0)
            fn()


def _raise_scripted(fail: dict[str, Any], method: str) -> None:
    item = fail.get(method)
    if item is None:
        return
    if isinstance(item, list):
        if not item:
            return
        exc = item.pop(0)
        if exc is None:
            return
        raise exc
    raise item


# ------------------------------------------------------------------------------------------------
# Kubernetes
# ------------------------------------------------------------------------------------------------


def make_node(name: str = "omen2", *, ready: bool = True, labels: Mapping[str, str] | None = None,
              taints: Sequence[Taint] = (), allocatable: Mapping[str, str] | None = None,
              unschedulable: bool = False) -> NodeFacts:
    return NodeFacts(
        name=name,
        labels=MappingProxyType(dict(labels or {})),
        conditions=(Condition("Ready", "True" if ready else "False",
                              reason="KubeletReady" if ready else "KubeletNotReady"),),
        taints=tuple(taints),
        allocatable=MappingProxyType(dict(allocatable or {"cpu": "16", "memory": "64Gi"})),
        capacity=MappingProxyType(dict(allocatable or {"cpu": "16", "memory": "64Gi"})),
        unschedulable=unschedulable,
        resource_version="1",
    )


class FakeKube:
    def __init__(self, nodes: Sequence[NodeFacts] = (), *, clock: FakeClock | None = None) -> None:
        self.clock = clock or FakeClock()
        self.nodes: dict[str, NodeFacts] = {n.name: n for n in nodes}
        self.objects: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
        self.pods: list[PodRef] = []
        self.calls: list[tuple[str, Any]] = []
        self.patches: list[tuple[str, Any, str]] = []
        self.evicted: list[PodRef] = []
        self.deleted: list[PodRef] = []
        self.leases: dict[tuple[str, str], LeaseRecord] = {}
        self.events: list[NodeEvent] = []  # create_node_event; fail["create_node_event"] raises instead
        # api_version -> served plurals; an api_version not named here serves the kinds of ``objects``
        self.served: dict[str, set[str]] = {}
        self.fail: dict[str, Any] = {}
        self.on_patch: Callable[[str, Any], None] | None = None  # e.g. an operator that reverts a label
        self.eviction_api = "policy/v1"  # what eviction_version() discovers
        self.pods_linger = 0.0  # seconds an evicted/deleted pod stays (terminating) before it is gone
        # replace_object calls it with the body before checking it (a concurrent writer, for conflicts)
        self.before_write: Callable[[dict[str, Any]], None] | None = None
        self.writes: list[dict[str, Any]] = []  # every object replace_object wrote, in order
        self._lock = threading.Lock()

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
        self.calls.append(("read_node", name))
        _raise_scripted(self.fail, "read_node")
        return self.nodes.get(name)

    def list_nodes(self, label_selector: str | None = None) -> list[NodeFacts]:
        self.calls.append(("list_nodes", label_selector))
        _raise_scripted(self.fail, "list_nodes")
        nodes = list(self.nodes.values())
        if label_selector:
            wanted = dict(part.split("=", 1) for part in label_selector.split(",") if "=" in part)
            nodes = [n for n in nodes if all(n.labels.get(k) == v for k, v in wanted.items())]
        return nodes

    def patch_node(self, name: str, patch: Any, *, patch_type: str = "merge", dry_run: bool = False) -> NodeFacts:
        self.calls.append(("patch_node", (name, copy.deepcopy(patch), patch_type, dry_run)))
        _raise_scripted(self.fail, "patch_node")
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
        self.calls.append(("list_pods", (node, label_selector, namespace)))
        _raise_scripted(self.fail, "list_pods")
        pods = [p for p in self.pods
                if (node is None or p.node == node) and (namespace is None or p.namespace == namespace)]
        if label_selector:
            wanted = dict(part.split("=", 1) for part in label_selector.split(",") if "=" in part)
            pods = [p for p in pods if all(p.labels.get(k) == v for k, v in wanted.items())]
        return pods

    def evict_pod(self, pod: PodRef, *, dry_run: bool = False, grace_seconds: int | None = None) -> None:
        self.calls.append(("evict_pod", pod))
        _raise_scripted(self.fail, "evict_pod")
        if not dry_run:
            self.evicted.append(pod)
            if self.pods_linger:
                self.clock.after(self.pods_linger, lambda: self._remove_pod(pod))
            else:
                self._remove_pod(pod)

    def _remove_pod(self, pod: PodRef) -> None:
        if pod in self.pods:
            self.pods.remove(pod)

    def eviction_version(self) -> str:
        self.calls.append(("eviction_version", None))
        _raise_scripted(self.fail, "eviction_version")
        return self.eviction_api

    def wait_for_pods_gone(self, pods: Sequence[PodRef], timeout: float) -> list[PodRef]:
        """A watch on fake time: scheduled changes fire until none of ``pods`` is left or the deadline."""
        self.calls.append(("wait_for_pods_gone", ([p.key for p in pods], timeout)))
        _raise_scripted(self.fail, "wait_for_pods_gone")
        deadline = self.clock.now() + timeout
        while True:
            left = [p for p in pods if any(q.key == p.key and q.uid == p.uid for q in self.pods)]
            if not left:
                return []
            nxt = self.clock.next_event()
            if nxt is None or nxt > deadline:
                self.clock.advance_to(deadline)
                return left
            self.clock.advance_to(nxt)

    def delete_pod(self, pod: PodRef, *, dry_run: bool = False, grace_seconds: int | None = None) -> None:
        self.calls.append(("delete_pod", pod))
        _raise_scripted(self.fail, "delete_pod")
        if not dry_run:
            self.deleted.append(pod)
            if self.pods_linger:
                self.clock.after(self.pods_linger, lambda: self._remove_pod(pod))
            else:
                self._remove_pod(pod)

    def list_objects(self, api_version: str, kind_plural: str, *, namespace: str | None = None,
                     label_selector: str | None = None) -> list[Mapping[str, Any]]:
        self.calls.append(("list_objects", (api_version, kind_plural, namespace, label_selector)))
        _raise_scripted(self.fail, "list_objects")
        objs = self.objects.get((api_version, kind_plural), [])
        if namespace:
            objs = [o for o in objs if (o.get("metadata") or {}).get("namespace") == namespace]
        return copy.deepcopy(objs)

    def served_resources(self, api_version: str) -> frozenset[str] | None:
        self.calls.append(("served_resources", api_version))
        _raise_scripted(self.fail, "served_resources")
        if api_version in self.served:
            return frozenset(self.served[api_version])
        if api_version == "v1":
            return frozenset({"nodes", "pods"})
        kinds = {k for (v, k) in self.objects if v == api_version}
        return frozenset(kinds) if kinds else None

    def wait_for_node(self, name: str, predicate: Callable[[NodeFacts | None], bool],
                      timeout: float) -> tuple[bool, NodeFacts | None]:
        self.calls.append(("wait_for_node", (name, timeout)))
        _raise_scripted(self.fail, "wait_for_node")
        deadline = self.clock.now() + timeout
        while True:
            node = self.nodes.get(name)
            if predicate(node):
                return True, node
            nxt = self.clock.next_event()
            if nxt is None or nxt > deadline:
                self.clock.advance_to(deadline)
                return False, self.nodes.get(name)
            self.clock.advance_to(nxt)

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
        self.calls.append(("read_object", (api_version, kind_plural, namespace, name)))
        _raise_scripted(self.fail, "read_object")
        _, obj = self._find(api_version, kind_plural, namespace, name)
        return copy.deepcopy(dict(obj)) if obj is not None else None

    def create_object(self, api_version: str, kind_plural: str, namespace: str,
                      body: Mapping[str, Any]) -> dict[str, Any]:
        self.calls.append(("create_object", (api_version, kind_plural, namespace)))
        _raise_scripted(self.fail, "create_object")
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
        self.calls.append(("replace_object", (api_version, kind_plural, namespace, subresource)))
        _raise_scripted(self.fail, "replace_object")
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
        self.calls.append(("delete_object", (api_version, kind_plural, namespace, name)))
        _raise_scripted(self.fail, "delete_object")
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
        return self.leases.get((namespace, name))

    def create_lease(self, namespace: str, name: str, holder: str, duration_seconds: int) -> LeaseRecord:
        if (namespace, name) in self.leases:
            raise Conflict("lease exists", status=409)
        rec = LeaseRecord(namespace, name, holder, duration_seconds, self.clock.wall(), self.clock.wall(), "1")
        self.leases[(namespace, name)] = rec
        return rec

    def update_lease(self, lease: LeaseRecord, holder: str, duration_seconds: int, *, acquire: bool) -> LeaseRecord:
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
        self.leases.pop((lease.namespace, lease.name), None)

    # -- events --
    def create_node_event(self, event: NodeEvent) -> None:
        _raise_scripted(self.fail, "create_node_event")
        self.events.append(event)


# ------------------------------------------------------------------------------------------------
# Node hosts
# ------------------------------------------------------------------------------------------------


def make_host(name: str = "omen2", *, swap: bool = False, fstab_swap: bool = False, kubelet: str = "active",
              journal: str = "", driver: str = "nvidia", cuda: int = 0) -> HostFacts:
    return HostFacts(
        host=name,
        swap_devices=(SwapDevice("/swapfile", "file", 32 << 30),) if swap else (),
        fstab_active_swap=("/swapfile none swap sw 0 0",) if fstab_swap else (),
        services={"kubelet": ServiceFacts("kubelet", kubelet, journal_tail=journal)},
        gpus=(GpuDevice("01:00.0", "10de:2b85", "NVIDIA GB202 [GeForce RTX 5090]", driver),),
        cuda_processes=tuple(CudaProcess(1000 + i, "python") for i in range(cuda)),
    )


def quad_gpus() -> tuple[GpuDevice, ...]:
    """The GPUs of the lab's gpu-quad (engine/lab/scenarios/multi-gpu.yaml) after kubelet came back
    under container: two RTX 5090s (one left on vfio-pci), an RTX 3090, an RTX 4090 without a driver."""
    return (GpuDevice("01:00.0", "10de:2b85", "NVIDIA Corporation GB202 [GeForce RTX 5090]", "nvidia"),
            GpuDevice("02:00.0", "10de:2b85", "NVIDIA Corporation GB202 [GeForce RTX 5090]", "vfio-pci"),
            GpuDevice("41:00.0", "10de:2204", "NVIDIA Corporation GA102 [GeForce RTX 3090]", "nvidia"),
            GpuDevice("c1:00.0", "10de:2684", "NVIDIA Corporation AD102 [GeForce RTX 4090]", "none"))


PlaybookEffect = Callable[["FakeNodes", str, Mapping[str, Any]], PlaybookResult | None]


class FakeNodes:
    def __init__(self, hosts: Mapping[str, HostFacts | Exception] | None = None, *,
                 clock: FakeClock | None = None, inventory: Mapping[str, str] | None = None) -> None:
        self.clock = clock or FakeClock()
        self.hosts: dict[str, HostFacts | Exception] = dict(hosts or {})
        self.inventory = dict(inventory or {})  # node -> inventory host (default: same name)
        self.effects: dict[str, PlaybookEffect] = {}  # playbook file name -> effect
        self.runs: list[dict[str, Any]] = []
        self.gathers: list[tuple[list[str], list[str]]] = []
        self.files: dict[str, dict[str, str]] = {}  # host -> path -> content
        self.fail: dict[str, Any] = {}
        self.closed = False
        self.cancelled = False
        self.facts_become: bool | None = None  # facts do not depend on privilege

    def inventory_host(self, node: str) -> str:
        if node not in self.hosts and node not in self.inventory:
            raise HostError(f"node {node} is not in the inventory", host=node)
        return self.inventory.get(node, node)

    def set_facts(self, node: str, facts: HostFacts | Exception) -> None:
        self.hosts[node] = facts

    def update(self, node: str, **changes: Any) -> None:
        h = self.hosts[node]
        assert isinstance(h, HostFacts)
        self.hosts[node] = replace(h, **changes)

    def _facts(self, node: str, files: Sequence[str]) -> HostFacts | Exception:
        h = self.hosts.get(node)
        if h is None:
            return HostError(f"{node}: unreachable", host=node, unreachable=True)
        if isinstance(h, Exception):
            return h
        if files:
            from engine.facts import FileFacts

            have = self.files.get(node, {})
            found = {p: FileFacts(p, p in have, have.get(p, "")) for p in files}
            h = replace(h, files=found)
        return h

    def gather_facts(self, nodes: Sequence[str], files: Sequence[str] = ()) -> Mapping[str, HostFacts | Exception]:
        self.gathers.append((list(nodes), list(files)))
        _raise_scripted(self.fail, "gather_facts")
        return {n: self._facts(n, files) for n in nodes}

    def run_playbook(self, playbook: Path, nodes: Sequence[str], *, extravars: Mapping[str, Any] | None = None,
                     become: bool = True, timeout: float = 300, check: bool = False,
                     on_event: Callable[[TaskEvent], None] | None = None) -> PlaybookResult:
        evars = dict(extravars or {})
        self.runs.append({"playbook": Path(playbook).name, "path": Path(playbook), "nodes": list(nodes),
                          "extravars": evars, "become": become, "timeout": timeout, "check": check})
        _raise_scripted(self.fail, "run_playbook")
        effect = self.effects.get(Path(playbook).name)
        result: PlaybookResult | None = None
        for n in nodes:
            if on_event:
                on_event({"host": n, "task": f"{Path(playbook).stem}", "status": "changed", "msg": ""})
            if effect is not None and not check:
                result = effect(self, n, evars) or result
        if result is not None:
            return result
        files = list(evars.get("runbook_files") or [])
        facts = {n: f for n in nodes if isinstance(f := self._facts(n, files), HostFacts)}
        unreachable = {n: str(f) for n in nodes if isinstance(f := self._facts(n, files), Exception)}
        return PlaybookResult(status="successful" if not unreachable else "failed", rc=0 if not unreachable else 4,
                              changed=dict.fromkeys(facts, not check), unreachable_hosts=unreachable,
                              host_facts=facts)

    def recent_facts(self, nodes: Sequence[str], *, max_age: float,
                     files: Sequence[str] = ()) -> Mapping[str, tuple[HostFacts, float]]:
        return {}  # keeps none (subclasses in tests keep some)

    def cancel(self) -> None:
        self.cancelled = True

    def close(self) -> None:
        self.closed = True


class RecordingSink:
    """An EventSink keeping every event; ``fail_on`` makes emit raise for one kind (journal failure)."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.fail_on = fail_on

    def emit(self, kind: str, **data: Any) -> None:
        if kind == self.fail_on:
            raise OSError(f"journal unavailable (while recording {kind})")
        self.events.append((kind, data))

    def kinds(self, step: str | None = None) -> list[str]:
        return [k for k, d in self.events if step is None or d.get("step") == step]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [d for k, d in self.events if k == kind]


# ------------------------------------------------------------------------------------------------
# The omen2 incident, as facts and as scripted host behaviour
# ------------------------------------------------------------------------------------------------

GPU_LABEL = "nvidia.com/gpu.workload.config"
SWAP_REFUSAL = ('E0710 15:39:51 run.go:72] "command failed" err="failed to run Kubelet: running with swap on is '
                'not supported, please disable swap or set --fail-swap-on flag to false"')


def incident_node(name: str = "omen2") -> NodeFacts:
    return make_node(name, ready=False, labels={GPU_LABEL: "vm-passthrough"},
                     allocatable={"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "0"})


def incident_host(name: str = "omen2", cuda: int = 0) -> HostFacts:
    return make_host(name, swap=True, fstab_swap=True, kubelet="activating", journal=SWAP_REFUSAL, cuda=cuda)


def healthy_node(name: str = "omen2") -> NodeFacts:
    return make_node(name, ready=True, labels={GPU_LABEL: "container"},
                     allocatable={"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "1"})


def healthy_host(name: str = "omen2") -> HostFacts:
    return make_host(name, kubelet="active")


def install_recovery_effects(kube: FakeKube, nodes: FakeNodes, *, ready_after: float | None = 20.0,
                             gpu_after: float | None = 40.0) -> None:
    """swap-off.yml turns swap off; restart-kubelet.yml starts kubelet, and (on fake time) the node
    turns Ready ``ready_after`` s later and advertises its GPU ``gpu_after`` s later (None: never)."""

    def swap_off(fn: FakeNodes, node: str, _: Mapping[str, Any]) -> None:
        fn.update(node, swap_devices=(), fstab_active_swap=())

    def restart_kubelet(fn: FakeNodes, node: str, _: Mapping[str, Any]) -> None:
        h = fn.hosts[node]
        assert isinstance(h, HostFacts)
        if h.swap_active:
            return  # kubelet refuses again
        fn.update(node, services={"kubelet": ServiceFacts("kubelet", "active")})
        if ready_after is not None:
            fn.clock.after(ready_after, lambda: kube.set_ready(node, True))
        if gpu_after is not None:
            fn.clock.after(gpu_after, lambda: kube.set_allocatable(node, "nvidia.com/gpu", "1"))

    nodes.effects["swap-off.yml"] = swap_off
    nodes.effects["restart-kubelet.yml"] = restart_kubelet


# ------------------------------------------------------------------------------------------------
# The shipped flagship's host, with the behaviour its step order guards against
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class KubeletComeback:
    """One time kubelet came back on a fake GPU host: why, and the workload label at that moment."""

    cause: str  # "restart-kubelet.yml" or "auto-restart"
    label: str | None
    killed: tuple[int, ...]  # host CUDA pids vfio-manager killed then


@dataclasses.dataclass
class GpuHostLog:
    """What happened to a fake GPU host, seen from outside the engine, in order.

    ``effects``: ``label=<value>`` for each label PATCH (the API server's view), then the playbook
    names as they acted (the host's view); ``comebacks``: each time kubelet came back."""

    effects: list[str] = dataclasses.field(default_factory=list)
    comebacks: list[KubeletComeback] = dataclasses.field(default_factory=list)


def install_gpu_host(kube: FakeKube, nodes: FakeNodes, node: str = "omen2", *, auto_restart: bool,
                     ready_after: float = 5.0, gpu_after: float = 10.0,
                     stuck: frozenset[str] = frozenset()) -> GpuHostLog:
    """What the shipped gpu-node-recovery's playbooks do to a fake omen2, and what the GPU Operator does next.

    * ``swap-off.yml``: swap off, fstab's swap entry commented out. With ``auto_restart`` kubelet's
      own ``Restart=always`` brings it back at once (a real node's systemd; the lab's); without it
      kubelet stays down (``systemctl stop kubelet``) until ``restart-kubelet.yml``.
    * ``restart-kubelet.yml``: kubelet comes back unless swap is still on (it refuses again).
    * Whenever kubelet comes back while the node's workload label is not ``container``, vfio-manager
      rebinds every GPU to vfio-pci and kills every host CUDA job on them (the incident's danger); the
      node then never advertises nvidia.com/gpu. Otherwise a GPU left on vfio-pci loses its driver
      (vfio-manager's preStop; no job dies: none runs on it), the node turns Ready ``ready_after`` s
      later and advertises its GPUs on nvidia ``gpu_after`` s later (fake time; 0: at once).
    * ``gpu-bind-driver.yml``: binds every GPU that is not on nvidia to nvidia, except the slots in
      ``stuck`` (a GPU the driver does not take: the playbook reports no error, the GPU stays put).

    Returns the log, appended to as things happen (tests assert it, not only the run's outcome).
    """
    log = GpuHostLog()

    def label_patched(name: str, patch: Any) -> None:
        labels = ((patch.get("metadata") or {}).get("labels") or {}) if isinstance(patch, dict) else {}
        if name == node and GPU_LABEL in labels:
            log.effects.append(f"label={labels[GPU_LABEL]}")

    def come_back(fn: FakeNodes, cause: str) -> None:
        h = fn.hosts[node]
        assert isinstance(h, HostFacts)
        label = kube.nodes[node].labels.get(GPU_LABEL) if node in kube.nodes else None
        killed: tuple[int, ...] = ()
        changes: dict[str, Any] = {"services": {**h.services, "kubelet": ServiceFacts("kubelet", "active")}}
        if label != "container":
            killed = tuple(p.pid for p in h.cuda_processes)
            changes.update(cuda_processes=(), gpus=tuple(replace(g, driver="vfio-pci") for g in h.gpus))
        else:
            changes.update(gpus=tuple(replace(g, driver="none") if g.driver == "vfio-pci" else g for g in h.gpus))
        fn.update(node, **changes)
        log.comebacks.append(KubeletComeback(cause, label, killed))
        fn.clock.after(ready_after, lambda: kube.set_ready(node, True))

        def advertise() -> None:
            now = fn.hosts[node]
            assert isinstance(now, HostFacts)
            kube.set_allocatable(node, "nvidia.com/gpu", str(len(now.gpus) - len(now.gpus_not_on("nvidia"))))

        if not killed:
            fn.clock.after(gpu_after, advertise)

    def swap_off(fn: FakeNodes, host: str, _: Mapping[str, Any]) -> None:
        log.effects.append("swap-off.yml")
        fn.update(host, swap_devices=(), fstab_active_swap=())
        if auto_restart:
            come_back(fn, "auto-restart")

    def restart_kubelet(fn: FakeNodes, host: str, _: Mapping[str, Any]) -> None:
        log.effects.append("restart-kubelet.yml")
        h = fn.hosts[host]
        assert isinstance(h, HostFacts)
        if not h.swap_active:
            come_back(fn, "restart-kubelet.yml")

    def bind_gpus(fn: FakeNodes, host: str, evars: Mapping[str, Any]) -> None:
        log.effects.append("gpu-bind-driver.yml")
        h = fn.hosts[host]
        assert isinstance(h, HostFacts)
        driver = str(evars.get("driver", "nvidia"))
        fn.update(host, gpus=tuple(g if g.slot in stuck else replace(g, driver=driver) for g in h.gpus))

    kube.on_patch = label_patched
    nodes.effects["swap-off.yml"] = swap_off
    nodes.effects["restart-kubelet.yml"] = restart_kubelet
    nodes.effects["gpu-bind-driver.yml"] = bind_gpus
    return log


# ------------------------------------------------------------------------------------------------
# runbook serve without the run machinery or a cluster (was tests/fakes.py: test doubles
# are not shipped in the package). ``FakeRunStarter`` keeps runs in memory and behaves as the
# ``RunStarter`` contract says (states, digests, ``StalePlan`` / ``UsageError``);
# ``StaticClusterView`` serves a fixed list of nodes and kured locks; ``ClusterKube`` is the slice of
# ``KubeAPI`` that ``KubeClusterView`` reads; ``cluster_node`` a node as the server's cluster view
# sees it. Nothing here does I/O.
# ------------------------------------------------------------------------------------------------

DIGEST = "a" * 64


def cluster_node(name: str, *, ready: bool = True, gpus: int = 1, labels: Mapping[str, str] | None = None) -> NodeFacts:
    """A node as the API shows it: Ready True/Unknown, ``nvidia.com/gpu.count`` = ``gpus``."""
    all_labels = {"kubernetes.io/hostname": name, **({"nvidia.com/gpu.count": str(gpus)} if gpus else {}),
                  **dict(labels or {})}
    cond = Condition("Ready", "True" if ready else "Unknown",
                     "KubeletReady" if ready else "NodeStatusUnknown")
    return NodeFacts(name=name, labels=MappingProxyType(all_labels), conditions=(cond,))


FSTAB_DIFF = """--- before: /etc/fstab
+++ after: /etc/fstab
@@ -8,3 +8,3 @@
 UUID=4f1c-root / ext4 defaults 0 1
-/swap.img none swap sw 0 0
+#/swap.img none swap sw 0 0  # disabled by runbook (kubelet needs swap off)
 tmpfs /run/user tmpfs defaults 0 0
"""


def saved_plan(node: str = "omen2", *, expires_in: float = 3600.0) -> Plan:
    """A sealed gpu-node-recovery plan as ``runbook plan --out`` saves it (two steps, the fstab diff)."""
    now = time.time()

    def iso(t: float) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))

    return Plan.model_validate({
        "runbook": "gpu-node-recovery", "version": "3", "runbook_digest": "b" * 64,
        "params": {"node": node}, "node": node, "inventory_host": node,
        "created_at": iso(now), "expires_at": iso(now + expires_in), "state": "ready",
        "preconditions": [{"id": "swap-is-the-cause", "applies": True, "holds": True,
                           "observed": "kubelet: running with swap on is not supported",
                           "evidence": {"swap_total_bytes": 2147483648}}],
        "steps": [
            {"id": "swap-off", "why": "kubelet refuses to start while swap is on", "kind": "change",
             "action": "ansible", "summary": "comment the swap line out of /etc/fstab, swapoff -a",
             "command": f"ansible-playbook -i INVENTORY -l {node} playbooks/disable-swap.yml",
             "guards": [{"check": "host reachable", "holds": True, "observed": "ssh ok"}],
             "verify": [{"check": "host swap_total_bytes == 0", "timeout_seconds": 60}],
             "preview": FSTAB_DIFF, "mutating": True},
            {"id": "restart-kubelet", "why": "pick up the fixed configuration", "kind": "change",
             "action": "ansible", "summary": "systemctl restart kubelet",
             "command": f"ansible-playbook -i INVENTORY -l {node} playbooks/restart-kubelet.yml",
             "verify": [{"check": "node Ready", "timeout_seconds": 300}], "mutating": True},
        ]}).sealed()


def trigger_spec(runbook: str = "gpu-node-recovery", *, mode: str = "approve",
                 alert: str | tuple[str, ...] = ("KubeNodeNotReady", "KubeNodeUnreachable"),
                 matchers: tuple[str, ...] = (), params: Mapping[str, str] | None = None,
                 pagerduty: Mapping[str, Any] | None = None, require_diagnosis: bool = False) -> TriggerSpec:
    trig = Trigger.model_validate({
        "alert": alert, "matchers": matchers, "mode": mode, "require_diagnosis": require_diagnosis,
        "params": dict(params if params is not None else {"node": "{{ labels.node }}"}),
        **({"pagerduty": dict(pagerduty)} if pagerduty else {})})
    return TriggerSpec(runbook=runbook, trigger=trig, node_param="node")


class FakeRunStarter:
    """In-memory runs. ``outcome(run)`` decides how an executed run ends (default: succeeded)."""

    def __init__(self, triggers: Sequence[TriggerSpec] = (), *,
                 outcome: Callable[[Mapping[str, Any]], str] | None = None,
                 execute_delay: float = 0.0, submit_delay: float = 0.0, recover_ids: Iterable[str] = (),
                 preload: Iterable[Mapping[str, Any]] = (),
                 plan: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
                 approvals: ApprovalConfig | None = None) -> None:
        self.triggers = list(triggers)
        self.approvals = approvals or ApprovalConfig()  # the approval policy, judged like the real starter
        self._approvals: dict[str, list[Approval]] = {}
        self.plan = plan  # the plan (a Plan's JSON shape) a run waiting for approval shows; digest from it
        self.outcome = outcome or (lambda run: "succeeded")
        self.execute_delay = execute_delay
        self.submit_delay = submit_delay
        self.requests: list[RunRequest] = []
        self.previews: list[tuple[str, dict[str, str], str]] = []  # preview() calls: nothing recorded
        self.executed: list[str] = []
        self.cancels: list[tuple[str, str]] = []  # cancel() calls
        self._runs: dict[str, dict[str, Any]] = {dict(r)["id"]: dict(r) for r in preload}
        self._recover = list(recover_ids)
        self._ids = itertools.count(1)
        self._cond = threading.Condition()

    # -- RunStarter ---------------------------------------------------------------------------------

    def trigger_index(self) -> Sequence[TriggerSpec]:
        return list(self.triggers)

    def submit(self, request: RunRequest) -> RunTicket:
        if self.submit_delay:
            time.sleep(self.submit_delay)
        known = {t.runbook for t in self.triggers}
        if known and request.runbook not in known:
            raise UsageError(f"unknown runbook {request.runbook!r}")
        node = request.params.get("node") or request.node
        if not isinstance(node, str) or not is_node_name(node):
            raise UsageError(f"param node: {node!r} is not a valid node name")
        with self._cond:
            run_id = f"r-fake-{next(self._ids):04d}"
            self.requests.append(request)
            self._runs[run_id] = {
                "id": run_id, "runbook": request.runbook, "params": dict(request.params),
                "nodes": [node], "state": "pending", "source": request.source, "plan_digest": None,
                "approval_required": request.mode == "approve", "approved_by": None,
                "warnings": list(request.warnings), "reason": request.reason,
                "dedup_key": request.dedup_key, "requested_by": request.requested_by or request.source,
                "require_diagnosis": request.require_diagnosis,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()), "finished": None,
                "exit_code": None}
            self._cond.notify_all()
        return RunTicket(run_id, "pending")

    def execute(self, run_id: str) -> RunOutcome:
        if self.execute_delay:
            time.sleep(self.execute_delay)
        with self._cond:
            run = self._runs[run_id]
            self.executed.append(run_id)
            if run["state"] in ("succeeded", "failed", "blocked", "cancelled"):
                return RunOutcome(run_id, run["state"], run["plan_digest"], run["exit_code"])
            if run["approval_required"] and not run["approved_by"]:
                run["state"], run["plan_digest"] = "waiting-approval", DIGEST
                if self.plan is not None:
                    run["plan"] = dict(self.plan(run))
                    run["plan_digest"] = run["plan"].get("digest") or DIGEST
                self._cond.notify_all()
                return RunOutcome(run_id, "waiting-approval", DIGEST)
        state = self.outcome(run)
        with self._cond:
            run["state"] = state
            run["exit_code"] = {"succeeded": 0, "failed": 1, "blocked": 3}.get(state, 1)
            run["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
            self._cond.notify_all()
        return RunOutcome(run_id, state, run["plan_digest"], run["exit_code"],
                          reason=f"fake run {state}")

    def require_approval(self, run_id: str, reason: str) -> None:
        with self._cond:
            run = self._runs[run_id]
            run["approval_required"] = True
            run.setdefault("escalations", []).append(reason)

    def approve(self, run_id: str, plan_digest: str, approved_by: str, *,
                roles: frozenset[str] = frozenset()) -> Mapping[str, Any]:
        with self._cond:
            run = self._runs.get(run_id)
            if run is None:
                raise UsageError(f"unknown run id {run_id!r}")
            if run["plan_digest"] is None or plan_digest != run["plan_digest"]:
                raise StalePlan(f"run {run_id}: approval names plan {plan_digest!r}, but the run's plan is "
                                f"{run['plan_digest']!r}")
            if run["state"] != "waiting-approval":
                raise StalePlan(f"run {run_id} is {run['state']}, not waiting for approval")
            rule = rule_for(self.approvals, run["runbook"], {})
            earlier = self._approvals.setdefault(run_id, [])
            new = Approval(approved_by, plan_digest, roles)
            why = refusal(rule, new, requester=run.get("requested_by"), earlier=earlier)
            if why is not None:
                raise ApprovalRefused(f"run {run_id}: {why}")
            earlier.append(new)
            status = judge(rule, earlier, plan_digest, requester=run.get("requested_by"))
            run["approvals"] = status.as_dict()
            if status.satisfied:
                run["approved_by"] = ", ".join(status.approvers)
            return dict(run)

    def reject(self, run_id: str, reason: str, rejected_by: str) -> Mapping[str, Any]:
        with self._cond:
            run = self._runs.get(run_id)
            if run is None:
                raise UsageError(f"unknown run id {run_id!r}")
            if run["state"] != "waiting-approval":
                raise StalePlan(f"run {run_id} is {run['state']}, not waiting for approval")
            run.update(state="cancelled", exit_code=4, rejected_by=rejected_by, rejected_reason=reason,
                       finished=time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()))
            run.setdefault("events", []).append({"kind": "approval.rejected", "by": rejected_by, "reason": reason})
            self._cond.notify_all()
            return dict(run)

    def runs(self, limit: int = 100) -> Sequence[Mapping[str, Any]]:
        with self._cond:
            return [dict(r) for r in reversed(list(self._runs.values()))][:limit]

    def run(self, run_id: str) -> Mapping[str, Any]:
        with self._cond:
            if run_id not in self._runs:
                raise UsageError(f"unknown run id {run_id!r}")
            return dict(self._runs[run_id])

    def record_event(self, run_id: str, kind: str, data: Mapping[str, Any]) -> None:
        with self._cond:
            if run_id not in self._runs:
                raise UsageError(f"unknown run id {run_id!r}")
            self._runs[run_id].setdefault("events", []).append({"kind": kind, **dict(data)})
            self._cond.notify_all()

    def cancel(self, run_id: str, reason: str) -> str:
        """A pending, waiting or running fake run ends ``cancelled`` at once (``cancels`` records it)."""
        with self._cond:
            run = self._runs.get(run_id)
            if run is None:
                raise UsageError(f"unknown run id {run_id!r}")
            self.cancels.append((run_id, reason))
            if run["state"] in ("succeeded", "failed", "blocked", "cancelled", "interrupted"):
                return str(run["state"])
            run.update(state="cancelled", exit_code=4, finished=time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()))
            run.setdefault("events", []).append({"kind": "run.cancelled", "reason": reason})
            self._cond.notify_all()
            return "cancelled"

    def prune(self, keep: int, max_age: float | None) -> Sequence[str]:
        """Finished runs beyond the ``keep`` newest (the fake keeps no finish times: ``max_age`` unused)."""
        with self._cond:
            finished = [r for r in reversed(list(self._runs.values()))
                        if r["state"] in ("succeeded", "failed", "blocked", "cancelled")]
            gone = [r["id"] for r in finished[keep:]]
            for run_id in gone:
                del self._runs[run_id]
            return gone

    def recover(self) -> Sequence[str]:
        return list(self._recover)

    def runbook_names(self) -> Sequence[str]:
        return sorted({t.runbook for t in self.triggers})

    def preview(self, runbook: str, params: Mapping[str, str], node: str) -> Mapping[str, Any]:
        if runbook not in self.runbook_names():
            raise UsageError(f"no runbook named {runbook!r}")
        if not is_node_name(node):
            raise UsageError(f"param node: {node!r} is not a valid node name")
        with self._cond:
            self.previews.append((runbook, dict(params), node))
        if self.plan is None:
            return {"format": "runbook-plan/v1", "runbook": runbook, "node": node, "state": "ready",
                    "params": {**params, "node": node}, "digest": DIGEST, "steps": []}
        return dict(self.plan({"id": f"preview-{len(self.previews)}", "runbook": runbook,
                               "params": {**params, "node": node}}))

    # -- test helpers ---------------------------------------------------------------------------------

    def wait_until(self, predicate: Callable[[FakeRunStarter], bool], timeout: float = 5.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout)

    def replan(self, run_id: str, digest: str) -> None:
        """The run's plan changed (as when facts moved): approvals naming the old digest are stale."""
        with self._cond:
            self._runs[run_id]["plan_digest"] = digest
            if isinstance(self._runs[run_id].get("plan"), dict):
                self._runs[run_id]["plan"]["digest"] = digest
            self._cond.notify_all()

    def set_state(self, run_id: str, state: str) -> None:
        with self._cond:
            self._runs[run_id]["state"] = state
            self._cond.notify_all()


class FakeLeadership:
    """A leadership that tests set or flip by hand (the real one is ``engine.serve.leader.LeaderElector``)."""

    def __init__(self, leading: bool = False) -> None:
        self.leading = leading
        self.on_change: Any = None

    def is_leader(self) -> bool:
        return self.leading

    def describe(self) -> dict[str, Any]:
        return {"role": "leader" if self.leading else "follower"}

    def try_once(self) -> bool:
        return self.leading

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def win(self) -> None:
        self.leading = True
        self.on_change(True)


class StaticClusterView:
    """A ``ClusterView`` over a fixed (mutable) list of nodes; ``fail`` makes it unreadable."""

    def __init__(self, nodes: Iterable[NodeFacts] = (), *, kured: Mapping[str, str] | None = None,
                 exclusions: ExclusionConfig | None = None) -> None:
        self.nodes = list(nodes)
        self.kured = dict(kured or {})
        self.exclusions = exclusions or ExclusionConfig()
        self.fail: str | None = None
        self.reads = 0

    def snapshot(self) -> ClusterSnapshot:
        self.reads += 1
        if self.fail:
            raise ClusterUnavailable(self.fail)
        return snapshot_from(self.nodes, self.exclusions, self.kured, time.time())


class ClusterKube:
    """Only ``list_nodes`` and ``list_objects`` of ``KubeAPI`` (what ``KubeClusterView`` reads), from memory;
    ``error`` makes them raise, ``calls`` counts the node reads."""

    def __init__(self, nodes: Iterable[NodeFacts] = (), daemonsets: Iterable[Mapping[str, Any]] = ()) -> None:
        self.nodes = list(nodes)
        self.daemonsets = list(daemonsets)
        self.error: Exception | None = None
        self.calls = 0

    def list_nodes(self, label_selector: str | None = None) -> list[NodeFacts]:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return list(self.nodes)

    def list_objects(self, api_version: str, kind_plural: str, *, namespace: str | None = None,
                     label_selector: str | None = None) -> list[Mapping[str, Any]]:
        if self.error is not None:
            raise self.error
        if (api_version, kind_plural) != ("apps/v1", "daemonsets"):
            return []
        return [d for d in self.daemonsets
                if namespace is None or (d.get("metadata") or {}).get("namespace") == namespace]


def alert(node: str, *, alertname: str = "KubeNodeNotReady", status: str = "firing",
          fingerprint: str | None = None, **labels: str) -> dict[str, Any]:
    """One alert of an Alertmanager v4 webhook, as Alertmanager 0.25 sends it."""
    return {
        "status": status,
        "labels": {"alertname": alertname, "node": node, "condition": "Ready", "status": "true",
                   "severity": "warning", **labels},
        "annotations": {"summary": f"{node} has been unready for more than 15 minutes."},
        "startsAt": "2026-07-10T15:39:51.000Z",
        "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else "2026-07-10T16:39:51.000Z",
        "generatorURL": "http://prometheus.example/graph?g0.expr=kube_node_status_condition",
        "fingerprint": fingerprint if fingerprint is not None else f"fp-{alertname}-{node}",
    }


def webhook(*alerts: Mapping[str, Any], status: str | None = None) -> dict[str, Any]:
    """An Alertmanager v4 webhook body around ``alerts``."""
    firing = any(a.get("status") == "firing" for a in alerts)
    return {
        "receiver": "runbook", "status": status or ("firing" if firing else "resolved"),
        "alerts": list(alerts), "groupLabels": {"alertname": "KubeNodeNotReady"},
        "commonLabels": {"alertname": "KubeNodeNotReady"}, "commonAnnotations": {},
        "externalURL": "http://alertmanager.example", "version": "4",
        "groupKey": '{}:{alertname="KubeNodeNotReady"}', "truncatedAlerts": 0,
    }


TOKEN = "t0k3n-for-tests-sender"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
APPROVER_TOKEN = "t0k3n-for-tests-alice"  # approver "alice"
APPROVE = {"Authorization": f"Bearer {APPROVER_TOKEN}"}
READER_TOKEN = "t0k3n-for-tests-reader"  # reader "grafana"
READ = {"Authorization": f"Bearer {READER_TOKEN}"}
INCIDENT_NODES = tuple(cluster_node(f"omen{i}") for i in range(1, 9))


class Served:
    """A served app (Starlette TestClient, lifespan run) with its fakes and captured notifications."""

    def __init__(self, client: Any, starter: FakeRunStarter, cluster: StaticClusterView,
                 sent: list[dict[str, Any]]) -> None:
        self.client, self.starter, self.cluster, self.sent = client, starter, cluster, sent

    @property
    def dispatcher(self) -> Any:
        return self.client.app.state.dispatcher

    def post_alerts(self, *alerts: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> Any:
        return self.client.post("/hooks/alertmanager", json=webhook(*alerts),
                                headers=dict(AUTH if headers is None else headers))

    def idle(self, timeout: float = 5.0) -> None:
        """Wait until every queued run was executed and every notification attempted."""
        assert self.dispatcher.worker.wait_idle(timeout), "runs still executing"
        assert self.dispatcher.notifier.flush(timeout), "notifications still queued"

    def events(self) -> list[str]:
        return [m["runbook_event"]["event"] for m in self.sent]


@contextmanager
def served(mode: str = "auto", *, token: str | None = TOKEN, nodes: Iterable[NodeFacts] | None = None,
           starter: FakeRunStarter | None = None, env: Mapping[str, str] | None = None,
           clock: Callable[[], float] = time.time, notify_from_config: bool = False,
           identity: Any = None, elector: Any = None, sweep_interval: float = 0, **cfg: Any) -> Iterator[Served]:
    """The app over fakes: trigger KubeNodeNotReady/Unreachable on ``node=~"omen.*"`` in ``mode``;
    eight healthy nodes omen1..omen8 unless ``nodes``; ``cfg`` overrides the configuration. The
    sender's token is ``token`` (``AUTH``), approver ``alice`` has ``APPROVE``, reader ``grafana``
    has ``READ``; the TestClient's Host ``testserver`` is allowed. ``notify_from_config``: the
    configuration's ``notify:`` section sends the notifications (real HTTP), not the capture.
    ``identity``: a ``KubeIdentity``: ``auth.mode: kubernetes``, no approver or reader credential.
    ``elector``: a ``LeaderElector`` (replicas); ``sweep_interval`` 0: no sweeper thread."""
    import httpx
    from starlette.testclient import TestClient

    from engine.serve.app import create_app
    from engine.serve.config import load_config
    from engine.serve.notify import Notifier

    sent: list[dict[str, Any]] = []

    def receive(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200)

    roles = {} if identity is not None else {"RUNBOOK_APPROVER_TOKEN_ALICE": APPROVER_TOKEN,
                                             "RUNBOOK_READER_TOKEN_GRAFANA": READER_TOKEN}
    environ = {**({"RUNBOOK_WEBHOOK_TOKEN": token} if token else {}), **roles, **dict(env or {})}
    auth = {"allowed_hosts": ["testserver"], **({"mode": "kubernetes"} if identity is not None else {}),
            **dict(cfg.pop("auth", None) or {})}
    config = load_config(None, env=environ, overrides={**cfg, "auth": auth})
    starter = starter or FakeRunStarter([trigger_spec(mode=mode, matchers=('node=~"omen.*"',))])
    cluster = StaticClusterView(INCIDENT_NODES if nodes is None else nodes)
    notifier = None if notify_from_config else Notifier("http://127.0.0.1:9/notify",
                                                        transport=httpx.MockTransport(receive))
    app = create_app(config, starter, cluster=cluster, notifier=notifier, sweep_interval=sweep_interval,
                     clock=clock, identity=identity, elector=elector)
    with TestClient(app) as client:
        yield Served(client, starter, cluster, sent)
