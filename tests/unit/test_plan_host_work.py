"""Fewer Ansible runs per plan and per step (issue 9's profile): the plan's check-mode previews
hand it their closing host facts, a plan without previews starts its facts run before the
Kubernetes client is built, and the executor reuses the facts the previous playbook published
(recording the reuse and its age in the journal)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.connectors.base import PlaybookResult
from engine.execution import Executor
from engine.facts import HostFacts
from engine.loader import load
from engine.model import PlanState, RunState
from engine.params import PreparedRun, prepare_run
from engine.previews import start_host_work
from engine.runs import plan_targets
from tests.fakes import FakeClock, FakeKube, FakeNodes, RecordingSink, make_host, make_node

REPO = Path(__file__).resolve().parents[2]


class RememberingNodes(FakeNodes):
    """FakeNodes that keeps the facts each run returned, as AnsibleConnector.recent_facts does."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.recent: dict[str, tuple[HostFacts, float]] = {}

    def run_playbook(self, playbook: Path, nodes: Sequence[str], **kw: Any) -> PlaybookResult:
        for n in nodes:
            self.recent.pop(n, None)
        result = super().run_playbook(playbook, nodes, **kw)
        self.recent.update({n: (f, time.monotonic()) for n, f in result.host_facts.items()})
        return result

    def gather_facts(self, nodes: Sequence[str], files: Sequence[str] = ()) -> Mapping[str, HostFacts | Exception]:
        out = super().gather_facts(nodes, files)
        self.recent.update({n: (f, time.monotonic()) for n, f in out.items() if isinstance(f, HostFacts)})
        return out

    def recent_facts(self, nodes: Sequence[str], *, max_age: float,
                     files: Sequence[str] = ()) -> dict[str, tuple[HostFacts, float]]:
        now = time.monotonic()
        return {n: (f, now - at) for n in nodes if (hit := self.recent.get(n)) is not None
                for f, at in [hit] if max_age > 0 and now - at <= max_age and all(p in f.files for p in files)}


def _lab(nodes_cls: type[FakeNodes] = RememberingNodes, *, labels: Mapping[str, str] | None = None
         ) -> tuple[FakeClock, FakeKube, FakeNodes, PreparedRun]:
    clock = FakeClock()
    kube = FakeKube([make_node("omen2", labels=dict(labels or {}))], clock=clock)
    nodes = nodes_cls({"omen2": make_host("omen2")}, clock=clock)

    def touch(fn: FakeNodes, node: str, ev: Mapping[str, Any]) -> None:
        fn.files.setdefault(node, {})[ev["marker_path"]] = f"marker={ev['marker_content']}\n"

    nodes.effects["example-touch-file.yml"] = touch
    loaded = load("example-label-and-file", REPO / "runbooks")
    return clock, kube, nodes, prepare_run(loaded, ["value=ok1"], node="omen2")


def test_the_previews_closing_facts_are_the_plans_host_facts() -> None:
    _, kube, nodes, prepared = _lab()
    plan = plan_targets([prepared], kube, nodes)[0]
    assert plan.state is PlanState.READY
    assert nodes.gathers == []  # no facts run: the check-mode run's closing facts served
    (preview_run,) = nodes.runs
    assert preview_run["check"] is True
    assert preview_run["extravars"]["runbook_files"] == ["/var/tmp/runbook-example"]  # what the plan reads
    assert plan.step("touch-file").preview.startswith("check mode")


def test_a_preview_of_a_step_the_plan_does_not_change_is_dropped() -> None:
    _, kube, nodes, prepared = _lab(labels={"runbook.example/marker": "ok1"})
    nodes.files["omen2"] = {"/var/tmp/runbook-example": "marker=ok1\n"}
    plan = plan_targets([prepared], kube, nodes)[0]
    assert plan.state is PlanState.NOTHING_TO_DO
    assert all(s.preview == "" for s in plan.steps)
    assert nodes.gathers == [] and [r["check"] for r in nodes.runs] == [True]


def test_without_facts_from_the_previews_a_facts_run_gathers_them() -> None:
    _, kube, nodes, prepared = _lab(FakeNodes)  # keeps no recent facts
    plan = plan_targets([prepared], kube, nodes)[0]
    assert plan.state is PlanState.READY
    assert nodes.gathers == [(["omen2"], ["/var/tmp/runbook-example"])]
    assert plan.step("touch-file").preview.startswith("check mode")


def test_a_plan_without_previews_waits_for_the_facts_run_it_started_first() -> None:
    _, kube, nodes, prepared = _lab()
    work = start_host_work([prepared], nodes, preview=False)
    assert work.previews is None and work.facts is not None
    plan = plan_targets([prepared], kube, nodes, preview=False, host_work=work)[0]
    assert plan.state is PlanState.READY
    assert nodes.gathers == [(["omen2"], ["/var/tmp/runbook-example"])] and nodes.runs == []  # one facts run


def test_the_executor_reuses_the_previous_playbooks_facts_and_journals_it() -> None:
    clock, kube, nodes, prepared = _lab()
    plan = plan_targets([prepared], kube, nodes, preview=False)[0]
    gathers_before = len(nodes.gathers)
    sink = RecordingSink()
    result = Executor(kube, nodes, events=sink, playbooks_dir=prepared.loaded.playbooks_dir,
                      cancel=threading.Event(), clock=clock, sleep=clock.sleep, wall=clock.wall,
                      ).execute(plan, prepared.runbook, prepared.params)
    assert result.state is RunState.SUCCEEDED, result.reason
    reused = [d for k, d in sink.events if k == "probe.reused"]
    # touch-file's skip_if used the plan's facts (seconds old), not a new facts run
    assert [d["step"] for d in reused][:1] == ["touch-file"]
    assert all(d["probe"] == "host" and d["node"] == "omen2" and 0 <= d["age_s"] <= 10 for d in reused)
    outcome = next(d for k, d in sink.events if k == "step.outcome" and d["step"] == "touch-file")
    assert 0 <= outcome["evidence"]["host_facts_age_s"] <= 10
    assert len(nodes.gathers) == gathers_before  # the step's checks gathered nothing new


def test_reuse_off_gathers_before_every_step() -> None:
    clock, kube, nodes, prepared = _lab()
    plan = plan_targets([prepared], kube, nodes, preview=False)[0]
    sink = RecordingSink()
    result = Executor(kube, nodes, events=sink, playbooks_dir=prepared.loaded.playbooks_dir,
                      cancel=threading.Event(), clock=clock, sleep=clock.sleep, wall=clock.wall,
                      host_facts_max_age=0).execute(plan, prepared.runbook, prepared.params)
    assert result.state is RunState.SUCCEEDED, result.reason
    assert not [k for k, _ in sink.events if k == "probe.reused"]
