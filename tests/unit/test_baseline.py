"""``baseline``: the facts a plan was made from, kept in the plan, compared with at run time.

"No host CUDA job killed" is the reason it exists: a verification that needs "before" as well as
"now". Plans keep a baseline only when a runbook reads it; planning stays pure; a saved plan whose
baseline no longer holds is stale like any other drift.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from engine import checks as chk
from engine import probes
from engine.checks import CudaProcessesCheck, CudaProcessesSpec, ExprCheck
from engine.execution import Executor
from engine.facts import CudaProcess, Facts
from engine.loader import parse_runbook
from engine.model import (
    Plan,
    PlanState,
    Runbook,
    RunState,
    StepStatus,
)
from engine.planning import plan_run, reads_baseline, saved_plan_problems
from engine.templating import TemplateError, baseline_data, baseline_paths, context, render, template_problems
from tests.fakes import (
    FakeClock,
    FakeKube,
    FakeNodes,
    RecordingSink,
    incident_host,
    incident_node,
    install_recovery_effects,
    make_host,
)

DATA = Path(__file__).parent / "data"
PLAYBOOKS = DATA / "playbooks"
NOW = datetime(2026, 7, 10, 15, 40, tzinfo=UTC)

RECOVERY = b"""apiVersion: runbook/v1
name: recovery
version: "1"
params:
  node: {type: node, required: true}
steps:
  - id: swap-off
    action: {ansible: {playbook: swap-off.yml}}
    skip_if: [{swap_active: false}]
    verify: [{check: {swap_active: false}}]
  - id: restart-kubelet
    requires: [swap-off]
    action: {ansible: {playbook: restart-kubelet.yml}}
    skip_if:
      - {service: {name: kubelet, state: active}}
      - {cuda_processes: {none_killed: true}}
    verify:
      - check: {service: {name: kubelet, state: active}}
      - check: {cuda_processes: {none_killed: true}}
        timeout: 10s
report: "CUDA jobs {{ baseline.host.cuda_process_count }} -> {{ facts.host.cuda_process_count }}"
"""

EXPR = b"""apiVersion: runbook/v1
name: counting
version: "1"
params:
  node: {type: node, required: true}
steps:
  - id: restart-kubelet
    action: {ansible: {playbook: restart-kubelet.yml}}
    verify:
      - check: {expr: "facts.host.cuda_process_count >= baseline.host.cuda_process_count"}
        timeout: 10s
"""

PLAIN = b"""apiVersion: runbook/v1
name: plain
version: "1"
params:
  node: {type: node, required: true}
steps:
  - id: restart-kubelet
    action: {ansible: {playbook: restart-kubelet.yml}}
    verify: [{check: {service: {name: kubelet, state: active}}}]
