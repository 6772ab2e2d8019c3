"""The web console's server side (engine.serve.console) through the Starlette TestClient over the fake
run starter: sessions, CSRF, roles, escaping, the live stream, and notification links. The browser
itself is driven in tests/integration/test_console_browser.py."""

from __future__ import annotations

import re
from typing import Any

import httpx

from engine.serve.notify import Notification, Notifier
from tests.fakes import APPROVER_TOKEN, READER_TOKEN, TOKEN, FakeRunStarter, alert, served, trigger_spec


def _login(client: Any, credential: str) -> httpx.Response:
    client.cookies.clear()  # a fresh visitor (httpx's jar keeps an expired cookie beside the new one)
    page = client.get("/ui/login")
    token = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert token is not None
    return client.post("/ui/login", data={"csrf": token.group(1), "credential": credential, "next": "/ui/"},
                       follow_redirects=False)


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found is not None
    return found.group(1)


def _waiting(s: Any) -> str:
    assert s.post_alerts(alert("omen2")).status_code == 202
    s.idle()
    run_id: str = s.starter.runs()[0]["id"]
    assert s.starter.run(run_id)["state"] == "waiting-approval"
    return run_id


def test_the_session_cookie_is_httponly_samesite_strict_and_secure_when_the_public_url_is_https() -> None:
    with served("approve", public_url="https://runbook.example.org") as s:
        s.client.base_url = httpx.URL("https://testserver")  # behind a TLS proxy: Secure cookies come back
        response = _login(s.client, APPROVER_TOKEN)
        assert response.status_code == 303
        cookie = response.headers["set-cookie"].lower()
        assert "runbook_session=" in cookie and "httponly" in cookie and "samesite=strict" in cookie
        assert "secure" in cookie
    with served("approve") as s:
        cookie = _login(s.client, APPROVER_TOKEN).headers["set-cookie"].lower()
        assert "secure" not in cookie.split("runbook_session=")[1].split(",")[0]


def test_a_login_with_a_wrong_credential_a_sender_credential_or_no_form_token_gets_no_session() -> None:
    with served("approve") as s:
        assert _login(s.client, "wrong").status_code == 401
        assert _login(s.client, TOKEN).status_code == 403  # a sender may not read runs
        s.client.cookies.clear()
        bare = s.client.post("/ui/login", data={"csrf": "x", "credential": APPROVER_TOKEN}, follow_redirects=False)
        assert bare.status_code == 403
        assert "runbook_session" not in s.client.cookies


def test_pages_redirect_to_the_login_form_when_reads_need_a_credential() -> None:
    with served("approve", auth={"reads": "token"}) as s:
        run_id = _waiting(s)
        for path in ("/ui/", f"/ui/runs/{run_id}"):
            response = s.client.get(path, follow_redirects=False)
            assert response.status_code == 303 and response.headers["location"].startswith("/ui/login?next=")
        assert s.client.get(f"/ui/runs/{run_id}/live").status_code == 401
        _login(s.client, READER_TOKEN)
        assert s.client.get("/ui/").status_code == 200


def test_an_approval_form_without_the_sessions_csrf_token_approves_nothing() -> None:
    with served("approve") as s:
        run_id = _waiting(s)
        _login(s.client, APPROVER_TOKEN)
        digest = s.starter.run(run_id)["plan_digest"]
        for csrf in ("", "forged"):
            response = s.client.post(f"/ui/runs/{run_id}/decision",
                                     data={"csrf": csrf, "action": "approve", "plan_digest": digest})
            assert response.status_code == 403 and "CSRF" in response.text
        assert s.starter.run(run_id)["approved_by"] is None
        page = s.client.get(f"/ui/runs/{run_id}")
        ok = s.client.post(f"/ui/runs/{run_id}/decision", follow_redirects=False,
                           data={"csrf": _csrf(page.text), "action": "approve", "plan_digest": digest})
        assert ok.status_code == 303
        assert s.starter.run(run_id)["approved_by"] == "alice"


def test_a_reader_session_gets_no_approve_button_and_its_approval_post_is_refused() -> None:
    with served("approve") as s:
        run_id = _waiting(s)
        _login(s.client, READER_TOKEN)
        page = s.client.get(f"/ui/runs/{run_id}")
        assert 'id="approve"' not in page.text and "may only read" in page.text
        response = s.client.post(f"/ui/runs/{run_id}/decision", data={
            "csrf": _csrf(page.text), "action": "approve", "plan_digest": s.starter.run(run_id)["plan_digest"]})
        assert response.status_code == 403 and "grafana (reader) may not approve" in response.text
        assert s.starter.run(run_id)["approved_by"] is None


