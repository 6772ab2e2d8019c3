"""Notification targets over real HTTP on 127.0.0.1: PagerDuty Events API v2 and signed webhooks.

The receiver checks what PagerDuty documents for ``POST /v2/enqueue`` (and answers 400 like it does
when a body breaks the rules), and verifies ``X-Runbook-Signature`` the way docs/serve.md tells a
receiver to.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from engine.serve.notify import SIGNATURE_HEADER, Notification, Notifier, sign_webhook, verify_webhook
from engine.serve.pagerduty_events import events_for
from engine.serve.testing import FakeRunStarter, alert, served, trigger_spec, webhook

ROUTING_KEY = "R0ut1ngK3yF0rT3stsXXXXXXXXXXXXXX"  # 32 characters, as PagerDuty's integration keys
SECRET = "s3cret-for-signing-webhooks"
GROUP_KEY = webhook()["groupKey"]


def pd_errors(body: bytes) -> list[str]:
    """What PagerDuty's Events API v2 refuses (its documented request format)."""
    errors: list[str] = []
    if len(body) > 512 * 1024:
        errors.append("event larger than 512 KB")
    try:
        ev = json.loads(body)
    except ValueError:
        return ["not JSON"]
    if not isinstance(ev, dict):
        return ["not an object"]
    if not isinstance(ev.get("routing_key"), str) or len(ev["routing_key"]) != 32:
        errors.append("routing_key must be the 32-character integration key")
    action = ev.get("event_action")
    if action not in ("trigger", "acknowledge", "resolve"):
        errors.append(f"event_action {action!r}")
    key = ev.get("dedup_key")
    if action in ("acknowledge", "resolve") and not key:
        errors.append("dedup_key is required to acknowledge or resolve")
    if key is not None and (not isinstance(key, str) or len(key) > 255):
        errors.append("dedup_key must be a string of at most 255 characters")
    if action == "trigger":
        p = ev.get("payload")
        if not isinstance(p, dict):
            return [*errors, "payload is required for a trigger"]
        if not isinstance(p.get("summary"), str) or not p["summary"] or len(p["summary"]) > 1024:
            errors.append("payload.summary: 1..1024 characters")
        if not isinstance(p.get("source"), str) or not p["source"]:
            errors.append("payload.source is required")
        if p.get("severity") not in ("critical", "error", "warning", "info"):
            errors.append(f"payload.severity {p.get('severity')!r}")
        if "timestamp" in p:
            try:
                datetime.fromisoformat(str(p["timestamp"]).replace("Z", "+00:00"))
            except ValueError:
                errors.append("payload.timestamp is not ISO 8601")
        if "custom_details" in p and not isinstance(p["custom_details"], dict):
            errors.append("payload.custom_details must be an object")
    for link in ev.get("links", []):
        if not isinstance(link, dict) or not isinstance(link.get("href"), str):
            errors.append("links[] need an href")
    return errors


class Receiver:
    """A PagerDuty Events v2 endpoint (``/v2/enqueue``) and a webhook endpoint (``/hook``) on loopback."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.hooks: list[tuple[bytes, str | None]] = []
        self.refused: list[list[str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path == "/v2/enqueue":
                    errors = pd_errors(body)
                    if errors:
                        outer.refused.append(errors)
                        self._answer(400, {"status": "invalid event", "message": "Event object is invalid",
                                           "errors": errors})
                        return
                    ev = json.loads(body)
                    outer.events.append(ev)
                    self._answer(202, {"status": "success", "message": "Event processed",
                                       "dedup_key": ev.get("dedup_key")})
                else:
                    outer.hooks.append((body, self.headers.get(SIGNATURE_HEADER)))
                    self._answer(200, {})

            def _answer(self, code: int, data: Mapping[str, Any]) -> None:
                out = json.dumps(data).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _with_steps(state: str) -> Any:
    def outcome(run: dict[str, Any]) -> str:
        now = time.time()
        run.setdefault("events", []).extend([
            {"kind": "step.outcome", "step": "drain", "status": "succeeded", "reason": "",
             "started_at": now - 3, "finished_at": now - 2},
            {"kind": "step.outcome", "step": "restart-kubelet", "status": "succeeded" if state == "succeeded"
             else "failed", "reason": "" if state == "succeeded" else "Ready stayed Unknown for 300s",
             "started_at": now - 2, "finished_at": now}])
        return state
    return outcome


def _serve_with_pagerduty(receiver: Receiver, state: str, **pd: Any) -> Any:
    starter = FakeRunStarter([trigger_spec(mode="auto", matchers=('node=~"omen.*"',))], outcome=_with_steps(state))
    return served("auto", starter=starter, notify_from_config=True, public_url="https://runbook.example.org",
                  notify={"url": receiver.url + "/hook", "secret": SECRET, "pagerduty": {
                      "routing_key": ROUTING_KEY, "url": receiver.url + "/v2/enqueue", **pd}})


def _wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_run_that_succeeds_acknowledges_notes_each_step_and_resolves_the_incident_with_its_report(
        receiver: Receiver) -> None:
    with _serve_with_pagerduty(receiver, "succeeded", acknowledge_on_start=True) as s:
        run_id = s.post_alerts(alert("omen2", fingerprint="fp-omen2")).json()["runs"][0]
        s.idle()
        _wait_for(lambda: len(receiver.events) >= 5)
    assert receiver.refused == []
    assert [e["event_action"] for e in receiver.events] == ["acknowledge", "trigger", "trigger", "trigger", "resolve"]
    # the same key Alertmanager's pagerduty_configs gives the incident: sha256(groupKey)
    assert {e["dedup_key"] for e in receiver.events} == {hashlib.sha256(GROUP_KEY.encode()).hexdigest()}
    steps = [e["payload"]["custom_details"] for e in receiver.events[1:3]]
    assert [(d["step"], d["status"]) for d in steps] == [("drain", "succeeded"), ("restart-kubelet", "succeeded")]
    final = receiver.events[3]["payload"]
    assert final["source"] == "omen2" and final["custom_details"]["state"] == "succeeded"
    assert "step restart-kubelet: succeeded" in final["custom_details"]["report"]
    assert all(e["links"] == [{"href": f"https://runbook.example.org/runs/{run_id}", "text": f"runbook run {run_id}"}]
               for e in receiver.events)


def test_a_failed_run_leaves_the_incident_open_with_the_evidence(receiver: Receiver) -> None:
    with _serve_with_pagerduty(receiver, "failed", dedup_key="alert") as s:
        s.post_alerts(alert("omen2", fingerprint="fp-omen2"))
        s.idle()
        _wait_for(lambda: any(e["payload"]["custom_details"]["event"] == "failed"
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
        _wait_for(lambda: any(json.loads(b)["runbook_event"]["event"] == "finished" for b, _ in receiver.hooks))
    now = time.time()
    for body, header in receiver.hooks:
        assert header is not None and verify_webhook(body, header, SECRET, now=now)
        assert not verify_webhook(body.replace(b"omen2", b"omen3"), header, SECRET, now=now)
        assert not verify_webhook(body, header, "another-secret-of-16b", now=now)
        assert not verify_webhook(body, header, SECRET, now=now + 3600)  # replayed an hour later
    finished = [json.loads(b)["runbook_event"] for b, _ in receiver.hooks
                if json.loads(b)["runbook_event"]["event"] == "finished"][0]
    assert finished["state"] == "succeeded" and finished["node"] == "omen2"
    assert finished["runbook"] == "gpu-node-recovery" and "step drain: succeeded" in finished["report"]
    assert finished["link"] == f"https://runbook.example.org/runs/{run_id}"
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
