"""``runbook diagnose``: read-only evidence and the causal chain behind a sick GPU node.

Reads node conditions and taints, GPU labels, the host's kubelet state and journal, swap, the GPU
driver binding, the VMs that ask for this node's GPU and the pods on the node; then names the cause
it recognises, as a chain like the incident's ("swap on -> kubelet refuses -> NotReady -> GPU labels
gone -> 2 VMs ErrorUnschedulable"), and the runbook that fixes it with its exact command. It never
changes anything. A cause it does not know is said plainly, with the evidence and kubelet's last
error line (exit 1); a known cause or a healthy node is exit 0.

``explain`` is pure (facts in, ``Diagnosis`` out); ``gather_and_explain`` reads, in parallel.
"""

from __future__ import annotations

import json
from collections import Counter
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
OLD_SWAP_REFUSAL = "please disable swap"
WORKLOAD_LABEL = "nvidia.com/gpu.workload.config"
GFD_LABELS = ("nvidia.com/gpu.product", "nvidia.com/gpu.count")
GPU_LABEL_PREFIXES = ("nvidia.com/gpu.", "feature.node.kubernetes.io/pci-10de")
RECOVERY = "gpu-node-recovery"
SWITCH = "gpu-workload-switch"


@dataclass(frozen=True)
class Diagnosis:
    node: str
    cause: str  # "swap" | "healthy" | "unknown" | "node-missing"
    chain: tuple[str, ...]  # each link with its evidence, in causal order
    fix: str | None  # the exact command of the runbook that fixes it
    evidence: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # what else an operator must know (the vfio risk, waiting VMs)
    links: tuple[str, ...] = ()  # the chain's links without evidence ("swap on", "kubelet refuses", ...)

    @property
    def known(self) -> bool:
        return self.cause in ("swap", "healthy")

    @property
    def summary(self) -> str:
        """The chain in one line, its links without their evidence: ``swap on -> kubelet refuses -> ...``."""
        return " -> ".join(self.links or self.chain)

    @property
    def exit_code(self) -> int:
        return ExitCode.OK if self.known else ExitCode.FAILED

    def as_json(self) -> dict[str, Any]:
        return {"node": self.node, "cause": self.cause, "known": self.known, "summary": self.summary,
                "chain": list(self.chain), "fix": self.fix, "notes": list(self.notes),
                "evidence": dict(self.evidence)}


# -- pure helpers ---------------------------------------------------------------------------------


def _devices(vm: Mapping[str, Any]) -> list[str]:
    """The device resources a VirtualMachine asks for (hostDevices and gpus, by deviceName)."""
    spec = ((vm.get("spec") or {}).get("template") or {}).get("spec") or {}
    devices = ((spec.get("domain") or {}).get("devices") or {})
    return [str(d.get("deviceName")) for d in [*(devices.get("hostDevices") or ()), *(devices.get("gpus") or ())]
            if isinstance(d, Mapping) and d.get("deviceName")]


def node_gpu_resources(node: NodeFacts, host: HostFacts | None,
                       kubevirts: Sequence[Mapping[str, Any]]) -> list[str]:
    """Resources a VM could get from this node: the node's ``nvidia.com/*`` capacity, and the KubeVirt
    ``permittedHostDevices`` entries whose PCI vendor:device matches one of the host's GPUs."""
    out = {k for k in node.capacity if k.startswith("nvidia.com/")}
    ids = {g.vendor_device.lower() for g in (host.gpus if host is not None else ())}
    for kv in kubevirts:
        permitted = (((kv.get("spec") or {}).get("configuration") or {}).get("permittedHostDevices") or {})
        for dev in permitted.get("pciHostDevices") or ():
            if str(dev.get("pciVendorSelector", "")).lower() in ids and dev.get("resourceName"):
                out.add(str(dev["resourceName"]))
    return sorted(out)


def waiting_vms(vms: Sequence[Mapping[str, Any]], resources: Sequence[str]) -> list[dict[str, Any]]:
    """VMs asking for one of ``resources`` that are not Running, with why they wait."""
    out = []
    for vm in vms:
        asked = [d for d in _devices(vm) if d in resources]
        status = vm.get("status") or {}
        printable = status.get("printableStatus") or "Unknown"
        if not asked or printable in ("Running", "Stopped", "Paused"):
            continue
        meta = vm.get("metadata") or {}
        scheduled: Mapping[str, Any] = next(
            (c for c in status.get("conditions") or () if c.get("type") == "PodScheduled"), {})
        out.append({"vm": f"{meta.get('namespace', '')}/{meta.get('name', '')}", "status": printable,
                    "asks_for": asked, "why": scheduled.get("message", ""),
                    "since": scheduled.get("lastTransitionTime", "")})
    return sorted(out, key=lambda v: v["vm"])


