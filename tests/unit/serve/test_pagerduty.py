"""PagerDuty v3 signatures, checked against PagerDuty's own published test vector.

The vector is the one in PagerDuty's Go client (github.com/PagerDuty/go-pagerduty,
``webhookv3/webhookv3_test.go``, ``TestVerifySignature``): its secret, its body (byte for byte)
and its "valid" and "mismatch" signatures. PagerDuty's developer docs describe the scheme
(``docs/webhooks/04-Signatures.md``) but print no secret with their example header.
"""

from __future__ import annotations

import hashlib
import hmac

import pytest

from engine.serve.alertmanager import PayloadError
from engine.serve.pagerduty import (
    SignatureMismatch,
    SignatureMissing,
    parse_delivery,
    sign,
    verify_signature,
)

PD_SECRET = "lDQHScfUeXUKaQRNF+8XIiDKZ7XX3itBAYzwU0TARw8lJqRnkKl2iB1anSb0Z+IK"
PD_VALID = "v1=0c0b9495b893a39e70d1fea2fe11fbe0a825f88b9f67846f6cc07dd2bc5476cd"
PD_MISMATCH = "v1=7020c8a7ec668a9b7012bc3dd82e483394b038f4230acc6785efbf2a7d8bcaf5"
PD_BODY = (
    b'{"event":{"id":"01BWDWL3NYY7LUFPZCC28QUCMK","event_type":"incident.priority_updated",'
    b'"resource_type":"incident","occurred_at":"2021-04-26T17:36:27.458Z","agent":{"html_url":'
    b'"https://acme.pagerduty.com/users/PLH1HKV","id":"PLH1HKV","self":"https://api.pagerduty.com/users/PLH1HKV",'
    b'"summary":"Tenex Engineer","type":"user_reference"},"client":null,"data":{"id":"PGR0VU2","type":"incident",'
    b'"self":"https://api.pagerduty.com/incidents/PGR0VU2","html_url":"https://acme.pagerduty.com/incidents/PGR0VU2",'
    b'"number":2,"status":"triggered","title":"A little bump in the road","service":{"html_url":'
    b'"https://acme.pagerduty.com/services/PF9KMXH","id":"PF9KMXH","self":"https://api.pagerduty.com/services/PF9KMXH",'
    b'"summary":"API Service","type":"service_reference"},"assignees":[{"html_url":'
    b'"https://acme.pagerduty.com/users/PTUXL6G","id":"PTUXL6G","self":"https://api.pagerduty.com/users/PTUXL6G",'
    b'"summary":"User 123","type":"user_reference"}],"escalation_policy":{"html_url":'
    b'"https://acme.pagerduty.com/escalation_policies/PUS0KTE","id":"PUS0KTE",'
    b'"self":"https://api.pagerduty.com/escalation_policies/PUS0KTE","summary":"Default",'
    b'"type":"escalation_policy_reference"},"teams":[{"html_url":"https://acme.pagerduty.com/teams/PFCVPS0",'
    b'"id":"PFCVPS0","self":"https://api.pagerduty.com/teams/PFCVPS0","summary":"Engineering",'
    b'"type":"team_reference"}],"priority":{"html_url":"https://acme.pagerduty.com/account/incident_priorities",'
    b'"id":"PSO75BM","self":"https://api.pagerduty.com/priorities/PSO75BM","summary":"P1",'
    b'"type":"priority_reference"},"urgency":"high","conference_bridge":{"conference_number":1000,'
    b'"conference_url":"https://example.com"},"resolve_reason":null}}}'
)


def test_pagerduty_published_vector_verifies() -> None:
    assert sign(PD_BODY, PD_SECRET) == PD_VALID
    verify_signature(PD_BODY, PD_VALID, [PD_SECRET])


def test_pagerduty_published_mismatch_is_refused() -> None:
    with pytest.raises(SignatureMismatch):
        verify_signature(PD_BODY, PD_MISMATCH, [PD_SECRET])


def test_any_of_several_v1_values_may_match_during_a_secret_rotation() -> None:
    verify_signature(PD_BODY, f"{PD_MISMATCH},{PD_VALID}", [PD_SECRET])
    verify_signature(PD_BODY, f"v2=abc, {PD_VALID}", [PD_SECRET])
    verify_signature(PD_BODY, PD_VALID, ["old-secret", PD_SECRET])


def test_one_changed_byte_of_the_body_is_refused() -> None:
    with pytest.raises(SignatureMismatch):
        verify_signature(PD_BODY.replace(b"A little bump", b"A little jump"), PD_VALID, [PD_SECRET])


@pytest.mark.parametrize("header", [None, "", "   ", "sha256=abc", "v1=", "v1=xyz", "v1=" + "a" * 63,
                                    "v2=" + "a" * 64, PD_VALID.removeprefix("v1=")])
def test_missing_or_malformed_headers_are_signature_missing(header: str | None) -> None:
    with pytest.raises(SignatureMissing):
        verify_signature(PD_BODY, header, [PD_SECRET])


def test_signature_is_hmac_sha256_of_the_raw_body() -> None:
    body = "{\"title\": \"omen2 \u00e9\"}".encode()
    assert sign(body, "s") == "v1=" + hmac.new(b"s", body, hashlib.sha256).hexdigest()


def test_the_vector_body_parses_as_an_incident_event() -> None:
    d = parse_delivery(PD_BODY)
    inc = d.event.incident()
    assert (d.event.event_type, inc.id, inc.title, inc.service.id, inc.service.summary) == (
        "incident.priority_updated", "PGR0VU2", "A little bump in the road", "PF9KMXH", "API Service")


@pytest.mark.parametrize("body", [b"{}", b'{"event": []}', b'{"event": {"id": 1}}', b"nope"])
def test_malformed_deliveries_are_payload_errors(body: bytes) -> None:
    with pytest.raises(PayloadError):
        parse_delivery(body)
