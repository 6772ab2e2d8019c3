"""The RunbookRemediation reconciler (engine.serve.remediator) over our fakes: the real dispatcher and
app (tests.fakes.served) with a fake run starter, RunbookRemediation objects in tests.fakes'
FakeKube. Each decision: which node, one run per object through the dispatcher, the conditions NHC
reads, the finalizer, cancellation on delete and on nhc-timed-out, MHC's Machine annotations."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from engine.serve.remediator import (
    API_VERSION,
    FINALIZER,
    PLURAL,
    Remediator,
    parse_remediation,
    report_for_run,
)
from tests.fakes import FakeKube, FakeLeadership, FakeRunStarter, Served, make_node, served, trigger_spec

NS = "runbook-system"
KEY = (API_VERSION, PLURAL)


def nhc_object(node: str = "omen2", *, mode: str = "auto", name: str | None = None,
               annotations: Mapping[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "RunbookRemediation",
            "metadata": {"name": name or node, "namespace": NS, "uid": f"uid-{name or node}", "resourceVersion": "1",
                         "generation": 1,
                         "annotations": {"remediation.medik8s.io/node-name": node,
                                         "remediation.medik8s.io/template-name": "gpu-recovery",
                                         **dict(annotations or {})},
                         "ownerReferences": [{"apiVersion": "remediation.medik8s.io/v1alpha1",
                                              "kind": "NodeHealthCheck", "name": "nhc-gpu", "uid": "u1"}]},
            "spec": {"runbook": "gpu-node-recovery", "mode": mode, **spec}}


def mhc_object(machine: str = "pool-abc") -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "RunbookRemediation",
            "metadata": {"name": machine, "namespace": NS, "uid": f"uid-{machine}", "resourceVersion": "1",
                         "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta1", "kind": "Machine",
                                              "name": machine, "uid": "m1"}]},
            "spec": {"runbook": "gpu-node-recovery", "mode": "auto"}}


def machine(name: str = "pool-abc", node: str | None = "omen3", **annotations: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": NS, "annotations": dict(annotations), "resourceVersion": "1"},
            "status": {"nodeRef": {"name": node}} if node else {}}


class World:
    def __init__(self, s: Served, kube: FakeKube, remediator: Remediator, leader: FakeLeadership) -> None:
        self.s, self.kube, self.remediator, self.leader = s, kube, remediator, leader

    def add(self, obj: dict[str, Any]) -> None:
        self.kube.objects.setdefault(KEY, []).append(obj)

    def obj(self, name: str) -> dict[str, Any] | None:
        return self.kube.read_object(API_VERSION, PLURAL, NS, name)

    def conditions(self, name: str) -> dict[str, tuple[str, str]]:
        obj = self.obj(name)
        assert obj is not None
        return {c["type"]: (c["status"], c["reason"]) for c in (obj.get("status") or {}).get("conditions") or ()}

    def delete(self, name: str) -> None:
        for o in self.kube.objects[KEY]:
            if o["metadata"]["name"] == name:
                o["metadata"]["deletionTimestamp"] = "2026-12-03T17:00:00Z"

    def settle(self) -> None:
        self.remediator.reconcile_all()
        self.s.idle()
        self.remediator.reconcile_all()


@pytest.fixture
def world() -> Iterator[World]:
    starter = FakeRunStarter([trigger_spec(mode="approve", matchers=('node=~"omen.*"',))])
    with served("auto", starter=starter) as s:
        kube = FakeKube()
        leader = FakeLeadership(leading=True)
        remediator = Remediator(lambda: kube, s.dispatcher, starter, leader, interval=60)
        yield World(s, kube, remediator, leader)


def test_an_nhc_object_gets_the_finalizer_and_one_run_on_the_annotated_node_then_succeeded_true(
        world: World) -> None:
    world.add(nhc_object("omen2", name="omen2-x7k"))  # generateName: the node comes from the annotation
    world.remediator.reconcile_all()
    obj = world.obj("omen2-x7k")
    assert obj is not None and FINALIZER in obj["metadata"]["finalizers"]
    (request,) = world.s.starter.requests
    assert (request.node, request.source, request.mode, request.require_diagnosis) == (
        "omen2", "remediation", "auto", True)
    assert "NodeHealthCheck nhc-gpu" in request.reason and request.dedup_key == "remediation-uid-omen2-x7k"
    assert obj["status"]["runName"] == world.s.starter.runs()[0]["id"]
    assert world.conditions("omen2-x7k")["Processing"][0] == "True"
    world.settle()
    assert world.conditions("omen2-x7k") == {"Processing": ("False", "RunSucceeded"),
                                              "Succeeded": ("True", "RunSucceeded")}
    world.remediator.reconcile_all()
    assert len(world.s.starter.requests) == 1  # one run per object, however often it is reconciled


def test_a_failed_run_reports_succeeded_false_with_its_reason_so_nhc_escalates_at_once(world: World) -> None:
    world.s.starter.outcome = lambda run: "failed"
    world.add(nhc_object("omen2"))
    world.settle()
    assert world.conditions("omen2") == {"Processing": ("False", "RunFailed"), "Succeeded": ("False", "RunFailed")}
    obj = world.obj("omen2")
    assert obj is not None and obj["status"]["phase"] == "Failed"


def test_a_diagnosis_that_does_not_match_is_the_reason_of_succeeded_false() -> None:
    run = {"state": "blocked", "outcome_reason": "diagnosis swap (gpu-node-recovery) does not match gpu-3090-2: x",
           "events": [{"kind": "diagnosis", "matched": False,
                       "reason": "diagnosis swap (gpu-node-recovery) does not match gpu-3090-2: x"}]}
    report = report_for_run(run, run_name="r-1", node="gpu-3090-2")
    assert (report.succeeded, report.processing, report.reason) == (False, False, "DiagnosisDidNotMatch")
    assert report.message.startswith("diagnosis swap (gpu-node-recovery) does not match gpu-3090-2")
    blocked = report_for_run({"state": "blocked", "outcome_reason": "guard nvsentinel: quarantined"},
                             run_name="r-2", node="n")
    assert (blocked.succeeded, blocked.reason, blocked.message) == (
        False, "RunBlocked", "guard nvsentinel: quarantined")


def test_a_refused_start_is_reported_once_and_never_retried(world: World) -> None:
    world.s.cluster.nodes = [n for n in world.s.cluster.nodes if n.name != "omen5"]
    world.s.cluster.nodes.append(make_node("omen5", labels={"runbook.io/exclude": "true"}))
    world.add(nhc_object("omen5"))
    world.remediator.reconcile_all()
    status, reason = world.conditions("omen5")["Succeeded"]
    assert (status, reason) == ("False", "Blocked")
    assert world.s.starter.requests == []
    world.remediator.reconcile_all()
    assert world.s.starter.requests == []
    assert world.conditions("omen5")["Succeeded"] == ("False", "Blocked")  # the first answer stands


def test_deleting_the_object_cancels_its_active_run_and_then_removes_the_finalizer(world: World) -> None:
    world.add(nhc_object("omen2", mode="approve"))
    world.settle()
    run_id = world.obj("omen2")["status"]["runName"]  # type: ignore[index]
    assert world.s.starter.run(run_id)["state"] == "waiting-approval"
    assert world.conditions("omen2")["Processing"] == ("True", "WaitingApproval")
    world.delete("omen2")
    world.remediator.reconcile_all()
    assert world.s.starter.cancels and world.s.starter.cancels[0][0] == run_id
    assert "was deleted" in world.s.starter.cancels[0][1]
    obj = world.obj("omen2")
    assert obj is not None and FINALIZER not in obj["metadata"].get("finalizers", [])


def test_a_run_still_active_after_the_cancel_keeps_the_finalizer_until_it_ends(world: World) -> None:
    gate = threading.Event()
    world.s.starter.outcome = lambda run: "cancelled" if gate.wait(5) else "succeeded"
    world.s.starter.cancel = lambda run_id, reason: "cancelling"  # type: ignore[method-assign]
    world.add(nhc_object("omen2"))
    world.remediator.reconcile_all()
    run_id = world.obj("omen2")["status"]["runName"]  # type: ignore[index]
    world.s.starter.set_state(run_id, "running")
    world.delete("omen2")
    world.remediator.reconcile_all()
    assert FINALIZER in world.obj("omen2")["metadata"]["finalizers"]  # type: ignore[index]
    gate.set()
    world.s.idle()
    world.remediator.reconcile_all()
    assert FINALIZER not in world.obj("omen2")["metadata"].get("finalizers", [])  # type: ignore[index]


def test_nhc_timed_out_cancels_the_run_and_reports_timed_out(world: World) -> None:
    world.add(nhc_object("omen2", mode="approve"))
    world.settle()
    for o in world.kube.objects[KEY]:
        o["metadata"]["annotations"]["remediation.medik8s.io/nhc-timed-out"] = "2026-12-03T17:00:00Z"
    world.remediator.reconcile_all()
    assert world.s.starter.cancels
    assert world.conditions("omen2") == {"Processing": ("False", "TimedOut"), "Succeeded": ("False", "TimedOut")}


def test_timed_out_before_any_run_starts_nothing(world: World) -> None:
    world.add(nhc_object("omen2", annotations={"remediation.medik8s.io/nhc-timed-out": "now"}))
    world.remediator.reconcile_all()
    assert world.s.starter.requests == []
    assert world.conditions("omen2")["Succeeded"] == ("False", "TimedOut")


def test_an_mhc_object_remediates_the_machines_node(world: World) -> None:
    world.kube.objects[("cluster.x-k8s.io/v1beta1", "machines")] = [machine(node="omen3")]
    world.add(mhc_object())
    world.remediator.reconcile_all()
    (request,) = world.s.starter.requests
    assert request.node == "omen3" and "Machine pool-abc" in request.reason


@pytest.mark.parametrize(("annotation", "condition", "phase"), [
    ("cluster.x-k8s.io/skip-remediation", ("False", "SkipRemediation"), "Skipped"),
    ("cluster.x-k8s.io/paused", ("Unknown", "Paused"), "Paused"),
])
def test_mhc_skip_remediation_and_paused_start_nothing(world: World, annotation: str, condition: tuple[str, str],
                                                       phase: str) -> None:
    world.kube.objects[("cluster.x-k8s.io/v1beta1", "machines")] = [machine(**{annotation: ""})]
    world.add(mhc_object())
    world.remediator.reconcile_all()
    assert world.s.starter.requests == []
    assert world.conditions("pool-abc")["Succeeded"] == condition
    assert world.obj("pool-abc")["status"]["phase"] == phase  # type: ignore[index]


def test_a_machine_without_a_node_ref_waits(world: World) -> None:
    world.kube.objects[("cluster.x-k8s.io/v1beta1", "machines")] = [machine(node=None)]
    world.add(mhc_object())
    world.remediator.reconcile_all()
    assert world.s.starter.requests == []
    assert world.conditions("pool-abc")["Succeeded"] == ("Unknown", "WaitingForNodeRef")


def test_an_invalid_spec_is_reported_and_never_run(world: World) -> None:
    world.add(nhc_object("omen2", mode="sometimes", params={"node": ["a"]}))
    world.remediator.reconcile_all()
    assert world.s.starter.requests == []
    assert world.conditions("omen2")["Succeeded"] == ("False", "InvalidSpec")
    msg = next(c["message"] for c in world.obj("omen2")["status"]["conditions"])  # type: ignore[index]
    assert "spec.mode" in msg and "spec.params.node" in msg


def test_a_follower_does_nothing(world: World) -> None:
    world.leader.leading = False
    world.add(nhc_object("omen2"))
    assert world.remediator.reconcile_all() == 0
    assert world.s.starter.requests == [] and "finalizers" not in world.obj("omen2")["metadata"]  # type: ignore[index]


def test_parse_defaults_to_approve_mode_and_required_diagnosis() -> None:
    r = parse_remediation({"metadata": {"name": "n1", "namespace": NS}, "spec": {"runbook": "x"}})
    assert (r.mode, r.require_diagnosis, r.problem) == ("approve", True, "")
    assert parse_remediation({"metadata": {}, "spec": {}}).problem == "spec.runbook: a runbook name is required"