"""


def runbook(text: bytes, name: str) -> Runbook:
    return parse_runbook(text, f"{name}.yaml", playbooks_dir=PLAYBOOKS)


def host_with_jobs(*pids: int, **kw: Any) -> Any:
    from dataclasses import replace

    return replace(make_host(**kw), cuda_processes=tuple(CudaProcess(p, "python3") for p in pids))


class Lab:
    def __init__(self, host: Any) -> None:
        self.clock = FakeClock()
        self.kube = FakeKube([incident_node()], clock=self.clock)
        self.nodes = FakeNodes({"omen2": host}, clock=self.clock)
        self.sink = RecordingSink()

    def facts(self, rb: Runbook) -> Facts:
        return probes.gather(rb, {"node": "omen2"}, "omen2", self.kube, self.nodes, clock=self.clock.wall)

    def plan(self, rb: Runbook) -> Plan:
        return plan_run(rb, {"node": "omen2"}, self.facts(rb), runbook_digest="d" * 64, now=NOW)

    def execute(self, rb: Runbook, plan: Plan | None = None) -> Any:
        executor = Executor(self.kube, self.nodes, events=self.sink, playbooks_dir=PLAYBOOKS, clock=self.clock,
                            sleep=self.clock.sleep, wall=self.clock.wall, cancel=threading.Event())
        return executor.execute(plan or self.plan(rb), rb, {"node": "omen2"})


# -- templates -----------------------------------------------------------------------------------


def test_templates_see_the_baseline_beside_the_facts() -> None:
    before = Facts(node_name="omen2", host=host_with_jobs(41, 42))
    now = Facts(node_name="omen2", host=host_with_jobs(42))
    ctx = context({}, now, baseline_data(before))
    assert render("{{ baseline.host.cuda_process_count }} -> {{ facts.host.cuda_process_count }}", ctx) == "2 -> 1"


def test_a_template_reading_a_missing_baseline_fails_instead_of_guessing() -> None:
    with pytest.raises(TemplateError, match="undefined"):
        render("{{ baseline.host.cuda_process_count }}", context({}, Facts(node_name="omen2")))


def test_the_baseline_is_read_only() -> None:
    ctx = context({}, None, baseline_data(Facts(node_name="omen2", host=host_with_jobs(1))))
    with pytest.raises(TemplateError):
        render("{{ baseline.host.cuda_processes.append(1) }}", ctx)


def test_load_time_checks_accept_baseline_roots_and_refuse_unknown_ones() -> None:
    assert template_problems("{{ baseline.host.gpu_driver }} {{ baseline.node.ready }}", params={}) == []
    problems = template_problems("{{ baseline.objects }}", params={})
    assert problems and "unknown baseline fact 'objects'" in problems[0]


def test_baseline_paths_are_the_longest_constant_paths_a_template_reads() -> None:
    src = "baseline.host.cuda_processes | rejectattr('pid', 'in', facts.host.cuda_processes) | list"
    assert baseline_paths(src, expression=True) == {("host", "cuda_processes")}
    assert baseline_paths("{{ baseline.node.labels['k'] }} {{ baseline.host.swap_active }}") == {
        ("node", "labels", "k"), ("host", "swap_active")}


# -- the none_killed check ------------------------------------------------------------------------


def none_killed() -> CudaProcessesCheck:
    return CudaProcessesCheck(cuda_processes=CudaProcessesSpec(none_killed=True))


def test_none_killed_holds_while_every_baseline_process_still_runs() -> None:
    base = baseline_data(Facts(node_name="omen2", host=host_with_jobs(41)))
    r = chk.evaluate(none_killed(), Facts(node_name="omen2", host=host_with_jobs(41, 77)), baseline=base)
    assert r.holds is True and "all 1 from the plan still run" in r.observed


def test_none_killed_fails_naming_the_process_that_is_gone_even_when_another_replaced_it() -> None:
    base = baseline_data(Facts(node_name="omen2", host=host_with_jobs(41)))
    r = chk.evaluate(none_killed(), Facts(node_name="omen2", host=host_with_jobs(77)), baseline=base)
    assert r.holds is False
    assert r.observed == "CUDA processes gone since the plan: 41 python3"
    assert r.evidence["killed"] == ["41 python3"]


def test_none_killed_is_unknown_without_a_baseline_or_without_host_facts() -> None:
    assert chk.evaluate(none_killed(), Facts(node_name="omen2", host=host_with_jobs(41))).holds is None
    base = baseline_data(Facts(node_name="omen2", host=host_with_jobs(41)))
    assert chk.evaluate(none_killed(), Facts(node_name="omen2"), baseline=base).holds is None


def test_none_killed_describes_itself_for_plans() -> None:
    assert chk.describe(none_killed()) == "no host CUDA process killed since the plan"


def test_an_expr_check_compares_facts_with_the_baseline() -> None:
    check = ExprCheck(expr="facts.host.cuda_process_count >= baseline.host.cuda_process_count")
    base = baseline_data(Facts(node_name="omen2", host=host_with_jobs(1, 2)))
    assert chk.evaluate(check, Facts(node_name="omen2", host=host_with_jobs(1, 2)), baseline=base).holds is True
    assert chk.evaluate(check, Facts(node_name="omen2", host=host_with_jobs(1)), baseline=base).holds is False
    assert chk.evaluate(check, Facts(node_name="omen2", host=host_with_jobs(1))).holds is None  # fail closed


def test_prediction_never_assumes_a_baseline_comparison() -> None:
    facts = Facts(node_name="omen2", host=host_with_jobs(41))
    base = baseline_data(facts)
    assert chk.establish(none_killed(), facts, baseline=base) == facts
    assert chk.establish(ExprCheck(expr="baseline.host.swap_active"), facts, baseline=base) == facts


# -- planning --------------------------------------------------------------------------------------


def test_a_plan_keeps_a_baseline_only_when_the_runbook_reads_it() -> None:
    lab = Lab(incident_host())
    assert reads_baseline(runbook(RECOVERY, "recovery")) and reads_baseline(runbook(EXPR, "counting"))
    assert not reads_baseline(runbook(PLAIN, "plain"))
    assert lab.plan(runbook(PLAIN, "plain")).baseline == {}
    plan = lab.plan(runbook(RECOVERY, "recovery"))
    assert plan.baseline["node_name"] == "omen2"
    assert plan.baseline["host"]["swap_active"] is True and "objects" not in plan.baseline


def test_the_baseline_is_the_gathered_facts_not_the_prediction() -> None:
    lab = Lab(host_with_jobs(41, swap=True, kubelet="activating"))
    plan = lab.plan(runbook(RECOVERY, "recovery"))
    assert plan.baseline["host"]["swap_active"] is True  # swap-off's prediction did not leak into it
    assert plan.step("restart-kubelet").kind == "change"


def test_the_baseline_paths_checks_read_are_recorded_as_dependencies() -> None:
    lab = Lab(host_with_jobs(41, kubelet="activating"))
    plan = lab.plan(runbook(RECOVERY, "recovery"))
    assert plan.depends_on["baseline.host.cuda_processes"] == [41]
    plan2 = Lab(host_with_jobs(41, 42)).plan(runbook(EXPR, "counting"))
    assert plan2.depends_on["baseline.host.cuda_process_count"] == 2


def test_a_saved_plan_whose_baseline_moved_on_is_stale() -> None:
    rb = runbook(RECOVERY, "recovery")
    saved = Lab(host_with_jobs(41, kubelet="activating")).plan(rb)
    fresh = Lab(host_with_jobs(99, kubelet="activating")).plan(rb)
    problems = saved_plan_problems(saved, runbook_digest="d" * 64, now=NOW + timedelta(minutes=1), fresh=fresh)
    assert problems == ["host of omen2: cuda_processes (the plan's baseline): planned [41], now [99]"]


def test_the_baseline_is_part_of_what_the_digest_seals() -> None:
    plan = Lab(host_with_jobs(41)).plan(runbook(RECOVERY, "recovery"))
    forged = plan.model_copy(update={"baseline": {**plan.baseline, "host": None}})
    assert forged.compute_digest() != plan.digest


# -- execution -------------------------------------------------------------------------------------


def test_execution_verifies_against_the_plan_baseline_and_passes_when_the_job_survives() -> None:
    lab = Lab(host_with_jobs(41, swap=True, fstab_swap=True, kubelet="activating"))
    install_recovery_effects(lab.kube, lab.nodes, ready_after=None, gpu_after=None)
    rb = runbook(RECOVERY, "recovery")
    result = lab.execute(rb)
    assert result.state is RunState.SUCCEEDED, result.reason
    assert result.outcomes[-1].status is StepStatus.SUCCEEDED
    checks = [v["check"] for v in result.outcomes[-1].evidence["verify"]]
    assert "no host CUDA process killed since the plan" in checks
    assert result.report == "CUDA jobs 1 -> 1"


def test_execution_fails_the_step_when_a_host_cuda_job_was_killed() -> None:
    lab = Lab(host_with_jobs(41, swap=True, fstab_swap=True, kubelet="activating"))
    install_recovery_effects(lab.kube, lab.nodes, ready_after=None, gpu_after=None)
    restart = lab.nodes.effects["restart-kubelet.yml"]

    def restart_and_kill(fn: FakeNodes, node: str, evars: Any) -> Any:
        out = restart(fn, node, evars)
        fn.update(node, cuda_processes=())  # vfio-pci rebind: the job lost its GPU
        return out

    lab.nodes.effects["restart-kubelet.yml"] = restart_and_kill
    result = lab.execute(runbook(RECOVERY, "recovery"))
    assert result.state is RunState.FAILED and result.exit_code == 1
    last = result.outcomes[-1]
    assert last.step == "restart-kubelet" and last.status in (StepStatus.FAILED, StepStatus.TIMED_OUT)
    assert "CUDA processes gone since the plan: 41 python3" in last.reason
    assert result.report == "CUDA jobs 1 -> 0"


def test_a_step_is_not_skipped_as_done_when_a_job_was_killed_meanwhile() -> None:
    clock = FakeClock()
    kube = FakeKube([incident_node()], clock=clock)
    nodes = FakeNodes({"omen2": host_with_jobs(41, kubelet="active")}, clock=clock)
    rb = runbook(RECOVERY, "recovery")
    plan = plan_run(rb, {"node": "omen2"}, probes.gather(rb, {"node": "omen2"}, "omen2", kube, nodes),
                    runbook_digest="d" * 64, now=NOW)
    assert plan.state is PlanState.NOTHING_TO_DO
    nodes.update("omen2", cuda_processes=())  # the job died between plan and run
    executor = Executor(kube, nodes, events=RecordingSink(), playbooks_dir=PLAYBOOKS, clock=clock,
                        sleep=clock.sleep, wall=clock.wall, cancel=threading.Event())
    result = executor.execute(plan, rb, {"node": "omen2"})
    assert result.state is RunState.BLOCKED  # planned as no-op, but live facts show work: make a new plan
    assert "CUDA processes gone since the plan" in result.outcomes[-1].reason
