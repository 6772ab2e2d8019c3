"""NFD, GPU Feature Discovery and the NVIDIA GPU Operator, as gpu-node-facts.md describes them.

* NFD: ``feature.node.kubernetes.io/pci-10de.present`` on nodes with NVIDIA PCI devices, set once
  nfd-worker has run there. It outlives a kubelet outage (nfd-master keeps the last NodeFeature), so
  the operator keeps reconciling NotReady nodes.
* GFD: ``nvidia.com/gpu.product|count|memory|family`` while the gpu-feature-discovery pod runs (and
  the GPU is on the ``nvidia`` driver); removed when kubelet is down (the pod stops and deletes its
  features file).
* Operator: the workload label ``nvidia.com/gpu.workload.config`` (only honoured with sandbox
  workloads enabled; default workload otherwise) selects the ``nvidia.com/gpu.deploy.*`` labels,
  on NotReady nodes too. Each enabled operand is a DaemonSet (``daemonset``) whose node selector is
  its deploy label, as the operator's; the lab's real daemonset controller and scheduler place and
  remove its pods (nfd-worker's DaemonSet runs everywhere; gpu-operator and NFD master/gc are
  ReplicaSet pods, ``replicaset``). ``vm-passthrough``:
  vfio-manager binds every NVIDIA display function to ``vfio-pci`` (the host CUDA jobs on a GPU it
  takes from ``nvidia`` die; those on other GPUs live on) and the
  sandbox device plugin advertises ``nvidia.com/<PCI NAME>``; ``container``: the device plugin
  advertises ``nvidia.com/gpu`` for GPUs on ``nvidia``; a GPU left on ``vfio-pci`` loses its driver
  (vfio-manager's preStop unbinds and does not rebind).

Pure decisions over API dicts and host-state dicts; the simulator does the calls.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from engine.lab.scenario import WORKLOADS, GpuOperator, Scenario

WORKLOAD_LABEL = "nvidia.com/gpu.workload.config"
PRESENT_LABEL = "nvidia.com/gpu.present"
DEPLOY_PREFIX = "nvidia.com/gpu.deploy."
NFD_LABELS = ("feature.node.kubernetes.io/pci-10de.present", "feature.node.kubernetes.io/pci-0300_10de.present")
GFD_LABELS = ("nvidia.com/gpu.product", "nvidia.com/gpu.count", "nvidia.com/gpu.memory", "nvidia.com/gpu.family")
OPERAND_LABEL = "runbook.lab/operand"
MANAGED_LABEL = "runbook.lab/managed"
# what the daemonset controller stamps on its pods (the template's generation, 1 for the lab's)
TEMPLATE_GENERATION_LABEL = "pod-template-generation"
POD_TEMPLATE_HASH_LABEL = "pod-template-hash"

WORKLOAD_OPERANDS: dict[str, tuple[str, ...]] = {
    "container": ("driver", "gpu-feature-discovery", "container-toolkit", "device-plugin", "dcgm",
                  "dcgm-exporter", "node-status-exporter", "operator-validator"),
    "vm-passthrough": ("sandbox-device-plugin", "sandbox-validator", "vfio-manager", "kata-manager",
                       "cc-manager"),
    "vm-vgpu": ("sandbox-device-plugin", "vgpu-manager", "vgpu-device-manager", "sandbox-validator",
                "cc-manager"),
}
POD_PREFIX = {
    "driver": "nvidia-driver-daemonset", "gpu-feature-discovery": "gpu-feature-discovery",
    "container-toolkit": "nvidia-container-toolkit-daemonset", "device-plugin": "nvidia-device-plugin-daemonset",
    "dcgm": "nvidia-dcgm", "dcgm-exporter": "nvidia-dcgm-exporter",
    "node-status-exporter": "nvidia-node-status-exporter", "operator-validator": "nvidia-operator-validator",
    "sandbox-device-plugin": "nvidia-sandbox-device-plugin-daemonset",
    "sandbox-validator": "nvidia-sandbox-validator", "vfio-manager": "nvidia-vfio-manager",
    "kata-manager": "nvidia-kata-manager", "cc-manager": "nvidia-cc-manager",
    "vgpu-manager": "nvidia-vgpu-manager-daemonset", "vgpu-device-manager": "nvidia-vgpu-device-manager",
    "cuda-validator": "nvidia-cuda-validator",  # a one-shot pod the operator-validator creates
    "nfd-worker": "gpu-operator-node-feature-discovery-worker",
}
ONE_SHOT = frozenset({"cuda-validator"})
DAEMONSET_TOLERATIONS = [
    {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"},
    {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"},
    {"key": "node.kubernetes.io/disk-pressure", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/memory-pressure", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/pid-pressure", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"},
]


def workload_of(labels: dict[str, str], operator: GpuOperator) -> str:
    """The workload the operator applies: the label when sandbox workloads are on and it is valid."""
    value = labels.get(WORKLOAD_LABEL)
    if operator.sandbox_workloads and value in WORKLOADS:
        return value
    return operator.default_workload if operator.sandbox_workloads else "container"


def desired_operands(workload: str, operator: GpuOperator) -> list[str]:
    """Operands that have a DaemonSet (enabled in the ClusterPolicy) and whose deploy label is set."""
    enabled = set(operator.operands) | ({"driver"} if operator.driver_enabled else set())
    return [op for op in WORKLOAD_OPERANDS[workload] if op in enabled]


def displays(host: dict[str, Any]) -> list[dict[str, Any]]:
    return [d for d in host.get("pci_devices", []) if d.get("display")]


def label_changes(labels: dict[str, str], host: dict[str, Any] | None, scenario: Scenario,
                  gfd_running: bool) -> dict[str, str | None]:
    """The label patch NFD + GFD + the operator want on one node (None removes a label)."""
    operator = scenario.gpu_operator
    want: dict[str, str | None] = {}
    present = labels.get(NFD_LABELS[0]) == "true"
    if present:
        want[PRESENT_LABEL] = "true"
        workload = workload_of(labels, operator)
        deploy = {DEPLOY_PREFIX + op for op in WORKLOAD_OPERANDS[workload]}
        for key in [k for k in labels if k.startswith(DEPLOY_PREFIX)] + sorted(deploy):
            want[key] = "true" if key in deploy else None
    else:
        if PRESENT_LABEL in labels:
            want[PRESENT_LABEL] = "false"
        for key in labels:
            if key.startswith(DEPLOY_PREFIX):
                want[key] = None
    nvidia = [d for d in displays(host or {}) if d.get("driver") == "nvidia"]
    if gfd_running and nvidia:
        model = scenario.gpu_model(nvidia[0]["vendor_device"])
        want.update({"nvidia.com/gpu.product": model.product, "nvidia.com/gpu.count": str(len(nvidia)),
                     "nvidia.com/gpu.memory": str(model.memory_mib), "nvidia.com/gpu.family": model.family})
    else:
        want.update({key: None for key in GFD_LABELS})
    return {k: v for k, v in want.items() if labels.get(k) != v}


def nfd_labels(host: dict[str, Any]) -> dict[str, str]:
    """What nfd-worker reports for a host's PCI devices."""
    return {key: "true" for key in NFD_LABELS} if displays(host) else {}


