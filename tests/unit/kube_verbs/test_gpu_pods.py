"""GPU pods: ``evict: {resource: nvidia.com/gpu}`` selects the node's pods asking for that resource;
``objects`` checks filter by ``resource`` (pods, VMs, VMIs); reports read the object lists they name."""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from engine import checks as chk
from engine import probes
from engine.actions import kube_effect, select_pods
from engine.checks import ObjectsCheck, ObjectsSpec
from engine.connectors.base import PodRef
from engine.connectors.kube import pod_ref_from_dict
from engine.execution import Executor
from engine.facts import Facts, NodeFacts
from engine.kube_verbs import KubeContext, NoOp
from engine.kube_verbs import apply as kv_apply
from engine.kube_verbs.evict import KubeDeletePods, KubeEvict, PodSelectorSpec
from engine.loader import parse_runbook
from engine.model import RunState, StepStatus
from engine.planning import plan_run
from tests.fakes import FakeClock, FakeKube, FakeNodes, RecordingSink, healthy_host, healthy_node

PLAYBOOKS = Path(__file__).resolve().parents[1] / "data" / "playbooks"
NOW = datetime(2026, 7, 10, 15, 40, tzinfo=UTC)
GPU = "nvidia.com/gpu"
RTX = "nvidia.com/GB202_GEFORCE_RTX_5090"


def pod(name: str, requests: dict[str, str] | None = None, *, node: str = "omen2", namespace: str = "ml",
        phase: str = "Running") -> PodRef:
    return PodRef(namespace, name, node, {}, phase, requests or {})


def pod_object(name: str, containers: list[dict[str, Any]], *, node: str = "omen2", phase: str = "Running",
               init: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"nodeName": node, "containers": containers}
    if init:
        spec["initContainers"] = init
    return {"metadata": {"namespace": "ml", "name": name}, "spec": spec, "status": {"phase": phase}}


def vm_object(name: str, device: str | None, status: str = "ErrorUnschedulable") -> dict[str, Any]:
    devices: dict[str, Any] = {"disks": []}
    if device:
        devices["hostDevices"] = [{"name": "gpu1", "deviceName": device}]
    return {"metadata": {"namespace": "gpu-vms", "name": name},
            "spec": {"template": {"spec": {"domain": {"devices": devices}}}},
            "status": {"printableStatus": status}}


# -- selecting pods ---------------------------------------------------------------------------------


def test_pod_refs_carry_what_their_containers_ask_for_requests_else_limits() -> None:
    ref = pod_ref_from_dict(pod_object("train", [
        {"name": "a", "resources": {"limits": {GPU: "1"}, "requests": {"cpu": "500m"}}},
        {"name": "b", "resources": {"requests": {GPU: "2", "cpu": "1"}, "limits": {GPU: "2"}}},
        {"name": "c"},
    ]))
    assert dict(ref.requests) == {GPU: "3", "cpu": "1.5"}  # engine.resources sums 500m + 1
    assert ref.node == "omen2" and ref.phase == "Running"


def test_eviction_by_resource_selects_only_live_pods_asking_for_it() -> None:
    pods = [pod("train", {GPU: "1"}), pod("web", {"cpu": "1"}), pod("zero", {GPU: "0"}),
            pod("done", {GPU: "1"}, phase="Succeeded"), pod("vm", {RTX: "1"}), pod("split", {GPU: "1.0"})]
    chosen = select_pods(PodSelectorSpec(resource=GPU), pods)
    assert [p.name for p in chosen] == ["train", "split"]
    assert [p.name for p in select_pods(PodSelectorSpec(resource=RTX), pods)] == ["vm"]
    assert select_pods(PodSelectorSpec(), pods) == pods  # no resource: every listed pod


def test_the_effect_names_the_resource_and_gives_an_equivalent_command() -> None:
    effect = kube_effect(KubeEvict(evict=PodSelectorSpec(resource=GPU)), NodeFacts("omen2"))
    assert effect.summary == f"evict pods on omen2 asking for {GPU}"  # type: ignore[union-attr]
    assert "spec.nodeName=omen2" in effect.command and f'has("{GPU}")' in effect.command
    delete = kube_effect(KubeDeletePods(delete_pods=PodSelectorSpec(resource=GPU, grace_seconds=0)), NodeFacts("omen2"))
    assert "kubectl delete pod" in delete.command and "--grace-period=0" in delete.command


RUNBOOK = parse_runbook(b"""apiVersion: runbook/v1
name: evict-gpu-pods
version: "1"
params:
  node: {type: node, required: true}
steps:
  - id: evict
    action: {kube: {evict: {resource: nvidia.com/gpu}}}
    verify:
      - check: {objects: {api_version: v1, kind: Pod, resource: nvidia.com/gpu, field: spec.nodeName,
                          equals: "{{ params.node }}", max: 0}}
        timeout: 30s
""", "evict-gpu-pods.yaml", playbooks_dir=PLAYBOOKS)


