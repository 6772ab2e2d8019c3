"""The real node lifecycle controller and scheduler react to heartbeats the way they do in a cluster.

No kubelet runs: the small ``Kubelets`` below posts Ready status and renews node Leases, as the lab's
simulator does. Timings come from the session control plane (grace 8 s, monitor period 2 s).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.fakes.clock import wait_for as poll

GPU = "nvidia.com/GB202_GEFORCE_RTX_5090"


def micro_time() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Kubelets:
    """Fake kubelets: register nodes Ready and renew their Leases every second until told to stop."""

    def __init__(self, core: client.CoreV1Api) -> None:
        self.core = core
        self.leases = client.CoordinationV1Api(core.api_client)
        self.beating: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def register(self, name: str, extra_resources: dict[str, str] | None = None) -> None:
        self.core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
        self.post_status(name, extra_resources or {})
        self.leases.create_namespaced_lease("kube-node-lease", {
            "metadata": {"name": name},
            "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": micro_time()}})
        self.beating.add(name)

    def post_status(self, name: str, extra_resources: dict[str, str]) -> None:
        resources = {"cpu": "32", "memory": "128Gi", "pods": "110", **extra_resources}
        self.core.patch_node_status(name, {"status": {
            "capacity": resources, "allocatable": resources,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kubelet is posting ready status",
                            "lastHeartbeatTime": rfc3339(), "lastTransitionTime": rfc3339()}]}})

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for name in list(self.beating):
                with contextlib.suppress(ApiException):  # deleted by the test's cleanup
                    self.leases.patch_namespaced_lease(name, "kube-node-lease",
                                                       {"spec": {"renewTime": micro_time()}})

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture
def kubelets(kube_client: client.CoreV1Api) -> Iterator[Kubelets]:
    fakes = Kubelets(kube_client)
    yield fakes
    fakes.stop()


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 45.0) -> Any:
    return poll(probe, timeout, what, interval=0.25)


def ready_condition(core: client.CoreV1Api, name: str) -> Any:
    return next(c for c in core.read_node(name).status.conditions if c.type == "Ready")


def taints(core: client.CoreV1Api, name: str) -> set[tuple[str, str]]:
    return {(t.key, t.effect) for t in core.read_node(name).spec.taints or []}


def test_a_node_whose_lease_stops_turns_unknown_and_gets_the_unreachable_taints(
        kube_client: client.CoreV1Api, kubelets: Kubelets) -> None:
    kubelets.register("healthy")  # one healthy node: with all nodes down the controller stops tainting
    kubelets.register("omen2")
    time.sleep(3)
    started = time.monotonic()

    kubelets.beating.discard("omen2")  # its kubelet dies: no more Lease renewals

    wait_for("omen2 Ready=Unknown", lambda: ready_condition(kube_client, "omen2").status == "Unknown")
    condition = ready_condition(kube_client, "omen2")
    assert condition.reason == "NodeStatusUnknown"
    assert condition.message == "Kubelet stopped posting node status."
    wait_for("the unreachable NoExecute taint", lambda: (
        "node.kubernetes.io/unreachable", "NoExecute") in taints(kube_client, "omen2"))
    assert ("node.kubernetes.io/unreachable", "NoSchedule") in taints(kube_client, "omen2")
    assert 6 < time.monotonic() - started < 40
    assert ready_condition(kube_client, "healthy").status == "True"
    assert not {k for k, _ in taints(kube_client, "healthy")} & {"node.kubernetes.io/unreachable"}


def test_a_gpu_pod_stays_unschedulable_until_a_ready_node_advertises_the_gpu_then_is_bound(
        kube_client: client.CoreV1Api, kubelets: Kubelets) -> None:
    kubelets.register("omen2")  # Ready, but its GPU is not advertised (device plugin down)
    kube_client.create_namespaced_pod("default", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cuda-job"},
        "spec": {"containers": [{"name": "main", "image": "cuda:12",
                                 "resources": {"limits": {GPU: "1"}}}]}})

    def unschedulable() -> Any:
        conditions = kube_client.read_namespaced_pod("cuda-job", "default").status.conditions or []
        return next((c for c in conditions if c.type == "PodScheduled" and c.reason == "Unschedulable"), None)

    condition = wait_for("PodScheduled=False/Unschedulable", unschedulable)
    assert condition.status == "False"
    assert f"Insufficient {GPU}" in condition.message
    time.sleep(2)
    assert kube_client.read_namespaced_pod("cuda-job", "default").spec.node_name is None

    kubelets.post_status("omen2", {GPU: "1"})  # the device plugin registers the GPU

    node_name = wait_for("the scheduler to bind the pod",
                         lambda: kube_client.read_namespaced_pod("cuda-job", "default").spec.node_name, 30)
    assert node_name == "omen2"
