"""``runbook diagnose``: read-only evidence, and the runbooks whose declared diagnosis matches it.

Each runbook may declare a ``diagnosis`` (model.DiagnosisSpec): the cause it fixes, the evidence
that identifies it (checks over facts, the kinds steps use; required or supporting) and what rules
it out. ``diagnose`` gathers the facts of one node or of every sick node once (one read-only
facts run for all hosts), evaluates every runbook's diagnosis over them, and ranks the matches:
cause, matched and unmatched evidence, confidence and the exact command with its params. When no
runbook matches it says so plainly, with the evidence it gathered (exit 1); a match or a healthy
node is exit 0. No cause is known to the code: the catalogue is the runbooks directory (each runbook's
``diagnosis`` and ``diagnoses``), and what it knows about the fleet (the workload label, the GPU labels
and resources, what to say about a healthy node) is data, ``runbooks/catalogue/fleet.yaml``
(model.Fleet). A Ready node is examined like a sick one: a GPU fault (an Xid, a pending row remap, a
stopped fabric manager) leaves it Ready.

It never changes anything. ``explain`` and ``evaluate_diagnosis`` are pure (facts in, value out);
``gather`` reads, in parallel; ``render_text``/``render_table`` turn the values into text. The
command itself (options, connectors, printing, exit code) is ``engine.app.diagnose``.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import checks as chk
from engine.errors import ExitCode, LoadError, RunbookError
from engine.facts import Facts, HostFacts, NodeFacts, same_pci_slot
from engine.resources import object_resources, parse_quantity

if TYPE_CHECKING:
    from engine.connectors.base import KubeAPI, NodeAutomation
    from engine.model import DiagnosisSpec, Evidence, Fleet, Runbook

CONFIDENCE_RANK = {"high": 0, "medium": 1, "low": 2}


@dataclass(frozen=True)
class EvidenceResult:
    """One declared piece of evidence as evaluated on this node's facts."""

    id: str
    check: str  # the check, described
    weight: str  # "required" | "supporting" (excludes: "required")
    holds: bool | None  # None: could not be evaluated (a probe failed)
    observed: str = ""
    says: str = ""


@dataclass(frozen=True)
class Match:
    """One runbook's diagnosis on one node: matched or not, with every piece of evidence."""

    runbook: str
    cause: str
    title: str
    matched: bool
    confidence: str  # "high" | "medium" | "low" ("" when not matched)
    evidence: tuple[EvidenceResult, ...]
    excluded_by: tuple[EvidenceResult, ...] = ()
    command: str = ""

    @property
    def score(self) -> tuple[int, float, str]:
        held = sum(1 for e in self.evidence if e.holds is True)
        return (CONFIDENCE_RANK.get(self.confidence, 3), -held / max(len(self.evidence), 1), self.runbook)

    def as_json(self) -> dict[str, Any]:
        return {"runbook": self.runbook, "cause": self.cause, "title": self.title, "matched": self.matched,
                "confidence": self.confidence, "command": self.command,
                "evidence": [asdict(e) for e in self.evidence],
                "excluded_by": [asdict(e) for e in self.excluded_by]}


