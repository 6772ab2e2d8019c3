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
    assert [(s.id, s.kind) for s in p.steps] == [("reset-gpu", "change"), ("restart-device-plugin", "change")]


def test_gpu_reset_refuses_a_gpu_a_process_holds_naming_it() -> None:
    p = plan("gpu-reset", host(XID48, cuda=(CudaProcess(7, "train.py", "02:00.0"),)), gpu="02:00.0")
    assert p.state is PlanState.BLOCKED
    assert "pid 7 (train.py)" in " ".join(" ".join(p.blocked_reasons).split())


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
