"""``runbook diagnose``: facts and the runbooks' declared diagnoses in, ranked causes out (``explain`` is pure)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from engine.diagnose import (
    Diagnosis,
    explain,
    last_error,
    load_catalogue,
    node_gpu_resources,
    render_table,
    render_text,
)
from engine.errors import LoadError
from engine.facts import Facts, HostFacts, NodeFacts, ProbeError, ServiceFacts, Taint
from engine.loader import default_runbooks_dir, parse_runbook
from tests.fakes import (
    SWAP_REFUSAL,
    healthy_host,
    healthy_node,
    incident_host,
    incident_node,
    make_host,
    make_node,
)

RTX = "nvidia.com/GB202_GEFORCE_RTX_5090"
CRI_ERROR = ('E1202 16:33:07.992404 2031 run.go:72] "command failed" err="failed to run Kubelet: validate '
             'service connection: validate CRI v1 runtime API for endpoint \\"unix:///var/run/containerd/'
             'containerd.sock\\": rpc error: code = Unavailable"')
CERT_ERROR = ("E bootstrap.go:266] part of the existing bootstrap client certificate in /etc/kubernetes/kubelet.conf "
              "is expired: 2025-03-20 08:12:44 +0000 UTC\n"
              'E run.go:72] "command failed" err="failed to run Kubelet: unable to load bootstrap kubeconfig: stat '
              '/etc/kubernetes/bootstrap-kubelet.conf: no such file or directory"')
KUBEVIRT = [{"spec": {"configuration": {"permittedHostDevices": {"pciHostDevices": [
    {"pciVendorSelector": "10de:2b85", "resourceName": RTX},
    {"pciVendorSelector": "10de:2204", "resourceName": "nvidia.com/GA102_GEFORCE_RTX_3090"}]}}}}]
CATALOGUE, CATALOGUE_PROBLEMS = load_catalogue(default_runbooks_dir())


def vm(name: str, device: str | None, status: str = "ErrorUnschedulable") -> dict[str, Any]:
    devices: dict[str, Any] = {"hostDevices": [{"name": "gpu1", "deviceName": device}]} if device else {}
    return {"metadata": {"namespace": "gpu-vms", "name": name},
            "spec": {"template": {"spec": {"domain": {"devices": devices}}}},
            "status": {"printableStatus": status, "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": f"0/8 nodes are available: 7 Insufficient {RTX}.",
                 "lastTransitionTime": "2026-03-20T15:39:51Z"}]}}


VMS = [vm("gpu-fedora", RTX), vm("rhel9-gpu-vm", RTX), vm("ubuntu-dev", None, "Running"),
       vm("a3090-vm", "nvidia.com/GA102_GEFORCE_RTX_3090")]


def unreachable(node: Any) -> Any:
    return replace(node, taints=(Taint("node.kubernetes.io/unreachable", "NoSchedule"),
                                 Taint("node.kubernetes.io/unreachable", "NoExecute")))


def with_containerd(host: HostFacts, state: str, journal: str = "") -> HostFacts:
    return replace(host, services={**host.services, "containerd": ServiceFacts("containerd", state, journal)})


def facts(name: str, node: NodeFacts | None, host: HostFacts | None, *errors: ProbeError) -> Facts:
    return Facts(node_name=name, node=node, host=host, errors=errors)


def diagnose(name: str, node: NodeFacts | None, host: HostFacts | None, vms: Any = (), **kw: Any) -> Diagnosis:
    return explain(facts(name, node, host), CATALOGUE, vms=vms, **kw)


def test_the_packaged_catalogue_loads_and_names_three_causes() -> None:
    assert CATALOGUE_PROBLEMS == []
    # (the GPU catalogue's causes: tests/unit/test_diagnose_gpu_faults.py)
    assert {rb.name: rb.diagnosis.cause.id for rb in CATALOGUE if rb.diagnosis}.items() >= {
        "gpu-node-recovery": "swap", "containerd-recovery": "containerd",
        "kubelet-client-cert-expired": "kubelet-cert-expired"}.items()


def test_the_incident_is_explained_as_swap_with_the_recovery_command() -> None:
    d = diagnose("omen2", unreachable(incident_node()), with_containerd(incident_host(), "active"), VMS,
                 kubevirts=KUBEVIRT)
    assert d.cause == "swap" and d.known and d.exit_code == 0
    assert d.runbook == "gpu-node-recovery" and d.confidence == "high"
    assert d.fix == "runbook run gpu-node-recovery --node omen2"
    assert d.summary == "swap -> kubelet down -> NotReady -> GPU labels gone -> 2 VMs ErrorUnschedulable"
    assert any("vfio-pci" in n for n in d.notes)
    held = {e.id for e in d.matches[0].evidence if e.holds}
    assert held == {"node-not-ready", "swap-on-or-refused", "kubelet-refuses-swap", "kubelet-not-running"}
    assert [m.runbook for m in d.considered if m.runbook in ("containerd-recovery", "kubelet-client-cert-expired")] \
        == ["containerd-recovery", "kubelet-client-cert-expired"]
    assert [m.runbook for m in d.matches] == ["gpu-node-recovery"]  # no GPU cause on a host without GPU faults


def test_swap_already_off_but_refused_in_the_journal_is_still_swap() -> None:
    host = make_host(swap=False, kubelet="activating", journal=SWAP_REFUSAL)
    d = diagnose("omen2", incident_node(), host)
    assert d.cause == "swap"


def test_containerd_down_names_containerd_recovery_and_not_swap() -> None:
    host = with_containerd(make_host("gpu-3090-2", kubelet="activating", journal=CRI_ERROR), "failed")
    d = diagnose("gpu-3090-2", make_node("gpu-3090-2", ready=False), host)
    assert d.cause == "containerd" and d.runbook == "containerd-recovery" and d.confidence == "high"
    assert d.fix == "runbook run containerd-recovery --node gpu-3090-2"
    assert "containerd-recovery" in render_text(d) and "+ containerd-not-running" in render_text(d)


def test_containerd_not_read_is_not_evidence_of_containerd_down() -> None:
    host = make_host("gpu-3090-2", kubelet="activating", journal=CRI_ERROR)  # no containerd facts
    d = diagnose("gpu-3090-2", make_node("gpu-3090-2", ready=False), host)
    assert d.cause == "unknown" and d.exit_code == 1


def test_a_swap_refusal_excludes_containerd_even_with_containerd_down() -> None:
    host = with_containerd(make_host(swap=True, kubelet="activating", journal=SWAP_REFUSAL), "failed")
    d = diagnose("omen2", incident_node(), host)
    assert [m.runbook for m in d.matches] == ["gpu-node-recovery"]
    containerd = next(m for m in d.considered if m.runbook == "containerd-recovery")
    assert [e.id for e in containerd.excluded_by] == ["swap-refusal"]


def test_an_expired_client_certificate_names_its_runbook() -> None:
    host = with_containerd(make_host("gpu-3090-3", kubelet="activating", journal=CERT_ERROR), "active")
    d = diagnose("gpu-3090-3", make_node("gpu-3090-3", ready=False), host)
    assert d.cause == "kubelet-cert-expired" and d.confidence == "high"
    assert d.fix == "runbook run kubelet-client-cert-expired --node gpu-3090-3"


def test_a_node_down_for_a_cause_no_runbook_addresses_shows_the_evidence_and_exits_1() -> None:
    host = with_containerd(make_host("gpu-3090-4", kubelet="failed", journal='E x] "command failed" err="boom"'),
                           "active")
    d = diagnose("gpu-3090-4", make_node("gpu-3090-4", ready=False), host)
    assert d.cause == "unknown" and not d.known and d.exit_code == 1 and d.fix is None
    text = render_text(d)
    assert text.startswith("node gpu-3090-4: no runbook addresses this")
    assert 'err="boom"' in text and "units: " in text and "kubelet_state" in text
    assert "not swap (gpu-node-recovery): swap-on-or-refused does not hold" in text


def test_unreachable_host_facts_are_evidence_not_a_guess() -> None:
    d = explain(facts("omen2", incident_node(), None, ProbeError("host", "omen2 unreachable")), CATALOGUE,
                vms=VMS)
    assert d.cause == "unknown" and "omen2 unreachable" in d.evidence["host_error"]
    swap = next(m for m in d.considered if m.runbook == "gpu-node-recovery")
    assert next(e for e in swap.evidence if e.id == "swap-on-or-refused").holds is None


def test_a_healthy_node_says_nothing_is_wrong_and_mentions_the_vms_waiting_for_its_gpu() -> None:
    d = diagnose("omen2", healthy_node(), healthy_host(), VMS, kubevirts=KUBEVIRT)
    assert d.cause == "healthy" and d.exit_code == 0 and d.matches == ()
    assert render_text(d).startswith("node omen2: nothing is wrong")
    assert any("gpu-workload-switch" in n for n in d.notes)


def test_a_cordoned_ready_node_is_examined_not_called_healthy() -> None:
    node = replace(healthy_node(), unschedulable=True)
    d = diagnose("omen2", node, healthy_host())
    assert d.cause == "unknown" and d.state == "Ready,SchedulingDisabled"


def test_a_missing_node_is_not_a_known_cause() -> None:
    d = diagnose("nope", None, None)
    assert d.cause == "node-missing" and d.exit_code == 1


def test_pod_statuses_read_like_kubectl() -> None:
    pods = [{"metadata": {"namespace": "a", "name": "p1", "deletionTimestamp": "x"}},
            {"metadata": {"namespace": "a", "name": "p2"},
             "status": {"containerStatuses": [{"state": {"terminated": {"reason": "Error"}}}]}},
            {"metadata": {"namespace": "a", "name": "p3"}, "status": {"phase": "Running"}}]
    d = diagnose("omen2", incident_node(), incident_host(), pods=pods)
    assert d.evidence["pods"] == {"a/p1": "Terminating", "a/p2": "Error", "a/p3": "Running"}


def test_last_error_prefers_klog_error_lines() -> None:
    tail = f"I0101 info\n{CRI_ERROR}\nsystemd: kubelet.service: Scheduled restart job"
    assert last_error(tail) == CRI_ERROR


def test_a_node_resources_come_from_its_capacity_and_the_kubevirt_mapping_of_its_gpus() -> None:
    assert node_gpu_resources(incident_node(), incident_host(), KUBEVIRT) == [RTX, "nvidia.com/gpu"]


def test_json_form_carries_the_ranked_matches_with_matched_and_unmatched_evidence() -> None:
    d = diagnose("omen2", incident_node(), incident_host(), VMS, kubevirts=KUBEVIRT)
    doc = d.as_json()
    assert doc["cause"] == "swap" and doc["runbook"] == "gpu-node-recovery" and doc["known"] is True
    assert doc["matches"][0]["command"] == "runbook run gpu-node-recovery --node omen2"
    assert {e["id"]: e["holds"] for e in doc["matches"][0]["evidence"]}["kubelet-refuses-swap"] is True
    assert {m["runbook"] for m in doc["not_matched"]} >= {"containerd-recovery", "kubelet-client-cert-expired"}
    assert "gpu-node-recovery" not in {m["runbook"] for m in doc["not_matched"]}


def test_the_all_table_has_one_row_per_node() -> None:
    ds = [diagnose("omen2", incident_node(), incident_host()),
          diagnose("x", make_node("x", ready=False), make_host("x", kubelet="failed"))]
    lines = render_table(ds).splitlines()
    assert lines[0].split() == ["NODE", "STATE", "CAUSE", "RUNBOOK", "CONFIDENCE", "COMMAND"]
    assert lines[1].split()[:5] == ["omen2", "NotReady", "swap", "gpu-node-recovery", "high"]
    assert "no runbook addresses this" in lines[2]


RUNBOOK = """apiVersion: runbook/v1
name: r
version: "1"
params: {node: {type: node, required: true}}
diagnosis:
  cause: {id: c, title: t}
  evidence:
%s
steps:
  - {id: s, action: {check: {}}}
"""


@pytest.mark.parametrize(("evidence", "problem"), [
    ("    - {id: a, weight: supporting, check: {node_ready: false}}", "at least one piece of required evidence"),
    ("    - {id: a, check: {node_ready: false}}\n    - {id: a, check: {swap_active: true}}", "duplicate evidence id"),
    ("    - {id: a, check: {node_redy: false}}", "diagnosis.evidence[0].check"),
])
def test_a_bad_diagnosis_is_a_located_load_error(evidence: str, problem: str) -> None:
    with pytest.raises(LoadError) as e:
        parse_runbook((RUNBOOK % evidence).encode(), "r.yaml")
    assert problem in str(e.value) and "r.yaml:" in str(e.value)
