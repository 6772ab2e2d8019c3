"""Lab: the control plane runs the daemonset, namespace and garbage-collector controllers, the GPU
Operator's operands are DaemonSet pods, and a whole-node drain behaves as on a real node (issue 29).

* The operand pods belong to DaemonSets that select nodes by their ``nvidia.com/gpu.deploy.*``
  label, as the operator's do; giving a node such a label makes the real daemonset controller (and
  the scheduler) put the operand's pod there, and the simulated kubelet runs it; taking the label
  away removes the pod.
* ``runbook run`` of a whole-node drain (kubectl drain --ignore-daemonsets: no selector, no force)
  on worker-1, where the GPU Operator and NFD's master run: the DaemonSet pods stay (same pods), the
  ReplicaSet pods are evicted and come back on other nodes. Before, the lab's pods were bare and the
  drain was refused.
* A deleted namespace finishes terminating (the namespace controller empties it), and a drain that
  meets a pod of a terminating namespace waits for it as kubectl does (its eviction is refused with
  HTTP 403 ``NamespaceTerminating``; the pod is already being deleted): a finalizer holds that pod
  until the test lets it go.

One lab for the module; the tests leave worker-1 uncordoned and mark the lab dirty (pods moved).
"""

from __future__ import annotations

import json
import shlex
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.lab import sim_gpu
from engine.lab.controlplane import ControlPlane
from tests.integration.lab.flagship_cli import ROOT
from tests.integration.lab.lab_helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.lab]

OPERATOR_NS = "gpu-operator"
HOLD = "runbook.test/hold"
CONTAINERS = [{"name": "web", "image": "nginx:1.27"}]
DRAIN = """apiVersion: runbook/v1
name: drain-whole-node
version: "1"
description: Drain a whole node as kubectl drain --ignore-daemonsets does.
params:
  node: {type: node, required: true}
steps:
  - id: drain
    why: Move every pod but the DaemonSets' away before maintenance.
    action: {kube: {drain: {ignore_daemonsets: true, timeout: 120s}}}
"""


@pytest.fixture(scope="module")
def api(incident: Any) -> Iterator[tuple[ControlPlane, Any, Any]]:
    from kubernetes import client

    plane = ControlPlane.from_state(incident.lab.record()["controlplane_dir"])
    with plane.new_api_client() as api_client:
        try:
            yield plane, client.CoreV1Api(api_client), client.AppsV1Api(api_client)
        finally:
            incident.dirty = True  # pods moved between nodes: the next module starts from a reset


def runbook(sh: Any, args: str, tmp_path: Path, text: str) -> Any:
    (tmp_path / "runbooks").mkdir(exist_ok=True)
    (tmp_path / "runbooks" / "drain-whole-node.yaml").write_text(text)
    env = f"PYTHONPATH={shlex.quote(str(ROOT))} RUNBOOK_JOURNAL={shlex.quote(str(tmp_path / 'journal.sqlite'))}"
    return sh(f"{env} {shlex.quote(sys.executable)} -m engine {args} --runbooks-dir {tmp_path / 'runbooks'}",
              timeout=600)


def pods_on(core: Any, node: str, namespace: str | None = None) -> dict[str, Any]:
    """``namespace/name`` -> pod, for the pods bound to ``node`` that are not being deleted."""
    found = (core.list_namespaced_pod(namespace, field_selector=f"spec.nodeName={node}") if namespace
             else core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}"))
    return {f"{p.metadata.namespace}/{p.metadata.name}": p for p in found.items
            if p.metadata.deletion_timestamp is None}


def owner_kind(pod: Any) -> str:
    return next((o.kind for o in pod.metadata.owner_references or () if o.controller), "")


def running_and_ready(pod: Any) -> bool:
    return pod.status.phase == "Running" and any(
        c.type == "Ready" and c.status == "True" for c in pod.status.conditions or ())


def test_operands_are_daemonset_pods_placed_by_their_deploy_label(api: tuple[ControlPlane, Any, Any]) -> None:
    _plane, core, apps = api
    daemonsets = {d.metadata.name: d for d in apps.list_namespaced_daemon_set(OPERATOR_NS).items}
    assert daemonsets["nvidia-device-plugin-daemonset"].spec.template.spec.node_selector == {
        "nvidia.com/gpu.deploy.device-plugin": "true"}
    assert daemonsets["gpu-operator-node-feature-discovery-worker"].spec.template.spec.node_selector is None
    # every operand pod has its DaemonSet as controller (the seeded ones adopted), the one-shot
    # validators aside; gpu-operator and NFD master/gc belong to ReplicaSets
    for pod in core.list_namespaced_pod(OPERATOR_NS).items:
        operand = pod.metadata.labels[sim_gpu.OPERAND_LABEL]
        want = ("" if operand in sim_gpu.ONE_SHOT else
                "ReplicaSet" if operand in {c for _, c in sim_gpu.CLUSTER_COMPONENTS} else "DaemonSet")
        assert owner_kind(pod) == want, (pod.metadata.name, pod.metadata.owner_references)
    # a dead node's pods are marked not ready (by the node lifecycle controller, as on a real cluster)
    dead = pods_on(core, "gpu-3090-3", OPERATOR_NS)
    assert dead and not any(running_and_ready(p) for p in dead.values())

    # the deploy label on a Ready node: the daemonset controller makes the pod, the scheduler binds
    # it, the simulated kubelet runs it; the label gone, the pod goes
    label = "nvidia.com/gpu.deploy.device-plugin"
    core.patch_node("worker-3", {"metadata": {"labels": {label: "true"}}})
    try:
        placed = wait_for(lambda: [p for p in pods_on(core, "worker-3", OPERATOR_NS).values()
                                   if p.metadata.name.startswith("nvidia-device-plugin-daemonset-")
                                   and running_and_ready(p)], 60, "a device-plugin pod running on worker-3")
        (pod,) = placed
        assert owner_kind(pod) == "DaemonSet" and pod.metadata.generate_name == "nvidia-device-plugin-daemonset-"
    finally:
        core.patch_node("worker-3", {"metadata": {"labels": {label: None}}})
    wait_for(lambda: not any(n.startswith(f"{OPERATOR_NS}/nvidia-device-plugin-daemonset-")
                             for n in pods_on(core, "worker-3", OPERATOR_NS)), 60, "the device-plugin pod gone")


