"""Resuming and taking over re-apply the rules (issue 25 item 4): a run the leader recovers is held to
``force_mode``, ``mode_overrides``, the breaker, ``max_pending_approvals`` and dedup as a new run is."""

from __future__ import annotations

import time
from typing import Any

from tests.fakes import FakeRunStarter, alert, make_node, served, trigger_spec


def _orphan(node: str = "omen2", **kw: Any) -> dict[str, Any]:
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
    return {"id": f"r-orphan-{node}", "runbook": "gpu-node-recovery", "params": {"node": node}, "nodes": [node],
            "state": "interrupted", "source": "alertmanager", "plan_digest": None, "approval_required": False,
            "approved_by": None, "started": now, "finished": None, "exit_code": None, **kw}


def _starter(*orphans: dict[str, Any]) -> FakeRunStarter:
    return FakeRunStarter([trigger_spec(mode="auto", matchers=('node=~"omen.*"',))], preload=list(orphans),
                          recover_ids=[o["id"] for o in orphans])


def test_an_automatic_orphan_waits_for_approval_when_force_mode_is_approve_now() -> None:
    starter = _starter(_orphan())
    with served(starter=starter, force_mode="approve") as s:
        s.idle()
        run = s.client.get("/runs/r-orphan-omen2").json()
        assert run["state"] == "waiting-approval", run
        assert "force_mode" in starter.run("r-orphan-omen2")["escalations"][0]


def test_an_automatic_orphan_waits_for_approval_while_the_breaker_is_open() -> None:
    nodes = [make_node(f"omen{i}", ready=i > 4) for i in range(1, 9)]  # 4 of 8 NotReady
    starter = _starter(_orphan())
    with served(starter=starter, nodes=nodes, breaker={"max_unhealthy_nodes": 2}) as s:
        s.idle()
        assert s.client.get("/runs/r-orphan-omen2").json()["state"] == "waiting-approval"
        assert "breaker" in starter.run("r-orphan-omen2")["escalations"][0]


def test_an_orphan_that_needs_an_approval_beyond_max_pending_approvals_is_not_started() -> None:
    starter = _starter(_orphan())
    with served(starter=starter, force_mode="approve", breaker={"max_pending_approvals": 0}) as s:
        s.idle()
        assert starter.executed == []
        assert "escalations" not in starter.run("r-orphan-omen2")


def test_an_orphan_nothing_objects_to_resumes_automatically_and_its_node_stays_deduplicated() -> None:
    starter = _starter(_orphan(dedup_key="fp-orphan"))
    with served(starter=starter) as s:
        s.idle()
        assert starter.executed == ["r-orphan-omen2"]
        assert "escalations" not in starter.run("r-orphan-omen2")
        again = s.post_alerts(alert("omen2", fingerprint="fp-orphan")).json()["decisions"][0]
        assert again["outcome"] == "duplicate", again


def test_orphans_keep_their_places_in_the_rate_window_only_those_past_its_limit_wait_for_approval() -> None:
    # A burst's queue handed back by a stopped replica: four automatic runs, created in this order,
    # all in the window; with max_auto_runs 3 the first three had their places, the fourth had none.
    orphans = [_orphan(f"omen{i}", state="pending") for i in range(1, 5)]
    starter = FakeRunStarter([trigger_spec(mode="auto", matchers=('node=~"omen.*"',))], preload=orphans,
                             recover_ids=[o["id"] for o in orphans])
    with served(starter=starter, breaker={"max_auto_runs": 3, "max_unhealthy_nodes": 100}) as s:
        s.idle()
        assert sorted(starter.executed) == ["r-orphan-omen1", "r-orphan-omen2", "r-orphan-omen3", "r-orphan-omen4"]
        assert [r for r in ("omen1", "omen2", "omen3") if "escalations" in starter.run(f"r-orphan-{r}")] == []
        assert "automatic runs of gpu-node-recovery" in starter.run("r-orphan-omen4")["escalations"][0]
