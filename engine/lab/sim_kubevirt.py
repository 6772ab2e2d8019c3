"""KubeVirt (v1.7) as far as the incident needs it: CRDs, the KubeVirt CR, VirtualMachines, their
VMIs and virt-launcher pods, and ``printableStatus``.

A VM whose ``runStrategy`` is ``Always`` gets a VMI and a virt-launcher pod that requests its
``hostDevices`` resources (requests = limits = 1) and selects ``kubevirt.io/schedulable=true``; the
real kube-scheduler decides where it goes. The VMI copies the pod's ``PodScheduled=False/Unschedulable``
condition; the VM's ``printableStatus`` follows KubeVirt's precedence (Terminating, Stopping,
Migrating, Paused, Running, ..., ErrorUnschedulable, Provisioning, Starting, ..., Stopped).

Manifests and pure decisions; the simulator does the calls.
"""

from __future__ import annotations

import zlib
from typing import Any

from engine.lab.scenario import KubeVirt, Scenario, Vm, parse_size

MANAGED_LABEL = "runbook.lab/managed"
PAUSED_ANNOTATION = "runbook.lab/paused"
UNSCHEDULABLE_SINCE = "runbook.lab/unschedulable-since"
SCHEDULABLE_LABEL = "kubevirt.io/schedulable"
Obj = dict[str, Any]


def _crd(group: str, plural: str, singular: str, kind: str, short: list[str], columns: list[Obj],
         scope: str = "Namespaced") -> Obj:
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group, "scope": scope,
            "names": {"plural": plural, "singular": singular, "kind": kind, "shortNames": short,
                      "categories": ["all"] if group == "kubevirt.io" else []},
            "versions": [{
                "name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                "additionalPrinterColumns": columns,
            }],
        },
    }


_AGE = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
_READY = {"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type=='Ready')].status"}


def crds() -> list[Obj]:
    """VirtualMachine, VirtualMachineInstance, KubeVirt (kubevirt.io/v1) and ClusterPolicy (nvidia.com/v1)."""
    return [
        _crd("kubevirt.io", "virtualmachines", "virtualmachine", "VirtualMachine", ["vm", "vms"],
             [_AGE, {"name": "Status", "type": "string", "jsonPath": ".status.printableStatus"}, _READY]),
        _crd("kubevirt.io", "virtualmachineinstances", "virtualmachineinstance", "VirtualMachineInstance",
             ["vmi", "vmis"],
             [_AGE, {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
              {"name": "IP", "type": "string", "jsonPath": ".status.interfaces[0].ipAddress"},
              {"name": "NodeName", "type": "string", "jsonPath": ".status.nodeName"}, _READY]),
        _crd("kubevirt.io", "kubevirts", "kubevirt", "KubeVirt", ["kv", "kvs"],
             [_AGE, {"name": "Phase", "type": "string", "jsonPath": ".status.phase"}]),
        _crd("nvidia.com", "clusterpolicies", "clusterpolicy", "ClusterPolicy", [],
             [{"name": "Status", "type": "string", "jsonPath": ".status.state"}, _AGE], scope="Cluster"),
    ]


def kubevirt_cr(kv: KubeVirt) -> Obj:
    """The KubeVirt CR with the incident's permittedHostDevices (PCI vendor:device selectors)."""
    devices = [{"pciVendorSelector": d.selector, "resourceName": d.resource, "externalResourceProvider": True}
               for d in kv.permitted_host_devices]
    return {
        "apiVersion": "kubevirt.io/v1", "kind": "KubeVirt",
        "metadata": {"name": "kubevirt", "namespace": kv.namespace, "labels": {MANAGED_LABEL: "true"}},
        "spec": {"certificateRotateStrategy": {}, "workloadUpdateStrategy": {},
                 "configuration": {"developerConfiguration": {"featureGates": ["GPU", "HostDevices"]},
                                   "permittedHostDevices": {"pciHostDevices": devices}}},
    }


def cluster_policy(scenario: Scenario) -> Obj:
    op = scenario.gpu_operator
    return {
        "apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy",
        "metadata": {"name": "cluster-policy", "labels": {MANAGED_LABEL: "true"}},
        "spec": {"operator": {"defaultRuntime": "containerd"},
                 "driver": {"enabled": op.driver_enabled},
                 "sandboxWorkloads": {"enabled": op.sandbox_workloads, "defaultWorkload": op.default_workload},
                 **{name.replace("-", ""): {"enabled": True} for name in op.operands}},
    }


def vm_manifest(vm: Vm, now: float) -> Obj:
    from engine.lab.sim_kube import rfc3339

    annotations = {}
    if vm.paused:
        annotations[PAUSED_ANNOTATION] = "true"
    if vm.unschedulable_days:
        annotations[UNSCHEDULABLE_SINCE] = rfc3339(now - vm.unschedulable_days * 86400)
    devices: Obj = {"disks": [{"name": "rootdisk", "disk": {"bus": "virtio"}}]}
    if vm.host_devices:
        devices["hostDevices"] = [{"name": f"gpu{i + 1}", "deviceName": d} for i, d in enumerate(vm.host_devices)]
    return {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": vm.name, "namespace": vm.namespace, "labels": {MANAGED_LABEL: "true"},
                     "annotations": annotations},
        "spec": {
            "runStrategy": "Always" if vm.running else "Halted",
            "template": {
                "metadata": {"labels": {"kubevirt.io/vm": vm.name}},
                "spec": {
                    "domain": {"cpu": {"cores": int(float(vm.cpu))}, "devices": devices,
                               "resources": {"requests": {"memory": vm.memory}}},
                    "volumes": [{"name": "rootdisk",
                                 "containerDisk": {"image": f"quay.io/containerdisks/{vm.name}:latest"}}],
                },
            },
        },
    }


