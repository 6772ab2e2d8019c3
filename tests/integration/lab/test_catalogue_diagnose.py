"""The catalogue on the lab's incident (issue 19): `runbook diagnose --all` names each sick node's cause
and runbook from the runbooks' declared diagnoses, in one read-only pass; a healthy node has nothing
wrong; containerd-recovery refuses a containerd that cannot start before any change, and brings
gpu-3090-2 back to Ready otherwise. (gpu-3090-3's expired certificate, renewed: test_kubelet_cert_lab.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.lab.hoststate import HostState
from tests.integration.lab.flagship_cli import kube_node, node_status, ready, runbook

pytestmark = [pytest.mark.integration, pytest.mark.lab]

GPU_NODES = ("omen2", "gpu-3090-1", "gpu-3090-2", "gpu-3090-3")
FATAL = ('time="2026-12-03T08:00:00Z" level=fatal msg="containerd: failed to load TOML from '
         '/etc/containerd/config.toml: invalid plugin key URI"')


def _states(lab: Any) -> dict[str, HostState]:
    nodes = lab.lab.record()["nodes"]
    return {n: HostState(nodes[n]["state_dir"]) for n in GPU_NODES}


def test_diagnose_all_names_every_sick_node_with_its_runbook_and_command_read_only(incident: Any, sh: Any) -> None:
    states = _states(incident)
    calls_before = {n: s.calls() for n, s in states.items()}
    r = runbook(sh, "diagnose --all -o json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["catalogue_problems"] == []
    found = {d["node"]: (d["cause"], d["runbook"], d["fix"]) for d in doc["nodes"]}
    assert found == {
        "omen2": ("swap", "gpu-node-recovery", "runbook run gpu-node-recovery --node omen2"),
        "gpu-3090-1": ("swap", "gpu-node-recovery", "runbook run gpu-node-recovery --node gpu-3090-1"),
        "gpu-3090-2": ("containerd", "containerd-recovery", "runbook run containerd-recovery --node gpu-3090-2"),
        "gpu-3090-3": ("kubelet-cert-expired", "kubelet-client-cert-expired",
                       "runbook run kubelet-client-cert-expired --node gpu-3090-3"),
    }
    assert all(d["state"].startswith("NotReady") and d["confidence"] == "high" for d in doc["nodes"])

    table = runbook(sh, "diagnose --all")
    assert table.returncode == 0, table.stdout + table.stderr
    rows = {ln.split()[0]: ln.split() for ln in table.stdout.splitlines()[1:]}
    assert rows["gpu-3090-2"][2:5] == ["containerd", "containerd-recovery", "high"]
    assert set(rows) == set(GPU_NODES)  # the Ready nodes are not listed
    picked = json.loads(runbook(sh, "diagnose -l nvidia.com/gpu.workload.config=vm-passthrough -o json").stdout)
    assert [(d["node"], d["cause"]) for d in picked["nodes"]] == [("omen2", "swap")]
    assert {n: s.calls() for n, s in states.items()} == calls_before  # read-only


def test_diagnose_a_healthy_node_says_nothing_is_wrong(incident: Any, sh: Any) -> None:
    r = runbook(sh, "diagnose --node cp-1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("node cp-1: nothing is wrong")
    none = runbook(sh, "diagnose -l node-role.kubernetes.io/control-plane")
    assert none.returncode == 0 and none.stdout.startswith("nothing is wrong"), none.stdout + none.stderr


def test_diagnose_one_node_shows_the_matched_evidence_of_containerd_down(incident: Any, sh: Any) -> None:
    r = runbook(sh, "diagnose --node gpu-3090-2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("node gpu-3090-2: root cause: containerd")
    assert "+ containerd-not-running (required)" in r.stdout and "+ kubelet-cannot-reach-cri" in r.stdout
    assert "fix: runbook run containerd-recovery --node gpu-3090-2" in r.stdout


def test_containerd_that_cannot_start_is_refused_before_any_change(fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    state = _states(fresh_lab)["gpu-3090-2"]
    state.append_journal("containerd", "containerd", 912, [FATAL])
    calls_before = state.calls()
    r = runbook(sh, "run containerd-recovery --node gpu-3090-2 --yes", journal=tmp_path / "j.sqlite")
    assert r.returncode == 3, r.stdout + r.stderr
    out = " ".join(r.stdout.split())
    assert "precondition containerd-can-start" in out and "failed to load TOML" in out
    assert "nothing was changed" in out
    assert state.calls() == calls_before
    assert node_status(sh, "gpu-3090-2")["ready"] is False


def test_a_failing_start_is_tried_once_and_the_run_fails_with_containerds_journal(
        fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    state = _states(fresh_lab)["gpu-3090-2"]

    def broken(s: dict[str, Any]) -> None:
        s["units"]["containerd"]["start_error"] = {"status": 1, "lines": [FATAL]}

    state.update(broken)
    r = runbook(sh, "run containerd-recovery --node gpu-3090-2 --yes", journal=tmp_path / "j.sqlite")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "failed to load TOML" in r.stdout + r.stderr
    starts = [c for c in state.calls("systemctl") if "containerd" in c["argv"]]
    assert len(starts) == 1, starts  # one start, no loop of restarts
    assert not [c for c in state.calls("systemctl") if "kubelet" in c["argv"]]  # kubelet left alone
    again = runbook(sh, "plan containerd-recovery --node gpu-3090-2")
    assert again.returncode == 3 and "containerd-can-start" in again.stdout  # now refused outright


def test_zram_swap_is_refused_at_plan_time_before_the_relabel_and_nothing_changes(
        fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    state = _states(fresh_lab)["gpu-3090-1"]

    def zram(s: dict[str, Any]) -> None:
        s["swap"]["devices"]["/dev/zram0"] = {"type": "partition", "size": 4 << 30, "used": 0}
        s["swap"]["active"].append("/dev/zram0")

    state.update(zram)
    calls_before = state.calls()
    labels_before = kube_node(sh, "gpu-3090-1")["metadata"]["labels"]
    r = runbook(sh, "run gpu-node-recovery --node gpu-3090-1 --yes", journal=tmp_path / "j.sqlite")
    assert r.returncode == 3, r.stdout + r.stderr
    out = " ".join(r.stdout.split())
    assert "precondition swap-can-be-kept-off" in out and "zram device /dev/zram0" in out
    assert state.calls() == calls_before
    assert kube_node(sh, "gpu-3090-1")["metadata"]["labels"] == labels_before


@pytest.mark.timeout(900)
def test_containerd_recovery_brings_gpu_3090_2_back_to_ready_with_its_gpu(
        fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    state = _states(fresh_lab)["gpu-3090-2"]
    r = runbook(sh, "run containerd-recovery --node gpu-3090-2 --yes", journal=tmp_path / "j.sqlite")
    assert r.returncode == 0, r.stdout + r.stderr
    node = kube_node(sh, "gpu-3090-2")
    assert ready(node) and node["status"]["allocatable"]["nvidia.com/gpu"] == "1"
    status = node_status(sh, "gpu-3090-2")
    assert status["kubelet"] == "active"
    calls = state.calls("systemctl")
    assert [c["argv"] for c in calls if "containerd" in c["argv"]] == [["start", "containerd"]]
    # kubelet came back by itself once the socket answered (its Restart=always; the playbook gives it
    # 30 s, the lab restarts it every 2 s): the runbook's restart step was skipped, not run
    assert not [c for c in calls if "kubelet" in c["argv"]], calls
    assert "containerd: failed -> active" in r.stdout
    after = json.loads(runbook(sh, "diagnose --node gpu-3090-2 -o json").stdout)
    assert after["cause"] == "healthy"
