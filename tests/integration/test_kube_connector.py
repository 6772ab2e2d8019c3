"""KubeConnector against the real 1.20 control plane: what the engine relies on, end to end."""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.connectors.base import PodRef
from engine.connectors.kube import KubeConnector
from engine.errors import Conflict, KubeError, NotFound
from engine.facts import NodeFacts
from engine.lab.controlplane import ControlPlane

pytestmark = pytest.mark.integration

WORKLOAD = "nvidia.com/gpu.workload.config"


@pytest.fixture
def kube(control_plane: ControlPlane) -> KubeConnector:
    return KubeConnector(kubeconfig=str(control_plane.kubeconfig))


def make_node(kube_client: Any, name: str, labels: dict[str, str] | None = None) -> None:
    kube_client.create_node({"metadata": {"name": name, "labels": labels or {}}})


def set_ready(kube_client: Any, name: str, status: str) -> None:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    kube_client.patch_node_status(name, {"status": {"conditions": [
        {"type": "Ready", "status": status, "reason": "Test", "message": "set by the test",
         "lastHeartbeatTime": now, "lastTransitionTime": now}]}})


# -- nodes --------------------------------------------------------------------------------------------
def test_node_read_patch_and_label_round_trip_with_all_three_patch_types(kube: KubeConnector,
                                                                         kube_client: Any) -> None:
    make_node(kube_client, "omen2", {WORKLOAD: "vm-passthrough"})
    node = kube.read_node("omen2")
    assert node is not None and node.labels[WORKLOAD] == "vm-passthrough"

    node = kube.patch_node("omen2", {"metadata": {"labels": {WORKLOAD: "container"}}})
    assert node.labels[WORKLOAD] == "container"
    node = kube.patch_node("omen2", {"spec": {"taints": [{"key": "runbook", "effect": "NoSchedule"}]}},
                           patch_type="strategic")
    assert [t.key for t in node.taints] == ["runbook"]
    node = kube.patch_node("omen2", [{"op": "add", "path": "/spec/unschedulable", "value": True}],
                           patch_type="json")
    assert node.unschedulable

    again = kube.read_node("omen2")
    assert again is not None
    assert (again.labels, again.unschedulable) == (node.labels, node.unschedulable)
    assert kube_client.read_node("omen2").metadata.labels[WORKLOAD] == "container"
    assert [n.name for n in kube.list_nodes(label_selector=f"{WORKLOAD}=container")] == ["omen2"]
    assert kube.list_nodes(label_selector=f"{WORKLOAD}=vm-passthrough") == []


def test_a_missing_node_reads_as_none_and_patching_it_is_not_found(kube: KubeConnector) -> None:
    assert kube.read_node("no-such-node") is None
    with pytest.raises(NotFound):
        kube.patch_node("no-such-node", {"metadata": {"labels": {"a": "b"}}})


def test_a_json_patch_must_be_a_list(kube: KubeConnector, kube_client: Any) -> None:
    make_node(kube_client, "omen2")
    with pytest.raises(KubeError, match="list of operations"):
        kube.patch_node("omen2", {"metadata": {"labels": {"a": "b"}}}, patch_type="json")


def test_server_side_dry_run_answers_the_result_and_leaves_no_trace(kube: KubeConnector,
                                                                    kube_client: Any) -> None:
    make_node(kube_client, "omen2", {WORKLOAD: "vm-passthrough"})
    before = kube.read_node("omen2")
    assert before is not None
    preview = kube.patch_node("omen2", {"metadata": {"labels": {WORKLOAD: "container"}}}, dry_run=True)
    assert preview.labels[WORKLOAD] == "container"
    after = kube.read_node("omen2")
    assert after is not None and after.labels == before.labels  # nothing was written
    assert kube_client.read_node("omen2").metadata.labels[WORKLOAD] == "vm-passthrough"


