"""HTTP behaviour of ``runbook serve``: auth, bad input, resolved alerts, runs, approvals, metrics."""

from __future__ import annotations

import base64
import json
import threading

import httpx
import pytest
from starlette.testclient import TestClient

from engine.serve.app import create_app
from engine.serve.config import load_config
from engine.serve.delivery import RetryPolicy
from engine.serve.notify import Notifier
from tests.fakes import (
    APPROVE,
    AUTH,
    DIGEST,
    READ,
    TOKEN,
    FakeRunStarter,
    StaticClusterView,
    alert,
    make_node,
    served,
    trigger_spec,
    webhook,
)

NODES = [make_node(f"omen{i}") for i in range(1, 9)]


# -- authentication ---------------------------------------------------------------------------


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"bearer {TOKEN}x"},
    {"Authorization": TOKEN},
    {"Authorization": "Basic " + base64.b64encode(b"alertmanager:wrong").decode()},
    {"Authorization": "Basic %%%notbase64"},
    {"Authorization": "Basic " + base64.b64encode(b"\xff\xfe:x").decode()},
])
def test_alertmanager_hook_refuses_missing_or_wrong_credentials(headers: dict[str, str]) -> None:
    with served() as s:
        r = s.post_alerts(alert("omen2"), headers=headers)
        assert r.status_code == 401
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert s.starter.requests == []


@pytest.mark.parametrize("headers", [
    AUTH,
    {"Authorization": f"bearer {TOKEN}"},
    {"Authorization": "Basic " + base64.b64encode(f"alertmanager:{TOKEN}".encode()).decode()},
])
def test_bearer_or_basic_auth_with_the_token_as_password_is_accepted(headers: dict[str, str]) -> None:
    with served() as s:
        r = s.post_alerts(alert("omen2"), headers=headers)
        assert r.status_code == 202, r.text
        assert len(s.starter.requests) == 1


def test_without_a_configured_token_every_state_changing_endpoint_refuses() -> None:
    with served(token=None, env={"RUNBOOK_APPROVER_TOKEN_ALICE": "an-approver-token-long"}) as s:
        assert s.post_alerts(alert("omen2"), headers={}).status_code == 401
        assert s.client.post("/breaker/reset", json={}).status_code == 401
        assert s.client.post("/runs/r-x/approve", json={"plan_digest": DIGEST}).status_code == 401
        assert s.starter.requests == []


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "needle"), [
    (b"", "empty body"),
    (b"{", "not valid JSON"),
    (b"\xc3\x28", "not UTF-8"),
    (b"null", "expected a JSON object"),
    (b"[]", "expected a JSON object"),
    (json.dumps({"version": "4"}).encode(), "status"),
    (json.dumps({**webhook(alert("omen2")), "alerts": {"a": 1}}).encode(), "alerts"),
    (json.dumps(webhook({**alert("omen2"), "labels": ["node", "omen2"]})).encode(), "alerts[0].labels"),
    (json.dumps(webhook({**alert("omen2"), "labels": {"node": None}})).encode(), "alerts[0].labels.node"),
    (json.dumps({**webhook(alert("omen2")), "version": 4}).encode(), "version"),
    pytest.param(b"[" * 50_000, "", id="deeply-nested"),
])
def test_garbage_and_wrong_types_are_a_400_with_a_clear_message(body: bytes, needle: str) -> None:
    with served() as s:
        r = s.client.post("/hooks/alertmanager", content=body, headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]
        assert s.starter.requests == []


