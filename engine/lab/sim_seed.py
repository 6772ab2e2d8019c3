"""A scenario's initial state: each node host's state folder and fstab, and the cluster's API objects.

``host_state`` builds a host's ``state.json`` and journal (a kubelet already crash-looping has a
journal history and a restart counter); ``fstab_text`` its /etc/fstab. ``seed_cluster`` creates what
exists before the simulator runs (namespaces, CRDs, the KubeVirt CR and ClusterPolicy, Nodes as their
kubelets last reported them, Leases, the GPU Operator's pods with their last statuses);
``seed_controllers`` the GPU Operator's DaemonSets and ReplicaSets and ``seed_vms`` the
VirtualMachines, once the nodes' state is reached: the real daemonset and replicaset controllers
adopt the pods seeded before them (nothing is created for a dead node: it is tainted by then), and no
GPU VM is scheduled in the seconds before the node lifecycle controller notices a dead node. A pod
the scenario has Terminating is made then, owned by its DaemonSet (a terminating pod is never
adopted). ``wipe_cluster`` deletes what the lab created (``lab reset``). Nodes reach NotReady through
the real controller, never by a patch.
"""

from __future__ import annotations

import time
from typing import Any

from engine.lab import sim_gpu, sim_kubelet, sim_kubevirt, sim_nodes, sim_pods
from engine.lab.scenario import Node, Scenario, SwapDevice, starts_ready
from engine.lab.sim_kube import (
    CLUSTER_POLICIES,
    CRDS,
    DAEMONSETS,
    KUBEVIRTS,
    LEASES,
    NAMESPACES,
    NODES,
    PODS,
    REPLICASETS,
    VMIS,
    VMS,
    Kube,
    Obj,
)

MANAGED = f"{sim_nodes.MANAGED_LABEL}=true"
CUDA_PID_BASE = 41000
NVIDIA_MODULES = ["nvidiafb", "nouveau", "nvidia_drm", "nvidia"]


# -- node hosts ------------------------------------------------------------------------------------
def fstab_text(node: Node) -> str:
    if node.host.fstab is not None:
        return node.host.fstab if node.host.fstab.endswith("\n") else node.host.fstab + "\n"
    lines = ["# /etc/fstab: static file system information.",
             "UUID=5b1f3c2e-8d4a-4c6e-9f70-2a1b3c4d5e6f / ext4 errors=remount-ro 0 1"]
    for path, dev in node.host.swap.devices.items():
        if dev.in_fstab:
            lines.append(f"{dev.spec(path)} none swap {dev.fstab_options} 0 0")
    return "\n".join(lines) + "\n"


def swap_device_state(path: str, dev: SwapDevice, active: bool) -> Obj:
    """A swap device in the host's state: its fields (the shims resolve fstab specs with them) and,
    turned on from fstab with ``pri=N``, that priority."""
    out: Obj = {k: v for k, v in dev.model_dump(exclude={"fstab_spec", "fstab_options"}).items()
                if v is not None and v != []}
    if active and dev.in_fstab and dev.fstab_priority is not None:
        out["prio"] = dev.fstab_priority
    return out


def pci_devices(node: Node, scenario: Scenario) -> list[Obj]:
    out = []
    for gpu in node.gpus:
        model = scenario.gpu_model(gpu.model)
        out.append({"slot": gpu.slot, "vendor_device": gpu.model, "class": "VGA compatible controller [0300]",
                    "name": model.name, "subsystem": model.subsystem, "rev": "a1", "driver": gpu.driver,
                    "modules": NVIDIA_MODULES, "display": True, "memory_mib": model.memory_mib})
        if model.audio:
            out.append({"slot": gpu.slot[:-1] + "1", "vendor_device": model.audio, "class": "Audio device [0403]",
                        "name": model.audio_name, "subsystem": model.subsystem, "rev": "a1",
                        "driver": "snd_hda_intel", "modules": ["snd_hda_intel"], "display": False})
    return out


