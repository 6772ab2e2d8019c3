"""The GPU failure catalogue's runbooks executed on fakes (fake time): what a run does across the
reboot of gpu-fallen-off-bus, and how a check step planned as a no-op is re-checked live."""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from engine import probes
from engine.execution import Executor
from engine.facts import GpuHealth, HostFacts, NodeFacts, RowRemap
from engine.loader import default_runbooks_dir, load_runbook, parse_runbook
from engine.model import PlanState, Runbook, RunResult, RunState, StepStatus
from engine.planning import plan_run
from tests.fakes import FakeClock, FakeKube, FakeNodes, RecordingSink, make_host, make_node, quad_gpus

NOW = datetime(2026, 12, 7, 14, 0, tzinfo=UTC)
GPU = "nvidia.com/gpu"
KEY = "runbook.io/gpu-fallen-off-bus"
NODE = "gpu-quad"
# what the first run left: its record of the lost GPU and the stamp of its cordon
RECORDED = {KEY: "02:00.0 Xid 79", "runbook.io/cordoned-by": "run-1"}


def quad_node(*, allocatable: int = 4, unschedulable: bool = False,
              annotations: dict[str, str] | None = None) -> NodeFacts:
    n = make_node(NODE, unschedulable=unschedulable)
    return replace(n, allocatable=MappingProxyType({**n.allocatable, GPU: str(allocatable)}),
                   capacity=MappingProxyType({**n.capacity, GPU: "4"}),
                   annotations=MappingProxyType(dict(annotations or {})))


def quad_host(health: GpuHealth) -> HostFacts:
    gpus = tuple(replace(g, driver="nvidia") for g in quad_gpus())
    return replace(make_host(NODE), gpus=gpus,
                   gpu_health=replace(health, remaps=health.remaps or tuple(RowRemap(g.slot) for g in gpus)))


def execute(rb: Runbook, kube: FakeKube, nodes: FakeNodes, clock: FakeClock,
            params: dict[str, Any] | None = None) -> tuple[PlanState, RunResult]:
    values = {k: p.default for k, p in rb.params.items() if p.default is not None}
    values.update(node=NODE, **(params or {}))
    facts = probes.gather(rb, values, NODE, kube, nodes, clock=clock.wall)
    plan = plan_run(rb, values, facts, runbook_digest="f" * 64, now=NOW)
    executor = Executor(kube, nodes, events=RecordingSink(), playbooks_dir=default_runbooks_dir().parent / "playbooks",
                        clock=clock, sleep=clock.sleep, wall=clock.wall, cancel=threading.Event())
    return plan.state, executor.execute(plan, rb, values)


def outcomes(result: RunResult) -> dict[str, StepStatus]:
    return {o.step: o.status for o in result.outcomes}


def test_after_the_reboot_gpus_back_verifies_every_gpu_and_the_node_is_uncordoned() -> None:
    # the run of gpu-fallen-off-bus after the approved reboot: the node cordoned with the record, every
    # GPU back. gpus-back has a skip_if ("a repeat") that does not hold, and its verify holds at plan time:
    # the plan makes it a no-op by its verify, and the run must re-check that verify, not refuse the step
    # because its skip_if does not hold (it never did: it was the verify that made the no-op).
    rb = load_runbook(default_runbooks_dir() / "gpu-fallen-off-bus.yaml")
    clock = FakeClock()
    kube = FakeKube([quad_node(unschedulable=True, annotations=RECORDED)], clock=clock)
    nodes = FakeNodes({NODE: quad_host(GpuHealth(smi_rc=0))}, clock=clock)
    state, result = execute(rb, kube, nodes, clock)
    assert state is PlanState.READY
    assert result.state is RunState.SUCCEEDED, result.reason
    got = outcomes(result)
    assert (got["gpus-back"], got["uncordon"]) == (StepStatus.SKIPPED, StepStatus.SUCCEEDED), result.outcomes
    assert kube.nodes[NODE].unschedulable is False


def test_after_the_reboot_a_gpu_that_stopped_answering_since_the_plan_is_waited_for_not_passed() -> None:
    rb = load_runbook(default_runbooks_dir() / "gpu-fallen-off-bus.yaml")
    clock = FakeClock()
    kube = FakeKube([quad_node(unschedulable=True, annotations=RECORDED)], clock=clock)
    nodes = FakeNodes({NODE: quad_host(GpuHealth(smi_rc=0))}, clock=clock)
    values = {k: p.default for k, p in rb.params.items() if p.default is not None} | {"node": NODE}
    facts = probes.gather(rb, values, NODE, kube, nodes, clock=clock.wall)
    plan = plan_run(rb, values, facts, runbook_digest="f" * 64, now=NOW)
    assert plan.step("gpus-back").kind == "no-op"
    kube.set_allocatable(NODE, GPU, "3")  # the device plugin withholds a GPU since the plan
    executor = Executor(kube, nodes, events=RecordingSink(), playbooks_dir=default_runbooks_dir().parent / "playbooks",
                        clock=clock, sleep=clock.sleep, wall=clock.wall, cancel=threading.Event())
    result = executor.execute(plan, rb, values)
    assert result.state is RunState.FAILED
    assert outcomes(result)["gpus-back"] is StepStatus.TIMED_OUT  # waited for its verify; never uncordoned
    assert kube.nodes[NODE].unschedulable is True


