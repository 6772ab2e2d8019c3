"""Notification targets over real HTTP on 127.0.0.1: PagerDuty Events API v2 and signed webhooks.

The receiver checks what PagerDuty documents for ``POST /v2/enqueue`` (and answers 400 like it does
when a body breaks the rules), and verifies ``X-Runbook-Signature`` the way docs/serve.md tells a
receiver to.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from engine.serve.notify import Notification, Notifier, sign_webhook, verify_webhook
from engine.serve.pagerduty_events import events_for
from tests.fakes import FakeRunStarter, alert, served, trigger_spec, two_steps_then, wait_for, webhook
from tests.fakes.notify import ROUTING_KEY, SECRET, Receiver, pd_errors, running

GROUP_KEY = webhook()["groupKey"]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with running() as r:
        yield r


def _serve_with_pagerduty(receiver: Receiver, state: str, **pd: Any) -> Any:
    starter = FakeRunStarter([trigger_spec(mode="auto", matchers=('node=~"omen.*"',))],
                             outcome=two_steps_then(state, "drain"))
    return served("auto", starter=starter, notify_from_config=True, public_url="https://runbook.example.org",
                  notify={"url": receiver.url + "/hook", "secret": SECRET, "pagerduty": {
                      "routing_key": ROUTING_KEY, "url": receiver.url + "/v2/enqueue", **pd}})


def test_a_run_that_succeeds_acknowledges_notes_each_step_and_resolves_the_incident_with_its_report(
        receiver: Receiver) -> None:
    with _serve_with_pagerduty(receiver, "succeeded", acknowledge_on_start=True) as s:
        run_id = s.post_alerts(alert("omen2", fingerprint="fp-omen2")).json()["runs"][0]
        s.idle()
        wait_for(lambda: len(receiver.events) >= 5)
    assert receiver.refused == []
    assert [e["event_action"] for e in receiver.events] == ["acknowledge", "trigger", "trigger", "trigger", "resolve"]
    # the same key Alertmanager's pagerduty_configs gives the incident: sha256(groupKey)
    assert {e["dedup_key"] for e in receiver.events} == {hashlib.sha256(GROUP_KEY.encode()).hexdigest()}
    steps = [e["payload"]["custom_details"] for e in receiver.events[1:3]]
    assert [(d["step"], d["status"]) for d in steps] == [("drain", "succeeded"), ("restart-kubelet", "succeeded")]
    assert "step restart-kubelet succeeded" in receiver.events[2]["payload"]["summary"]
    final = receiver.events[3]["payload"]
    assert final["source"] == "omen2" and final["custom_details"]["state"] == "succeeded"
    assert "step restart-kubelet: succeeded" in final["custom_details"]["report"]
    link = f"https://runbook.example.org/ui/runs/{run_id}"
    assert all(e["links"] == [{"href": link, "text": f"runbook run {run_id}"}]
               for e in receiver.events)


def test_a_failed_run_leaves_the_incident_open_with_the_evidence(receiver: Receiver) -> None:
    with _serve_with_pagerduty(receiver, "failed", dedup_key="alert") as s:
        s.post_alerts(alert("omen2", fingerprint="fp-omen2"))
        s.idle()
        wait_for(lambda: any(e["payload"]["custom_details"]["event"] == "failed"
                              for e in receiver.events if "payload" in e))
        time.sleep(0.2)  # nothing more may follow
    assert receiver.refused == []
    actions = [e["event_action"] for e in receiver.events]
    assert "resolve" not in actions and "acknowledge" not in actions  # not configured to acknowledge
    assert {e["dedup_key"] for e in receiver.events} == {"runbook-fp-omen2"}
    details = receiver.events[-1]["payload"]["custom_details"]
    assert details["state"] == "failed"
    assert "restart-kubelet: failed" in details["report"] and "Ready stayed Unknown" in details["report"]


def test_pagerduty_events_stay_within_the_documented_limits_whatever_the_alert_carried() -> None:
    n = Notification("failed", "r" * 5000, node="n" * 5000, run_id="run-1", reason="x" * 100_000,
                     warnings=["w" * 10_000] * 50, report="y" * 1_000_000, alert_key="k" * 1000,
                     extra={f"k{i}": "v" * 100_000 for i in range(50)})
    (event,) = events_for(n, routing_key=ROUTING_KEY, dedup="alert")
    body = json.dumps(event).encode()
    assert pd_errors(body) == []
    assert len(body) < 64 * 1024 and len(event["dedup_key"]) <= 255
    assert events_for(Notification("blocked", "(all)", reason="3 alerts refused"), routing_key=ROUTING_KEY) == []


def test_webhooks_are_signed_and_a_receiver_rejects_a_tampered_or_replayed_body(receiver: Receiver) -> None:
    with _serve_with_pagerduty(receiver, "succeeded") as s:
        run_id = s.post_alerts(alert("omen2")).json()["runs"][0]
        s.idle()
        wait_for(lambda: any(json.loads(b)["runbook_event"]["event"] == "finished" for b, _ in receiver.hooks))
    now = time.time()
    for body, header in receiver.hooks:
        assert header is not None and verify_webhook(body, header, SECRET, now=now)
        assert not verify_webhook(body.replace(b"omen2", b"omen3"), header, SECRET, now=now)
        assert not verify_webhook(body, header, "another-secret-of-16b", now=now)
        assert not verify_webhook(body, header, SECRET, now=now + 3600)  # replayed an hour later
    finished = next(json.loads(b)["runbook_event"] for b, _ in receiver.hooks
                    if json.loads(b)["runbook_event"]["event"] == "finished")
    assert finished["state"] == "succeeded" and finished["node"] == "omen2"
    assert finished["runbook"] == "gpu-node-recovery" and "step drain: succeeded" in finished["report"]
    assert finished["link"] == f"https://runbook.example.org/ui/runs/{run_id}"
    assert "step" not in [json.loads(b)["runbook_event"]["event"] for b, _ in receiver.hooks]


def test_the_signature_is_hmac_sha256_of_timestamp_dot_body() -> None:
    import hmac

    body = b'{"text":"x"}'
    expected = hmac.new(SECRET.encode(), b"1700000000." + body, hashlib.sha256).hexdigest()
    assert sign_webhook(body, SECRET, 1700000000) == f"t=1700000000,v1={expected}"
    assert not verify_webhook(body, None, SECRET, now=1700000000)
    assert not verify_webhook(body, "v1=" + expected, SECRET, now=1700000000)  # no timestamp


def test_a_notifier_without_pagerduty_or_url_sends_nothing() -> None:
    n = Notifier(None)
    n.notify(Notification("finished", "rb", run_id="r-1"))
    assert n.flush(1) and n.sent == 0 and n.failed == 0