def pod_status(pod: Mapping[str, Any]) -> str:
    """``kubectl get pods``' STATUS column, reduced: Terminating, a container's waiting/terminated
    reason (Error, CrashLoopBackOff), else the phase."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return "Terminating"
    status = pod.get("status") or {}
    for cs in status.get("containerStatuses") or ():
        state = cs.get("state") or {}
        for key in ("waiting", "terminated"):
            reason = (state.get(key) or {}).get("reason")
            if reason and reason != "Completed":
                return str(reason)
    return str(status.get("phase") or "Pending")


def _err(line: str) -> str:
    """The klog error text of a journal line (``err="..."``), or the line."""
    i = line.find("err=")
    return line[i:] if i >= 0 else line.strip()


def last_error(journal_tail: str) -> str:
    """The last error-looking line of a journal tail (klog ``E`` lines, systemd failures)."""
    lines = [ln.strip() for ln in journal_tail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if '"command failed"' in ln or " E" in ln[:80] or "err=" in ln:
            return ln
    return lines[-1] if lines else ""


def explain(node_name: str, node: NodeFacts | None, host: HostFacts | Exception | None,
            vms: Sequence[Mapping[str, Any]] | Exception, *, kubevirts: Sequence[Mapping[str, Any]] = (),
            pods: Sequence[Mapping[str, Any]] | Exception = ()) -> Diagnosis:
    """Pure: facts in, diagnosis out."""
    evidence: dict[str, Any] = {}
    if node is None or not node.exists:
        return Diagnosis(node_name, "node-missing", (f"node {node_name} does not exist in the cluster",),
                         None, {"node": None})
    ready = node.condition("Ready")
    evidence["ready"] = asdict(ready) if ready else None
    evidence["taints"] = [asdict(t) for t in node.taints]
    evidence["workload_label"] = node.labels.get(WORKLOAD_LABEL)
    evidence["gpu_labels"] = {k: v for k, v in sorted(node.labels.items()) if k.startswith(GPU_LABEL_PREFIXES)}
    evidence["allocatable_gpu"] = {k: v for k, v in node.allocatable.items() if k.startswith("nvidia.com/")}
    if isinstance(host, Exception):
        evidence["host_error"] = str(host)
        host = None
    if host is not None:
        kubelet = host.service("kubelet")
        evidence["swap_devices"] = [asdict(d) for d in host.swap_devices]
        evidence["fstab_active_swap"] = list(host.fstab_active_swap)
        evidence["unhandled_swap_sources"] = list(host.unhandled_swap_sources)
        evidence["kubelet_state"] = kubelet.state
        evidence["kubelet_journal_tail"] = kubelet.journal_tail.splitlines()[-5:]
        evidence["gpu_driver"] = host.gpu_driver
        evidence["gpus"] = [asdict(g) for g in host.gpus]
        evidence["cuda_processes"] = [asdict(p) for p in host.cuda_processes]
    resources = node_gpu_resources(node, host, kubevirts)
    evidence["gpu_resources"] = resources
    if isinstance(vms, Exception):
        evidence["vms_error"] = str(vms)
        waiting: list[dict[str, Any]] = []
    else:
        waiting = waiting_vms(vms, resources)
    evidence["waiting_gpu_vms"] = waiting
    if isinstance(pods, Exception):
        evidence["pods_error"] = str(pods)
    else:
        statuses = {f"{(p.get('metadata') or {}).get('namespace', '')}/{(p.get('metadata') or {}).get('name', '')}":
                    pod_status(p) for p in pods}
        evidence["pods"] = dict(sorted(statuses.items()))
        evidence["pod_statuses"] = dict(Counter(statuses.values()).most_common())

    workload = node.labels.get(WORKLOAD_LABEL)
    notes: list[str] = []
    vm_names = ", ".join(v["vm"].split("/")[-1] for v in waiting)
    vm_link = (f"{len(waiting)} VM{'s' if len(waiting) != 1 else ''} {waiting[0]['status']} ({vm_names})"
               if waiting else "")

    kubelet_state = host.service("kubelet").state if host is not None else "unknown"
    if node.ready and kubelet_state in ("active", "unknown"):
        seen = f"kubelet {kubelet_state}" if host is not None else "no host facts"
        chain = [f"node {node_name} is Ready ({seen}, workload {workload or 'unset'})"]
        if waiting and workload != "vm-passthrough":
            notes.append(f"{vm_link} wait for this node's GPU while it serves containers "
                         f"({', '.join(resources)}); switch it with: runbook run {SWITCH} --node {node_name} "
                         "-p workload=vm-passthrough (stop the host's CUDA jobs first)")
        return Diagnosis(node_name, "healthy", tuple(chain), None, evidence, tuple(notes), ("Ready",))

    tail = host.service("kubelet").journal_tail if host is not None else ""
    swap_refused = SWAP_REFUSAL in tail or OLD_SWAP_REFUSAL in tail
    if host is not None and (host.swap_active or swap_refused):
        chain, links = [], []
        if host.swap_active:
            chain.append(f"swap on ({', '.join(d.name for d in host.swap_devices)})")
        else:
            chain.append("swap on (swap is off now, but the kubelet journal shows the refusal)")
        links.append("swap on")
        refusal = next((ln.strip() for ln in tail.splitlines() if SWAP_REFUSAL in ln or OLD_SWAP_REFUSAL in ln), "")
        chain.append(f"kubelet refuses to start (crash loop, systemctl is-active: {kubelet_state}"
                     + (f"; journal: {_err(refusal)}" if refusal else "") + ")")
        links.append("kubelet refuses")
        status = ready.status if ready else "missing"
        reason = f", {ready.reason}" if ready and ready.reason else ""
        chain.append(f"node NotReady (Ready={status}{reason}; taints "
                     f"{', '.join(sorted({t.key + ':' + t.effect for t in node.taints})) or 'none'})")
        links.append("NotReady")
        gone = [k for k in GFD_LABELS if k not in node.labels]
        if gone:
            chain.append(f"GPU labels gone ({', '.join(gone)} absent: GPU Feature Discovery and the device "
                         "plugin are down with kubelet)")
            links.append("GPU labels gone")
        if waiting:
            chain.append(f"{vm_link.split(' (')[0]} ("
                         + "; ".join(f"{v['vm']} asks for {', '.join(v['asks_for'])}" for v in waiting) + ")")
            links.append(vm_link.split(" (")[0])
        if workload == "vm-passthrough":
            jobs = len(host.cuda_processes)
            notes.append("the workload label is vm-passthrough: if kubelet came back now, vfio-manager would "
                         f"rebind the GPU to vfio-pci and kill the host's {jobs} CUDA job(s); the runbook "
                         "relabels the node to container first")
        if host.unhandled_swap_sources:
            notes.append("swap also comes from sources the swap-off playbook refuses to handle: "
                         + ", ".join(host.unhandled_swap_sources))
        return Diagnosis(node_name, "swap", tuple(chain), f"runbook run {RECOVERY} --node {node_name}", evidence,
                         tuple(notes), tuple(links))

    if host is None:
        reason = "host facts unavailable" + (f": {evidence['host_error']}" if "host_error" in evidence else "")
    else:
        reason = f"kubelet {kubelet_state}, swap off, no swap refusal in the kubelet journal"
    chain = [f"node NotReady for a cause runbook does not know ({reason})"]
    links = ["NotReady (cause unknown)"]
    if host is not None and tail:
        err = last_error(tail)
        evidence["kubelet_last_error"] = err
        chain.append(f"kubelet's last error: {_err(err)}")
    if waiting:
        chain.append(vm_link)
        links.append(vm_link.split(" (")[0])
    return Diagnosis(node_name, "unknown", tuple(chain), None, evidence, tuple(notes), tuple(links))


# -- reading --------------------------------------------------------------------------------------


def gather_and_explain(node_name: str, kube: KubeAPI, nodes: NodeAutomation | None) -> Diagnosis:
    """Read everything in parallel (read-only), then explain."""

    def host_facts() -> HostFacts | Exception | None:
        if nodes is None:
            return None
        try:
            return nodes.gather_facts([node_name])[node_name]
        except RunbookError as e:
            return e

    def listing(api_version: str, plural: str) -> list[Mapping[str, Any]] | Exception:
        try:
            return kube.list_objects(api_version, plural)
        except RunbookError as e:
            return e

    def pods_on_node() -> list[Mapping[str, Any]] | Exception:
        found = listing("v1", "pods")
        if isinstance(found, Exception):
            return found
        return [p for p in found if (p.get("spec") or {}).get("nodeName") == node_name]

    with ThreadPoolExecutor(max_workers=5) as pool:
        node_f = pool.submit(kube.read_node, node_name)
        host_f = pool.submit(host_facts)
        vms_f = pool.submit(listing, "kubevirt.io/v1", "virtualmachines")
        kv_f = pool.submit(listing, "kubevirt.io/v1", "kubevirts")
        pods_f = pool.submit(pods_on_node)
        node = node_f.result()
        kubevirts = kv_f.result()
        return explain(node_name, node, host_f.result() if node is not None else None, vms_f.result(),
                       kubevirts=kubevirts if not isinstance(kubevirts, Exception) else (),
                       pods=pods_f.result())


# -- rendering ------------------------------------------------------------------------------------


def render_text(d: Diagnosis) -> str:
    head = {"swap": "root cause: swap", "healthy": "healthy", "unknown": "cause unknown",
            "node-missing": "no such node"}[d.cause]
    lines = [f"node {d.node}: {head}", f"  {d.summary}", ""]
    lines += [("  " if i == 0 else "  -> ") + link for i, link in enumerate(d.chain)]
    for note in d.notes:
        lines.append(f"note: {note}")
    if d.fix:
        lines += ["", f"fix: {d.fix}", f"     (review it first: runbook plan {d.fix.split()[2]} --node {d.node})"]
    elif d.cause == "unknown":
        lines += ["", "runbook does not recognise this cause and proposes no fix; evidence:"]
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
        print(json.dumps(d.as_json(), indent=2, default=str))
    else:
        print(render_text(d))
    return d.exit_code