@dataclass(frozen=True)
class Diagnosis:
    node: str
    cause: str  # a runbook's cause id | "healthy" | "unknown" | "node-missing"
    chain: tuple[str, ...]  # each link with its evidence, in causal order
    fix: str | None  # the exact command of the best-matching runbook
    evidence: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # what else an operator must know (the vfio risk, waiting VMs)
    links: tuple[str, ...] = ()  # the chain's links without evidence ("swap", "kubelet down", ...)
    matches: tuple[Match, ...] = ()  # the matching runbooks, best first
    considered: tuple[Match, ...] = ()  # every runbook with a diagnosis that did not match
    state: str = ""  # "NotReady", "Ready,SchedulingDisabled", "Ready,GPU-less", ...

    @property
    def known(self) -> bool:
        return self.cause not in ("unknown", "node-missing")

    @property
    def runbook(self) -> str | None:
        return self.matches[0].runbook if self.matches else None

    @property
    def confidence(self) -> str:
        return self.matches[0].confidence if self.matches else ""

    @property
    def title(self) -> str:
        return self.matches[0].title if self.matches else ""

    @property
    def summary(self) -> str:
        """The chain in one line, its links without their evidence: ``swap -> kubelet down -> ...``."""
        return " -> ".join(self.links or self.chain)

    @property
    def exit_code(self) -> int:
        return ExitCode.OK if self.known else ExitCode.FAILED

    def as_json(self) -> dict[str, Any]:
        return {"node": self.node, "state": self.state, "cause": self.cause, "known": self.known,
                "runbook": self.runbook, "confidence": self.confidence, "title": self.title,
                "summary": self.summary, "chain": list(self.chain), "fix": self.fix,
                "matches": [m.as_json() for m in self.matches],
                "not_matched": [m.as_json() for m in self.considered],
                "notes": list(self.notes), "evidence": dict(self.evidence)}


# -- pure helpers ---------------------------------------------------------------------------------


def _devices(vm: Mapping[str, Any]) -> list[str]:
    """The resources a VirtualMachine asks for (``engine.resources``: hostDevices and gpus by deviceName)."""
    return [name for name, qty in object_resources(vm).items() if qty > 0]


def default_fleet() -> Fleet:
    """The fleet knowledge of the default runbooks folder (``runbooks/catalogue/fleet.yaml``)."""
    from engine.loader import default_runbooks_dir, fleet_path

    return _fleet_at(str(fleet_path(default_runbooks_dir()).resolve()))


@functools.lru_cache(maxsize=4)
def _fleet_at(path: str) -> Fleet:
    from engine.loader import load_fleet

    return load_fleet(Path(path))


def node_gpu_resources(node: NodeFacts, host: HostFacts | None,
                       kubevirts: Sequence[Mapping[str, Any]], fleet: Fleet | None = None) -> list[str]:
    """Resources a VM could get from this node: the node's GPU resources (``nvidia.com/*``), and the
    KubeVirt ``permittedHostDevices`` entries whose PCI vendor:device matches one of the host's GPUs."""
    fleet = fleet or default_fleet()
    out = {k for k in node.capacity if k.startswith(fleet.gpu_resource_prefix)}
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


def node_state(node: NodeFacts, fleet: Fleet) -> str:
    """``kubectl get nodes``' STATUS, plus ``GPU-less`` for a container GPU node advertising no GPU and
    ``GPUs:A/C`` when allocatable GPUs are fewer than capacity (the device plugin withholds some)."""
    parts = ["Ready" if node.ready else "NotReady"]
    if node.unschedulable:
        parts.append("SchedulingDisabled")
    if gpu_less(node, fleet):
        parts.append("GPU-less")
    elif gpus_withheld(node, fleet):
        parts.append(f"GPUs:{node.allocatable.get(fleet.gpu_resource, '0')}/{node.capacity.get(fleet.gpu_resource)}")
    return ",".join(parts)


def _quantity(value: str) -> Decimal | int:
    try:
        return parse_quantity(value)
    except ValueError:
        return 0


def gpu_less(node: NodeFacts, fleet: Fleet) -> bool:
    """A node set to serve its GPU to containers that advertises none (``nvidia.com/gpu`` 0 or absent)."""
    if node.labels.get(fleet.workload_label) != fleet.container_workload:
        return False
    return _quantity(node.allocatable.get(fleet.gpu_resource, "0")) < 1


def gpus_withheld(node: NodeFacts, fleet: Fleet) -> bool:
    """Fewer GPUs allocatable than the node's capacity: the device plugin reports some Unhealthy, or is down."""
    resource = fleet.gpu_resource
    return _quantity(node.allocatable.get(resource, "0")) < _quantity(node.capacity.get(resource, "0"))