SKIPPED_CHECK = b"""apiVersion: runbook/v1
name: skipped-check
version: "1"
params: {node: {type: node, required: true}}
steps:
  - id: wait-ready
    action: {check: {}}
    skip_if: [{expr: "facts.node.unschedulable"}]
    verify: [{check: {node_ready: true}, timeout: 60s}]
"""


def test_a_check_step_the_plan_skipped_by_its_skip_if_is_still_refused_once_that_no_longer_holds() -> None:
    # the guard against a no-op whose facts changed stays for a no-op the plan took from skip_if
    rb = parse_runbook(SKIPPED_CHECK, "skipped-check.yaml")
    clock = FakeClock()
    kube = FakeKube([make_node(NODE, ready=False, unschedulable=True)], clock=clock)
    nodes = FakeNodes({NODE: make_host(NODE)}, clock=clock)
    values = {"node": NODE}
    plan = plan_run(rb, values, probes.gather(rb, values, NODE, kube, nodes, clock=clock.wall),
                    runbook_digest="f" * 64, now=NOW)
    assert plan.step("wait-ready").kind == "no-op"
    kube.set_node(replace(kube.nodes[NODE], unschedulable=False))
    executor = Executor(kube, nodes, events=RecordingSink(), playbooks_dir=default_runbooks_dir().parent / "playbooks",
                        clock=clock, sleep=clock.sleep, wall=clock.wall, cancel=threading.Event())
    result = executor.execute(plan, rb, values)
    assert result.state is RunState.BLOCKED
    assert "live facts show work is needed" in result.outcomes[0].reason


# -- the Xid 79 repeat window, on a fake clock ------------------------------------------------------

AT = "runbook.io/gpu-fallen-off-bus-at"
HOUR = 3600.0


BOOT_A, BOOT_B = "6b1f0c52-1d0e-4a8e-9d7a-3f5e2c1b0a99", "8e2a4d61-7c3b-4f19-a0d2-5b6c7d8e9f00"


def lost(slot: str, boot_id: str = "") -> HostFacts:
    from dataclasses import replace

    from engine.facts import XidEvent

    line = f"NVRM: Xid (PCI:0000:{slot[:5]}): 79, GPU has fallen off the bus."
    return replace(quad_host(GpuHealth(smi_rc=15, lost=(slot,), xids=(XidEvent(slot, 79, line),))), boot_id=boot_id)


def first_loss(clock: FakeClock, boot_id: str = "") -> tuple[FakeKube, FakeNodes, RunResult]:
    rb = load_runbook(default_runbooks_dir() / "gpu-fallen-off-bus.yaml")
    kube = FakeKube([quad_node(allocatable=3)], clock=clock)
    nodes = FakeNodes({NODE: lost("02:00.0", boot_id)}, clock=clock)
    _, result = execute(rb, kube, nodes, clock, {"gpu_check_timeout": 1})
    return kube, nodes, result


def test_the_first_loss_records_the_gpu_and_the_time_of_the_clock() -> None:
    clock = FakeClock()
    kube, _, result = first_loss(clock)
    assert outcomes(result)["record-lost-gpu"] is StepStatus.SUCCEEDED
    assert outcomes(result)["gpus-back"] is StepStatus.TIMED_OUT  # the GPU is not back: escalate
    recorded = kube.nodes[NODE].annotations
    assert recorded[KEY] == "02:00.0 Xid 79"
    written = datetime.fromisoformat(recorded[AT].replace("Z", "+00:00")).timestamp()
    assert abs(written - clock.wall()) < 10  # the run's own (fake) time, not this machine's


def repeat_after(hours: float, window: str | None = None) -> tuple[FakeKube, RunResult]:
    """The first loss, then (the GPU back, the node uncordoned) another GPU lost ``hours`` later."""
    clock = FakeClock()
    kube, nodes, _ = first_loss(clock)
    recorded = dict(kube.nodes[NODE].annotations)
    clock.advance_to(clock.t + hours * HOUR)
    kube.set_node(quad_node(allocatable=3, annotations={k: v for k, v in recorded.items()
                                                         if k != "runbook.io/cordoned-by"}))
    nodes.set_facts(NODE, lost("41:00.0"))
    rb = load_runbook(default_runbooks_dir() / "gpu-fallen-off-bus.yaml")
    params: dict[str, Any] = {"gpu_check_timeout": 1} | ({"repeat_window": window} if window else {})
    _, result = execute(rb, kube, nodes, clock, params)
    return kube, result


def test_a_second_loss_within_the_window_cordons_and_says_contact_support() -> None:
    kube, result = repeat_after(hours=30)
    assert result.state is RunState.SUCCEEDED, result.reason
    got = outcomes(result)
    assert (got["cordon"], got["record-lost-gpu"], got["gpus-back"], got["uncordon"]) == (
        StepStatus.SUCCEEDED, StepStatus.SKIPPED, StepStatus.SKIPPED, StepStatus.SKIPPED)
    assert "hardware: contact support" in result.report and "02:00.0 Xid 79 at " in result.report
    assert kube.nodes[NODE].unschedulable is True


