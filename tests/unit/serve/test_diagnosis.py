"""A trigger with ``require_diagnosis: true`` fires its runbook only when the runbook's declared
diagnosis matches the paged node: checked first, read-only; otherwise the run ends blocked with the
evidence and nothing is planned or changed (issue 19)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from engine.errors import LoadError
from engine.facts import ServiceFacts
from engine.loader import load_runbook
from engine.serve.alertmanager import parse_webhook
from engine.serve.starter import RunRequest
from engine.serve.triggers import TriggerIndex
from engine.serve_starter import JournalRunStarter
from engine.settings import Settings
from tests.fakes import (
    FakeKube,
    FakeNodes,
    FakeRunStarter,
    alert,
    incident_host,
    incident_node,
    make_host,
    make_node,
    served,
    trigger_spec,
    webhook,
)

REPO = Path(__file__).resolve().parents[3]
GPU_LABEL = "nvidia.com/gpu.workload.config"
CRI_ERROR = ('E run.go:72] "command failed" err="failed to run Kubelet: validate CRI v1 runtime API for endpoint '
             '\\"unix:///var/run/containerd/containerd.sock\\": rpc error: code = Unavailable"')


def _runbooks(tmp_path: Path, *, require: bool = True) -> Path:
    """The packaged runbooks, gpu-node-recovery's trigger with ``require_diagnosis``."""
    folder = tmp_path / "runbooks"
    shutil.copytree(REPO / "runbooks", folder)
    (tmp_path / "playbooks").symlink_to(REPO / "playbooks")
    path = folder / "gpu-node-recovery.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["triggers"][0]["require_diagnosis"] = require
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return folder


def test_require_diagnosis_on_a_runbook_without_a_diagnosis_is_a_located_load_error(tmp_path: Path) -> None:
    path = tmp_path / "rb.yaml"
    path.write_text(
        "apiVersion: runbook/v1\nname: rb\nversion: '1'\nparams: {node: {type: node, required: true}}\n"
        "steps:\n  - id: wait\n    action: {check: {}}\n    verify: [{check: {node_ready: true}}]\n"
        "triggers:\n  - alert: KubeNodeNotReady\n    params: {node: '{{ labels.node }}'}\n"
        "    require_diagnosis: true\n")
    with pytest.raises(LoadError) as e:
        load_runbook(path)
    assert f"{path}:12" in str(e.value) and "triggers[0].require_diagnosis" in str(e.value)
    assert "diagnosis section" in str(e.value)


def test_the_trigger_index_carries_require_diagnosis_to_the_candidate_and_shows_it() -> None:
    index = TriggerIndex([trigger_spec(require_diagnosis=True), trigger_spec("other")])
    (first, second) = index.for_alert(parse_webhook(json.dumps(webhook(alert("omen2"))).encode()).alerts[0]).candidates
    assert (first.runbook, first.require_diagnosis) == ("gpu-node-recovery", True)
    assert (second.runbook, second.require_diagnosis) == ("other", False)
    assert [t["require_diagnosis"] for t in index.describe()] == [True, False]


def test_the_server_asks_the_starter_to_check_the_diagnosis_and_says_so_in_its_answer() -> None:
    starter = FakeRunStarter([trigger_spec(require_diagnosis=True)])
    with served(starter=starter) as s:
        r = s.post_alerts(alert("omen2"))
        s.idle()
    assert r.status_code == 202, r.text
    (decision,) = r.json()["decisions"]
    assert decision["outcome"] == "started"
    assert "if the runbook's diagnosis matches the node" in decision["reason"]
    (request,) = starter.requests
    assert request.require_diagnosis is True


def _starter(tmp_path: Path, kube: FakeKube, nodes: FakeNodes, *, require: bool = True) -> JournalRunStarter:
    settings = Settings(journal=tmp_path / "journal.sqlite", runbooks_dir=_runbooks(tmp_path, require=require),
                        inventory=tmp_path / "inventory.ini", _cache={"kube": kube, "nodes": nodes})
    return JournalRunStarter(settings)


def _request(node: str, *, require: bool = True, mode: str = "auto") -> RunRequest:
    return RunRequest(runbook="gpu-node-recovery", params={"node": node}, node=node, mode=mode,  # type: ignore[arg-type]
                      source="alertmanager", reason=f"alertmanager: KubeNodeNotReady{{node={node}}}",
                      require_diagnosis=require)


def _containerd_down() -> tuple[FakeKube, FakeNodes]:
    host = make_host("gpu-3090-2", kubelet="activating", journal=CRI_ERROR)
    host = replace(host, services={**host.services, "containerd": ServiceFacts("containerd", "failed", "")})
    kube = FakeKube([make_node("gpu-3090-2", ready=False, labels={GPU_LABEL: "container"})])
    return kube, FakeNodes({"gpu-3090-2": host})


def test_a_page_for_a_node_sick_for_another_cause_ends_blocked_with_the_evidence_and_nothing_changes(
        tmp_path: Path) -> None:
    kube, nodes = _containerd_down()
    starter = _starter(tmp_path, kube, nodes)
    ticket = starter.submit(_request("gpu-3090-2"))
    outcome = starter.execute(ticket.run_id)
    assert (outcome.state, outcome.exit_code) == ("blocked", 3)
    assert outcome.reason.startswith("diagnosis swap (gpu-node-recovery) does not match gpu-3090-2: ")
    assert "swap-on-or-refused does not hold" in outcome.reason and "nothing was planned or changed" in outcome.reason
    run = starter.run(ticket.run_id)
    assert run["state"] == "blocked" and run["plan"] is None and run["outcome_reason"] == outcome.reason
    (diag,) = [e for e in run["events"] if e["kind"] == "diagnosis"]
    assert diag["matched"] is False and diag["cause"] == "swap"
    held = {e["id"]: e["holds"] for e in diag["evidence"]}
    assert held["node-not-ready"] is True and held["swap-on-or-refused"] is False
    assert "plan" not in [e["kind"] for e in run["events"]]
    # read-only: one facts run, no playbook, no Kubernetes write, no node Lease
    assert len(nodes.gathers) == 1 and nodes.runs == []
    assert kube.patches == [] and kube.leases == {}


def test_a_page_whose_diagnosis_matches_goes_on_to_its_plan(tmp_path: Path) -> None:
    kube = FakeKube([incident_node("omen2")])
    nodes = FakeNodes({"omen2": incident_host("omen2")})
    starter = _starter(tmp_path, kube, nodes)
    ticket = starter.submit(_request("omen2", mode="approve"))
    outcome = starter.execute(ticket.run_id)
    assert outcome.state == "waiting-approval", outcome
    run = starter.run(ticket.run_id)
    (diag,) = [e for e in run["events"] if e["kind"] == "diagnosis"]
    assert diag["matched"] is True and diag["confidence"] == "high"
    assert diag["reason"].startswith("diagnosis swap (gpu-node-recovery) matches omen2, confidence high")
    assert run["plan"] is not None and kube.patches == []


def test_without_require_diagnosis_no_diagnosis_is_made_and_the_preconditions_decide(tmp_path: Path) -> None:
    kube, nodes = _containerd_down()
    starter = _starter(tmp_path, kube, nodes, require=False)
    ticket = starter.submit(_request("gpu-3090-2", require=False))
    outcome = starter.execute(ticket.run_id)
    assert outcome.state == "blocked" and "precondition down-only-because-of-swap" in outcome.reason
    assert [e for e in starter.run(ticket.run_id)["events"] if e["kind"] == "diagnosis"] == []
