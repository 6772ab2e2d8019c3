"""``runbook diagnose``: facts in, causal chain and fix out (``explain`` is pure)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from fakes import (
    SWAP_REFUSAL,
    healthy_host,
    healthy_node,
    incident_host,
    incident_node,
    make_host,
    make_node,
)

from engine.diagnose import Diagnosis, explain, last_error, node_gpu_resources, pod_status, render_text
from engine.errors import HostError
from engine.facts import GpuDevice, Taint

RTX = "nvidia.com/GB202_GEFORCE_RTX_5090"
CRI_ERROR = ('E1202 16:33:07.992404 2031 run.go:72] "command failed" err="failed to run Kubelet: validate '
             'service connection: validate CRI v1 runtime API for endpoint \\"unix:///var/run/containerd/'
             'containerd.sock\\": rpc error: code = Unavailable"')
KUBEVIRT = [{"spec": {"configuration": {"permittedHostDevices": {"pciHostDevices": [
    {"pciVendorSelector": "10de:2b85", "resourceName": RTX},
    {"pciVendorSelector": "10de:2204", "resourceName": "nvidia.com/GA102_GEFORCE_RTX_3090"}]}}}}]


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


def test_the_incident_is_explained_as_the_swap_chain_with_the_recovery_command() -> None:
    d = explain("omen2", unreachable(incident_node()), incident_host(), VMS, kubevirts=KUBEVIRT)
    assert d.cause == "swap" and d.known and d.exit_code == 0
    assert d.summary == "swap on -> kubelet refuses -> NotReady -> GPU labels gone -> 2 VMs ErrorUnschedulable"
    assert d.fix == "runbook run gpu-node-recovery --node omen2"
    assert d.chain[0] == "swap on (/swapfile)"
    assert "running with swap on is not supported" in d.chain[1] and "activating" in d.chain[1]
    assert "node.kubernetes.io/unreachable:NoExecute" in d.chain[2]
    assert "gpu-vms/gpu-fedora asks for nvidia.com/GB202_GEFORCE_RTX_5090" in d.chain[-1]
    assert any("vfio-pci" in n and "1 CUDA job" not in n for n in d.notes)  # the vm-passthrough warning


def test_only_the_vms_asking_for_this_nodes_gpu_are_counted() -> None:
    d = explain("omen2", incident_node(), incident_host(), VMS, kubevirts=KUBEVIRT)
    assert [v["vm"] for v in d.evidence["waiting_gpu_vms"]] == ["gpu-vms/gpu-fedora", "gpu-vms/rhel9-gpu-vm"]
    assert d.evidence["waiting_gpu_vms"][0]["why"].endswith(f"Insufficient {RTX}.")


def test_a_node_resources_come_from_its_capacity_and_the_kubevirt_mapping_of_its_gpus() -> None:
    node = replace(incident_node(), capacity={"cpu": "16", "nvidia.com/gpu": "1"})
    assert node_gpu_resources(node, incident_host(), KUBEVIRT) == [RTX, "nvidia.com/gpu"]
    assert node_gpu_resources(node, None, KUBEVIRT) == ["nvidia.com/gpu"]


def test_swap_already_off_but_refused_in_the_journal_is_still_the_swap_cause() -> None:
    host = make_host(swap=False, kubelet="activating", journal=SWAP_REFUSAL)
    d = explain("omen2", incident_node(), host, [])
    assert d.cause == "swap" and "kubelet journal shows the refusal" in d.chain[0]


def test_a_node_down_for_another_cause_is_unknown_with_kubelets_last_error() -> None:
    host = replace(make_host("gpu-3090-2", kubelet="activating", journal="Started kubelet.\n" + CRI_ERROR + "\n"),
                   gpus=(GpuDevice("01:00.0", "10de:2204", "GA102 [GeForce RTX 3090]", "nvidia"),))
    d = explain("gpu-3090-2", make_node("gpu-3090-2", ready=False), host, VMS, kubevirts=KUBEVIRT)
    assert d.cause == "unknown" and not d.known and d.exit_code == 1 and d.fix is None
    assert "swap off, no swap refusal" in d.chain[0]
    assert d.chain[1].startswith('kubelet\'s last error: err="failed to run Kubelet: validate service connection')
    # the 5090 VMs do not wait for a 3090 node; the VM asking for a 3090 does
    assert [v["vm"] for v in d.evidence["waiting_gpu_vms"]] == ["gpu-vms/a3090-vm"]
    assert d.summary == "NotReady (cause unknown) -> 1 VM ErrorUnschedulable"
    text = render_text(d)
    assert "cause unknown" in text and "proposes no fix" in text and "kubelet_state" in text


def test_unreachable_host_facts_are_evidence_not_a_guess() -> None:
    d = explain("omen2", incident_node(), HostError("omen2 unreachable", host="omen2"), VMS)
    assert d.cause == "unknown" and "host facts unavailable: omen2 unreachable" in d.chain[0]


def test_a_healthy_node_is_known_and_mentions_the_vms_still_waiting_for_its_gpu() -> None:
    d = explain("omen2", healthy_node(), healthy_host(), VMS, kubevirts=KUBEVIRT)
    assert d.cause == "healthy" and d.exit_code == 0 and d.summary == "Ready"
    assert any("gpu-workload-switch --node omen2 -p workload=vm-passthrough" in n for n in d.notes)


def test_a_missing_node_is_not_a_known_cause() -> None:
    d = explain("nope", None, None, [])
    assert d.cause == "node-missing" and d.exit_code == 1


def test_pod_statuses_read_like_kubectl() -> None:
    assert pod_status({"metadata": {"deletionTimestamp": "x"}, "status": {"phase": "Running"}}) == "Terminating"
    assert pod_status({"status": {"phase": "Running", "containerStatuses": [
        {"state": {"terminated": {"reason": "Error"}}}]}}) == "Error"
    assert pod_status({"status": {"phase": "Running"}}) == "Running"
    pods = [{"metadata": {"namespace": "gpu-operator", "name": "p"}, "status": {"phase": "Pending"}}]
    d = explain("omen2", incident_node(), incident_host(), [], pods=pods)
    assert d.evidence["pod_statuses"] == {"Pending": 1}


def test_last_error_prefers_klog_error_lines() -> None:
    tail = f"{CRI_ERROR}\nsystemd[1]: kubelet.service: Failed with result 'exit-code'.\n"
    assert last_error(tail) == CRI_ERROR
    assert last_error("") == ""


def test_json_form_carries_summary_chain_fix_and_evidence() -> None:
    d = explain("omen2", incident_node(), incident_host(), VMS, kubevirts=KUBEVIRT)
    doc = json.loads(json.dumps(d.as_json()))  # what `diagnose -o json` prints: plain JSON values
    assert set(doc) == {"node", "cause", "known", "summary", "chain", "fix", "notes", "evidence"}
    assert (doc["node"], doc["cause"], doc["known"]) == ("omen2", "swap", True)
    assert doc["summary"] == "swap on -> kubelet refuses -> NotReady -> GPU labels gone -> 2 VMs ErrorUnschedulable"
    assert doc["fix"] == "runbook run gpu-node-recovery --node omen2"
    assert [link.split(" (")[0] for link in doc["chain"]] == [
        "swap on", "kubelet refuses to start", "node NotReady", "GPU labels gone", "2 VMs ErrorUnschedulable"]
    assert "running with swap on is not supported" in doc["chain"][1]
    ev = doc["evidence"]
    assert (ev["kubelet_state"], ev["workload_label"], ev["gpu_driver"]) == ("activating", "vm-passthrough", "nvidia")
    assert ev["swap_devices"] == [{"name": "/swapfile", "type": "file", "size_bytes": 32 << 30}]
    assert ev["fstab_active_swap"] == ["/swapfile none swap sw 0 0"]
    assert [v["vm"] for v in ev["waiting_gpu_vms"]] == ["gpu-vms/gpu-fedora", "gpu-vms/rhel9-gpu-vm"]
    assert Diagnosis("n", "swap", ("x",), None).as_json()["fix"] is None  # no fix: null, not a made-up command
