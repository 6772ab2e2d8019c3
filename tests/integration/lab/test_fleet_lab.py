"""Fleets and run guards on the lab, through the real CLI (issue 13's Done-when).

* ``runbook run gpu-node-recovery -l feature.node.kubernetes.io/pci-10de.present=true --max-parallel 2
  --yes`` recovers omen2 and gpu-3090-1, leaves gpu-3090-2 (containerd) and gpu-3090-3 (expired
  certificate) untouched with their reasons in the summary, kills no CUDA job, and exits 3;
* the same with ``--fail-fast`` changes nothing and exits 3;
* ``--node X`` on a node labelled ``runbook.io/exclude=true`` is refused (exit 3, the label named)
  and passes with ``--override-guard exclusion --reason ...``, journaled with who and why.

"Changed nothing" and "untouched" are read from outside the engine: the API server's audit log
(mutating requests by the engine's user) and each node host's log of mutating commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.lab.controlplane import ControlPlane
from engine.lab.hoststate import HostState
from engine.runs import current_user
from tests.integration.lab.flagship_cli import LABEL, cuda_pids, kube_node, node_status, ready, runbook

pytestmark = [pytest.mark.integration, pytest.mark.lab]

GPU_NODES = ("gpu-3090-1", "gpu-3090-2", "gpu-3090-3", "omen2")
FLEET = "run gpu-node-recovery -l feature.node.kubernetes.io/pci-10de.present=true --max-parallel 2 --yes"


class Outside:
    """What changed in the cluster and on the node hosts since it was made (not the engine's word)."""

    def __init__(self, lab: Any) -> None:
        record = lab.lab.record()
        self.plane = ControlPlane.from_state(record["controlplane_dir"])
        self.hosts = {n: HostState(record["nodes"][n]["state_dir"]) for n in GPU_NODES}
        self.audit = self.plane.audit_mark()
        self.calls = {n: len(h.calls()) for n, h in self.hosts.items()}

    def mutations(self) -> list[dict[str, Any]]:
        """The engine's mutating API requests (the lab's admin user; dry runs excluded)."""
        return self.plane.mutations(since=self.audit)

    def node_mutations(self, node: str) -> list[str]:
        """Mutating requests on the node object or on pods bound to it (evictions, deletions)."""
        out = []
        for e in self.mutations():
            ref = e.get("objectRef", {})
            if ref.get("resource") == "nodes" and ref.get("name") == node:
                out.append(f"{e.get('verb')} {e.get('requestURI')}")
        return out

    def host_calls(self, node: str) -> list[str]:
        return [f"{c['cmd']} {' '.join(c.get('argv', []))}" for c in self.hosts[node].calls()[self.calls[node]:]]


def test_fail_fast_refuses_the_whole_gpu_fleet_and_changes_nothing(incident: Any, sh: Any, tmp_path: Path) -> None:
    outside = Outside(incident)
    r = runbook(sh, f"{FLEET} --fail-fast -o json", journal=tmp_path / "journal.sqlite")
    assert r.returncode == 3, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    outcomes = {row["node"]: row["outcome"] for row in doc["runs"]}
    assert outcomes == {"gpu-3090-1": "not-started", "gpu-3090-2": "blocked", "gpu-3090-3": "blocked",
                        "omen2": "not-started"}
    assert "--fail-fast" in doc["summary"]["refused"]
    assert outside.mutations() == []  # not one write to the API server: no label, no Lease
    assert {n: outside.host_calls(n) for n in GPU_NODES} == {n: [] for n in GPU_NODES}


@pytest.mark.timeout(1200)  # a fleet recovery of two nodes on a loaded CI machine
def test_a_gpu_fleet_recovers_the_swap_nodes_and_leaves_the_others_untouched_with_their_reasons(
        fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    journal = tmp_path / "journal.sqlite"
    pids_before = cuda_pids(sh, "omen2")
    assert len(pids_before) == 1
    outside = Outside(fresh_lab)

    r = runbook(sh, f"{FLEET} -o json", journal=journal, timeout=1000)
    assert r.returncode == 3, r.stdout + r.stderr  # none failed, two blocked
    doc = json.loads(r.stdout)
    rows = {row["node"]: row for row in doc["runs"]}
    assert {n: rows[n]["outcome"] for n in rows} == {"gpu-3090-1": "succeeded", "gpu-3090-2": "blocked",
                                                     "gpu-3090-3": "blocked", "omen2": "succeeded"}
    assert "not because of swap" in rows["gpu-3090-2"]["reason"]
    assert "not because of swap" in rows["gpu-3090-3"]["reason"]
    assert doc["summary"] == {"nodes": 4, "succeeded": 2, "blocked": 2, "exit_code": 3}
    assert all(rows[n]["run_id"] for n in rows)

    for name in ("omen2", "gpu-3090-1"):
        node = kube_node(sh, name)
        assert ready(node), name
        assert node["metadata"]["labels"][LABEL] == "container"
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "1"
    status = node_status(sh, "omen2")
    assert (status["cuda_jobs_running"], status["cuda_jobs_killed"]) == (1, 0)
    assert cuda_pids(sh, "omen2") == pids_before  # the same job, not a restarted one

    for name in ("gpu-3090-2", "gpu-3090-3"):  # untouched, read from outside the engine
        assert outside.node_mutations(name) == [], name
        assert outside.host_calls(name) == [], name
        assert not ready(kube_node(sh, name))
    for name in ("omen2", "gpu-3090-1"):
        assert any(c.startswith("swapoff") for c in outside.host_calls(name)), outside.host_calls(name)

    # one ansible-playbook process per batch: both nodes' swap-off ran in the same Ansible run
    runs = {n: json.loads(runbook(sh, f"runs show {rows[n]['run_id']} -o json", journal=journal).stdout)
            for n in ("omen2", "gpu-3090-1")}
    hosts_seen = {n: {e.get("host") for e in runs[n]["events"]
                      if e["kind"] == "ansible.task" and e.get("step") == "swap-off"} for n in runs}
    assert hosts_seen == {"omen2": {"omen2"}, "gpu-3090-1": {"gpu-3090-1"}}  # each journal has its own host


@pytest.mark.timeout(1200)
def test_an_excluded_node_is_refused_naming_the_label_and_an_override_passes_it_journaled(
        fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    journal = tmp_path / "journal.sqlite"
    sh("kubectl label node gpu-3090-1 runbook.io/exclude=true", check=True)
    outside = Outside(fresh_lab)
    r = runbook(sh, "run gpu-node-recovery --node gpu-3090-1 --yes", journal=journal)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "guard exclusion" in r.stdout and "runbook.io/exclude=true" in r.stdout
    assert outside.mutations() == [] and outside.host_calls("gpu-3090-1") == []

    r = runbook(sh, "run gpu-node-recovery --node gpu-3090-1 --yes --override-guard exclusion "
                "--reason 'INC-7: the owner asked for it'", journal=journal, timeout=1000)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ready(kube_node(sh, "gpu-3090-1"))
    last = json.loads(runbook(sh, "runs -o json", journal=journal).stdout)[0]
    shown = json.loads(runbook(sh, f"runs show {last['id']} -o json", journal=journal).stdout)
    override = [e for e in shown["events"] if e["kind"] == "guard.override"]
    assert len(override) == 1
    assert override[0]["guard"] == "exclusion" and override[0]["reason"] == "INC-7: the owner asked for it"
    assert override[0]["by"] == current_user()  # who (this test's user), and why (above)
