"""Cluster health, exclusion labels and kured's lock, read through KubeAPI and failing closed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.errors import KubeError
from engine.facts import NodeFacts
from engine.serve.cluster import ClusterUnavailable, KubeClusterView, gpu_count, kured_locks
from engine.serve.config import ExclusionConfig
from tests.fakes import FakeKube, make_node

DAEMONSETS = ("apps/v1", "daemonsets")

T0 = 1_800_000_000.0


def _kured(value: Any, name: str = "kured", ns: str = "kube-system") -> dict[str, Any]:
    ann = value if isinstance(value, str) else json.dumps(value)
    return {"metadata": {"name": name, "namespace": ns, "annotations": {"weave.works/kured-node-lock": ann}}}


def _view(kube: FakeKube, clock: list[float] | None = None, ttl: float = 5.0) -> KubeClusterView:
    clock = clock if clock is not None else [T0]
    return KubeClusterView(lambda: kube, ExclusionConfig(), ttl=ttl, clock=lambda: clock[0])


def test_the_incident_counts_four_of_eight_unhealthy_nodes_and_their_gpus() -> None:
    nodes = [make_node(f"omen{i}", ready=i > 4, gpus=2 if i == 2 else 1) for i in range(1, 9)]
    snap = _view(FakeKube(nodes)).snapshot()
    assert (snap.total_nodes, snap.unhealthy_nodes, snap.unhealthy_gpus) == (
        8, ("omen1", "omen2", "omen3", "omen4"), 5)


def test_gpus_come_from_the_label_else_capacity_else_passthrough_devices() -> None:
    assert gpu_count(make_node("a", gpus=4)) == 4
    assert gpu_count(NodeFacts(name="b", capacity={"nvidia.com/gpu": "2"})) == 2
    assert gpu_count(NodeFacts(name="c", capacity={"nvidia.com/GB202_GEFORCE_RTX_5090": "1", "cpu": "16"})) == 1
    assert gpu_count(NodeFacts(name="d", labels={"nvidia.com/gpu.count": "x"})) == 0


def test_our_label_and_medik8s_label_exclude_a_node() -> None:
    nodes = [make_node("omen1", labels={"runbook.io/exclude": "true"}),
             make_node("omen2", labels={"remediation.medik8s.io/exclude-from-remediation": "True"}),
             make_node("omen3", labels={"runbook.io/exclude": "false"})]
    snap = _view(FakeKube(nodes)).snapshot()
    assert "runbook.io/exclude=true" in (snap.exclusion("omen1") or "")
    assert "medik8s" in (snap.exclusion("omen2") or "")
    assert snap.exclusion("omen3") is None and snap.exclusion("unknown") is None


def test_kured_single_lock_names_the_node_being_rebooted() -> None:
    lock = {"nodeID": "omen2", "metadata": {"unschedulable": False}, "created": "2027-01-15T08:00:00.123456789Z",
            "TTL": 0}
    kube = FakeKube([make_node("omen2")], objects={DAEMONSETS: [_kured(lock)]})
    snap = _view(kube).snapshot()
    assert "kured" in (snap.exclusion("omen2") or "")


def test_kured_multi_lock_and_ttl_expiry() -> None:
    locks = {"maxOwners": 2, "locks": [
        {"nodeID": "omen3", "created": "2027-01-15T08:00:00Z", "TTL": 0},
        {"nodeID": "omen4", "created": "2027-01-15T08:00:00Z", "TTL": 60 * 10**9},
    ]}
    created = 1_800_000_000.0  # 2027-01-15T08:00:00Z
    live = kured_locks(json.dumps(locks), now=created + 30)
    assert set(live) == {"omen3", "omen4"}
    later = kured_locks(json.dumps(locks), now=created + 61)
    assert set(later) == {"omen3"}  # omen4's lock expired; TTL 0 never expires


def test_kured_in_another_namespace_or_without_annotation_is_no_lock() -> None:
    kube = FakeKube([make_node("omen2")], objects={DAEMONSETS: [_kured({"nodeID": "omen2"}, ns="kured")]})
    assert _view(kube).snapshot().exclusion("omen2") is None
    no_annotation = {"metadata": {"name": "kured", "namespace": "kube-system"}}
    kube = FakeKube([make_node("omen2")], objects={DAEMONSETS: [no_annotation]})
    assert _view(kube).snapshot().exclusion("omen2") is None


@pytest.mark.parametrize("value", ["{not json", "[]", '{"locks": "x"}', '{"locks": [{"created": "x"}]}'])
def test_an_unreadable_kured_lock_fails_closed(value: str) -> None:
    kube = FakeKube([make_node("omen2")], objects={DAEMONSETS: [_kured(value)]})
    with pytest.raises(ClusterUnavailable, match="kured"):
        _view(kube).snapshot()


def test_api_errors_fail_closed_and_are_retried_after_a_second() -> None:
    kube = FakeKube([make_node("omen2")])
    kube.error = KubeError("connection refused")
    clock = [T0]
    view = _view(kube, clock)
    with pytest.raises(ClusterUnavailable, match="connection refused"):
        view.snapshot()
    kube.error = None
    with pytest.raises(ClusterUnavailable):
        view.snapshot()  # the error is cached briefly: a storm does not hammer a sick API
    clock[0] += 1.5
    assert view.snapshot().total_nodes == 1


def test_a_connector_that_cannot_be_built_fails_closed() -> None:
    def broken() -> FakeKube:
        raise RuntimeError("no kubeconfig")

    view = KubeClusterView(broken, ExclusionConfig())
    with pytest.raises(ClusterUnavailable, match="no kubeconfig"):
        view.snapshot()


def test_snapshots_are_cached_for_the_ttl() -> None:
    kube = FakeKube([make_node("omen2")])
    clock = [T0]
    view = _view(kube, clock, ttl=5)
    for _ in range(50):
        view.snapshot()
    assert kube.calls_to("list_nodes") == 1
    clock[0] += 6
    view.snapshot()
    assert kube.calls_to("list_nodes") == 2
