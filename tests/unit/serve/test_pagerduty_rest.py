"""A run paged by a PagerDuty incident reports on that incident through the REST API, and opens no other.

Against ``tests/fakes/oncall.py``: PagerDuty's REST API v2 (notes, acknowledge, resolve; 429 with
Retry-After) and Events API v2 on 127.0.0.1, both checking the documented request formats.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

from engine.serve.pagerduty import sign
from tests.fakes import FakeRunStarter, Served, served, trigger_spec, two_steps_then, wait_for
from tests.fakes.oncall import PD_FROM, PD_TOKEN, OnCallFakes, running

SECRET = "pd-subscription-secret"
INCIDENT = "Q2R3S4"
ROUTING_KEY = "R0ut1ngK3yF0rT3stsXXXXXXXXXXXXXX"


@pytest.fixture
def fakes() -> Iterator[OnCallFakes]:
    with running() as f:
        yield f


def _served(fakes: OnCallFakes, state: str = "succeeded", *, resolve: bool = True, events_v2: bool = True,
            rest: bool = True, **retry: Any) -> Any:
    mapping = {"service": "GPU nodes", "title_pattern": r"Node (?P<node>[a-z0-9.-]+) is NotReady",
               "runbook": "gpu-node-recovery", "mode": "auto", "resolve_incident": resolve}
    notify: dict[str, Any] = {"retry": {"attempts": 4, "backoff": 0.05, "max_retry_after": 0.2, **retry}}
    if rest:
        notify["pagerduty_rest"] = {"url": fakes.url}
    if events_v2:
        notify["pagerduty"] = {"routing_key": ROUTING_KEY, "url": fakes.url + "/v2/enqueue"}
    env = {"RUNBOOK_PAGERDUTY_SECRET": SECRET, "RUNBOOK_PAGERDUTY_API_TOKEN": PD_TOKEN,
           "RUNBOOK_PAGERDUTY_FROM": PD_FROM} if rest else {"RUNBOOK_PAGERDUTY_SECRET": SECRET}
    starter = FakeRunStarter([trigger_spec(mode="auto", matchers=('node=~"omen.*"',))], outcome=two_steps_then(state))
    return served("auto", starter=starter, env=env, notify_from_config=True, public_url="https://runbook.example.org",
                  pagerduty={"mappings": [mapping]}, notify=notify)


def _page(s: Served, incident: str = INCIDENT) -> str:
    body = json.dumps({"event": {
        "id": "01DEN0BJ1X4MDVUFTS1B0NJTIB", "event_type": "incident.triggered", "resource_type": "incident",
        "occurred_at": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()),
        "data": {"id": incident, "type": "incident", "title": "[FIRING:1] Node omen2 is NotReady",
                 "status": "triggered", "urgency": "high", "number": 42,
                 "service": {"id": "PSVC123", "summary": "GPU nodes", "type": "service_reference"}}}}).encode()
    r = s.client.post("/hooks/pagerduty", content=body, headers={
        "Content-Type": "application/json", "X-PagerDuty-Signature": sign(body, SECRET), "X-Webhook-Id": "wh-1"})
    assert r.status_code == 202, r.text
    run_id: str = r.json()["runs"][0]
    return run_id


def test_a_paged_run_notes_acknowledges_and_resolves_the_incident_that_paged_and_opens_no_other(
        fakes: OnCallFakes) -> None:
    incident = fakes.incident(INCIDENT)
    with _served(fakes) as s:
        run_id = _page(s)
        s.idle()
        wait_for(lambda: incident.status == "resolved", 10, "the incident to be resolved")
    assert fakes.refused == []
    assert incident.history == ["acknowledged", "resolved"]
    start, step1, step2, final = incident.notes
    link = f"https://runbook.example.org/ui/runs/{run_id}"
    assert f"run {run_id} started (auto mode)" in start and f"Console: {link}" in start
    assert "step swap-off succeeded" in step1 and "step restart-kubelet succeeded" in step2
    assert "succeeded." in final and "step restart-kubelet: succeeded" in final and "stays open" not in final
    # the note precedes the acknowledgement, the report precedes the resolution
    calls = [(m, p) for m, p, _ in fakes.requests if p.startswith("/incidents/")]
    assert calls[:2] == [("POST", f"/incidents/{INCIDENT}/notes"), ("PUT", f"/incidents/{INCIDENT}")]
    assert calls[-2:] == [("POST", f"/incidents/{INCIDENT}/notes"), ("PUT", f"/incidents/{INCIDENT}")]
    assert fakes.events == []  # no Events API v2 event: no second alert, no second incident
    assert all(h["from"] == PD_FROM and h["authorization"] == f"Token token={PD_TOKEN}"
               for _, p, h in fakes.requests if p.startswith("/incidents/"))


def test_a_failed_run_leaves_the_incident_open_with_the_reason(fakes: OnCallFakes) -> None:
    incident = fakes.incident(INCIDENT)
    with _served(fakes, "failed") as s:
        _page(s)
        s.idle()
        wait_for(lambda: len(incident.notes) == 4, 10, "the final note")
        time.sleep(0.2)  # nothing more may follow
    assert incident.history == ["acknowledged"] and incident.status == "acknowledged"
    final = incident.notes[-1]
    assert "failed." in final and "Ready stayed Unknown for 300s" in final and "The incident stays open." in final


def test_a_trigger_that_does_not_resolve_leaves_a_succeeded_runs_incident_open_and_says_so(
        fakes: OnCallFakes) -> None:
    incident = fakes.incident(INCIDENT)
    with _served(fakes, resolve=False) as s:
        _page(s)
        s.idle()
        wait_for(lambda: len(incident.notes) == 4, 10, "the final note")
        time.sleep(0.2)
    assert incident.status == "acknowledged"
    assert "resolve_incident: false" in incident.notes[-1] and "The incident stays open." in incident.notes[-1]


def test_rate_limits_are_retried_after_retry_after_without_blocking_the_run_and_are_counted(
        fakes: OnCallFakes) -> None:
    incident = fakes.incident(INCIDENT)
    fakes.rate_limit(3)
    with _served(fakes, events_v2=False) as s:
        _page(s)
        s.idle()  # the run ended while PagerDuty was still answering 429
        assert s.starter.run(s.starter.runs()[0]["id"])["state"] == "succeeded"
        wait_for(lambda: incident.status == "resolved", 20, "the incident to be resolved after the 429s")
        text = s.client.get("/metrics").text
        ready = s.client.get("/readyz").json()
    assert len(incident.notes) == 4  # every note arrived once, in order, despite the 429s
    assert 'runbook_serve_notifications_total{outcome="retry",target="pagerduty-rest"} 3.0' in text
    assert 'runbook_serve_notifications_total{outcome="success",target="pagerduty-rest"} 6.0' in text
    assert ready["notify"]["pagerduty-rest"]["retries"] == 3 and ready["notify"]["pagerduty-rest"]["failed"] == 0


def test_an_outage_is_given_up_after_the_retries_counted_and_shown_on_readyz_not_healthz(
        fakes: OnCallFakes) -> None:
    with _served(fakes, events_v2=False, attempts=2) as s:
        fakes.close()  # PagerDuty is down: connection refused
        _page(s)
        s.idle(10)
        assert s.starter.run(s.starter.runs()[0]["id"])["state"] == "succeeded"
        ready = s.client.get("/readyz")
        health = s.client.get("/healthz").json()
        text = s.client.get("/metrics").text
    assert ready.status_code == 200  # a dead target is worth seeing, not worth a restart
    rest = ready.json()["notify"]["pagerduty-rest"]
    assert rest["sent"] == 0 and rest["failed"] == 6 and rest["retries"] == 6
    assert "ConnectError" in rest["last_error"] and rest["last_error_at"]
    assert "notify" not in health and "ConnectError" not in json.dumps(health)
    assert 'runbook_serve_notifications_total{outcome="failure",target="pagerduty-rest"} 6.0' in text
    assert PD_TOKEN not in json.dumps(ready.json())


def test_without_a_rest_token_the_events_v2_path_stays(fakes: OnCallFakes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with _served(fakes, rest=False, resolve=False) as s:
        _page(s)
        s.idle()
        wait_for(lambda: any(e["event_action"] == "resolve" for e in fakes.events), 10, "the resolve event")
    assert {e["dedup_key"] for e in fakes.events} == {f"runbook-pd-incident-{INCIDENT}"}
    # the alert runbook's notes opened is its own: resolved with the run, whatever resolve_incident says
    assert [e["event_action"] for e in fakes.events][-1] == "resolve"
    assert not [p for _, p, _ in fakes.requests if p.startswith("/incidents/")]


def test_the_token_and_from_address_never_reach_a_log_or_a_repr(fakes: OnCallFakes,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    fakes.incident(INCIDENT)
    with _served(fakes) as s:
        _page(s)
        s.idle()
        shown = repr(s.dispatcher.config) + repr(s.dispatcher.notifier.target("pagerduty-rest"))
    logged = "\n".join(r.getMessage() for r in caplog.records) + shown
    assert PD_TOKEN not in logged and PD_FROM not in logged


def test_a_run_waiting_for_approval_notes_its_plan_but_acknowledges_only_once_approved(fakes: OnCallFakes) -> None:
    from tests.fakes import APPROVE

    incident = fakes.incident(INCIDENT)
    mapping = {"service": "GPU nodes", "title_pattern": r"Node (?P<node>[a-z0-9.-]+) is NotReady",
               "runbook": "gpu-node-recovery", "mode": "approve", "resolve_incident": True}
    env = {"RUNBOOK_PAGERDUTY_SECRET": SECRET, "RUNBOOK_PAGERDUTY_API_TOKEN": PD_TOKEN,
           "RUNBOOK_PAGERDUTY_FROM": PD_FROM}
    with served("approve", env=env, notify_from_config=True, pagerduty={"mappings": [mapping]},
                notify={"pagerduty_rest": {"url": fakes.url}, "retry": {"attempts": 2, "backoff": 0.05}}) as s:
        run_id = _page(s)
        s.starter.wait_until(lambda st: st.run(run_id)["state"] == "waiting-approval")
        wait_for(lambda: incident.notes, 10, "the waiting-approval note")
        time.sleep(0.2)
        assert incident.status == "triggered"  # nobody has approved: the page keeps escalating
        digest = s.starter.run(run_id)["plan_digest"]
        assert "waiting for approval" in incident.notes[0] and f"Plan digest: {digest}" in incident.notes[0]
        r = s.client.post(f"/runs/{run_id}/approve", json={"plan_digest": digest}, headers=APPROVE)
        assert r.status_code == 202, r.text
        s.idle()
        wait_for(lambda: incident.status == "resolved", 10, "the incident resolved")
    assert incident.history == ["acknowledged", "resolved"]
    assert "started (approve mode)" in incident.notes[1] and "approved by alice" in incident.notes[1]
