"""Guards end to end through the HTTP app: dedup, breaker, exclusions, approval budget, restarts."""

from __future__ import annotations

import threading
from typing import Any

from tests.fakes import (
    APPROVE,
    AUTH,
    DIGEST,
    FakeRunStarter,
    alert,
    make_node,
    served,
    trigger_spec,
)

INCIDENT = [make_node(f"omen{i}", ready=i > 4) for i in range(1, 9)]  # omen1..4 NotReady: 4 of 8


def _modes(decisions: list[dict[str, Any]]) -> list[str]:
    return [d.get("mode", "") for d in decisions if d["outcome"] == "started"]


def test_twenty_concurrent_identical_alerts_start_exactly_one_run() -> None:
    starter = FakeRunStarter([trigger_spec(mode="auto")], submit_delay=0.05)
    with served(starter=starter) as s:
        barrier = threading.Barrier(20)
        codes: list[int] = []

        def page() -> None:
            barrier.wait()
            codes.append(s.post_alerts(alert("omen2", fingerprint="same")).status_code)

        threads = [threading.Thread(target=page) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        s.idle()
        assert sorted(codes) == [200] * 19 + [202]
        assert len(starter.requests) == 1
        assert len(starter.executed) == 1


def test_same_node_with_another_fingerprint_is_a_duplicate_while_active_and_in_cooldown() -> None:
    starter = FakeRunStarter([trigger_spec(mode="approve")])
    with served(starter=starter) as s:
        assert s.post_alerts(alert("omen2")).status_code == 202
        s.idle()
        r = s.post_alerts(alert("omen2", alertname="KubeNodeUnreachable"))
        (d,) = r.json()["decisions"]
        assert (r.status_code, d["outcome"]) == (200, "duplicate") and "in progress" in d["reason"]
        (run_id,) = [x["id"] for x in s.client.get("/runs").json()]
        s.client.post(f"/runs/{run_id}/approve", json={"plan_digest": DIGEST}, headers=APPROVE)
        s.idle()
        r = s.post_alerts(alert("omen2", alertname="KubeNodeUnreachable", fingerprint="new"))
        assert "cooldown" in r.json()["decisions"][0]["reason"]
        assert len(starter.requests) == 1


def test_an_alert_storm_over_many_nodes_starts_no_more_automatic_runs_than_the_limit() -> None:
    nodes = [make_node(f"omen{i}", ready=False) for i in range(1, 31)]
    with served(mode="auto", nodes=nodes, breaker={"max_auto_runs": 3, "max_unhealthy_nodes": 100,
                                                  "max_unhealthy_gpus": 100, "max_pending_approvals": 5}) as s:
        r = s.post_alerts(*[alert(f"omen{i}") for i in range(1, 31)])
        assert r.status_code == 202
        decisions = r.json()["decisions"]
        s.idle()
        auto = [q for q in s.starter.requests if q.mode == "auto"]
        approve = [q for q in s.starter.requests if q.mode == "approve"]
        assert len(auto) == 3
        assert len(approve) == 5  # a human is paged, up to the approval budget
        assert all("3 automatic runs of gpu-node-recovery" in q.warnings[0] for q in approve)
        blocked = [d for d in decisions if d["outcome"] == "blocked"]
        assert len(blocked) == 22 and all("waiting for approval" in d["reason"] for d in blocked)
        metrics = s.client.get("/metrics").text
        assert 'runbook_serve_breaker_open{key="gpu-node-recovery",kind="runbook"} 1.0' in metrics
        assert 'runbook_serve_runs_blocked_total{reason="approvals-limit",runbook="gpu-node-recovery"} 22.0' in metrics


def test_the_incidents_four_of_eight_notready_trips_the_default_unhealthy_threshold() -> None:
    with served(mode="auto", nodes=INCIDENT) as s:
        r = s.post_alerts(alert("omen2"))
        assert r.status_code == 202 and _modes(r.json()["decisions"]) == ["approve"]
        (req,) = s.starter.requests
        assert req.mode == "approve"
        assert "4 of 8 nodes are unhealthy" in req.warnings[0]
        s.idle()
        assert s.events() == ["waiting-approval"]
        assert "4 of 8 nodes are unhealthy" in s.sent[0]["text"]


def test_a_configuration_that_allows_it_lets_auto_recover_omen2() -> None:
    with served(mode="auto", nodes=INCIDENT, breaker={"max_unhealthy_nodes": 4}) as s:
        r = s.post_alerts(alert("omen2"))
        assert _modes(r.json()["decisions"]) == ["auto"]
        s.idle()
        (run,) = s.client.get("/runs").json()
        assert (run["state"], run["nodes"]) == ("succeeded", ["omen2"])
        assert s.events() == ["started", "finished"]


def test_force_mode_approve_and_per_runbook_overrides() -> None:
    with served(mode="auto", env={"RUNBOOK_SERVE_FORCE_MODE": "approve"}) as s:
        assert _modes(s.post_alerts(alert("omen2")).json()["decisions"]) == ["approve"]
    with served(mode="approve", mode_overrides={"gpu-node-recovery": "auto"}) as s:
        assert _modes(s.post_alerts(alert("omen2")).json()["decisions"]) == ["auto"]


def test_a_failed_automatic_run_opens_the_breaker_for_that_node_until_reset() -> None:
    starter = FakeRunStarter([trigger_spec(mode="auto")], outcome=lambda run: "failed")
    with served(starter=starter, dedup={"node_cooldown": 0}) as s:
        s.post_alerts(alert("omen2", fingerprint="one"))
        s.idle()
        assert s.events() == ["started", "failed"]
        assert "breaker for omen2 is open" in s.sent[-1]["text"]
        assert 'runbook_serve_breaker_open{key="omen2",kind="node"} 1.0' in s.client.get("/metrics").text

        r = s.post_alerts(alert("omen2", fingerprint="two"))
        assert _modes(r.json()["decisions"]) == ["approve"]
        assert "until a person resets it" in r.json()["decisions"][0]["warnings"][0]
        assert _modes(s.post_alerts(alert("omen3")).json()["decisions"]) == ["auto"]  # other nodes unaffected
        s.idle()

        assert s.client.post("/breaker/reset", json={"node": "omen2"}).status_code == 401
        assert s.client.post("/breaker/reset", json={"node": "omen2"}, headers=AUTH).status_code == 403
        reset = s.client.post("/breaker/reset", json={"node": "omen2"}, headers=APPROVE)
        assert reset.json() == {"reset": ["node:omen2"], "by": "alice"}
        assert 'runbook_serve_breaker_open{key="omen2",kind="node"} 0.0' in s.client.get("/metrics").text
        starter.set_state(s.client.get("/runs").json()[1]["id"], "cancelled")  # the waiting one
        s.dispatcher.reconcile()
        r = s.post_alerts(alert("omen2", fingerprint="three"))
        assert _modes(r.json()["decisions"]) == ["auto"]


def test_excluded_nodes_and_kureds_lock_start_nothing() -> None:
    nodes = [make_node("omen1", labels={"runbook.io/exclude": "true"}),
             make_node("omen2", labels={"remediation.medik8s.io/exclude-from-remediation": "true"}),
             make_node("omen3")]
    with served(nodes=nodes) as s:
        s.cluster.kured = {"omen3": "kured holds its reboot lock for node omen3"}
        r = s.post_alerts(alert("omen1"), alert("omen2"), alert("omen3"))
        assert r.status_code == 200
        reasons = [d["reason"] for d in r.json()["decisions"]]
        assert [d["outcome"] for d in r.json()["decisions"]] == ["blocked"] * 3
        assert "runbook.io/exclude=true" in reasons[0] and "medik8s" in reasons[1] and "kured" in reasons[2]
        assert s.starter.requests == []
        s.idle()
        assert s.events() == ["blocked"] * 3
        # Alertmanager re-sends the same group: refused once, then a duplicate (no notification storm)
        again = s.post_alerts(alert("omen1"))
        assert again.json()["decisions"][0]["outcome"] == "duplicate"
        text = s.client.get("/metrics").text
        assert 'runbook_serve_runs_blocked_total{reason="kured-lock",runbook="gpu-node-recovery"} 1.0' in text
        assert 'runbook_serve_runs_blocked_total{reason="excluded",runbook="gpu-node-recovery"} 2.0' in text


def test_an_unreadable_cluster_fails_closed_and_a_resend_is_considered_again() -> None:
    with served() as s:
        s.cluster.fail = "connection refused"
        r = s.post_alerts(alert("omen2"))
        (d,) = r.json()["decisions"]
        assert d["outcome"] == "blocked" and "connection refused" in d["reason"]
        assert s.starter.requests == []
        s.cluster.fail = None
        assert s.post_alerts(alert("omen2")).status_code == 202


def test_a_full_worker_pool_refuses_instead_of_piling_up() -> None:
    starter = FakeRunStarter([trigger_spec(mode="auto")], execute_delay=0.5)
    with served(starter=starter, workers=1, queue_size=0) as s:
        assert s.post_alerts(alert("omen2")).status_code == 202
        r = s.post_alerts(alert("omen3"))
        (d,) = r.json()["decisions"]
        assert d["outcome"] == "blocked" and "worker pool is full" in d["reason"]
        s.idle()
        assert s.post_alerts(alert("omen3")).status_code == 202  # transient: a re-send is considered


def test_runs_and_approvals_survive_a_restart() -> None:
    left = [
        {"id": "r-old-pending", "runbook": "gpu-node-recovery", "params": {"node": "omen5"}, "nodes": ["omen5"],
         "state": "pending", "source": "alertmanager", "plan_digest": None, "approval_required": False,
         "approved_by": None, "started": "2026-12-02T10:00:00.000Z", "finished": None, "exit_code": None},
        {"id": "r-old-waiting", "runbook": "gpu-node-recovery", "params": {"node": "omen6"}, "nodes": ["omen6"],
         "state": "waiting-approval", "source": "alertmanager", "plan_digest": DIGEST, "approval_required": True,
         "approved_by": None, "started": "2026-12-02T10:00:00.000Z", "finished": None, "exit_code": None},
    ]
    starter = FakeRunStarter([trigger_spec(mode="auto")], preload=left, recover_ids=["r-old-pending"])
    with served(starter=starter) as s:
        s.idle()
        assert starter.executed == ["r-old-pending"]  # queued again at start
        assert s.client.get("/runs/r-old-pending").json()["state"] == "succeeded"
        dup = s.post_alerts(alert("omen6"))  # the waiting run still holds its node
        assert dup.json()["decisions"][0]["outcome"] == "duplicate"
        ok = s.client.post("/runs/r-old-waiting/approve", json={"plan_digest": DIGEST}, headers=APPROVE)
        assert (ok.status_code, ok.json()["queued"]) == (202, True)
        s.idle()
        assert s.client.get("/runs/r-old-waiting").json()["state"] == "succeeded"


def test_an_approval_that_times_out_frees_the_node() -> None:
    with served(mode="approve", dedup={"node_cooldown": 0}) as s:
        (run_id,) = s.post_alerts(alert("omen2")).json()["runs"]
        s.idle()
        s.starter.set_state(run_id, "cancelled")
        s.dispatcher.reconcile()
        s.idle()
        assert s.events() == ["waiting-approval", "failed"]
        assert s.post_alerts(alert("omen2", fingerprint="again")).status_code == 202