def test_a_stale_digest_is_refused_with_the_reason_on_the_page() -> None:
    with served("approve") as s:
        run_id = _waiting(s)
        _login(s.client, APPROVER_TOKEN)
        page = s.client.get(f"/ui/runs/{run_id}")
        response = s.client.post(f"/ui/runs/{run_id}/decision",
                                 data={"csrf": _csrf(page.text), "action": "approve", "plan_digest": "b" * 64})
        assert response.status_code == 409 and 'id="error"' in response.text and "approval refused" in response.text
        assert s.starter.run(run_id)["approved_by"] is None


def test_label_and_param_values_are_escaped_as_text() -> None:
    starter = FakeRunStarter([trigger_spec(mode="approve", params={"node": "{{ labels.node }}",
                                                                   "team": "{{ labels.team }}"})])
    with served("approve", starter=starter) as s:
        assert s.post_alerts(alert("omen2", team='<script>alert("x")</script>')).status_code == 202
        s.idle()
        run_id = s.starter.runs()[0]["id"]
        page = s.client.get(f"/ui/runs/{run_id}").text
        assert "<script>alert" not in page and "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in page


def test_the_live_stream_sends_the_rendered_run_then_ends_once_the_run_is_final() -> None:
    with served("auto") as s:
        assert s.post_alerts(alert("omen2")).status_code == 202
        s.idle()
        run_id = s.starter.runs()[0]["id"]
        assert s.starter.run(run_id)["state"] == "succeeded"
        body = s.client.get(f"/ui/runs/{run_id}/live").text
        assert body.startswith("event: update\n") and 'data: <section class="card summary"' in body
        assert "succeeded" in body and body.rstrip().endswith("event: end\ndata:")


def test_a_notification_links_to_the_runs_console_page_when_a_public_url_is_set() -> None:
    sent: list[httpx.Request] = []
    notifier = Notifier("http://127.0.0.1:9/hook", public_url="https://runbook.example.org",
                        transport=httpx.MockTransport(lambda r: sent.append(r) or httpx.Response(200)))
    notifier.notify(Notification("waiting-approval", "gpu-node-recovery", node="omen2", run_id="r-1 2",
                                 extra={"plan_digest": "a" * 64}))
    assert notifier.flush(5)
    body = httpx.Response(200, content=sent[0].content).json()
    assert body["runbook_event"]["link"] == "https://runbook.example.org/ui/runs/r-1%202"
    assert "open: https://runbook.example.org/ui/runs/r-1%202" in body["text"]


def _engine_plan(run: Any) -> dict[str, Any]:
    """A plan built from the engine's own model (``engine.model.Plan``), as the journal stores it."""
    from engine.model import (
        Change,
        CheckEvaluation,
        Plan,
        PlannedStep,
        PlannedVerify,
        PlanState,
        PreconditionResult,
    )

    node = run["params"]["node"]
    plan = Plan(runbook=run["runbook"], version="1", runbook_digest="d" * 64, params=dict(run["params"]), node=node,
                created_at="2026-12-03T08:00:00Z", expires_at="2026-12-03T08:15:00Z", state=PlanState.READY,
                preconditions=(PreconditionResult(id="gpu-present", applies=True, holds=True,
                                                  observed="1 GPU", evidence={"gpus": 1}),),
                steps=(PlannedStep(id="relabel", why="keep the GPU on the container driver", kind="change",
                                   action="kube", summary="label workload -> container",
                                   command=f"kubectl label node {node} nvidia.com/gpu.workload.config=container",
                                   changes=(Change(path="node.labels[nvidia.com/gpu.workload.config]",
                                                   before="vm-passthrough", after="container"),),
                                   guards=(CheckEvaluation(check="node.gpus >= 1", holds=True, observed="1"),),
                                   verify=(PlannedVerify(check="node.labels.workload == 'container'",
                                                         timeout_seconds=30),),
                                   preview="--- a\n+++ b\n-swap\n+#swap"),))
    return plan.sealed().model_dump(mode="json")


def test_the_run_page_shows_a_plan_of_the_engines_own_shape_with_its_command_changes_guards_and_diff() -> None:
    starter = FakeRunStarter([trigger_spec(mode="approve")], plan=_engine_plan)
    with served("approve", starter=starter) as s:
        run_id = _waiting(s)
        page = s.client.get(f"/ui/runs/{run_id}").text
        assert s.starter.run(run_id)["plan_digest"] in page
        assert "kubectl label node omen2 nvidia.com/gpu.workload.config=container" in page
        assert "vm-passthrough → container" in page and "node.gpus &gt;= 1" in page
        assert '<span class="del">-swap</span>' in page and '<span class="add">+#swap</span>' in page
        assert "within 30.0s" in page and "gpu-present" in page


