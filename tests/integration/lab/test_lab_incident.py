"""The default scenario reproduces every observed fact of the omen2 incident (real API, kubectl, Ansible)."""

from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter
from typing import Any

import pytest
from click.testing import CliRunner

from engine.lab.labcli import lab_group
from engine.lab.sim_kube import parse_time
from tests.integration.lab.lab_helpers import ansible, condition, kubectl_json, output_lines, taints

pytestmark = [pytest.mark.integration, pytest.mark.lab]

GPU_NODES_DOWN = {"omen2", "gpu-3090-1", "gpu-3090-2", "gpu-3090-3"}
SWAP_ERROR = ('"command failed" err="failed to run Kubelet: running with swap on is not supported, please '
              'disable swap or set --fail-swap-on flag to false"')


def test_four_gpu_nodes_are_notready_and_tainted_by_the_real_node_lifecycle_controller(incident: Any, sh: Any) -> None:
    nodes = {n["metadata"]["name"]: n for n in kubectl_json(sh, "get nodes")["items"]}
    assert len(nodes) == 8
    down = {name for name, n in nodes.items() if condition(n, "Ready").get("status") != "True"}
    assert down == GPU_NODES_DOWN
    for name in down:
        ready = condition(nodes[name], "Ready")
        assert (ready["status"], ready["reason"]) == ("Unknown", "NodeStatusUnknown")
        assert ready["message"] == "Kubelet stopped posting node status."
        assert {("node.kubernetes.io/unreachable", "NoSchedule"),
                ("node.kubernetes.io/unreachable", "NoExecute")} <= taints(nodes[name])
    table = sh("kubectl get nodes --no-headers", check=True).stdout
    assert Counter(line.split()[1] for line in table.splitlines()) == {"Ready": 4, "NotReady": 4}


def test_kubectl_get_vm_shows_the_incident_phases(incident: Any, sh: Any) -> None:
    table = sh("kubectl get vm -A", check=True).stdout.splitlines()
    assert table[0].split() == ["NAMESPACE", "NAME", "AGE", "STATUS", "READY"]
    rows = [line.split() for line in table[1:]]
    assert Counter(r[3] for r in rows) == {"Running": 3, "Paused": 2, "Stopped": 1, "ErrorUnschedulable": 2}
    assert {r[1] for r in rows if r[3] == "ErrorUnschedulable"} == {"gpu-fedora", "rhel9-gpu-vm"}


def test_gpu_vms_have_been_unschedulable_for_112_days_for_want_of_the_rtx_5090(incident: Any, sh: Any) -> None:
    vm = kubectl_json(sh, "get vm -n gpu-vms gpu-fedora")
    scheduled = condition(vm, "PodScheduled")
    assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable")
    assert round((time.time() - parse_time(scheduled["lastTransitionTime"])) / 86400) == 112
    message = scheduled["message"]
    assert "Insufficient nvidia.com/GB202_GEFORCE_RTX_5090" in message
    assert "{node.kubernetes.io/unreachable: }" in message
    pod = kubectl_json(sh, "get pods -n gpu-vms -l vm.kubevirt.io/name=gpu-fedora")["items"][0]
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/GB202_GEFORCE_RTX_5090": "1"}
    assert pod["spec"]["nodeSelector"] == {"kubevirt.io/schedulable": "true"}
    assert "nodeName" not in pod["spec"]  # the real scheduler found no node


def test_the_kubevirt_cr_permits_both_gpus_by_pci_id(incident: Any, sh: Any) -> None:
    kv = kubectl_json(sh, "get kubevirt -n kubevirt kubevirt")
    devices = kv["spec"]["configuration"]["permittedHostDevices"]["pciHostDevices"]
    assert {(d["pciVendorSelector"], d["resourceName"]) for d in devices} == {
        ("10de:2b85", "nvidia.com/GB202_GEFORCE_RTX_5090"), ("10de:2204", "nvidia.com/GA102_GEFORCE_RTX_3090")}


def test_gpu_operator_pods_are_14_running_6_error_4_terminating(incident: Any, sh: Any) -> None:
    table = sh("kubectl get pods -n gpu-operator --no-headers", check=True).stdout
    rows = [line.split() for line in table.splitlines()]
    assert Counter(r[2] for r in rows) == {"Running": 14, "Error": 6, "Terminating": 4}
    errors = {r[0].rsplit("-", 1)[0] for r in rows if r[2] == "Error"}
    assert {"nvidia-sandbox-device-plugin-daemonset", "nvidia-sandbox-validator"} <= errors


