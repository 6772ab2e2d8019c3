"""The GPU failure catalogue's diagnosis rules (docs/catalogue.md): facts in, each fault's cause id (the
word ``runbook lab inject`` takes), its runbook, confidence and the GPU it names out; and the fleet
knowledge ``runbook diagnose`` reads as data (runbooks/catalogue/fleet.yaml), not code."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import pytest

from engine.diagnose import Diagnosis, explain, is_sick, load_catalogue, render_table, to_examine
from engine.errors import LoadError
from engine.facts import CudaProcess, Facts, GpuHealth, HostFacts, NodeFacts, RowRemap, XidEvent
from engine.loader import default_runbooks_dir, fleet_path, load_fleet
from tests.fakes import incident_host, make_host, make_node, quad_gpus

CATALOGUE, PROBLEMS = load_catalogue(default_runbooks_dir())
FLEET = load_fleet(fleet_path(default_runbooks_dir()))
GPU = "nvidia.com/gpu"
XID48 = "NVRM: Xid (PCI:0000:02:00): 48, pid=41001, name=python3, An uncorrectable double bit error (DBE)"


def quad_node(*, ready: bool = True, allocatable: int = 4, capacity: int = 4, **kw: object) -> NodeFacts:
    node = make_node("gpu-quad", ready=ready, labels={FLEET.workload_label: "container",
                                                      "feature.node.kubernetes.io/pci-10de.present": "true"}, **kw)
    return replace(node, allocatable=MappingProxyType({**node.allocatable, GPU: str(allocatable)}),
                   capacity=MappingProxyType({**node.capacity, GPU: str(capacity)}))


def quad_host(health: GpuHealth | None = None, **kw: object) -> HostFacts:
    gpus = tuple(replace(g, driver="nvidia") for g in quad_gpus())
    remaps = tuple(RowRemap(g.slot) for g in gpus)
    base = replace(make_host("gpu-quad"), gpus=gpus, gpu_health=GpuHealth(smi_rc=0, remaps=remaps),
                   cuda_processes=(CudaProcess(41000, "python3", "01:00.0"), CudaProcess(41001, "train.py", "41:00.0")))
    if health is not None:
        base = replace(base, gpu_health=replace(health, remaps=health.remaps or remaps))
    return replace(base, **kw)  # type: ignore[arg-type]


def diag(node: NodeFacts, host: HostFacts) -> Diagnosis:
    return explain(Facts(node_name=node.name, node=node, host=host), CATALOGUE, fleet=FLEET)


def test_the_catalogue_names_every_gpu_fault_after_its_inject_word() -> None:
    assert PROBLEMS == []
    causes = {d.cause.id: rb.name for rb in CATALOGUE for d in rb.all_diagnoses}
    assert {k: causes[k] for k in ("xid79", "xid48", "xid95", "row-remap-pending", "driver-mismatch",
                                   "device-plugin", "fabric-manager")} == {
        "xid79": "gpu-fallen-off-bus", "xid48": "gpu-reset", "xid95": "gpu-reset",
        "row-remap-pending": "gpu-reset", "driver-mismatch": "gpu-driver-reload",
        "device-plugin": "device-plugin-restart", "fabric-manager": "fabric-manager-restart"}


def test_an_xid48_on_one_gpu_of_a_ready_node_is_named_with_that_gpu_and_the_reset_command() -> None:
    host = quad_host(GpuHealth(smi_rc=0, xids=(XidEvent("02:00.0", 48, XID48),)))
    d = diag(quad_node(allocatable=3), host)
    assert (d.cause, d.runbook, d.confidence) == ("xid48", "gpu-reset", "high")
    assert d.fix == "runbook run gpu-reset --node gpu-quad -p gpu=02:00.0"
    assert d.state == "Ready,GPUs:3/4"
    assert d.evidence["per_gpu"]["02:00.0"]["xids"] == [48]
    assert d.evidence["per_gpu"]["01:00.0"] == {**d.evidence["per_gpu"]["01:00.0"], "xids": [],
                                                 "cuda_processes": [41000]}
    xid = next(e for e in d.matches[0].evidence if e.id == "xid48-logged")
    assert xid.observed == "GPU 02:00.0: Xid 48"


def test_xid95_and_a_pending_remap_are_each_named_on_their_own_gpu() -> None:
    d95 = diag(quad_node(allocatable=3), quad_host(GpuHealth(smi_rc=0, xids=(XidEvent("41:00.0", 95),))))
    assert (d95.cause, d95.fix) == ("xid95", "runbook run gpu-reset --node gpu-quad -p gpu=41:00.0")
    remaps = (RowRemap("01:00.0"), RowRemap("02:00.0"), RowRemap("41:00.0"), RowRemap("c1:00.0", pending=True))
    dr = diag(quad_node(), quad_host(GpuHealth(smi_rc=0, remaps=remaps)))
    assert (dr.cause, dr.fix) == ("row-remap-pending", "runbook run gpu-reset --node gpu-quad -p gpu=c1:00.0")


def test_a_lost_gpu_is_xid79_not_a_reset() -> None:
    health = GpuHealth(smi_rc=15, smi_error="Unable to determine the device handle for GPU00000000:41:00.0: GPU is "
                                            "lost.  Reboot the system to recover this GPU",
                       xids=(XidEvent("41:00.0", 79), XidEvent("41:00.0", 48)), lost=("41:00.0",))
    d = diag(quad_node(allocatable=3), quad_host(health))
    assert (d.cause, d.runbook, d.confidence) == ("xid79", "gpu-fallen-off-bus", "high")
    assert not any(m.cause == "xid48" for m in d.matches)  # excluded: a reset cannot help a lost GPU


def test_the_driver_mismatch_is_named_from_nvidia_smi_and_the_plugin_is_not_blamed() -> None:
    health = GpuHealth(smi_rc=18, smi_error="Failed to initialize NVML: Driver/library version mismatch")
    d = diag(quad_node(allocatable=0), quad_host(health, cuda_processes=()))
    assert (d.cause, d.runbook) == ("driver-mismatch", "gpu-driver-reload")
    assert [m.cause for m in d.matches] == ["driver-mismatch"]


def test_a_device_plugin_withholding_healthy_gpus_is_named() -> None:
    d = diag(quad_node(allocatable=0), quad_host())
    assert (d.cause, d.runbook) == ("device-plugin", "device-plugin-restart")
    assert d.confidence == "low"  # the pods were not listed here: its crash loop (supporting) is unknown


def test_a_stopped_fabric_manager_on_an_nvswitch_system_is_named() -> None:
    health = GpuHealth(smi_rc=0, nvswitches=4, fabric_manager_state="failed", fabric_manager_version="570.133.07",
                       driver_version="570.133.07")
    d = diag(quad_node(), quad_host(health))
    assert (d.cause, d.runbook, d.confidence) == ("fabric-manager", "fabric-manager-restart", "high")
    no_switch = diag(quad_node(), quad_host(replace(health, nvswitches=0)))
    assert no_switch.cause == "healthy"


def test_a_gpu_fault_plus_swap_gets_both_causes() -> None:
    host = replace(incident_host("gpu-quad"), gpus=quad_host().gpus,
                   gpu_health=GpuHealth(smi_rc=0, xids=(XidEvent("02:00.0", 48),)))
    d = diag(quad_node(ready=False), host)
    assert {m.cause for m in d.matches} == {"swap", "xid48"}
    table = render_table([d])
    assert [ln.split()[2] for ln in table.splitlines()[1:]] == [d.matches[0].cause, d.matches[1].cause]


def test_a_healthy_gpu_node_is_healthy_and_still_examined_by_diagnose_all() -> None:
    node, host = quad_node(), quad_host()
    assert diag(node, host).cause == "healthy"
    assert not is_sick(node, FLEET) and to_examine(node, FLEET)
    plain = make_node("cpu-1")
    assert not to_examine(plain, FLEET)
    assert is_sick(quad_node(allocatable=3), FLEET)


def test_the_fleet_knowledge_is_data_and_diagnose_follows_it(tmp_path: Path) -> None:
    # another workload label in the data: the GPU-less verdict and the evidence follow it, no code changes
    other = FLEET.model_copy(update={"workload_label": "example.com/gpu-mode"})
    node = make_node("n", labels={"example.com/gpu-mode": "container"}, allocatable={"cpu": "1", GPU: "0"})
    assert is_sick(node, other) and not is_sick(node, FLEET)
    d = explain(Facts(node_name="n", node=node, host=make_host("n")), CATALOGUE, fleet=other)
    assert d.evidence["workload_label"] == "container" and "GPU-less" in d.state


def test_a_broken_fleet_file_is_a_located_load_error(tmp_path: Path) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text("workload_label: x\ngpu_labels: [a]\nnot_a_field: 1\n")
    with pytest.raises(LoadError) as e:
        load_fleet(bad)
    assert f"{bad}:3" in str(e.value) and "unknown field 'not_a_field'" in str(e.value)


def test_a_runbook_declaring_one_cause_twice_is_a_located_load_error() -> None:
    from engine.loader import parse_runbook

    text = """apiVersion: runbook/v1