def should_run(vm: Obj) -> bool:
    spec = vm.get("spec", {})
    if "runStrategy" in spec:
        return spec["runStrategy"] in ("Always", "RerunOnFailure", "Once")
    return bool(spec.get("running"))


def vmi_manifest(vm: Obj) -> Obj:
    meta = vm["metadata"]
    return {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                     "labels": {MANAGED_LABEL: "true", "kubevirt.io/vm": meta["name"]},
                     "ownerReferences": [{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
                                          "name": meta["name"], "uid": meta["uid"], "controller": True,
                                          "blockOwnerDeletion": True}]},
        "spec": vm["spec"]["template"]["spec"],
    }


def launcher_pod(vmi: Obj, kv: KubeVirt) -> Obj:
    """virt-launcher: requests the VM's CPU, memory (+ overhead) and host devices."""
    meta, spec = vmi["metadata"], vmi["spec"]
    domain = spec.get("domain", {})
    memory = parse_size(domain.get("resources", {}).get("requests", {}).get("memory", "1Gi"))
    overhead = 256 * 1024 * 1024
    requests: Obj = {"cpu": str(domain.get("cpu", {}).get("cores", 1)), "memory": str(memory + overhead)}
    limits: Obj = {}
    for dev in domain.get("devices", {}).get("hostDevices", []):
        requests[dev["deviceName"]] = str(int(requests.get(dev["deviceName"], 0)) + 1)
        limits[dev["deviceName"]] = requests[dev["deviceName"]]
    resources: Obj = {"requests": requests}
    if limits:
        resources["limits"] = limits
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": f"virt-launcher-{meta['name']}-", "namespace": meta["namespace"],
                     "labels": {"kubevirt.io": "virt-launcher", "kubevirt.io/created-by": meta["uid"],
                                "vm.kubevirt.io/name": meta["name"], MANAGED_LABEL: "true"},
                     "ownerReferences": [{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                                          "name": meta["name"], "uid": meta["uid"], "controller": True,
                                          "blockOwnerDeletion": True}]},
        "spec": {"nodeSelector": {SCHEDULABLE_LABEL: "true"}, "restartPolicy": "Never",
                 "terminationGracePeriodSeconds": 30,
                 "containers": [{"name": "compute", "image": f"quay.io/kubevirt/virt-launcher:{kv.version}",
                                 "resources": resources}]},
    }


