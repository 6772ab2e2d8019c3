"""``runbook diagnose``: read-only evidence and the causal chain behind a sick GPU node.

Reads node conditions and taints, GPU labels, the host's kubelet state and journal, swap,
the GPU driver binding, affected VMs and pods; then names the cause it recognises and the
runbook that fixes it, with the exact command. It never changes anything. A cause it does not
know is said plainly, with the evidence (exit 1).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from engine.errors import ExitCode, RunbookError
from engine.facts import HostFacts, NodeFacts

if TYPE_CHECKING:
    from engine.connectors.base import KubeAPI, NodeAutomation
    from engine.settings import Settings

SWAP_REFUSAL = "running with swap on is not supported"
WORKLOAD_LABEL = "nvidia.com/gpu.workload.config"
GPU_LABEL_PREFIXES = ("nvidia.com/gpu.", "feature.node.kubernetes.io/pci-10de")


@dataclass(frozen=True)
class Diagnosis:
    node: str
    cause: str  # "swap" | "healthy" | "unknown" | "node-missing"
    chain: tuple[str, ...]
    fix: str | None
    evidence: Mapping[str, Any] = field(default_factory=dict)

    @property
    def known(self) -> bool:
        return self.cause in ("swap", "healthy")


def _affected_vms(vms: Sequence[Mapping[str, Any]]) -> list[str]:
    """VMs that ask for a host device and cannot be scheduled."""
    out = []
    for vm in vms:
        status = (vm.get("status") or {}).get("printableStatus")
        devices = (((vm.get("spec") or {}).get("template") or {}).get("spec") or {}).get("domain", {})
        devices = (devices.get("devices") or {})
        wants_device = bool(devices.get("hostDevices") or devices.get("gpus"))
        if status == "ErrorUnschedulable" and wants_device:
            meta = vm.get("metadata") or {}
            out.append(f"{meta.get('namespace', '')}/{meta.get('name', '')}")
    return sorted(out)


def explain(node_name: str, node: NodeFacts | None, host: HostFacts | Exception | None,
            vms: Sequence[Mapping[str, Any]] | Exception) -> Diagnosis:
    """Pure: facts in, diagnosis out."""
    evidence: dict[str, Any] = {}
    if node is None:
        return Diagnosis(node_name, "node-missing", (f"node {node_name} does not exist in the cluster",),
                         None, {"node": None})
    ready = node.condition("Ready")
    evidence["ready"] = asdict(ready) if ready else None
    evidence["taints"] = [asdict(t) for t in node.taints]
    evidence["workload_label"] = node.labels.get(WORKLOAD_LABEL)
    evidence["gpu_labels"] = sorted(k for k in node.labels if k.startswith(GPU_LABEL_PREFIXES))
    evidence["allocatable_gpu"] = {k: v for k, v in node.allocatable.items() if k.startswith("nvidia.com/")}
    if isinstance(host, Exception):
        evidence["host_error"] = str(host)
        host = None
    if host is not None:
        kubelet = host.service("kubelet")
        evidence["swap_devices"] = [asdict(d) for d in host.swap_devices]
        evidence["fstab_active_swap"] = list(host.fstab_active_swap)
        evidence["kubelet_state"] = kubelet.state
        evidence["kubelet_journal_tail"] = kubelet.journal_tail.splitlines()[-5:]
        evidence["gpu_driver"] = host.gpu_driver
        evidence["cuda_processes"] = [asdict(p) for p in host.cuda_processes]
    if isinstance(vms, Exception):
        evidence["vms_error"] = str(vms)
        affected: list[str] = []
    else:
        affected = _affected_vms(vms)
    evidence["unschedulable_gpu_vms"] = affected

    if node.ready and (host is None or host.service("kubelet").state == "active"):
        return Diagnosis(node_name, "healthy", (f"node {node_name} is Ready",), None, evidence)

    chain: list[str] = []
    swap_refused = host is not None and SWAP_REFUSAL in host.service("kubelet").journal_tail
    if host is not None and (host.swap_active or swap_refused):
        if host.swap_active:
            devs = ", ".join(d.name for d in host.swap_devices)
            chain.append(f"swap on ({devs})")
        else:
            chain.append("swap was on (kubelet journal shows the refusal)")
        chain.append(f"kubelet refuses to start (systemctl is-active: {host.service('kubelet').state})")
        status = ready.status if ready else "missing"
        chain.append(f"node NotReady (Ready={status})")
        if not evidence["gpu_labels"] or "nvidia.com/gpu" not in node.allocatable:
            chain.append("GPU labels gone, device plugin not advertising")
        if affected:
            chain.append(f"{len(affected)} VM{'s' if len(affected) != 1 else ''} ErrorUnschedulable "
                         f"({', '.join(a.split('/')[-1] for a in affected)})")
        fix = f"runbook run gpu-node-recovery --node {node_name}"
        return Diagnosis(node_name, "swap", tuple(chain), fix, evidence)

    reason = "host facts unavailable" if host is None else \
        f"kubelet {host.service('kubelet').state}, swap off, no swap refusal in the journal"
    chain.append(f"node NotReady for a cause runbook does not know ({reason})")
    return Diagnosis(node_name, "unknown", tuple(chain), None, evidence)


def gather_and_explain(node_name: str, kube: KubeAPI, nodes: NodeAutomation | None) -> Diagnosis:
    """Read everything in parallel (read-only), then explain."""

    def host_facts() -> HostFacts | Exception | None:
        if nodes is None:
            return None
        try:
            return nodes.gather_facts([node_name])[node_name]
        except RunbookError as e:
            return e

    def vm_list() -> list[Mapping[str, Any]] | Exception:
        try:
            return kube.list_objects("kubevirt.io/v1", "virtualmachines")
        except RunbookError as e:
            return e

    with ThreadPoolExecutor(max_workers=3) as pool:
        node_f = pool.submit(kube.read_node, node_name)
        host_f = pool.submit(host_facts)
        vms_f = pool.submit(vm_list)
        node = node_f.result()
        return explain(node_name, node, host_f.result() if node is not None else None, vms_f.result())


def render_text(d: Diagnosis) -> str:
    lines = [f"node {d.node}: cause {d.cause}"]
    lines.append("  " + "\n  -> ".join(d.chain))
    if d.fix:
        lines.append(f"fix: {d.fix}")
    elif d.cause == "unknown":
        lines.append("runbook does not recognise this cause; evidence:")
        for k, v in d.evidence.items():
            lines.append(f"  {k}: {json.dumps(v, default=str)}")
    return "\n".join(lines)


def diagnose_command(settings: Settings, node: str, output: str) -> int:
    from engine.loader import default_runbooks_dir, playbooks_dir_for
    from engine.params import validate_node_name

    validate_node_name(node)
    runbooks_dir = settings.runbooks_dir or default_runbooks_dir()
    nodes = settings.nodes(playbooks_dir_for(runbooks_dir)) if settings.inventory else None
    try:
        d = gather_and_explain(node, settings.kube(), nodes)
    finally:
        settings.close()
    if output == "json":
        print(json.dumps({"node": d.node, "cause": d.cause, "chain": list(d.chain), "fix": d.fix,
                          "evidence": d.evidence}, indent=2, default=str))
    else:
        print(render_text(d))
    return ExitCode.OK if d.known else ExitCode.FAILED
