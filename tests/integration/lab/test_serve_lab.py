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
from serve_helpers import (
    PD_SECRET,
    Server,
    alertmanager,
    alertmanager_binary,
    descendants,
    fire,
    lab_status,
    node_json,
    ready_status,
    serving,
)

from engine.connectors.kube import KubeConnector
from engine.lab.hoststate import HostState
from engine.locks import DEFAULT_NAMESPACE, acquire_node_lock, holder_for, lease_name
from engine.serve.pagerduty import sign
from engine.serve.testing import alert, webhook

pytestmark = [pytest.mark.integration, pytest.mark.lab, pytest.mark.timeout(300)]

RUNBOOK = "gpu-node-recovery"
WORKLOAD = "nvidia.com/gpu.workload.config"
# The incident has 4 of 8 nodes NotReady: these thresholds let an automatic run through.
PERMISSIVE = {"max_unhealthy_nodes": 8, "max_unhealthy_gpus": 100}
AUTO = {"mode_overrides": {RUNBOOK: "auto"}}
PLAN_TIMEOUT = 90  # an approve-mode plan previews the playbooks in check mode over SSH
RUN_TIMEOUT = 240  # relabel, swap off, kubelet back, GPU advertised


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


# -- the incident stays as it is ---------------------------------------------------------------------------