@pytest.mark.timeout(600)
def test_a_whole_node_drain_leaves_the_daemonset_pods_and_evicts_the_rest(
        api: tuple[ControlPlane, Any, Any], sh: Any, tmp_path: Path) -> None:
    _plane, core, _apps = api
    node = "worker-1"
    before = pods_on(core, node)
    kept = {k: p.metadata.uid for k, p in before.items() if owner_kind(p) == "DaemonSet"}
    moved = {k for k in before if k not in kept}
    assert any(k.startswith(f"{OPERATOR_NS}/gpu-operator-node-feature-discovery-worker-") for k in kept), before
    assert any(k.startswith(f"{OPERATOR_NS}/gpu-operator-") and "node-feature" not in k for k in moved), before
    try:
        done = runbook(sh, f"run drain-whole-node --node {node} --yes -o json", tmp_path, DRAIN)
        assert done.returncode == 0, done.stdout + done.stderr
        evidence = json.loads(done.stdout)["outcomes"][0]["evidence"]["action"]
        assert sorted(evidence["pods"]) == sorted(moved)
        assert {s["pod"] for s in evidence["skipped"]} == set(kept)
        assert evidence["refused"] == []
        after = pods_on(core, node)
        assert {k: p.metadata.uid for k, p in after.items()} == kept  # the same DaemonSet pods, nothing else
        assert core.read_node(node).spec.unschedulable
        # the ReplicaSets' pods came back elsewhere, and run
        for prefix, _component in sim_gpu.CLUSTER_COMPONENTS:
            def elsewhere(prefix: str = prefix) -> list[Any]:
                pods = core.list_namespaced_pod(OPERATOR_NS, label_selector=f"app={prefix}").items
                return [p for p in pods if p.spec.node_name not in (None, node) and running_and_ready(p)]

            wait_for(elsewhere, 60, f"{prefix}'s pod running on another node")
    finally:
        core.patch_node(node, {"spec": {"unschedulable": None}})


@pytest.mark.timeout(600)
def test_a_deleted_namespace_terminates_and_a_drain_waits_for_its_pod_being_deleted(
        api: tuple[ControlPlane, Any, Any], sh: Any, tmp_path: Path) -> None:
    from kubernetes import client

    plane, core, _apps = api
    ns, node = "dsctl-gone", "worker-2"
    core.create_namespace({"metadata": {"name": ns}})
    labels = {"dsctl-test": "yes"}
    core.create_namespaced_pod(ns, {"metadata": {"name": "plain", "labels": labels},
                                    "spec": {"nodeName": node, "containers": CONTAINERS}})
    core.create_namespaced_pod(ns, {"metadata": {"name": "held", "labels": labels, "finalizers": [HOLD]},
                                    "spec": {"nodeName": node, "containers": CONTAINERS}})
    try:
        wait_for(lambda: len([p for p in pods_on(core, node, ns).values() if running_and_ready(p)]) == 2, 60,
                 "both pods running")
        core.delete_namespace(ns)
        # the namespace controller deletes its pods: plain goes (the kubelet confirms), held stays deleting
        wait_for(lambda: [p.metadata.name for p in core.list_namespaced_pod(ns).items] == ["held"], 60,
                 "the namespace controller to delete its pods")
        assert core.read_namespaced_pod("held", ns).metadata.deletion_timestamp is not None
        assert core.read_namespace(ns).status.phase == "Terminating"

        text = DRAIN.replace("timeout: 120s}", "selector: dsctl-test=yes, force: true, timeout: 120s}")
        mark = plane.audit_mark()
        result: dict[str, Any] = {}
        drain = threading.Thread(target=lambda: result.update(
            done=runbook(sh, f"run drain-whole-node --node {node} --yes -o json", tmp_path, text)))
        drain.start()

        def refused() -> bool:
            return any(e.get("objectRef", {}).get("subresource") == "eviction" and e["objectRef"].get("name") == "held"
                       and e["responseStatus"]["code"] == 403 and "dryRun" not in e.get("requestURI", "")
                       for e in plane.audit_events(since=mark))

        try:
            wait_for(refused, 120, "the eviction of held refused (its namespace is terminating)")
        finally:
            core.patch_namespaced_pod("held", ns, {"metadata": {"finalizers": None}})
            drain.join(timeout=300)
        done = result["done"]
        assert done.returncode == 0, done.stdout + done.stderr
        evidence = json.loads(done.stdout)["outcomes"][0]["evidence"]["action"]
        assert evidence["namespace_terminating"] == [f"{ns}/held"] and evidence["pods"] == [f"{ns}/held"]

        def gone() -> bool:
            try:
                core.read_namespace(ns)
            except client.ApiException as e:
                return e.status == 404
            return False

        wait_for(gone, 90, f"namespace {ns} to finish terminating")
    finally:
        core.patch_node(node, {"spec": {"unschedulable": None}})
        for name in ("held", "plain"):
            try:
                core.patch_namespaced_pod(name, ns, {"metadata": {"finalizers": None}})
            except client.ApiException as e:
                if e.status != 404:
                    raise
