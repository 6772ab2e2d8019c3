"""The GPU failure catalogue's runbooks planned on fake facts (pure): what each plans for its fault, and
what it refuses before any change (docs/catalogue.md)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from engine.facts import CudaProcess, Facts, GpuHealth, HostFacts, NodeFacts, RowRemap, XidEvent
from engine.loader import default_runbooks_dir, load_runbook
from engine.model import Plan, PlanState
from engine.planning import plan_run
from tests.fakes import make_host, make_node, quad_gpus

NOW = datetime(2026, 12, 3, 8, 0, tzinfo=UTC)
GPU = "nvidia.com/gpu"
KEY = "runbook.io/gpu-fallen-off-bus"


def node(allocatable: int = 3, **kw: Any) -> NodeFacts:
    n = make_node("gpu-quad", labels={"nvidia.com/gpu.workload.config": "container"}, **kw)
    return replace(n, allocatable=MappingProxyType({**n.allocatable, GPU: str(allocatable)}),
                   capacity=MappingProxyType({**n.capacity, GPU: "4"}))


def host(health: GpuHealth, cuda: tuple[CudaProcess, ...] = (CudaProcess(41000, "python3", "01:00.0"),)) -> HostFacts:
    gpus = tuple(replace(g, driver="nvidia") for g in quad_gpus())
    return replace(make_host("gpu-quad"), gpus=gpus, cuda_processes=cuda,
                   gpu_health=replace(health, remaps=health.remaps or tuple(RowRemap(g.slot) for g in gpus)))


def plan(name: str, h: HostFacts, n: NodeFacts | None = None, **params: Any) -> Plan:
    rb = load_runbook(default_runbooks_dir() / f"{name}.yaml")
    values = {k: p.default for k, p in rb.params.items() if p.default is not None}
    values.update(node="gpu-quad", **params)
    return plan_run(rb, values, Facts(node_name="gpu-quad", node=n or node(), host=h, gathered_at=NOW.timestamp()),
                    runbook_digest="f" * 64, now=NOW)


XID48 = GpuHealth(smi_rc=0, xids=(XidEvent("02:00.0", 48),))


def test_gpu_reset_plans_the_reset_of_that_gpu_then_the_plugin_restart() -> None:
    p = plan("gpu-reset", host(XID48), gpu="02:00.0")
    assert p.state is PlanState.READY, p.blocked_reasons
    assert [(s.id, s.kind) for s in p.steps] == [("evict-gpu-pods", "no-op"), ("reset-gpu", "change"),
                                                 ("restart-device-plugin", "change")]


POD_A, POD_B = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", "11111111-2222-3333-4444-555555555555"


def test_gpu_reset_evicts_only_the_pods_whose_processes_hold_that_gpu_then_resets_it() -> None:
    procs = (CudaProcess(41000, "python3", "01:00.0"),  # a host job on another GPU: stays
             CudaProcess(7, "train.py", "02:00.0", pod_uid=POD_A, cgroup="/kubepods.slice/x"),
             CudaProcess(8, "worker", "02:00.0", pod_uid=POD_A),
             CudaProcess(9, "serve.py", "41:00.0", pod_uid=POD_B))  # another GPU's pod: stays
    p = plan("gpu-reset", host(XID48, cuda=procs), gpu="02:00.0")
    assert p.state is PlanState.READY, p.blocked_reasons
    assert [(s.id, s.kind) for s in p.steps] == [("evict-gpu-pods", "change"), ("reset-gpu", "change"),
                                                 ("restart-device-plugin", "change")]
    evict = p.step("evict-gpu-pods")
    assert evict.summary == f"evict pods on gpu-quad with UID {POD_A}"
    assert POD_B not in evict.command and f'.metadata.uid == "{POD_A}"' in evict.command


def test_gpu_reset_refuses_a_gpu_a_process_holds_naming_it() -> None:
    p = plan("gpu-reset", host(XID48, cuda=(CudaProcess(7, "train.py", "02:00.0"),)), gpu="02:00.0")
    assert p.state is PlanState.BLOCKED
    assert "pid 7 (train.py)" in " ".join(" ".join(p.blocked_reasons).split())


def test_gpu_reset_refuses_a_host_process_beside_a_pods_naming_only_the_host_process() -> None:
    # fail closed: a process whose cgroup names no pod (or could not be read) is the host's
    procs = (CudaProcess(7, "train.py", "02:00.0", pod_uid=POD_A), CudaProcess(12, "nvtop", "02:00.0"))
    p = plan("gpu-reset", host(XID48, cuda=procs), gpu="02:00.0")
    assert p.state is PlanState.BLOCKED
    said = " ".join(" ".join(p.blocked_reasons).split())
    assert "pid 12 (nvtop), not a pod's process" in said and "pid 7" not in said


def test_gpu_reset_evicts_nobody_when_the_gpu_needs_no_reset() -> None:
    # allocatable below the host's GPUs but no fault on that GPU: the plugin restart only
    procs = (CudaProcess(7, "train.py", "02:00.0", pod_uid=POD_A),)
    p = plan("gpu-reset", host(GpuHealth(smi_rc=0), cuda=procs), gpu="02:00.0")
    assert [(s.id, s.kind) for s in p.steps] == [("evict-gpu-pods", "no-op"), ("reset-gpu", "no-op"),
                                                 ("restart-device-plugin", "change")]


def test_gpu_reset_refuses_an_nvswitch_system_with_the_reason() -> None:
    p = plan("gpu-reset", host(replace(XID48, nvswitches=4)), gpu="02:00.0")
    assert p.state is PlanState.BLOCKED
    assert "NVSwitch system" in " ".join(p.blocked_reasons)


def test_gpu_reset_of_a_healthy_gpu_has_nothing_to_do() -> None:
    p = plan("gpu-reset", host(GpuHealth(smi_rc=0)), node(allocatable=4), gpu="02:00.0")
    assert p.state is PlanState.NOTHING_TO_DO


def test_the_fabric_manager_of_another_version_is_refused_with_both_versions() -> None:
    health = GpuHealth(smi_rc=0, nvswitches=4, fabric_manager_state="failed", fabric_manager_version="570.86.15",
                       driver_version="570.133.07")
    p = plan("fabric-manager-restart", host(health), node(allocatable=4))
    assert p.state is PlanState.BLOCKED
    reasons = " ".join(p.blocked_reasons)
    assert "570.86.15" in reasons and "570.133.07" in reasons
    ok = plan("fabric-manager-restart", host(replace(health, fabric_manager_version="570.133.07")), node(allocatable=4))
    assert ok.state is PlanState.READY, ok.blocked_reasons


def test_a_lost_gpu_plans_cordon_record_and_a_check_that_escalates() -> None:
    lost = GpuHealth(smi_rc=15, lost=("02:00.0",), xids=(XidEvent("02:00.0", 79),))
    p = plan("gpu-fallen-off-bus", host(lost))
    assert p.state is PlanState.READY, p.blocked_reasons
    assert {s.id: s.kind for s in p.steps} == {"cordon": "change", "evict-gpu-pods": "change",
                                               "record-lost-gpu": "change", "gpus-back": "change",
                                               "uncordon": "change"}


def test_a_repeat_cordons_only_and_leaves_the_node_cordoned() -> None:
    lost = GpuHealth(smi_rc=15, lost=("41:00.0",), xids=(XidEvent("41:00.0", 79),))
    recorded = replace(node(), annotations=MappingProxyType({KEY: "02:00.0 Xid 79",
                                                             KEY + "-at": "2026-12-02T08:00:00Z"}))  # a day ago
    p = plan("gpu-fallen-off-bus", host(lost), recorded)
    assert p.state is PlanState.READY, p.blocked_reasons
    assert {s.id: s.kind for s in p.steps} == {"cordon": "change", "evict-gpu-pods": "change",
                                               "record-lost-gpu": "no-op", "gpus-back": "no-op",
                                               "uncordon": "no-op"}


BOOT_A, BOOT_B = "6b1f0c52-1d0e-4a8e-9d7a-3f5e2c1b0a99", "8e2a4d61-7c3b-4f19-a0d2-5b6c7d8e9f00"


def test_a_second_run_before_the_reboot_is_the_same_loss_not_a_repeat() -> None:
    # the record was made in this boot and the GPU is still lost: the reboot is still due
    lost = GpuHealth(smi_rc=15, lost=("02:00.0",), xids=(XidEvent("02:00.0", 79),))
    recorded = replace(node(unschedulable=True), annotations=MappingProxyType({
        KEY: "02:00.0 Xid 79", KEY + "-at": "2026-12-03T07:50:00Z", KEY + "-boot": BOOT_A,
        "runbook.io/cordoned-by": "the-first-run"}))
    p = plan("gpu-fallen-off-bus", replace(host(lost), boot_id=BOOT_A), recorded)
    assert p.state is PlanState.READY, p.blocked_reasons
    assert {s.id: s.kind for s in p.steps} == {"cordon": "no-op", "evict-gpu-pods": "change",
                                               "record-lost-gpu": "no-op", "gpus-back": "change",
                                               "uncordon": "change"}


def test_a_loss_after_a_boot_that_followed_the_record_is_a_repeat() -> None:
    lost = GpuHealth(smi_rc=15, lost=("41:00.0",), xids=(XidEvent("41:00.0", 79),))
    recorded = replace(node(), annotations=MappingProxyType({
        KEY: "02:00.0 Xid 79", KEY + "-at": "2026-12-02T08:00:00Z", KEY + "-boot": BOOT_A}))
    p = plan("gpu-fallen-off-bus", replace(host(lost), boot_id=BOOT_B), recorded)
    assert {s.id: s.kind for s in p.steps} == {"cordon": "change", "evict-gpu-pods": "change",
                                               "record-lost-gpu": "no-op", "gpus-back": "no-op",
                                               "uncordon": "no-op"}
    # and when the host's boot id cannot be read, it counts as a repeat too (no reboot: fail closed)
    unknown = plan("gpu-fallen-off-bus", host(lost), replace(recorded, annotations=MappingProxyType({
        **recorded.annotations, KEY + "-boot": ""})))
    assert unknown.step("gpus-back").kind == "no-op"


def test_the_record_carries_the_boot_it_was_lost_in() -> None:
    lost = GpuHealth(smi_rc=15, lost=("02:00.0",), xids=(XidEvent("02:00.0", 79),))
    p = plan("gpu-fallen-off-bus", replace(host(lost), boot_id=BOOT_A))
    changes = p.step("record-lost-gpu").changes
    assert any(c.path == f"node.annotations[{KEY}-boot]" and c.after == BOOT_A for c in changes), changes


def test_the_dcgm_alerts_start_their_runbooks_with_the_gpu_and_only_if_the_diagnosis_matches() -> None:
    import json

    from engine.loader import list_runbooks
    from engine.serve.alertmanager import parse_webhook
    from engine.serve.starter import TriggerSpec
    from engine.serve.triggers import TriggerIndex
    from tests.fakes import alert, webhook

    loaded, problems = list_runbooks(default_runbooks_dir())
    assert problems == []
    idx = TriggerIndex([TriggerSpec(runbook=lr.name, trigger=t, node_param=lr.runbook.node_param)
                        for lr in loaded for t in lr.runbook.triggers])
    for name, labels, want in [
            ("GPUXidReset", {"gpu_slot": "C1:00.0"}, ("gpu-reset", {"node": "gpu-quad", "gpu": "c1:00.0"})),
            ("GPURowRemapPending", {"gpu_slot": "02:00.0"}, ("gpu-reset", {"node": "gpu-quad", "gpu": "02:00.0"})),
            ("GPUFallenOffBus", {"gpu_slot": "41:00.0"}, ("gpu-fallen-off-bus", {"node": "gpu-quad"}))]:
        a = parse_webhook(json.dumps(webhook(alert("gpu-quad", alertname=name, **labels))).encode()).alerts[0]
        (c,) = idx.for_alert(a).candidates
        assert ((c.runbook, dict(c.params)), c.require_diagnosis, c.mode) == (want, True, "approve")
