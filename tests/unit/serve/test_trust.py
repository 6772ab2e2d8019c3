"""The trust boundary of ``runbook serve`` (issue 14, items 1-4 and 7-11), through its ASGI app.

Each test states one guarantee of docs/reliability.md: no open server, senders are not approvers,
weak secrets refused, PagerDuty replays refused on signed content, invalid Unicode refused before
anything is created, bounded sizes and memory, summarised refusals, fingerprints that survive a
restart, exact parameter validation.
"""

from __future__ import annotations

import json
import re
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from engine.errors import UsageError
from engine.loader import parse_runbook
from engine.model import Param
from engine.params import coerce_value, is_node_name, resolve_params
from engine.serve.alertmanager import parse_alertmanager
from engine.serve.config import ServeConfig, load_config
from engine.serve.guards import Guards, ReplayGuard
from engine.serve.notify import MAX_NOTIFICATION_BYTES, Notification
from engine.serve.pagerduty import sign
from tests.fakes import (
    APPROVE,
    AUTH,
    DIGEST,
    READ,
    FakeRunStarter,
    alert,
    served,
    trigger_spec,
    webhook,
)

OTHER_APPROVER = {"Authorization": "Bearer t0k3n-for-tests-bob-approver"}
BOB = {"RUNBOOK_APPROVER_TOKEN_BOB": "t0k3n-for-tests-bob-approver"}


# -- 1. no open server ------------------------------------------------------------------------


def test_no_credential_configured_means_every_state_changing_endpoint_answers_401() -> None:
    with served(token=None) as s:
        assert s.client.post("/hooks/alertmanager", json=webhook(alert("omen2"))).status_code == 401
        assert s.client.post("/runs/r-x/approve", json={"plan_digest": DIGEST}).status_code == 401
        assert s.client.post("/breaker/reset", json={}).status_code == 401
        assert s.starter.requests == []


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data",
                                          None])
def test_posts_that_are_not_application_json_are_refused_even_with_a_valid_credential(
        content_type: str | None) -> None:
    with served() as s:
        headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
        r = s.client.post("/hooks/alertmanager", content=json.dumps(webhook(alert("omen2"))), headers=headers)
        assert r.status_code == 415
        r = s.client.post("/breaker/reset", content=b"{}", headers={**APPROVE, **headers})
        assert r.status_code == 415
        assert s.starter.requests == []


def test_requests_for_another_host_name_or_from_another_origin_are_refused() -> None:
    with served() as s:
        rebinding = s.client.post("/hooks/alertmanager", json=webhook(alert("omen2")),
                                  headers={**AUTH, "Host": "attacker.example"})
        assert rebinding.status_code == 421
        assert s.client.get("/runs", headers={"Host": "attacker.example:8080"}).status_code == 421
        cross_site = s.client.post("/hooks/alertmanager", json=webhook(alert("omen2")),
                                   headers={**AUTH, "Origin": "https://attacker.example"})
        assert cross_site.status_code == 403
        assert s.client.post("/breaker/reset", json={}, headers={**APPROVE, "Origin": "null"}).status_code == 403
        assert s.starter.requests == []
        # the bound address and the configured names are fine; /healthz answers any probe
        assert s.client.get("/runs", headers={"Host": "127.0.0.1:8080"}).status_code == 200
        assert s.client.get("/healthz", headers={"Host": "10.0.0.7"}).status_code == 200
        ok = s.client.post("/hooks/alertmanager", json=webhook(alert("omen2")),
                           headers={**AUTH, "Origin": "http://testserver"})
        assert ok.status_code == 202


def test_reads_are_open_on_loopback_by_default_and_need_a_reader_elsewhere() -> None:
    with served() as s:  # 127.0.0.1
        for path in ("/runs", "/breaker", "/triggers", "/metrics"):
            assert s.client.get(path).status_code == 200
    with served(listen="10.1.2.3:8080") as s:
        for path in ("/runs", "/runs/r-x", "/breaker", "/triggers", "/metrics"):
            assert s.client.get(path).status_code == 401
            assert s.client.get(path, headers=AUTH).status_code == 403
            assert s.client.get(path, headers=READ).status_code in (200, 404)
    with served(listen="10.1.2.3:8080", auth={"reads": "open"}) as s:
        assert s.client.get("/runs").status_code == 200


