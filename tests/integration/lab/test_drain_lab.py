"""Lab: ``drain`` on a real API server, with a real PodDisruptionBudget and real controllers.

worker-2 runs two replicas of a ReplicaSet guarded by a budget that allows one disruption at a time
(``minAvailable: 1`` of two), a DaemonSet's pod (placed there by the lab's daemonset controller) and a
mirror pod. ``runbook run drain-node``
cordons it, evicts the first replica, is refused (HTTP 429) for the second until the ReplicaSet's
replacement runs on another node, evicts it then, and leaves the DaemonSet and mirror pods. What
happened is read from outside the engine as well: the API server's audit log (each eviction's answer
and when the simulated kubelet removed the first pod) and the cluster itself.

The drain takes the test's pods only (``selector: drain-test=yes``, kubectl's ``--pod-selector``); a
whole-node drain is test_lab_controllers.py's.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.lab.controlplane import ControlPlane
from tests.integration.lab.flagship_cli import ROOT
from tests.integration.lab.lab_helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.lab]

NODE = "worker-2"
NS = "default"
APP = {"app": "drain-web"}
CONTAINERS = [{"name": "web", "image": "nginx:1.27"}]
RUNBOOK = """apiVersion: runbook/v1
name: drain-node
version: "1"
description: Drain a node as kubectl drain does (DaemonSet pods stay).
params:
  node: {type: node, required: true}
steps:
  - id: drain
    why: Move the node's workloads away, within their disruption budgets, before maintenance.
    action: {kube: {drain: {ignore_daemonsets: true, selector: drain-test=yes, timeout: 300s}}}