def test_rejecting_with_a_reason_cancels_the_run_records_who_and_why_and_a_reader_cannot_reject() -> None:
    with served("approve") as s:
        run_id = _waiting(s)
        _login(s.client, READER_TOKEN)
        page = s.client.get(f"/ui/runs/{run_id}")
        refused = s.client.post(f"/ui/runs/{run_id}/decision",
                                data={"csrf": _csrf(page.text), "action": "reject", "reason": "no"})
        assert refused.status_code == 403 and s.starter.run(run_id)["state"] == "waiting-approval"
        _login(s.client, APPROVER_TOKEN)
        csrf = _csrf(s.client.get(f"/ui/runs/{run_id}").text)
        empty = s.client.post(f"/ui/runs/{run_id}/decision", data={"csrf": csrf, "action": "reject", "reason": " "})
        assert empty.status_code == 400 and s.starter.run(run_id)["state"] == "waiting-approval"
        done = s.client.post(f"/ui/runs/{run_id}/decision", follow_redirects=False,
                             data={"csrf": csrf, "action": "reject", "reason": "omen2 is being drained by hand"})
        assert done.status_code == 303
        run = s.starter.run(run_id)
        assert (run["state"], run["rejected_by"], run["rejected_reason"]) == (
            "cancelled", "alice", "omen2 is being drained by hand")
        page = s.client.get(done.headers["location"]).text
        assert "alice: omen2 is being drained by hand" in page and 'id="approve"' not in page
        s.idle()
        assert "waiting_approval" in s.dispatcher.guards.state() and \
            run_id not in s.dispatcher.guards.state()["waiting_approval"]
        again = s.client.post(f"/ui/runs/{run_id}/decision",
                              data={"csrf": csrf, "action": "approve", "plan_digest": run["plan_digest"]})
        assert again.status_code == 409 and s.starter.run(run_id)["approved_by"] is None


def test_the_journal_starter_records_a_rejection_and_cancels_only_a_waiting_run(tmp_path: Any) -> None:
    from pathlib import Path

    import pytest

    from engine.errors import StalePlan
    from engine.serve_starter import JournalRunStarter
    from engine.settings import Settings

    repo = Path(__file__).resolve().parents[4]
    starter = JournalRunStarter(Settings(journal=tmp_path / "j.sqlite", runbooks_dir=repo / "runbooks"))
    journal = starter.journal
    waiting = journal.create_run("gpu-node-recovery", {"node": "omen2"}, ["omen2"], source="alertmanager",
                                 approval_required=True, state="waiting-approval")
    running = journal.create_run("gpu-node-recovery", {"node": "omen3"}, ["omen3"], source="alertmanager",
                                 state="running")
    summary = starter.reject(waiting, "drained by hand", "alice")
    assert (summary["state"], summary["exit_code"]) == ("cancelled", 4)
    events = starter.run(waiting)["events"]
    rejected = [e for e in events if e["kind"] == "approval.rejected"]
    assert [(e["by"], e["reason"]) for e in rejected] == [("alice", "drained by hand")]
    assert events[-1]["kind"] == "run.cancelled" and "rejected by alice" in events[-1]["reason"]
    for run_id in (waiting, running):
        with pytest.raises(StalePlan, match="not waiting for approval"):
            starter.reject(run_id, "again", "alice")
    assert journal.get_run(running).state == "running"


def test_the_page_of_a_finished_three_step_run_weighs_under_150_kb_with_its_stylesheet_and_script() -> None:
    def plan(run: Any) -> dict[str, Any]:
        one = _engine_plan(run)
        one["steps"] = [dict(one["steps"][0], id=f"step-{i}") for i in range(3)]
        return one

    starter = FakeRunStarter([trigger_spec(mode="approve")], plan=plan)
    with served("approve", starter=starter) as s:
        run_id = _waiting(s)
        for i in range(3):
            s.starter.record_event(run_id, "step.start", {"step": f"step-{i}"})
            s.starter.record_event(run_id, "verify.result", {"step": f"step-{i}", "check": "x", "holds": True,
                                                             "attempts": 2, "elapsed": 1.5})
            s.starter.record_event(run_id, "step.outcome", {"step": f"step-{i}", "status": "succeeded",
                                                            "evidence": {"observed": "ok" * 50}})
        s.starter.set_state(run_id, "succeeded")
        page = s.client.get(f"/ui/runs/{run_id}")
        assert page.status_code == 200 and page.text.count('data-status="succeeded"') == 3
        total = sum(len(s.client.get(p).content) for p in ("/ui/static/console.css", "/ui/static/console.js"))
        total += len(page.content)
        assert total < 150 * 1024, f"{total} bytes"
        assert "http://" not in page.text.split("</head>")[0] and "https://" not in page.text.split("</head>")[0]
