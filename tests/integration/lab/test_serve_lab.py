"""``runbook serve`` end to end on the lab: a page for omen2 -> guards -> a real run -> omen2 recovered.

Every test starts ``runbook serve`` as a real subprocess (lab environment, its own journal and
configuration in ``tmp_path``, a token, 127.0.0.1 only) and always stops it (SIGTERM, then SIGKILL,
and whatever it started). Tests that leave omen2 as the incident left it run first on one shared
state (``unchanged_lab``: it checks afterwards that omen2 was not touched, and marks the lab for a
reset if it was); tests that recover omen2 take ``fresh_lab`` (reset before the test).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.connectors.kube import KubeConnector
from engine.lab.hoststate import HostState
from engine.locks import DEFAULT_NAMESPACE, acquire_node_lock, holder_for, lease_name
from engine.serve.pagerduty import sign
from tests.fakes import alert, webhook
from tests.integration.lab.serve_helpers import (
    PD_SECRET,
    Server,
    alertmanager,
    alertmanager_binary,
    fire,
    lab_status,
    lab_status_all,
    node_json,
    ready_status,
    serving,
)

pytestmark = [pytest.mark.integration, pytest.mark.lab, pytest.mark.timeout(900)]

RUNBOOK = "gpu-node-recovery"
WORKLOAD = "nvidia.com/gpu.workload.config"
# The incident has 4 of 8 nodes NotReady: these thresholds let an automatic run through.
PERMISSIVE = {"max_unhealthy_nodes": 8, "max_unhealthy_gpus": 100}
AUTO = {"mode_overrides": {RUNBOOK: "auto"}}
# Deadlines, not expectations: on an idle machine a preview plan takes ~5-10 s and a recovery ~15 s,
# but a shared 2-core CI machine under load has taken 10 times that.
PLAN_TIMEOUT = 240  # an approve-mode plan previews the playbooks in check mode over SSH
RUN_TIMEOUT = 360  # relabel, swap off, kubelet back, GPU advertised
# Tests that stop the server while a plan is being made (check mode only) do not wait for it.
QUICK_STOP = {"shutdown_grace": "1s"}


# -- fixtures and probes ------------------------------------------------------------------------------


def omen2_calls(lab: Any) -> list[dict[str, Any]]:
    """Every mutating shim call on omen2's host since the last reset (swapoff, systemctl restart...)."""
    return HostState(lab.lab.record()["nodes"]["omen2"]["state_dir"]).calls()


def omen2_untouched(lab: Any, sh: Callable[..., Any]) -> None:
    """omen2 is as the incident left it: no host command ran, label, swap and readiness unchanged."""
    assert omen2_calls(lab) == []
    status = lab_status(sh)
    assert (status["ready"], status["workload"], status["swap_active"], status["gpu_driver"],
            status["cuda_jobs_running"], status["cuda_jobs_killed"]) == (
        False, "vm-passthrough", True, "nvidia", 1, 0), status


def omen2_recovered(lab: Any, sh: Callable[..., Any]) -> None:
    """Through the real API: Ready, workload label container, nvidia.com/gpu 1; the CUDA job lives."""
    node = node_json(sh)
    assert ready_status(node) == "True"
    assert node["metadata"]["labels"][WORKLOAD] == "container"
    assert node["status"]["allocatable"].get("nvidia.com/gpu") == "1"
    status = lab_status(sh)
    assert (status["ready"], status["gpu_driver"], status["swap_active"], status["cuda_jobs_running"],
            status["cuda_jobs_killed"]) == (True, "nvidia", False, 1, 0), status


@pytest.fixture
def unchanged_lab(lab: Any) -> Iterator[Any]:
    """The incident, shared between tests that must not change omen2 (reset only if a test did)."""
    if lab.dirty:
        lab.reset()
    yield lab
    try:
        touched = bool(omen2_calls(lab)) or any(
            n["name"] == "omen2" and n["workload"] != "vm-passthrough" for n in lab.lab.status()["nodes"])
    except Exception:
        touched = True
    if touched:
        lab.dirty = True