def test_a_second_run_before_the_reboot_is_the_same_loss_and_escalates_again_not_contact_support() -> None:
    clock = FakeClock()
    kube, nodes, _ = first_loss(clock, BOOT_A)
    assert kube.nodes[NODE].annotations[KEY + "-boot"] == BOOT_A  # the boot it was lost in
    first_at = kube.nodes[NODE].annotations[AT]
    clock.advance_to(clock.t + 0.5 * HOUR)  # nobody approved the reboot yet: same boot, GPU still lost
    rb = load_runbook(default_runbooks_dir() / "gpu-fallen-off-bus.yaml")
    _, again = execute(rb, kube, nodes, clock, {"gpu_check_timeout": 1})
    got = outcomes(again)
    assert (got["record-lost-gpu"], got["gpus-back"]) == (StepStatus.SKIPPED, StepStatus.TIMED_OUT)  # escalates
    assert "contact support" not in again.report and "The reboot is still due" in " ".join(again.report.split())
    assert kube.nodes[NODE].annotations[AT] == first_at  # the first loss's record stays


def test_a_loss_in_a_later_boot_than_the_record_is_a_repeat() -> None:
    clock = FakeClock()
    kube, nodes, _ = first_loss(clock, BOOT_A)
    recorded = dict(kube.nodes[NODE].annotations)
    clock.advance_to(clock.t + 30 * HOUR)  # rebooted (a new boot id), back, uncordoned; lost again
    kube.set_node(quad_node(allocatable=3, annotations={k: v for k, v in recorded.items()
                                                         if k != "runbook.io/cordoned-by"}))
    nodes.set_facts(NODE, lost("41:00.0", BOOT_B))
    rb = load_runbook(default_runbooks_dir() / "gpu-fallen-off-bus.yaml")
    _, result = execute(rb, kube, nodes, clock, {"gpu_check_timeout": 1})
    assert outcomes(result)["gpus-back"] is StepStatus.SKIPPED and "hardware: contact support" in result.report


def test_a_second_loss_after_the_window_is_a_new_loss_recorded_anew_and_escalated() -> None:
    kube, result = repeat_after(hours=200)  # the default window is 168h
    got = outcomes(result)
    assert (got["record-lost-gpu"], got["gpus-back"]) == (StepStatus.SUCCEEDED, StepStatus.TIMED_OUT)
    assert "contact support" not in result.report
    assert kube.nodes[NODE].annotations[KEY] == "41:00.0 Xid 79"  # the new loss, with its own time


def test_the_window_is_a_param() -> None:
    _, short = repeat_after(hours=2, window="1h")
    assert outcomes(short)["record-lost-gpu"] is StepStatus.SUCCEEDED and "contact support" not in short.report
    _, long = repeat_after(hours=300, window="720h")
    assert outcomes(long)["gpus-back"] is StepStatus.SKIPPED and "hardware: contact support" in long.report


def test_node_annotation_time_judges_the_record_against_the_facts_time() -> None:
    from pydantic import TypeAdapter

    from engine.checks import Check, evaluate
    from engine.facts import Facts

    chk = TypeAdapter(Check).validate_python({"node_annotation_time": {"key": AT, "within": "2h"}})
    t0 = datetime(2026, 12, 7, 12, 0, tzinfo=UTC).timestamp()
    node = quad_node(annotations={AT: "2026-12-07T12:00:00Z"})

    def at(seconds: float, n: NodeFacts = node) -> bool | None:
        return evaluate(chk, Facts(node_name=NODE, node=n, gathered_at=t0 + seconds)).holds

    assert (at(0), at(2 * HOUR), at(2 * HOUR + 1), at(-60)) == (True, True, False, True)
    assert at(0, quad_node()) is False  # no record
    assert at(0, quad_node(annotations={AT: "last tuesday"})) is None  # not a time: unknown, fails closed
    assert evaluate(chk, Facts(node_name=NODE, node=node)).holds is None  # no time of the facts


def test_a_node_with_no_lost_gpu_has_nothing_to_do_and_its_check_step_does_not_wait() -> None:
    # nothing lost, not cordoned: nothing to do, even while the device plugin withholds a GPU (another
    # runbook's fault); gpus-back must not wait its 180 s for allocatable and fail the run
    rb = load_runbook(default_runbooks_dir() / "gpu-fallen-off-bus.yaml")
    clock = FakeClock()
    kube = FakeKube([quad_node(allocatable=3)], clock=clock)
    nodes = FakeNodes({NODE: quad_host(GpuHealth(smi_rc=0))}, clock=clock)
    start = clock.t
    state, result = execute(rb, kube, nodes, clock)
    assert state is PlanState.NOTHING_TO_DO
    assert result.state is RunState.SUCCEEDED and set(outcomes(result).values()) == {StepStatus.SKIPPED}
    assert outcomes(result)["gpus-back"] is StepStatus.SKIPPED and clock.t - start < 5
