"""The real kubectl works against the control plane with the generated kubeconfig."""

from __future__ import annotations

from kubernetes import client

from engine.lab.kubectl import Kubectl


def test_kubectl_get_nodes_lists_the_nodes(kube_client: client.CoreV1Api, kubectl: Kubectl) -> None:
    kube_client.create_node({"metadata": {"name": "omen2"}})

    result = kubectl("get", "nodes")

    assert result.stdout.splitlines()[0].split()[:2] == ["NAME", "STATUS"]
    assert any(line.split()[0] == "omen2" for line in result.stdout.splitlines()[1:])


def test_kubectl_label_node_changes_the_label_the_official_client_then_reads(
        kube_client: client.CoreV1Api, kubectl: Kubectl) -> None:
    kube_client.create_node({"metadata": {"name": "omen2",
                                          "labels": {"nvidia.com/gpu.workload.config": "vm-passthrough"}}})

    kubectl("label", "node", "omen2", "nvidia.com/gpu.workload.config=container", "--overwrite")

    labels = kube_client.read_node("omen2").metadata.labels
    assert labels["nvidia.com/gpu.workload.config"] == "container"
    assert kubectl.json("get", "node", "omen2")["metadata"]["labels"]["nvidia.com/gpu.workload.config"] == "container"


def test_kubectl_server_side_dry_run_changes_nothing(kube_client: client.CoreV1Api, kubectl: Kubectl) -> None:
    kube_client.create_node({"metadata": {"name": "omen2", "labels": {"a": "1"}}})

    kubectl("label", "node", "omen2", "a=2", "--overwrite", "--dry-run=server")

    assert kube_client.read_node("omen2").metadata.labels["a"] == "1"
