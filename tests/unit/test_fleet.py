"""Fleets through the run service (``RunService.run_targets``), on our fakes: blocked nodes are
reported and left untouched, nodes with nothing to do are reported as such, the others run in
rolling batches whose playbook steps are one Ansible run over the batch's hosts; ``--max-failures``,
``--fail-fast``, cancellation, the run guards and the closing summary with its exit code."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine import app
from engine.connectors.base import PlaybookResult
from engine.errors import ExitCode, UsageError
from engine.model import Plan, PlanState, RunState
from engine.params import PreparedRun
from engine.run_guards import EXCLUDE_LABEL, GpuBudget, GuardConfig
from engine.runs import FleetResult, NodeOutcome, RunService, current_user
from engine.settings import Settings
from tests.fakes import (
    GPU_LABEL,
    FakeClock,
    FakeKube,
    FakeNodes,
    healthy_host,
    healthy_node,
    incident_host,
    incident_node,
    install_recovery_effects,
    make_host,
)

DATA = Path(__file__).parent / "data"
RUNBOOK = DATA / "runbooks" / "gpu-recovery.yaml"
NO_BUDGET = GuardConfig(gpu_budget=GpuBudget(max_percent=None))


@dataclass
class Fleet:
    clock: FakeClock
    kube: FakeKube
    nodes: FakeNodes
    service: RunService

    def targets(self, names: list[str]) -> list[PreparedRun]:
        every = self.service.targets(str(RUNBOOK), [], selector="")
        return [t for t in every if t.node in names] if names else every

    def plan(self, names: list[str] | None = None) -> tuple[list[PreparedRun], list[Plan]]:
        targets = self.targets(names or [])
        return targets, self.service.plan_targets(targets, preview=False)

    def playbook_runs(self, playbook: str) -> list[list[str]]:
        """The nodes of each real (not check-mode) run of ``playbook``, in order."""
        return [r["nodes"] for r in self.nodes.runs if r["playbook"] == playbook and not r["check"]]

    def patched(self) -> set[str]:
        return {name for name, _, _ in self.kube.patches}


def _fleet(tmp_path: Path, *, broken: list[str], healthy: list[str] = (),  # type: ignore[assignment]
           other_cause: list[str] = (), excluded: list[str] = (),  # type: ignore[assignment]
           guards: GuardConfig = NO_BUDGET) -> Fleet:
    clock = FakeClock()
    kube_nodes = [incident_node(n) for n in [*broken, *other_cause]] + [healthy_node(n) for n in healthy]
    kube = FakeKube(kube_nodes, clock=clock)
    hosts = {n: incident_host(n) for n in broken}
    hosts.update({n: healthy_host(n) for n in healthy})
    hosts.update({n: make_host(n, kubelet="failed", journal="containerd.sock: no such file") for n in other_cause})
    nodes = FakeNodes(hosts, clock=clock)
    install_recovery_effects(kube, nodes, ready_after=0.0, gpu_after=0.0)
    for n in excluded:
        kube.set_label(n, EXCLUDE_LABEL, "true")
    settings = Settings(journal=tmp_path / "journal.sqlite", inventory=tmp_path / "hosts.yml")
    settings._cache.update(kube=kube, nodes=nodes)  # our fakes instead of the real connectors
    service = RunService(settings, guards=guards, gather_window=30.0,  # a loaded machine: wait for all
                         executor_options={"clock": clock, "sleep": clock.sleep, "wall": clock.wall})
    return Fleet(clock, kube, nodes, service)


@pytest.fixture
def mixed(tmp_path: Path) -> Iterator[Fleet]:
    """gpu-1..3 down because of swap, gpu-4 down for another cause, gpu-5 healthy, gpu-6 excluded."""
    fleet = _fleet(tmp_path, broken=["gpu-1", "gpu-2", "gpu-3", "gpu-6"], other_cause=["gpu-4"],
                   healthy=["gpu-5"], excluded=["gpu-6"])
    yield fleet
    fleet.service.journal.close()


def _rows(result: FleetResult) -> dict[str, str]:
    return {r.node: r.outcome for r in result.runs}


def test_blocked_nodes_are_reported_and_untouched_while_the_others_recover_in_batches(mixed: Fleet) -> None:
    targets, plans = mixed.plan()
    result = mixed.service.run_targets(targets, plans, max_parallel=2)
    assert _rows(result) == {"gpu-1": "succeeded", "gpu-2": "succeeded", "gpu-3": "succeeded",
                             "gpu-4": "blocked", "gpu-5": "nothing-to-do", "gpu-6": "blocked"}
    assert result.exit_code == ExitCode.BLOCKED  # none failed, some blocked
    reasons = {r.node: r.reason for r in result.runs}
    assert "down-only-for-swap" in reasons["gpu-4"] or "not because of swap" in reasons["gpu-4"]
    assert "guard exclusion" in reasons["gpu-6"] and f"{EXCLUDE_LABEL}=true" in reasons["gpu-6"]
    # untouched: no patch, no playbook on the blocked nodes or the healthy one
    assert mixed.patched() == {"gpu-1", "gpu-2", "gpu-3"}
    touched = {n for r in mixed.nodes.runs if not r["check"] for n in r["nodes"]}
    assert touched == {"gpu-1", "gpu-2", "gpu-3"}
    # every node has a journaled run with its state
    journal = mixed.service.journal
    states = {r.node: journal.get_run(r.run_id).state for r in result.runs if r.run_id}
    assert states == {"gpu-1": "succeeded", "gpu-2": "succeeded", "gpu-3": "succeeded", "gpu-4": "blocked",
                      "gpu-5": "succeeded", "gpu-6": "blocked"}


def test_each_batch_runs_a_playbook_step_as_one_ansible_run_over_its_hosts(mixed: Fleet) -> None:
    targets, plans = mixed.plan()
    planned = len(mixed.nodes.gathers)
    mixed.service.run_targets(targets, plans, max_parallel=2)
    assert mixed.playbook_runs("swap-off.yml") == [["gpu-1", "gpu-2"], ["gpu-3"]]
    assert mixed.playbook_runs("restart-kubelet.yml") == [["gpu-1", "gpu-2"], ["gpu-3"]]
    # the runs' own host-facts requests are shared within a batch too
    assert [sorted(g[0]) for g in mixed.nodes.gathers[planned:]] == [["gpu-1", "gpu-2"]] * 2 + [["gpu-3"]] * 2


def test_a_host_failing_in_the_shared_run_fails_only_its_own_node(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, broken=["gpu-1", "gpu-2", "gpu-3", "gpu-4"])
    plain = fleet.nodes.effects["swap-off.yml"]

    def swap_off_fails_on_gpu_2(fn: FakeNodes, node: str, ev: Mapping[str, Any]) -> PlaybookResult | None:
        if node == "gpu-2":
            return PlaybookResult(status="failed", rc=2, failed_hosts={"gpu-2": "swapoff: /swapfile: busy"})
        return plain(fn, node, ev)

    fleet.nodes.effects["swap-off.yml"] = swap_off_fails_on_gpu_2
    targets, plans = fleet.plan()
    result = fleet.service.run_targets(targets, plans, max_parallel=2)
    assert _rows(result) == {"gpu-1": "succeeded", "gpu-2": "failed", "gpu-3": "not-started",
                             "gpu-4": "not-started"}  # --max-failures 1: no new batch after gpu-2
    assert fleet.playbook_runs("swap-off.yml") == [["gpu-1", "gpu-2"]]  # one process for the batch
    assert fleet.playbook_runs("restart-kubelet.yml") == [["gpu-1"]]  # gpu-2 stopped at its failure
    assert "busy" in next(r.reason for r in result.runs if r.node == "gpu-2")
    assert result.exit_code == ExitCode.FAILED
    assert result.summary()["failed"] == 1 and result.summary()["not-started"] == 2


def test_a_slow_host_timing_out_the_shared_run_fails_only_its_own_node(tmp_path: Path) -> None:
    # One process for the batch; gpu-2's host hangs until the run's timeout kills it. gpu-1's host went
    # through the whole play (it published its closing facts, free strategy): gpu-1 goes on.
    fleet = _fleet(tmp_path, broken=["gpu-1", "gpu-2"])
    plain = fleet.nodes.effects["swap-off.yml"]

    def swap_off_hangs_on_gpu_2(fn: FakeNodes, node: str, ev: Mapping[str, Any]) -> PlaybookResult | None:
        if node != "gpu-2":
            return plain(fn, node, ev)
        done = fn._facts("gpu-1", [])
        assert not isinstance(done, Exception)
        return PlaybookResult(status="timeout", rc=254, changed={"gpu-1": True}, host_facts={"gpu-1": done})

    fleet.nodes.effects["swap-off.yml"] = swap_off_hangs_on_gpu_2
    targets, plans = fleet.plan()
    result = fleet.service.run_targets(targets, plans, max_parallel=2, max_failures=2)
    assert fleet.playbook_runs("swap-off.yml") == [["gpu-1", "gpu-2"]]  # one process for the batch
    assert _rows(result) == {"gpu-1": "succeeded", "gpu-2": "failed"}
    assert fleet.playbook_runs("restart-kubelet.yml") == [["gpu-1"]]


def test_split_result_gives_a_node_whose_host_finished_its_play_its_own_outcome() -> None:
    from engine.batch import split_result

    host = make_host
    timed_out = PlaybookResult(status="timeout", rc=254, changed={"a": True}, host_facts={"a": host("a")})
    assert (split_result(timed_out, "a", "a").status, split_result(timed_out, "a", "a").rc) == ("successful", 0)
    assert split_result(timed_out, "b", "b").status == "timeout"  # the slow one: no closing facts
    failed = PlaybookResult(status="timeout", rc=254, failed_hosts={"a": "a: boom"}, host_facts={"a": host("a")})
    assert split_result(failed, "a", "a").status == "timeout"  # a failure stays its own
    cancelled = PlaybookResult(status="canceled", rc=254, host_facts={"a": host("a")})
    assert split_result(cancelled, "a", "a").status == "canceled"  # the operator's stop is everyone's


def test_a_batch_runs_all_its_hosts_at_once_and_a_fleets_facts_at_most_forks_at_a_time() -> None:
    from engine.connectors.ansible import run_forks

    assert run_forks(20, 10, read_only=False) == 20  # a rolling batch of 20: forks >= the batch
    assert run_forks(100, 10, read_only=True) == 10  # the plan's facts over a fleet
    assert run_forks(3, 10, read_only=True) == 3 and run_forks(1, 10, read_only=False) == 1


def test_max_failures_lets_the_rollout_continue_until_that_many_nodes_failed(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, broken=["gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5"])
    plain = fleet.nodes.effects["swap-off.yml"]

    def fails_on(fn: FakeNodes, node: str, ev: Mapping[str, Any]) -> PlaybookResult | None:
        if node in ("gpu-1", "gpu-3"):
            return PlaybookResult(status="failed", rc=2, failed_hosts={node: "swapoff failed"})
        return plain(fn, node, ev)

    fleet.nodes.effects["swap-off.yml"] = fails_on
    targets, plans = fleet.plan()
    result = fleet.service.run_targets(targets, plans, max_parallel=1, max_failures=2)
    assert _rows(result) == {"gpu-1": "failed", "gpu-2": "succeeded", "gpu-3": "failed", "gpu-4": "not-started",
                             "gpu-5": "not-started"}
    assert result.exit_code == ExitCode.FAILED


def test_fail_fast_refuses_the_whole_fleet_when_any_plan_is_blocked(mixed: Fleet) -> None:
    targets, plans = mixed.plan()
    result = mixed.service.run_targets(targets, plans, max_parallel=2, fail_fast=True)
    assert result.exit_code == ExitCode.BLOCKED
    assert mixed.kube.patches == [] and [r for r in mixed.nodes.runs if not r["check"]] == []
    assert _rows(result) == {"gpu-1": "not-started", "gpu-2": "not-started", "gpu-3": "not-started",
                             "gpu-4": "blocked", "gpu-5": "nothing-to-do", "gpu-6": "blocked"}
    assert "--fail-fast" in result.summary()["refused"] and "gpu-4" in result.summary()["refused"]


def test_batches_are_settle_seconds_apart(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, broken=["gpu-1", "gpu-2", "gpu-3"])
    targets, plans = fleet.plan()
    waits: list[float] = []
    result = fleet.service.run_targets(targets, plans, max_parallel=1, settle=30.0, sleep=waits.append)
    assert result.exit_code == ExitCode.OK
    assert waits == [30.0, 30.0]  # between three batches, not before the first


def test_a_cancelled_fleet_starts_no_batch_and_exits_4(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, broken=["gpu-1", "gpu-2"])
    targets, plans = fleet.plan()
    cancel = threading.Event()
    cancel.set()
    result = fleet.service.run_targets(targets, plans, cancel=cancel)
    assert set(_rows(result).values()) == {"cancelled"} and result.exit_code == ExitCode.CANCELLED
    assert fleet.kube.patches == []


def test_the_exit_code_of_a_fleet_follows_its_worst_outcome() -> None:
    def fleet(*outcomes: str, cancelled: bool = False) -> int:
        return FleetResult(tuple(NodeOutcome(f"n{i}", o) for i, o in enumerate(outcomes)), cancelled).exit_code

    assert fleet("succeeded", "nothing-to-do") == 0
    assert fleet("succeeded", "blocked", "failed") == 1
    assert fleet("succeeded", "blocked") == 3
    assert fleet("succeeded", "cancelled") == 4
    assert fleet("blocked", cancelled=True) == 4


def test_the_exclusion_label_blocks_one_node_and_an_override_passes_it_journaled_with_who_and_why(
        tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, broken=["gpu-1"], excluded=["gpu-1"])
    targets, plans = fleet.plan()
    refused = fleet.service.run_targets(targets, plans, execute_nothing_to_do=True)
    assert refused.exit_code == ExitCode.BLOCKED and fleet.kube.patches == []
    assert f"label {EXCLUDE_LABEL}=true" in refused.runs[0].reason
    passed = fleet.service.run_targets(targets, plans, execute_nothing_to_do=True,
                                       overrides={"exclusion": "the owner asked for it in INC-42"})
    assert passed.exit_code == ExitCode.OK, passed.runs[0].reason
    assert fleet.kube.nodes["gpu-1"].labels[GPU_LABEL] == "container"
    run_id = passed.runs[0].run_id
    assert run_id is not None
    overrides = [e.data for e in fleet.service.journal.events(run_id) if e.kind == "guard.override"]
    assert overrides == [{"guard": "exclusion", "by": current_user(), "reason": "the owner asked for it in INC-42",
                          "finding": f"node gpu-1 is excluded from remediation by label {EXCLUDE_LABEL}=true"}]


def test_the_gpu_budget_counts_the_nodes_of_the_running_batch(tmp_path: Path) -> None:
    # Two healthy-looking GPU nodes in service with one GPU each, but their plans change something:
    # at most one GPU out of service at a time, so the batch of two may take only one of them.
    fleet = _fleet(tmp_path, broken=[], guards=GuardConfig(gpu_budget=GpuBudget(max_gpus=1, max_percent=None)))
    for n in ("gpu-1", "gpu-2"):
        fleet.kube.nodes[n] = healthy_node(n)
        fleet.kube.set_label(n, GPU_LABEL, "vm-passthrough")  # relabel-container will change it
        fleet.nodes.hosts[n] = healthy_host(n)
    targets, plans = fleet.plan()
    assert [p.state for p in plans] == [PlanState.READY, PlanState.READY]
    result = fleet.service.run_targets(targets, plans, max_parallel=2)
    rows = _rows(result)
    assert sorted(rows.values()) == ["blocked", "succeeded"], result.runs
    blocked = next(r for r in result.runs if r.outcome == "blocked")
    assert "guard gpu-budget" in blocked.reason


def test_an_unreadable_guard_blocks(tmp_path: Path) -> None:
    from engine.errors import KubeError

    fleet = _fleet(tmp_path, broken=["gpu-1"])
    targets, plans = fleet.plan()
    fleet.kube.fail["list_nodes"] = KubeError("the API server is gone")
    result = fleet.service.run_targets(targets, plans, execute_nothing_to_do=True)
    assert result.exit_code == ExitCode.BLOCKED and fleet.kube.patches == []
    assert "cannot be evaluated" in result.runs[0].reason


def test_overrides_need_a_known_guard_and_a_reason_and_are_never_for_automatic_runs(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, broken=["gpu-1"])
    with pytest.raises(UsageError, match="no such guard"):
        fleet.service.check_overrides({"exclude": "typo"})
    with pytest.raises(UsageError, match="reason"):
        fleet.service.check_overrides({"exclusion": " "})
    fleet.service.automatic = True
    with pytest.raises(UsageError, match="for people"):
        fleet.service.check_overrides({"exclusion": "a page"})


def test_runbook_run_with_a_selector_prints_one_summary_row_per_node_as_json(
        mixed: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    code = app.run(mixed.service.settings, str(RUNBOOK), node=None, selector="", raw_params=[], dry_run=False,
                   yes=True, output="json", max_parallel=2, settle=0.0, lock_wait=0.0)
    assert code == ExitCode.BLOCKED
    doc = json.loads(capsys.readouterr().out)
    assert [(r["node"], r["outcome"]) for r in doc["runs"]] == [
        ("gpu-1", "succeeded"), ("gpu-2", "succeeded"), ("gpu-3", "succeeded"), ("gpu-4", "blocked"),
        ("gpu-5", "nothing-to-do"), ("gpu-6", "blocked")]
    assert all(set(r) >= {"node", "outcome", "run_id", "duration", "reason"} for r in doc["runs"])
    assert doc["summary"] == {"nodes": 6, "succeeded": 3, "blocked": 2, "nothing-to-do": 1, "exit_code": 3}


def test_runbook_run_with_a_selector_ends_with_a_text_summary(
        mixed: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    code = app.run(mixed.service.settings, str(RUNBOOK), node=None, selector="", raw_params=[], dry_run=False,
                   yes=True, output="text", max_parallel=2, settle=0.0, lock_wait=0.0, fail_fast=True)
    assert code == ExitCode.BLOCKED
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = max(i for i, line in enumerate(lines) if line.split()[:2] == ["node", "outcome"])
    assert [line.split()[:2] for line in lines[header + 1:header + 7]] == [
        ["gpu-1", "not-started"], ["gpu-2", "not-started"], ["gpu-3", "not-started"], ["gpu-4", "blocked"],
        ["gpu-5", "nothing-to-do"], ["gpu-6", "blocked"]]
    assert "exit 3" in out and "--fail-fast" in out
    assert mixed.kube.patches == []


def test_a_single_excluded_node_exits_3_naming_the_label(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = _fleet(tmp_path, broken=["gpu-1"], excluded=["gpu-1"])
    code = app.run(fleet.service.settings, str(RUNBOOK), node="gpu-1", selector=None, raw_params=[],
                   dry_run=False, yes=True, output="text", max_parallel=1, settle=0.0, lock_wait=0.0)
    assert code == ExitCode.BLOCKED
    assert f"{EXCLUDE_LABEL}=true" in capsys.readouterr().out
    assert fleet.kube.patches == []
    runs = fleet.service.journal.list_runs()
    assert [r.state for r in runs] == [RunState.BLOCKED.value]


def test_a_node_whose_lease_another_run_holds_is_blocked_while_the_batch_goes_on(tmp_path: Path) -> None:
    from engine.locks import DEFAULT_NAMESPACE, lease_name

    fleet = _fleet(tmp_path, broken=["gpu-1", "gpu-2"])
    fleet.kube.create_lease(DEFAULT_NAMESPACE, lease_name("gpu-2"), "someone-else", 10**9)  # fake wall clock: 2023
    targets, plans = fleet.plan()
    result = fleet.service.run_targets(targets, plans, max_parallel=2)
    assert _rows(result) == {"gpu-1": "succeeded", "gpu-2": "blocked"}
    assert "someone-else" in next(r.reason for r in result.runs if r.node == "gpu-2")
    assert fleet.patched() == {"gpu-1"}
    assert fleet.playbook_runs("swap-off.yml") == [["gpu-1"]]  # gpu-2 left the batch before its turn
    assert result.exit_code == ExitCode.BLOCKED


def test_a_run_with_nothing_to_do_is_not_stopped_by_the_gpu_budget(tmp_path: Path) -> None:
    # gpu-1 is in service and has nothing to do; the budget allows no GPU out of service at all,
    # but re-checking gpu-1 takes no GPU away.
    fleet = _fleet(tmp_path, broken=["gpu-2"], healthy=["gpu-1"],
                   guards=GuardConfig(gpu_budget=GpuBudget(max_gpus=0, max_percent=None)))
    targets, plans = fleet.plan(["gpu-1"])
    assert [p.state for p in plans] == [PlanState.NOTHING_TO_DO]
    result = fleet.service.run_targets(targets, plans, execute_nothing_to_do=True)
    assert _rows(result) == {"gpu-1": "nothing-to-do"}, result.runs
    assert fleet.service.guard_blocks(["gpu-1"])["gpu-1"].startswith("guard gpu-budget")  # were it to change


def test_fail_fast_sees_a_node_the_guards_refuse_before_anything_starts(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, broken=["gpu-1", "gpu-2"], excluded=["gpu-2"])
    targets, plans = fleet.plan()
    assert [p.state for p in plans] == [PlanState.READY, PlanState.READY]  # only a guard refuses gpu-2
    result = fleet.service.run_targets(targets, plans, fail_fast=True)
    assert _rows(result) == {"gpu-1": "not-started", "gpu-2": "blocked"}
    assert fleet.kube.patches == [] and result.exit_code == ExitCode.BLOCKED


def test_the_gpu_budget_stops_a_new_run_but_not_the_resume_of_one_that_started(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, broken=[], guards=GuardConfig(gpu_budget=GpuBudget(max_gpus=0, max_percent=None)))
    fleet.kube.nodes["gpu-1"] = healthy_node("gpu-1")  # in service, one GPU; its plan relabels it
    fleet.kube.set_label("gpu-1", GPU_LABEL, "vm-passthrough")
    fleet.nodes.hosts["gpu-1"] = healthy_host("gpu-1")
    (prep,), (plan,) = fleet.plan()
    assert plan.state is PlanState.READY
    service = fleet.service
    new = service.execute(service.create(prep, plan), prep, plan)
    assert new.state is RunState.BLOCKED and "guard gpu-budget" in new.reason
    assert fleet.kube.patches == []
    run_id = service.create(prep, plan)
    service.journal.set_state(run_id, RunState.INTERRUPTED.value)  # an engine died mid-run
    resumed = service.execute(run_id, prep, plan, resume=True)
    assert resumed.state is RunState.SUCCEEDED, resumed.reason
    assert fleet.kube.nodes["gpu-1"].labels[GPU_LABEL] == "container"