def host_state(node: Node, scenario: Scenario, now: float) -> tuple[Obj, list[Obj]]:
    """The host's initial ``state.json`` dict and journal entries."""
    host = node.host
    timing = scenario.timing
    units: dict[str, Obj] = {}
    journal: list[Obj] = []
    for name, active in host.units.items():
        units[name] = {"active": active, "sub": "running" if active == "active" else "dead",
                       "result": "exit-code" if active == "failed" else "success", "enabled": True,
                       "desired": "running" if active == "active" else "stopped", "since": now - 3600,
                       "description": f"{name} container runtime" if name == "containerd" else name,
                       "main_pid": 900 + len(units), "generation": 1}
        if active == "failed":
            units[name]["sub"] = "failed"
            journal += [{"ts": now - 3600, "unit": name, "ident": "systemd", "pid": 1, "msg": msg} for msg in (
                f"{name}.service: Main process exited, code=exited, status=1/FAILURE",
                f"{name}.service: Failed with result 'exit-code'.",
                f"Failed to start {name}.service - {units[name]['description']}.")]
    kubelet_unit: Obj = {"active": "active", "sub": "running", "result": "success", "enabled": True,
                         "desired": "running", "since": now - 3600, "description": sim_kubelet.DESCRIPTION,
                         "restarts": host.kubelet.restart_counter, "main_pid": 2000, "generation": 1,
                         "exec": "/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS "
                                 "$KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS",
                         "docs": "https://kubernetes.io/docs/"}
    units["kubelet"] = kubelet_unit
    state: Obj = {
        "host": node.name, "next_pid": 2001,
        "swap": {"devices": {path: swap_device_state(path, dev, path in host.swap.active)
                             for path, dev in host.swap.devices.items()},
                 "active": list(host.swap.active)},
        "units": units,
        "kubelet": {"fail_swap_on": host.kubelet.fail_swap_on,
                    "fault": host.kubelet.fault.model_dump() if host.kubelet.fault else None,
                    "client_cert_expired": host.kubelet.client_cert_expired,
                    "healthy": False, "evaluated_generation": 1},
        "pci_devices": pci_devices(node, scenario),
        "cuda_jobs": [{"pid": CUDA_PID_BASE + i, **job.model_dump(), "gpu": node.cuda_job_gpu(job)}
                      for i, job in enumerate(host.cuda_jobs)],
        "cuda_jobs_killed": 0,
    }
    if host.kubelet.stopped:
        kubelet_unit.update(active="inactive", sub="dead", desired="stopped")
    elif sim_kubelet.failure_lines(state, now, 0) is None:  # kubelet runs (maybe unable to post status)
        journal += sim_kubelet.come_up(state, now - 3600)
    else:
        journal += sim_kubelet.crash_history(state, now, 3, timing.kubelet_restart_seconds)
    return state, journal