def test_bodies_over_the_limit_are_refused_with_413() -> None:
    with served(max_body_bytes=2048) as s:
        big = webhook(alert("omen2", note="x" * 4000))
        r = s.client.post("/hooks/alertmanager", json=big, headers=AUTH)
        assert r.status_code == 413
        # also when the sender does not announce a length (chunked)
        r = s.client.post("/hooks/alertmanager", content=iter([json.dumps(big).encode()]),
                          headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 413
        assert s.starter.requests == []


def test_unknown_fields_are_ignored() -> None:
    with served() as s:
        body = webhook({**alert("omen2"), "futureField": {"x": [1]}})
        body["somethingNew"] = True
        r = s.client.post("/hooks/alertmanager", json=body, headers=AUTH)
        assert r.status_code == 202


def test_resolved_alerts_never_start_runs() -> None:
    with served() as s:
        r = s.post_alerts(alert("omen2", status="resolved"), alert("omen3", status="resolved"))
        assert r.status_code == 200
        assert r.json()["status"] == "ignored"
        decisions = r.json()["decisions"]
        assert [(d["outcome"], d["reason"]) for d in decisions] == [
            ("ignored", "resolved alerts never start runs")] * 2  # one decision per alert, both resolved
        assert [d["alert"].split('node="')[1].split('"')[0] for d in decisions] == ["omen2", "omen3"]
        assert s.starter.requests == []


def test_alerts_without_a_matching_trigger_are_ignored() -> None:
    with served() as s:
        r = s.post_alerts(alert("cpu1"), alert("omen2", alertname="Watchdog"))
        assert (r.status_code, r.json()["status"]) == (200, "ignored")


def test_hostile_label_values_are_refused_by_param_validation() -> None:
    with served() as s:
        r = s.post_alerts(alert("omen{{ 7*7 }}"), alert("omen2; rm -rf /"))
        assert r.status_code == 200
        assert [d["outcome"] for d in r.json()["decisions"]] == ["rejected", "rejected"]
        assert "not a valid node name" in r.json()["decisions"][0]["reason"]
        assert s.starter.requests == []


# -- runs ---------------------------------------------------------------------------------------


def test_an_auto_run_is_accepted_without_waiting_for_it_and_executes_in_the_worker_pool() -> None:
    gate = threading.Event()  # the run cannot finish before the webhook has answered
    starter = FakeRunStarter([trigger_spec(mode="auto")], execute_gate=gate)
    with served(starter=starter) as s:
        r = s.post_alerts(alert("omen2"))
        assert r.status_code == 202
        (run_id,) = r.json()["runs"]
        assert s.client.get(f"/runs/{run_id}").json()["state"] == "pending"
        gate.set()
        s.idle()
        assert s.client.get(f"/runs/{run_id}").json()["state"] == "succeeded"
        assert s.events() == ["started", "finished"]
        assert "omen2" in s.sent[0]["text"]


def test_approve_mode_waits_and_only_the_right_digest_completes_it() -> None:
    with served(mode="approve") as s:
        r = s.post_alerts(alert("omen2"))
        assert r.status_code == 202
        (run_id,) = r.json()["runs"]
        s.idle()
        run = s.client.get(f"/runs/{run_id}").json()
        assert {k: run[k] for k in ("id", "runbook", "params", "state", "plan_digest")} == {
            "id": run_id, "runbook": "gpu-node-recovery", "params": {"node": "omen2"},
            "state": "waiting-approval", "plan_digest": DIGEST}
        waiting = [m for m in s.sent if m["runbook_event"]["event"] == "waiting-approval"]
        assert waiting and DIGEST in waiting[0]["text"]

        url = f"/runs/{run_id}/approve"
        assert s.client.post(url, json={"plan_digest": DIGEST}).status_code == 401
        wrong = s.client.post(url, json={"plan_digest": "b" * 64}, headers=APPROVE)
        assert wrong.status_code == 409 and "plan" in wrong.json()["error"]
        assert s.client.post("/runs/r-nope/approve", json={"plan_digest": DIGEST}, headers=APPROVE).status_code == 404
        assert s.client.post(url, content=b"{", headers={**APPROVE, "Content-Type": "application/json"}
                             ).status_code == 400
        assert s.client.post(url, json={"digest": DIGEST}, headers=APPROVE).status_code == 400
        assert s.client.post(url, json={"plan_digest": DIGEST, "approved_by": "<script>"},
                             headers=APPROVE).status_code == 400
        assert s.client.get(f"/runs/{run_id}").json()["state"] == "waiting-approval"

        ok = s.client.post(url, json={"plan_digest": DIGEST}, headers=APPROVE)
        assert ok.status_code == 202 and ok.json()["queued"] is True
        s.idle()
        run = s.client.get(f"/runs/{run_id}").json()
        assert (run["state"], run["approved_by"]) == ("succeeded", "alice")
        again = s.client.post(url, json={"plan_digest": DIGEST}, headers=APPROVE)
        assert again.status_code == 409 and "not waiting" in again.json()["error"]


def test_approving_a_run_this_server_does_not_own_only_records_it() -> None:
    cli_run = {"id": "r-cli-1", "runbook": "gpu-node-recovery", "params": {"node": "omen5"}, "nodes": ["omen5"],
               "state": "waiting-approval", "source": "cli", "plan_digest": DIGEST, "approval_required": True,
               "approved_by": None, "started": None, "finished": None, "exit_code": None}
    starter = FakeRunStarter([trigger_spec()], preload=[cli_run])
    with served(starter=starter) as s:
        r = s.client.post("/runs/r-cli-1/approve", json={"plan_digest": DIGEST}, headers=APPROVE)
        assert (r.status_code, r.json()["queued"]) == (200, False)
        assert starter.executed == []


def test_runs_listing_and_unknown_run() -> None:
    with served() as s:
        s.post_alerts(alert("omen2"), alert("omen3"))
        s.idle()
        runs = s.client.get("/runs").json()
        assert {r["nodes"][0] for r in runs} == {"omen2", "omen3"}
        assert len(s.client.get("/runs?limit=1").json()) == 1
        for bad in ("0", "x", "5000", "-1"):
            assert s.client.get(f"/runs?limit={bad}").status_code == 400
        nf = s.client.get("/runs/r-does-not-exist")
        assert nf.status_code == 404 and "unknown run" in nf.json()["error"]


def test_healthz_metrics_and_triggers() -> None:
    with served() as s:
        s.post_alerts(alert("omen2"), headers={})
        s.post_alerts(alert("omen2"))
        s.idle()
        health = s.client.get("/healthz").json()
        assert health["status"] == "ok" and health["triggers"] == 1
        text = s.client.get("/metrics").text
        assert 'runbook_serve_webhook_requests_total{endpoint="alertmanager",outcome="unauthorized"} 1.0' in text
        assert 'runbook_serve_webhook_requests_total{endpoint="alertmanager",outcome="started"} 1.0' in text
        assert 'runbook_serve_runs_started_total{mode="auto",runbook="gpu-node-recovery"} 1.0' in text
        assert 'runbook_serve_runs_succeeded_total{runbook="gpu-node-recovery"} 1.0' in text
        assert "runbook_serve_webhook_seconds_bucket" in text
        assert "runbook_serve_signature_verify_seconds" in text
        (t,) = s.client.get("/triggers").json()
        assert t["runbook"] == "gpu-node-recovery" and t["matchers"] == ['node=~"omen.*"']


def test_notification_failures_are_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    def broken(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("receiver down")

    config = load_config(None, env={"RUNBOOK_WEBHOOK_TOKEN": TOKEN},
                         overrides={"auth": {"allowed_hosts": ["testserver"]}})
    starter = FakeRunStarter([trigger_spec(mode="auto")])
    notifier = Notifier("http://127.0.0.1:9/x", transport=httpx.MockTransport(broken),
                        retry=RetryPolicy(attempts=2, backoff=0.01))  # retried once, then given up
    app = create_app(config, starter, cluster=StaticClusterView(NODES), notifier=notifier, sweep_interval=0)
    with TestClient(app) as client:
        r = client.post("/hooks/alertmanager", json=webhook(alert("omen2")), headers=AUTH)
        assert r.status_code == 202
        assert app.state.dispatcher.worker.wait_idle(5)
        assert notifier.flush(5)
    assert notifier.failed >= 2 and notifier.sent == 0
    assert "receiver down" in caplog.text


def test_reads_can_be_protected_by_the_token_too() -> None:
    with served(protect_reads=True) as s:
        for path in ("/runs", "/runs/r-x", "/breaker", "/triggers", "/metrics"):
            assert s.client.get(path).status_code == 401
            assert s.client.get(path, headers=AUTH).status_code == 403  # a sender is no reader
            assert s.client.get(path, headers=READ).status_code in (200, 404)
            assert s.client.get(path, headers=APPROVE).status_code in (200, 404)
        assert s.client.get("/healthz").status_code == 200


class _StoreDown(FakeRunStarter):
    broken = False

    def runs(self, limit: int = 100, *, sources: tuple[str, ...] | None = None) -> list[dict[str, object]]:
        if self.broken:
            raise OSError("the store went away")
        return list(super().runs(limit, sources=sources))


def test_readyz_is_ready_while_the_store_answers_and_503_naming_the_cause_when_it_does_not() -> None:
    starter = _StoreDown([trigger_spec(mode="auto", matchers=('node=~"omen.*"',))])
    with served(starter=starter) as s:
        ok = s.client.get("/readyz", headers={"Host": "10.1.2.3:8080"})  # probes use the pod address
        assert ok.status_code == 200
        assert ok.json() | {"status": "ready", "ready": True, "store": "ok", "role": "single"} == ok.json()
        starter.broken = True
        down = s.client.get("/readyz")
        assert down.status_code == 503
        assert down.json()["status"] == "not-ready" and "the store went away" in down.json()["store"]
        assert s.client.get("/healthz").status_code == 200  # alive all the same: not restarted for it
