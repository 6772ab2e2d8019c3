"""The simulated kubelet's pod decisions (engine.lab.sim_pods) and the GPU Operator's DaemonSets
(engine.lab.sim_gpu): pure functions over API dicts."""

from __future__ import annotations

from typing import Any

from engine.lab import sim_gpu, sim_pods
from engine.lab.scenario import GpuOperator
from engine.lab.sim_kube import parse_time

T0 = 1_700_000_000.0  # a whole second


def running_pod(started: float, ready: bool = True) -> dict[str, Any]:
    pod: dict[str, Any] = {"metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                           "spec": {"containers": [{"name": "c", "image": "img:1"}]}}
    pod["status"] = sim_pods.pod_status(pod, "Running", "127.0.1.2", started)
    if not ready:  # what the node lifecycle controller does to the pods of a NotReady node
        for c in pod["status"]["conditions"]:
            if c["type"] == "Ready":
                c["status"] = "False"
    return pod


def test_a_running_ready_pod_is_left_alone_by_a_kubelet_that_never_rebooted() -> None:
    assert sim_pods.kubelet_action(running_pod(T0)) is None
    assert sim_pods.kubelet_action(running_pod(T0), booted_at=T0 - 100) is None


def test_a_pod_marked_not_ready_while_the_kubelet_was_away_is_made_ready_again() -> None:
    pod = running_pod(T0, ready=False)
    assert sim_pods.kubelet_action(pod) == "ready"
    patch = sim_pods.ready_again(pod, T0 + 30)
    ready = next(c for c in patch["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and parse_time(ready["lastTransitionTime"]) == T0 + 30
    assert {c["type"] for c in patch["conditions"]} == {"Initialized", "Ready", "ContainersReady", "PodScheduled"}


def test_a_pod_whose_containers_ran_before_the_hosts_boot_is_restarted_with_fresh_status() -> None:
    pod = running_pod(T0, ready=False)
    boot = T0 + 60.7
    assert sim_pods.kubelet_action(pod, booted_at=boot) == "restart"
    status = sim_pods.restarted_status(pod, "127.0.1.2", boot + 3)
    (cs,) = status["containerStatuses"]
    assert cs["restartCount"] == 1 and cs["ready"]
    assert parse_time(cs["state"]["running"]["startedAt"]) == int(boot + 3)
    last = cs["lastState"]["terminated"]
    assert last["reason"] == "Unknown" and last["exitCode"] == 255
    assert last["startedAt"] == pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]
    assert status["startTime"] == pod["status"]["startTime"]  # the pod's own start stays
    assert any(c["type"] == "Ready" and c["status"] == "True" for c in status["conditions"])
    # the restarted pod (started in the boot's second, after it) is not restarted again
    after = {**pod, "status": status}
    assert sim_pods.kubelet_action(after, booted_at=boot) is None


def test_terminating_and_finished_pods_keep_their_rules() -> None:
    pod = running_pod(T0)
    assert sim_pods.kubelet_action({**pod, "metadata": {**pod["metadata"], "deletionTimestamp": "x"}}) == "delete"
    done = {**pod, "status": {**pod["status"], "phase": "Succeeded"}}
    assert sim_pods.kubelet_action(done, booted_at=T0 + 100) is None
    pending = {**pod, "status": {"phase": "Pending"}}
    assert sim_pods.kubelet_action(pending, booted_at=T0 + 100) == "run"


def test_each_operand_daemonset_selects_nodes_by_its_deploy_label_and_seeded_pods_match_it() -> None:
    op = GpuOperator()
    assert sim_gpu.daemonset_operands(op) == [*sorted(op.operands), "nfd-worker"]
    ds = sim_gpu.daemonset(op, "device-plugin")
    assert ds["metadata"]["name"] == "nvidia-device-plugin-daemonset"
    assert ds["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.deploy.device-plugin": "true"}
    assert "nodeSelector" not in sim_gpu.daemonset(op, "nfd-worker")["spec"]["template"]["spec"]
    pod = sim_gpu.operand_pod(op, "omen2", "device-plugin", "nvidia-device-plugin-daemonset-abcde")
    selector = ds["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()  # the DaemonSet adopts it
    assert pod["metadata"]["labels"][sim_gpu.TEMPLATE_GENERATION_LABEL] == "1"
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}  # adopted pods are never replaced
    owned = sim_gpu.operand_pod(op, "omen2", "vfio-manager", owner={
        "kind": "DaemonSet", "metadata": {"name": "nvidia-vfio-manager", "uid": "u-ds"}})
    (ref,) = owned["metadata"]["ownerReferences"]
    assert ref["uid"] == "u-ds" and ref["kind"] == "DaemonSet" and ref["controller"]
    rs = sim_gpu.replicaset(op, "gpu-operator", "gpu-operator")
    bare = sim_gpu.cluster_pod(op, "worker-1", "gpu-operator", "gpu-operator")
    assert rs["spec"]["selector"]["matchLabels"].items() <= bare["metadata"]["labels"].items()
    assert bare["metadata"]["name"].startswith(rs["metadata"]["name"] + "-")
