"""Checks against facts: table-driven. Unknowable checks answer None, and callers fail closed."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from pydantic import TypeAdapter

from engine import checks
from engine.checks import HOST, NODE, Check, HostFile, ObjectsQuery, parse_quantity
from engine.facts import Facts, FileFacts, ProbeError, Taint
from tests.fakes import make_host, make_node

CHECK = TypeAdapter(Check)

INCIDENT = Facts(
    node_name="omen2",
    node=make_node("omen2", ready=False, labels={"nvidia.com/gpu.workload.config": "vm-passthrough"},
                   taints=[Taint("node.kubernetes.io/not-ready", "NoSchedule")],
                   allocatable={"cpu": "16", "nvidia.com/gpu": "0"}),
    host=make_host("omen2", swap=True, fstab_swap=True, kubelet="activating", cuda=2,
                   journal='E0710 run.go:72] "command failed" err="failed to run Kubelet: running with swap on '
                           'is not supported, please disable swap"'),
    objects={"kubevirt.io/v1/virtualmachines": (
        {"metadata": {"name": "gpu-fedora", "namespace": "vms"}, "status": {"printableStatus": "ErrorUnschedulable"}},
        {"metadata": {"name": "rhel9-gpu-vm", "namespace": "vms"}, "status": {"printableStatus": "ErrorUnschedulable"}},
        {"metadata": {"name": "web", "namespace": "vms"}, "status": {"printableStatus": "Running"}},
    )},
)
HEALTHY = Facts(node_name="omen2",
                node=make_node("omen2", labels={"nvidia.com/gpu.workload.config": "container"},
                               allocatable={"nvidia.com/gpu": "1", "memory": "64Gi"}),
                host=make_host("omen2"))
BLIND = Facts(node_name="omen2", errors=(ProbeError("node", "connection refused"),
                                         ProbeError("host", "omen2: unreachable")))
GONE = Facts(node_name="omen2", node=make_node("omen2").__class__(name="omen2", exists=False), host=make_host())

VMS = {"objects": {"api_version": "kubevirt.io/v1", "kind": "VirtualMachine", "field": "status.printableStatus",
                   "equals": "ErrorUnschedulable"}}

CASES: list[tuple[str, dict[str, Any], Facts, bool | None]] = [
    ("node exists", {"node_exists": True}, INCIDENT, True),
    ("a missing node does not exist", {"node_exists": False}, GONE, True),
    ("the incident node is not ready", {"node_ready": False}, INCIDENT, True),
    ("a healthy node is ready", {"node_ready": True}, HEALTHY, True),
    ("label equals", {"node_label": {"key": "nvidia.com/gpu.workload.config", "equals": "vm-passthrough"}},
     INCIDENT, True),
    ("label differs", {"node_label": {"key": "nvidia.com/gpu.workload.config", "equals": "container"}},
     INCIDENT, False),
    ("label absent", {"node_label": {"key": "example.com/x", "absent": True}}, INCIDENT, True),
    ("label present", {"node_label": {"key": "nvidia.com/gpu.workload.config", "absent": False}}, INCIDENT, True),
    ("taint present", {"node_taint": {"key": "node.kubernetes.io/not-ready", "present": True}}, INCIDENT, True),
    ("taint with other effect", {"node_taint": {"key": "node.kubernetes.io/not-ready", "effect": "NoExecute",
                                                "present": True}}, INCIDENT, False),
    ("taint absent", {"node_taint": {"key": "node.kubernetes.io/not-ready", "present": False}}, HEALTHY, True),
    ("condition status", {"node_condition": {"type": "Ready", "status": False}}, INCIDENT, True),
    ("missing condition is Unknown", {"node_condition": {"type": "MemoryPressure", "status": "Unknown"}},
     INCIDENT, True),
    ("no GPU allocatable", {"allocatable": {"resource": "nvidia.com/gpu", "min": 1}}, INCIDENT, False),
    ("GPU allocatable", {"allocatable": {"resource": "nvidia.com/gpu", "min": 1}}, HEALTHY, True),
    ("quantities compare", {"allocatable": {"resource": "memory", "min": "32Gi"}}, HEALTHY, True),
    ("absent resource is zero", {"allocatable": {"resource": "example.com/fpga", "min": 1}}, HEALTHY, False),
    ("two GPU VMs unschedulable", {**VMS, "objects": {**VMS["objects"], "count": 2}}, INCIDENT, True),
    ("at least one unschedulable VM", VMS, INCIDENT, True),
    ("no unschedulable VM", {**VMS, "objects": {**VMS["objects"], "max": 0}}, INCIDENT, False),
    ("swap on", {"swap_active": True}, INCIDENT, True),
    ("swap off", {"swap_active": False}, HEALTHY, True),
    ("fstab has active swap", {"fstab_active_swap": True}, INCIDENT, True),
    ("kubelet activating", {"service": {"name": "kubelet", "state": "activating"}}, INCIDENT, True),
    ("kubelet active or activating", {"service": {"name": "kubelet", "state": ["active", "activating"]}},
     INCIDENT, True),
    ("kubelet not active", {"service": {"name": "kubelet", "state": "active"}}, INCIDENT, False),
    ("unknown service", {"service": {"name": "nginx", "state": "active"}}, INCIDENT, False),
    ("journal has the swap refusal", {"journal_contains": {"unit": "kubelet", "text": "swap on is not supported"}},
     INCIDENT, True),
    ("journal lacks text", {"journal_contains": {"unit": "kubelet", "text": "OOM"}}, INCIDENT, False),
    ("nvidia driver", {"gpu_driver": "nvidia"}, INCIDENT, True),
    ("not vfio", {"gpu_driver": "vfio-pci"}, INCIDENT, False),
    ("CUDA jobs running", {"cuda_processes": {"min": 1}}, INCIDENT, True),
    ("no CUDA jobs", {"cuda_processes": {"max": 0}}, INCIDENT, False),
    ("expr over facts", {"expr": "facts.host.swap_active and params.node == 'omen2'"}, INCIDENT, True),
    ("expr false", {"expr": "facts.node.ready"}, INCIDENT, False),
    ("all", {"all": [{"swap_active": True}, {"node_ready": False}]}, INCIDENT, True),
    ("any", {"any": [{"swap_active": False}, {"journal_contains": {"unit": "kubelet", "text": "swap"}}]},
     INCIDENT, True),
    ("not", {"not": {"node_ready": True}}, INCIDENT, True),
    ("templated equals", {"node_label": {"key": "nvidia.com/gpu.workload.config",
                                         "equals": "{{ params.workload }}"}}, HEALTHY, True),
    # Unknowable: probes failed, node gone, expression errors.
    ("node probe failed", {"node_ready": False}, BLIND, None),
    ("host probe failed", {"swap_active": False}, BLIND, None),
    ("label on a missing node", {"node_label": {"key": "a", "absent": True}}, GONE, None),
    ("expr over missing facts", {"expr": "facts.host.swap_active"}, BLIND, None),
    ("expr with an undefined param", {"expr": "params.nope"}, INCIDENT, None),
    ("objects never listed", {**VMS, "objects": {**VMS["objects"], "namespace": "other"}}, INCIDENT, None),
    ("not of unknown is unknown", {"not": {"swap_active": True}}, BLIND, None),
    ("all with a false part is false", {"all": [{"swap_active": True}, {"node_exists": False}]},
     Facts(node_name="omen2", node=make_node(), errors=(ProbeError("host", "down"),)), False),
    ("all with an unknown part is unknown", {"all": [{"swap_active": True}, {"node_exists": True}]},
     Facts(node_name="omen2", node=make_node(), errors=(ProbeError("host", "down"),)), None),
    ("any with a true part is true", {"any": [{"swap_active": True}, {"node_exists": True}]},
     Facts(node_name="omen2", node=make_node(), errors=(ProbeError("host", "down"),)), True),
    ("any with only false and unknown is unknown", {"any": [{"swap_active": True}, {"node_exists": False}]},
     Facts(node_name="omen2", node=make_node(), errors=(ProbeError("host", "down"),)), None),
]


@pytest.mark.parametrize(("check", "facts", "holds"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_check_against_facts(check: dict[str, Any], facts: Facts, holds: bool | None) -> None:
    result = checks.evaluate(CHECK.validate_python(check), facts, {"node": "omen2", "workload": "container"})
    assert result.holds is holds, result.observed
    assert result.observed


def test_unknown_results_say_which_probe_failed() -> None:
    r = checks.evaluate(CHECK.validate_python({"swap_active": False}), BLIND)
    assert r.holds is None and "unreachable" in r.observed
    assert not r.passed


def test_reads_record_stable_facts_but_not_journal_lines() -> None:
    c = CHECK.validate_python({"any": [{"swap_active": True},
                                       {"journal_contains": {"unit": "kubelet", "text": "swap"}}]})
    assert checks.evaluate(c, INCIDENT).reads == {"host.swap_active": True}
    label = CHECK.validate_python({"node_label": {"key": "nvidia.com/gpu.workload.config", "equals": "container"}})
    assert checks.evaluate(label, INCIDENT).reads == {"node.labels[nvidia.com/gpu.workload.config]": "vm-passthrough"}


@pytest.mark.parametrize("check", [
    {"node_label": {"key": "nvidia.com/gpu.workload.config", "equals": "container"}},
    {"node_label": {"key": "nvidia.com/gpu.workload.config", "absent": True}},
    {"node_ready": True},
    {"node_taint": {"key": "node.kubernetes.io/not-ready", "present": False}},
    {"node_taint": {"key": "example.com/drain", "effect": "NoSchedule", "present": True}},
    {"allocatable": {"resource": "nvidia.com/gpu", "min": 1}},
    {"swap_active": False},
    {"fstab_active_swap": False},
    {"service": {"name": "kubelet", "state": "active"}},
    {"gpu_driver": "vfio-pci"},
    {"cuda_processes": {"max": 0}},
    {"all": [{"swap_active": False}, {"node_ready": True}]},
])
def test_establish_predicts_facts_in_which_the_check_holds(check: dict[str, Any]) -> None:
    c = CHECK.validate_python(check)
    assert checks.evaluate(c, INCIDENT).holds is not True or check == {"node_ready": True}
    predicted = checks.establish(c, INCIDENT)
    assert checks.evaluate(c, predicted).holds is True


def test_establish_leaves_unknowable_checks_and_unknown_facts_alone() -> None:
    for check in ({"expr": "facts.node.ready"}, {"journal_contains": {"unit": "kubelet", "text": "x"}},
                  {"any": [{"swap_active": False}, {"node_ready": True}]}):
        assert checks.establish(CHECK.validate_python(check), INCIDENT) is INCIDENT
    assert checks.establish(CHECK.validate_python({"swap_active": False}), BLIND) is BLIND


def test_file_checks_read_the_files_the_host_probe_reported() -> None:
    host = make_host()
    facts = Facts(node_name="omen2", host=host.__class__(**{**host.__dict__, "files": {
        "/var/tmp/m": FileFacts("/var/tmp/m", True, "marker=done\n")}}))
    yes = CHECK.validate_python({"file": {"path": "/var/tmp/m", "contains": "marker=done"}})
    no = CHECK.validate_python({"file": {"path": "/var/tmp/other"}})
    assert checks.evaluate(yes, facts).holds is True
    assert checks.evaluate(no, facts).holds is None  # not gathered: unknown, not "absent"
    assert checks.required_probes([yes]) == {HOST, HostFile("/var/tmp/m")}


def test_required_probes_gather_only_what_checks_need() -> None:
    cs = [CHECK.validate_python(c) for c in (
        {"node_ready": True}, {"not": {"swap_active": True}}, VMS,
        {"objects": {"api_version": "v1", "kind": "Pod", "namespace": "{{ params.ns }}"}})]
    assert checks.required_probes(cs, {"ns": "gpu-operator"}) == {
        NODE, HOST, ObjectsQuery("kubevirt.io/v1", "virtualmachines"), ObjectsQuery("v1", "pods", "gpu-operator")}
    assert checks.required_probes([CHECK.validate_python({"node_label": {"key": "a", "absent": True}})]) == {NODE}
    assert checks.required_probes([CHECK.validate_python({"expr": "facts.host.swap_active"})]) == {HOST}


@pytest.mark.parametrize(("text", "value"), [
    ("1", Decimal(1)), ("500m", Decimal("0.5")), ("4Gi", Decimal(4 * 2**30)), ("2k", Decimal(2000)),
    ("1e3", Decimal(1000)), (3, Decimal(3)), ("0.5", Decimal("0.5")),
])
def test_kubernetes_quantities_parse(text: str | int, value: Decimal) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "1Gb", "one", "1 Gi"])
def test_bad_quantities_are_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        parse_quantity(text)


def test_checks_describe_themselves_for_plans() -> None:
    c = CHECK.validate_python({"node_label": {"key": "nvidia.com/gpu.workload.config", "equals": "{{ params.w }}"}})
    assert checks.describe_bound(c, {"w": "container"}) == "label nvidia.com/gpu.workload.config = container"
    assert checks.describe(CHECK.validate_python(VMS)) == \
        "at least 1 VirtualMachine with status.printableStatus = ErrorUnschedulable"


def test_cuda_processes_of_one_gpu_are_counted_and_established_apart_from_the_others() -> None:
    from dataclasses import replace

    from engine.facts import CudaProcess

    procs = (CudaProcess(1, "host-job", "01:00.0"), CudaProcess(2, "train", "02:00.0", pod_uid="u-1"))
    facts = Facts(node_name="gpu-quad", host=replace(make_host(), cuda_processes=procs))
    free = CHECK.validate_python({"cuda_processes": {"gpu": "02:00.0", "max": 0}})
    r = checks.evaluate(free, facts)
    assert r.holds is False and r.observed == "1 CUDA process on GPU 02:00.0: 2 train (pod u-1)"
    predicted = checks.establish(free, facts)
    assert checks.evaluate(free, predicted).holds is True
    assert predicted.host is not None and [p.pid for p in predicted.host.cuda_processes] == [1]  # others stay
    assert checks.evaluate(CHECK.validate_python({"cuda_processes": {"gpu": "0000:01:00.0", "max": 0}}),
                           facts).holds is False  # any form of the PCI address


def test_none_killed_except_one_gpu_forgives_only_that_gpus_processes() -> None:
    from dataclasses import replace

    from engine.facts import CudaProcess

    before = {"host": {"cuda_processes": [{"pid": 1, "name": "a", "gpu": "01:00.0"},
                                          {"pid": 2, "name": "b", "gpu": "02:00.0"}]}}
    now = Facts(node_name="gpu-quad", host=replace(make_host(), cuda_processes=(CudaProcess(1, "a", "01:00.0"),)))
    spared = CHECK.validate_python({"cuda_processes": {"none_killed": True, "except_gpu": "02:00.0"}})
    assert checks.evaluate(spared, now, baseline=before).holds is True
    other = CHECK.validate_python({"cuda_processes": {"none_killed": True, "except_gpu": "01:00.0"}})
    assert checks.evaluate(other, now, baseline=before).holds is False
    with pytest.raises(ValueError):
        CHECK.validate_python({"cuda_processes": {"max": 0, "except_gpu": "01:00.0"}})