# -- watching -----------------------------------------------------------------------------------------
def test_wait_for_node_returns_within_50_ms_of_the_change(kube: KubeConnector, kube_client: Any,
                                                          control_plane: ControlPlane) -> None:
    make_node(kube_client, "omen2")
    writer = KubeConnector(kubeconfig=str(control_plane.kubeconfig))
    writer.read_node("omen2")  # warm the writer's connection
    latencies = []
    for i in range(5):
        started: dict[str, float] = {}

        def change(value: str = str(i), started: dict[str, float] = started) -> None:
            time.sleep(0.3)
            started["t"] = time.monotonic()
            writer.patch_node("omen2", {"metadata": {"labels": {"step": value}}})

        def stepped(n: NodeFacts | None, v: str = str(i)) -> bool:
            return n is not None and n.labels.get("step") == v

        t = threading.Thread(target=change)
        t.start()
        ok, node = kube.wait_for_node("omen2", stepped, timeout=10)
        seen = time.monotonic()
        t.join()
        assert ok and node is not None and node.labels["step"] == str(i)
        latencies.append(seen - started["t"])  # includes the writer's own PATCH round trip
    assert statistics.median(latencies) <= 0.05, latencies


def test_wait_for_node_reacts_to_a_ready_condition_change(kube: KubeConnector, kube_client: Any) -> None:
    make_node(kube_client, "omen2")
    set_ready(kube_client, "omen2", "False")
    threading.Timer(0.3, set_ready, (kube_client, "omen2", "True")).start()
    start = time.monotonic()
    ok, node = kube.wait_for_node("omen2", lambda n: n is not None and n.ready, timeout=10)
    assert ok and node is not None and node.ready
    assert time.monotonic() - start < 1.0


def test_wait_for_node_honours_its_timeout_even_while_other_changes_stream_in(
        kube: KubeConnector, kube_client: Any) -> None:
    make_node(kube_client, "omen2")
    stop = threading.Event()

    def churn() -> None:  # unrelated changes every 50 ms: the wait must not overrun because of them
        n = 0
        while not stop.is_set():
            n += 1
            kube_client.patch_node("omen2", {"metadata": {"labels": {"churn": str(n)}}})
            time.sleep(0.05)

    t = threading.Thread(target=churn)
    t.start()
    try:
        start = time.monotonic()
        ok, node = kube.wait_for_node("omen2", lambda n: n is not None and n.labels.get("never") == "x",
                                      timeout=1.2)
        elapsed = time.monotonic() - start
    finally:
        stop.set()
        t.join()
    assert not ok
    assert node is not None and "churn" in node.labels  # the last node seen is returned
    assert 1.2 <= elapsed < 1.3, elapsed


def test_wait_for_node_sees_a_node_appear_and_disappear(kube: KubeConnector, kube_client: Any) -> None:
    threading.Timer(0.2, make_node, (kube_client, "late")).start()
    ok, node = kube.wait_for_node("late", lambda n: n is not None, timeout=10)
    assert ok and node is not None and node.name == "late"
    threading.Timer(0.2, kube_client.delete_node, ("late",)).start()
    ok, node = kube.wait_for_node("late", lambda n: n is None, timeout=10)
    assert ok and node is None


def test_wait_for_node_re_lists_and_re_watches_when_the_api_server_expires_its_resource_version(
        control_plane: ControlPlane, kube_client: Any) -> None:
    """The real API server ends a watch from an expired resourceVersion with an ERROR 410 event:
    re-list, re-watch, go on.

    A resourceVersion expires for real when it is older than what the server can replay: here,
    two changes later the API server restarts, and its watch cache starts at the newer revision
    (the same 410 as an etcd compaction gives). The connector's first list is made to return that
    expired resourceVersion (the only thing changed in it), as if the server had expired it
    between the list and the watch.
    """
    make_node(kube_client, "omen2")
    expired = kube_client.list_node(field_selector="metadata.name=omen2").metadata.resource_version
    for n in ("1", "2"):
        kube_client.patch_node("omen2", {"metadata": {"labels": {"churn": n}}})
    control_plane.restart_apiserver()
    # the thing the connector must handle really happens: a raw watch from it gets the server's 410
    raw = kube_client.list_node(field_selector="metadata.name=omen2", watch=True, resource_version=expired,
                                _preload_content=False, _request_timeout=10)
    first = json.loads(raw.readline())
    raw.release_conn()
    assert (first["type"], first["object"]["code"]) == ("ERROR", 410), first

    class ListsFromAnExpiredVersion(KubeConnector):
        lists: list[str] = []  # the resourceVersion each list returned, in order

        def _list_node_with_rv(self, name: str) -> tuple[NodeFacts | None, str]:
            node, rv = super()._list_node_with_rv(name)
            ListsFromAnExpiredVersion.lists.append(rv)
            return node, (expired if len(ListsFromAnExpiredVersion.lists) == 1 else rv)

    kube = ListsFromAnExpiredVersion(kubeconfig=str(control_plane.kubeconfig))
    threading.Timer(1.0, kube_client.patch_node, ("omen2", {"metadata": {"labels": {"x": "1"}}})).start()
    ok, node = kube.wait_for_node("omen2", lambda n: n is not None and n.labels.get("x") == "1", timeout=20)
    assert ok and node is not None and node.labels["churn"] == "2"
    # the initial list, and the re-list the real 410 caused (a stream that merely ends re-watches without one)
    assert len(ListsFromAnExpiredVersion.lists) == 2, ListsFromAnExpiredVersion.lists


