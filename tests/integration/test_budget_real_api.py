"""The cluster's budget (``engine.budget``) against the real 1.20 API server: two processes racing for
the last place, one wins; the loser's write is refused by the server (409) and its second look
sees the winner. Each racer is a separate Python process with its own ``KubeConnector``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.budget import BUDGET_LEASE, LEASES, ClusterBudget
from engine.connectors.kube import KubeConnector
from engine.lab.controlplane import ControlPlane

pytestmark = pytest.mark.integration

NS = "kube-node-lease"
REPO = Path(__file__).resolve().parents[2]

# One racer: reads the budget, waits (first attempt only) until the other racer has read it too, then
# decides "room for 2 runs" and writes. Prints its ClaimResult as JSON.
RACER = r"""
import json, sys, time
from pathlib import Path
from engine.budget import ClusterBudget
from engine.connectors.kube import KubeConnector

kubeconfig, ns, run, node, barrier, other = sys.argv[1:7]
first = [True]

def decide(others):
    if first[0]:
        first[0] = False
        Path(barrier).touch()  # I read version v and decided on it
        deadline = time.monotonic() + 60
        while not Path(other).exists():  # the other racer read the same version
            if time.monotonic() > deadline:
                raise SystemExit("the other racer never came")
            time.sleep(0.01)
    return f"full: {len(others)} runs in flight" if len(others) >= 2 else None

budget = ClusterBudget(KubeConnector(kubeconfig=kubeconfig), ns)
result = budget.claim(run, node, decide)
print(json.dumps({"granted": result.granted, "reason": result.reason, "attempts": result.attempts,
                  "others": [c.run for c in result.others]}))
"""


@pytest.fixture
def plane(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    yield control_plane
    kube = KubeConnector(kubeconfig=str(control_plane.kubeconfig))
    obj = kube.read_object(*LEASES, NS, BUDGET_LEASE)
    if obj is not None:
        kube.delete_object(*LEASES, NS, BUDGET_LEASE)


def test_two_processes_racing_for_the_last_place_in_the_budget_one_wins(plane: ControlPlane,
                                                                        tmp_path: Path) -> None:
    kube = KubeConnector(kubeconfig=str(plane.kubeconfig))
    budget = ClusterBudget(kube, NS)
    assert budget.claim("r-first", "gpu-0", lambda others: None).granted  # one place left of two
    racers = []
    for me, other in (("a", "b"), ("b", "a")):
        racers.append(subprocess.Popen(
            [sys.executable, "-c", RACER, str(plane.kubeconfig), NS, f"r-{me}", f"gpu-{me}",
             str(tmp_path / f"{me}.read"), str(tmp_path / f"{other}.read")],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = {}
    for me, p in zip("ab", racers, strict=True):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results[me] = json.loads(out.strip().splitlines()[-1])
    granted = [me for me, r in results.items() if r["granted"]]
    assert len(granted) == 1, results  # exactly one of them
    winner, loser = granted[0], "b" if granted[0] == "a" else "a"
    assert results[winner]["attempts"] == 1 and results[winner]["others"] == ["r-first"]
    # the loser decided on the same version, its write was refused by the server, it looked again
    assert results[loser]["attempts"] == 2, results
    assert results[loser]["reason"] == "full: 2 runs in flight"
    assert sorted(results[loser]["others"]) == sorted(["r-first", f"r-{winner}"])
    assert sorted(c.run for c in budget.claims()) == sorted(["r-first", f"r-{winner}"])
    assert budget.release(f"r-{winner}") and budget.release("r-first")
    assert budget.claims() == []