def advertised(host: dict[str, Any], scenario: Scenario, workload: str,
               running: set[str]) -> dict[str, int]:
    """Extended resources the running device plugins report for this host."""
    out: dict[str, int] = {}
    gpus = displays(host)
    if workload == "container" and "device-plugin" in running:
        out["nvidia.com/gpu"] = sum(1 for d in gpus if d.get("driver") == "nvidia")
    if workload in ("vm-passthrough", "vm-vgpu") and "sandbox-device-plugin" in running:
        for d in gpus:
            name = scenario.gpu_model(d["vendor_device"]).resource_name
            out[name] = out.get(name, 0) + (1 if d.get("driver") == "vfio-pci" else 0)
    return out


def gpu_resource_names(scenario: Scenario) -> set[str]:
    names = {"nvidia.com/gpu"}
    for node in scenario.all_nodes:
        names.update(scenario.gpu_model(g.model).resource_name for g in node.gpus)
    return names


@dataclass(frozen=True)
class Rebind:
    """One GPU whose binding vfio-manager changed, and the host CUDA jobs (pids) that died with it."""

    slot: str
    before: str
    after: str
    killed: tuple[int, ...] = ()


def job_gpu(host: dict[str, Any], job: dict[str, Any]) -> str | None:
    """The slot of the GPU a host CUDA job runs on (a job without one: the first GPU on nvidia)."""
    if job.get("gpu"):
        return str(job["gpu"])
    return next((str(d["slot"]) for d in displays(host) if d.get("driver") == "nvidia"), None)


