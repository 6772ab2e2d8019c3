"""``runbook serve`` on the lab under the failure-handling policies (issue 29): an automatic run paged
outside its trigger's maintenance window is deferred and starts by itself when the window opens (the
server's clock compressed with RUNBOOK_CLOCK), and a two-approver policy starts a run only on the
second distinct approval (the console shows "1 of 2 approvals"). Each recovers omen2 for real."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fakes import alert, webhook
from tests.integration.lab.serve_helpers import APPROVERS, REPO, serving

pytestmark = [pytest.mark.integration, pytest.mark.lab, pytest.mark.timeout(1200)]

PLAN_TIMEOUT = 240  # deadlines, not expectations (a loaded 2-core machine)
RUN_TIMEOUT = 480
PERMISSIVE = {"max_unhealthy_nodes": 8, "max_unhealthy_gpus": 100}


def _runbooks(tmp_path: Path, windows: list[dict[str, Any]] | None = None) -> Path:
    shutil.copytree(REPO / "runbooks", tmp_path / "runbooks")
    (tmp_path / "playbooks").symlink_to(REPO / "playbooks")
    if windows is not None:
        path = tmp_path / "runbooks" / "gpu-node-recovery.yaml"
        doc = yaml.safe_load(path.read_text())
        doc["triggers"][0]["windows"] = windows
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return tmp_path / "runbooks"


def _started(r: Any) -> dict[str, Any]:
    assert r.status_code == 202, r.text
    (d,) = r.json()["decisions"]
    assert d["outcome"] == "started", d
    return dict(d)


def test_an_automatic_run_outside_its_window_is_deferred_and_starts_when_the_window_opens(
        fresh_lab: Any, tmp_path: Path) -> None:
    # Two minutes before the window, at twice the speed: it opens about a minute after the server starts.
    env = {**fresh_lab.env(), "RUNBOOK_CLOCK": "2026-12-07T21:58:00+00:00*2"}
    config = {"mode_overrides": {"gpu-node-recovery": "auto"}, "breaker": PERMISSIVE, "deferred_poll": "1s"}
    books = _runbooks(tmp_path, windows=[{"start": "22:00", "end": "23:00", "timezone": "UTC"}])
    with serving(env, tmp_path / "serve", config, runbooks_dir=books) as server:
        d = _started(server.alert(webhook(alert("omen2", fingerprint="fp-window"))))
        assert d["mode"] == "auto"
        deadline = time.monotonic() + 60
        while True:
            run = server.run(d["run_id"])
            deferred = [e for e in run["events"] if e["kind"] == "run.deferred"]
            if deferred or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert deferred, run["events"]
        assert deferred[0]["until"] == "2026-12-07T22:00:00+00:00"
        assert "outside its maintenance windows" in deferred[0]["reason"]
        assert run["state"] == "pending" and "lock.acquired" not in [e["kind"] for e in run["events"]]
        run = server.wait_state(d["run_id"], ("succeeded",), RUN_TIMEOUT + 120)
        kinds = [e["kind"] for e in run["events"]]
        assert kinds.index("run.deferred") < kinds.index("lock.acquired") < kinds.index("step.start")
        (guards,) = [e for e in run["events"] if e["kind"] == "guards"]
        (window,) = [v for v in guards["verdicts"] if v["guard"] == "window"]
        assert window["holds"] is True


def test_a_two_approver_policy_starts_the_run_only_on_the_second_distinct_approval(
        fresh_lab: Any, tmp_path: Path) -> None:
    config = {"approvals": {"policies": [{"runbook": "gpu-node-recovery", "min_approvers": 2,
                                          "approvers": {"identities": ["alice", "bob"]}}]}}
    with serving(fresh_lab.env(), tmp_path / "serve", config, runbooks_dir=_runbooks(tmp_path)) as server:
        d = _started(server.alert(webhook(alert("omen2", fingerprint="fp-two"))))
        run = server.wait_state(d["run_id"], ("waiting-approval",), PLAN_TIMEOUT)
        digest = run["plan_digest"]
        first = server.approve(d["run_id"], digest, by="alice")
        assert first.status_code == 200 and first.json()["queued"] is False, first.text
        assert first.json()["approvals"]["text"] == "1 of 2 approvals"
        again = server.approve(d["run_id"], digest, by="alice")
        assert again.status_code == 403 and "alice has approved this plan already" in again.text
        page = server.get(f"/ui/runs/{d['run_id']}", headers={"Authorization": f"Bearer {APPROVERS['alice']}"})
        assert page.status_code == 200 and "1 of 2 approvals" in page.text
        time.sleep(1.0)  # nothing may start on one approval
        run = server.run(d["run_id"])
        assert (run["state"], run["approved_by"]) == ("waiting-approval", None)
        assert "lock.acquired" not in [e["kind"] for e in run["events"]]
        second = server.approve(d["run_id"], digest, by="bob")
        assert second.status_code == 202 and second.json()["queued"] is True, second.text
        run = server.wait_state(d["run_id"], ("succeeded",), RUN_TIMEOUT)
        assert run["approved_by"] == "alice, bob"
        kinds = [e["kind"] for e in run["events"]]
        assert kinds.count("approval.recorded") == 2 and kinds.index("approval.granted") < kinds.index("lock.acquired")