@pytest.fixture
def kube(lab: Any) -> Iterator[KubeConnector]:
    connector = KubeConnector(kubeconfig=lab.lab.env()["KUBECONFIG"])
    try:
        yield connector
    finally:
        connector.close()


def omen2_alert(fingerprint: str = "fp-omen2-notready") -> dict[str, Any]:
    return webhook(alert("omen2", fingerprint=fingerprint))


def started(r: httpx.Response) -> dict[str, Any]:
    """The single decision of a webhook answer that started a run."""
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["status"] == "started" and len(body["runs"]) == 1, body
    decision: dict[str, Any] = body["decisions"][0]
    assert (decision["outcome"], decision["runbook"], decision["node"]) == ("started", RUNBOOK, "omen2"), decision
    return decision


def metric(server: Server, name: str, **labels: str) -> float | None:
    """The value of the /metrics sample ``name`` whose labels include ``labels`` (any order)."""
    for line in server.get("/metrics").text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        if m is None or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None


def webhooks(server: Server, endpoint: str, outcome: str) -> float | None:
    return metric(server, "runbook_serve_webhook_requests_total", endpoint=endpoint, outcome=outcome)


def blocked(server: Server, reason: str) -> float | None:
    return metric(server, "runbook_serve_runs_blocked_total", runbook=RUNBOOK, reason=reason)


# -- the incident stays as it is ---------------------------------------------------------------------------


def test_the_real_server_refuses_alerts_without_the_token(lab: Any, tmp_path: Path) -> None:
    with serving(lab.env(), tmp_path) as server:
        assert server.alert(omen2_alert(), headers={}).status_code == 401
        assert server.alert(omen2_alert(), headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert server.runs() == []
        assert webhooks(server, "alertmanager", "unauthorized") == 2


def test_forged_and_unsigned_pagerduty_webhooks_start_nothing(unchanged_lab: Any, sh: Any, tmp_path: Path) -> None:
    config = {"pagerduty": {"mappings": [{
        "service": "PF9KMXH", "title_pattern": r"Node (?P<node>[a-z0-9.-]+) is NotReady", "runbook": RUNBOOK}]}}
    body = json.dumps({"event": {
        "id": "01DFA8ZJ3AZQ9TAQ9BJ7DR6ZS2", "event_type": "incident.triggered", "resource_type": "incident",
        "occurred_at": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()),  # older ones are refused
        "agent": None, "client": None,
        "data": {"id": "Q2XAMPLE1", "type": "incident", "number": 42, "status": "triggered", "urgency": "high",
                 "title": "Node omen2 is NotReady",
                 "service": {"id": "PF9KMXH", "summary": "GPU nodes", "type": "service_reference"}}}}).encode()
    headers = {"Content-Type": "application/json", "X-Webhook-Id": "wh-forged-1"}
    with serving(unchanged_lab.env(), tmp_path, {**config, **QUICK_STOP}, pd_secret=PD_SECRET) as server:
        forged = server.post("/hooks/pagerduty", content=body,
                             headers={**headers, "X-PagerDuty-Signature": sign(body, "not-the-secret")})
        assert forged.status_code == 403, forged.text
        unsigned = server.post("/hooks/pagerduty", content=body, headers=headers)
        assert unsigned.status_code == 400, unsigned.text
        malformed = server.post("/hooks/pagerduty", content=body,
                                headers={**headers, "X-PagerDuty-Signature": "v1=not-hex"})
        assert malformed.status_code == 400, malformed.text
        # a signature over other bytes does not vouch for these bytes
        tampered = server.post("/hooks/pagerduty", content=body.replace(b"omen2", b"omen3"),
                               headers={**headers, "X-PagerDuty-Signature": sign(body, PD_SECRET)})
        assert tampered.status_code == 403, tampered.text
        assert server.runs() == []
        assert webhooks(server, "pagerduty", "forbidden") == 2
        assert webhooks(server, "pagerduty", "bad-request") == 2
        # control: the same delivery, properly signed, does start the run (so the refusals were the signature's)
        signed = {**headers, "X-Webhook-Id": "wh-signed-1",
                  "X-PagerDuty-Signature": f"v1={'0' * 64}, {sign(body, PD_SECRET)}"}
        run_id = started(server.post("/hooks/pagerduty", content=body, headers=signed))["run_id"]
        replay = server.post("/hooks/pagerduty", content=body, headers=signed)
        assert (replay.status_code, replay.json()["status"]) == (200, "duplicate"), replay.text
        run = server.run(run_id)
        assert (run["source"], run["params"]["node"], run["approval_required"]) == ("pagerduty", "omen2", True)
        assert len(server.runs()) == 1
        # stopped while it plans (check mode only): SIGTERM ends it after shutdown_grace
    omen2_untouched(unchanged_lab, sh)


