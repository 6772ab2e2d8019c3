"""The library entry points the CLI and the server use, end to end on the fakes."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fakes import (
    GPU_LABEL,
    FakeClock,
    FakeKube,
    FakeNodes,
    RecordingSink,
    healthy_host,
    healthy_node,
    incident_host,
    incident_node,
    install_recovery_effects,
    make_host,
    make_node,
)

from engine import api
from engine.errors import LoadError, UsageError
from engine.model import PlanState, RunState

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"
NOW = datetime(2026, 7, 10, 15, 40, tzinfo=UTC)


def test_load_by_name_gives_the_runbook_its_digest_and_playbooks() -> None:
    loaded = api.load("example-label-and-file", REPO / "runbooks")
    assert loaded.name == "example-label-and-file"
    assert len(loaded.digest) == 64
    assert loaded.playbooks_dir == (REPO / "playbooks").resolve()
    with pytest.raises(LoadError):
        api.load("no-such-runbook", REPO / "runbooks")


def test_prepare_run_validates_params_before_anything_runs() -> None:
    loaded = api.load("example-label-and-file", REPO / "runbooks")
    assert api.prepare_run(loaded, [], node="omen2").params["value"] == "done"
    with pytest.raises(UsageError, match="not a valid node name"):
        api.prepare_run(loaded, [], node="omen2; rm -rf /")
    with pytest.raises(UsageError, match="unknown param 'colour'"):
        api.prepare_run(loaded, ["colour=red"], node="omen2")
    with pytest.raises(UsageError, match="missing required param node"):
        api.prepare_run(loaded, [])


def _example_lab() -> tuple[FakeClock, FakeKube, FakeNodes]:
    clock = FakeClock()
    kube = FakeKube([make_node("omen2"), make_node("omen3")], clock=clock)
    nodes = FakeNodes({"omen2": make_host("omen2"), "omen3": make_host("omen3")}, clock=clock)

    def touch(fn: FakeNodes, node: str, ev: Any) -> None:
        fn.files.setdefault(node, {})[ev["marker_path"]] = f"marker={ev['marker_content']}\n"

    nodes.effects["example-touch-file.yml"] = touch
    return clock, kube, nodes


def test_the_example_plans_with_previews_and_runs_both_changes() -> None:
    clock, kube, nodes = _example_lab()
    loaded = api.load("example-label-and-file", REPO / "runbooks")
    prepared = api.prepare_run(loaded, ["value=ok1"], node="omen2")
    plan = api.plan(prepared, kube, nodes, now=NOW)
    assert plan.state is PlanState.READY
    assert [s.kind for s in plan.steps] == ["change", "change"]
    assert plan.step("label-node").preview.startswith("server dry-run accepted")
    assert plan.step("touch-file").preview.startswith("check mode")
    assert kube.patches == [] and [r["check"] for r in nodes.runs] == [True]  # the plan changed nothing
    sink = RecordingSink()
    result = api.run(prepared, plan, kube, nodes, events=sink, cancel=threading.Event(), clock=clock,
                     sleep=clock.sleep, wall=clock.wall)
    assert result.state is RunState.SUCCEEDED, result.reason
    assert kube.nodes["omen2"].labels["runbook.example/marker"] == "ok1"
    assert nodes.files["omen2"]["/var/tmp/runbook-example"] == "marker=ok1\n"
    assert nodes.runs[-1]["extravars"]["runbook_files"] == ["/var/tmp/runbook-example"]
    again = api.plan(prepared, kube, nodes, now=NOW)
    assert again.state is PlanState.NOTHING_TO_DO


def test_a_saved_plan_round_trips_and_refuses_to_apply_after_drift(tmp_path: Path) -> None:
    clock = FakeClock()
    kube = FakeKube([incident_node()], clock=clock)
    nodes = FakeNodes({"omen2": incident_host()}, clock=clock)
    install_recovery_effects(kube, nodes)
    loaded = api.load(DATA / "runbooks" / "gpu-recovery.yaml", playbooks_dir=DATA / "playbooks")
    prepared = api.prepare_run(loaded, [], node="omen2")
    plan = api.plan(prepared, kube, nodes, now=NOW, preview=False)
    api.save_plan(plan, tmp_path / "plan.json")
    saved = api.load_plan(tmp_path / "plan.json")
    assert saved == plan
    problems, again = api.check_saved_plan(saved, loaded, kube, nodes, now=NOW + timedelta(minutes=1))
    assert problems == [] and again.params == prepared.params
    kube.set_label("omen2", GPU_LABEL, "container")
    problems, _ = api.check_saved_plan(saved, loaded, kube, nodes, now=NOW + timedelta(minutes=1))
    assert f"node omen2 label {GPU_LABEL}: planned vm-passthrough, now container" in problems


def test_a_plan_file_that_is_not_a_plan_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "p.json").write_text('{"runbook": 1}')
    with pytest.raises(LoadError):
        api.load_plan(tmp_path / "p.json")


def test_a_fleet_is_planned_with_one_host_facts_run() -> None:
    kube = FakeKube([incident_node("omen2"), healthy_node("omen1")])
    nodes = FakeNodes({"omen2": incident_host("omen2"), "omen1": healthy_host("omen1")})
    loaded = api.load(DATA / "runbooks" / "gpu-recovery.yaml", playbooks_dir=DATA / "playbooks")
    prepared = api.prepare_fleet(loaded, [], api.select_nodes(kube, ""))
    plans = api.plan_fleet(prepared, kube, nodes, now=NOW, preview=False)
    assert [(p.node, p.state) for p in plans] == [("omen1", PlanState.NOTHING_TO_DO), ("omen2", PlanState.READY)]
    assert len(nodes.gathers) == 1 and sorted(nodes.gathers[0][0]) == ["omen1", "omen2"]


def test_a_fleet_rolls_out_in_batches_and_stops_at_the_first_failed_batch() -> None:
    clock = FakeClock()
    names = ["omen1", "omen2", "omen3", "omen4", "omen5"]
    kube = FakeKube([incident_node(n) for n in names], clock=clock)
    nodes = FakeNodes({n: incident_host(n) for n in names}, clock=clock)
    nodes.hosts["omen4"] = make_host("omen4", kubelet="failed", journal="other cause")  # omen4 is refused
    install_recovery_effects(kube, nodes)
    loaded = api.load(DATA / "runbooks" / "gpu-recovery.yaml", playbooks_dir=DATA / "playbooks")
    prepared = api.prepare_fleet(loaded, [], names)
    plans = api.plan_fleet(prepared, kube, nodes, now=NOW, preview=False)
    sinks = {n: RecordingSink() for n in names}
    lock = threading.Lock()

    def run_one(p: api.PreparedRun, pl: Any, sink: Any) -> Any:
        with lock:  # the fake clock is shared: keep the runs of a batch from interleaving on it
            return api.run(p, pl, kube, nodes, events=sink, clock=clock, sleep=clock.sleep, wall=clock.wall)

    results = api.run_fleet(list(zip(prepared, plans, strict=True)), kube, nodes, events_for=sinks.__getitem__,
                            max_parallel=2, settle=30.0, sleep=clock.sleep, run_one=run_one)
    assert [(r.node, r.state) for r in results] == [
        ("omen1", RunState.SUCCEEDED), ("omen2", RunState.SUCCEEDED), ("omen3", RunState.SUCCEEDED),
        ("omen4", RunState.BLOCKED)]
    assert sinks["omen5"].events == []  # never started
    assert 30.0 in clock.sleeps