# -- leases -------------------------------------------------------------------------------------------
def test_lease_create_update_and_a_stale_update_is_a_conflict(kube: KubeConnector) -> None:
    lease = kube.create_lease("kube-node-lease", "runbook-test", "runbook/run-1", 30)
    assert (lease.holder, lease.duration_seconds) == ("runbook/run-1", 30)
    with pytest.raises(Conflict):
        kube.create_lease("kube-node-lease", "runbook-test", "runbook/run-2", 30)

    renewed = kube.update_lease(lease, "runbook/run-1", 30, acquire=False)
    assert renewed.resource_version != lease.resource_version
    assert renewed.acquire_time == pytest.approx(lease.acquire_time, abs=1e-6)
    assert renewed.renew_time >= lease.renew_time
    with pytest.raises(Conflict):  # someone else's view of the old version
        kube.update_lease(lease, "runbook/run-2", 30, acquire=True)
    assert kube.read_lease("kube-node-lease", "runbook-test") == renewed

    with pytest.raises(Conflict):  # deleting a version we no longer hold is refused
        kube.delete_lease(lease)
    kube.delete_lease(renewed)
    assert kube.read_lease("kube-node-lease", "runbook-test") is None
    kube.delete_lease(renewed)  # already gone: fine


def test_lease_times_on_a_whole_second_are_accepted_by_the_apiserver(control_plane: ControlPlane) -> None:
    """isoformat() would drop the fraction at .000000 and the apiserver would answer 400."""
    whole = float(int(time.time()))
    kube = KubeConnector(kubeconfig=str(control_plane.kubeconfig), clock=lambda: whole)
    lease = kube.create_lease("kube-node-lease", "runbook-whole-second", "runbook/run-1", 15)
    assert lease.acquire_time == lease.renew_time == whole
    taken = kube.update_lease(lease, "runbook/run-2", 15, acquire=True)
    assert taken.holder == "runbook/run-2"
    kube.delete_lease(taken)


# -- pods: eviction and deletion ----------------------------------------------------------------------
def make_pod(kube_client: Any, name: str, node: str, labels: dict[str, str] | None = None) -> None:
    kube_client.create_namespaced_pod("default", {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]}})


def test_eviction_uses_the_version_discovery_names_policy_v1beta1_on_the_1_20_server(kube: KubeConnector,
                                                                                     kube_client: Any) -> None:
    make_node(kube_client, "omen2")
    make_pod(kube_client, "gpu-job", "omen2", {"app": "gpu"})
    make_pod(kube_client, "other", "omen2")
    pods = kube.list_pods(node="omen2", label_selector="app=gpu")
    assert [(p.namespace, p.name, p.node) for p in pods] == [("default", "gpu-job", "omen2")]

    assert kube.eviction_version() == "policy/v1beta1"  # discovery: 1.20 serves pods/eviction as v1beta1
    kube.evict_pod(pods[0], dry_run=True)
    assert kube_client.read_namespaced_pod("gpu-job", "default").metadata.deletion_timestamp is None
    kube.evict_pod(pods[0], grace_seconds=30)
    pod = kube_client.list_namespaced_pod("default", field_selector="metadata.name=gpu-job").items
    assert not pod or pod[0].metadata.deletion_timestamp is not None  # terminating (no kubelet here)
    kube.evict_pod(PodRef("default", "no-such-pod"))  # already gone: nothing to do


