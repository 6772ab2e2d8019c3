"""The run guards (engine.run_guards) over our fake KubeAPI: each holds, blocks naming its reason,
blocks when it cannot be evaluated, and passes only by a named override that is reported."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from engine.errors import KubeError, UsageError
from engine.facts import NodeFacts
from engine.run_guards import (
    GUARD_NAMES,
    GuardConfig,
    GuardVerdict,
    block_reason,
    blocking,
    evaluate_run_guards,
    load_guard_config,
    overridden,
    selector_matches,
)
from tests.fakes import FakeKube, make_node

T0 = 1_800_000_000.0
NHC = ("remediation.medik8s.io/v1alpha1", "nodehealthchecks")


def gpu_node(name: str, *, gpus: int = 1, ready: bool = True, cordoned: bool = False,
             labels: dict[str, str] | None = None) -> NodeFacts:
    node = make_node(name, ready=ready, unschedulable=cordoned,
                     labels={"nvidia.com/gpu.present": "true", **(labels or {})},
                     allocatable={"cpu": "16", "nvidia.com/gpu": str(gpus)})
    return node


def lab(*extra: NodeFacts) -> FakeKube:
    """Four healthy 1-GPU nodes and a CPU-only node, plus ``extra``."""
    nodes = [gpu_node(f"gpu-{i}") for i in range(1, 5)] + [make_node("cpu-1"), *extra]
    return FakeKube(nodes)


def verdict(verdicts: list[GuardVerdict], name: str) -> GuardVerdict:
    return next(v for v in verdicts if v.name == name)


def kured(value: Any) -> dict[str, Any]:
    ann = value if isinstance(value, str) else json.dumps(value)
    return {"metadata": {"name": "kured", "namespace": "kube-system",
                         "annotations": {"weave.works/kured-node-lock": ann}}}


def nhc(name: str, selector: Any, pauses: list[str]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"selector": selector, "pauseRequests": pauses,
                                                  "minHealthy": "51%"}}


def test_a_healthy_cluster_gives_one_holding_verdict_per_guard_in_order() -> None:
    verdicts = evaluate_run_guards(lab(), "gpu-1", GuardConfig(), now=T0)
    assert [v.name for v in verdicts] == list(GUARD_NAMES)
    assert all(v.holds and not v.blocks and v.evaluated for v in verdicts), verdicts
    assert blocking(verdicts) == []


# -- exclusion ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("label", ["runbook.io/exclude", "remediation.medik8s.io/exclude-from-remediation"])
def test_an_exclusion_label_blocks_naming_the_label(label: str) -> None:
    kube = lab(gpu_node("omen2", ready=False, labels={label: "True"}))
    v = verdict(evaluate_run_guards(kube, "omen2", GuardConfig(), now=T0), "exclusion")
    assert v.blocks and f"{label}=True" in v.reason and not v.transient


def test_an_exclusion_label_with_another_value_holds() -> None:
    kube = lab(gpu_node("omen2", labels={"runbook.io/exclude": "false"}))
    assert verdict(evaluate_run_guards(kube, "omen2", GuardConfig(), now=T0), "exclusion").holds


def test_a_node_missing_from_the_cluster_blocks_the_guards_that_need_it() -> None:
    verdicts = evaluate_run_guards(lab(), "ghost", GuardConfig(), now=T0)
    blocked = {v.name for v in blocking(verdicts)}
    assert blocked == {"exclusion", "nhc-pause", "nvsentinel", "gpu-budget"}
    assert "ghost is not in the cluster" in verdict(verdicts, "exclusion").reason


def test_an_override_passes_the_named_guard_and_reports_who_and_why() -> None:
    kube = lab(gpu_node("omen2", labels={"runbook.io/exclude": "true"}))
    verdicts = evaluate_run_guards(kube, "omen2", GuardConfig(), now=T0, actor="alice",
                                   overrides={"exclusion": "label left over from the RMA"})
    v = verdict(verdicts, "exclusion")
    assert not v.holds and not v.blocks
    assert v.overridden is not None and (v.overridden.by, v.overridden.reason) == (
        "alice", "label left over from the RMA")
    assert v.as_dict()["overridden"] == {"by": "alice", "reason": "label left over from the RMA"}
    assert blocking(verdicts) == [] and block_reason(verdicts) is None
    assert [o.name for o in overridden(verdicts)] == ["exclusion"]


def test_an_override_of_one_guard_leaves_the_others_blocking() -> None:
    kube = lab(gpu_node("omen2", labels={"runbook.io/exclude": "true"}))
    kube.objects[("apps/v1", "daemonsets")] = [kured({"nodeID": "omen2", "created": "2027-01-15T08:00:00Z"})]
    verdicts = evaluate_run_guards(kube, "omen2", GuardConfig(), now=T0, overrides={"exclusion": "RMA"})
    assert [v.name for v in blocking(verdicts)] == ["kured-lock"]
    assert block_reason(verdicts) == "guard kured-lock: kured holds its reboot lock for node omen2 " \
                                     "(since 2027-01-15T08:00:00Z)"


@pytest.mark.parametrize(("overrides", "message"), [
    ({"exclude": "typo"}, "no such guard"), ({"exclusion": "  "}, "give the reason")])
def test_a_bad_override_is_a_usage_error(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        evaluate_run_guards(lab(), "gpu-1", GuardConfig(), overrides=overrides)


# -- kured -------------------------------------------------------------------------------------------


def test_kureds_lock_on_the_node_blocks_and_elsewhere_holds() -> None:
    kube = lab()
    kube.objects[("apps/v1", "daemonsets")] = [kured({"maxOwners": 2, "locks": [
        {"nodeID": "gpu-2", "created": "2027-01-15T08:00:00.123456789Z", "TTL": 0}]})]
    v = verdict(evaluate_run_guards(kube, "gpu-2", GuardConfig(), now=T0), "kured-lock")
    assert v.blocks and v.transient and "kured holds its reboot lock for node gpu-2" in v.reason
    assert verdict(evaluate_run_guards(kube, "gpu-1", GuardConfig(), now=T0), "kured-lock").holds


def test_an_unreadable_kured_lock_blocks() -> None:
    kube = lab()
    kube.objects[("apps/v1", "daemonsets")] = [kured("{not json")]
    v = verdict(evaluate_run_guards(kube, "gpu-1", GuardConfig(), now=T0), "kured-lock")
    assert v.blocks and not v.evaluated and "cannot read kured's lock" in v.reason


def test_kured_disabled_is_not_read() -> None:
    kube = lab()
    kube.objects[("apps/v1", "daemonsets")] = [kured({"nodeID": "gpu-1"})]
    cfg = GuardConfig.model_validate({"kured": {"enabled": False}})
    assert verdict(evaluate_run_guards(kube, "gpu-1", cfg, now=T0), "kured-lock").holds
    assert not any(c == ("list_objects", ("apps/v1", "daemonsets", "kube-system", None)) for c in kube.calls)


# -- NodeHealthCheck pause ---------------------------------------------------------------------------


def test_a_paused_nodehealthcheck_selecting_the_node_blocks_naming_it() -> None:
    kube = lab()
    kube.objects[NHC] = [nhc("nhc-gpu", {"matchLabels": {"nvidia.com/gpu.present": "true"}},
                             ["maintenance CHG-1234"])]
    v = verdict(evaluate_run_guards(kube, "gpu-3", GuardConfig(), now=T0), "nhc-pause")
    assert v.blocks and "NodeHealthCheck nhc-gpu" in v.reason and "maintenance CHG-1234" in v.reason
    assert verdict(evaluate_run_guards(kube, "cpu-1", GuardConfig(), now=T0), "nhc-pause").holds


def test_an_unpaused_nodehealthcheck_holds() -> None:
    kube = lab()
    kube.objects[NHC] = [nhc("nhc-gpu", {"matchLabels": {"nvidia.com/gpu.present": "true"}}, [])]
    assert verdict(evaluate_run_guards(kube, "gpu-3", GuardConfig(), now=T0), "nhc-pause").holds


def test_without_the_nodehealthcheck_resource_the_pause_holds_and_nothing_is_listed() -> None:
    kube = lab()
    v = verdict(evaluate_run_guards(kube, "gpu-1", GuardConfig(), now=T0), "nhc-pause")
    assert v.holds and "no NodeHealthCheck" in v.reason
    assert not any(c[0] == "list_objects" and c[1][0] == NHC[0] for c in kube.calls)


@pytest.mark.parametrize("failure", ["discovery", "list"])
def test_a_nodehealthcheck_that_cannot_be_read_blocks(failure: str) -> None:
    kube = lab()
    kube.served[NHC[0]] = {NHC[1]}
    if failure == "discovery":
        kube.fail["served_resources"] = KubeError("discovery: HTTP 503", status=503)
    else:
        kube.fail["list_objects"] = [None, KubeError("forbidden", status=403)]  # kured's read passes
    v = verdict(evaluate_run_guards(kube, "gpu-1", GuardConfig(), now=T0), "nhc-pause")
    assert v.blocks and not v.evaluated, v
    assert ("503" if failure == "discovery" else "forbidden") in v.reason


def test_a_selector_with_an_unknown_operator_blocks() -> None:
    kube = lab()
    kube.objects[NHC] = [nhc("odd", {"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]},
                             ["x"])]
    v = verdict(evaluate_run_guards(kube, "gpu-1", GuardConfig(), now=T0), "nhc-pause")
    assert v.blocks and not v.evaluated and "unknown operator 'Gt'" in v.reason


def test_nhc_pause_off_reads_no_nodehealthcheck() -> None:
    kube = lab()
    kube.objects[NHC] = [nhc("nhc-all", {}, ["x"])]
    cfg = GuardConfig(nhc_pause=False)
    assert verdict(evaluate_run_guards(kube, "gpu-1", cfg, now=T0), "nhc-pause").holds
    assert ("served_resources", NHC[0]) not in kube.calls


@pytest.mark.parametrize(("selector", "labels", "expected"), [
    ({}, {"a": "1"}, True),
    ({"matchLabels": {"a": "1"}}, {"a": "1"}, True),
    ({"matchLabels": {"a": "1"}}, {"a": "2"}, False),
    ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]}, {"a": "2"}, True),
    ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {}, True),
    ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {"a": "1"}, False),
    ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {}, False),
    ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {}, True),
])
def test_label_selectors_match_as_kubernetes_does(selector: Any, labels: dict[str, str], expected: bool) -> None:
    assert selector_matches(selector, labels) is expected


# -- GPU budget --------------------------------------------------------------------------------------


def test_the_gpu_budget_blocks_a_healthy_node_when_it_would_exceed_the_percent() -> None:
    # 10 GPUs; gpu-1 (1) cordoned, big-1 (4) NotReady: 5 out; +1 = 6 > 50 %
    kube = lab(gpu_node("big-1", gpus=4, ready=False), gpu_node("big-2", gpus=2, cordoned=True))
    kube.set_node(replace(kube.nodes["gpu-1"], unschedulable=True))
    v = verdict(evaluate_run_guards(kube, "gpu-2", GuardConfig(), now=T0), "gpu-budget")
    assert v.blocks and v.transient, v
    assert "7 GPUs out of service" in v.reason and "+ 1 on node gpu-2 = 8" in v.reason
    assert "50% of the cluster's 10 GPUs" in v.reason


def test_the_gpu_budget_counts_the_fleets_nodes_in_flight() -> None:
    cfg = GuardConfig.model_validate({"gpu_budget": {"max_gpus": 2, "max_percent": None}})
    kube = lab()
    assert verdict(evaluate_run_guards(kube, "gpu-3", cfg, in_flight=["gpu-1"], now=T0), "gpu-budget").holds
    v = verdict(evaluate_run_guards(kube, "gpu-3", cfg, in_flight=["gpu-1", "gpu-2"], now=T0), "gpu-budget")
    assert v.blocks and "gpu-1, gpu-2" in v.reason and "at most 2 GPUs" in v.reason


def test_a_node_already_out_of_service_adds_nothing_to_the_budget() -> None:
    # every GPU node is down (the incident): recovering one takes nothing away
    kube = FakeKube([gpu_node(f"gpu-{i}", ready=False) for i in range(1, 5)] + [make_node("cpu-1")])
    cfg = GuardConfig.model_validate({"gpu_budget": {"max_gpus": 0}})
    v = verdict(evaluate_run_guards(kube, "gpu-2", cfg, in_flight=["gpu-1"], now=T0), "gpu-budget")
    assert v.holds and "already out of service (not Ready)" in v.reason


def test_the_gpu_budget_reads_gpu_counts_from_labels_and_capacity() -> None:
    by_label = NodeFacts(name="lab-1", labels=MappingProxyType({"nvidia.com/gpu.count": "8"}),
                         conditions=make_node("x").conditions)
    kube = lab(by_label)
    cfg = GuardConfig.model_validate({"gpu_budget": {"max_gpus": 7, "max_percent": None}})
    v = verdict(evaluate_run_guards(kube, "lab-1", cfg, now=T0), "gpu-budget")
    assert v.blocks and "+ 8 on node lab-1" in v.reason


def test_an_unreadable_node_list_blocks_budget_capacity_and_exclusion() -> None:
    kube = lab()
    kube.fail["list_nodes"] = KubeError("connection refused")
    verdicts = evaluate_run_guards(kube, "gpu-1", GuardConfig(), now=T0)
    assert {v.name for v in blocking(verdicts)} == {"exclusion", "nhc-pause", "nvsentinel", "gpu-budget",
                                                    "unhealthy-capacity"}
    assert all("connection refused" in v.reason for v in blocking(verdicts))


# -- unhealthy capacity ------------------------------------------------------------------------------


def test_unhealthy_capacity_is_off_by_default_and_blocks_above_its_threshold() -> None:
    kube = lab(gpu_node("bad-1", ready=False), gpu_node("bad-2", ready=False), gpu_node("bad-3", ready=False))
    assert verdict(evaluate_run_guards(kube, "bad-1", GuardConfig(), now=T0), "unhealthy-capacity").holds
    cfg = GuardConfig.model_validate({"unhealthy_capacity": {"max_unhealthy_nodes": 2}})
    v = verdict(evaluate_run_guards(kube, "bad-1", cfg, now=T0), "unhealthy-capacity")
    assert v.blocks and "3 of 8 nodes are not Ready (bad-1, bad-2, bad-3)" in v.reason
    cfg = GuardConfig.model_validate({"unhealthy_capacity": {"max_unhealthy_gpus": 3}})
    assert verdict(evaluate_run_guards(kube, "bad-1", cfg, now=T0), "unhealthy-capacity").holds


# -- configuration -----------------------------------------------------------------------------------


def test_the_guards_section_of_a_yaml_file_is_read(tmp_path: Path) -> None:
    f = tmp_path / "runbook.yaml"
    f.write_text("other: 1\nguards:\n  labels: {ops.example/frozen: 'yes'}\n  nhc_pause: false\n"
                 "  gpu_budget: {max_gpus: 4, max_percent: 25}\n")
    cfg = load_guard_config(f)
    assert cfg.labels == {"ops.example/frozen": "yes"} and cfg.nhc_pause is False
    assert (cfg.gpu_budget.max_gpus, cfg.gpu_budget.max_percent) == (4, 25)
    assert load_guard_config(None) == GuardConfig()


@pytest.mark.parametrize(("text", "message"), [
    ("guards:\n  gpu_budget: {max_percent: 150}\n", "gpu_budget.max_percent"),
    ("guards:\n  nhc_paused: true\n", "nhc_paused"),
    ("guards: [1]\n", "must be a mapping"),
    ("guards: {labels: [\n", ":2: invalid YAML"),
])
def test_a_bad_guards_section_is_a_located_usage_error(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "runbook.yaml"
    f.write_text(text)
    with pytest.raises(UsageError, match=message) as e:
        load_guard_config(f)
    assert str(f) in str(e.value)


# -- runbook serve's configuration -------------------------------------------------------------------


def test_serve_takes_a_guards_section_else_its_exclusions_section() -> None:
    from engine.serve.config import load_config

    older = load_config(None, env={}, overrides={"exclusions": {"labels": {"ops.example/hands-off": "yes"},
                                                                 "kured": {"namespace": "kured"}}})
    guards = older.run_guards()
    assert guards.labels == {"ops.example/hands-off": "yes"} and guards.kured.namespace == "kured"
    assert guards.nhc_pause and guards.gpu_budget.max_percent == 50
    newer = load_config(None, env={}, overrides={"guards": {"gpu_budget": {"max_gpus": 2}}})
    assert newer.run_guards().gpu_budget.max_gpus == 2
    assert newer.run_guards().labels == GuardConfig().labels
    assert load_config(None, env={}).run_guards() == GuardConfig()


def test_serve_refuses_exclusions_and_guards_together() -> None:
    from engine.serve.config import load_config

    with pytest.raises(UsageError, match="not in exclusions: as well"):
        load_config(None, env={}, overrides={"guards": {}, "exclusions": {"labels": {}}})


# -- other remediators: the Medik8s node Lease, NVSentinel's quarantine ------------------------------


def medik8s_lease(kube: FakeKube, node: str, holder: str, *, renewed: float = T0 - 10, duration: int = 60,
                  namespace: str = "medik8s-leases") -> None:
    from engine.connectors.base import LeaseRecord

    kube.leases[(namespace, f"node-{node}")] = LeaseRecord(namespace, f"node-{node}", holder, duration,
                                                           renewed, renewed, "7")


def test_a_medik8s_lease_held_by_another_remediator_blocks_naming_the_lease_and_its_holder() -> None:
    kube = lab()
    medik8s_lease(kube, "gpu-1", "NodeHealthCheck")
    v = verdict(evaluate_run_guards(kube, "gpu-1", GuardConfig(), now=T0), "medik8s-lease")
    assert v.blocks and v.transient
    assert v.reason.startswith("Lease medik8s-leases/node-gpu-1 is held by NodeHealthCheck")
    assert verdict(evaluate_run_guards(kube, "gpu-2", GuardConfig(), now=T0), "medik8s-lease").holds


def test_a_run_through_runbooks_own_template_passes_the_lease_nhc_holds_for_it() -> None:
    kube = lab()
    medik8s_lease(kube, "gpu-1", "NodeHealthCheck")
    v = verdict(evaluate_run_guards(kube, "gpu-1", GuardConfig(), now=T0, through_template=True), "medik8s-lease")
    assert v.holds and "remediation template" in v.reason


def test_an_expired_or_released_medik8s_lease_does_not_block() -> None:
    kube = lab()
    medik8s_lease(kube, "gpu-1", "NodeHealthCheck", renewed=T0 - 61, duration=60)
    medik8s_lease(kube, "gpu-2", "")
    assert verdict(evaluate_run_guards(kube, "gpu-1", GuardConfig(), now=T0), "medik8s-lease").holds
    assert verdict(evaluate_run_guards(kube, "gpu-2", GuardConfig(), now=T0), "medik8s-lease").holds


def test_the_lease_namespace_comes_from_lease_namespace_and_an_unreadable_lease_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    kube = lab()
    monkeypatch.setenv("LEASE_NAMESPACE", "nhc-system")
    medik8s_lease(kube, "gpu-1", "node-maintenance", namespace="nhc-system")
    v = verdict(evaluate_run_guards(kube, "gpu-1", GuardConfig(), now=T0), "medik8s-lease")
    assert v.blocks and "nhc-system/node-gpu-1" in v.reason and "node-maintenance" in v.reason

    def refuse(namespace: str, name: str) -> Any:
        raise KubeError("leases is forbidden")

    kube.read_lease = refuse  # type: ignore[method-assign]
    v = verdict(evaluate_run_guards(kube, "gpu-1", GuardConfig(), now=T0), "medik8s-lease")
    assert v.blocks and not v.evaluated and "forbidden" in v.reason


@pytest.mark.parametrize(("labels", "blocks"), [
    ({"dgxc.nvidia.com/nvsentinel-state": "quarantined"}, True),
    ({"dgxc.nvidia.com/nvsentinel-state": "remediation-failed"}, True),
    ({"dgxc.nvidia.com/nvsentinel-state": "remediation-succeeded"}, False),
    ({"k8saas.nvidia.com/cordon-by": "NVSentinel"}, True),
    ({"k8saas.nvidia.com/cordon-by": "someone-else"}, False),
    ({}, False),
])
def test_an_nvsentinel_quarantine_blocks_until_done(labels: dict[str, str], blocks: bool) -> None:
    kube = lab(gpu_node("gpu-q", labels=labels))
    v = verdict(evaluate_run_guards(kube, "gpu-q", GuardConfig(), now=T0), "nvsentinel")
    assert v.blocks is blocks, v.reason
    if blocks:
        assert "NVSentinel" in v.reason and "--override-guard nvsentinel" in v.reason


def test_an_nvsentinel_quarantine_passes_only_by_a_named_override() -> None:
    kube = lab(gpu_node("gpu-q", labels={"dgxc.nvidia.com/nvsentinel-state": "draining"}))
    v = verdict(evaluate_run_guards(kube, "gpu-q", GuardConfig(), now=T0,
                                    overrides={"nvsentinel": "RMA ticket 42 closed"}, actor="alice"), "nvsentinel")
    assert not v.blocks and v.overridden is not None and v.overridden.by == "alice"
    off = GuardConfig.model_validate({"nvsentinel": {"enabled": False}, "medik8s_lease": {"enabled": False}})
    verdicts = evaluate_run_guards(kube, "gpu-q", off, now=T0)
    assert verdict(verdicts, "nvsentinel").holds and verdict(verdicts, "medik8s-lease").holds
