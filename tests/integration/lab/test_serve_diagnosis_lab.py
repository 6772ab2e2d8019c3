"""``runbook serve`` on the lab with a trigger that requires the runbook's diagnosis (issue 19): a page
for gpu-3090-2 (containerd down) does not fire gpu-node-recovery - the run ends blocked with the
diagnosis' evidence before any plan, and nothing changes on the host or in the API - while a page for
omen2 (swap) matches and goes on to its plan, waiting for approval, omen2 still untouched."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.lab.hoststate import HostState
from tests.fakes import alert, webhook
from tests.integration.lab.serve_helpers import REPO, node_json, serving

pytestmark = [pytest.mark.integration, pytest.mark.lab, pytest.mark.timeout(900)]

PLAN_TIMEOUT = 240  # a deadline, not an expectation: facts, then a check-mode preview over SSH


def _runbooks(tmp_path: Path) -> Path:
    """The repository's runbooks and playbooks, gpu-node-recovery's trigger with require_diagnosis."""
    shutil.copytree(REPO / "runbooks", tmp_path / "runbooks")
    (tmp_path / "playbooks").symlink_to(REPO / "playbooks")
    path = tmp_path / "runbooks" / "gpu-node-recovery.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["triggers"][0]["require_diagnosis"] = True
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return tmp_path / "runbooks"


def _calls(lab: Any, node: str) -> list[dict[str, Any]]:
    return HostState(lab.lab.record()["nodes"][node]["state_dir"]).calls()


def test_a_trigger_requiring_the_diagnosis_fires_only_on_the_node_whose_cause_it_fixes(
        incident: Any, sh: Any, tmp_path: Path) -> None:
    before = {n: _calls(incident, n) for n in ("gpu-3090-2", "omen2")}
    labels_before = node_json(sh, "gpu-3090-2")["metadata"]["labels"]
    with serving(incident.env(), tmp_path / "serve", runbooks_dir=_runbooks(tmp_path)) as server:
        triggers = server.get("/triggers").json()
        assert any(t["runbook"] == "gpu-node-recovery" and t["require_diagnosis"] for t in triggers), triggers

        r = server.alert(webhook(alert("gpu-3090-2", fingerprint="fp-3090-2")))
        assert r.status_code == 202, r.text
        (d,) = r.json()["decisions"]
        assert (d["outcome"], d["runbook"]) == ("started", "gpu-node-recovery"), d
        assert "diagnosis matches the node" in d["reason"]
        run = server.wait_state(d["run_id"], ("blocked",), PLAN_TIMEOUT)
        reason = run["outcome_reason"]
        assert reason.startswith("diagnosis swap (gpu-node-recovery) does not match gpu-3090-2: "), reason
        assert "swap-on-or-refused does not hold" in reason and "nothing was planned or changed" in reason
        (diag,) = [e for e in run["events"] if e["kind"] == "diagnosis"]
        held = {e["id"]: e["holds"] for e in diag["evidence"]}
        assert diag["matched"] is False and held["node-not-ready"] is True and held["swap-on-or-refused"] is False
        assert run["plan"] is None and run["exit_code"] == 3

        r = server.alert(webhook(alert("omen2", fingerprint="fp-omen2")))
        assert r.status_code == 202, r.text
        (d,) = r.json()["decisions"]
        run = server.wait_state(d["run_id"], ("waiting-approval",), PLAN_TIMEOUT)
        (diag,) = [e for e in run["events"] if e["kind"] == "diagnosis"]
        assert (diag["matched"], diag["cause"], diag["confidence"]) == (True, "swap", "high")
        assert run["plan"] is not None

    # nothing changed by either page: no mutating command on the hosts, the labels as they were
    assert {n: _calls(incident, n) for n in before} == before
    assert node_json(sh, "gpu-3090-2")["metadata"]["labels"] == labels_before
    assert node_json(sh, "omen2")["metadata"]["labels"]["nvidia.com/gpu.workload.config"] == "vm-passthrough"