def is_sick(node: NodeFacts, fleet: Fleet | None = None) -> bool:
    """NotReady, unschedulable, GPU-less nodes, or nodes with GPUs withheld."""
    fleet = fleet or default_fleet()
    return not node.ready or node.unschedulable or gpu_less(node, fleet) or gpus_withheld(node, fleet)


def to_examine(node: NodeFacts, fleet: Fleet | None = None) -> bool:
    """What ``diagnose --all`` looks at: the sick nodes and every GPU node (a GPU fault can leave a node
    Ready: its facts say, not its conditions)."""
    fleet = fleet or default_fleet()
    return is_sick(node, fleet) or any(node.labels.get(k) == "true" for k in fleet.gpu_node_labels)


def _params_for(runbook: Runbook, node: str) -> dict[str, Any]:
    params: dict[str, Any] = {k: p.default for k, p in runbook.params.items() if p.default is not None}
    if runbook.node_param:
        params[runbook.node_param] = node
    return params


def _evaluate_evidence(ev: Evidence, facts: Facts, params: Mapping[str, Any]) -> EvidenceResult:
    r = chk.evaluate(ev.check, facts, params)
    return EvidenceResult(ev.id, chk.describe(ev.check), ev.weight, r.holds, r.observed, ev.says)


def evaluate_diagnoses(runbook: Runbook, facts: Facts) -> list[Match]:
    """Pure: every diagnosis the runbook declares (``diagnosis``, then ``diagnoses``) over one node's facts."""
    out = [evaluate_diagnosis(runbook, facts, d) for d in runbook.all_diagnoses]
    return [m for m in out if m is not None]


def evaluate_diagnosis(runbook: Runbook, facts: Facts, diagnosis: DiagnosisSpec | None = None) -> Match | None:
    """Pure: one runbook's declared diagnosis (``diagnosis``: one of its ``diagnoses``) over one node's
    facts (None: it declares none).

    Matches when every required piece of evidence holds (unknown does not hold: fail closed) and no
    exclusion holds. Confidence: high when every supporting piece holds too, medium when some do,
    low when none do."""
    from engine.templating import context, render

    diag = diagnosis or runbook.diagnosis
    if diag is None:
        return None
    params = _params_for(runbook, facts.node_name)
    results = tuple(_evaluate_evidence(ev, facts, params) for ev in diag.evidence)
    excluded = tuple(r for r in (_evaluate_evidence(ev, facts, params) for ev in diag.excludes) if r.holds is True)
    required = [r for r in results if r.weight == "required"]
    supporting = [r for r in results if r.weight == "supporting"]
    matched = all(r.holds is True for r in required) and not excluded
    confidence = ""
    if matched:
        held = sum(1 for r in supporting if r.holds is True)
        confidence = "high" if held == len(supporting) else "medium" if held else "low"
    command = f"runbook run {runbook.name} --node {facts.node_name}"
    for key, template in diag.params.items():
        try:
            value = render(template, context(params, facts))
        except Exception as e:  # a param that cannot be filled is said, not guessed
            value = f"<cannot fill: {e}>"
        command += f" -p {key}={value}"
    return Match(runbook.name, diag.cause.id, diag.cause.title, matched, confidence, results, excluded, command)


def gpu_evidence(host: HostFacts) -> dict[str, Any]:
    """Per GPU (by PCI slot): its driver, its CUDA processes (and the UIDs of the pods they belong to)
    and what the NVIDIA stack says about it
    (Xids since its last reset, a pending or failed row remap, lost, persistence mode)."""
    h = host.gpu_health
    out: dict[str, Any] = {}
    for g in host.gpus:
        remap = next((r for r in h.remaps if same_pci_slot(r.slot, g.slot)), None)
        out[g.slot] = {"name": g.name, "driver": g.driver,
                       "cuda_processes": [p.pid for p in host.processes_on(g)],
                       "pods": sorted({p.pod_uid for p in host.processes_on(g) if p.pod_uid}),
                       "xids": [x.code for x in h.xids_on(g.slot)],
                       "remap_pending": remap.pending if remap else None,
                       "remap_failure": remap.failure if remap else None,
                       "lost": any(same_pci_slot(s, g.slot) for s in h.lost),
                       "persistence": h.persistence.get(g.slot)}
    return out


