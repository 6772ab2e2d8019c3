"""Lab scenarios: the packaged incident scenario, the format's derived values, and located errors."""

from __future__ import annotations

import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from engine.errors import LoadError
from engine.lab import sim_gpu, sim_kubevirt, sim_seed
from engine.lab.scenario import load_scenario, parse_scenario, parse_size, starts_ready

SCENARIOS = Path(__file__).resolve().parents[3] / "engine" / "lab" / "scenarios"
MINIMAL = """\
apiVersion: runbook.lab/v1
name: tiny
nodes:
  - name: worker-1
    host: {ssh: false}
"""


def parse(text: str):
    return parse_scenario(textwrap.dedent(text).encode(), "scenario.yaml")


def problems(text: str) -> str:
    with pytest.raises(LoadError) as info:
        parse(text)
    return str(info.value)


def test_the_packaged_scenario_is_the_omen2_incident() -> None:
    sc = load_scenario()
    assert sc.name == "incident-omen2"
    assert len(sc.all_nodes) == 8
    down = [n.name for n in sc.all_nodes if not starts_ready(n)]
    assert len(down) == 4 and "omen2" in down
    assert all(sc.node(name).gpus for name in down)  # the cluster's whole GPU capacity
    omen2 = sc.node("omen2")
    assert omen2.gpus[0].model == "10de:2b85" and omen2.workload == "vm-passthrough"
    assert omen2.host.swap.active == ["/swapfile"] and omen2.host.swap.devices["/swapfile"].size == 32 << 30
    assert "/swapfile" in sim_seed.fstab_text(omen2) and omen2.host.cuda_jobs
    assert {sc.node(n).gpus[0].model for n in down if n != "omen2"} == {"10de:2204"}


def test_at_least_one_gpu_node_is_down_for_a_cause_other_than_swap() -> None:
    sc = load_scenario()
    others = [n for n in sc.all_nodes if not starts_ready(n) and not n.host.swap.active]
    assert others and all(n.host.kubelet.fault or n.host.kubelet.client_cert_expired for n in others)


def test_vm_phases_and_operator_pods_match_the_incident() -> None:
    sc = load_scenario()
    assert Counter(vm.expected_status for vm in sc.vms) == {
        "Running": 3, "Paused": 2, "Stopped": 1, "ErrorUnschedulable": 2}
    assert {vm.name for vm in sc.vms if vm.expected_status == "ErrorUnschedulable"} == {"gpu-fedora", "rhel9-gpu-vm"}
    assert all(vm.unschedulable_days == 112 for vm in sc.vms if vm.host_devices)
    statuses: Counter[str] = Counter()
    statuses["Running"] += 3 + len(sc.all_nodes)  # gpu-operator, NFD master and gc; nfd-worker per node
    for node in sc.all_nodes:
        statuses.update(sim_seed._operand_statuses(node, sc).values())
    assert statuses == {"Running": 14, "Error": 6, "Terminating": 4}
    assert sc.node("omen2").operator_pods["sandbox-device-plugin"] == "Error"
    assert sc.node("omen2").operator_pods["sandbox-validator"] == "Error"


def test_no_zone_has_more_than_two_notready_nodes_so_the_controller_keeps_tainting() -> None:
    sc = load_scenario()
    per_zone = Counter(n.zone for n in sc.all_nodes if not starts_ready(n))
    assert max(per_zone.values()) <= 2


def test_sandbox_resource_names_derive_from_the_pci_ids_name() -> None:
    sc = load_scenario()
    assert sc.gpu_model("10de:2b85").resource_name == "nvidia.com/GB202_GEFORCE_RTX_5090"
    assert sc.gpu_model("10de:2204").resource_name == "nvidia.com/GA102_GEFORCE_RTX_3090"
    assert {d.resource for d in sc.kubevirt.permitted_host_devices} <= sim_gpu.gpu_resource_names(sc)


def test_a_fleet_of_generated_gpu_nodes_for_benchmarks() -> None:
    sc = parse(MINIMAL + "generate:\n  - {count: 100, prefix: gpu-}\n")
    names = [n.name for n in sc.all_nodes]
    assert len(names) == 101 and names[1] == "gpu-001" and names[-1] == "gpu-100"
    assert all(starts_ready(n) and not n.host.ssh and n.gpus for n in sc.all_nodes[1:])
    assert {n.zone for n in sc.all_nodes[1:]} == {"zone-a", "zone-b", "zone-c"}