def driver_effects(host: dict[str, Any], workload: str, vfio_manager_running: bool) -> list[Rebind]:
    """Apply vfio-manager's effect to ``host`` (in place), GPU by GPU; returns the GPUs it rebound.

    Only the CUDA jobs on a GPU that leaves the ``nvidia`` driver die: the others keep their GPU."""
    jobs = [(job_gpu(host, j), j) for j in host.get("cuda_jobs", [])]
    changes: list[Rebind] = []
    for dev in displays(host):
        before = str(dev.get("driver", "none"))
        if workload == "vm-passthrough" and vfio_manager_running and before != "vfio-pci":
            after = "vfio-pci"  # vfio-manage.sh bind --all
        elif workload != "vm-passthrough" and before == "vfio-pci":
            after = "none"  # vfio-manager's preStop unbound it; nothing rebinds to nvidia
        else:
            continue
        dev["driver"] = after
        killed = tuple(int(j["pid"]) for slot, j in jobs if slot == dev["slot"]) if before == "nvidia" else ()
        changes.append(Rebind(str(dev["slot"]), before, after, killed))
    dead = {pid for change in changes for pid in change.killed}
    if dead:  # their GPU vanished from the nvidia driver under them
        host["cuda_jobs"] = [j for _, j in jobs if int(j["pid"]) not in dead]
        host["cuda_jobs_killed"] = int(host.get("cuda_jobs_killed", 0)) + len(dead)
    return changes


# -- pod manifests ------------------------------------------------------------------------------------
def stable_suffix(*parts: str, length: int = 5) -> str:
    """A pod-name suffix like the API server's, stable for the same inputs (same names after reset)."""
    alphabet = "bcdfghjklmnpqrstvwxz2456789"
    digest = int(hashlib.sha256("/".join(parts).encode()).hexdigest(), 16)
    return "".join(alphabet[(digest >> (5 * i)) % len(alphabet)] for i in range(length))


def daemonset_operands(operator: GpuOperator) -> list[str]:
    """The operands that have a DaemonSet: those the ClusterPolicy enables (+ the driver when enabled)
    and NFD's worker; the one-shot validators are pods another pod creates."""
    enabled = set(operator.operands) | ({"driver"} if operator.driver_enabled else set())
    known = {op for ops in WORKLOAD_OPERANDS.values() for op in ops}
    return [*sorted(enabled & known), "nfd-worker"]


def _operand_labels(operand: str) -> dict[str, str]:
    return {"app": POD_PREFIX[operand], OPERAND_LABEL: operand, MANAGED_LABEL: "true",
            "app.kubernetes.io/part-of": "gpu-operator"}


def _operand_spec(operator: GpuOperator, operand: str) -> dict[str, Any]:
    one_shot = operand in ONE_SHOT
    spec: dict[str, Any] = {
        "restartPolicy": "Never" if one_shot else "Always", "tolerations": DAEMONSET_TOLERATIONS,
        "priorityClassName": "system-node-critical", "terminationGracePeriodSeconds": 30,
        "containers": [{"name": operand, "image": f"nvcr.io/nvidia/gpu-operator-{operand}:{operator.version}"}],
    }
    if operand != "nfd-worker" and not one_shot:  # NFD's worker runs on every node
        spec["nodeSelector"] = {DEPLOY_PREFIX + operand: "true"}
    return spec