def explain(facts: Facts, catalogue: Sequence[Runbook], *, vms: Sequence[Mapping[str, Any]] | Exception = (),
            kubevirts: Sequence[Mapping[str, Any]] = (),
            pods: Sequence[Mapping[str, Any]] | Exception = (), fleet: Fleet | None = None) -> Diagnosis:
    """Pure: one node's facts, the runbooks' diagnoses and the fleet knowledge in, the diagnosis out."""
    fleet = fleet or default_fleet()
    node_name, node = facts.node_name, facts.node
    evidence: dict[str, Any] = {}
    if node is None or not node.exists:
        errors = [f"{e.probe}: {e.message}" for e in facts.errors if e.probe == chk.NODE]
        return Diagnosis(node_name, "node-missing", (f"node {node_name} does not exist in the cluster"
                                                      + (f" ({'; '.join(errors)})" if errors else ""),),
                         None, {"node": None, "errors": errors}, state="missing")
    host = facts.host
    state = node_state(node, fleet)
    ready = node.condition("Ready")
    workload = node.labels.get(fleet.workload_label)
    evidence["state"] = state
    evidence["ready"] = asdict(ready) if ready else None
    evidence["conditions"] = [asdict(c) for c in node.conditions]
    evidence["taints"] = [asdict(t) for t in node.taints]
    evidence["workload_label"] = workload
    evidence["gpu_labels"] = {k: v for k, v in sorted(node.labels.items())
                              if k.startswith(fleet.gpu_label_prefixes)}
    evidence["allocatable_gpu"] = {k: v for k, v in node.allocatable.items() if k.startswith(fleet.gpu_resource_prefix)}
    evidence["capacity_gpu"] = {k: v for k, v in node.capacity.items() if k.startswith(fleet.gpu_resource_prefix)}
    host_errors = [e.message for e in facts.errors if e.probe == chk.HOST]
    if host_errors:
        evidence["host_error"] = "; ".join(host_errors)
    if host is not None:
        kubelet = host.service("kubelet")
        evidence["swap_devices"] = [asdict(d) for d in host.swap_devices]
        evidence["fstab_active_swap"] = list(host.fstab_active_swap)
        evidence["unhandled_swap_sources"] = list(host.unhandled_swap_sources)
        evidence["kubelet_state"] = kubelet.state
        evidence["kubelet_journal_tail"] = kubelet.journal_tail.splitlines()[-5:]
        evidence["units"] = {name: svc.state for name, svc in sorted(host.services.items())}
        evidence["gpu_driver"] = host.gpu_driver
        evidence["gpus"] = [asdict(g) for g in host.gpus]
        evidence["cuda_processes"] = [asdict(p) for p in host.cuda_processes]
        evidence["per_gpu"] = gpu_evidence(host)
        evidence["nvidia_smi"] = {"exit_code": host.gpu_health.smi_rc, "error": host.gpu_health.smi_error}
    resources = node_gpu_resources(node, host, kubevirts, fleet)
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

    notes: list[str] = []
    vm_names = ", ".join(v["vm"].split("/")[-1] for v in waiting)
    vm_link = (f"{len(waiting)} VM{'s' if len(waiting) != 1 else ''} {waiting[0]['status']} ({vm_names})"
               if waiting else "")

    evaluated = [m for rb in catalogue for m in evaluate_diagnoses(rb, facts) if m is not None]
    matches = tuple(sorted((m for m in evaluated if m.matched), key=lambda m: m.score))
    considered = tuple(sorted((m for m in evaluated if not m.matched), key=lambda m: (m.runbook, m.cause)))
    kubelet_state = host.service("kubelet").state if host is not None else "unknown"
    looks_healthy = node.ready and kubelet_state in ("active", "unknown") and not is_sick(node, fleet)
    if looks_healthy and not matches:
        seen = f"kubelet {kubelet_state}" if host is not None else "no host facts"
        chain = [f"nothing is wrong: node {node_name} is Ready ({seen}, workload {workload or 'unset'})"]
        if waiting and workload != fleet.passthrough_workload and fleet.waiting_vms_note:
            notes.append(fleet.waiting_vms_note.replace("{vms}", vm_link).replace("{resources}", ", ".join(resources))
                         .replace("{node}", node_name))
        return Diagnosis(node_name, "healthy", tuple(chain), None, evidence, tuple(notes), ("Ready",),
                         considered=considered, state=state)

    tail = host.service("kubelet").journal_tail if host is not None else ""
    # The node's side of the chain: what the cause did to it, common to every cause.
    status = ready.status if ready else "missing"
    reason = f", {ready.reason}" if ready and ready.reason else ""
    node_links: list[tuple[str, str]] = []
    if kubelet_state not in ("active", "unknown"):
        err = last_error(tail)
        node_links.append(("kubelet down", f"kubelet down (systemctl is-active: {kubelet_state}"
                                           + (f"; journal: {_err(err)}" if err else "") + ")"))
    if not node.ready:
        node_links.append(("NotReady", f"node NotReady (Ready={status}{reason}; taints "
                           f"{', '.join(sorted({t.key + ':' + t.effect for t in node.taints})) or 'none'})"))
    if node.unschedulable:
        node_links.append(("cordoned", "node cordoned (unschedulable)"))
    gone = [k for k in fleet.gpu_labels if k not in node.labels]
    if gone and (host is None or host.gpus or workload):
        node_links.append(("GPU labels gone", f"GPU labels gone ({', '.join(gone)} absent"
                           + (f": {fleet.gpu_labels_gone}" if fleet.gpu_labels_gone else "") + ")"))
    if gpus_withheld(node, fleet):
        node_links.append(("GPUs withheld", f"allocatable {fleet.gpu_resource} "
                           f"{node.allocatable.get(fleet.gpu_resource, '0')} of capacity "
                           f"{node.capacity.get(fleet.gpu_resource)}"))
    if waiting:
        node_links.append((vm_link.split(" (")[0], f"{vm_link.split(' (')[0]} ("
                           + "; ".join(f"{v['vm']} asks for {', '.join(v['asks_for'])}" for v in waiting) + ")"))
    notes += declared_notes(catalogue, facts)

    if matches:
        best = matches[0]
        chain = [f"{best.title} [{best.runbook}, confidence {best.confidence}]"]
        chain += [text for _, text in node_links]  # the evidence itself: the match's lines
        links = [best.cause, *(link for link, _ in node_links)]
        for other in matches[1:]:
            notes.append(f"also matches: {other.cause} ({other.runbook}, confidence {other.confidence}): "
                         f"{other.command}")
        return Diagnosis(node_name, best.cause, tuple(chain), best.command, evidence, tuple(notes), tuple(links),
                         matches, considered, state)

    if host is None:
        why = "host facts unavailable" + (f": {evidence['host_error']}" if "host_error" in evidence else "")
    else:
        why = (f"kubelet {kubelet_state}; swap {'on' if host.swap_active else 'off'}; units "
               + (", ".join(f"{k} {v}" for k, v in evidence["units"].items()) or "none read"))
    chain = [f"node {node_name} is {state}: no runbook addresses this ({why})"]
    if host is not None and tail:
        err = last_error(tail)
        evidence["kubelet_last_error"] = err
        chain.append(f"kubelet's last error: {_err(err)}")
    chain += [text for link, text in node_links if link != "kubelet down"]
    links = ["no runbook addresses this", *(link for link, _ in node_links)]
    return Diagnosis(node_name, "unknown", tuple(chain), None, evidence, tuple(notes), tuple(links),
                     (), considered, state)


