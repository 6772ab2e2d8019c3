"""Node Events: every step outcome of a run becomes a Kubernetes Event on the Node, best effort."""

from __future__ import annotations

import threading
from typing import Any

from engine.errors import JournalError, KubeError
from engine.execution import Executor
from engine.model import RunState
from engine.node_events import NodeEventSink, find_run_id, node_event_for
from tests.fakes import (
    FakeClock,
    FakeKube,
    FakeNodes,
    RecordingSink,
    incident_host,
    incident_node,
    install_recovery_effects,
)
from tests.unit.test_execution import PARAMS, PLAYBOOKS, RUNBOOK, Lab


class _JournalLike:
    """Stands in for JournalSink: has a run id, records, and can fail like a full disk."""

    def __init__(self, run_id: str, fail_on: str | None = None) -> None:
        self.run_id = run_id
        self.fail_on = fail_on
        self.kinds: list[str] = []

    def emit(self, kind: str, **data: Any) -> None:
        if kind == self.fail_on:
            raise JournalError("journal: disk full")
        self.kinds.append(kind)


def _lab() -> Lab:
    clock = FakeClock()
    kube = FakeKube([incident_node()], clock=clock)
    nodes = FakeNodes({"omen2": incident_host()}, clock=clock)
    install_recovery_effects(kube, nodes, ready_after=20.0, gpu_after=40.0)
    return Lab(clock, kube, nodes, RecordingSink(), threading.Event())


def test_a_recovery_posts_one_succeeded_event_per_step_on_the_node_naming_run_runbook_and_step() -> None:
    lab = _lab()
    journal = _JournalLike("run-abc123")
    executor = Executor(lab.kube, lab.nodes, events=journal, playbooks_dir=PLAYBOOKS, clock=lab.clock,
                        sleep=lab.clock.sleep, wall=lab.clock.wall, cancel=lab.cancel)
    result = executor.execute(lab.plan(), RUNBOOK, PARAMS)
    assert result.state is RunState.SUCCEEDED
    outcomes = [o for o in result.outcomes]
    assert [e.reason for e in lab.kube.events] == ["RemediationStepSucceeded" if o.status.value == "succeeded"
                                                   else "RemediationStepSkipped" for o in outcomes]
    assert len(lab.kube.events) == len(RUNBOOK.steps)
    for event, outcome in zip(lab.kube.events, outcomes, strict=True):
        assert event.node == "omen2" and event.reporting_controller == "runbook" and event.type == "Normal"
        assert f"run run-abc123: runbook {RUNBOOK.name}, step {outcome.step}" in event.note
    assert journal.kinds.count("step.outcome") == len(RUNBOOK.steps)


def test_a_failed_step_is_a_warning_event_and_a_blocked_run_says_blocked_once() -> None:
    failed = node_event_for("step.outcome", {"step": "relabel", "status": "rolled-back", "reason": "denied"},
                            run_id="r1", runbook="gpu", node="omen2", instance="i")
    assert failed is not None and (failed.reason, failed.type) == ("RemediationStepFailed", "Warning")
    assert "step relabel rolled-back: denied" in failed.note
    kube = FakeKube([incident_node()])
    sink = NodeEventSink(_JournalLike("r2"), kube)
    sink.emit("run.start", runbook="gpu", node="omen2")
    sink.emit("step.outcome", step="relabel", status="blocked", reason="guard")
    sink.emit("run.blocked", reason="guard")
    assert [(e.reason, e.type) for e in kube.events] == [("RemediationBlocked", "Warning")]
    before_any_step = NodeEventSink(_JournalLike("r3"), kube)
    before_any_step.emit("run.start", runbook="gpu", node="omen2")
    before_any_step.emit("run.blocked", reason="the plan is blocked: exclusion label")
    assert kube.events[-1].reason == "RemediationBlocked" and "r3" in kube.events[-1].note


def test_an_event_the_api_refuses_is_logged_and_the_run_still_succeeds(caplog: Any) -> None:
    lab = _lab()
    lab.kube.fail["create_node_event"] = KubeError("events is forbidden", status=403)
    journal = _JournalLike("run-x")
    executor = Executor(lab.kube, lab.nodes, events=journal, playbooks_dir=PLAYBOOKS, clock=lab.clock,
                        sleep=lab.clock.sleep, wall=lab.clock.wall, cancel=lab.cancel)
    with caplog.at_level("WARNING", logger="runbook.node_events"):
        result = executor.execute(lab.plan(), RUNBOOK, PARAMS)
    assert result.state is RunState.SUCCEEDED and lab.kube.events == []
    assert "could not record Event RemediationStepSucceeded on node omen2 for run run-x" in caplog.text


def test_the_journal_is_written_first_and_its_failure_still_aborts_with_no_event_posted() -> None:
    kube = FakeKube([incident_node()])
    sink = NodeEventSink(_JournalLike("r4", fail_on="step.outcome"), kube)
    sink.emit("run.start", runbook="gpu", node="omen2")
    try:
        sink.emit("step.outcome", step="relabel", status="succeeded")
    except JournalError:
        pass
    else:  # pragma: no cover - the assertion below says what broke
        raise AssertionError("the journal's failure was swallowed")
    assert kube.events == []


def test_the_run_id_is_found_through_a_fanout_of_sinks() -> None:
    class Fan:
        def __init__(self, *sinks: Any) -> None:
            self.sinks = list(sinks)

    assert find_run_id(Fan(RecordingSink(), _JournalLike("run-7"))) == "run-7"
    assert find_run_id(RecordingSink()) is None
