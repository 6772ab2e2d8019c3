"""The control plane is a real Kubernetes API: what the engine's kube connector relies on works as in the field."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from engine.lab.controlplane import ControlPlane


def micro_time(moment: datetime | None = None) -> str:
    """A MicroTime the 1.20 API server accepts (always 6 fractional digits; isoformat() drops them at 0)."""
    return (moment or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node_body(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}}}


def test_a_node_can_be_created_read_and_labelled(kube_client: client.CoreV1Api) -> None:
    kube_client.create_node(node_body("omen1", {"nvidia.com/gpu.workload.config": "vm-passthrough"}))

    kube_client.patch_node("omen1", {"metadata": {"labels": {"nvidia.com/gpu.workload.config": "container"}}})

    node = kube_client.read_node("omen1")
    assert node.metadata.labels["nvidia.com/gpu.workload.config"] == "container"
    assert node.metadata.resource_version


def test_listing_nodes_with_a_label_selector_returns_only_the_matching_ones(kube_client: client.CoreV1Api) -> None:
    kube_client.create_node(node_body("gpu1", {"role": "gpu"}))
    kube_client.create_node(node_body("gpu2", {"role": "gpu"}))
    kube_client.create_node(node_body("cpu1", {"role": "cpu"}))

    names = {n.metadata.name for n in kube_client.list_node(label_selector="role=gpu").items}

    assert names == {"gpu1", "gpu2"}


def test_server_side_dry_run_leaves_no_trace(kube_client: client.CoreV1Api) -> None:
    kube_client.create_node(node_body("omen2", {"a": "1"}))

    would_create = kube_client.create_node(node_body("ghost"), dry_run="All")
    would_patch = kube_client.patch_node("omen2", {"metadata": {"labels": {"a": "2"}}}, dry_run="All")

    assert would_create.metadata.name == "ghost"
    assert would_patch.metadata.labels["a"] == "2"  # the answer shows the change...
    with pytest.raises(ApiException) as missing:
        kube_client.read_node("ghost")
    assert missing.value.status == 404  # ...but nothing was stored
    assert kube_client.read_node("omen2").metadata.labels["a"] == "1"


def test_a_lease_update_with_a_stale_resource_version_is_refused_with_409(kube_client: client.CoreV1Api) -> None:
    leases = client.CoordinationV1Api(kube_client.api_client)
    body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "runbook-lock-omen2", "namespace": "default"},
            "spec": {"holderIdentity": "run-1", "leaseDurationSeconds": 30,
                     "acquireTime": micro_time(), "renewTime": micro_time()}}
    created = leases.create_namespaced_lease("default", body)
    stale = created.metadata.resource_version
    body["metadata"]["resourceVersion"] = stale
    body["spec"]["renewTime"] = micro_time()
    leases.replace_namespaced_lease("runbook-lock-omen2", "default", body)  # the holder renews: ok

    body["spec"]["holderIdentity"] = "run-2"  # a competitor still holding the old version
    with pytest.raises(ApiException) as conflict:
        leases.replace_namespaced_lease("runbook-lock-omen2", "default", body)

    assert conflict.value.status == 409
    assert leases.read_namespaced_lease("runbook-lock-omen2", "default").spec.holder_identity == "run-1"
    leases.delete_namespaced_lease("runbook-lock-omen2", "default")


VM_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "virtualmachines.kubevirt.io"},
    "spec": {
        "group": "kubevirt.io", "scope": "Namespaced",
        "names": {"kind": "VirtualMachine", "plural": "virtualmachines", "singular": "virtualmachine",
                  "shortNames": ["vm", "vms"]},
        "versions": [{"name": "v1", "served": True, "storage": True,
                      "subresources": {"status": {}},
                      "schema": {"openAPIV3Schema": {"type": "object",
                                                     "x-kubernetes-preserve-unknown-fields": True}}}],
    },
}


def test_a_kubevirt_virtual_machine_custom_resource_can_be_defined_created_and_listed(
        kube_client: client.CoreV1Api) -> None:
    extensions = client.ApiextensionsV1Api(kube_client.api_client)
    try:
        extensions.create_custom_resource_definition(VM_CRD)
    except ApiException as e:
        if e.status != 409:
            raise
    deadline = time.monotonic() + 30
    while True:  # usable once Established (~0.1 s)
        crd = extensions.read_custom_resource_definition("virtualmachines.kubevirt.io")
        if any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or []):
            break
        assert time.monotonic() < deadline, "CRD never became Established"
        time.sleep(0.1)
    custom = client.CustomObjectsApi(kube_client.api_client)
    vm = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
          "metadata": {"name": "win11-gpu", "namespace": "default", "labels": {"gpu": "passthrough"}},
          "spec": {"running": True}}

    custom.create_namespaced_custom_object("kubevirt.io", "v1", "default", "virtualmachines", vm)
    custom.patch_namespaced_custom_object_status("kubevirt.io", "v1", "default", "virtualmachines",
                                                 "win11-gpu", {"status": {"printableStatus": "Running"}})
    listed = custom.list_cluster_custom_object("kubevirt.io", "v1", "virtualmachines", label_selector="gpu")

    assert [(vm["metadata"]["name"], vm["status"]["printableStatus"]) for vm in listed["items"]] == [
        ("win11-gpu", "Running")]
    custom.delete_namespaced_custom_object("kubevirt.io", "v1", "default", "virtualmachines", "win11-gpu")


def test_the_audit_log_records_a_mutation_by_the_admin_user(control_plane: ControlPlane,
                                                            kube_client: client.CoreV1Api) -> None:
    mark = control_plane.audit_mark()

    kube_client.create_node(node_body("audited"))
    kube_client.patch_node("audited", {"metadata": {"labels": {"x": "y"}}})
    kube_client.read_node("audited")

    deadline = time.monotonic() + 10
    while len(events := control_plane.mutations(since=mark)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [(e["verb"], e["objectRef"]["resource"], e["objectRef"]["name"]) for e in events] == [
        ("create", "nodes", "audited"), ("patch", "nodes", "audited")]
    assert events[1]["requestObject"] == {"metadata": {"labels": {"x": "y"}}}  # RequestResponse level


def test_a_dry_run_is_audited_but_not_counted_as_a_mutation(control_plane: ControlPlane,
                                                            kube_client: client.CoreV1Api) -> None:
    kube_client.create_node(node_body("dry"))
    mark = control_plane.audit_mark()

    kube_client.patch_node("dry", {"metadata": {"labels": {"x": "y"}}}, dry_run="All")

    deadline = time.monotonic() + 10
    while not control_plane.mutations(since=mark, include_dry_run=True) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(control_plane.mutations(since=mark, include_dry_run=True)) == 1
    assert control_plane.mutations(since=mark) == []