def test_a_generated_fleet_can_be_broken_by_swap_each_node_with_its_own_host() -> None:
    sc = load_scenario(Path(__file__).resolve().parents[3] / "engine" / "lab" / "scenarios" / "fleet-20.yaml")
    fleet = [n for n in sc.all_nodes if n.labels.get("bench.runbook.io/fleet20") == "true"]
    assert len(fleet) == 20 and fleet[0].name == "fleet-001"
    assert all(n.host.ssh and n.host.swap.active == ["/swap.img"] and not starts_ready(n) for n in fleet)
    assert len({id(n.host) for n in fleet}) == 20  # copies, not one shared host
    assert [n.name for n in sc.all_nodes if starts_ready(n)] == ["cp-1", "worker-1"]


@pytest.mark.parametrize(("value", "expected"), [
    (1024, 1024), ("32Gi", 32 << 30), ("32G", 32 << 30), ("1.5Gi", 3 << 29), ("512Mi", 512 << 20), ("8GiB", 8 << 30),
])
def test_sizes(value: int | str, expected: int) -> None:
    assert parse_size(value) == expected


def test_an_unknown_field_is_reported_with_file_line_and_path() -> None:
    text = MINIMAL + "  - name: omen2\n    gpuz: []\n"
    assert "scenario.yaml:7: nodes[1].gpuz: unknown field 'gpuz'" in problems(text)


def test_a_bad_value_names_its_field() -> None:
    text = MINIMAL + "  - name: omen2\n    host:\n      swap: {devices: {/swapfile: {size: lots}}}\n"
    message = problems(text)
    assert "scenario.yaml:8:" in message and "nodes[1].host.swap.devices./swapfile.size" in message
    assert "'lots' is not a size" in message


def test_an_unknown_gpu_model_and_a_bad_workload_label_are_located() -> None:
    text = MINIMAL + (
        "  - name: omen2\n"
        "    labels: {nvidia.com/gpu.workload.config: vm-passthru}\n"
        '    gpus: [{model: "10de:ffff"}]\n')
    message = problems(text)
    assert "scenario.yaml:7: nodes[1].labels: workload label 'vm-passthru'" in message
    assert "scenario.yaml:8: nodes[1].gpus[0].model: unknown GPU model '10de:ffff'" in message


def test_duplicate_nodes_are_refused() -> None:
    assert "scenario.yaml:6: nodes[1].name: duplicate node name 'worker-1'" in problems(
        MINIMAL + "  - name: worker-1\n")


def test_active_swap_must_be_a_known_device() -> None:
    text = MINIMAL + "  - name: omen2\n    host: {swap: {active: [/swapfile]}}\n"
    assert "scenario.yaml:7: nodes[1].host.swap: active swap '/swapfile' is not among swap.devices" in problems(text)


def test_a_scenario_where_every_node_starts_notready_is_refused() -> None:
    text = """\
    apiVersion: runbook.lab/v1
    name: all-down
    nodes:
      - name: omen2
        host: {swap: {devices: {/swapfile: {size: 1Gi}}, active: [/swapfile]}}
    """
    assert "master disruption mode" in problems(text)


def test_yaml_errors_and_a_wrong_api_version_are_located() -> None:
    assert "scenario.yaml:3:1: invalid YAML" in problems("apiVersion: runbook.lab/v1\nname: [unclosed\n")
    assert "apiVersion" in problems(MINIMAL.replace("runbook.lab/v1", "v2"))


def test_vm_manifests_request_their_host_devices() -> None:
    sc = load_scenario()
    vm = next(v for v in sc.vms if v.name == "gpu-fedora")
    manifest = sim_kubevirt.vm_manifest(vm, now=1_000_000_000.0)
    devices = manifest["spec"]["template"]["spec"]["domain"]["devices"]["hostDevices"]
    assert devices == [{"name": "gpu1", "deviceName": "nvidia.com/GB202_GEFORCE_RTX_5090"}]
    assert manifest["metadata"]["annotations"][sim_kubevirt.UNSCHEDULABLE_SINCE] == "2001-05-20T01:46:40Z"


def _vm(run_strategy: str = "Always") -> dict:
    return {"metadata": {"name": "gpu-fedora", "namespace": "gpu-vms"}, "spec": {"runStrategy": run_strategy}}


