"""Escalation and automatic whole-run rollback through the run service, on our fakes: a failed run
escalates to the next runbook of its chain as a linked child run; a blocked run never escalates; a
child that needs approval is parked; ``on_failure: {rollback: all}`` rolls the whole run back as a
linked run that restores what it found."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.escalation import lineage
from engine.model import RunState
from engine.params import prepare_run
from engine.runs import RunService
from engine.settings import Settings
from tests.fakes import FakeClock, FakeKube, FakeNodes, make_host, make_node

KEY = "example.io/state"


def _runbook(name: str, steps: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"apiVersion": "runbook/v1", "name": name, "version": "1",
            "params": {"node": {"type": "node", "required": True}}, "steps": steps, **extra}


def _label(step: str, value: str, *, expect: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": step, "action": {"kube": {"label": {KEY: value}}}, "rollback": "auto",
            "verify": [{"check": {"node_label": {"key": KEY, "equals": expect or value}}, "timeout": "2s"}], **extra}


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[RunService, FakeKube]]:
    books = tmp_path / "runbooks"
    books.mkdir()
    (tmp_path / "playbooks").mkdir()
    docs = [
        _runbook("fix", [_label("set-a", "a", expect="never")], on_failure={"escalate": ["gone", "second"]}),
        _runbook("second", [_label("set-b", "b")]),
        _runbook("fix-guarded", [{**_label("set-a", "a", expect="never"),
                                  "guards": [{"node_label": {"key": "x", "equals": "y"}}]}],
                 on_failure={"escalate": ["second"]}),
        _runbook("fix-asks", [_label("set-a", "a", expect="never")], on_failure={"escalate": ["asks"]}),
        _runbook("asks", [_label("set-c", "c")], approval=True),
        _runbook("undo-all", [_label("set-a", "a"), {**_label("set-b", "b", expect="never"),
                                                     "on_failure": {"rollback": "all"},
                                                     "action": {"kube": {"label": {"other": "b"}}},
                                                     "verify": [{"check": {"node_label": {"key": "other",
                                                                                          "equals": "never"}},
                                                                 "timeout": "2s"}]}]),
    ]
    for d in docs:
        (books / f"{d['name']}.yaml").write_text(yaml.safe_dump(d))
    clock = FakeClock()
    kube = FakeKube([make_node("omen2", labels={KEY: "orig"})], clock=clock)
    nodes = FakeNodes({"omen2": make_host("omen2")}, clock=clock)
    settings = Settings(journal=tmp_path / "journal.sqlite", runbooks_dir=books)
    settings._cache.update(kube=kube, nodes=nodes)
    svc = RunService(settings, executor_options={"clock": clock, "sleep": clock.sleep, "wall": clock.wall})
    yield svc, kube
    svc.journal.close()


def _run(svc: RunService, name: str) -> tuple[str, Any]:
    prepared = prepare_run(svc.load(name), {"node": "omen2"})
    plan = svc.plan(prepared)
    run_id = svc.create(prepared, plan)
    return run_id, svc.execute(run_id, prepared, plan)


def test_a_failed_run_escalates_along_its_chain_to_a_linked_child_that_fixes_the_node(
        service: tuple[RunService, FakeKube]) -> None:
    svc, kube = service
    run_id, result = _run(svc, "fix")
    assert result.state is RunState.FAILED
    events = svc.journal.events(run_id)
    refused = [e.data for e in events if e.kind == "escalation.refused"]
    assert refused and refused[0]["runbook"] == "gone"  # a missing runbook: the chain goes on
    (child,) = lineage(events)["children"]
    assert child["runbook"] == "second" and child["why"] == "escalated to"
    rec = svc.journal.get_run(child["run"])
    assert (rec.runbook, rec.state, rec.source) == ("second", "succeeded", "escalation")
    assert lineage(svc.journal.events(child["run"]))["parent"] == {"run": run_id, "why": "escalated from"}
    assert kube.nodes["omen2"].labels[KEY] == "b"


def test_a_blocked_run_never_escalates(service: tuple[RunService, FakeKube]) -> None:
    svc, _ = service
    run_id, result = _run(svc, "fix-guarded")
    assert result.state is RunState.BLOCKED
    assert lineage(svc.journal.events(run_id))["children"] == []


def test_a_child_that_needs_approval_is_parked_for_a_person(service: tuple[RunService, FakeKube]) -> None:
    svc, kube = service
    run_id, _ = _run(svc, "fix-asks")
    (child,) = lineage(svc.journal.events(run_id))["children"]
    assert svc.journal.get_run(child["run"]).state == "waiting-approval"
    assert kube.nodes["omen2"].labels[KEY] == "a"  # the child changed nothing yet


def test_rollback_all_restores_what_the_run_found_as_a_linked_run(service: tuple[RunService, FakeKube]) -> None:
    svc, kube = service
    run_id, result = _run(svc, "undo-all")
    assert result.state is RunState.FAILED
    (child,) = lineage(svc.journal.events(run_id))["children"]
    assert child["why"] == "rolled back by"
    assert svc.journal.get_run(child["run"]).state == "succeeded"
    assert kube.nodes["omen2"].labels[KEY] == "orig" and "other" not in kube.nodes["omen2"].labels
    assert lineage(svc.journal.events(child["run"]))["parent"] == {"run": run_id, "why": "rolls back"}


def test_the_shipped_escalations_name_shipped_runbooks_with_a_node_param_that_ask_for_approval() -> None:
    from engine.loader import list_runbooks

    loaded, problems = list_runbooks(Path(__file__).resolve().parents[2] / "runbooks")
    assert not problems
    books = {lr.name: lr.runbook for lr in loaded}
    assert books["gpu-node-recovery"].on_failure is not None
    for rb in books.values():
        for name in (rb.on_failure.escalate if rb.on_failure else ()):
            assert name in books and books[name].node_param is not None and books[name].approval, name
