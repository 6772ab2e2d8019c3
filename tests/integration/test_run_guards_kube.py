"""The run guards (engine.run_guards) through the real KubeConnector on the real 1.20 API server: the
exclusion label, kured's lock on a real DaemonSet, a Medik8s NodeHealthCheck pause with the real
CRD installed (and discovery before and after), and the GPU budget counted from real Node objects."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from engine.connectors.kube import KubeConnector
from engine.lab.controlplane import ControlPlane
from engine.run_guards import NHC_API_VERSION, GuardConfig, GuardVerdict, blocking, evaluate_run_guards

pytestmark = pytest.mark.integration

NHC_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "nodehealthchecks.remediation.medik8s.io"},
    "spec": {
        "group": "remediation.medik8s.io", "scope": "Cluster",
        "names": {"plural": "nodehealthchecks", "singular": "nodehealthcheck", "kind": "NodeHealthCheck",
                  "shortNames": ["nhc"]},
        "versions": [{"name": "v1alpha1", "served": True, "storage": True, "subresources": {"status": {}},
                      "schema": {"openAPIV3Schema": {"type": "object",
                                                     "x-kubernetes-preserve-unknown-fields": True}}}],
    },
}


@pytest.fixture
def kube(control_plane: ControlPlane) -> KubeConnector:
    return KubeConnector(kubeconfig=str(control_plane.kubeconfig))


def gpu_node(core: client.CoreV1Api, name: str, *, gpus: int = 1, labels: dict[str, str] | None = None,
             ready: str = "True", cordoned: bool = False) -> None:
    core.create_node({"metadata": {"name": name, "labels": {"nvidia.com/gpu.present": "true", **(labels or {})}},
                      "spec": {"unschedulable": cordoned}})
    heartbeat(core, name, gpus=gpus, ready=ready)


def heartbeat(core: client.CoreV1Api, name: str, *, gpus: int = 1, ready: str = "True") -> None:
    """Post the node's status now (the node lifecycle controller marks a silent node Unknown after 8 s:
    tests that need Ready nodes post again right before they judge)."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    res = {"cpu": "16", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
    core.patch_node_status(name, {"status": {"capacity": res, "allocatable": res, "conditions": [
        {"type": "Ready", "status": ready, "reason": "Test", "message": "set by the test",
         "lastHeartbeatTime": now, "lastTransitionTime": now}]}})


def verdict(verdicts: list[GuardVerdict], name: str) -> GuardVerdict:
    return next(v for v in verdicts if v.name == name)


def test_an_exclusion_label_on_a_real_node_blocks_and_an_override_passes_it(
        kube: KubeConnector, kube_client: client.CoreV1Api) -> None:
    gpu_node(kube_client, "gpu-x", labels={"runbook.io/exclude": "true"})
    gpu_node(kube_client, "gpu-y")
    v = verdict(evaluate_run_guards(kube, "gpu-x", GuardConfig()), "exclusion")
    assert v.blocks and "runbook.io/exclude=true" in v.reason
    assert verdict(evaluate_run_guards(kube, "gpu-y", GuardConfig()), "exclusion").holds
    passed = verdict(evaluate_run_guards(kube, "gpu-x", GuardConfig(), overrides={"exclusion": "RMA done"},
                                         actor="alice"), "exclusion")
    assert not passed.blocks and passed.overridden is not None and passed.overridden.by == "alice"


def test_kureds_lock_on_a_real_daemonset_blocks_the_node_it_names(
        kube: KubeConnector, kube_client: client.CoreV1Api) -> None:
    gpu_node(kube_client, "gpu-k")
    created = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.123456789Z")
    lock = json.dumps({"nodeID": "gpu-k", "metadata": {"unschedulable": False}, "created": created, "TTL": 0})
    apps = client.AppsV1Api(kube_client.api_client)
    labels = {"name": "kured"}
    ds = {"metadata": {"name": "kured", "namespace": "kube-system",
                       "annotations": {"weave.works/kured-node-lock": lock}},
          "spec": {"selector": {"matchLabels": labels},
                   "template": {"metadata": {"labels": labels},
                                "spec": {"containers": [{"name": "kured", "image": "kured:1.17"}]}}}}
    apps.create_namespaced_daemon_set("kube-system", ds)
    try:
        v = verdict(evaluate_run_guards(kube, "gpu-k", GuardConfig()), "kured-lock")
        assert v.blocks and "kured holds its reboot lock for node gpu-k" in v.reason
        apps.patch_namespaced_daemon_set("kured", "kube-system", {"metadata": {"annotations": {
            "weave.works/kured-node-lock": "{broken"}}})
        v = verdict(evaluate_run_guards(kube, "gpu-k", GuardConfig()), "kured-lock")
        assert v.blocks and not v.evaluated and "cannot read kured's lock" in v.reason
    finally:
        apps.delete_namespaced_daemon_set("kured", "kube-system")
    assert verdict(evaluate_run_guards(kube, "gpu-k", GuardConfig()), "kured-lock").holds