# -- reading --------------------------------------------------------------------------------------


def load_catalogue(runbooks_dir: Path) -> tuple[list[Runbook], list[str]]:
    """Every runbook of the directory that declares a diagnosis, and the files that failed to load
    (said, not fatal: one broken runbook must not hide the others' diagnoses)."""
    from engine.loader import find_runbooks, load_runbook

    out: list[Runbook] = []
    problems: list[str] = []
    for path in find_runbooks(runbooks_dir):
        try:
            rb = load_runbook(path)
        except LoadError as e:
            problems.append(str(e).splitlines()[0])
            continue
        if rb.all_diagnoses:
            out.append(rb)
    return out, problems


def catalogue_probes(catalogue: Sequence[Runbook], node: str) -> set[Any]:
    """The probes every diagnosis needs (the node and its host always: the evidence shows both)."""
    probes: set[Any] = {chk.NODE, chk.HOST}
    for rb in catalogue:
        params = _params_for(rb, node)
        for diag in rb.all_diagnoses:
            probes |= chk.required_probes([ev.check for ev in (*diag.evidence, *diag.excludes)]
                                          + [n.when for n in diag.notes], params)
    return probes


def declared_notes(catalogue: Sequence[Runbook], facts: Facts) -> list[str]:
    """Pure: the runbooks' diagnosis notes whose condition holds on this node (unknown does not),
    rendered over params and facts, in catalogue order."""
    from engine.templating import context, render

    out: list[str] = []
    for rb in catalogue:
        params = _params_for(rb, facts.node_name)
        for note in (n for diag in rb.all_diagnoses for n in diag.notes):
            if chk.evaluate(note.when, facts, params).holds is not True:
                continue
            try:
                out.append(render(note.says, context(params, facts)))
            except Exception as e:  # a note that cannot be filled is said, not guessed
                out.append(f"{note.says} <cannot fill: {e}>")
    return out


