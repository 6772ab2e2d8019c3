"""Dedup, circuit breaker and approval budget: decisions with an injected clock."""

from __future__ import annotations

import threading
from pathlib import Path

from engine.serve.cluster import ClusterSnapshot
from engine.serve.config import ServeConfig
from engine.serve.guards import Guards, ReplayGuard, Reservation

HEALTHY = ClusterSnapshot(total_nodes=8, unhealthy_nodes=("omen2",), unhealthy_gpus=1)
INCIDENT = ClusterSnapshot(total_nodes=8, unhealthy_nodes=("omen1", "omen2", "omen3", "omen4"), unhealthy_gpus=4)


def _guards(clock: list[float], **breaker: object) -> Guards:
    cfg = ServeConfig.model_validate({"breaker": breaker} if breaker else {})
    return Guards(cfg, clock=lambda: clock[0])


def test_same_fingerprint_is_a_duplicate_within_the_window() -> None:
    clock = [1000.0]
    g = _guards(clock)
    r = g.reserve("rb|fp1", "omen2")
    assert isinstance(r, Reservation)
    g.bind(r, "r-1")
    assert "duplicate" in str(g.reserve("rb|fp1", None))
    clock[0] += 3601
    assert isinstance(g.reserve("rb|fp1", None), Reservation)


def test_a_busy_node_and_a_node_in_cooldown_start_nothing() -> None:
    clock = [1000.0]
    g = _guards(clock)
    r = g.reserve("rb|fp1", "omen2")
    assert isinstance(r, Reservation)
    g.bind(r, "r-1")
    assert "in progress" in str(g.reserve("rb|fp2", "omen2"))
    g.finished("omen2", "r-1", state="succeeded", automatic=True)
    assert "cooldown" in str(g.reserve("rb|fp3", "omen2"))
    clock[0] += 901
    assert isinstance(g.reserve("rb|fp4", "omen2"), Reservation)


def test_a_released_claim_can_be_taken_again_unless_the_key_is_kept() -> None:
    g = _guards([0.0])
    r = g.reserve("k", "omen2")
    assert isinstance(r, Reservation)
    g.release(r)
    r2 = g.reserve("k", "omen2")
    assert isinstance(r2, Reservation)
    g.release(r2, keep_key=True)
    assert "nothing was started" in str(g.reserve("k", "omen2"))
    assert isinstance(g.reserve("other", "omen2"), Reservation)  # the node itself is free


def test_concurrent_identical_reservations_yield_exactly_one() -> None:
    g = _guards([0.0])
    barrier = threading.Barrier(20)
    won: list[object] = []

    def go() -> None:
        barrier.wait()
        won.append(g.reserve("rb|same", "omen2"))

    threads = [threading.Thread(target=go) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(isinstance(w, Reservation) for w in won) == 1


def test_the_incident_trips_the_default_unhealthy_threshold() -> None:
    g = _guards([0.0])
    warnings = g.check_auto("gpu-node-recovery", "omen2", INCIDENT)
    assert warnings and "4 of 8 nodes are unhealthy" in warnings[0]
    allowing = _guards([0.0], max_unhealthy_nodes=4)
    assert allowing.check_auto("gpu-node-recovery", "omen2", INCIDENT) == []


def test_too_many_unhealthy_gpus_trip_the_breaker() -> None:
    g = _guards([0.0], max_unhealthy_nodes=10, max_unhealthy_gpus=3)
    (w,) = g.check_auto("rb", "omen2", INCIDENT)
    assert "4 GPUs" in w


def test_at_most_n_automatic_runs_per_runbook_per_window() -> None:
    clock = [0.0]
    g = _guards(clock, max_auto_runs=2, window="10m")
    assert g.check_auto("rb", "n1", HEALTHY) == []
    assert g.check_auto("rb", "n2", HEALTHY) == []
    assert "2 automatic runs of rb" in g.check_auto("rb", "n3", HEALTHY)[0]
    assert g.check_auto("other", "n3", HEALTHY) == []  # per runbook
    g.undo_auto("rb")
    assert g.check_auto("rb", "n3", HEALTHY) == []
    clock[0] += 601
    assert g.check_auto("rb", "n4", HEALTHY) == []


def test_a_failed_automatic_run_opens_the_node_breaker_until_reset(tmp_path: Path) -> None:
    state = tmp_path / "breaker.json"
    g = _guards([0.0], state_file=str(state))
    assert g.finished("omen2", "r-1", state="failed", automatic=True, reason="kubelet still down")
    assert "stay off until a person resets it" in g.check_auto("rb", "omen2", HEALTHY)[0]
    assert g.check_auto("rb", "omen3", HEALTHY) == []
    # a restart keeps it open
    again = _guards([0.0], state_file=str(state))
    assert again.check_auto("rb", "omen2", HEALTHY)
    assert again.reset(node="omen2") == ["node:omen2"]
    assert again.check_auto("rb", "omen2", HEALTHY) == []
    assert _guards([0.0], state_file=str(state)).check_auto("rb", "omen2", HEALTHY) == []


def test_a_failed_approved_run_does_not_open_the_breaker() -> None:
    g = _guards([0.0])
    assert not g.finished("omen2", "r-1", state="failed", automatic=False)
    assert g.state()["open_nodes"] == {}


def test_approval_budget() -> None:
    g = _guards([0.0], max_pending_approvals=2)
    assert g.reserve_approval() is None
    g.bind_approval("r-1")
    assert g.reserve_approval() is None
    assert "already waiting" in str(g.reserve_approval())
    g.bind_approval(None)
    assert g.reserve_approval() is None
    g.bind_approval("r-2")
    g.finished(None, "r-1", state="succeeded", automatic=False)
    assert g.reserve_approval() is None


def test_reset_everything() -> None:
    g = _guards([0.0], max_auto_runs=1)
    g.check_auto("rb", "n1", HEALTHY)
    g.finished("n1", "r-1", state="failed", automatic=True)
    assert sorted(g.reset()) == ["node:n1", "runbook:rb"]
    assert g.check_auto("rb", "n2", HEALTHY) == []


def test_replayed_webhook_ids() -> None:
    clock = [0.0]
    r = ReplayGuard(100, clock=lambda: clock[0], max_ids=3)
    assert r.claim("a") and not r.claim("a")
    r.release("a")
    assert r.claim("a")
    clock[0] = 101
    assert r.claim("a")
    for i in range(10):
        assert r.claim(f"x{i}")  # bounded memory: old ids are forgotten