def test_waiting_for_pods_gone_watches_until_the_last_one_is_deleted(kube: KubeConnector, kube_client: Any) -> None:
    make_node(kube_client, "omen2")
    for name in ("a", "b"):
        make_pod(kube_client, name, "omen2")
    pods = kube.list_pods(node="omen2")
    for p in pods:
        kube.evict_pod(p)  # terminating; nothing finishes the deletion (no kubelet)
    started = time.monotonic()
    assert {p.name for p in kube.wait_for_pods_gone(pods, 1.5)} == {"a", "b"}
    assert 1.4 <= time.monotonic() - started < 10

    def finish() -> None:
        time.sleep(0.5)
        for name in ("a", "b"):
            kube_client.delete_namespaced_pod(name, "default", grace_period_seconds=0)
            time.sleep(0.3)

    threading.Thread(target=finish, daemon=True).start()
    started = time.monotonic()
    assert kube.wait_for_pods_gone(pods, 30) == []
    assert time.monotonic() - started < 10, "seen through the watch, not at the timeout"


def test_the_drain_preview_dry_runs_each_eviction_on_the_real_server_and_changes_nothing(
        kube: KubeConnector, kube_client: Any, control_plane: ControlPlane) -> None:
    from kubernetes import client

    from engine import kube_verbs as kv
    from engine.kube_verbs.drain import DrainSpec, KubeDrain

    make_node(kube_client, "omen2")
    uid = "0d9c0ce0-0000-4000-8000-00000000000"
    owner = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-6d4f", "uid": uid + "1", "controller": True}
    ds = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "fluentd", "uid": uid + "2", "controller": True}
    container = [{"name": "c", "image": "busybox"}]
    for name, meta, extra in (
            ("web-1", {"ownerReferences": [owner], "labels": {"app": "web"}}, {}),
            ("guarded", {"ownerReferences": [owner], "labels": {"app": "guarded"}}, {}),
            ("fluentd-omen2", {"ownerReferences": [ds]}, {}),
            ("etcd-omen2", {"annotations": {"kubernetes.io/config.mirror": "d41d8cd9"}}, {}),
            ("scratch", {"ownerReferences": [owner]}, {"volumes": [{"name": "tmp", "emptyDir": {}}]})):
        kube_client.create_namespaced_pod("default", {"metadata": {"name": name, **meta},
                                                      "spec": {"nodeName": "omen2", "containers": container, **extra}})
    # the server ignores budgets for Pending pods: "guarded" runs (as a kubelet would report it)
    kube_client.patch_namespaced_pod_status("guarded", "default", {"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"}]}})
    with control_plane.new_api_client() as api_client:
        objects = client.CustomObjectsApi(api_client)  # the 1.20 server serves PDBs as policy/v1beta1 only
        objects.create_namespaced_custom_object("policy", "v1beta1", "default", "poddisruptionbudgets", {
            "apiVersion": "policy/v1beta1", "kind": "PodDisruptionBudget", "metadata": {"name": "guarded"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}}})
        try:
            node = kube.read_node("omen2")
            assert node is not None
            effect = kv.kube_effect(KubeDrain(drain=DrainSpec(ignore_daemonsets=True, delete_emptydir_data=True)), node)
            assert isinstance(effect, kv.PodOperation)
            ctx = kv.KubeContext(kube, "omen2", time.monotonic, time.sleep, threading.Event())
            lines = kv.preview(effect, ctx).splitlines()
        finally:
            objects.delete_namespaced_custom_object("policy", "v1beta1", "default", "poddisruptionbudgets", "guarded")
    assert lines[0] == "cordon omen2"
    assert "server dry-run accepted: evict default/web-1" in lines
    assert "server dry-run accepted: evict default/scratch (emptyDir tmp deleted)" in lines
    assert "skip default/fluentd-omen2: DaemonSet-managed (fluentd): it would come back here" in lines
    assert "skip default/etcd-omen2: mirror pod of a static pod (the kubelet owns it)" in lines
    # one running pod, minAvailable 1: the budget allows no disruption, so the server refuses (429)
    assert any(ln.startswith("server dry-run REJECTED: evict default/guarded: ") and "disruption budget" in ln
               for ln in lines), lines
    pods = kube_client.list_namespaced_pod("default").items
    assert len(pods) == 5 and all(p.metadata.deletion_timestamp is None for p in pods), "a dry run changes nothing"
    assert not kube_client.read_node("omen2").spec.unschedulable