def check_runbook(runbook: Runbook, node: str, kube: KubeAPI, nodes: NodeAutomation | None) -> Match:
    """One runbook's declared diagnoses on one node, from facts read now (read-only): what a
    ``require_diagnosis`` trigger asks before its run plans. The best match of its causes, else the
    first cause's non-match. Facts that cannot be read make the evidence unknown, which does not
    hold: the diagnosis does not match (fail closed)."""
    from engine import probes as prb

    if not runbook.all_diagnoses:
        raise RunbookError(f"runbook {runbook.name} declares no diagnosis")
    facts = prb.gather_probes_many(catalogue_probes([runbook], node), [node], kube, nodes)[node]
    evaluated = [m for m in evaluate_diagnoses(runbook, facts) if m is not None]
    matched = sorted((m for m in evaluated if m.matched), key=lambda m: m.score)
    return matched[0] if matched else evaluated[0]


def match_reason(m: Match, node: str) -> str:
    """One line for a journal or a notification: does the diagnosis match, and on what evidence."""
    if m.matched:
        held = ", ".join(e.id for e in m.evidence if e.holds is True)
        return f"diagnosis {m.cause} ({m.runbook}) matches {node}, confidence {m.confidence}: {held}"
    why = [f"{e.id} {'unknown' if e.holds is None else 'does not hold'}" + (f" [{e.observed}]" if e.observed else "")
           for e in m.evidence if e.weight == "required" and e.holds is not True]
    why += [f"excluded by {e.id}" + (f" [{e.observed}]" if e.observed else "") for e in m.excluded_by]
    return (f"diagnosis {m.cause} ({m.runbook}) does not match {node}: {'; '.join(why)}; "
            "the runbook does not address this, so nothing was planned or changed "
            f"(see `runbook diagnose --node {node}`)")


