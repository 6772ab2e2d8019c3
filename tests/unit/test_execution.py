"""Execution: re-check live, write the intent ahead, act, verify on fake time, roll back, stop."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from engine import probes
from engine.connectors.base import PlaybookResult
from engine.errors import HostError, KubeError
from engine.execution import Executor
from engine.facts import HostFacts
from engine.loader import load_runbook, parse_runbook
from engine.model import Plan, PlanState, Runbook, RunResult, RunState, StepStatus
from engine.planning import plan_run
from tests.fakes import (
    GPU_LABEL,
    FakeClock,
    FakeKube,
    FakeNodes,
    GpuHostLog,
    KubeletComeback,
    RecordingSink,
    healthy_host,
    incident_host,
    incident_node,
    install_gpu_host,
    install_recovery_effects,
    make_host,
    make_node,
)

DATA = Path(__file__).parent / "data"
PLAYBOOKS = DATA / "playbooks"
RUNBOOK = load_runbook(DATA / "runbooks" / "gpu-recovery.yaml", playbooks_dir=PLAYBOOKS)
PARAMS: dict[str, Any] = {"node": "omen2", "workload": "container", "ready_timeout": 180}
NOW = datetime(2026, 7, 10, 15, 40, tzinfo=UTC)


@dataclass
class Lab:
    clock: FakeClock
    kube: FakeKube
    nodes: FakeNodes
    sink: RecordingSink
    cancel: threading.Event

    def plan(self, runbook: Runbook = RUNBOOK, params: dict[str, Any] | None = None) -> Plan:
        p = params or PARAMS
        facts = probes.gather(runbook, p, "omen2", self.kube, self.nodes, clock=self.clock.wall)
        return plan_run(runbook, p, facts, runbook_digest="d" * 64, now=NOW)

    def execute(self, plan: Plan | None = None, runbook: Runbook = RUNBOOK, params: dict[str, Any] | None = None,
                **kw: Any) -> RunResult:
        executor = Executor(self.kube, self.nodes, events=self.sink, playbooks_dir=PLAYBOOKS, clock=self.clock,
                            sleep=self.clock.sleep, wall=self.clock.wall, cancel=self.cancel)
        return executor.execute(plan or self.plan(runbook, params), runbook, params or PARAMS, **kw)

    def playbooks_run(self) -> list[str]:
        return [r["playbook"] for r in self.nodes.runs if not r["check"]]


@pytest.fixture
def lab() -> Lab:
    clock = FakeClock()
    kube = FakeKube([incident_node()], clock=clock)
    nodes = FakeNodes({"omen2": incident_host()}, clock=clock)
    install_recovery_effects(kube, nodes, ready_after=20.0, gpu_after=40.0)
    return Lab(clock, kube, nodes, RecordingSink(), threading.Event())


def statuses(result: RunResult) -> list[tuple[str, StepStatus]]:
    return [(o.step, o.status) for o in result.outcomes]


def test_the_incident_is_recovered_in_order_with_verification_on_fake_time(lab: Lab) -> None:
    started = time.monotonic()
    result = lab.execute()
    assert result.state is RunState.SUCCEEDED and result.exit_code == 0, result.reason
    assert statuses(result) == [("relabel-container", StepStatus.SUCCEEDED), ("swap-off", StepStatus.SUCCEEDED),
                                ("restart-kubelet", StepStatus.SUCCEEDED)]
    assert lab.kube.patches == [("omen2", {"metadata": {"labels": {GPU_LABEL: "container"}}}, "merge")]
    assert lab.playbooks_run() == ["swap-off.yml", "restart-kubelet.yml"]
    assert lab.nodes.runs[0]["extravars"] == {"backup": True}
    assert lab.clock.now() - 1000.0 >= 40.0  # waited for the GPU on fake time...
    assert time.monotonic() - started < 5.0  # ...without really sleeping
    assert result.report.strip() == "omen2: Ready"
    assert result.outcomes[2].evidence["verify"][1]["check"] == "node is Ready"


def test_every_step_records_start_intent_result_verification_and_outcome_in_order(lab: Lab) -> None:
    lab.execute()
    kinds = [k for k in lab.sink.kinds("restart-kubelet") if k != "ansible.task"]
    assert kinds[:5] == ["step.start", "guard.result", "guard.result", "action.intent", "action.result"]
    assert kinds[-1] == "step.outcome"
    assert set(kinds[5:-1]) == {"verify.attempt", "verify.result"}
    assert lab.sink.kinds()[0] == "run.start" and lab.sink.kinds()[-1] == "run.finish"
    assert "ansible.task" in lab.sink.kinds("swap-off")


def test_the_intent_is_recorded_before_the_action_happens(lab: Lab) -> None:
    seen: list[tuple[str, int]] = []

    class Watching(RecordingSink):
        def emit(self, kind: str, **data: Any) -> None:
            seen.append((kind, len(lab.kube.patches) + len(lab.nodes.runs)))
            super().emit(kind, **data)

    lab.sink = Watching()
    lab.execute()
    intents = [n for k, n in seen if k == "action.intent"]
    results = [n for k, n in seen if k == "action.result"]
    assert intents == [0, 1, 2] and results == [1, 2, 3]


def test_a_journal_that_cannot_record_the_intent_stops_the_run_before_acting(lab: Lab) -> None:
    lab.sink = RecordingSink(fail_on="action.intent")
    with pytest.raises(OSError, match="journal unavailable"):
        lab.execute()
    assert lab.kube.patches == [] and lab.playbooks_run() == []


def test_a_guard_that_fails_live_blocks_before_any_action() -> None:
    rb = parse_runbook(b"""apiVersion: runbook/v1