def test_the_real_server_refuses_alerts_without_the_token(lab: Any, tmp_path: Path) -> None:
    with serving(lab.env(), tmp_path) as server:
        assert server.alert(omen2_alert(), headers={}).status_code == 401
        assert server.alert(omen2_alert(), headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert server.runs() == []
        assert metric(server, "runbook_serve_webhook_requests_total", endpoint="alertmanager",
                      outcome="unauthorized") == 2


def test_forged_and_unsigned_pagerduty_webhooks_start_nothing(unchanged_lab: Any, sh: Any, tmp_path: Path) -> None:
    config = {"pagerduty": {"mappings": [{
        "service": "PF9KMXH", "title_pattern": r"Node (?P<node>[a-z0-9.-]+) is NotReady", "runbook": RUNBOOK}]}}
    body = json.dumps({"event": {
        "id": "01DFA8ZJ3AZQ9TAQ9BJ7DR6ZS2", "event_type": "incident.triggered", "resource_type": "incident",
        "occurred_at": "2026-12-02T03:04:05.123Z", "agent": None, "client": None,
        "data": {"id": "Q2XAMPLE1", "type": "incident", "number": 42, "status": "triggered", "urgency": "high",
                 "title": "Node omen2 is NotReady",
                 "service": {"id": "PF9KMXH", "summary": "GPU nodes", "type": "service_reference"}}}}).encode()
    headers = {"Content-Type": "application/json", "X-Webhook-Id": "wh-forged-1"}
    with serving(unchanged_lab.env(), tmp_path, config, pd_secret=PD_SECRET) as server:
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
        assert metric(server, "runbook_serve_webhook_requests_total", endpoint="pagerduty", outcome="forbidden") == 2
        assert metric(server, "runbook_serve_webhook_requests_total", endpoint="pagerduty", outcome="bad-request") == 2
        # control: the same delivery, properly signed, does start the run (so the refusals were the signature's)
        signed = {**headers, "X-Webhook-Id": "wh-signed-1",
                  "X-PagerDuty-Signature": f"v1={'0' * 64}, {sign(body, PD_SECRET)}"}
        run_id = started(server.post("/hooks/pagerduty", content=body, headers=signed))["run_id"]
        replay = server.post("/hooks/pagerduty", content=body, headers=signed)
        assert (replay.status_code, replay.json()["status"]) == (200, "duplicate"), replay.text
        run = server.wait_state(run_id, ("waiting-approval",), PLAN_TIMEOUT)
        assert (run["source"], run["params"]["node"], len(server.runs())) == ("pagerduty", "omen2", 1)
    omen2_untouched(unchanged_lab, sh)


def test_twenty_concurrent_identical_alerts_start_exactly_one_run(unchanged_lab: Any, sh: Any,
                                                                   tmp_path: Path) -> None:
    with serving(unchanged_lab.env(), tmp_path, {"workers": 4}) as server:
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
        runs = server.runs()
        assert len(runs) == 1 and runs[0]["nodes"] == ["omen2"], runs
        server.wait_state(runs[0]["id"], ("waiting-approval",), PLAN_TIMEOUT)
        assert len(server.runs()) == 1
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
        assert metric(server, "runbook_serve_runs_blocked_total", reason="breaker", runbook="gpu-node-recovery") == 1
        assert metric(server, "runbook_serve_breaker_open", key="unhealthy", kind="cluster") == 1
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
            assert metric(server, "runbook_serve_runs_blocked_total", reason="run-blocked", runbook="gpu-node-recovery") == 1
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
        r = server.alert(omen2_alert())
        assert time.monotonic() - t0 < 2.0  # answered at once; the run executes in a worker
        decision = started(r)
        assert decision["mode"] == "auto" and not decision.get("warnings")
        run = server.wait_state(decision["run_id"], ("succeeded",), RUN_TIMEOUT)
        assert (run["source"], run["approval_required"], run["exit_code"]) == ("alertmanager", False, 0)
        kinds = [e["kind"] for e in run["events"]]
        assert kinds.index("lock.acquired") < kinds.index("step.start") and "lock.released" in kinds
        assert metric(server, "runbook_serve_runs_succeeded_total", runbook="gpu-node-recovery") == 1
    omen2_recovered(fresh_lab, sh)
    assert kube.read_lease(DEFAULT_NAMESPACE, lease_name("omen2")) is None  # released at the end


def test_approve_mode_waits_refuses_a_wrong_digest_and_completes_with_the_right_one(
        fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    with serving(fresh_lab.env(), tmp_path) as server:  # the runbook's own mode: approve
        decision = started(server.alert(omen2_alert()))
        assert decision["mode"] == "approve"
        run_id = decision["run_id"]
        run = server.wait_state(run_id, ("waiting-approval",), PLAN_TIMEOUT)
        digest = run["plan_digest"]
        assert run["approval_required"] is True and len(digest) == 64
        assert [s["id"] for s in run["plan"]["steps"]] == ["relabel-container", "swap-off", "restart-kubelet"]

        wrong = server.approve(run_id, "0" * 64)
        assert wrong.status_code == 409 and digest in wrong.text, wrong.text
        no_token = server.post(f"/runs/{run_id}/approve", json={"plan_digest": digest})
        assert no_token.status_code == 401
        time.sleep(1.0)  # nothing may run after a refused approval
        run = server.run(run_id)
        assert (run["state"], run["approved_by"]) == ("waiting-approval", None)
        omen2_untouched(fresh_lab, sh)

        right = server.approve(run_id, digest)
        assert right.status_code == 202 and right.json()["queued"] is True, right.text
        run = server.wait_state(run_id, ("succeeded",), RUN_TIMEOUT)
        assert run["approved_by"] == "alice" and run["plan_digest"] == digest
    omen2_recovered(fresh_lab, sh)


def test_a_run_waiting_for_approval_survives_a_server_restart(fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    journal = tmp_path / "journal.sqlite"
    with serving(fresh_lab.env(), tmp_path, journal=journal, name="first") as first:
        run_id = started(first.alert(omen2_alert()))["run_id"]
        digest = first.wait_state(run_id, ("waiting-approval",), PLAN_TIMEOUT)["plan_digest"]
        first.stop()
        assert first.proc.returncode == 0, first.log_tail()
        assert descendants(first.proc.pid) == []
    with serving(fresh_lab.env(), tmp_path, journal=journal, name="second") as second:
        run = second.run(run_id)
        assert (run["state"], run["plan_digest"]) == ("waiting-approval", digest)
        assert run_id in second.get("/healthz").json()["breaker"]["waiting_approval"]
        # the re-sent page is still a duplicate: the new server knows the run from the journal
        again = second.alert(omen2_alert())
        assert again.json()["decisions"][0]["outcome"] == "duplicate", again.text
        assert len(second.runs()) == 1
        approved = second.approve(run_id, digest, by="bob")
        assert approved.status_code == 202 and approved.json()["queued"] is True, approved.text
        run = second.wait_state(run_id, ("succeeded",), RUN_TIMEOUT)
        assert run["approved_by"] == "bob"
    omen2_recovered(fresh_lab, sh)


def test_a_real_alertmanager_pages_the_server_and_the_approved_run_recovers_omen2(
        fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    alertmanager_binary()  # skip (outside CI) before anything starts
    with serving(fresh_lab.env(), tmp_path) as server, alertmanager(tmp_path / "am", server.url) as am:
        fire(am, "omen2")
        runs = server.wait_runs(lambda rs: any(r["state"] == "waiting-approval" for r in rs),
                                PLAN_TIMEOUT, "the paged run to wait for approval")
        (run,) = runs
        assert (run["runbook"], run["nodes"], run["source"], run["approval_required"]) == (
            RUNBOOK, ["omen2"], "alertmanager", True)
        assert run["plan_digest"]
        detail = server.run(run["id"])
        assert "fingerprint" in detail["reason"] and "KubeNodeNotReady" in detail["reason"]
        assert metric(server, "runbook_serve_webhook_requests_total", endpoint="alertmanager", outcome="started") == 1
        assert metric(server, "runbook_serve_webhook_requests_total", endpoint="alertmanager", outcome="unauthorized") is None
        assert server.approve(run["id"], run["plan_digest"]).status_code == 202
        server.wait_state(run["id"], ("succeeded",), RUN_TIMEOUT)
    omen2_recovered(fresh_lab, sh)