# -- 2. senders are not approvers ---------------------------------------------------------------


def _waiting_run(s: Any) -> str:
    r = s.post_alerts(alert("omen2"))
    (run_id,) = r.json()["runs"]
    s.idle()
    assert s.client.get(f"/runs/{run_id}").json()["state"] == "waiting-approval"
    return str(run_id)


def test_a_senders_credential_cannot_approve_or_reset_breakers() -> None:
    with served(mode="approve") as s:
        run_id = _waiting_run(s)
        r = s.client.post(f"/runs/{run_id}/approve", json={"plan_digest": DIGEST}, headers=AUTH)
        assert r.status_code == 403 and "may not approve" in r.json()["error"]
        assert s.client.post("/breaker/reset", json={}, headers=AUTH).status_code == 403
        assert s.client.get(f"/runs/{run_id}").json()["approved_by"] is None


def test_the_approver_recorded_is_the_credentials_identity_never_a_field() -> None:
    with served(mode="approve", env=BOB) as s:
        run_id = _waiting_run(s)
        forged = s.client.post(f"/runs/{run_id}/approve", json={"plan_digest": DIGEST, "approved_by": "bob"},
                               headers=APPROVE)
        assert forged.status_code == 400 and "identity of your credential (alice)" in forged.json()["error"]
        assert s.client.get(f"/runs/{run_id}").json()["approved_by"] is None
        ok = s.client.post(f"/runs/{run_id}/approve", json={"plan_digest": DIGEST}, headers=APPROVE)
        assert ok.status_code == 202
        s.idle()
        assert s.client.get(f"/runs/{run_id}").json()["approved_by"] == "alice"


def test_the_requester_of_a_run_cannot_approve_it() -> None:
    cli_run = {"id": "r-cli-1", "runbook": "gpu-node-recovery", "params": {"node": "omen5"}, "nodes": ["omen5"],
               "state": "waiting-approval", "source": "cli", "plan_digest": DIGEST, "approval_required": True,
               "approved_by": None, "requested_by": "alice", "started": None, "finished": None, "exit_code": None}
    with served(starter=FakeRunStarter([trigger_spec()], preload=[cli_run]), env=BOB) as s:
        own = s.client.post("/runs/r-cli-1/approve", json={"plan_digest": DIGEST}, headers=APPROVE)
        assert own.status_code == 403 and "requested by alice" in own.json()["error"]
        assert s.client.get("/runs/r-cli-1").json()["approved_by"] is None
        other = s.client.post("/runs/r-cli-1/approve", json={"plan_digest": DIGEST}, headers=OTHER_APPROVER)
        assert other.status_code == 200
        assert s.client.get("/runs/r-cli-1").json()["approved_by"] == "bob"
    with served(starter=FakeRunStarter([trigger_spec()], preload=[cli_run]),
                auth={"requester_cannot_approve": False}) as s:
        assert s.client.post("/runs/r-cli-1/approve", json={"plan_digest": DIGEST}, headers=APPROVE).status_code == 200


def test_one_token_cannot_belong_to_two_identities() -> None:
    with pytest.raises(UsageError, match="RUNBOOK_APPROVER_TOKEN_BOB: the same token is also given to "
                                         "RUNBOOK_WEBHOOK_TOKEN") as e:
        load_config(None, env={"RUNBOOK_WEBHOOK_TOKEN": "shared-token-0123456789",
                               "RUNBOOK_APPROVER_TOKEN_BOB": "shared-token-0123456789"})
    assert "shared-token" not in str(e.value)


# -- 3. weak secrets ----------------------------------------------------------------------------


