"""The recovery and its order, done by hand against the lab: relabel -> swap off + fstab -> restart kubelet.

Each test starts from the incident (``fresh_lab`` resets the lab first when a test changed it).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest

from engine.errors import RunbookError
from engine.lab.hoststate import HostState
from tests.integration.lab.lab_helpers import ansible, condition, kubectl_json, node, output_lines, taints, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.lab]

RELABEL = "kubectl label node omen2 nvidia.com/gpu.workload.config=container --overwrite"


def omen2_status(lab: Any) -> dict[str, Any]:
    return next(n for n in lab.lab.status()["nodes"] if n["name"] == "omen2")


def swap_off_and_edit_fstab(sh: Any) -> None:
    assert ansible(sh, "omen2", "swapoff -a").returncode == 0
    edit = sh("ansible -i \"$RUNBOOK_INVENTORY\" omen2 -b -m replace "
              "-a 'path=/etc/fstab regexp=\"^([^#\\s]\\S*\\s+\\S+\\s+swap\\s.*)$\" replace=\"# \\1\"'")
    assert edit.returncode == 0, edit.stdout + edit.stderr


def ready_with(sh: Any, resource: str) -> Any:
    n = node(sh, "omen2")
    if condition(n, "Ready").get("status") == "True" and n["status"]["allocatable"].get(resource, "0") != "0":
        return n
    return None


def test_recovery_in_the_right_order_brings_omen2_back_with_its_gpu_and_the_cuda_job_alive(
        fresh_lab: Any, sh: Any) -> None:
    assert sh(RELABEL).returncode == 0
    # the operator swaps the deploy labels at once, though the node is still NotReady
    def container_labels() -> Any:
        labels = node(sh, "omen2")["metadata"]["labels"]
        return labels if "nvidia.com/gpu.deploy.device-plugin" in labels else None

    labels = wait_for(container_labels, 10, "the container deploy labels")
    assert "nvidia.com/gpu.deploy.vfio-manager" not in labels
    swap_off_and_edit_fstab(sh)
    assert "#" in ansible(sh, "omen2", "grep swapfile /etc/fstab").stdout
    assert ansible(sh, "omen2", "systemctl restart kubelet").returncode == 0
    recovered = wait_for(lambda: ready_with(sh, "nvidia.com/gpu"), 40, "omen2 Ready with nvidia.com/gpu")
    assert recovered["status"]["allocatable"]["nvidia.com/gpu"] == "1"
    assert ("node.kubernetes.io/unreachable", "NoExecute") not in taints(wait_for(
        lambda: (lambda n: n if not taints(n) else None)(node(sh, "omen2")), 20, "the taints to go"))
    assert "active" in ansible(sh, "omen2", "systemctl is-active kubelet", become=False).stdout
    status = omen2_status(fresh_lab)
    assert (status["ready"], status["gpu_driver"], status["cuda_jobs_running"], status["cuda_jobs_killed"]) == (
        True, "nvidia", 1, 0)
    wait_for(lambda: node(sh, "omen2")["metadata"]["labels"].get("nvidia.com/gpu.product"), 20, "GFD's labels")
    # the passthrough VMs still ask for the 5090 as a vfio device: they stay unschedulable (report says so)
    vm = kubectl_json(sh, "get vm -n gpu-vms gpu-fedora")
    assert vm["status"]["printableStatus"] == "ErrorUnschedulable"


def test_restarting_kubelet_before_relabelling_kills_the_cuda_job_and_never_yields_nvidia_gpu(
        fresh_lab: Any, sh: Any) -> None:
    swap_off_and_edit_fstab(sh)
    assert ansible(sh, "omen2", "systemctl restart kubelet").returncode == 0
    wait_for(lambda: ready_with(sh, "nvidia.com/GB202_GEFORCE_RTX_5090"), 40,
             "omen2 Ready with the 5090 as a passthrough device")
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:  # and nvidia.com/gpu does not come
        assert node(sh, "omen2")["status"]["allocatable"].get("nvidia.com/gpu", "0") == "0"
        time.sleep(0.5)
    status = omen2_status(fresh_lab)
    assert (status["gpu_driver"], status["cuda_jobs_running"], status["cuda_jobs_killed"]) == ("vfio-pci", 0, 1)
    assert "Kernel driver in use: vfio-pci" in ansible(sh, "omen2", "lspci -nnk -d 10de:2b85").stdout
    assert "No devices were found" in ansible(
        sh, "omen2", "nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader").stdout
    with pytest.raises(RunbookError, match="cannot start"):
        fresh_lab.lab.job("omen2", "start")


def test_lab_job_stops_and_starts_the_host_cuda_job(fresh_lab: Any, sh: Any) -> None:
    query = "nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader"
    assert fresh_lab.lab.job("omen2", "stop")["cuda_jobs"] == []
    assert output_lines(ansible(sh, "omen2", query)) == []
    jobs = fresh_lab.lab.job("omen2", "start")["cuda_jobs"]
    assert len(jobs) == 1
    assert f"{jobs[0]['pid']}, python3" in ansible(sh, "omen2", query).stdout


def test_reset_restores_host_files_state_api_objects_and_counters(fresh_lab: Any, sh: Any) -> None:
    assert sh(RELABEL).returncode == 0
    swap_off_and_edit_fstab(sh)
    ansible(sh, "omen2", "systemctl restart kubelet")
    fresh_lab.lab.job("gpu-3090-1", "start")
    wait_for(lambda: ready_with(sh, "nvidia.com/gpu"), 40, "omen2 Ready")
    started = time.monotonic()
    fresh_lab.reset()
    assert time.monotonic() - started < 60
    n = node(sh, "omen2")
    assert condition(n, "Ready")["status"] != "True"
    assert ("node.kubernetes.io/unreachable", "NoExecute") in taints(n)
    assert n["metadata"]["labels"]["nvidia.com/gpu.workload.config"] == "vm-passthrough"
    assert "/swapfile" in ansible(sh, "omen2", "swapon --show").stdout
    fstab = ansible(sh, "omen2", "cat /etc/fstab").stdout
    assert any(line.startswith("/swapfile") for line in fstab.splitlines())
    assert "activating" in ansible(sh, "omen2", "systemctl is-active kubelet", become=False).stdout
    status = {s["name"]: s for s in fresh_lab.lab.status()["nodes"]}
    assert (status["omen2"]["cuda_jobs_running"], status["omen2"]["cuda_jobs_killed"]) == (1, 0)
    assert status["gpu-3090-1"]["cuda_jobs_running"] == 0
    state_dir = fresh_lab.lab.record()["nodes"]["omen2"]["state_dir"]
    assert HostState(state_dir).calls() == []
    rows = [line.split() for line in sh("kubectl get vm -A --no-headers", check=True).stdout.splitlines()]
    assert Counter(r[3] for r in rows) == {"Running": 3, "Paused": 2, "Stopped": 1, "ErrorUnschedulable": 2}
    table = sh("kubectl get pods -n gpu-operator --no-headers", check=True).stdout
    pods = [line.split() for line in table.splitlines()]
    assert Counter(p[2] for p in pods) == {"Running": 14, "Error": 6, "Terminating": 4}
