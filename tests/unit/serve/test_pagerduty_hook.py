"""The PagerDuty endpoint: signature first (400/403, nothing starts), replays, incident mapping."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from engine.serve.pagerduty import sign
from tests.fakes import Served, served

SECRET = "pd-subscription-secret"
MAPPING = {"service": "GPU nodes", "title_pattern": r"Node (?P<node>[a-z0-9.-]+) is NotReady",
           "runbook": "gpu-node-recovery", "mode": "approve"}


def _now_iso(offset: float = 0.0) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(time.time() + offset))


def _delivery(title: str = "[FIRING:1] Node omen2 is NotReady", event_type: str = "incident.triggered",
              service: str = "GPU nodes", occurred_at: str | None = None) -> bytes:
    return json.dumps({"event": {
        "id": "01DEN0BJ1X4MDVUFTS1B0NJTIB", "event_type": event_type, "resource_type": "incident",
        "occurred_at": occurred_at or _now_iso(), "agent": None, "client": None,
        "data": {"id": "Q2R3S4", "type": "incident", "title": title, "status": "triggered", "urgency": "high",
                 "number": 42, "service": {"id": "PSVC123", "summary": service, "type": "service_reference"},
                 "html_url": "https://example.pagerduty.com/incidents/Q2R3S4"}}}).encode()


def _post(s: Served, body: bytes, *, signature: str | None = None, webhook_id: str | None = "wh-1",
          extra: dict[str, str] | None = None) -> Any:
    headers = {"Content-Type": "application/json", **(extra or {})}
    if signature is not None:
        headers["X-PagerDuty-Signature"] = signature
    if webhook_id is not None:
        headers["X-Webhook-Id"] = webhook_id
    return s.client.post("/hooks/pagerduty", content=body, headers=headers)


def _pd(**cfg: Any) -> Any:
    return served(env={"RUNBOOK_PAGERDUTY_SECRET": SECRET}, pagerduty={"mappings": [MAPPING]}, **cfg)


def test_a_signed_incident_maps_to_the_runbook_with_the_node_from_the_title() -> None:
    with _pd() as s:
        body = _delivery()
        r = _post(s, body, signature=sign(body, SECRET))
        assert r.status_code == 202, r.text
        (req,) = s.starter.requests
        assert (req.runbook, dict(req.params), req.mode, req.source) == (
            "gpu-node-recovery", {"node": "omen2"}, "approve", "pagerduty")
        assert "Q2R3S4" in req.reason


def test_an_unsigned_delivery_is_400_and_starts_nothing() -> None:
    with _pd() as s:
        r = _post(s, _delivery())
        assert r.status_code == 400 and "missing X-PagerDuty-Signature" in r.json()["error"]
        assert s.starter.requests == []


@pytest.mark.parametrize("signature", ["", "v1=", "sha256=deadbeef", "v1=nothex", "v0=" + "a" * 64])
def test_a_malformed_signature_header_is_400(signature: str) -> None:
    with _pd() as s:
        r = _post(s, _delivery(), signature=signature)
        assert r.status_code == 400
        assert s.starter.requests == []


def test_a_forged_delivery_is_403_and_starts_nothing() -> None:
    with _pd() as s:
        body = _delivery()
        forged = sign(body, "not-the-secret")
        assert _post(s, body, signature=forged).status_code == 403
        tampered = _delivery(title="[FIRING:1] Node omen3 is NotReady")
        assert _post(s, tampered, signature=sign(body, SECRET), webhook_id="wh-2").status_code == 403
        assert s.starter.requests == []
        text = s.client.get("/metrics").text
        assert 'runbook_serve_webhook_requests_total{endpoint="pagerduty",outcome="forbidden"} 2.0' in text
        assert "runbook_serve_signature_verify_seconds_count 2.0" in text


def test_a_replayed_webhook_id_is_a_duplicate_and_starts_nothing_new() -> None:
    with _pd() as s:
        body = _delivery()
        assert _post(s, body, signature=sign(body, SECRET)).status_code == 202
        again = _post(s, body, signature=sign(body, SECRET))
        assert again.status_code == 200 and again.json()["status"] == "duplicate"
        assert len(s.starter.requests) == 1


def test_a_forged_replay_does_not_poison_the_webhook_id() -> None:
    with _pd() as s:
        body = _delivery()
        assert _post(s, body, signature=sign(body, "forger")).status_code == 403
        assert _post(s, body, signature=sign(body, SECRET)).status_code == 202


def test_other_event_types_and_unmatched_incidents_start_nothing() -> None:
    with _pd() as s:
        ack = _delivery(event_type="incident.acknowledged")
        r = _post(s, ack, signature=sign(ack, SECRET))
        assert (r.status_code, r.json()["status"]) == (200, "ignored")
        other = _delivery(title="Disk full on omen2")
        r = _post(s, other, signature=sign(other, SECRET), webhook_id="wh-3")
        assert (r.status_code, r.json()["status"]) == (200, "ignored")
        elsewhere = _delivery(service="Databases")
        r = _post(s, elsewhere, signature=sign(elsewhere, SECRET), webhook_id="wh-4")
        assert r.json()["status"] == "ignored"
        assert s.starter.requests == []


@pytest.mark.parametrize("body", [b"{", b"[]", b'{"event": {"id": "x"}}',
                                  b'{"event": {"id": "x", "event_type": "incident.triggered", "data": {"title": 1}}}'])
def test_signed_garbage_is_400_never_500(body: bytes) -> None:
    with _pd() as s:
        r = _post(s, body, signature=sign(body, SECRET))
        assert r.status_code == 400, r.text
        assert s.starter.requests == []


def test_bodies_over_two_megabytes_are_refused() -> None:
    with _pd() as s:
        body = _delivery(title="Node omen2 is NotReady " + "x" * (2 * 1024 * 1024))
        r = _post(s, body, signature=sign(body, SECRET))
        assert r.status_code == 413
        assert s.starter.requests == []


def test_without_a_secret_the_endpoint_refuses_everything() -> None:
    with served() as s:
        body = _delivery()
        r = _post(s, body, signature=sign(body, SECRET))
        assert r.status_code == 503 and "RUNBOOK_PAGERDUTY_SECRET" in r.json()["error"]
        assert s.starter.requests == []


def test_hostile_titles_are_refused_by_param_validation() -> None:
    with served(env={"RUNBOOK_PAGERDUTY_SECRET": SECRET}, pagerduty={"mappings": [
            {**MAPPING, "title_pattern": r"Node (?P<node>\S+) is NotReady"}]}) as s:
        body = _delivery(title="Node omen2;reboot is NotReady")
        r = _post(s, body, signature=sign(body, SECRET))
        assert r.json()["decisions"][0]["outcome"] == "rejected"
        assert s.starter.requests == []
