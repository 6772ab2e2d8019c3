"""The paging loop on the lab, all real: the simulator's kube-state-metrics -> Prometheus evaluating the
upstream kubernetes-mixin rules -> Alertmanager -> ``runbook serve`` (bearer token) -> a run.

One module, one monitoring set-up on the session's lab (reset to the incident first): Prometheus and
Alertmanager are added to the running lab (``Lab.start_monitoring``, what ``runbook lab up
--with-monitoring`` does on a running lab) with deploy/monitoring's rules loaded too; one ``runbook
serve`` (approve mode, the runbook's own) with a notification receiver and a Slack-shaped fake
(``tests.fakes.oncall``: the Web API the interactive approval message goes to) on 127.0.0.1; Alertmanager
routed to it. From the incident, every NotReady node pages: omen2 (swap) is approved by a signed
click on its Slack message (as alice, mapped from her Slack user id) and recovered, the message updated;
gpu-3090-2 (containerd down) is refused by the preconditions with one notification however often
Alertmanager re-sends. The lab's compressed clock (docs/lab.md) keeps it to a few minutes.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.lab.monitoring import Monitoring, binary
from tests.fakes.oncall import SLACK_BOT_TOKEN, SLACK_CHANNEL, SLACK_SIGNING_SECRET, OnCallFakes, click
from tests.integration.lab.lab_helpers import wait_for
from tests.integration.lab.serve_helpers import TOKEN, Server, alertmanager_binary, node_json, ready_status, serving

pytestmark = [pytest.mark.integration, pytest.mark.lab, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[3]
RUNBOOK_RULES = REPO / "deploy" / "monitoring" / "runbook-alerts.yaml"
DASHBOARD = REPO / "deploy" / "monitoring" / "runbook-dashboard.json"
RUNBOOK = "gpu-node-recovery"
# Deadlines, not expectations (a loaded 2-core machine is slow): alert `for` is 10 s in the lab.
ALERT_TIMEOUT = 120
PLAN_TIMEOUT = 240
RUN_TIMEOUT = 360
SLACK_ALICE = "U0ALICE01"  # alice's Slack user id (notify.slack.users)


class Receiver:
    """A notification receiver on 127.0.0.1: keeps every JSON body POSTed to it."""

    def __init__(self) -> None:
        received: list[dict[str, Any]] = []
        self.received = received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                received.append(json.loads(self.rfile.read(length)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/notify"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def events(self, node: str) -> list[dict[str, Any]]:
        return [b["runbook_event"] for b in list(self.received) if b.get("runbook_event", {}).get("node") == node]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Loop:
    lab: Any
    monitoring: Monitoring
    server: Server
    receiver: Receiver
    slack: OnCallFakes


@pytest.fixture(scope="module")
def loop(lab: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loop]:
    alertmanager_binary()  # skip (outside CI) before anything starts
    binary("prometheus")
    if lab.dirty:
        lab.reset()
    lab.dirty = True  # omen2 gets recovered
    workdir = tmp_path_factory.mktemp("monitoring-loop")
    receiver = Receiver()
    slack = OnCallFakes()
    env = {**lab.env(), "RUNBOOK_SLACK_BOT_TOKEN": SLACK_BOT_TOKEN,
           "RUNBOOK_SLACK_SIGNING_SECRET": SLACK_SIGNING_SECRET}
    notify = {"url": receiver.url, "slack": {"channel": SLACK_CHANNEL, "api_url": slack.url + "/api",
                                             "users": {SLACK_ALICE: "alice"}}}
    try:
        with serving(env, workdir, {"notify": notify}, token=TOKEN) as server:
            lab.lab.start_monitoring(alert_webhook=f"{server.url}/hooks/alertmanager", webhook_token=TOKEN,
                                     extra_rules=[RUNBOOK_RULES])
            try:
                lab.lab.scrape_serve("lab", f"127.0.0.1:{server.port}")
                yield Loop(lab, lab.lab.monitoring(), server, receiver, slack)
            finally:
                lab.lab.stop_monitoring()
    finally:
        receiver.close()
        slack.close()


def firing(loop: Loop, node: str, alertname: str = "KubeNodeNotReady") -> dict[str, Any] | None:
    return next((a for a in loop.monitoring.alerts()
                 if (a["alertname"], a["node"], a["state"]) == (alertname, node, "firing")), None)


def run_for(loop: Loop, node: str) -> dict[str, Any] | None:
    return next((r for r in loop.server.runs() if r["nodes"] == [node]), None)


def test_the_runbook_rules_load_into_the_labs_prometheus_and_scrape_the_real_server(loop: Loop) -> None:
    def evaluated() -> list[dict[str, Any]]:
        groups = loop.monitoring.rule_groups()
        rules = [r for g in groups for r in g["rules"]]
        return groups if all(r["health"] != "unknown" for r in rules) else []  # not evaluated yet

    groups = {g["name"]: g for g in wait_for(evaluated, 60, "every rule to be evaluated once")}
    assert set(groups) == {"kubernetes-system-kubelet", "runbook-serve"}, groups.keys()
    rules = [r for g in groups.values() for r in g["rules"]]
    assert [(r["name"], r["health"], r.get("lastError", "")) for r in rules if r["health"] != "ok"] == []
    assert {r["name"] for r in groups["runbook-serve"]["rules"]} == {
        "RunbookServeDown", "RunbookServeAbsent", "RunbookServeNotReady", "RunbookWebhooksUnauthorized",
        "RunbookRunsFailing", "RunbookBreakerOpen"}
    kubelet = {r["name"]: r for r in groups["kubernetes-system-kubelet"]["rules"]}
    assert kubelet["KubeNodeNotReady"]["duration"] == loop.lab.lab.scenario().timing.alert_for_seconds
    # the server is a real target: `up` is 1 and its own counters reach Prometheus
    wait_for(lambda: loop.monitoring.query('up{job="runbook-serve"} == 1'), 60, "runbook serve scraped as up")
    assert not any(a["alertname"].startswith("Runbook") and a["state"] == "firing"
                   for a in loop.monitoring.alerts())
    # the Grafana dashboard's queries, with its variables as Grafana fills them, are PromQL this
    # Prometheus accepts (a refused query raises) and its "serve up" panel reads the real server
    queries = [q.replace("$job", "runbook-serve").replace("$instance", ".*").replace("$__rate_interval", "1m")
               for q in _dashboard_exprs(json.loads(DASHBOARD.read_text())["panels"])]
    assert len(queries) > 10
    for query in queries:
        loop.monitoring.query(query)
    up = loop.monitoring.query('sum(up{job="runbook-serve", instance=~".*"})')
    assert [float(s["value"][1]) for s in up] == [1.0], up


def _dashboard_exprs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return ([node["expr"]] if isinstance(node.get("expr"), str) else []) + [
            e for v in node.values() for e in _dashboard_exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in _dashboard_exprs(v)]
    return []


def test_an_alert_from_prometheus_pages_the_server_the_approved_run_recovers_omen2_and_the_resolution_is_recorded(
        loop: Loop, sh: Any) -> None:
    alert = wait_for(lambda: firing(loop, "omen2"), ALERT_TIMEOUT, "KubeNodeNotReady{node=omen2} to fire")
    assert alert["labels"]["job"] == "kube-state-metrics" and alert["labels"]["severity"] == "warning"
    status = sh("runbook lab status", check=True).stdout
    assert "alert KubeNodeNotReady node=omen2: firing" in status, status

    run = wait_for(lambda: run_for(loop, "omen2"), 90, "Alertmanager's webhook to start a run for omen2")
    detail = loop.server.run(run["id"])
    assert (detail["runbook"], detail["source"], detail["approval_required"]) == (RUNBOOK, "alertmanager", True)
    assert "KubeNodeNotReady" in detail["reason"] or "KubeNodeUnreachable" in detail["reason"], detail["reason"]
    fingerprint = detail["reason"].rsplit("fingerprint ", 1)[1]
    waiting = loop.server.wait_state(run["id"], ("waiting-approval",), PLAN_TIMEOUT)
    assert [s["id"] for s in waiting["plan"]["steps"]] == ["relabel-container", "swap-off", "bind-gpus",
                                                           "restart-kubelet"]
    _report_timings(loop, alert, waiting)
    # the server's alert-to-run histogram (the dashboard's "alert to run" panel) reached Prometheus
    wait_for(lambda: loop.monitoring.query(
        'sum(runbook_serve_alert_to_run_start_seconds_count{job="runbook-serve"}) > 0'), 60,
        "runbook_serve_alert_to_run_start_seconds scraped from the server")
    # the on-call engineer approves from Slack: the interactive message shows the plan's digest, and a
    # click signed as Slack signs it approves as the approver her Slack user id is mapped to
    message = wait_for(lambda: loop.slack.approval_message(run["id"]), 60, "the approval message in Slack")
    assert waiting["plan_digest"] in message.shown()
    answer = httpx.post(f"{loop.server.url}/hooks/slack", content=(signed := click(message, user=SLACK_ALICE))[0],
                        headers=signed[1], timeout=30)
    assert (answer.status_code, answer.json()["status"]) == (200, "approved"), answer.text
    done = loop.server.wait_state(run["id"], ("succeeded",), RUN_TIMEOUT)
    assert (done["approved_by"], done["exit_code"]) == ("alice", 0)
    wait_for(lambda: "Approved by alice" in message.shown(), 30, "the Slack message updated with the decision")
    assert not message.buttons()
    node = node_json(sh, "omen2")
    assert ready_status(node) == "True" and node["status"]["allocatable"].get("nvidia.com/gpu") == "1"

    # the rule stops matching, Prometheus resolves the alert, Alertmanager sends "resolved" to the server
    wait_for(lambda: not any(a["node"] == "omen2" for a in loop.monitoring.alerts()), ALERT_TIMEOUT,
             "omen2's alerts to resolve in Prometheus")
    assert "node=omen2" not in sh("runbook lab status", check=True).stdout

    def resolved() -> list[dict[str, Any]]:
        return [e for e in loop.server.run(run["id"])["events"] if e["kind"] == "alert.resolved"]

    (event,) = wait_for(resolved, 90, "the resolved notification recorded against the run")
    assert event["fingerprint"] == fingerprint and "node=\"omen2\"" in event["alert"], event
    time.sleep(3 * loop.lab.lab.scenario().timing.alert_group_interval_seconds)
    assert len(resolved()) == 1  # recorded once, whatever Alertmanager sends after
    assert not firing(loop, "omen2")
    # one waiting-approval notice, one started (the approval), one finished: no notice per re-send
    assert sorted(e["event"] for e in loop.receiver.events("omen2")) == ["finished", "started", "waiting-approval"]


def _iso(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()  # Python >= 3.11: "Z" and nanoseconds are fine


def _report_timings(loop: Loop, alert: dict[str, Any], run: dict[str, Any]) -> None:
    """Print the parts of alert-to-run on this machine (docs/serve.md quotes them; `pytest -rP`)."""
    timing = loop.lab.lab.scenario().timing
    fired = _iso(alert["active_at"]) + timing.alert_for_seconds
    created = _iso(run["events"][0]["time"])
    waiting = _iso(next(e["time"] for e in run["events"] if e["kind"] == "approval.waiting"))
    answer = {m: float(v) for m, v in (line.rsplit(" ", 1) for line in loop.server.get("/metrics").text.splitlines()
              if line.startswith('runbook_serve_webhook_seconds_') and 'endpoint="alertmanager"' in line
              and not line.startswith("runbook_serve_webhook_seconds_bucket"))}
    count = next((v for k, v in answer.items() if k.startswith("runbook_serve_webhook_seconds_count")), 0.0)
    total = next((v for k, v in answer.items() if k.startswith("runbook_serve_webhook_seconds_sum")), 0.0)
    print(f"paging loop timings: alert pending -> firing {timing.alert_for_seconds:.0f} s (for); "
          f"firing -> run created {created - fired:.1f} s (evaluation, resend, group_wait, webhook); "
          f"run created -> waiting for approval {waiting - created:.1f} s (plan + check-mode previews); "
          f"webhook answer mean {1000 * total / count if count else float('nan'):.1f} ms over {count:.0f}")


def test_a_node_down_for_another_cause_fires_the_same_alert_and_is_refused_once_however_often_it_is_resent(
        loop: Loop) -> None:
    wait_for(lambda: firing(loop, "gpu-3090-2"), ALERT_TIMEOUT, "KubeNodeNotReady{node=gpu-3090-2} to fire")
    run = wait_for(lambda: run_for(loop, "gpu-3090-2"), 90, "a run for gpu-3090-2")
    blocked = loop.server.wait_state(run["id"], ("blocked",), PLAN_TIMEOUT)
    assert "not because of swap" in blocked["outcome_reason"] and "containerd" in blocked["outcome_reason"], blocked
    assert blocked["exit_code"] == 3
    assert not any(e["kind"] in ("step.start", "action.intent", "lock.acquired") for e in blocked["events"])

    # Alertmanager keeps re-sending the page (repeat_interval) while the node stays NotReady
    timing = loop.lab.lab.scenario().timing
    am_metrics = f"{loop.monitoring.endpoints.alertmanager}/metrics"

    def sent() -> float:
        for line in httpx.get(am_metrics, timeout=5).text.splitlines():
            if line.startswith('alertmanager_notifications_total{integration="webhook"}'):
                return float(line.split()[-1])
        return 0.0

    before = sent()
    groups = len([a for a in loop.monitoring.alerts() if a["state"] == "firing"])
    wait_for(lambda: sent() >= before + 2 * groups, 4 * timing.alert_repeat_interval_seconds + 60,
             "Alertmanager to re-send every firing group twice")
    assert firing(loop, "gpu-3090-2")  # still paging
    runs = [r for r in loop.server.runs() if r["nodes"] == ["gpu-3090-2"]]
    assert [r["id"] for r in runs] == [run["id"]]  # the re-sends started nothing new
    events = loop.receiver.events("gpu-3090-2")
    assert [e["event"] for e in events] == ["blocked"], events
    assert "not because of swap" in events[0]["reason"]