def test_printable_status_follows_kubevirts_precedence() -> None:
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    paused = {"type": "Paused", "status": "True"}
    vmi = lambda phase, *conds: {"metadata": {}, "status": {"phase": phase, "conditions": list(conds)}}  # noqa: E731
    assert sim_kubevirt.printable_status(_vm("Halted"), None) == "Stopped"
    assert sim_kubevirt.printable_status(_vm(), None) == "Starting"
    assert sim_kubevirt.printable_status(_vm(), vmi("Scheduling", unschedulable)) == "ErrorUnschedulable"
    assert sim_kubevirt.printable_status(_vm(), vmi("Running")) == "Running"
    assert sim_kubevirt.printable_status(_vm(), vmi("Running", paused)) == "Paused"
    deleting = {"metadata": {"deletionTimestamp": "2025-07-10T00:00:00Z"}, "status": {"phase": "Running"}}
    assert sim_kubevirt.printable_status(_vm(), deleting) == "Stopping"


def test_the_vmi_copies_the_launcher_pods_unschedulable_condition_with_the_recorded_age() -> None:
    pod = {"spec": {}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/8 nodes are available"}]}}
    status = sim_kubevirt.vmi_status(pod, False, "2025-03-20T00:00:00Z", "2025-07-10T00:00:00Z", None)
    scheduled = next(c for c in status["conditions"] if c["type"] == "PodScheduled")
    assert (scheduled["reason"], scheduled["message"]) == ("Unschedulable", "0/8 nodes are available")
    assert scheduled["lastTransitionTime"] == "2025-03-20T00:00:00Z"


def test_the_operator_swaps_deploy_labels_from_the_workload_label() -> None:
    sc = load_scenario()
    labels = {"feature.node.kubernetes.io/pci-10de.present": "true",
              "nvidia.com/gpu.workload.config": "container", "nvidia.com/gpu.deploy.vfio-manager": "true"}
    patch = sim_gpu.label_changes(labels, {"pci_devices": []}, sc, gfd_running=False)
    assert patch["nvidia.com/gpu.deploy.vfio-manager"] is None
    assert patch["nvidia.com/gpu.deploy.device-plugin"] == "true" and patch["nvidia.com/gpu.present"] == "true"
    gone = sim_gpu.label_changes({"nvidia.com/gpu.present": "true", "nvidia.com/gpu.deploy.driver": "true"},
                                 {"pci_devices": []}, sc, gfd_running=False)
    assert gone == {"nvidia.com/gpu.present": "false", "nvidia.com/gpu.deploy.driver": None}


def test_vfio_manager_rebinds_the_gpu_and_kills_host_cuda_jobs() -> None:
    sc = load_scenario()
    host, _ = sim_seed.host_state(sc.node("omen2"), sc, 1e9)
    assert sim_gpu.advertised(host, sc, "container", {"device-plugin"}) == {"nvidia.com/gpu": 1}
    assert sim_gpu.driver_effects(host, "vm-passthrough", vfio_manager_running=True) == [
        sim_gpu.Rebind("01:00.0", "nvidia", "vfio-pci", (41000,))]
    assert host["cuda_jobs"] == [] and host["cuda_jobs_killed"] == 1
    assert sim_gpu.advertised(host, sc, "vm-passthrough", {"sandbox-device-plugin"}) == {
        "nvidia.com/GB202_GEFORCE_RTX_5090": 1}
    assert sim_gpu.advertised(host, sc, "container", {"device-plugin"}) == {"nvidia.com/gpu": 0}
    assert sim_gpu.driver_effects(host, "container", vfio_manager_running=False) == [
        sim_gpu.Rebind("01:00.0", "vfio-pci", "none")]
    assert sim_gpu.displays(host)[0]["driver"] == "none"  # preStop unbound it; nothing rebinds nvidia


def multi_gpu_host() -> tuple[Any, dict[str, Any]]:
    sc = load_scenario(SCENARIOS / "multi-gpu.yaml")
    host, _ = sim_seed.host_state(sc.node("gpu-quad"), sc, 1e9)
    return sc, host


def test_the_multi_gpu_scenario_models_four_gpus_one_by_one_with_a_cuda_job_on_two() -> None:
    sc, host = multi_gpu_host()
    node = sc.node("gpu-quad")
    assert [(g.slot, g.model, g.driver) for g in node.gpus] == [
        ("01:00.0", "10de:2b85", "nvidia"), ("02:00.0", "10de:2b85", "vfio-pci"),
        ("41:00.0", "10de:2204", "nvidia"), ("c1:00.0", "10de:2684", "none")]
    assert [(j["pid"], j["gpu"]) for j in host["cuda_jobs"]] == [(41000, "01:00.0"), (41001, "41:00.0")]
    assert not starts_ready(node)
    assert sim_gpu.advertised(host, sc, "container", {"device-plugin"}) == {"nvidia.com/gpu": 2}


def test_unbinding_one_gpu_from_vfio_pci_kills_no_cuda_job_on_the_nodes_other_gpus() -> None:
    _, host = multi_gpu_host()
    # back under container, vfio-manager's preStop unbinds 02:00.0: the jobs on 01:00.0 and 41:00.0 live
    assert sim_gpu.driver_effects(host, "container", vfio_manager_running=False) == [
        sim_gpu.Rebind("02:00.0", "vfio-pci", "none")]
    assert [j["pid"] for j in host["cuda_jobs"]] == [41000, 41001] and host["cuda_jobs_killed"] == 0
    assert sim_gpu.driver_effects(host, "container", vfio_manager_running=False) == []


def test_vfio_manager_kills_only_the_jobs_on_the_gpus_it_takes_from_nvidia() -> None:
    _, host = multi_gpu_host()
    host["pci_devices"][next(i for i, d in enumerate(host["pci_devices"]) if d["slot"] == "41:00.0")][
        "driver"] = "vfio-pci"  # already on vfio-pci: its job (an old state's) is not vfio-manager's doing
    host["cuda_jobs"][1]["gpu"] = "41:00.0"
    changes = sim_gpu.driver_effects(host, "vm-passthrough", vfio_manager_running=True)
    assert changes == [sim_gpu.Rebind("01:00.0", "nvidia", "vfio-pci", (41000,)),
                       sim_gpu.Rebind("c1:00.0", "none", "vfio-pci")]
    assert [j["pid"] for j in host["cuda_jobs"]] == [41001] and host["cuda_jobs_killed"] == 1
    assert {d["driver"] for d in sim_gpu.displays(host)} == {"vfio-pci"}


def test_a_cuda_job_without_a_gpu_runs_on_the_first_gpu_on_nvidia() -> None:
    _, host = multi_gpu_host()
    job = {"pid": 7, "name": "python3"}
    assert sim_gpu.job_gpu(host, job) == "01:00.0"
    host["pci_devices"][0]["driver"] = "vfio-pci"
    assert sim_gpu.job_gpu(host, job) == "41:00.0"
    assert sim_gpu.job_gpu(host, {**job, "gpu": "c1:00.0"}) == "c1:00.0"


def test_gpus_without_a_slot_get_one_by_position() -> None:
    sc = parse(MINIMAL + """\
  - name: quad
    gpus: [{model: "10de:2204"}, {model: "10de:2204"}, {model: "10de:2b85", driver: vfio-pci}]
    host: {cuda_jobs: [{name: a}, {name: b, gpu: "02:00.0"}]}
""")
    node = sc.node("quad")
    assert [g.slot for g in node.gpus] == ["01:00.0", "02:00.0", "03:00.0"]
    assert [node.cuda_job_gpu(j) for j in node.host.cuda_jobs] == ["01:00.0", "02:00.0"]
    assert load_scenario().node("omen2").gpus[0].slot == "01:00.0"  # one GPU: the slot it always had


def test_gpu_slots_and_cuda_job_gpus_are_checked_with_their_line() -> None:
    text = problems(MINIMAL + """\
  - name: quad
    gpus:
      - {model: "10de:2204", slot: "01:00.0"}
      - {model: "10de:2204", slot: "01:00.0"}
      - {model: "10de:2b85", slot: "03:00.0", driver: vfio-pci}
    host:
      cuda_jobs:
        - {name: a, gpu: "09:00.0"}
        - {name: b, gpu: "03:00.0"}
  - name: no-nvidia
    gpus: [{model: "10de:2204", driver: none}]
    host: {cuda_jobs: [{name: c}]}
""")
    assert "scenario.yaml:9: nodes[1].gpus[1].slot: two GPUs in slot 01:00.0" in text
    assert ("scenario.yaml:13: nodes[1].host.cuda_jobs[0].gpu: node 'quad' has no GPU in slot 09:00.0 "
            "(its GPUs: 01:00.0, 03:00.0)") in text
    assert ("scenario.yaml:14: nodes[1].host.cuda_jobs[1].gpu: the GPU in slot 03:00.0 is on vfio-pci: "
            "a CUDA job runs only on a GPU on the nvidia driver") in text
    assert ("nodes[2].host.cuda_jobs[0]: a CUDA job needs a GPU on the nvidia driver, and node 'no-nvidia' "
            "has none") in text