def test_twenty_concurrent_identical_alerts_start_exactly_one_run(unchanged_lab: Any, sh: Any,
                                                                   tmp_path: Path) -> None:
    with serving(unchanged_lab.env(), tmp_path, QUICK_STOP) as server:
        payload = omen2_alert()
        gate = threading.Barrier(20)

        def send(_: int) -> httpx.Response:
            gate.wait(10)
            return server.alert(payload)

        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(send, range(20)))
        outcomes = sorted(a.json()["decisions"][0]["outcome"] for a in answers)
        assert outcomes == ["duplicate"] * 19 + ["started"], [a.text for a in answers]
        assert sorted(a.status_code for a in answers) == [200] * 19 + [202]
        # runs are created on the request path: once every answer is in, the count is final
        runs = server.runs()
        assert len(runs) == 1 and runs[0]["nodes"] == ["omen2"], runs
        assert runs[0]["id"] == next(a.json()["runs"][0] for a in answers if a.status_code == 202)
        assert server.get("/breaker").json()["active_nodes"] == {"omen2": runs[0]["id"]}
    omen2_untouched(unchanged_lab, sh)


def test_default_breaker_turns_an_auto_trigger_into_a_plan_for_a_person(unchanged_lab: Any, sh: Any,
                                                                         tmp_path: Path) -> None:
    # auto requested, default thresholds: the incident's 4-of-8 NotReady is a bigger outage
    with serving(unchanged_lab.env(), tmp_path, AUTO) as server:
        decision = started(server.alert(omen2_alert()))
        assert decision["mode"] == "approve"
        assert any("4 of 8 nodes are unhealthy" in w for w in decision["warnings"]), decision
        run = server.wait_state(decision["run_id"], ("waiting-approval",), PLAN_TIMEOUT)
        assert run["approval_required"] is True and run["plan_digest"]
        assert any(w.startswith("breaker: 4 of 8 nodes are unhealthy") and "above 2" in w
                   for w in run["warnings"]), run["warnings"]
        assert not any(e["kind"] in ("step.start", "action.intent", "lock.acquired") for e in run["events"])
        assert blocked(server, "breaker") == 1
        assert metric(server, "runbook_serve_breaker_open", key="unhealthy", kind="cluster") == 1
    omen2_untouched(unchanged_lab, sh)


def test_an_alert_storm_over_every_node_starts_no_automatic_run_and_no_more_than_the_approval_budget(
        unchanged_lab: Any, sh: Any, tmp_path: Path) -> None:
    nodes = [n["name"] for n in lab_status_all(sh)]
    assert len(nodes) == 8
    config = {**AUTO, **QUICK_STOP, "breaker": {"max_pending_approvals": 3}}
    with serving(unchanged_lab.env(), tmp_path, config) as server:
        r = server.alert(webhook(*(alert(n) for n in nodes)))
        assert r.status_code == 202, r.text
        decisions = r.json()["decisions"]
        outcomes = sorted(d["outcome"] for d in decisions)
        assert outcomes == ["blocked"] * 5 + ["started"] * 3, decisions
        assert all(d["mode"] == "approve" for d in decisions)  # the breaker turned every auto run down
        assert all(any("4 of 8 nodes are unhealthy" in w for w in d["warnings"])
                   for d in decisions if d["outcome"] == "started")
        assert all("not paging for approval" in d["reason"] for d in decisions if d["outcome"] == "blocked")
        assert len(server.runs()) == 3
        assert metric(server, "runbook_serve_runs_started_total", runbook=RUNBOOK, mode="auto") is None
        assert metric(server, "runbook_serve_runs_started_total", runbook=RUNBOOK, mode="approve") == 3
        assert blocked(server, "approvals-limit") == 5
        # the storm goes on: a re-sent page may take the slot of a run that ended meanwhile (a plan
        # blocked by a precondition), never more: at most 3 wait at once, none is automatic
        again = server.alert(webhook(*(alert(n) for n in nodes)))
        assert again.status_code in (200, 202), again.text
        assert [d["outcome"] for d in again.json()["decisions"][:3]] == ["duplicate"] * 3
        runs = server.runs()
        assert all(r["approval_required"] for r in runs)
        assert sum(r["state"] in ("pending", "waiting-approval", "running") for r in runs) <= 3, runs
    omen2_untouched(unchanged_lab, sh)


