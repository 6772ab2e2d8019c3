"""``drain: {delete_after}`` (pods a budget still refuses are deleted, each named) and evictions refused
because the pod's namespace is terminating (kubectl: wait for a deleting pod, else retry)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from engine import probes
from engine.connectors.base import PodRef
from engine.errors import KubeError, NamespaceTerminating
from engine.execution import Executor
from engine.kube_verbs.drain import DrainSpec
from engine.loader import parse_runbook
from engine.model import Runbook, RunState
from engine.planning import plan_run
from tests.fakes import FakeClock, FakeKube, FakeNodes, RecordingSink, healthy_host, healthy_node

PLAYBOOKS = Path(__file__).resolve().parents[1] / "data" / "playbooks"
NOW = datetime(2026, 7, 10, 15, 40, tzinfo=UTC)


def pod(name: str) -> PodRef:
    return PodRef("web", name, "omen2", {}, "Running", {}, uid=f"uid-{name}", controller_kind="ReplicaSet",
                  controller_name=f"{name}-owner")


def drain_runbook(spec: dict[str, Any]) -> Runbook:
    doc = {"apiVersion": "runbook/v1", "name": "drain-node", "version": "1",
           "params": {"node": {"type": "node", "required": True}},
           "steps": [{"id": "drain", "action": {"kube": {"drain": spec}}}]}
    return parse_runbook(yaml.safe_dump(doc).encode(), "drain-node.yaml", playbooks_dir=PLAYBOOKS)


def run(rb: Runbook, kube: FakeKube) -> Any:
    nodes = FakeNodes({"omen2": healthy_host()}, clock=kube.clock)
    facts = probes.gather(rb, {"node": "omen2"}, "omen2", kube, nodes)
    plan = plan_run(rb, {"node": "omen2"}, facts, runbook_digest="d" * 64, now=NOW)
    executor = Executor(kube, nodes, events=RecordingSink(), playbooks_dir=PLAYBOOKS, clock=kube.clock,
                        sleep=kube.clock.sleep, wall=kube.clock.wall, cancel=threading.Event())
    return executor.execute(plan, rb, {"node": "omen2"})


def cluster(*pods: PodRef) -> FakeKube:
    kube = FakeKube([healthy_node()], clock=FakeClock())
    kube.pods = list(pods)
    return kube


def refused_by_budget() -> KubeError:
    return KubeError("Cannot evict pod as it would violate the pod's disruption budget.", status=429, retryable=True)


def terminating() -> NamespaceTerminating:
    return NamespaceTerminating("evict pod web/web-1: its namespace web is being deleted", status=403,
                                retryable=True)


def test_a_pod_a_budget_still_refuses_after_delete_after_is_deleted_and_named() -> None:
    held, free = pod("web-1"), pod("web-2")
    kube = cluster(held, free)
    kube.fail["evict_pod"] = [refused_by_budget(), None] + [refused_by_budget() for _ in range(100)]
    result = run(drain_runbook({"timeout": "120s", "delete_after": "30s"}), kube)
    assert result.state is RunState.SUCCEEDED, result.reason
    assert [p.name for p in kube.evicted] == ["web-2"] and [p.name for p in kube.deleted] == ["web-1"]
    ev = result.outcomes[0].evidence["action"]
    (gone,) = ev["deleted_after_budget"]
    assert gone["pod"] == "web/web-1" and gone["after"] == pytest.approx(30.0)
    assert "refused its eviction for 30s (delete_after): deleted" in gone["reason"]
    assert sum(kube.clock.sleeps) == pytest.approx(30.0), "it wakes up when delete_after is reached"


def test_without_delete_after_nothing_is_ever_deleted() -> None:
    kube = cluster(pod("web-1"))
    kube.fail["evict_pod"] = [refused_by_budget() for _ in range(100)]
    result = run(drain_runbook({"timeout": "20s"}), kube)
    assert result.state is RunState.FAILED and kube.deleted == []


def test_delete_after_must_be_shorter_than_the_timeout_and_needs_evictions() -> None:
    with pytest.raises(ValidationError, match="must be shorter than timeout"):
        DrainSpec(delete_after="5m", timeout="60s")
    with pytest.raises(ValidationError, match="with disable_eviction nothing is evicted"):
        DrainSpec(delete_after="5s", disable_eviction=True)


def test_a_terminating_namespace_is_retried_like_kubectl_and_the_drain_goes_on_once_it_passes() -> None:
    kube = cluster(pod("web-1"))
    kube.fail["evict_pod"] = [terminating(), terminating(), None]
    result = run(drain_runbook({"timeout": "60s"}), kube)
    assert result.state is RunState.SUCCEEDED, result.reason
    assert result.outcomes[0].evidence["action"]["refusals"] == {"web/web-1": 2}


def test_a_pod_already_deleting_in_a_terminating_namespace_is_waited_for_not_failed() -> None:
    from dataclasses import replace

    deleting = replace(pod("web-1"), deleting=True)
    kube = cluster(deleting)
    kube.fail["evict_pod"] = [terminating()]
    kube.clock.after(3, lambda: kube.pods.remove(deleting))
    result = run(drain_runbook({"timeout": "60s"}), kube)
    assert result.state is RunState.SUCCEEDED, result.reason
    assert result.outcomes[0].evidence["action"]["namespace_terminating"] == ["web/web-1"]