@pytest.mark.parametrize(("env", "key"), [
    ({"RUNBOOK_WEBHOOK_TOKEN": ""}, "RUNBOOK_WEBHOOK_TOKEN: is blank"),
    ({"RUNBOOK_WEBHOOK_TOKEN": "   \t "}, "RUNBOOK_WEBHOOK_TOKEN: is blank"),
    ({"RUNBOOK_WEBHOOK_TOKEN": "short-secret-15"}, "RUNBOOK_WEBHOOK_TOKEN: is shorter than 16 bytes"),
    ({"RUNBOOK_PAGERDUTY_SECRET": ""}, "RUNBOOK_PAGERDUTY_SECRET: is blank"),
    ({"RUNBOOK_PAGERDUTY_SECRET": "pd-short"}, "RUNBOOK_PAGERDUTY_SECRET: is shorter"),
    ({"RUNBOOK_APPROVER_TOKEN_ALICE": "alice"}, "RUNBOOK_APPROVER_TOKEN_ALICE: is shorter"),
    ({"RUNBOOK_READER_TOKEN_GRAFANA": " padded-reader-token-0123 "}, "RUNBOOK_READER_TOKEN_GRAFANA: has leading"),
])
def test_weak_secrets_from_the_environment_are_refused_naming_the_variable(env: dict[str, str], key: str) -> None:
    with pytest.raises(UsageError) as e:
        load_config(None, env=env)
    assert key in str(e.value)
    for value in env.values():
        if value.strip():
            assert value.strip() not in str(e.value)


@pytest.mark.parametrize(("yaml_text", "key"), [
    ('webhook_token: ""', "webhook_token: is blank"),
    ("webhook_token: tiny-token", "webhook_token: is shorter than 16 bytes"),
    ("auth: {approvers: {bob: '  '}}", "auth.approvers.bob: is blank"),
    ("auth: {senders: {am: abc}}", "auth.senders.am: is shorter"),
    ("pagerduty: {secrets: ['']}", "pagerduty.secrets[0]: is blank"),
])
def test_weak_secrets_in_the_file_are_refused_naming_the_key(tmp_path: Path, yaml_text: str, key: str) -> None:
    f = tmp_path / "serve.yaml"
    f.write_text(yaml_text + "\n")
    with pytest.raises(UsageError) as e:
        load_config(f, env={})
    assert f"{f}: {key}" in str(e.value)
    assert "tiny-token" not in str(e.value) and "abc" not in str(e.value)


# -- 4. PagerDuty replay ------------------------------------------------------------------------

PD_SECRET = "pd-subscription-secret-0123"
PD_MAPPING = {"service": "GPU nodes", "title_pattern": r"Node (?P<node>[a-z0-9.-]+) is NotReady",
              "runbook": "gpu-node-recovery", "mode": "approve"}


def _pd_body(occurred_at: str | None, *, title: str = "Node omen2 is NotReady", incident: str = "Q2R3S4") -> bytes:
    event: dict[str, Any] = {"id": "01EVT", "event_type": "incident.triggered", "resource_type": "incident",
                             "data": {"id": incident, "type": "incident", "title": title,
                                      "service": {"id": "PSVC123", "summary": "GPU nodes"}}}
    if occurred_at is not None:
        event["occurred_at"] = occurred_at
    return json.dumps({"event": event}).encode()


def _iso(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(at))


def _pd_post(s: Any, body: bytes, webhook_id: str) -> Any:
    return s.client.post("/hooks/pagerduty", content=body, headers={
        "Content-Type": "application/json", "X-PagerDuty-Signature": sign(body, PD_SECRET), "X-Webhook-Id": webhook_id})


def _pd_served(**kw: Any) -> Any:
    return served(env={"RUNBOOK_PAGERDUTY_SECRET": PD_SECRET}, pagerduty={"mappings": [PD_MAPPING]}, **kw)