name: guarded
version: "1"
params: {node: {type: node, required: true}}
steps:
  - id: restart-kubelet
    guards: [{node_label: {key: nvidia.com/gpu.workload.config, equals: container}}]
    action: {ansible: {playbook: restart-kubelet.yml}}
    verify: [{check: {service: {name: kubelet, state: active}}}]
""", "guarded.yaml", playbooks_dir=PLAYBOOKS)
    clock = FakeClock()
    kube = FakeKube([incident_node().with_labels({GPU_LABEL: "container"})], clock=clock)
    nodes = FakeNodes({"omen2": make_host(kubelet="activating")}, clock=clock)
    lab = Lab(clock, kube, nodes, RecordingSink(), threading.Event())
    plan = lab.plan(rb, {"node": "omen2"})
    assert plan.state is PlanState.READY
    kube.set_label("omen2", GPU_LABEL, "vm-passthrough")  # someone relabels between plan and run
    result = lab.execute(plan, rb, {"node": "omen2"})
    assert result.state is RunState.BLOCKED and result.exit_code == 3
    assert statuses(result) == [("restart-kubelet", StepStatus.BLOCKED)]
    assert result.outcomes[0].reason == (f"guard label {GPU_LABEL} = container does not hold: "
                                         f"label {GPU_LABEL}=vm-passthrough")
    assert lab.playbooks_run() == []
    assert "action.intent" not in lab.sink.kinds()
    assert lab.sink.of("guard.result")[0]["holds"] is False


def test_a_guard_that_cannot_be_evaluated_blocks(lab: Lab) -> None:
    plan = lab.plan()
    lab.kube.set_label("omen2", GPU_LABEL, "container")
    lab.nodes.set_facts("omen2", make_host(swap=False, kubelet="activating"))
    lab.kube.fail["read_node"] = [KubeError("apiserver unavailable", retryable=True)]
    result = lab.execute(plan, completed_steps={"relabel-container", "swap-off"})
    assert result.state is RunState.BLOCKED
    assert "could not be evaluated" in result.outcomes[0].reason


def test_a_step_planned_as_no_op_that_now_needs_work_is_blocked_not_improvised(lab: Lab) -> None:
    lab.kube.set_label("omen2", GPU_LABEL, "container")
    plan = lab.plan()
    assert plan.step("relabel-container").kind == "no-op"
    lab.kube.set_label("omen2", GPU_LABEL, "vm-passthrough")
    result = lab.execute(plan)
    assert statuses(result) == [("relabel-container", StepStatus.BLOCKED)]
    assert "make a new plan" in result.outcomes[0].reason
    assert lab.kube.patches == []


CHECK_ONLY = b"""apiVersion: runbook/v1
name: check-only
version: "1"
params: {node: {type: node, required: true}}
steps:
  - id: verify-node-ready
    action: {check: {}}
    verify: [{check: {node_ready: true}, timeout: 60s}]