def test_a_node_lease_held_by_a_cli_run_blocks_the_servers_run(unchanged_lab: Any, sh: Any, kube: KubeConnector,
                                                               tmp_path: Path) -> None:
    cli_run = "r-20261202030000-c11c11"  # a person's `runbook run gpu-node-recovery --node omen2`
    lock = acquire_node_lock(kube, "omen2", cli_run, ttl=600)
    try:
        with serving(unchanged_lab.env(), tmp_path, {**AUTO, "breaker": PERMISSIVE}) as server:
            decision = started(server.alert(omen2_alert()))
            assert decision["mode"] == "auto"
            run = server.wait_state(decision["run_id"], ("blocked",), PLAN_TIMEOUT)
            reason = run["outcome_reason"]
            assert holder_for(cli_run) in reason and f"{DEFAULT_NAMESPACE}/{lease_name('omen2')}" in reason, run
            assert run["exit_code"] == 3
            assert not any(e["kind"] in ("step.start", "action.intent", "lock.acquired") for e in run["events"])
            assert blocked(server, "run-blocked") == 1
            # nothing new starts on omen2 while the page is re-sent (node cooldown after the blocked run)
            again = server.alert(omen2_alert("fp-omen2-resent"))
            assert again.json()["decisions"][0]["outcome"] == "duplicate", again.text
        lease = kube.read_lease(DEFAULT_NAMESPACE, lease_name("omen2"))
        assert lease is not None and lease.holder == holder_for(cli_run)  # not taken over
    finally:
        lock.release()
    assert kube.read_lease(DEFAULT_NAMESPACE, lease_name("omen2")) is None
    omen2_untouched(unchanged_lab, sh)


# -- omen2 is recovered (the lab is reset before each) ----------------------------------------------------------


def test_auto_mode_with_permissive_breaker_recovers_omen2_end_to_end(fresh_lab: Any, sh: Any, kube: KubeConnector,
                                                                     tmp_path: Path) -> None:
    with serving(fresh_lab.env(), tmp_path, {**AUTO, "breaker": PERMISSIVE}) as server:
        t0 = time.monotonic()
        decision = started(server.alert(omen2_alert()))
        # answered before the run ends: it executes in a worker (unit tests measure the latency)
        assert time.monotonic() - t0 < 10.0
        assert server.run(decision["run_id"])["state"] in ("pending", "running")
        assert decision["mode"] == "auto" and not decision.get("warnings")
        run = server.wait_state(decision["run_id"], ("succeeded",), RUN_TIMEOUT)
        assert (run["source"], run["approval_required"], run["exit_code"]) == ("alertmanager", False, 0)
        kinds = [e["kind"] for e in run["events"]]
        assert kinds.index("lock.acquired") < kinds.index("step.start") and "lock.released" in kinds
        assert metric(server, "runbook_serve_runs_succeeded_total", runbook="gpu-node-recovery") == 1
    omen2_recovered(fresh_lab, sh)
    assert kube.read_lease(DEFAULT_NAMESPACE, lease_name("omen2")) is None  # released at the end