# -- API objects -----------------------------------------------------------------------------------
def _wait_established(kube: Kube, names: list[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ok = 0
        for name in names:
            crd = kube.get(CRDS, name) or {}
            conditions = (crd.get("status") or {}).get("conditions") or []
            ok += any(c["type"] == "Established" and c["status"] == "True" for c in conditions)
        if ok == len(names):
            return
        time.sleep(0.1)
    raise TimeoutError(f"CRDs not established within {timeout:.0f} s: {names}")


def _operand_statuses(node: Node, scenario: Scenario) -> dict[str, str]:
    """Operand -> initial status for a GPU node: desired operands Running unless the scenario says."""
    if not node.gpus or not scenario.gpu_operator.operand_pods:
        return {}
    workload = sim_gpu.workload_of(node.labels, scenario.gpu_operator)
    statuses = {op: "Running" for op in sim_gpu.desired_operands(workload, scenario.gpu_operator)}
    statuses.update(node.operator_pods)
    return statuses


def _extended_at_last_report(node: Node, host: Obj, scenario: Scenario) -> dict[str, int]:
    """What the device plugins advertised when the kubelet last reported (for a down node: before the
    outage, with a passthrough GPU on vfio-pci as vfio-manager had left it before the reboot)."""
    if not node.gpus:
        return {}
    workload = sim_gpu.workload_of(node.labels, scenario.gpu_operator)
    last = {**host, "pci_devices": [dict(d) for d in host["pci_devices"]]}
    if workload == "vm-passthrough" and not starts_ready(node):
        for dev in sim_gpu.displays(last):
            dev["driver"] = "vfio-pci"
    return sim_gpu.advertised(last, scenario, workload, set(sim_gpu.WORKLOAD_OPERANDS[workload]))


def _create_pod(kube: Kube, manifest: Obj, status: str, host_ip: str, now: float) -> None:
    pod = kube.create(PODS, manifest, manifest["metadata"]["namespace"], exist_ok=True)
    if pod is None:
        return
    ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    if status != "Pending":
        body = sim_pods.pod_status(pod, "Running" if status == "Terminating" else status, host_ip, now,
                                   restarts=7 if status == "Error" else 0)
        kube.patch(PODS, name, {"status": body}, ns, sub="status")
    if status == "Terminating":
        kube.delete(PODS, name, ns, grace=30)  # no kubelet confirms: it stays Terminating


def seed_cluster(kube: Kube, scenario: Scenario, addresses: dict[str, str],
                 hosts: dict[str, Obj], now: float | None = None) -> None:
    """Create the cluster's objects as they were when the scenario's outage had already begun."""
    now = time.time() if now is None else now
    op, kv = scenario.gpu_operator, scenario.kubevirt
    for ns in sorted({op.namespace, kv.namespace, *(vm.namespace for vm in scenario.vms)}):
        kube.create(NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}, exist_ok=True)
    crds = sim_kubevirt.crds()
    for crd in crds:
        kube.create(CRDS, crd, exist_ok=True)
    _wait_established(kube, [c["metadata"]["name"] for c in crds])
    kube.create(KUBEVIRTS, sim_kubevirt.kubevirt_cr(kv), kv.namespace, exist_ok=True)
    kube.patch(KUBEVIRTS, "kubevirt", {"status": {"phase": "Deployed"}}, kv.namespace, sub="status")
    kube.create(CLUSTER_POLICIES, sim_kubevirt.cluster_policy(scenario), exist_ok=True)
    kube.patch(CLUSTER_POLICIES, "cluster-policy", {"status": {"state": "notReady"}}, sub="status")

    nodes = scenario.all_nodes
    for node in nodes:
        host = hosts[node.name]
        manifest = sim_nodes.node_manifest(node, addresses[node.name],
                                           _extended_at_last_report(node, host, scenario), now)
        labels = manifest["metadata"]["labels"]
        labels.update(sim_gpu.nfd_labels(host))
        gfd = starts_ready(node) and "gpu-feature-discovery" in _operand_statuses(node, scenario)
        changes = sim_gpu.label_changes(labels, host, scenario, gfd_running=gfd or (
            starts_ready(node) and not op.operand_pods))
        labels.update({k: v for k, v in changes.items() if v is not None})
        created = kube.create(NODES, manifest, exist_ok=True) or kube.get(NODES, node.name) or {}
        kube.patch(NODES, node.name, {"status": manifest["status"]}, sub="status")
        if starts_ready(node):
            lease = sim_nodes.lease_body(node.name, now, created.get("metadata", {}).get("uid"))
            kube.create(LEASES, lease, sim_nodes.LEASE_NAMESPACE, exist_ok=True)
    if not op.operand_pods:
        return
    ready_workers = [n.name for n in nodes if starts_ready(n) and not n.gpus and "control-plane" not in n.roles]
    controller = op.controller_node or (ready_workers[0] if ready_workers else nodes[0].name)
    for prefix, component in sim_gpu.CLUSTER_COMPONENTS:
        _create_pod(kube, sim_gpu.cluster_pod(op, controller, prefix, component), "Running",
                    addresses[controller], now)
    for node, operand, status in _operand_pods(scenario):
        if status != "Terminating":  # made by seed_controllers, owned by its DaemonSet
            _create_pod(kube, sim_gpu.operand_pod(op, node.name, operand, _operand_pod_name(node, operand)),
                        status, addresses[node.name], now)


def _operand_pod_name(node: Node, operand: str) -> str:
    return f"{sim_gpu.POD_PREFIX[operand]}-{sim_gpu.stable_suffix(node.name, operand)}"


def _operand_pods(scenario: Scenario) -> list[tuple[Node, str, str]]:
    """(node, operand, initial status) of every operand pod the scenario starts with."""
    out = []
    for node in scenario.all_nodes:
        out.append((node, "nfd-worker", "Running"))
        out += [(node, operand, status) for operand, status in _operand_statuses(node, scenario).items()]
    return out


def seed_controllers(kube: Kube, scenario: Scenario, addresses: dict[str, str], now: float | None = None) -> None:
    """The GPU Operator's DaemonSets and ReplicaSets (their controllers adopt the seeded pods), then
    the pods the scenario has Terminating, owned by their DaemonSet. Call once the dead nodes are
    tainted: a DaemonSet then makes no pod there."""
    op = scenario.gpu_operator
    if not op.operand_pods:
        return
    now = time.time() if now is None else now
    for prefix, component in sim_gpu.CLUSTER_COMPONENTS:
        kube.create(REPLICASETS, sim_gpu.replicaset(op, prefix, component), op.namespace, exist_ok=True)
    owners: dict[str, Obj] = {}
    for operand in sim_gpu.daemonset_operands(op):
        manifest = sim_gpu.daemonset(op, operand)
        owners[operand] = (kube.create(DAEMONSETS, manifest, op.namespace, exist_ok=True)
                           or kube.get(DAEMONSETS, manifest["metadata"]["name"], op.namespace) or {})
    for node, operand, status in _operand_pods(scenario):
        if status == "Terminating":
            manifest = sim_gpu.operand_pod(op, node.name, operand, _operand_pod_name(node, operand),
                                           owner=owners.get(operand))
            _create_pod(kube, manifest, status, addresses[node.name], now)


def seed_vms(kube: Kube, scenario: Scenario, now: float | None = None) -> None:
    now = time.time() if now is None else now
    for vm in scenario.vms:
        kube.create(VMS, sim_kubevirt.vm_manifest(vm, now), vm.namespace, exist_ok=True)


def wipe_cluster(kube: Kube, scenario: Scenario) -> None:
    """Delete every object the lab created (namespaces and CRDs stay, to be used again)."""
    namespaces = {scenario.gpu_operator.namespace, *(vm.namespace for vm in scenario.vms)}
    for ns in sorted(namespaces):
        for res in (VMS, VMIS, DAEMONSETS, REPLICASETS):  # the controllers first: no pod comes back
            _delete_all(kube, res, ns)
    for ns in sorted(namespaces):
        kube.delete_collection(PODS, ns, grace=0)
    kube.delete_collection(LEASES, sim_nodes.LEASE_NAMESPACE, selector=MANAGED)
    for node in scenario.all_nodes:  # leases the simulator created for nodes it registered
        kube.delete(LEASES, node.name, sim_nodes.LEASE_NAMESPACE)
    kube.delete_collection(NODES, selector=MANAGED)


def _delete_all(kube: Kube, res: Any, namespace: str) -> None:
    try:
        items, _ = kube.list(res, namespace)
    except Exception:  # the CRD does not exist yet
        return
    for item in items:
        kube.delete(res, item["metadata"]["name"], namespace, grace=0)