"""


def test_a_check_step_that_already_held_at_plan_time_is_skipped_when_it_still_holds() -> None:
    rb = parse_runbook(CHECK_ONLY, "check-only.yaml", playbooks_dir=PLAYBOOKS)
    clock = FakeClock()
    kube = FakeKube([make_node("omen2", ready=True)], clock=clock)
    lab = Lab(clock, kube, FakeNodes({}, clock=clock), RecordingSink(), threading.Event())
    plan = lab.plan(rb, {"node": "omen2"})
    assert (plan.state, plan.step("verify-node-ready").kind) == (PlanState.NOTHING_TO_DO, "no-op")
    result = lab.execute(plan, rb, {"node": "omen2"})
    assert result.state is RunState.SUCCEEDED, result.outcomes
    assert statuses(result) == [("verify-node-ready", StepStatus.SKIPPED)]
    assert result.outcomes[0].reason.startswith("already holds: Ready=True")


def test_a_check_step_planned_as_no_op_that_no_longer_holds_waits_for_its_verify() -> None:
    rb = parse_runbook(CHECK_ONLY, "check-only.yaml", playbooks_dir=PLAYBOOKS)
    clock = FakeClock()
    kube = FakeKube([make_node("omen2", ready=True)], clock=clock)
    lab = Lab(clock, kube, FakeNodes({}, clock=clock), RecordingSink(), threading.Event())
    plan = lab.plan(rb, {"node": "omen2"})
    kube.nodes["omen2"] = make_node("omen2", ready=False)  # it went NotReady since the plan
    result = lab.execute(plan, rb, {"node": "omen2"})
    assert result.state is RunState.FAILED  # waited its 60 s (fake time), then failed with the evidence
    assert statuses(result) == [("verify-node-ready", StepStatus.TIMED_OUT)]
    assert clock.t >= 1060


def test_a_verify_timeout_fails_the_run_and_runs_the_rollback(lab: Lab) -> None:
    def operator_reverts(name: str, patch: Any) -> None:
        if patch == {"metadata": {"labels": {GPU_LABEL: "container"}}}:
            lab.kube.set_label(name, GPU_LABEL, "operator-owned")

    lab.kube.on_patch = operator_reverts
    result = lab.execute()
    assert result.state is RunState.FAILED and result.exit_code == 1
    outcome = result.outcomes[0]
    assert outcome.status is StepStatus.ROLLED_BACK
    assert outcome.reason.startswith(f"verify label {GPU_LABEL} = container timed out")
    assert outcome.reason.endswith("; rolled back")
    assert outcome.evidence["failure_status"] == "timed-out"
    assert [p[1] for p in lab.kube.patches] == [{"metadata": {"labels": {GPU_LABEL: "container"}}},
                                                {"metadata": {"labels": {GPU_LABEL: "vm-passthrough"}}}]
    assert [d["rollback"] for d in lab.sink.of("action.intent")] == [False, True]
    assert outcome.evidence["rollback"][0]["ok"] is True
    assert "rollback.start" in lab.sink.kinds() and lab.playbooks_run() == []
    assert lab.clock.now() - 1000.0 >= 30.0


def test_a_node_that_never_turns_ready_times_out_with_evidence() -> None:
    clock = FakeClock()
    kube = FakeKube([incident_node()], clock=clock)
    nodes = FakeNodes({"omen2": incident_host()}, clock=clock)
    install_recovery_effects(kube, nodes, ready_after=None)
    lab = Lab(clock, kube, nodes, RecordingSink(), threading.Event())
    result = lab.execute()
    assert result.state is RunState.FAILED and result.exit_code == 1
    last = result.outcomes[-1]
    assert last.status is StepStatus.TIMED_OUT
    assert last.reason.startswith("verify node is Ready timed out: Ready=False")
    assert 179.0 <= clock.now() - 1000.0 <= 200.0
    assert lab.sink.of("verify.result")[-1] == {**lab.sink.of("verify.result")[-1], "holds": False,
                                                "timed_out": True}


def test_a_failing_action_runs_the_rollback(lab: Lab) -> None:
    lab.kube.fail["patch_node"] = [KubeError("admission webhook denied the request", status=400), None]
    result = lab.execute()
    outcome = result.outcomes[0]
    assert outcome.status is StepStatus.ROLLED_BACK and result.exit_code == 1
    assert "admission webhook denied" in outcome.reason
    assert lab.playbooks_run() == []


def test_a_conflicting_concurrent_edit_is_retried_from_fresh_facts(lab: Lab) -> None:
    lab.kube.fail["patch_node"] = [KubeError("Operation cannot be fulfilled: conflict", status=409), None]
    result = lab.execute()
    assert result.state is RunState.SUCCEEDED
    assert [c[0] for c in lab.kube.calls].count("patch_node") == 2


def test_an_unreachable_host_fails_the_step_with_evidence(lab: Lab) -> None:
    lab.nodes.effects["swap-off.yml"] = lambda fn, node, ev: PlaybookResult(
        status="failed", rc=4, unreachable_hosts={node: "ssh: connect to host omen2 port 22: No route to host"})
    result = lab.execute()
    assert statuses(result)[-1] == ("swap-off", StepStatus.FAILED)
    assert "No route to host" in result.outcomes[-1].reason
    assert result.outcomes[-1].evidence["action"]["unreachable_hosts"]["omen2"].startswith("ssh:")


def test_a_connector_exception_is_a_recorded_failure(lab: Lab) -> None:
    lab.nodes.fail["run_playbook"] = HostError("ansible-runner could not start", host="omen2")
    result = lab.execute()
    assert result.state is RunState.FAILED
    assert result.outcomes[-1].reason == "action failed: ansible-runner could not start"


def test_host_checks_poll_with_injected_sleep_until_they_hold(lab: Lab) -> None:
    def slow_swap_off(fn: FakeNodes, node: str, _: Any) -> None:
        fn.clock.after(7.0, lambda: fn.update(node, swap_devices=(), fstab_active_swap=()))

    lab.nodes.effects["swap-off.yml"] = slow_swap_off
    result = lab.execute()
    assert result.state is RunState.SUCCEEDED, result.reason
    attempts = [d for d in lab.sink.of("verify.attempt") if d["step"] == "swap-off"]
    assert attempts[0]["source"] == "playbook" and not attempts[0]["holds"]
    assert attempts[-1]["source"] == "poll" and attempts[-1]["holds"]
    assert lab.clock.sleeps and all(s <= 10.0 for s in lab.clock.sleeps)


def test_cancel_between_steps_stops_before_the_next_step(lab: Lab) -> None:
    class CancelAfterFirst(RecordingSink):
        def emit(self, kind: str, **data: Any) -> None:
            super().emit(kind, **data)
            if kind == "step.outcome":
                lab.cancel.set()

    lab.sink = CancelAfterFirst()
    result = lab.execute()
    assert result.state is RunState.CANCELLED and result.exit_code == 4
    assert statuses(result) == [("relabel-container", StepStatus.SUCCEEDED)]
    assert result.reason == "cancelled before step swap-off"
    assert lab.playbooks_run() == []


def test_cancel_during_an_action_lets_it_finish_and_records_the_outcome(lab: Lab) -> None:
    original = lab.nodes.effects["swap-off.yml"]

    def interrupted(fn: FakeNodes, node: str, ev: Any) -> None:
        original(fn, node, ev)
        lab.cancel.set()  # Ctrl-C while Ansible runs

    lab.nodes.effects["swap-off.yml"] = interrupted
    result = lab.execute()
    assert result.state is RunState.CANCELLED and result.exit_code == 4
    assert statuses(result)[-1] == ("swap-off", StepStatus.CANCELLED)
    assert result.outcomes[-1].reason == "cancelled after the action finished; verification held"
    assert lab.playbooks_run() == ["swap-off.yml"]


def test_resume_does_not_redo_completed_steps(lab: Lab) -> None:
    plan = lab.plan()
    lab.kube.set_label("omen2", GPU_LABEL, "container")  # done by the run that died
    result = lab.execute(plan, completed_steps={"relabel-container"})
    assert result.state is RunState.SUCCEEDED
    assert [o.step for o in result.outcomes] == ["swap-off", "restart-kubelet"]
    assert lab.kube.patches == []
    assert lab.sink.of("run.start")[0]["resumed"] is True


def test_resume_verifies_an_interrupted_step_instead_of_redoing_it(lab: Lab) -> None:
    plan = lab.plan()
    lab.kube.set_label("omen2", GPU_LABEL, "container")
    lab.nodes.update("omen2", swap_devices=())  # swapoff ran; the run died before its outcome
    result = lab.execute(plan, completed_steps={"relabel-container"}, started_without_outcome="swap-off")
    assert result.state is RunState.SUCCEEDED
    # fstab still had the entry: skip_if did not hold and verify failed, and swap-off is idempotent: re-run.
    assert lab.playbooks_run() == ["swap-off.yml", "restart-kubelet.yml"]


def test_resume_skips_an_interrupted_step_whose_work_is_done(lab: Lab) -> None:
    plan = lab.plan()
    lab.kube.set_label("omen2", GPU_LABEL, "container")
    lab.nodes.update("omen2", swap_devices=(), fstab_active_swap=())
    result = lab.execute(plan, completed_steps={"relabel-container"}, started_without_outcome="swap-off")
    assert statuses(result)[0] == ("swap-off", StepStatus.SKIPPED)
    assert lab.playbooks_run() == ["restart-kubelet.yml"]


def _interrupted_restart(lab: Lab) -> Plan:
    plan = lab.plan()
    lab.kube.set_label("omen2", GPU_LABEL, "container")
    lab.nodes.update("omen2", swap_devices=(), fstab_active_swap=())
    return plan


def test_a_non_idempotent_interrupted_step_is_not_rerun_without_confirmation(lab: Lab) -> None:
    result = lab.execute(_interrupted_restart(lab), completed_steps={"relabel-container", "swap-off"},
                         started_without_outcome="restart-kubelet")
    assert result.state is RunState.BLOCKED and result.exit_code == 3
    assert "needs confirmation" in result.outcomes[0].reason
    assert lab.playbooks_run() == []


def test_a_non_idempotent_interrupted_step_reruns_when_confirmed(lab: Lab) -> None:
    asked: list[str] = []
    result = lab.execute(_interrupted_restart(lab), completed_steps={"relabel-container", "swap-off"},
                         started_without_outcome="restart-kubelet",
                         confirm_rerun=lambda step, why: not asked.append(step))  # type: ignore[func-returns-value]
    assert asked == ["restart-kubelet"]
    assert result.state is RunState.SUCCEEDED
    assert lab.playbooks_run() == ["restart-kubelet.yml"]


def test_a_refused_rerun_cancels(lab: Lab) -> None:
    result = lab.execute(_interrupted_restart(lab), completed_steps={"relabel-container", "swap-off"},
                         started_without_outcome="restart-kubelet", confirm_rerun=lambda step, why: False)
    assert result.state is RunState.CANCELLED and lab.playbooks_run() == []


def test_a_blocked_plan_is_not_executed(lab: Lab) -> None:
    lab.nodes.set_facts("omen2", make_host(kubelet="failed", journal="some other failure"))
    plan = lab.plan()
    assert plan.state is PlanState.BLOCKED
    result = lab.execute(plan)
    assert result.state is RunState.BLOCKED and result.exit_code == 3 and result.outcomes == ()
    assert lab.kube.patches == [] and lab.playbooks_run() == []


def test_a_healthy_node_runs_as_all_skipped(lab: Lab) -> None:
    lab.kube.set_label("omen2", GPU_LABEL, "container")
    lab.kube.set_ready("omen2", True)
    lab.nodes.set_facts("omen2", healthy_host())
    result = lab.execute()
    assert result.state is RunState.SUCCEEDED and result.exit_code == 0
    assert {o.status for o in result.outcomes} == {StepStatus.SKIPPED}
    assert result.reason.startswith("nothing to do")


def _with_approval() -> Runbook:
    text = (DATA / "runbooks" / "gpu-recovery.yaml").read_text().replace("\nsteps:", "\napproval: true\nsteps:")
    return parse_runbook(text.encode(), "gpu-recovery.yaml", playbooks_dir=PLAYBOOKS)


def test_a_runbook_that_needs_approval_waits_before_the_first_change(lab: Lab) -> None:
    rb = _with_approval()
    result = lab.execute(runbook=rb)
    assert result.state is RunState.WAITING_APPROVAL
    assert result.outcomes == () and lab.kube.patches == []
    assert lab.sink.of("approval.waiting")[0]["plan_digest"] == result.plan_digest


def test_an_approved_run_proceeds_and_a_refused_one_is_cancelled(lab: Lab) -> None:
    rb = _with_approval()
    asked: list[str | None] = []
    result = lab.execute(runbook=rb, approve=lambda step: not asked.append(step))  # type: ignore[func-returns-value]
    assert result.state is RunState.SUCCEEDED and asked == [None]
    refused = Lab(FakeClock(), FakeKube([incident_node()]), FakeNodes({"omen2": incident_host()}), RecordingSink(),
                  threading.Event()).execute(runbook=rb, approve=lambda step: False)
    assert refused.state is RunState.CANCELLED and refused.exit_code == 4


# -- the shipped flagship (runbooks/gpu-node-recovery.yaml and its playbooks), not the frozen look-alike --
SHIPPED_DIR = Path(__file__).resolve().parents[2]
SHIPPED_PLAYBOOKS = SHIPPED_DIR / "playbooks"
SHIPPED = load_runbook(SHIPPED_DIR / "runbooks" / "gpu-node-recovery.yaml", playbooks_dir=SHIPPED_PLAYBOOKS)
SHIPPED_PARAMS: dict[str, Any] = {"node": "omen2", "workload": "container", "ready_timeout": 120, "gpu_timeout": 180}
CUDA_PIDS = (1000,)


def shipped_omen2(*, auto_restart: bool, ready_after: float = 5.0,
                  gpu_after: float = 10.0) -> tuple[Lab, GpuHostLog]:
    """The incident on fakes, with one host CUDA job, kubelet coming back by itself after swap-off or not."""
    clock = FakeClock()
    kube = FakeKube([incident_node()], clock=clock)
    nodes = FakeNodes({"omen2": incident_host(cuda=len(CUDA_PIDS))}, clock=clock)
    log = install_gpu_host(kube, nodes, auto_restart=auto_restart, ready_after=ready_after, gpu_after=gpu_after)
    return Lab(clock, kube, nodes, RecordingSink(), threading.Event()), log


def run_shipped(lab: Lab) -> RunResult:
    facts = probes.gather(SHIPPED, SHIPPED_PARAMS, "omen2", lab.kube, lab.nodes, clock=lab.clock.wall)
    plan = plan_run(SHIPPED, SHIPPED_PARAMS, facts, runbook_digest="d" * 64, now=NOW)
    assert plan.state is PlanState.READY, plan.blocked_reasons
    executor = Executor(lab.kube, lab.nodes, events=lab.sink, playbooks_dir=SHIPPED_PLAYBOOKS, clock=lab.clock,
                        sleep=lab.clock.sleep, wall=lab.clock.wall, cancel=lab.cancel)
    return executor.execute(plan, SHIPPED, SHIPPED_PARAMS)


def cuda_pids(lab: Lab) -> tuple[int, ...]:
    host = lab.nodes.hosts["omen2"]
    assert isinstance(host, HostFacts)
    return tuple(p.pid for p in host.cuda_processes)


def test_the_fake_gpu_host_kills_the_cuda_job_when_kubelet_comes_back_before_the_relabel() -> None:
    # the danger the shipped order guards against is real in the fake: without it the tests below prove nothing
    lab, log = shipped_omen2(auto_restart=False)
    lab.nodes.run_playbook(SHIPPED_PLAYBOOKS / "swap-off.yml", ["omen2"])
    lab.nodes.run_playbook(SHIPPED_PLAYBOOKS / "restart-kubelet.yml", ["omen2"])
    assert log.comebacks == [KubeletComeback("restart-kubelet.yml", "vm-passthrough", CUDA_PIDS)]
    assert cuda_pids(lab) == ()
    lab, log = shipped_omen2(auto_restart=True)
    lab.nodes.run_playbook(SHIPPED_PLAYBOOKS / "swap-off.yml", ["omen2"])
    assert log.comebacks == [KubeletComeback("auto-restart", "vm-passthrough", CUDA_PIDS)]


def test_the_shipped_flagship_restarts_a_stopped_kubelet_after_relabel_and_swap_off_and_the_cuda_job_lives() -> None:
    lab, log = shipped_omen2(auto_restart=False)
    result = run_shipped(lab)
    assert result.state is RunState.SUCCEEDED and result.exit_code == 0, result.reason
    assert statuses(result) == [("relabel-container", StepStatus.SUCCEEDED), ("swap-off", StepStatus.SUCCEEDED),
                                ("bind-gpus", StepStatus.SKIPPED), ("restart-kubelet", StepStatus.SUCCEEDED)]
    # the order, from the fakes' side: label PATCH, then swap off, then the restart that brought kubelet back
    assert log.effects == ["label=container", "swap-off.yml", "restart-kubelet.yml"]
    assert log.comebacks == [KubeletComeback("restart-kubelet.yml", "container", ())]
    assert cuda_pids(lab) == CUDA_PIDS
    restart = result.outcomes[3]
    checks = {v["check"]: (v["holds"], v["observed"]) for v in restart.evidence["verify"]}
    assert checks["no host CUDA process killed since the plan"] == (
        True, "1 CUDA process; all 1 from the plan still run")
    assert checks["node is Ready"][0] is True
    assert "host CUDA processes: 1 when planned, 1 now (none killed)" in result.report


def test_the_shipped_flagship_skips_the_restart_when_kubelet_came_back_by_itself_after_swap_off() -> None:
    lab, log = shipped_omen2(auto_restart=True, ready_after=0.0, gpu_after=0.0)
    result = run_shipped(lab)
    assert result.state is RunState.SUCCEEDED and result.exit_code == 0, result.reason
    assert statuses(result) == [("relabel-container", StepStatus.SUCCEEDED), ("swap-off", StepStatus.SUCCEEDED),
                                ("bind-gpus", StepStatus.SKIPPED), ("restart-kubelet", StepStatus.SKIPPED)]
    assert result.outcomes[3].reason.startswith("already done: ")
    assert log.effects == ["label=container", "swap-off.yml"]  # restart-kubelet.yml never ran
    assert log.comebacks == [KubeletComeback("auto-restart", "container", ())]
    assert cuda_pids(lab) == CUDA_PIDS


def test_the_shipped_flagship_restarts_a_kubelet_that_came_back_but_is_not_serving_yet() -> None:
    # auto-restarted, but the node is not yet Ready when the step starts: not "already done", so it acts
    lab, log = shipped_omen2(auto_restart=True, ready_after=30.0, gpu_after=40.0)
    result = run_shipped(lab)
    assert result.state is RunState.SUCCEEDED, result.reason
    assert statuses(result)[3] == ("restart-kubelet", StepStatus.SUCCEEDED)
    assert log.effects == ["label=container", "swap-off.yml", "restart-kubelet.yml"]
    assert [c.label for c in log.comebacks] == ["container", "container"]
    assert cuda_pids(lab) == CUDA_PIDS


def test_the_shipped_flagship_does_not_restart_kubelet_when_the_label_was_reverted_before_the_restart() -> None:
    # something (an operator, a person) puts vm-passthrough back after the relabel: the live guard refuses
    lab, log = shipped_omen2(auto_restart=False)
    swap_off = lab.nodes.effects["swap-off.yml"]

    def swap_off_then_revert(fn: FakeNodes, host: str, evars: Any) -> None:
        swap_off(fn, host, evars)
        lab.kube.set_label("omen2", GPU_LABEL, "vm-passthrough")

    lab.nodes.effects["swap-off.yml"] = swap_off_then_revert
    result = run_shipped(lab)
    assert result.state is not RunState.SUCCEEDED and result.exit_code != 0
    assert statuses(result)[3] == ("restart-kubelet", StepStatus.BLOCKED)
    assert "restart-kubelet.yml" not in log.effects and log.comebacks == []
    assert cuda_pids(lab) == CUDA_PIDS