def gather(node_names: Sequence[str], kube: KubeAPI, nodes: NodeAutomation | None,
           catalogue: Sequence[Runbook], fleet: Fleet | None = None) -> list[Diagnosis]:
    """Read everything (read-only): node objects, one host-facts run for all ``node_names``, object
    lists once; then explain each node."""
    from engine import probes as prb

    if not node_names:
        return []
    probes: set[Any] = set()
    for n in node_names:
        probes |= catalogue_probes(catalogue, n)

    def listing(api_version: str, plural: str) -> list[Mapping[str, Any]] | Exception:
        try:
            return kube.list_objects(api_version, plural)
        except RunbookError as e:
            return e

    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="diagnose") as pool:
        facts_f = pool.submit(prb.gather_probes_many, probes, list(node_names), kube, nodes)
        vms_f = pool.submit(listing, "kubevirt.io/v1", "virtualmachines")
        kv_f = pool.submit(listing, "kubevirt.io/v1", "kubevirts")
        pods_f = pool.submit(listing, "v1", "pods")
        facts, vms, kubevirts, pods = facts_f.result(), vms_f.result(), kv_f.result(), pods_f.result()
    out = []
    for n in node_names:
        f = facts[n]
        node_errors = [e for e in f.errors if e.probe == chk.NODE]
        if f.node is None and node_errors:
            raise RunbookError(f"reading node {n}: {node_errors[0].message}")
        on_node: Sequence[Mapping[str, Any]] | Exception
        on_node = pods if isinstance(pods, Exception) else [
            p for p in pods if (p.get("spec") or {}).get("nodeName") == n]
        out.append(explain(f, catalogue, vms=vms, kubevirts=kubevirts if not isinstance(kubevirts, Exception) else (),
                           pods=on_node, fleet=fleet))
    return out


# -- rendering ------------------------------------------------------------------------------------


def _evidence_line(e: EvidenceResult) -> str:
    mark = {True: "+", False: "-", None: "?"}[e.holds]
    text = e.says or e.check
    return f"    {mark} {e.id} ({e.weight}): {text}" + (f" [{e.observed}]" if e.observed else "")


def render_text(d: Diagnosis) -> str:
    head = {"healthy": "nothing is wrong", "unknown": "no runbook addresses this",
            "node-missing": "no such node"}.get(d.cause, f"root cause: {d.cause}")
    lines = [f"node {d.node}: {head}", f"  {d.summary}", ""]
    lines += [("  " if i == 0 else "  -> ") + link for i, link in enumerate(d.chain)]
    for note in d.notes:
        lines.append(f"note: {note}")
    for i, m in enumerate(d.matches):
        lines += ["", f"{'match' if i == 0 else 'also'}: {m.runbook} ({m.cause}, confidence {m.confidence}): "
                      f"{m.title}"]
        lines += [_evidence_line(e) for e in m.evidence]
    if d.fix:
        lines += ["", f"fix: {d.fix}", f"     (review it first: {d.fix.replace('runbook run', 'runbook plan', 1)})"]
    elif d.cause == "unknown":
        lines += ["", "no runbook addresses this: runbook proposes no fix; evidence:"]
        for k, v in d.evidence.items():
            lines.append(f"  {k}: {json.dumps(v, default=str)}")
        for m in d.considered:
            lines.append(f"  not {m.cause} ({m.runbook}): "
                         + "; ".join(f"{e.id} {'unknown' if e.holds is None else 'does not hold'}"
                                     for e in m.evidence if e.weight == "required" and e.holds is not True)
                         + "".join(f"; excluded by {e.id}" for e in m.excluded_by))
    return "\n".join(lines)


def render_table(ds: Sequence[Diagnosis]) -> str:
    """One row per node and cause: a node with two faults (a GPU Xid and swap) has a row for each match."""
    rows = [("NODE", "STATE", "CAUSE", "RUNBOOK", "CONFIDENCE", "COMMAND")]
    for d in ds:
        cause = {"unknown": "no runbook addresses this"}.get(d.cause, d.cause)
        rows.append((d.node, d.state, cause, d.runbook or "-", d.confidence or "-", d.fix or "-"))
        for m in d.matches[1:]:
            rows.append((d.node, d.state, m.cause, m.runbook, m.confidence, m.command))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(v.ljust(widths[i]) for i, v in enumerate(r[:5])) + "  " + r[5] for r in rows).rstrip()
