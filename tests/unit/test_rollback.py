"""Whole-run rollback (engine.rollback): declared inverses, the plan showing them, the inverse steps
of a recorded run newest first (auto inverses restore the values the run found, byte for byte),
refusals, and the shipped runbooks declaring an inverse (or none, with why) for every mutating step."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from engine.loader import list_runbooks, load
from engine.model import PlanState, RunState, Step
from engine.params import prepare_run
from engine.rollback import changed_steps, inverse_steps
from engine.runs import plan_targets
from engine.store import EventRecord
from tests.fakes import FakeClock, FakeKube, FakeNodes, RecordingSink, make_host, make_node

REPO = Path(__file__).resolve().parents[2]


def test_every_mutating_step_of_the_shipped_runbooks_declares_its_inverse_or_none() -> None:
    loaded, problems = list_runbooks(REPO / "runbooks")
    assert not problems
    missing = [f"{lr.name}/{s.id}" for lr in loaded for s in lr.runbook.steps if s.mutating and s.rollback is None]
    assert missing == []


def test_auto_is_only_for_kube_verbs_with_an_inverse() -> None:
    with pytest.raises(ValidationError, match="rollback: auto is the inverse of the kube verbs"):
        Step.model_validate({"id": "x", "action": {"ansible": {"playbook": "p.yml"}}, "rollback": "auto"})
    with pytest.raises(ValidationError, match="not both"):
        Step.model_validate({"id": "x", "action": {"kube": {"cordon": True}},
                             "rollback": {"auto": True, "action": {"kube": {"uncordon": True}}}})


def _events(*items: tuple[str, str, dict[str, object]]) -> list[EventRecord]:
    return [EventRecord("r-1", i, 0.0, kind, step, dict(data)) for i, (kind, step, data) in enumerate(items)]


def test_changed_steps_leave_out_no_ops_and_steps_their_own_rollback_undid() -> None:
    events = _events(("action.result", "a", {"changed": True}), ("action.result", "b", {"changed": False}),
                     ("action.result", "c", {"changed": True}), ("step.outcome", "c", {"status": "rolled-back"}),
                     ("action.result", "d", {"changed": True}))
    assert changed_steps(events) == ["a", "d"]


def _lab() -> tuple[FakeClock, FakeKube, FakeNodes]:
    clock = FakeClock()
    kube = FakeKube([make_node("omen2", labels={"runbook.example/marker": "before-\u00e9 x"})], clock=clock)
    nodes = FakeNodes({"omen2": make_host("omen2")}, clock=clock)
    nodes.effects["example-touch-file.yml"] = lambda fn, node, ev: None
    return clock, kube, nodes


def test_the_plan_shows_each_inverse_and_a_label_is_restored_byte_for_byte() -> None:
    from engine.execution import Executor

    clock, kube, nodes = _lab()
    loaded = load("example-label-and-file", REPO / "runbooks")
    prepared = prepare_run(loaded, ["value=ok1"], node="omen2")
    plan = plan_targets([prepared], kube, nodes)[0]
    assert plan.step("label-node").rollback == "auto: restore what the step changed"
    assert plan.step("touch-file").rollback.startswith("none: the marker file is harmless")
    steps, skipped, refused = inverse_steps(loaded.runbook, plan, ["label-node", "touch-file"])
    assert refused == [] and skipped == ["step touch-file: no inverse: the marker file is harmless; remove it "
                                         "by hand if you want"]
    (undo,) = steps
    assert undo.action.model_dump()["kube"] == {"label": {"runbook.example/marker": "before-\u00e9 x"}}
    kube.nodes["omen2"] = kube.nodes["omen2"].with_labels({"runbook.example/marker": "ok1"})
    book = loaded.runbook.model_copy(update={"steps": tuple(steps), "preconditions": ()})
    result = Executor(kube, nodes, events=RecordingSink(), playbooks_dir=loaded.playbooks_dir,
                      cancel=threading.Event(), clock=clock, sleep=clock.sleep, wall=clock.wall,
                      ).execute(plan_targets([prepare_run(loaded.__class__(book, loaded.path, loaded.digest,
                                                                         loaded.playbooks_dir),
                                                          ["value=ok1"], node="omen2")], kube, nodes)[0],
                                book, prepared.params)
    assert result.state is RunState.SUCCEEDED, result.reason
    assert kube.nodes["omen2"].labels["runbook.example/marker"] == "before-\u00e9 x"


def test_a_changed_step_without_an_inverse_refuses_the_rollback_and_an_absent_label_is_removed() -> None:
    _clock, kube, nodes = _lab()
    kube.nodes["omen2"] = kube.nodes["omen2"].with_labels({})
    loaded = load("example-label-and-file", REPO / "runbooks")
    plan = plan_targets([prepare_run(loaded, ["value=ok1"], node="omen2")], kube, nodes)[0]
    assert plan.state is PlanState.READY
    steps, _, refused = inverse_steps(loaded.runbook, plan, ["label-node"])
    assert refused == [] and steps[0].action.model_dump()["kube"] == {"unlabel": ("runbook.example/marker",)}
    bare = loaded.runbook.model_copy(update={"steps": tuple(s.model_copy(update={"rollback": None})
                                                            for s in loaded.runbook.steps)})
    _, _, refused = inverse_steps(bare, plan, ["label-node"])
    assert refused == ["step label-node changed the node but declares no inverse (rollback: ...); "
                       "nothing is rolled back"]


def test_the_flagship_declares_a_guarded_label_inverse_and_the_fstab_restore() -> None:
    loaded = load("gpu-node-recovery", REPO / "runbooks")
    step = loaded.runbook.step("relabel-container")
    assert step.describe_rollback() == "auto: restore what the step changed (under 1 guard(s))"
    swap = loaded.runbook.step("swap-off")
    assert swap.describe_rollback().startswith("playbook fstab-restore.yml: put /etc/fstab back byte for byte")
