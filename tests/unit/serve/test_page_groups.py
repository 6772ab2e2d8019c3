"""Alertmanager pages resolve per node: a run reports success for its node only; the page (group) is
resolved when every node of its alerts recovered; the server warns at start about routing that
would put several nodes in one page."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from engine.serve.page_groups import PageGroups
from engine.serve.routing import routing_warnings
from tests.fakes import FakeRunStarter, alert, served, trigger_spec, wait_for, webhook
from tests.fakes.oncall import OnCallFakes, running

ROUTING_KEY = "R0ut1ngK3yF0rT3stsXXXXXXXXXXXXXX"


@pytest.fixture
def fakes() -> Iterator[OnCallFakes]:
    with running() as f:
        yield f


def test_a_two_node_group_is_resolved_only_after_both_nodes_runs_succeeded(
        fakes: OnCallFakes, caplog: pytest.LogCaptureFixture) -> None:
    omen3_may_end = threading.Event()

    def outcome(run: dict[str, Any]) -> str:
        if run["params"]["node"] == "omen3":
            omen3_may_end.wait(10)
        return "succeeded"

    starter = FakeRunStarter([trigger_spec(mode="auto", matchers=('node=~"omen.*"',))], outcome=outcome)
    with served("auto", starter=starter, notify_from_config=True, notify={
            "retry": {"attempts": 2, "backoff": 0.05},
            "pagerduty": {"routing_key": ROUTING_KEY, "url": fakes.url + "/v2/enqueue"}}) as s:
        r = s.client.post("/hooks/alertmanager", json=webhook(alert("omen2"), alert("omen3")),
                          headers={"Authorization": "Bearer t0k3n-for-tests-sender"})
        assert len(r.json()["runs"]) == 2, r.text
        first = wait_for(lambda: [e for e in fakes.events if e.get("payload", {}).get("class") == "finished"],
                         10, "omen2's final note")
        time.sleep(0.2)
        assert [e["event_action"] for e in fakes.events] == ["trigger"]  # no resolve: omen3 is still broken
        details = first[0]["payload"]["custom_details"]
        assert details["node"] == "omen2" and "success for omen2 only" in details["reason"]
        assert "omen3, not recovered yet, so the page stays open" in details["reason"]
        omen3_may_end.set()
        s.idle()
        wait_for(lambda: any(e["event_action"] == "resolve" for e in fakes.events), 10, "the resolve")
    actions = [(e["event_action"], e.get("payload", {}).get("source")) for e in fakes.events]
    assert actions == [("trigger", "omen2"), ("trigger", "omen3"), ("resolve", None)]
    assert len({e["dedup_key"] for e in fakes.events}) == 1  # one page: the group's
    mixed = [r.getMessage() for r in caplog.records if "holds the alerts of 2 nodes" in r.getMessage()]
    assert len(mixed) == 1 and "group_by: [alertname, node]" in mixed[0]  # said once, whatever the re-sends


def test_a_node_whose_alert_resolved_counts_as_recovered_and_a_lone_node_resolves_at_once() -> None:
    groups = PageGroups()
    groups.observe("g", firing=["omen2", "omen3", "omen4"])
    groups.observe("g", firing=["omen2", "omen3"], resolved=["omen4"])
    assert groups.recovered("g", "omen2") == ["omen3"]
    groups.observe("g", firing=["omen2", "omen3"])  # re-sent: omen2 stays recovered
    assert groups.recovered("g", "omen3") == []
    assert groups.nodes("g") == {}  # forgotten once recovered
    groups.observe("solo", firing=["omen5"])
    assert groups.recovered("solo", "omen5") == []
    assert groups.recovered("never-seen", "omen6") == []


AM_CONFIG = """
route:
  receiver: default
  group_by: [alertname]
  routes:
    - receiver: runbook
      matchers: ['alertname=~"KubeNodeNotReady|KubeNodeUnreachable"']
      continue: true
    - receiver: runbook-per-node
      group_by: [alertname, node]
    - receiver: runbook-all
      group_by: ['...']
receivers:
  - name: default
  - name: runbook
    webhook_configs: [{url: 'http://127.0.0.1:8080/hooks/alertmanager'}]
  - name: runbook-per-node
    webhook_configs: [{url: 'http://127.0.0.1:8080/hooks/alertmanager'}]
  - name: runbook-all
    webhook_configs: [{url: 'http://127.0.0.1:8080/hooks/alertmanager'}]
"""


def test_routing_that_groups_without_the_node_label_is_named_and_per_node_routing_is_not() -> None:
    import yaml

    warnings = routing_warnings(yaml.safe_load(AM_CONFIG), {"gpu-node-recovery": "node"})
    assert len(warnings) == 1, warnings
    assert "route.routes[0] (receiver runbook) groups by ['alertname'], without node" in warnings[0]
    assert "group_by: [alertname, node]" in warnings[0]


def test_the_server_warns_at_start_when_alertmanagers_routing_would_resolve_others_alerts(
        fakes: OnCallFakes, caplog: pytest.LogCaptureFixture) -> None:
    fakes.am_config = AM_CONFIG
    caplog.set_level(logging.WARNING, logger="engine.serve.routing")
    with served("auto", alertmanager={"url": fakes.url}):
        found = wait_for(lambda: [r.getMessage() for r in caplog.records if "groups by" in r.getMessage()], 10,
                         "the routing warning")
    assert "receiver runbook" in found[0] and "gpu-node-recovery" in found[0]


def test_a_node_whose_alert_resolved_lets_the_last_run_resolve_the_page(fakes: OnCallFakes) -> None:
    omen2_may_end = threading.Event()

    def outcome(run: dict[str, Any]) -> str:
        if run["params"]["node"] == "omen2":
            omen2_may_end.wait(10)
            return "succeeded"
        return "failed"  # omen3's run fails: only its alert resolving recovers it

    starter = FakeRunStarter([trigger_spec(mode="auto", matchers=('node=~"omen.*"',))], outcome=outcome)
    auth = {"Authorization": "Bearer t0k3n-for-tests-sender"}
    with served("auto", starter=starter, notify_from_config=True, notify={
            "retry": {"attempts": 2, "backoff": 0.05},
            "pagerduty": {"routing_key": ROUTING_KEY, "url": fakes.url + "/v2/enqueue"}}) as s:
        s.client.post("/hooks/alertmanager", json=webhook(alert("omen2"), alert("omen3")), headers=auth)
        wait_for(lambda: any(e.get("payload", {}).get("class") == "failed" for e in fakes.events), 10, "omen3 failed")
        r = s.client.post("/hooks/alertmanager", json=webhook(alert("omen2"), alert("omen3", status="resolved")),
                          headers=auth)
        assert r.status_code == 200, r.text
        omen2_may_end.set()
        s.idle()
        wait_for(lambda: any(e["event_action"] == "resolve" for e in fakes.events), 10, "the resolve")
    final = next(e for e in fakes.events if e.get("payload", {}).get("class") == "finished")
    assert "stays open" not in final["payload"]["custom_details"]["reason"]