@pytest.fixture
def nhc_crd(kube_client: client.CoreV1Api) -> Iterator[client.CustomObjectsApi]:
    extensions = client.ApiextensionsV1Api(kube_client.api_client)
    try:
        extensions.create_custom_resource_definition(NHC_CRD)
    except ApiException as e:
        if e.status != 409:
            raise
    deadline = time.monotonic() + 30
    while True:  # usable once Established (~0.1 s)
        crd = extensions.read_custom_resource_definition(NHC_CRD["metadata"]["name"])
        if any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or []):
            break
        assert time.monotonic() < deadline, "CRD never became Established"
        time.sleep(0.1)
    try:
        yield client.CustomObjectsApi(kube_client.api_client)
    finally:
        extensions.delete_custom_resource_definition(NHC_CRD["metadata"]["name"])


def test_a_paused_nodehealthcheck_blocks_the_nodes_it_selects_once_its_crd_exists(
        kube: KubeConnector, kube_client: client.CoreV1Api, request: pytest.FixtureRequest) -> None:
    gpu_node(kube_client, "gpu-n")
    kube_client.create_node({"metadata": {"name": "cpu-n", "labels": {"role": "cpu"}}})
    # before the CRD: discovery says not served, and the guard holds without listing anything
    assert kube.served_resources(NHC_API_VERSION) is None
    assert "nodes" in (kube.served_resources("v1") or ())
    v = verdict(evaluate_run_guards(kube, "gpu-n", GuardConfig()), "nhc-pause")
    assert v.holds and "no NodeHealthCheck resource" in v.reason

    custom: client.CustomObjectsApi = request.getfixturevalue("nhc_crd")
    deadline = time.monotonic() + 30
    while "nodehealthchecks" not in (kube.served_resources(NHC_API_VERSION) or ()):
        assert time.monotonic() < deadline, "discovery never showed nodehealthchecks"
        time.sleep(0.2)
    nhc: dict[str, Any] = {
        "apiVersion": NHC_API_VERSION, "kind": "NodeHealthCheck", "metadata": {"name": "nhc-gpu"},
        "spec": {"selector": {"matchExpressions": [{"key": "nvidia.com/gpu.present", "operator": "Exists"}]},
                 "minHealthy": "51%", "pauseRequests": ["CHG-1234 rack 7 firmware"],
                 "unhealthyConditions": [{"type": "Ready", "status": "False", "duration": "300s"}]}}
    custom.create_cluster_custom_object("remediation.medik8s.io", "v1alpha1", "nodehealthchecks", nhc)
    v = verdict(evaluate_run_guards(kube, "gpu-n", GuardConfig()), "nhc-pause")
    assert v.blocks and "NodeHealthCheck nhc-gpu" in v.reason and "CHG-1234 rack 7 firmware" in v.reason
    assert verdict(evaluate_run_guards(kube, "cpu-n", GuardConfig()), "nhc-pause").holds
    assert verdict(evaluate_run_guards(kube, "gpu-n", GuardConfig(nhc_pause=False)), "nhc-pause").holds

    custom.patch_cluster_custom_object("remediation.medik8s.io", "v1alpha1", "nodehealthchecks", "nhc-gpu",
                                       {"spec": {"pauseRequests": []}})
    assert verdict(evaluate_run_guards(kube, "gpu-n", GuardConfig()), "nhc-pause").holds


def test_the_gpu_budget_is_counted_from_real_nodes_cordons_and_not_ready(
        kube: KubeConnector, kube_client: client.CoreV1Api) -> None:
    # 12 GPUs: big (4, cordoned) and down (2, NotReady) are out of service; ok-1..ok-3 2 each, spare 0
    gpu_node(kube_client, "big", gpus=4, cordoned=True)
    gpu_node(kube_client, "down", gpus=2, ready="False")
    healthy = ["ok-1", "ok-2", "ok-3"]
    for name in healthy:
        gpu_node(kube_client, name, gpus=2)
    cfg = GuardConfig()  # at most 50 % of 12 = 6 GPUs out of service
    for name in ("big", *healthy):
        heartbeat(kube_client, name, gpus=4 if name == "big" else 2)
    v = verdict(evaluate_run_guards(kube, "ok-1", cfg), "gpu-budget")
    assert v.blocks, v  # 6 out + 2 = 8 > 6
    assert "6 GPUs out of service" in v.reason and "+ 2 on node ok-1 = 8" in v.reason
    assert "50% of the cluster's 12 GPUs" in v.reason
    # the node already down adds nothing: it may always be recovered
    down = verdict(evaluate_run_guards(kube, "down", cfg), "gpu-budget")
    assert down.holds and "already out of service" in down.reason

    kube.patch_node("big", {"spec": {"unschedulable": False}})  # uncordoned: 2 out, +2 = 4 <= 6
    for name in ("big", *healthy):
        heartbeat(kube_client, name, gpus=4 if name == "big" else 2)
    assert verdict(evaluate_run_guards(kube, "ok-1", cfg), "gpu-budget").holds
    # ... until the same fleet already remediates ok-2 and ok-3: 2 + 4 + 2 = 8 > 6
    flying = verdict(evaluate_run_guards(kube, "ok-1", cfg, in_flight=["ok-2", "ok-3"]), "gpu-budget")
    assert flying.blocks and "ok-2, ok-3" in flying.reason
    assert [b.name for b in blocking(evaluate_run_guards(kube, "ok-1", cfg, in_flight=["ok-2", "ok-3"],
                                                         overrides={"gpu-budget": "drain window"}))] == []