def test_a_run_evicts_the_gpu_pods_of_the_node_and_leaves_the_others() -> None:
    clock = FakeClock()
    kube = FakeKube([healthy_node()], clock=clock)
    kube.pods = [pod("train", {GPU: "1"}), pod("web", {"cpu": "1"}), pod("elsewhere", {GPU: "1"}, node="n2")]
    kube.objects[("v1", "pods")] = [pod_object("train", [{"resources": {"limits": {GPU: "1"}}}])]

    def evicted(p: PodRef) -> None:
        kube.objects[("v1", "pods")] = []

    nodes = FakeNodes({"omen2": healthy_host()}, clock=clock)
    facts = probes.gather(RUNBOOK, {"node": "omen2"}, "omen2", kube, nodes)
    plan = plan_run(RUNBOOK, {"node": "omen2"}, facts, runbook_digest="d" * 64, now=NOW)
    assert plan.step("evict").summary == f"evict pods on omen2 asking for {GPU}"
    clock.after(5, lambda: evicted(kube.pods[0]))
    executor = Executor(kube, nodes, events=RecordingSink(), playbooks_dir=PLAYBOOKS, clock=clock, sleep=clock.sleep,
                        wall=clock.wall, cancel=threading.Event())
    result = executor.execute(plan, RUNBOOK, {"node": "omen2"})
    assert result.state is RunState.SUCCEEDED, result.reason
    assert [p.name for p in kube.evicted] == ["train"]
    assert result.outcomes[0].status is StepStatus.SUCCEEDED
    assert result.outcomes[0].evidence["action"]["pods"] == ["ml/train"]


UID_A, UID_B = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", "11111111-2222-3333-4444-555555555555"


def test_eviction_by_pod_uid_selects_exactly_those_pods_and_an_empty_list_selects_none() -> None:
    pods = [replace(pod("a", {GPU: "1"}), uid=UID_A), replace(pod("b", {GPU: "1"}), uid=UID_B), pod("no-uid")]
    assert [p.name for p in select_pods(PodSelectorSpec(pod_uids=f" {UID_B} ,"), pods)] == ["b"]
    assert [p.name for p in select_pods(PodSelectorSpec(pod_uids=f"{UID_A},{UID_B}", resource=GPU), pods)] == ["a", "b"]
    assert select_pods(PodSelectorSpec(pod_uids="ffffffff-0000-0000-0000-000000000000"), pods) == []
    effect = kube_effect(KubeEvict(evict=PodSelectorSpec(pod_uids=UID_A)), NodeFacts("omen2"))
    assert effect.summary == f"evict pods on omen2 with UID {UID_A}"  # type: ignore[union-attr]
    assert f'.metadata.uid == "{UID_A}"' in effect.command
    # rendered empty (no pod holds the GPU): nothing to evict, never every pod of the node
    assert isinstance(kube_effect(KubeEvict(evict=PodSelectorSpec(pod_uids=" ")), NodeFacts("omen2")), NoOp)


def test_an_eviction_by_uid_evicts_only_that_pod_through_the_api() -> None:
    clock = FakeClock()
    kube = FakeKube([healthy_node()], clock=clock)
    kube.pods = [replace(pod("on-faulty-gpu", {GPU: "1"}), uid=UID_A, controller_kind="ReplicaSet"),
                 replace(pod("on-other-gpu", {GPU: "1"}), uid=UID_B, controller_kind="ReplicaSet")]
    effect = kube_effect(KubeEvict(evict=PodSelectorSpec(pod_uids=UID_A, timeout="30s")), NodeFacts("omen2"))
    ctx = KubeContext(kube, "omen2", clock, clock.sleep, threading.Event())
    evidence = kv_apply(effect, ctx)  # type: ignore[arg-type]
    assert [p.name for p in kube.evicted] == ["on-faulty-gpu"] and evidence["pods"] == ["ml/on-faulty-gpu"]


# -- objects asking for a resource ----------------------------------------------------------------


def objects_check(**spec: Any) -> ObjectsCheck:
    return ObjectsCheck(objects=ObjectsSpec(api_version="v1", kind="Pod", **spec))


def facts_with(key: str, objs: list[dict[str, Any]]) -> Facts:
    return Facts(node_name="omen2", objects={key: tuple(objs)})


def test_objects_checks_count_only_objects_asking_for_the_resource() -> None:
    pods = [pod_object("train", [{"resources": {"limits": {GPU: "1"}}}]),
            pod_object("init-gpu", [{}], init=[{"resources": {"requests": {GPU: "1"}}}]),
            pod_object("web", [{"resources": {"requests": {"cpu": "1"}}}]),
            pod_object("finished", [{"resources": {"limits": {GPU: "1"}}}], phase="Succeeded"),
            pod_object("other-node", [{"resources": {"limits": {GPU: "1"}}}], node="n2")]
    check = objects_check(resource=GPU, field="spec.nodeName", equals="omen2", max=0)
    r = chk.evaluate(check, facts_with("v1/pods", pods))
    assert r.holds is False
    assert r.observed == f"2 of 5 Pod asking for {GPU} with spec.nodeName=omen2: ml/train, ml/init-gpu"
    assert chk.describe(check) == f"at most 0 Pod asking for {GPU} with spec.nodeName = omen2"


