"""`runbook diagnose` on the lab's incident: swap named as the root cause with the recovery command;
nothing changed by looking. (The other incident nodes: test_catalogue_diagnose.py.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.lab.hoststate import HostState
from tests.integration.lab.flagship_cli import LABEL, kube_node, runbook

pytestmark = [pytest.mark.integration, pytest.mark.lab]


def test_diagnose_names_swap_as_the_root_cause_and_the_recovery_command(incident: Any, sh: Any) -> None:
    state_dir = incident.lab.record()["nodes"]["omen2"]["state_dir"]
    calls_before = HostState(state_dir).calls()
    r = runbook(sh, "diagnose --node omen2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("node omen2: root cause: swap")
    assert "swap -> kubelet down -> NotReady -> GPU labels gone -> 2 VMs ErrorUnschedulable" in r.stdout
    assert "running with swap on is not supported" in r.stdout
    assert "fix: runbook run gpu-node-recovery --node omen2" in r.stdout
    assert "vfio-pci" in r.stdout  # the note on why the label must change first

    doc = json.loads(runbook(sh, "diagnose --node omen2 -o json").stdout)
    assert doc["cause"] == "swap" and doc["known"] is True
    assert doc["fix"] == "runbook run gpu-node-recovery --node omen2"
    ev = doc["evidence"]
    assert [d["name"] for d in ev["swap_devices"]] == ["/swapfile"]
    assert ev["kubelet_state"] == "activating" and ev["gpu_driver"] == "nvidia"
    assert ev["workload_label"] == "vm-passthrough"
    assert [v["vm"] for v in ev["waiting_gpu_vms"]] == ["gpu-vms/gpu-fedora", "gpu-vms/rhel9-gpu-vm"]
    assert "Insufficient nvidia.com/GB202_GEFORCE_RTX_5090" in ev["waiting_gpu_vms"][0]["why"]
    assert ev["pod_statuses"].get("Terminating", 0) + ev["pod_statuses"].get("Error", 0) >= 1
    # read-only: no mutating command on the host, the node untouched
    assert HostState(state_dir).calls() == calls_before
    assert kube_node(sh, "omen2")["metadata"]["labels"][LABEL] == "vm-passthrough"