def test_approve_mode_waits_refuses_a_wrong_digest_survives_a_restart_and_completes_with_the_right_one(
        fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    """Approve mode (the runbook's own), and restart survival, in one recovery of omen2."""
    journal = tmp_path / "journal.sqlite"
    with serving(fresh_lab.env(), tmp_path, journal=journal, name="first") as first:
        decision = started(first.alert(omen2_alert()))
        assert decision["mode"] == "approve"
        run_id = decision["run_id"]
        run = first.wait_state(run_id, ("waiting-approval",), PLAN_TIMEOUT)
        digest = run["plan_digest"]
        assert run["approval_required"] is True and len(digest) == 64
        assert [s["id"] for s in run["plan"]["steps"]] == ["relabel-container", "swap-off", "bind-gpus",
                                                           "restart-kubelet"]

        wrong = first.approve(run_id, "0" * 64)
        assert wrong.status_code == 409 and digest in wrong.text, wrong.text
        no_token = first.post(f"/runs/{run_id}/approve", json={"plan_digest": digest})
        assert no_token.status_code == 401
        time.sleep(1.0)  # nothing may run after a refused approval
        run = first.run(run_id)
        assert (run["state"], run["approved_by"]) == ("waiting-approval", None)
        kinds = [e["kind"] for e in run["events"]]
        assert "plan" in kinds and "approval.waiting" in kinds, kinds  # the run's events, read
        assert "lock.acquired" not in kinds and "action.intent" not in kinds, kinds  # nothing started to act
        assert first.get("/healthz").json()["workers"]["running"] == 0
        omen2_untouched(fresh_lab, sh)

        assert first.stop() == []  # nothing was running: nothing to clean up after it
        assert first.stopped_cleanly(), first.log_tail()

    with serving(fresh_lab.env(), tmp_path, journal=journal, name="second") as second:
        run = second.run(run_id)
        assert (run["state"], run["plan_digest"], run["approved_by"]) == ("waiting-approval", digest, None)
        assert run_id in second.get("/breaker").json()["waiting_approval"]
        # the re-sent page is still a duplicate: the new server knows the run from the journal
        again = second.alert(omen2_alert())
        assert again.json()["decisions"][0]["outcome"] == "duplicate", again.text
        assert len(second.runs()) == 1
        assert second.approve(run_id, "f" * 64).status_code == 409

        right = second.approve(run_id, digest, by="bob")
        assert right.status_code == 202 and right.json()["queued"] is True, right.text
        run = second.wait_state(run_id, ("succeeded",), RUN_TIMEOUT)
        assert (run["approved_by"], run["plan_digest"], run["exit_code"]) == ("bob", digest, 0)
        kinds = [e["kind"] for e in run["events"]]
        assert kinds.index("approval.granted") < kinds.index("lock.acquired") < kinds.index("step.start")
        # the restart neither re-planned nor announced the waiting run again
        assert (kinds.count("plan"), kinds.count("approval.waiting")) == (1, 1), kinds
    omen2_recovered(fresh_lab, sh)


def test_a_real_alertmanager_pages_the_server_and_the_run_recovers_omen2(
        fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    alertmanager_binary()  # skip (outside CI) before anything starts
    with serving(fresh_lab.env(), tmp_path, {**AUTO, "breaker": PERMISSIVE}) as server, \
            alertmanager(tmp_path / "am", server.url) as am:
        fire(am, "omen2")
        runs = server.wait_runs(bool, 90, "Alertmanager's webhook to start a run")
        (run,) = runs
        assert (run["runbook"], run["nodes"], run["source"], run["approval_required"]) == (
            RUNBOOK, ["omen2"], "alertmanager", False)
        detail = server.run(run["id"])
        assert "KubeNodeNotReady" in detail["reason"] and "fingerprint" in detail["reason"]
        assert webhooks(server, "alertmanager", "started") == 1  # bearer credentials accepted
        assert webhooks(server, "alertmanager", "unauthorized") is None
        run = server.wait_state(run["id"], ("succeeded",), RUN_TIMEOUT)
        assert run["plan_digest"] and run["exit_code"] == 0
    omen2_recovered(fresh_lab, sh)
