"""The flagship on the lab: `runbook run gpu-node-recovery --node omen2 --yes` recovers the incident in
the safe order, verifies it (no host CUDA job killed), reports what changed and what remains; a second
run is all no-ops with reasons; a GPU node down for another cause is refused and left untouched.

Two recoveries: as the incident is (the lab's systemd brings kubelet back by itself once swap is off,
as a real node's would, and ``restart-kubelet`` may be skipped as already done), and with kubelet
stopped first (``systemctl stop kubelet`` through the host's shim: no automatic restart), where the
runbook's restart is the only way back. The second asserts the order from outside the engine: the
label PATCH in the API server's audit log, then ``swapoff`` in the host's call log, then ``systemctl
restart kubelet`` (docs/reliability.md, "Tests that prove what they claim").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.lab.hoststate import HostState
from tests.integration.lab.flagship_cli import (
    LABEL,
    cuda_pids,
    fstab,
    host_lines,
    kube_node,
    node_status,
    ready,
    runbook,
    vm_statuses,
)
from tests.integration.lab.test_durability_helpers import Effects

pytestmark = [pytest.mark.integration, pytest.mark.lab]


def test_a_gpu_node_down_for_another_cause_is_refused_with_the_evidence_and_nothing_changes(
        incident: Any, sh: Any, tmp_path: Path) -> None:
    state_dir = incident.lab.record()["nodes"]["gpu-3090-2"]["state_dir"]
    calls_before = HostState(state_dir).calls()
    node_before = kube_node(sh, "gpu-3090-2")
    r = runbook(sh, "run gpu-node-recovery --node gpu-3090-2 --yes", journal=tmp_path / "journal.sqlite")
    assert r.returncode == 3, r.stdout + r.stderr
    out = " ".join(r.stdout.split())
    assert "precondition down-only-because-of-swap: node gpu-3090-2 is NotReady, but not because of swap" in out
    assert "containerd.sock" in out  # kubelet's last error: the evidence of the real cause
    assert "nothing was changed" in out and "runbook diagnose --node gpu-3090-2" in out
    assert HostState(state_dir).calls() == calls_before  # not one mutating command on the host
    node_after = kube_node(sh, "gpu-3090-2")
    assert node_after["metadata"]["labels"] == node_before["metadata"]["labels"]
    assert node_after["spec"].get("taints") == node_before["spec"].get("taints")
    status = node_status(sh, "gpu-3090-2")
    assert (status["ready"], status["kubelet"]) == (False, "activating")


@pytest.mark.timeout(1200)  # two runs, a diagnose and read-outs; minutes on a loaded CI machine
def test_the_recovery_brings_omen2_back_with_its_gpu_the_cuda_job_alive_and_fstab_edited_minimally(
        fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    journal = tmp_path / "journal.sqlite"
    effects = Effects(fresh_lab)
    fstab_before = fstab(sh, "omen2")
    pids_before = cuda_pids(sh, "omen2")
    assert len(pids_before) == 1

    r = runbook(sh, "run gpu-node-recovery --node omen2 --yes", journal=journal)
    assert r.returncode == 0, r.stdout + r.stderr

    node = kube_node(sh, "omen2")
    assert ready(node)
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "1"
    assert node["metadata"]["labels"][LABEL] == "container"
    status = node_status(sh, "omen2")
    assert (status["swap_active"], status["kubelet"], status["gpu_driver"]) == (False, "active", "nvidia")
    assert (status["cuda_jobs_running"], status["cuda_jobs_killed"]) == (1, 0)
    assert cuda_pids(sh, "omen2") == pids_before  # the same job, not a restarted one

    fstab_after = fstab(sh, "omen2")
    changed = [(a, b) for a, b in zip(fstab_before, fstab_after, strict=True) if a != b]
    assert len(changed) == 1, changed  # only the swap entry; every other line byte for byte
    before_line, after_line = changed[0]
    assert before_line.startswith("/swapfile") and after_line == f"# {before_line}"

    report = r.stdout[r.stdout.index("What changed"):]
    assert "workload label nvidia.com/gpu.workload.config: vm-passthrough -> container" in report
    assert "swap: on (/swapfile) -> off" in report and "kubelet: activating -> active" in report
    assert "host CUDA processes: 1 when planned, 1 now (none killed)" in report
    assert "gpu-vms/gpu-fedora: ErrorUnschedulable" in report and "gpu-vms/rhel9-gpu-vm: ErrorUnschedulable" in report
    assert "runbook run gpu-workload-switch --node omen2 -p workload=vm-passthrough" in report
    assert vm_statuses(sh)["gpu-vms/gpu-fedora"] == "ErrorUnschedulable"

    # the restart step verified "no host CUDA job killed" (or was skipped because it already held);
    # either way the host's call log agrees with what the journal says the step did
    last = json.loads(runbook(sh, "runs -o json", journal=journal).stdout)[0]
    shown = json.loads(runbook(sh, f"runs show {last['id']} -o json", journal=journal).stdout)
    restart = next(e for e in shown["events"] if e.get("step") == "restart-kubelet" and e["kind"] == "step.outcome")
    checks = [v["check"] for v in restart["evidence"].get("verify", [])]
    if restart["status"] == "succeeded":
        assert "no host CUDA process killed since the plan" in checks
        assert effects.kubelet_restarts() == 1
    else:
        assert restart["status"] == "skipped" and "all 1 from the plan still run" in restart["reason"]
        assert effects.kubelet_restarts() == 0
    assert (effects.label_patches(), effects.swapoffs()) == (["container"], 1)

    # a second run: nothing to do, each step says why
    again = runbook(sh, "run gpu-node-recovery --node omen2 --yes -o json", journal=journal)
    assert again.returncode == 0, again.stdout + again.stderr
    result = json.loads(again.stdout)
    assert result["state"] == "succeeded"
    reasons = {o["step"]: (o["status"], o["reason"]) for o in result["outcomes"]}
    assert set(reasons) == {"relabel-container", "swap-off", "bind-gpus", "restart-kubelet"}
    assert all(status == "skipped" and reason.startswith("already done: ") for status, reason in reasons.values())
    assert "label nvidia.com/gpu.workload.config=container" in reasons["relabel-container"][1]
    assert "swap off" in reasons["swap-off"][1]
    assert "kubelet is active" in reasons["restart-kubelet"][1]

    # and diagnose now finds a healthy node, with the VMs that still wait for its GPU
    d = runbook(sh, "diagnose --node omen2 -o json")
    assert d.returncode == 0, d.stdout + d.stderr
    doc = json.loads(d.stdout)
    assert doc["cause"] == "healthy"
    assert any("gpu-workload-switch --node omen2 -p workload=vm-passthrough" in n for n in doc["notes"])


@pytest.mark.timeout(900)
def test_with_kubelet_stopped_the_runbook_restarts_it_after_the_relabel_and_the_swap_off_as_the_logs_show(
        fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    journal = tmp_path / "journal.sqlite"
    effects = Effects(fresh_lab)
    host_lines(sh, "omen2", "systemctl stop kubelet")  # through the host's shim, as an operator would
    assert node_status(sh, "omen2")["kubelet"] == "inactive"
    pids_before = cuda_pids(sh, "omen2")
    assert len(pids_before) == 1

    r = runbook(sh, "run gpu-node-recovery --node omen2 --yes -o json", journal=journal)
    assert r.returncode == 0, r.stdout + r.stderr
    # the order, from outside the engine: the API server's audit log and the host's call log
    assert effects.timeline() == ["systemctl stop kubelet", "label=container", "swapoff",
                                  "systemctl restart kubelet"]
    assert effects.counts() == {"label": 1, "swapoff": 1, "restart": 1}

    # and what the engine says it did
    result = json.loads(r.stdout)
    assert result["state"] == "succeeded"
    assert [(o["step"], o["status"]) for o in result["outcomes"]] == [
        ("relabel-container", "succeeded"), ("swap-off", "succeeded"), ("bind-gpus", "skipped"),
        ("restart-kubelet", "succeeded")]
    restart = result["outcomes"][3]
    verified = {v["check"]: v["holds"] for v in restart["evidence"]["verify"]}
    assert verified["no host CUDA process killed since the plan"] is True and verified["node is Ready"] is True

    node = kube_node(sh, "omen2")
    assert ready(node) and node["metadata"]["labels"][LABEL] == "container"
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "1"
    status = node_status(sh, "omen2")
    assert (status["swap_active"], status["kubelet"], status["gpu_driver"]) == (False, "active", "nvidia")
    assert (status["cuda_jobs_running"], status["cuda_jobs_killed"]) == (1, 0)
    assert cuda_pids(sh, "omen2") == pids_before