def test_vms_ask_for_their_host_devices() -> None:
    vms = [vm_object("gpu-fedora", RTX), vm_object("web", None, "Running"), vm_object("rhel9-gpu-vm", RTX)]
    check = ObjectsCheck(objects=ObjectsSpec(api_version="kubevirt.io/v1", kind="VirtualMachine", resource=RTX,
                                             field="status.printableStatus", equals="ErrorUnschedulable"))
    r = chk.evaluate(check, facts_with("kubevirt.io/v1/virtualmachines", vms))
    assert r.holds is True and r.evidence["matching"] == ["gpu-vms/gpu-fedora", "gpu-vms/rhel9-gpu-vm"]
    assert chk.object_resources(vms[0]) == {RTX: 1}


def test_planning_predicts_that_no_matching_object_remains_after_a_max_zero_verify() -> None:
    pods = [pod_object("train", [{"resources": {"limits": {GPU: "1"}}}]), pod_object("web", [{}])]
    check = objects_check(resource=GPU, field="spec.nodeName", equals="omen2", max=0)
    after = chk.establish(check, facts_with("v1/pods", pods))
    assert [o["metadata"]["name"] for o in after.objects["v1/pods"]] == ["web"]
    assert chk.evaluate(check, after).holds is True
    at_least = objects_check(resource=GPU, min=1)  # objects are never invented
    assert chk.establish(at_least, facts_with("v1/pods", [])) == facts_with("v1/pods", [])


# -- reports name the object lists they read --------------------------------------------------------


def test_object_keys_round_trip_to_queries() -> None:
    for q in (chk.ObjectsQuery("kubevirt.io/v1", "virtualmachines"), chk.ObjectsQuery("v1", "pods", "gpu-operator"),
              chk.ObjectsQuery("v1", "pods", "gpu-operator", "app=x"), chk.ObjectsQuery("v1", "pods", None, "a=b")):
        assert chk.ObjectsQuery.from_key(q.key) == q
    assert chk.ObjectsQuery.from_key("nonsense") is None


def test_a_report_gets_the_object_lists_it_names() -> None:
    src = ("{% for vm in facts.objects.get('kubevirt.io/v1/virtualmachines', []) %}{{ vm.metadata.name }} "
           "{% endfor %}{{ facts.host.gpu_driver }}")
    assert chk.template_probes(src) == {chk.HOST, chk.ObjectsQuery("kubevirt.io/v1", "virtualmachines")}


def test_the_executor_renders_a_report_over_the_objects_it_names() -> None:
    rb = parse_runbook(b"""apiVersion: runbook/v1
name: vms
version: "1"
params:
  node: {type: node, required: true}
steps:
  - id: look
    action: {check: {}}
    verify: [{check: {node_ready: true}}]
report: >-
  {% for vm in facts.objects['kubevirt.io/v1/virtualmachines'] %}{{ vm.metadata.name
  }}={{ vm.status.printableStatus }} {% endfor %}
""", "vms.yaml", playbooks_dir=PLAYBOOKS)
    clock = FakeClock()
    kube = FakeKube([healthy_node()], clock=clock)
    kube.objects[("kubevirt.io/v1", "virtualmachines")] = [vm_object("gpu-fedora", RTX, "Running"),
                                                           vm_object("rhel9-gpu-vm", RTX)]
    nodes = FakeNodes({"omen2": healthy_host()}, clock=clock)
    plan = plan_run(rb, {"node": "omen2"}, probes.gather(rb, {"node": "omen2"}, "omen2", kube, nodes),
                    runbook_digest="d" * 64, now=NOW)
    executor = Executor(kube, nodes, events=RecordingSink(), playbooks_dir=PLAYBOOKS, clock=clock, sleep=clock.sleep,
                        wall=clock.wall, cancel=threading.Event())
    result = executor.execute(plan, rb, {"node": "omen2"})
    assert result.report.strip() == "gpu-fedora=Running rhel9-gpu-vm=ErrorUnschedulable"


def test_the_plan_previews_each_eviction_with_a_server_dry_run_and_evicts_nothing() -> None:
    from engine import output
    from engine.loader import LoadedRunbook
    from engine.params import PreparedRun
    from engine.previews import preview_plan

    kube = FakeKube([healthy_node()])
    kube.pods = [pod("train", {GPU: "1"}), pod("web", {"cpu": "1"})]
    nodes = FakeNodes({"omen2": healthy_host()})
    prepared = PreparedRun(LoadedRunbook(RUNBOOK, Path("evict-gpu-pods.yaml"), "d" * 64, PLAYBOOKS),
                               {"node": "omen2"}, "omen2")
    facts = probes.gather(RUNBOOK, {"node": "omen2"}, "omen2", kube, nodes)
    plan = preview_plan(plan_run(RUNBOOK, {"node": "omen2"}, facts, runbook_digest="d" * 64, now=NOW),
                            prepared, kube, nodes, facts=facts)
    assert plan.step("evict").preview == "server dry-run accepted: evict ml/train"
    assert ("evict_pod", kube.pods[0]) in kube.calls and kube.evicted == []
    assert "-- would evict ml/train" in output.plan_text(plan)