"""


@pytest.fixture
def api(incident: Any) -> Iterator[tuple[ControlPlane, Any, Any, Any]]:
    """The lab's control plane and clients; the test's objects are removed and the node uncordoned after."""
    from kubernetes import client

    plane = ControlPlane.from_state(incident.lab.record()["controlplane_dir"])
    with plane.new_api_client() as api_client:
        core, apps = client.CoreV1Api(api_client), client.AppsV1Api(api_client)
        objects = client.CustomObjectsApi(api_client)
        try:
            yield plane, core, apps, objects
        finally:
            try:
                core.patch_node(NODE, {"spec": {"unschedulable": False}})
                for delete in (lambda: apps.delete_namespaced_replica_set("drain-web", NS),
                               lambda: apps.delete_namespaced_daemon_set("drain-ds", NS),
                               lambda: objects.delete_namespaced_custom_object(
                                   "policy", "v1beta1", NS, "poddisruptionbudgets", "drain-web")):
                    try:
                        delete()
                    except client.ApiException as e:
                        if e.status != 404:
                            raise
                for p in core.list_namespaced_pod(NS, label_selector="drain-test=yes").items:
                    try:  # the garbage collector may delete the DaemonSet's pods first
                        core.delete_namespaced_pod(p.metadata.name, NS, grace_period_seconds=0)
                    except client.ApiException as e:
                        if e.status != 404:
                            raise
                wait_for(lambda: not core.list_namespaced_pod(NS, label_selector="drain-test=yes").items, 60,
                         "the test's pods to go")
            except Exception:
                incident.dirty = True  # the next test resets the lab
                raise


def pods_on(core: Any, node: str) -> dict[str, Any]:
    return {p.metadata.name: p for p in core.list_namespaced_pod(NS, field_selector=f"spec.nodeName={node}").items
            if p.metadata.labels and p.metadata.labels.get("drain-test") == "yes"}


def running(pod: Any) -> bool:
    return pod.status.phase == "Running" and pod.metadata.deletion_timestamp is None


def runbook(sh: Any, args: str, tmp_path: Path) -> Any:
    env = f"PYTHONPATH={shlex.quote(str(ROOT))} RUNBOOK_JOURNAL={shlex.quote(str(tmp_path / 'journal.sqlite'))}"
    return sh(f"{env} {shlex.quote(sys.executable)} -m engine {args} --runbooks-dir {tmp_path / 'runbooks'}",
              timeout=600)


@pytest.mark.timeout(900)
def test_a_drain_respects_the_budget_one_eviction_at_a_time_and_leaves_daemonset_and_mirror_pods(
        api: tuple[ControlPlane, Any, Any, Any], sh: Any, tmp_path: Path) -> None:
    plane, core, apps, objects = api
    labels = {**APP, "drain-test": "yes"}
    # Two replicas on worker-2: made there, then adopted by a ReplicaSet whose replacements the
    # scheduler places elsewhere once worker-2 is cordoned.
    for name in ("drain-web-1", "drain-web-2"):
        core.create_namespaced_pod(NS, {"metadata": {"name": name, "labels": labels},
                                        "spec": {"nodeName": NODE, "containers": CONTAINERS}})
    wait_for(lambda: len([p for p in pods_on(core, NODE).values() if running(p)]) == 2, 60, "both replicas running")
    apps.create_namespaced_replica_set(NS, {
        "metadata": {"name": "drain-web"},
        "spec": {"replicas": 2, "selector": {"matchLabels": APP},
                 "template": {"metadata": {"labels": labels}, "spec": {"containers": CONTAINERS}}}})
    wait_for(lambda: all((p.metadata.owner_references or [None])[0] for p in pods_on(core, NODE).values()), 30,
             "the ReplicaSet to adopt both replicas")
    objects.create_namespaced_custom_object("policy", "v1beta1", NS, "poddisruptionbudgets", {
        "apiVersion": "policy/v1beta1", "kind": "PodDisruptionBudget", "metadata": {"name": "drain-web"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": APP}}})

    def allowed() -> Any:
        pdb = objects.get_namespaced_custom_object("policy", "v1beta1", NS, "poddisruptionbudgets", "drain-web")
        return (pdb.get("status") or {}).get("disruptionsAllowed") == 1

    wait_for(allowed, 60, "the budget to allow one disruption")
    apps.create_namespaced_daemon_set(NS, {
        "metadata": {"name": "drain-ds"},
        "spec": {"selector": {"matchLabels": {"app": "drain-ds"}},
                 "template": {"metadata": {"labels": {"app": "drain-ds", "drain-test": "yes"}},
                              "spec": {"nodeSelector": {"kubernetes.io/hostname": NODE}, "containers": CONTAINERS}}}})
    (ds_pod,) = wait_for(lambda: [n for n, p in pods_on(core, NODE).items()
                                  if n.startswith("drain-ds-") and running(p)], 60,
                         "the daemonset controller's pod running on worker-2")
    core.create_namespaced_pod(NS, {"metadata": {"name": "static-web-worker-2", "labels": {"drain-test": "yes"},
                                                 "annotations": {"kubernetes.io/config.mirror": "8f3c0a"}},
                                    "spec": {"nodeName": NODE, "containers": CONTAINERS}})
    wait_for(lambda: len([p for p in pods_on(core, NODE).values() if running(p)]) == 4, 60, "four pods running")
    (tmp_path / "runbooks").mkdir()
    (tmp_path / "runbooks" / "drain-node.yaml").write_text(RUNBOOK)

    # The plan: each pod's fate, each eviction tried as a server-side dry run; nothing changes.
    mark = plane.audit_mark()
    planned = runbook(sh, f"plan drain-node --node {NODE} -o json", tmp_path)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    preview = json.loads(planned.stdout)["steps"][0]["preview"].splitlines()
    assert preview[0] == f"cordon {NODE}"
    assert {ln for ln in preview if ln.startswith(("skip ", "server dry-run accepted"))} == {
        f"skip {NS}/{ds_pod}: DaemonSet-managed (drain-ds): it would come back here",
        f"skip {NS}/static-web-worker-2: mirror pod of a static pod (the kubelet owns it)",
        f"server dry-run accepted: evict {NS}/drain-web-1", f"server dry-run accepted: evict {NS}/drain-web-2"}, \
        preview
    assert plane.mutations(since=mark) == []
    assert not core.read_node(NODE).spec.unschedulable

    mark = plane.audit_mark()
    done = runbook(sh, f"run drain-node --node {NODE} --yes -o json", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    evidence = json.loads(done.stdout)["outcomes"][0]["evidence"]["action"]
    assert evidence["eviction_api"] == "policy/v1beta1"  # discovered on the 1.20 server
    assert sorted(evidence["pods"]) == [f"{NS}/drain-web-1", f"{NS}/drain-web-2"]
    assert sum(evidence["refusals"].values()) >= 1, evidence

    # From the audit log: a refusal (429) was retried, and the second eviction was accepted only after
    # the first evicted replica was gone (the budget let one disruption happen at a time).
    events = plane.audit_events(since=mark)
    evictions = sorted((e for e in events if e.get("objectRef", {}).get("subresource") == "eviction"
                        and "dryRun" not in e.get("requestURI", "")), key=lambda e: e["stageTimestamp"])
    accepted = [e for e in evictions if e["responseStatus"]["code"] == 201]
    refused = [e for e in evictions if e["responseStatus"]["code"] == 429]
    assert len(accepted) == 2 and refused, [(e["objectRef"]["name"], e["responseStatus"]["code"]) for e in evictions]
    first, second = accepted
    assert first["objectRef"]["name"] != second["objectRef"]["name"]
    gone = [e for e in events if e.get("verb") == "delete" and e.get("objectRef", {}).get("resource") == "pods"
            and e["objectRef"].get("name") == first["objectRef"]["name"] and not e["objectRef"].get("subresource")]
    assert gone and gone[0]["stageTimestamp"] < second["stageTimestamp"], "the second eviction waited for the first"
    assert any(first["stageTimestamp"] < e["stageTimestamp"] < second["stageTimestamp"]
               and e["objectRef"]["name"] == second["objectRef"]["name"] for e in refused)

    # The node: cordoned; the DaemonSet and mirror pods still run there; the replicas run elsewhere.
    assert core.read_node(NODE).spec.unschedulable
    assert {n for n, p in pods_on(core, NODE).items() if running(p)} == {ds_pod, "static-web-worker-2"}
    assert not any(n.startswith("drain-web") for n in pods_on(core, NODE))
    web = core.list_namespaced_pod(NS, label_selector="app=drain-web").items
    assert len(web) == 2 and all(p.spec.node_name != NODE for p in web)


@pytest.mark.timeout(600)
def test_delete_after_deletes_the_one_pod_its_budget_holds_and_names_it(
        api: tuple[ControlPlane, Any, Any, Any], sh: Any, tmp_path: Path) -> None:
    """A budget that allows no disruption (minAvailable 1 of its one pod): the eviction is refused
    (429) until ``delete_after``, then the pod is deleted, named in the evidence; the audit log shows
    the refusals, then the deletion."""
    plane, core, _apps, objects = api
    core.create_namespaced_pod(NS, {"metadata": {"name": "held-web", "labels": {"app": "held", "drain-test": "yes"}},
                                    "spec": {"nodeName": NODE, "containers": CONTAINERS}})
    objects.create_namespaced_custom_object("policy", "v1beta1", NS, "poddisruptionbudgets", {
        "apiVersion": "policy/v1beta1", "kind": "PodDisruptionBudget", "metadata": {"name": "held"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "held"}}}})
    try:
        wait_for(lambda: running(core.read_namespaced_pod("held-web", NS)), 60, "the held pod running")

        def holds() -> bool:
            status = objects.get_namespaced_custom_object("policy", "v1beta1", NS, "poddisruptionbudgets",
                                                          "held").get("status") or {}
            return status.get("currentHealthy") == 1 and status.get("disruptionsAllowed") == 0

        wait_for(holds, 60, "the budget to hold the pod")
        (tmp_path / "runbooks").mkdir()
        (tmp_path / "runbooks" / "drain-node.yaml").write_text(RUNBOOK.replace(
            "timeout: 300s}", "force: true, timeout: 120s, delete_after: 4s}"))
        mark = plane.audit_mark()
        done = runbook(sh, f"run drain-node --node {NODE} --yes -o json", tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        evidence = json.loads(done.stdout)["outcomes"][0]["evidence"]["action"]
        (deleted,) = evidence["deleted_after_budget"]
        assert deleted["pod"] == f"{NS}/held-web" and deleted["refused"] >= 1
        assert "(delete_after): deleted" in deleted["reason"] and deleted["after"] >= 4
        events = plane.audit_events(since=mark)
        refusals = [e for e in events if e.get("objectRef", {}).get("subresource") == "eviction"
                    and e["responseStatus"]["code"] == 429 and "dryRun" not in e.get("requestURI", "")]
        deletes = [e for e in events if e.get("verb") == "delete" and e.get("objectRef", {}).get("name") == "held-web"
                   and not e["objectRef"].get("subresource")]
        assert refusals and deletes and refusals[0]["stageTimestamp"] < deletes[0]["stageTimestamp"]
        wait_for(lambda: "held-web" not in pods_on(core, NODE), 60, "the held pod to be gone")
    finally:
        objects.delete_namespaced_custom_object("policy", "v1beta1", NS, "poddisruptionbudgets", "held")
