"""Node objects as a kubelet registers and reports them: labels, capacity, conditions, and the Lease.

``node_manifest`` is the Node a kubelet registered long ago (the lab creates it so); ``ready_status``
is what a running kubelet posts (conditions with heartbeat times, capacity and allocatable including
the device plugins' extended resources); ``lease_body`` is the kube-node-lease renewal. Pure.
"""

from __future__ import annotations

import zlib
from typing import Any

from engine.lab.scenario import Node, parse_size
from engine.lab.sim_kube import micro_time, rfc3339
from engine.lab.sim_kubevirt import SCHEDULABLE_LABEL

MANAGED_LABEL = "runbook.lab/managed"
KUBELET_VERSION = "v1.20.2"
LEASE_NAMESPACE = "kube-node-lease"
LEASE_SECONDS = 40
_CONDITIONS = (
    ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
    ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
    ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
    ("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
)


def base_resources(node: Node) -> dict[str, str]:
    return {"cpu": str(node.cpu), "memory": f"{parse_size(node.memory) // 1024}Ki", "pods": str(node.max_pods),
            "ephemeral-storage": "479597248Ki", "hugepages-1Gi": "0", "hugepages-2Mi": "0"}


def allocatable_of(capacity: dict[str, str]) -> dict[str, str]:
    out = dict(capacity)
    if "memory" in out:  # kubelet's eviction threshold (100Mi) is reserved
        out["memory"] = f"{max(int(out['memory'].removesuffix('Ki')) - 102400, 0)}Ki"
    return out


def node_labels(node: Node) -> dict[str, str]:
    labels = {"kubernetes.io/hostname": node.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
              "beta.kubernetes.io/os": "linux", "beta.kubernetes.io/arch": "amd64",
              "topology.kubernetes.io/zone": node.zone, MANAGED_LABEL: "true"}
    for role in node.roles:
        labels[f"node-role.kubernetes.io/{role}"] = ""
    if "control-plane" not in node.roles:
        labels[SCHEDULABLE_LABEL] = "true"
    labels.update(node.labels)
    return labels


def ready_status(node: Node, address: str, extended: dict[str, int], previous: dict[str, Any] | None,
                 now: float, boot_id: str = "") -> dict[str, Any]:
    """The status a running kubelet posts. Conditions keep their lastTransitionTime unless they change;
    extended resources once reported stay listed (as 0) when their plugin is gone, like kubelet does;
    ``nodeInfo.bootID`` is the host's boot id (a rebooted host's kubelet reports its new one)."""
    prev_conditions = {c["type"]: c for c in (previous or {}).get("conditions", [])}
    conditions = []
    for type_, status, reason, message in _CONDITIONS:
        old = prev_conditions.get(type_)
        ltt = old["lastTransitionTime"] if old and old.get("status") == status else rfc3339(now)
        conditions.append({"type": type_, "status": status, "reason": reason, "message": message,
                           "lastHeartbeatTime": rfc3339(now), "lastTransitionTime": ltt})
    capacity = base_resources(node)
    for name in (previous or {}).get("capacity", {}):
        if name.startswith("nvidia.com/"):
            capacity[name] = "0"
    capacity.update({name: str(count) for name, count in extended.items()})
    return {
        "conditions": conditions, "capacity": capacity, "allocatable": allocatable_of(capacity),
        "addresses": [{"type": "InternalIP", "address": address}, {"type": "Hostname", "address": node.name}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
        "nodeInfo": {"machineID": f"{zlib.crc32(node.name.encode()):08x}{len(node.name):024x}",
                     "systemUUID": "", "bootID": boot_id,
                     "kernelVersion": "6.1.0-28-amd64", "osImage": "Debian GNU/Linux 12 (bookworm)",
                     "containerRuntimeVersion": "containerd://1.7.24", "kubeletVersion": KUBELET_VERSION,
                     "kubeProxyVersion": KUBELET_VERSION, "operatingSystem": "linux", "architecture": "amd64"},
    }


def node_manifest(node: Node, address: str, extended: dict[str, int], now: float) -> dict[str, Any]:
    """The Node as registered (status Ready: the node lifecycle controller finds out on its own)."""
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": node.name, "labels": node_labels(node),
                     "annotations": {"node.alpha.kubernetes.io/ttl": "0",
                                     "volumes.kubernetes.io/controller-managed-attach-detach": "true"}},
        "spec": {"taints": [t.model_dump() for t in node.taints]} if node.taints else {},
        "status": ready_status(node, address, extended, None, now),
    }


def lease_body(node: str, now: float, uid: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": node, "namespace": LEASE_NAMESPACE, "labels": {MANAGED_LABEL: "true"}}
    if uid:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}]
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
            "spec": {"holderIdentity": node, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": micro_time(now)}}