def test_a_signed_delivery_older_than_the_window_or_from_the_future_is_refused() -> None:
    with _pd_served() as s:
        now = time.time()
        old = _pd_post(s, _pd_body(_iso(now - 300 - 60 - 30)), "wh-old")
        assert old.status_code == 403 and "possible replay" in old.json()["error"]
        future = _pd_post(s, _pd_body(_iso(now + 600)), "wh-future")
        assert future.status_code == 403 and "future" in future.json()["error"]
        missing = _pd_post(s, _pd_body(None), "wh-missing")
        assert missing.status_code == 400 and "occurred_at" in missing.json()["error"]
        assert s.starter.requests == []
        within_skew = _pd_post(s, _pd_body(_iso(now - 330)), "wh-skew")  # 5 min + 30 s: within the tolerance
        assert within_skew.status_code == 202


def test_a_replayed_body_with_a_fresh_webhook_id_starts_nothing() -> None:
    with _pd_served(dedup={"fingerprint_window": 0, "node_cooldown": 0}) as s:
        body = _pd_body(_iso(time.time()))
        assert _pd_post(s, body, "wh-1").status_code == 202
        s.idle()
        s.starter.set_state(s.starter.runs()[0]["id"], "cancelled")
        s.dispatcher.reconcile()  # the run ended: only the replay guard stands in the way
        for i in range(5):
            r = _pd_post(s, body, f"wh-forged-{i}")
            assert (r.status_code, r.json()["status"]) == (200, "duplicate")
        assert len(s.starter.requests) == 1


# -- 7. text that is not valid Unicode ----------------------------------------------------------