def pod_condition(pod: Obj | None, type_: str) -> Obj | None:
    if pod is None:
        return None
    return next((c for c in pod.get("status", {}).get("conditions", []) if c.get("type") == type_), None)


def vmi_status(pod: Obj | None, paused: bool, unschedulable_since: str | None, now_text: str,
               previous: Obj | None) -> Obj:
    """The VMI status virt-controller / virt-handler would write for the launcher pod's state."""
    scheduled = pod_condition(pod, "PodScheduled")
    phase_of_pod = (pod or {}).get("status", {}).get("phase", "Pending")
    node = (pod or {}).get("spec", {}).get("nodeName")
    prev_conditions = {c["type"]: c for c in (previous or {}).get("conditions", [])}

    def cond(type_: str, status: str, reason: str = "", message: str = "", since: str | None = None) -> Obj:
        old = prev_conditions.get(type_)
        ltt = since or (old["lastTransitionTime"] if old and old.get("status") == status else now_text)
        c: Obj = {"type": type_, "status": status, "lastTransitionTime": ltt}
        if reason:
            c["reason"] = reason
        if message:
            c["message"] = message
        return c

    if node and phase_of_pod == "Running":
        conditions = [cond("Ready", "False" if paused else "True", "PodNotReady" if paused else "")]
        if paused:
            conditions.append(cond("Paused", "True", "PausedByUser", "VMI was paused by user"))
        return {"phase": "Running", "nodeName": node, "conditions": conditions,
                "interfaces": [{"ipAddress": f"10.244.{zlib.crc32(node.encode()) % 250}.{len(node) + 10}",
                                "name": "default"}]}
    if node:
        return {"phase": "Scheduled", "nodeName": node, "conditions": [cond("Ready", "False", "PodNotReady")]}
    if scheduled and scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        return {"phase": "Scheduling", "conditions": [
            cond("Ready", "False", "GuestNotRunning", "Guest VM is not reported as running"),
            cond("PodScheduled", "False", "Unschedulable", scheduled.get("message", ""),
                 since=unschedulable_since),
        ]}
    return {"phase": "Scheduling" if pod else "Pending",
            "conditions": [cond("Ready", "False", "GuestNotRunning", "Guest VM is not reported as running")]}


def printable_status(vm: Obj, vmi: Obj | None) -> str:
    """KubeVirt's precedence, reduced to the states the lab produces."""
    if vm["metadata"].get("deletionTimestamp"):
        return "Terminating"
    if vmi is None:
        return "Starting" if should_run(vm) else "Stopped"
    if vmi["metadata"].get("deletionTimestamp"):
        return "Stopping"
    status = vmi.get("status", {})
    conditions = {c["type"]: c for c in status.get("conditions", [])}
    if conditions.get("Paused", {}).get("status") == "True":
        return "Paused"
    if status.get("phase") == "Running":
        return "Running"
    scheduled = conditions.get("PodScheduled", {})
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        return "ErrorUnschedulable"
    if status.get("phase") in ("Pending", "Scheduling", "Scheduled", None):
        return "Starting"
    return "Stopped" if not should_run(vm) else "Starting"


def vm_status(vm: Obj, vmi: Obj | None) -> Obj:
    printable = printable_status(vm, vmi)
    conditions = []
    for c in (vmi or {}).get("status", {}).get("conditions", []):
        if c["type"] in ("Ready", "PodScheduled", "Paused"):
            conditions.append(c)
    if not conditions:
        conditions = [{"type": "Ready", "status": "False",
                       "lastTransitionTime": vm["metadata"].get("creationTimestamp"),
                       "reason": "VMINotExists", "message": "VMI does not exist"}]
    return {"printableStatus": printable, "ready": printable == "Running",
            "created": vmi is not None, "conditions": conditions,
            "runStrategy": vm.get("spec", {}).get("runStrategy", "Always")}