name: r
version: "1"
params: {node: {type: node, required: true}}
diagnosis:
  cause: {id: c, title: t}
  evidence: [{id: a, check: {node_ready: false}}]
diagnoses:
  - cause: {id: c, title: t2}
    evidence: [{id: a, check: {node_ready: false}}]
steps:
  - {id: s, action: {check: {}}}
"""
    with pytest.raises(LoadError) as e:
        parse_runbook(text.encode(), "r.yaml")
    assert "r.yaml:9: diagnoses[0].cause.id: cause 'c' is declared twice" in str(e.value)


def plugin_pod(node: str, reason: str) -> dict[str, object]:
    return {"metadata": {"namespace": "gpu-operator", "name": f"nvidia-device-plugin-{node}",
                         "labels": {"app": "nvidia-device-plugin-daemonset"}},
            "spec": {"nodeName": node},
            "status": {"containerStatuses": [{"name": "plugin", "state": {"waiting": {"reason": reason}}}]}}


def test_the_device_plugin_crash_loop_counts_only_for_the_plugin_pod_of_that_node() -> None:
    from engine.checkkind import ObjectsQuery

    key = ObjectsQuery("v1", "pods", "gpu-operator", "app=nvidia-device-plugin-daemonset").key
    node, host = quad_node(allocatable=0), quad_host()

    def with_pods(*pods: dict[str, object]) -> Diagnosis:
        return explain(Facts(node_name=node.name, node=node, host=host, objects={key: pods}), CATALOGUE,
                       fleet=FLEET)

    elsewhere = with_pods(plugin_pod("gpu-other", "CrashLoopBackOff"), plugin_pod("gpu-quad", "ContainerCreating"))
    assert (elsewhere.cause, elsewhere.confidence) == ("device-plugin", "low")  # another node's crash loop
    here = with_pods(plugin_pod("gpu-other", "ContainerCreating"), plugin_pod("gpu-quad", "CrashLoopBackOff"))
    assert (here.cause, here.confidence) == ("device-plugin", "high")
    (looping,) = [e for e in here.matches[0].evidence if e.id == "plugin-crash-looping"]
    assert looping.holds is True and "gpu-operator/nvidia-device-plugin-gpu-quad" in looping.observed
    assert "spec.nodeName=gpu-quad" in looping.observed