def daemonset(operator: GpuOperator, operand: str) -> dict[str, Any]:
    """The operand's DaemonSet as the GPU Operator makes it: named as its pods' prefix, selecting the
    nodes with its ``nvidia.com/gpu.deploy.<operand>=true`` label (NFD's worker: every node).

    Update strategy OnDelete (a ClusterPolicy choice; the driver's default): the pods the lab seeds
    lack the controller-revision-hash only the controller can compute, and 1.20's controller never
    matches the template generation instead (it formats a pointer), so a rolling update would take
    every adopted pod for an old one and replace it, the incident's Error pods first."""
    labels = _operand_labels(operand)
    return {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": POD_PREFIX[operand], "namespace": operator.namespace,
                     "labels": {MANAGED_LABEL: "true", "app.kubernetes.io/part-of": "gpu-operator"}},
        "spec": {"selector": {"matchLabels": {"app": labels["app"]}}, "updateStrategy": {"type": "OnDelete"},
                 "template": {"metadata": {"labels": labels}, "spec": _operand_spec(operator, operand)}},
    }


def operand_pod(operator: GpuOperator, node: str, operand: str, name: str | None = None,
                owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """An operand pod bound to ``node``: a DaemonSet's (its template, adopted when the DaemonSet is
    created after it, or owned by ``owner``), or a one-shot validator's bare pod."""
    labels = _operand_labels(operand)
    if operand in ONE_SHOT:
        labels["runbook.lab/completes"] = "true"
    else:
        labels[TEMPLATE_GENERATION_LABEL] = "1"
    meta: dict[str, Any] = {"namespace": operator.namespace, "labels": labels}
    if name:
        meta["name"] = name
    else:
        meta["generateName"] = POD_PREFIX[operand] + "-"
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner["kind"], "name": owner["metadata"]["name"],
                                    "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"nodeName": node, **_operand_spec(operator, operand)}}


CLUSTER_COMPONENTS = (("gpu-operator", "gpu-operator"), ("gpu-operator-node-feature-discovery-master", "nfd-master"),
                      ("gpu-operator-node-feature-discovery-gc", "nfd-gc"))


def _cluster_labels(prefix: str, component: str) -> dict[str, str]:
    return {"app": prefix, OPERAND_LABEL: component, MANAGED_LABEL: "true",
            "app.kubernetes.io/part-of": "gpu-operator", POD_TEMPLATE_HASH_LABEL: stable_suffix(prefix, length=10)}


def replicaset(operator: GpuOperator, prefix: str, component: str) -> dict[str, Any]:
    """gpu-operator's and NFD master/gc's ReplicaSet (their Deployment's; one replica)."""
    labels = _cluster_labels(prefix, component)
    return {
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": f"{prefix}-{labels[POD_TEMPLATE_HASH_LABEL]}", "namespace": operator.namespace,
                     "labels": {MANAGED_LABEL: "true", "app.kubernetes.io/part-of": "gpu-operator"}},
        "spec": {"replicas": 1,
                 "selector": {"matchLabels": {"app": prefix, POD_TEMPLATE_HASH_LABEL: labels[POD_TEMPLATE_HASH_LABEL]}},
                 "template": {"metadata": {"labels": labels}, "spec": {
                     "restartPolicy": "Always", "terminationGracePeriodSeconds": 30,
                     "containers": [{"name": component, "image": f"nvcr.io/nvidia/{component}:{operator.version}"}]}}},
    }


def cluster_pod(operator: GpuOperator, node: str, prefix: str, component: str) -> dict[str, Any]:
    """gpu-operator and NFD master/gc: their ReplicaSet's pod on an ordinary node (adopted when the
    ReplicaSet is created after it)."""
    template = replicaset(operator, prefix, component)["spec"]["template"]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"namespace": operator.namespace,
                     "name": f"{prefix}-{stable_suffix(prefix, length=10)}-{stable_suffix(prefix, node)}",
                     "labels": dict(template["metadata"]["labels"])},
        "spec": {"nodeName": node, **template["spec"]},
    }
