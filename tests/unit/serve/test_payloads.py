"""Alertmanager v4 payloads become typed values; anything else is a clear PayloadError."""

from __future__ import annotations

import json

import pytest

from engine.serve.alertmanager import PayloadError, parse_webhook
from tests.fakes import alert, webhook


def _bytes(data: object) -> bytes:
    return json.dumps(data).encode()


def test_a_v4_payload_parses_and_unknown_keys_are_ignored() -> None:
    body = webhook(alert("omen2", fingerprint="4f2a"))
    body["someFutureKey"] = {"x": 1}
    body["alerts"][0]["newField"] = [1, 2]
    p = parse_webhook(_bytes(body))
    (a,) = p.alerts
    assert (a.name, a.labels["node"], a.fingerprint, a.firing) == ("KubeNodeNotReady", "omen2", "4f2a", True)
    assert a.starts_at is not None and a.starts_at.year == 2026
    assert p.truncated_alerts == 0


def test_an_alert_without_fingerprint_gets_a_stable_one_from_its_labels() -> None:
    one = parse_webhook(_bytes(webhook(alert("omen2", fingerprint="")))).alerts[0]
    two = parse_webhook(_bytes(webhook(alert("omen2", fingerprint="")))).alerts[0]
    other = parse_webhook(_bytes(webhook(alert("omen3", fingerprint="")))).alerts[0]
    assert one.dedup_key == two.dedup_key != other.dedup_key


@pytest.mark.parametrize(("body", "needle"), [
    (b"", "empty body"),
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe", "not UTF-8"),
    (b"[1, 2]", "expected a JSON object"),
    (b'"text"', "expected a JSON object"),
    (_bytes({"version": "4", "status": "firing"}), "alerts"),
    (_bytes({**webhook(alert("omen2")), "version": "3"}), "version"),
    (_bytes({**webhook(alert("omen2")), "alerts": "many"}), "alerts"),
    (_bytes(webhook({**alert("omen2"), "labels": {"node": 7}})), "alerts[0].labels.node"),
    (_bytes(webhook({**alert("omen2"), "status": "exploded"})), "alerts[0].status"),
    (_bytes(webhook({**alert("omen2"), "startsAt": "yesterday"})), "startsAt"),
    (_bytes({**webhook(alert("omen2")), "truncatedAlerts": -1}), "truncatedAlerts"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, "nested too deeply", id="deeply-nested"),
])
def test_malformed_payloads_are_payload_errors_naming_the_problem(body: bytes, needle: str) -> None:
    with pytest.raises(PayloadError) as e:
        parse_webhook(body)
    assert needle in str(e.value)
