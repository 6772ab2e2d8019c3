"""A burst of 200 failing nodes against the cluster's budget on the real 1.20 API server (issue 32):
every node gets an answer (its run granted, or refused with its reason) and the budget holds at
every instant (every version of the budget object the API server's watch delivered, and every
granted claim's own view). What is simulated: 200 API-only Nodes (not Ready, 8 GPUs each), and the
runs themselves (a granted run keeps its claim); the claims are the run service's (``engine.budget``:
``ClusterBudget.claim`` judged by ``budget_verdicts``) from two replicas of 8 workers each.
Figures are the benchmark's (``bench/p10_burst.py``), not asserted here."""

from __future__ import annotations

import pytest

from bench.p10_burst import burst
from engine.lab.controlplane import ControlPlane

pytestmark = pytest.mark.integration


def test_a_burst_of_200_nodes_is_answered_node_by_node_and_the_budget_holds_at_every_instant(
        control_plane: ControlPlane) -> None:
    out = burst(control_plane, 200, 20)
    assert out["decided"] == 200 and out["unanswered"] == 0, out
    assert out["granted"] == 20 and out["refused"] == 180, out
    assert out["refused_by"] == ["guard concurrency"], out  # each refusal names its reason
    assert out["violations"] == 0 and out["most_claims_seen"] <= 20, out
    assert out["budget_versions_seen"] >= 1 and out["watch_error"] == "", out  # it watched the whole burst