@pytest.mark.parametrize("where", ["label", "annotation", "fingerprint", "key"])
def test_lone_surrogates_in_an_alert_are_refused_with_400_before_anything_is_created(where: str) -> None:
    a = alert("omen2")
    if where == "label":
        a["labels"]["team"] = "gpu\ud800"
    elif where == "annotation":
        a["annotations"]["summary"] = "bad \udfff text"
    elif where == "fingerprint":
        a["fingerprint"] = "fp\ud834"
    else:
        a["labels"]["k\udc00"] = "v"
    body = json.dumps(webhook(a))  # ensure_ascii: the surrogate travels as a \\udXXX escape
    with served() as s:
        r = s.client.post("/hooks/alertmanager", content=body, headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 400 and "not valid Unicode" in r.json()["error"]
        assert "alerts[0]" in r.json()["error"]
        assert s.starter.requests == [] and s.client.get("/runs").json() == []


def test_a_lone_surrogate_in_a_pagerduty_title_is_refused_with_400() -> None:
    with _pd_served() as s:
        r = _pd_post(s, _pd_body(_iso(time.time()), title="Node omen2 is NotReady \ud800"), "wh-u")
        assert r.status_code == 400 and "event.data.title" in r.json()["error"]
        assert s.starter.requests == []


def test_a_run_holding_invalid_unicode_still_renders() -> None:
    bad = {"id": "r-odd", "runbook": "gpu-node-recovery", "params": {"node": "omen5"}, "nodes": ["omen5"],
           "state": "failed", "source": "cli", "plan_digest": None, "approval_required": False,
           "approved_by": None, "reason": "left by an old version \ud800", "started": None, "finished": None,
           "exit_code": 1}
    with served(starter=FakeRunStarter([trigger_spec()], preload=[bad])) as s:
        r = s.client.get("/runs/r-odd")
        assert r.status_code == 200 and b"left by an old version \\ud800" in r.content
        assert s.client.get("/runs").status_code == 200


# -- 8. bounded everything ----------------------------------------------------------------------


def test_huge_label_and_annotation_values_keep_the_run_and_every_notification_under_64_kib() -> None:
    big = alert("omen2", **{f"l{i}": "x" * 50_000 for i in range(20)})
    big["annotations"] = {f"a{i}": "y" * 50_000 for i in range(20)}
    with served(mode="approve", max_body_bytes=4 * 1024 * 1024) as s:
        r = s.post_alerts(big)
        assert r.status_code == 202, r.text
        (run_id,) = r.json()["runs"]
        s.idle()
        view = s.client.get(f"/runs/{run_id}")
        assert len(view.content) < 64 * 1024
        assert "...[truncated]" in view.json()["reason"]
        assert s.sent and all(len(json.dumps(m).encode()) < 64 * 1024 for m in s.sent)
    n = Notification("blocked", "rb", node="omen2", reason="z" * 500_000, warnings=["w" * 100_000] * 50,
                     extra={"note": "q" * 100_000})
    assert len(json.dumps(n.payload()).encode()) < MAX_NOTIFICATION_BYTES


def test_too_many_labels_is_a_400_and_alerts_beyond_the_cap_are_refused_not_considered() -> None:
    with served() as s:
        r = s.post_alerts(alert("omen2", **{f"l{i}": "v" for i in range(70)}))
        assert r.status_code == 400 and "alerts[0].labels: 75 entries" in r.json()["error"]
    with served(dedup={"fingerprint_window": 3600}, limits={"max_alerts": 5}) as s:
        alerts = [alert(f"omen{i}", alertname="Other") for i in range(8)]
        r = s.post_alerts(*alerts)
        body = r.json()
        assert body["refused_alerts"] == 3
        assert "3 alerts beyond limits.max_alerts (5)" in body["decisions"][-1]["reason"]
        assert len(body["decisions"]) == 6


def test_dedup_and_replay_memory_stay_bounded_when_every_fingerprint_is_fresh() -> None:
    config = ServeConfig()
    guards = Guards(config, clock=lambda: 1000.0)
    replays = ReplayGuard(86400, clock=lambda: 1000.0, max_ids=config.limits.max_dedup_entries)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for i in range(45_000):
            key = f"gpu-node-recovery|fp-{i:08d}-" + "x" * 100
            claim = guards.reserve(key, None)
            assert not isinstance(claim, str)
            guards.release(claim, keep_key=True)
            assert replays.claim(f"wh-{i}-" + "y" * 180)
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert guards.entries() <= config.limits.max_dedup_entries
    assert len(replays) <= config.limits.max_dedup_entries
    assert used - base < 8 * 1024 * 1024, f"{(used - base) / 1e6:.1f} MB"
    # the newest are remembered, the oldest forgotten
    assert isinstance(guards.reserve("gpu-node-recovery|fp-00044999-" + "x" * 100, None), str)
    assert not isinstance(guards.reserve("gpu-node-recovery|fp-00000000-" + "x" * 100, None), str)


def test_parsing_cuts_long_values_with_a_marker() -> None:
    body = json.dumps(webhook(alert("omen2", note="n" * 5000))).encode()
    payload, dropped = parse_alertmanager(body, max_value_bytes=1024)
    note = payload.alerts[0].labels["note"]
    assert dropped == 0 and len(note.encode()) <= 1024 and note.endswith("...[truncated]")


# -- 9. notification storms ---------------------------------------------------------------------


def test_a_thousand_refused_alerts_make_a_handful_of_notifications_and_one_summary() -> None:
    now = [1_000_000.0]
    with served(clock=lambda: now[0], max_body_bytes=8 * 1024 * 1024) as s:
        invalid = [alert(f"omen_bad_{i}", fingerprint=f"bad-{i}") for i in range(500)]  # not node names
        s.cluster.fail = "API server unreachable"
        unreadable = [alert(f"omen{100 + i}") for i in range(500)]  # blocked: the cluster cannot be read
        for group in (invalid, unreadable):
            r = s.post_alerts(*group)
            assert r.status_code == 200
            assert {d["outcome"] for d in r.json()["decisions"]} <= {"rejected", "blocked"}
        s.idle()
        first = len(s.sent)
        assert 0 < first <= 25, first
        for group in (invalid, unreadable):  # Alertmanager re-sends the same groups
            s.post_alerts(*group)
        s.idle()
        assert len(s.sent) == first
        now[0] += 15 * 60 + 1  # the cooldown window is over: one summary
        s.dispatcher.flush_refusals()
        s.idle()
        (summary,) = s.sent[first:]
        assert "alerts refused in the last 15 minutes" in summary["text"]
        refused = summary["runbook_event"]["refused"]
        assert first + refused == 1000  # every refusal reported once, alone or in the summary; re-sends not
        s.cluster.fail = None
        started = s.post_alerts(alert("omen2"))
        assert started.status_code == 202
        s.idle()
        assert "started" in s.events()  # started runs are still announced


# -- 10. restarts forget nothing documented -------------------------------------------------------


def test_an_alert_fingerprint_stays_a_duplicate_across_a_restart() -> None:
    with served(dedup={"node_cooldown": 0}) as s:
        r = s.post_alerts(alert("omen2"))
        (run_id,) = r.json()["runs"]
        s.idle()
        left = [dict(x) for x in s.starter.runs()]
    assert s.starter.run(run_id)["state"] == "succeeded"
    restarted = FakeRunStarter([trigger_spec(mode="auto", matchers=('node=~"omen.*"',))], preload=left)
    with served(starter=restarted, dedup={"node_cooldown": 0}) as s:
        r = s.post_alerts(alert("omen2"))
        (d,) = r.json()["decisions"]
        assert d["outcome"] == "duplicate" and run_id in d["reason"]
        assert restarted.requests == []
        other = s.post_alerts(alert("omen3"))
        assert other.status_code == 202  # a new fingerprint is not affected


# -- 11. exact parameter validation ---------------------------------------------------------------


@pytest.mark.parametrize(("param", "value", "needle"), [
    (Param(type="node"), "omen2\n", "U+000A at position 5"),
    (Param(type="node"), "omen2\r", "U+000D"),
    (Param(type="string"), "plain text\n", "U+000A at position 10"),
    (Param(type="string", pattern=".*"), "\x1b[31mred", "U+001B at position 0"),
    (Param(type="enum", values=["drain", "cordon"]), "drain\n", "U+000A"),
    (Param(type="string"), "tab\tinside", "U+0009"),
])
def test_a_trailing_newline_or_any_control_character_is_refused_with_its_position(
        param: Param, value: str, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        coerce_value("p", param, value)
    assert not is_node_name("omen2\n") and not is_node_name("omen2.\n")  # whole-value match itself


def test_the_cli_path_refuses_a_trailing_newline_with_a_located_error() -> None:
    rb = parse_runbook(b"""apiVersion: runbook/v1
name: params-demo
version: "1"
params:
  node: {type: node, required: true}
  workload: {type: enum, values: [container, vm-passthrough], default: container}
steps:
  - id: wait
    action: {check: {}}
    verify: [{check: {node_ready: true}}]
""", "params-demo.yaml")
    with pytest.raises(UsageError, match=r"param node: 'omen2\\n' contains a control character \(U\+000A"):
        resolve_params(rb, ["node=omen2\n"])
    with pytest.raises(UsageError, match="control character"):
        resolve_params(rb, [], node="omen2\n")
    with pytest.raises(UsageError, match="workload"):
        resolve_params(rb, ["node=omen2", "workload=container\n"])
    assert resolve_params(rb, ["node=omen2"])["node"] == "omen2"


def test_triggers_and_the_server_refuse_a_node_label_with_a_control_character() -> None:
    with served() as s:
        r = s.post_alerts(alert("omen2\r"), alert("omen3\x00"), alert("omen4\n"))
        reasons = [d["reason"] for d in r.json()["decisions"]]
        # (omen4\n matches no trigger: a matcher's "." stops at a newline)
        assert [d["outcome"] for d in r.json()["decisions"]] == ["rejected", "rejected", "ignored"]
        assert "U+000D at position 5" in reasons[0] and "U+0000 at position 5" in reasons[1]
        assert s.starter.requests == []
