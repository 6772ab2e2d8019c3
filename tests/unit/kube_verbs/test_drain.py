"""``drain`` as kubectl drain does it, ``evict`` on the same machinery, and ``wait`` on a condition.

Unit tests on our fakes (fake clock: nothing really sleeps). The lab test
(tests/integration/lab/test_drain_lab.py) drains a real API server's node with a real
PodDisruptionBudget; tests/integration/test_kube_connector.py covers the connector's discovery and
dry runs against the real server.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine import kube_verbs as kv
from engine import probes
from engine.connectors.base import PodRef
from engine.connectors.kube import eviction_version_from_discovery, pod_ref_from_dict
from engine.errors import KubeError, LoadError
from engine.execution import Executor
from engine.kube_verbs.drain import DrainSpec, KubeDrain, classify
from engine.loader import parse_runbook
from engine.model import Runbook, RunState
from engine.planning import plan_run
from tests.fakes import FakeClock, FakeKube, FakeNodes, RecordingSink, healthy_host, healthy_node

PLAYBOOKS = Path(__file__).resolve().parents[1] / "data" / "playbooks"
NOW = datetime(2026, 7, 10, 15, 40, tzinfo=UTC)


def pod(name: str, *, kind: str = "ReplicaSet", ns: str = "web", mirror: bool = False,
        empty_dir: tuple[str, ...] = (), phase: str = "Running", node: str = "omen2") -> PodRef:
    return PodRef(ns, name, node, {}, phase, {}, uid=f"uid-{name}", controller_kind=kind,
                  controller_name=f"{name}-owner" if kind else "", mirror=mirror, empty_dir=empty_dir)


def rules(**spec: Any) -> kv.PodRules:
    effect = kv.kube_effect(KubeDrain(drain=DrainSpec(**spec)), healthy_node())
    assert isinstance(effect, kv.PodOperation)
    return effect.rules


def drain_runbook(spec: dict[str, Any], *, verify: list[Any] | None = None) -> Runbook:
    step: dict[str, Any] = {"id": "drain", "action": {"kube": {"drain": spec}}}
    if verify is not None:
        step["verify"] = verify
    doc = {"apiVersion": "runbook/v1", "name": "drain-node", "version": "1",
           "params": {"node": {"type": "node", "required": True}}, "steps": [step]}
    return parse_runbook(yaml.safe_dump(doc).encode(), "drain-node.yaml", playbooks_dir=PLAYBOOKS)


def run(rb: Runbook, kube: FakeKube, cancel: threading.Event | None = None) -> Any:
    nodes = FakeNodes({"omen2": healthy_host()}, clock=kube.clock)
    facts = probes.gather(rb, {"node": "omen2"}, "omen2", kube, nodes)
    plan = plan_run(rb, {"node": "omen2"}, facts, runbook_digest="d" * 64, now=NOW)
    executor = Executor(kube, nodes, events=RecordingSink(), playbooks_dir=PLAYBOOKS, clock=kube.clock,
                        sleep=kube.clock.sleep, wall=kube.clock.wall, cancel=cancel or threading.Event())
    return executor.execute(plan, rb, {"node": "omen2"})


def cluster(*pods: PodRef) -> FakeKube:
    kube = FakeKube([healthy_node()], clock=FakeClock())
    kube.pods = list(pods)
    return kube


def refused_by_budget() -> KubeError:
    return KubeError("Cannot evict pod as it would violate the pod's disruption budget.", status=429, retryable=True)


# -- which pods (kubectl drain's filters) -----------------------------------------------------------


@pytest.mark.parametrize(("p", "spec", "verdict", "why"), [
    (pod("ds", kind="DaemonSet"), {}, "refuse", "set ignore_daemonsets: true"),
    (pod("ds", kind="DaemonSet"), {"ignore_daemonsets": True}, "skip", "DaemonSet-managed"),
    (pod("kube-apiserver-omen2", kind="Node", mirror=True), {}, "skip", "mirror pod"),
    (pod("cache", empty_dir=("scratch",)), {}, "refuse", "emptyDir scratch"),
    (pod("cache", empty_dir=("scratch",)), {"delete_emptydir_data": True}, "evict", "emptyDir scratch deleted"),
    (pod("bare", kind=""), {}, "refuse", "set force: true"),
    (pod("bare", kind=""), {"force": True}, "evict", "unmanaged"),
    (pod("job", kind="", phase="Succeeded"), {}, "evict", "finished"),
    (pod("web-1"), {}, "evict", ""),
])
def test_each_pod_is_evicted_skipped_or_refused_as_kubectl_drain_decides(
        p: PodRef, spec: dict[str, Any], verdict: str, why: str) -> None:
    d = classify(p, rules(**spec))
    assert d.verdict == verdict
    assert why in d.reason


def test_evict_skips_daemonset_and_mirror_pods_but_refuses_nothing() -> None:
    effect = kv.kube_effect(parse_runbook(yaml.safe_dump({
        "apiVersion": "runbook/v1", "name": "e", "version": "1", "params": {"node": {"type": "node"}},
        "steps": [{"id": "e", "action": {"kube": {"evict": {}}}, "verify": [{"check": {"node_exists": True}}]}],
    }).encode(), "e.yaml").steps[0].action.kube, healthy_node())  # type: ignore[union-attr]
    assert isinstance(effect, kv.PodOperation) and not effect.rules.strict and not effect.rules.cordon
    assert classify(pod("ds", kind="DaemonSet"), effect.rules).verdict == "skip"
    assert classify(pod("m", kind="Node", mirror=True), effect.rules).verdict == "skip"
    assert classify(pod("bare", kind="", empty_dir=("x",)), effect.rules).verdict == "evict"


def test_pod_refs_read_owner_mirror_annotation_and_emptydir_at_the_connector_boundary() -> None:
    ref = pod_ref_from_dict({
        "metadata": {"namespace": "kube-system", "name": "fluentd-x", "uid": "u1",
                     "deletionTimestamp": "2026-01-01T00:00:00Z",
                     "annotations": {"kubernetes.io/config.mirror": "abc"},
                     "ownerReferences": [{"kind": "Foo", "name": "f"}, {"kind": "DaemonSet", "name": "fluentd",
                                                                         "controller": True}]},
        "spec": {"nodeName": "omen2", "containers": [],
                 "volumes": [{"name": "cache", "emptyDir": {}}, {"name": "cfg", "configMap": {"name": "c"}}]},
    })
    assert (ref.controller_kind, ref.controller_name, ref.mirror, ref.empty_dir, ref.deleting, ref.uid) == \
        ("DaemonSet", "fluentd", True, ("cache",), True, "u1")


# -- the Eviction API version (discovery) ------------------------------------------------------------


def test_the_eviction_version_is_the_one_discovery_names_for_pods_eviction() -> None:
    v122 = {"resources": [{"name": "pods", "kind": "Pod"},
                          {"name": "pods/eviction", "group": "policy", "version": "v1", "kind": "Eviction"}]}
    v120 = {"resources": [{"name": "pods/eviction", "group": "policy", "version": "v1beta1", "kind": "Eviction"}]}
    assert eviction_version_from_discovery(v122) == "policy/v1"
    assert eviction_version_from_discovery(v120) == "policy/v1beta1"
    assert eviction_version_from_discovery({"resources": [{"name": "pods"}]}) is None


# -- a drain run -----------------------------------------------------------------------------------


def test_a_drain_cordons_first_retries_budget_refusals_and_leaves_daemonset_and_mirror_pods() -> None:
    web1, web2 = pod("web-1"), pod("web-2")
    ds, mirror = pod("fluentd-x", kind="DaemonSet", ns="kube-system"), pod("etcd-omen2", kind="Node", mirror=True)
    kube = cluster(web1, web2, ds, mirror)
    kube.fail["evict_pod"] = [None, refused_by_budget(), refused_by_budget(), None]  # web-2 refused twice
    result = run(drain_runbook({"ignore_daemonsets": True, "timeout": "60s"}), kube)
    assert result.state is RunState.SUCCEEDED, result.reason
    assert kube.nodes["omen2"].unschedulable
    names = [c[0] for c in kube.calls]
    assert names.index("patch_node") < names.index("evict_pod"), "cordon comes first"
    assert [p.name for p in kube.evicted] == ["web-1", "web-2"]
    assert kube.pods == [ds, mirror]
    ev = result.outcomes[0].evidence["action"]
    assert ev["pods"] == ["web/web-1", "web/web-2"] and ev["refusals"] == {"web/web-2": 2}
    assert ev["eviction_api"] == "policy/v1" and ev["cordoned"] is True
    assert {s["pod"] for s in ev["skipped"]} == {"kube-system/fluentd-x", "web/etcd-omen2"}
    assert kube.clock.sleeps[:2] == [1.0, 2.0], "backoff between refused rounds"
    assert ("wait_for_pods_gone", (["web/web-1", "web/web-2"], 15.0)) in kube.calls  # watched in 15 s chunks


def test_a_drain_refused_by_an_unmanaged_pod_evicts_nothing_and_says_which_and_why() -> None:
    kube = cluster(pod("web-1"), pod("bare", kind=""), pod("ds", kind="DaemonSet"))
    result = run(drain_runbook({}), kube)
    assert result.state is RunState.FAILED
    assert kube.evicted == [] and kube.nodes["omen2"].unschedulable  # cordoned, as kubectl leaves it
    ev = result.outcomes[0].evidence["action"]
    assert {r["pod"] for r in ev["refused"]} == {"web/bare", "web/ds"}
    assert "set force: true" in result.outcomes[0].reason and "ignore_daemonsets" in result.outcomes[0].reason


def test_a_budget_that_keeps_refusing_fails_the_drain_at_its_timeout() -> None:
    kube = cluster(pod("web-1"))
    kube.fail["evict_pod"] = [refused_by_budget() for _ in range(100)]
    result = run(drain_runbook({"timeout": "20s"}), kube)
    assert result.state is RunState.FAILED
    assert "timed out after 20s: a disruption budget still refuses web/web-1" in result.outcomes[0].reason
    assert result.outcomes[0].evidence["action"]["refusals"]["web/web-1"] >= 5
    assert sum(kube.clock.sleeps) == pytest.approx(20.0) and max(kube.clock.sleeps) <= 5.0
    assert kube.pods and kube.evicted == []


def test_a_cancelled_drain_stops_retrying_and_ends_cancelled_with_its_evidence() -> None:
    from engine.model import StepStatus

    kube = cluster(pod("web-1"), pod("web-2"))
    kube.fail["evict_pod"] = [None] + [refused_by_budget() for _ in range(100)]
    cancel = threading.Event()
    kube.clock.after(4, cancel.set)
    result = run(drain_runbook({"timeout": "10m"}), kube, cancel)
    assert result.state is RunState.CANCELLED
    outcome = result.outcomes[0]
    assert outcome.status is StepStatus.CANCELLED and "drain cancelled with 1 pod(s) left" in outcome.reason
    assert outcome.evidence["action"]["pods"] == ["web/web-1"] and kube.clock.now() < 1000 + 10


def test_disable_eviction_deletes_with_the_grace_period_instead() -> None:
    kube = cluster(pod("web-1"))
    result = run(drain_runbook({"disable_eviction": True, "grace_period": 7}), kube)
    assert result.state is RunState.SUCCEEDED, result.reason
    assert [p.name for p in kube.deleted] == ["web-1"] and kube.evicted == []
    assert ("eviction_version", None) not in kube.calls


def test_the_drain_waits_for_the_pods_to_be_gone_by_watching_not_sleeping() -> None:
    kube = cluster(pod("web-1"))
    kube.pods_linger = 12.0  # terminating for 12 s after the eviction
    start = kube.clock.now()
    result = run(drain_runbook({"timeout": "60s"}), kube)
    assert result.state is RunState.SUCCEEDED, result.reason
    assert result.outcomes[0].evidence["action"]["gone_after"] == pytest.approx(12.0)
    assert kube.clock.sleeps == [] and kube.clock.now() - start >= 12.0


def test_pods_that_outlive_the_timeout_fail_the_drain() -> None:
    kube = cluster(pod("web-1"))
    kube.pods_linger = 100.0
    result = run(drain_runbook({"timeout": "30s"}), kube)
    assert result.state is RunState.FAILED
    assert "1 pod(s) still on omen2 after 30s: web/web-1" in result.outcomes[0].reason


def test_the_grace_period_extends_the_wait_beyond_the_timeout() -> None:
    kube = cluster(pod("web-1"))
    kube.pods_linger = 45.0
    result = run(drain_runbook({"timeout": "30s", "grace_period": 60}), kube)
    assert result.state is RunState.SUCCEEDED, result.reason


def test_verification_fails_when_an_evictable_pod_is_still_on_the_node() -> None:
    kube = cluster(pod("web-1"))
    latecomer = pod("web-late")
    kube.clock.after(0.0, lambda: None)

    def arrive(_: Any = None) -> None:
        kube.pods.append(latecomer)  # bound to the node despite the cordon (a controller ignoring it)

    original = kube.wait_for_pods_gone

    def gone_then_arrive(pods: Any, timeout: float) -> list[PodRef]:
        left = original(pods, timeout)
        arrive()
        return left

    kube.wait_for_pods_gone = gone_then_arrive  # type: ignore[method-assign]
    result = run(drain_runbook({}), kube)
    assert result.state is RunState.FAILED
    assert "pods still on omen2: web/web-late" in result.outcomes[0].reason
    assert result.outcomes[0].evidence["action"]["left"] == ["web/web-late"]


def test_a_drain_step_verifies_itself_and_loads_without_a_verify_list() -> None:
    rb = drain_runbook({"ignore_daemonsets": True})
    assert rb.steps[0].mutating and not rb.steps[0].verify
    plan = plan_run(rb, {"node": "omen2"}, probes.gather(rb, {"node": "omen2"}, "omen2", cluster(), FakeNodes({})),
                    runbook_digest="d" * 64, now=NOW)
    step = plan.step("drain")
    assert step.kind == "change" and step.command.startswith("kubectl drain omen2 --ignore-daemonsets")
    assert [c.path for c in step.changes] == ["node.unschedulable"]


# -- the preview -------------------------------------------------------------------------------------


def test_the_plan_preview_lists_each_pod_with_its_fate_and_dry_runs_each_eviction() -> None:
    from engine import output
    from engine.loader import LoadedRunbook
    from engine.params import PreparedRun
    from engine.previews import preview_plan

    kube = cluster(pod("web-1"), pod("ds", kind="DaemonSet"), pod("etcd-omen2", kind="Node", mirror=True))
    kube.fail["evict_pod"] = [refused_by_budget()]
    rb = drain_runbook({"ignore_daemonsets": True})
    prepared = PreparedRun(LoadedRunbook(rb, Path("drain-node.yaml"), "d" * 64, PLAYBOOKS), {"node": "omen2"}, "omen2")
    facts = probes.gather(rb, {"node": "omen2"}, "omen2", kube, FakeNodes({}))
    plan = preview_plan(plan_run(rb, {"node": "omen2"}, facts, runbook_digest="d" * 64, now=NOW),
                        prepared, kube, None, facts=facts)
    lines = (plan.step("drain").preview or "").splitlines()
    assert lines[0] == "cordon omen2"
    assert "skip web/ds: DaemonSet-managed (ds-owner): it would come back here" in lines
    assert "skip web/etcd-omen2: mirror pod of a static pod (the kubelet owns it)" in lines
    assert any(ln.startswith("server dry-run REJECTED: evict web/web-1: Cannot evict pod") for ln in lines)
    assert kube.evicted == [] and not kube.nodes["omen2"].unschedulable
    assert all(c[1] is not None for c in kube.calls if c[0] == "evict_pod")
    kube.fail["evict_pod"] = []
    plan = preview_plan(plan_run(rb, {"node": "omen2"}, facts, runbook_digest="d" * 64, now=NOW),
                        prepared, kube, None, facts=facts)
    assert "server dry-run accepted: evict web/web-1" in (plan.step("drain").preview or "")
    assert "would evict web/web-1" in output.plan_text(plan)
    assert kube.evicted == []


def test_the_preview_names_the_pods_that_refuse_the_drain() -> None:
    from engine.kube_verbs.effects import KubeContext

    kube = cluster(pod("web-1"), pod("bare", kind=""))
    effect = kv.kube_effect(KubeDrain(drain=DrainSpec()), healthy_node())
    assert isinstance(effect, kv.PodOperation)
    text = kv.preview(effect, KubeContext(kube, "omen2", kube.clock, kube.clock.sleep, threading.Event()))
    assert "REFUSED web/bare: not managed by a controller" in text
    assert "not tried web/web-1: the drain is refused" in text
    from engine.output import preview_gist

    assert preview_gist(text) == "drain refused by web/bare"
    assert not any(c[0] == "evict_pod" for c in kube.calls)


# -- wait on a condition ---------------------------------------------------------------------------


def wait_runbook(wait: dict[str, Any]) -> Runbook:
    doc = {"apiVersion": "runbook/v1", "name": "wait-ready", "version": "1",
           "params": {"node": {"type": "node", "required": True}},
           "steps": [{"id": "wait", "action": {"kube": {"wait": wait}}}]}
    return parse_runbook(yaml.safe_dump(doc).encode(), "wait-ready.yaml", playbooks_dir=PLAYBOOKS)


def test_wait_until_watches_for_the_condition_instead_of_sleeping() -> None:
    kube = cluster()
    kube.set_ready("omen2", False)
    kube.clock.after(7, lambda: kube.set_ready("omen2", True))
    start = kube.clock.now()
    result = run(wait_runbook({"until": {"node_ready": True}, "timeout": "2m"}), kube)
    assert result.state is RunState.SUCCEEDED, result.reason
    assert kube.clock.now() - start == pytest.approx(7.0)
    assert kube.clock.sleeps == [] and any(c[0] == "wait_for_node" for c in kube.calls)


def test_wait_until_fails_with_the_last_observation_at_its_timeout() -> None:
    kube = cluster()
    kube.set_ready("omen2", False)
    result = run(wait_runbook({"until": {"node_ready": True}, "timeout": "30s"}), kube)
    assert result.state is RunState.FAILED
    assert "wait up to 30s until node is Ready: not by the timeout" in result.outcomes[0].reason


def test_the_old_wait_seconds_form_still_pauses() -> None:
    kube = cluster()
    result = run(wait_runbook({"seconds": 5}), kube)
    assert result.state is RunState.SUCCEEDED
    assert sum(kube.clock.sleeps) == pytest.approx(5.0)


@pytest.mark.parametrize(("wait", "message"), [
    ({"seconds": 5, "until": {"node_ready": True}}, "either 'until'"),
    ({}, "either 'until'"),
    ({"seconds": 5, "timeout": "10s"}, "'timeout' goes with 'until'"),
])
def test_a_wait_takes_one_form(wait: dict[str, Any], message: str) -> None:
    with pytest.raises(LoadError, match=message):
        wait_runbook(wait)
