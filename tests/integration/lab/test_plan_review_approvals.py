"""Approvals on the lab (issue 6): a run of a runbook requiring approval pauses with its plan digest in
the journal; `runbook runs` shows it; an approval for another digest (exit 5) or an unknown run (exit 2)
is refused; the right approval from another process lets the waiting run continue; a run whose process
ended continues with `runbook resume` once approved."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.integration.lab.flagship_cli import LABEL, RUNBOOKS, kube_node, ready, runbook, start_runbook
from tests.integration.lab.lab_helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.lab]


def approval_runbooks(tmp_path: Path) -> Path:
    """The flagship with `approval: true`, in a folder of its own (playbooks: the packaged ones)."""
    folder = tmp_path / "runbooks"
    folder.mkdir()
    text = (RUNBOOKS / "gpu-node-recovery.yaml").read_text()
    assert "\nversion: " in text
    (folder / "gpu-node-recovery.yaml").write_text(text.replace("\nversion: ", "\napproval: true\nversion: ", 1))
    return folder


def waiting_run(sh: Any, journal: Path) -> Any:
    r = runbook(sh, "runs -o json", journal=journal)
    if r.returncode != 0:
        return None
    return next((x for x in json.loads(r.stdout) if x["state"] == "waiting-approval"), None)


def test_a_run_waits_for_an_approval_of_its_plan_digest_from_another_process(
        fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    journal, folder = tmp_path / "journal.sqlite", approval_runbooks(tmp_path)
    proc = start_runbook(fresh_lab.env(), ["run", "gpu-node-recovery", "--node", "omen2", "--yes",
                                            "--runbooks-dir", str(folder)], journal=journal, log=tmp_path / "run.log")
    try:
        run = wait_for(lambda: waiting_run(sh, journal), 90, "the run waiting for approval")
        run_id, digest = run["id"], run["plan_digest"]
        assert len(digest) == 64 and run["approval_required"] is True
        listed = runbook(sh, "runs", journal=journal).stdout
        assert run_id in listed and digest in listed  # the whole digest, ready to approve
        assert kube_node(sh, "omen2")["metadata"]["labels"][LABEL] == "vm-passthrough"  # paused before any change

        wrong = runbook(sh, f"approve {run_id} --plan-digest {'0' * 64}", journal=journal)
        assert wrong.returncode == 5 and "approve that digest" in wrong.stderr, wrong.stderr
        unknown = runbook(sh, f"approve r-00000000000000-000000 --plan-digest {digest}", journal=journal)
        assert unknown.returncode == 2 and "unknown run id" in unknown.stderr, unknown.stderr
        assert proc.poll() is None and waiting_run(sh, journal) is not None  # still waiting

        # With the SQLite store the approver is the OS user; --by may name only the configured identity.
        policy = tmp_path / "approvals.yaml"
        policy.write_text("approvals:\n  cli_identity: reviewer\n")
        typed = runbook(sh, f"approve {run_id} --plan-digest {digest} --by mallory --guards-config {policy}",
                        journal=journal)
        assert typed.returncode == 2 and "--by mallory" in typed.stderr, typed.stderr
        ok = runbook(sh, f"approve {run_id} --plan-digest {digest} --by reviewer --guards-config {policy}",
                     journal=journal)
        assert ok.returncode == 0, ok.stderr
        assert proc.wait(timeout=240) == 0, (tmp_path / "run.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    shown = json.loads(runbook(sh, f"runs show {run_id} -o json", journal=journal).stdout)
    assert shown["state"] == "succeeded" and shown["approved_by"] == "reviewer"
    assert any(e["kind"] == "approval.granted" and e["plan_digest"] == digest for e in shown["events"])
    node = kube_node(sh, "omen2")
    assert ready(node) and node["metadata"]["labels"][LABEL] == "container"


def test_resume_continues_an_approved_run_whose_process_ended(fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    journal, folder = tmp_path / "journal.sqlite", approval_runbooks(tmp_path)
    proc = start_runbook(fresh_lab.env(), ["run", "gpu-node-recovery", "--node", "omen2", "--yes",
                                            "--runbooks-dir", str(folder)], journal=journal, log=tmp_path / "run.log")
    try:
        run = wait_for(lambda: waiting_run(sh, journal), 90, "the run waiting for approval")
        proc.send_signal(signal.SIGTERM)  # the operator's terminal goes away
        assert proc.wait(timeout=60) == 3, (tmp_path / "run.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert waiting_run(sh, journal)["id"] == run["id"]
    assert kube_node(sh, "omen2")["metadata"]["labels"][LABEL] == "vm-passthrough"

    assert runbook(sh, f"approve {run['id']} --plan-digest {run['plan_digest']}", journal=journal).returncode == 0
    r = runbook(sh, f"resume {run['id']} --yes --runbooks-dir {folder}", journal=journal)
    assert r.returncode == 0, r.stdout + r.stderr
    node = kube_node(sh, "omen2")
    assert ready(node) and node["metadata"]["labels"][LABEL] == "container"
    assert json.loads(runbook(sh, f"runs show {run['id']} -o json", journal=journal).stdout)["state"] == "succeeded"
