"""The run service's road, end to end on the fakes: load, params, plan (one node or many), saved plans."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from engine.errors import LoadError, UsageError
from engine.execution import Executor
from engine.loader import load, load_plan, save_plan
from engine.model import PlanState, RunState
from engine.params import prepare_fleet, prepare_run
from engine.previews import start_host_work
from engine.runs import check_saved_plan, plan_targets, select_nodes
from tests.fakes import (
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

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"
NOW = datetime(2026, 7, 10, 15, 40, tzinfo=UTC)


def test_load_by_name_gives_the_runbook_its_digest_and_playbooks() -> None:
    loaded = load("example-label-and-file", REPO / "runbooks")
    assert loaded.name == "example-label-and-file"
    assert len(loaded.digest) == 64
    assert loaded.playbooks_dir == (REPO / "playbooks").resolve()
    with pytest.raises(LoadError):
        load("no-such-runbook", REPO / "runbooks")


def test_prepare_run_validates_params_before_anything_runs() -> None:
    loaded = load("example-label-and-file", REPO / "runbooks")
    assert prepare_run(loaded, [], node="omen2").params["value"] == "done"
    with pytest.raises(UsageError, match="not a valid node name"):
        prepare_run(loaded, [], node="omen2; rm -rf /")
    with pytest.raises(UsageError, match="unknown param 'colour'"):
        prepare_run(loaded, ["colour=red"], node="omen2")
    with pytest.raises(UsageError, match="missing required param node"):
        prepare_run(loaded, [])


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
    loaded = load("example-label-and-file", REPO / "runbooks")
    prepared = prepare_run(loaded, ["value=ok1"], node="omen2")
    plan = plan_targets([prepared], kube, nodes, now=NOW)[0]
    assert plan.state is PlanState.READY
    assert [s.kind for s in plan.steps] == ["change", "change"]
    assert plan.step("label-node").preview.startswith("server dry-run accepted")
    assert plan.step("touch-file").preview.startswith("check mode")
    assert kube.patches == [] and [r["check"] for r in nodes.runs] == [True]  # the plan changed nothing
    sink = RecordingSink()
    result = Executor(kube, nodes, events=sink, playbooks_dir=prepared.loaded.playbooks_dir,
                      cancel=threading.Event(), clock=clock, sleep=clock.sleep, wall=clock.wall,
                      ).execute(plan, prepared.runbook, prepared.params)
    assert result.state is RunState.SUCCEEDED, result.reason
    assert kube.nodes["omen2"].labels["runbook.example/marker"] == "ok1"
    assert nodes.files["omen2"]["/var/tmp/runbook-example"] == "marker=ok1\n"
    assert nodes.runs[-1]["extravars"]["runbook_files"] == ["/var/tmp/runbook-example"]
    again = plan_targets([prepared], kube, nodes, now=NOW)[0]
    assert again.state is PlanState.NOTHING_TO_DO


def test_a_saved_plan_round_trips_and_refuses_to_apply_after_drift(tmp_path: Path) -> None:
    clock = FakeClock()
    kube = FakeKube([incident_node()], clock=clock)
    nodes = FakeNodes({"omen2": incident_host()}, clock=clock)
    install_recovery_effects(kube, nodes)
    loaded = load(DATA / "runbooks" / "gpu-recovery.yaml", playbooks_dir=DATA / "playbooks")
    prepared = prepare_run(loaded, [], node="omen2")
    plan = plan_targets([prepared], kube, nodes, now=NOW, preview=False)[0]
    save_plan(plan, tmp_path / "plan.json")
    saved = load_plan(tmp_path / "plan.json")
    assert saved == plan
    problems, again = check_saved_plan(saved, loaded, kube, nodes, now=NOW + timedelta(minutes=1))
    assert problems == [] and again.params == prepared.params
    kube.set_label("omen2", GPU_LABEL, "container")
    problems, _ = check_saved_plan(saved, loaded, kube, nodes, now=NOW + timedelta(minutes=1))
    assert f"node omen2 label {GPU_LABEL}: planned vm-passthrough, now container" in problems


def test_a_plan_file_that_is_not_a_plan_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "p.json").write_text('{"runbook": 1}')
    with pytest.raises(LoadError):
        load_plan(tmp_path / "p.json")


def test_a_fleet_is_planned_with_one_host_facts_run_and_the_real_inventory_in_its_commands() -> None:
    kube = FakeKube([incident_node("omen2"), healthy_node("omen1")])
    nodes = FakeNodes({"omen2": incident_host("omen2"), "omen1": healthy_host("omen1")})
    loaded = load(DATA / "runbooks" / "gpu-recovery.yaml", playbooks_dir=DATA / "playbooks")
    prepared = prepare_fleet(loaded, [], select_nodes(kube, ""))
    plans = plan_targets(prepared, kube, nodes, now=NOW, preview=False, inventory_cmd_hint="hosts.yml")
    assert [(p.node, p.state) for p in plans] == [("omen1", PlanState.NOTHING_TO_DO), ("omen2", PlanState.READY)]
    assert len(nodes.gathers) == 1 and sorted(nodes.gathers[0][0]) == ["omen1", "omen2"]
    commands = [s.command for p in plans for s in p.steps if "ansible-playbook" in s.command]
    assert commands and all("-i hosts.yml" in c and "INVENTORY" not in c for c in commands)


def test_the_fleets_host_facts_run_starts_before_the_kubernetes_client_is_needed() -> None:
    kube = FakeKube([incident_node("omen2"), healthy_node("omen1")])
    nodes = FakeNodes({"omen2": incident_host("omen2"), "omen1": healthy_host("omen1")})
    loaded = load(DATA / "runbooks" / "gpu-recovery.yaml", playbooks_dir=DATA / "playbooks")
    prepared = prepare_fleet(loaded, [], ["omen1", "omen2"])
    work = start_host_work(prepared, nodes, preview=False)
    assert work.facts is not None and work.previews is None  # one facts run for the fleet, started now
    plans = plan_targets(prepared, kube, nodes, now=NOW, preview=False, host_work=work)
    assert [p.state for p in plans] == [PlanState.NOTHING_TO_DO, PlanState.READY]
    assert len(nodes.gathers) == 1 and sorted(nodes.gathers[0][0]) == ["omen1", "omen2"]  # not run again