def test_omen2_journal_shows_the_kubelet_swap_error_over_ansible(incident: Any, sh: Any) -> None:
    result = ansible(sh, "omen2", "journalctl -u kubelet -n 5")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("omen2 | CHANGED | rc=0")
    assert any(re.search(r" kubelet\[\d+\]: E\d{4} [\d:.]+ +\d+ run\.go:72\] ", line) and line.endswith(SWAP_ERROR)
               for line in lines)
    assert any(line.endswith("kubelet.service: Main process exited, code=exited, status=1/FAILURE") for line in lines)
    assert any(line.endswith("kubelet.service: Failed with result 'exit-code'.") for line in lines)
    full = ansible(sh, "omen2", "journalctl -u kubelet --no-pager").stdout
    assert re.search(r"kubelet\.service: Scheduled restart job, restart counter is at \d+\.", full)


def test_omen2_kubelet_is_activating_a_crash_loop(incident: Any, sh: Any) -> None:
    result = ansible(sh, "omen2", "systemctl is-active kubelet", become=False)
    assert "rc=3" in result.stdout and "activating" in result.stdout


def test_omen2_has_a_32_gb_swapfile_on_and_listed_in_fstab(incident: Any, sh: Any) -> None:
    shown = ansible(sh, "omen2", "swapon --show --noheadings --raw --bytes").stdout.splitlines()[1:]
    assert shown[0].split()[:3] == ["/swapfile", "file", str(32 << 30)]
    proc = ansible(sh, "omen2", "cat /proc/swaps").stdout.splitlines()[1:]
    assert proc[0].startswith("Filename") and proc[1].split()[0] == "/swapfile"
    fstab = ansible(sh, "omen2", "cat /etc/fstab").stdout
    assert re.search(r"^/swapfile\s+none\s+swap\s+sw\s+0\s+0$", fstab, re.MULTILINE)


def test_omen2_gpu_is_on_the_nvidia_driver_with_a_cuda_job(incident: Any, sh: Any) -> None:
    lspci = ansible(sh, "omen2", "lspci -nnk -d 10de:").stdout
    assert "NVIDIA Corporation GB202 [GeForce RTX 5090] [10de:2b85]" in lspci
    assert "\tKernel driver in use: nvidia\n" in lspci + "\n"
    assert "\tKernel modules: nvidiafb, nouveau, nvidia_drm, nvidia" in lspci
    smi = ansible(sh, "omen2", "nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader").stdout
    assert re.search(r"^\d+, python3$", smi, re.MULTILINE)


def test_another_gpu_node_is_down_for_a_cause_other_than_swap(incident: Any, sh: Any) -> None:
    journal = ansible(sh, "gpu-3090-2", "journalctl -u kubelet -n 5").stdout
    assert "validate CRI v1 runtime API" in journal and "swap" not in journal
    assert output_lines(ansible(sh, "gpu-3090-2", "swapon --show")) == []
    assert "failed" in ansible(sh, "gpu-3090-2", "systemctl is-active containerd", become=False).stdout
    lspci = ansible(sh, "gpu-3090-2", "lspci -nn -d 10de:2204").stdout
    assert "GA102 [GeForce RTX 3090] [10de:2204]" in lspci


def test_lab_status_json_describes_nodes_and_vms(incident: Any) -> None:
    result = CliRunner().invoke(lab_group, ["status", "-o", "json", "--lab-dir", str(incident.lab.dir)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["kubeconfig"].endswith("kubeconfig") and data["inventory"].endswith(".yml")
    nodes = {n["name"]: n for n in data["nodes"]}
    assert {name for name, n in nodes.items() if not n["ready"]} == GPU_NODES_DOWN
    omen2 = nodes["omen2"]
    assert (omen2["workload"], omen2["gpu_driver"], omen2["cuda_jobs_running"], omen2["cuda_jobs_killed"]) == (
        "vm-passthrough", "nvidia", 1, 0)
    assert all(isinstance(n["ready"], bool) and isinstance(n["cuda_jobs_killed"], int) for n in nodes.values())
    assert nodes["worker-1"]["gpu_driver"] == "none"
    assert Counter(vm["status"] for vm in data["vms"])["ErrorUnschedulable"] == 2


def test_eval_lab_env_makes_kubectl_and_ansible_target_the_lab(incident: Any, sh: Any) -> None:
    script = (f'unset KUBECONFIG RUNBOOK_INVENTORY; eval "$({sys.executable} -m engine lab env '
              f'--lab-dir {incident.lab.dir})"; kubectl get nodes --no-headers | wc -l; '
              "ansible -i \"$RUNBOOK_INVENTORY\" omen2 -b -m command -a 'journalctl -u kubelet -n 5'")
    result = sh(script)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[0].strip() == "8"
    assert "swap on is not supported" in result.stdout
