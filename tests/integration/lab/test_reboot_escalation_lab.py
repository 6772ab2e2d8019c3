"""Lab: the flagship on omen2 whose swap cannot be turned off escalates to ``node-reboot``, and the
reboot really happens in the simulated host (issue 29).

The fault: omen2's /swapfile is commented out in /etc/fstab but still on, and ``swapoff`` fails with
"Cannot allocate memory" (the device's ``swapoff_error``: the RAM cannot take its pages back). The
flagship relabels, its swap-off step fails, and the run escalates to ``node-reboot``, parked until a
person approves it. Once approved and resumed it reboots omen2 through Ansible's ``reboot`` module
over real SSH: the host's sshd goes away and comes back (its log shows both), the boot id changes,
the boot re-reads /etc/fstab (the commented-out swap stays off), kubelet starts per its enabled state
and the node turns Ready with its GPU back on nvidia and allocatable; the pods that stayed on the
node through the reboot get fresh statuses from the kubelet (restarted once, running since the boot,
Ready again), the GPU Operator's operands run as DaemonSet pods. What the runs say is checked
against what the host recorded (calls.jsonl, the journal, sshd's log), not only their exit codes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.lab.hoststate import HostState
from engine.lab.sim_kube import parse_time
from tests.integration.lab.flagship_cli import LABEL, host_lines, kube_node, ready, runbook
from tests.integration.lab.lab_helpers import kubectl_json, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.lab]

COMMENTED_FSTAB = ("# /etc/fstab: static file system information.\n"
                   "UUID=5b1f3c2e-8d4a-4c6e-9f70-2a1b3c4d5e6f / ext4 errors=remount-ro 0 1\n"
                   "# /swapfile none swap sw 0 0\n")


def omen2_host(lab: Any) -> tuple[HostState, Path]:
    record = lab.lab.record()
    return HostState(record["nodes"]["omen2"]["state_dir"]), Path(record["hosts"]["omen2"]["host_dir"])


@pytest.mark.timeout(1500)
def test_the_flagship_escalates_to_node_reboot_and_the_host_really_reboots(
        fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    journal = tmp_path / "journal.sqlite"
    host, host_dir = omen2_host(fresh_lab)
    fresh_lab.lab.write_host_file("omen2", "/etc/fstab", COMMENTED_FSTAB)

    def fault(state: dict[str, Any]) -> None:
        state["swap"]["devices"]["/swapfile"]["swapoff_error"] = "Cannot allocate memory"

    host.update(fault)
    assert host.read()["swap"]["active"] == ["/swapfile"]
    boot_id_before = host_lines(sh, "omen2", "cat /proc/sys/kernel/random/boot_id")
    listening_before = (host_dir / "sshd.log").read_text().count("Server listening on")

    failed = runbook(sh, "run gpu-node-recovery --node omen2 --yes -o json", journal=journal)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    parent = json.loads(failed.stdout)["run_id"]
    shown = json.loads(runbook(sh, f"runs show {parent} -o json", journal=journal).stdout)
    (child,) = [c for c in shown["children"] if c["why"] == "escalated to"]
    assert child["runbook"] == "node-reboot"
    swapoffs = host.calls("swapoff")
    assert [c["rc"] for c in swapoffs] == [4]  # it failed, and it is why the run failed
    assert host.calls("shutdown") == []  # parked: nothing reboots before a person approves
    waiting = json.loads(runbook(sh, f"runs show {child['run']} -o json", journal=journal).stdout)
    assert waiting["state"] == "waiting-approval", waiting

    approved = runbook(sh, f"approve {child['run']} --plan-digest {waiting['plan_digest']}", journal=journal)
    assert approved.returncode == 0, approved.stdout + approved.stderr
    resumed = runbook(sh, f"resume {child['run']} --yes -o json", journal=journal, timeout=1200)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr

    # the host rebooted: the module's shutdown call, sshd gone and back in the same namespace, a new
    # boot id, the boot's journal
    assert [(c["cmd"], c["argv"][0]) for c in host.calls("shutdown")] == [("shutdown", "-r")]
    log = (host_dir / "sshd.log").read_text()
    assert "runbook-lab: host rebooting (sshd gone)" in log
    assert log.count("Server listening on") == listening_before + 1
    boot_id_after = host_lines(sh, "omen2", "cat /proc/sys/kernel/random/boot_id")
    assert boot_id_after != boot_id_before
    state = host.read()
    assert state["boot"]["count"] == 1 and state["boot"]["id"] == boot_id_after[0]
    systemd = [e["msg"] for e in host.journal("systemd")]
    assert f"-- Boot {boot_id_after[0].replace('-', '')} --" in systemd
    # /etc/fstab re-read: the commented-out swap stayed off, as /proc/swaps shows over SSH
    assert state["swap"]["active"] == []
    assert host_lines(sh, "omen2", "cat /proc/swaps")[1:] == []
    assert not any(m.startswith("Activated swap") for m in systemd)
    # kubelet back per its enabled state, the node Ready with its GPU on nvidia, uncordoned
    node = kube_node(sh, "omen2")
    assert ready(node) and not node["spec"].get("unschedulable")
    assert node["status"]["nodeInfo"]["bootID"] == boot_id_after[0]  # the kubelet reports the new boot
    assert node["metadata"]["labels"][LABEL] == "container"
    assert node["status"]["allocatable"].get("nvidia.com/gpu") == "1"
    assert [d["driver"] for d in state["pci_devices"] if d.get("display")] == ["nvidia"]
    assert state["units"]["kubelet"]["active"] == "active"

    # the kubelet re-registered the node's pods as a real one does after a reboot: NFD's worker (a
    # DaemonSet pod that stayed on the cordoned node) restarted once, running since the boot, Ready
    def nfd_worker() -> Any:
        pods = kubectl_json(sh, "get pods -n gpu-operator --field-selector spec.nodeName=omen2")["items"]
        found = [p for p in pods if p["metadata"]["labels"].get("runbook.lab/operand") == "nfd-worker"]
        return found[0] if found and any(c["type"] == "Ready" and c["status"] == "True"
                                         for c in found[0]["status"].get("conditions", [])) else None

    pod = wait_for(nfd_worker, 60, "omen2's NFD worker pod Ready again")
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "DaemonSet"
    (container,) = pod["status"]["containerStatuses"]
    assert container["restartCount"] == 1 and container["ready"], container
    assert container["lastState"]["terminated"]["reason"] == "Unknown"
    assert parse_time(container["state"]["running"]["startedAt"]) >= int(state["boot"]["at"])
    assert parse_time(pod["status"]["startTime"]) < state["boot"]["at"]  # the pod's own start stays
    operands = {p["metadata"]["labels"]["runbook.lab/operand"]: p for p in kubectl_json(
        sh, "get pods -n gpu-operator --field-selector spec.nodeName=omen2")["items"]}
    assert operands["device-plugin"]["metadata"]["ownerReferences"][0]["kind"] == "DaemonSet"