def test_delete_pod_dry_run_keeps_the_pod_and_grace_zero_removes_it(kube: KubeConnector,
                                                                    kube_client: Any) -> None:
    make_node(kube_client, "omen2")
    make_pod(kube_client, "job", "omen2")
    ref = PodRef("default", "job")
    kube.delete_pod(ref, dry_run=True, grace_seconds=0)
    assert kube_client.read_namespaced_pod("job", "default").metadata.deletion_timestamp is None
    kube.delete_pod(ref, grace_seconds=0)
    assert kube_client.list_namespaced_pod("default", field_selector="metadata.name=job").items == []
    kube.delete_pod(ref)  # already gone: fine


def test_list_objects_reads_core_and_group_kinds_as_plain_mappings(kube: KubeConnector,
                                                                    kube_client: Any) -> None:
    make_node(kube_client, "omen2")
    make_pod(kube_client, "a", "omen2", {"app": "x"})
    make_pod(kube_client, "b", "omen2")
    pods = kube.list_objects("v1", "pods", namespace="default", label_selector="app=x")
    assert [p["metadata"]["name"] for p in pods] == ["a"]
    assert {n["metadata"]["name"] for n in kube.list_objects("v1", "nodes")} == {"omen2"}
    kube.create_lease("default", "x", "me", 10)
    leases = kube.list_objects("coordination.k8s.io/v1", "leases", namespace="default")
    assert [lease["spec"]["holderIdentity"] for lease in leases] == ["me"]
    assert any(item["metadata"]["name"] == "x"
               for item in kube.list_objects("coordination.k8s.io/v1", "leases"))
    with pytest.raises(NotFound):
        kube.list_objects("kubevirt.io/v1", "virtualmachines")  # no such API on this server
    kube.delete_lease(kube.read_lease("default", "x"))  # type: ignore[arg-type]


# -- failures -----------------------------------------------------------------------------------------
def dead_kubeconfig(control_plane: ControlPlane, tmp_path: Path) -> Path:
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = yaml.safe_load(control_plane.kubeconfig.read_text())
    for cluster in config["clusters"]:
        cluster["cluster"]["server"] = f"https://127.0.0.1:{port}"
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def test_an_api_server_that_is_down_is_a_retryable_kube_error_within_a_second(
        control_plane: ControlPlane, tmp_path: Path) -> None:
    kube = KubeConnector(kubeconfig=str(dead_kubeconfig(control_plane, tmp_path)))
    for call in (lambda: kube.read_node("omen2"), lambda: kube.list_nodes(),
                 lambda: kube.patch_node("omen2", {"metadata": {"labels": {"a": "b"}}}),
                 lambda: kube.read_lease("kube-node-lease", "x")):
        start = time.monotonic()
        with pytest.raises(KubeError) as err:
            call()
        assert time.monotonic() - start < 1.0
        assert err.value.retryable
        assert "unreachable" in str(err.value) and "127.0.0.1" in str(err.value)


def test_waiting_on_a_dead_api_server_fails_instead_of_hanging(control_plane: ControlPlane,
                                                              tmp_path: Path) -> None:
    kube = KubeConnector(kubeconfig=str(dead_kubeconfig(control_plane, tmp_path)))
    start = time.monotonic()
    with pytest.raises(KubeError):
        kube.wait_for_node("omen2", lambda n: True, timeout=30)
    assert time.monotonic() - start < 1.0


def test_a_missing_kubeconfig_or_context_is_a_clear_kube_error(control_plane: ControlPlane,
                                                               tmp_path: Path) -> None:
    with pytest.raises(KubeError, match="cannot load kubeconfig"):
        KubeConnector(kubeconfig=str(tmp_path / "nope"))
    with pytest.raises(KubeError, match="context nope"):
        KubeConnector(kubeconfig=str(control_plane.kubeconfig), context="nope")


def test_importing_the_connector_does_not_import_the_kubernetes_client() -> None:
    """Cold start: `runbook validate` and friends must not pay for the client."""
    code = "import sys, engine.connectors.kube; print(json.dumps('kubernetes' in sys.modules))"
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout) is False
