"""gpu-workload-switch on the lab's omen2 after recovery: refused while the host CUDA job runs; with the
job stopped, GPU pods evicted (policy/v1beta1 on the lab's 1.20 server), the GPU on vfio-pci and
advertised as the 5090, one of the two GPU VMs running and the report naming the one that waits;
back to container refused while that VM holds the GPU, then done once it is stopped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.lab.flagship_cli import LABEL, kube_node, node_status, runbook, vm_statuses
from tests.integration.lab.lab_helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.lab]

RTX = "nvidia.com/GB202_GEFORCE_RTX_5090"
GPU_VMS = ("gpu-vms/gpu-fedora", "gpu-vms/rhel9-gpu-vm")
GPU_POD = """apiVersion: v1
kind: Pod
metadata: {name: cuda-burn, namespace: default, labels: {app: cuda-burn}}
spec:
  nodeSelector: {kubernetes.io/hostname: omen2}
  containers:
  - name: burn
    image: nvcr.io/nvidia/cuda:12.4.0-base-ubuntu22.04
    resources: {limits: {nvidia.com/gpu: "1"}}
"""


def pod_phase(sh: Any, name: str) -> str:
    r = sh(f"kubectl get pod -n default {name} -o json")
    return json.loads(r.stdout)["status"].get("phase", "") if r.returncode == 0 else "(gone)"


@pytest.mark.timeout(1500)  # one scenario of six runs; on a loaded 2-core CI machine it takes minutes
def test_switch_to_passthrough_and_back_on_omen2_after_recovery(fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    journal = tmp_path / "journal.sqlite"
    assert runbook(sh, "run gpu-node-recovery --node omen2 --yes", journal=journal).returncode == 0
    (tmp_path / "pod.yaml").write_text(GPU_POD)
    assert sh(f"kubectl apply -f {tmp_path / 'pod.yaml'}").returncode == 0
    try:
        wait_for(lambda: pod_phase(sh, "cuda-burn") == "Running", 60, "the GPU pod running on omen2")
        switch = "run gpu-workload-switch --node omen2 -p workload=vm-passthrough --yes"

        # refused while the host CUDA job uses the GPU: the process is the evidence; nothing changes
        refused = runbook(sh, switch, journal=journal)
        assert refused.returncode == 3, refused.stdout + refused.stderr
        out = " ".join(refused.stdout.split())
        assert "precondition no-host-cuda-jobs: host CUDA processes use the GPU of omen2: pid" in out
        assert "(python3)" in out and "-p force=true" in out
        assert kube_node(sh, "omen2")["metadata"]["labels"][LABEL] == "container"
        assert pod_phase(sh, "cuda-burn") == "Running"
        assert node_status(sh, "omen2")["cuda_jobs_running"] == 1

        # the job stopped: pods evicted, relabelled, vfio-pci, the 5090 advertised, one VM scheduled
        assert runbook(sh, "lab job stop omen2").returncode == 0
        # the GPU budget: the incident's three other GPU nodes are down, so taking omen2's GPU out of
        # the container pool would leave 4 of the cluster's 4 GPUs out of service (default at most 50%)
        budget = runbook(sh, switch, journal=journal)
        assert budget.returncode == 3, budget.stdout + budget.stderr
        assert "guard gpu-budget: GPU budget exceeded" in " ".join(budget.stdout.split())
        assert kube_node(sh, "omen2")["metadata"]["labels"][LABEL] == "container"
        assert pod_phase(sh, "cuda-burn") == "Running"
        # an operator passes it deliberately (journaled with who and why)
        override = " --override-guard gpu-budget --reason 'lab: the other GPU nodes are down for other causes'"
        switch += override
        done = runbook(sh, switch + " -o json", journal=journal)
        assert done.returncode == 0, done.stdout + done.stderr
        result = json.loads(done.stdout)
        evict = next(o for o in result["outcomes"] if o["step"] == "evict-gpu-pods")
        assert evict["status"] == "succeeded" and evict["evidence"]["action"]["pods"] == ["default/cuda-burn"]
        wait_for(lambda: pod_phase(sh, "cuda-burn") == "(gone)", 30, "the evicted pod to go")
        node = kube_node(sh, "omen2")
        assert node["metadata"]["labels"][LABEL] == "vm-passthrough"
        assert node["status"]["allocatable"][RTX] == "1"
        status = node_status(sh, "omen2")
        assert (status["gpu_driver"], status["cuda_jobs_killed"]) == ("vfio-pci", 0)

        def one_running() -> Any:
            vms = vm_statuses(sh)
            running = [v for v in GPU_VMS if vms[v] == "Running"]
            return running if len(running) == 1 else None

        running = wait_for(one_running, 60, "one GPU VM Running")[0]
        waiting = next(v for v in GPU_VMS if v != running)
        assert vm_statuses(sh)[waiting] == "ErrorUnschedulable"
        report = result["report"]
        assert f"{running}: Running on omen2" in report
        assert f"{waiting}: ErrorUnschedulable: still waits" in report and f"Insufficient {RTX}" in report

        # back to container: refused while the VM holds the GPU
        back = "run gpu-workload-switch --node omen2 -p workload=container --yes" + override
        held = runbook(sh, back, journal=journal)
        assert held.returncode == 3, held.stdout + held.stderr
        assert f"a VM holds the GPU of omen2: {running}" in " ".join(held.stdout.split())
        assert kube_node(sh, "omen2")["metadata"]["labels"][LABEL] == "vm-passthrough"

        # stop both GPU VMs (the waiting one would take the freed GPU), then switch back
        for vm in GPU_VMS:
            ns, name = vm.split("/")
            assert sh(f"kubectl patch vm -n {ns} {name} --type merge "
                      "-p '{\"spec\":{\"runStrategy\":\"Halted\"}}'").returncode == 0
        wait_for(lambda: all(vm_statuses(sh)[v] == "Stopped" for v in GPU_VMS), 60, "the GPU VMs stopped")
        back_done = runbook(sh, back, journal=journal)
        assert back_done.returncode == 0, back_done.stdout + back_done.stderr
        node = kube_node(sh, "omen2")
        assert node["metadata"]["labels"][LABEL] == "container"
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "1"
        assert node_status(sh, "omen2")["gpu_driver"] == "nvidia"
        assert "workload vm-passthrough -> container; GPU driver vfio-pci -> nvidia" in back_done.stdout
        # the GPU serves the host again: a CUDA job can start
        assert runbook(sh, "lab job start omen2").returncode == 0
    finally:
        sh("kubectl delete pod -n default cuda-burn --ignore-not-found --grace-period=0 --force")
