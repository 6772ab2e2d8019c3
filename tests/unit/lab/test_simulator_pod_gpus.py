"""The lab's pods get GPUs and a CUDA process on each, whose cgroup names the pod (simulator_pod_gpus)."""

from __future__ import annotations

from typing import Any

from engine.hostfacts import parse_cgroup
from engine.lab.simulator_pod_gpus import add_job, assign, cgroup_line

UID_A, UID_B, UID_C = ("aaaaaaaa-0000-0000-0000-000000000001", "bbbbbbbb-0000-0000-0000-000000000002",
                       "cccccccc-0000-0000-0000-000000000003")


def host() -> dict[str, Any]:
    return {"pci_devices": [{"slot": s, "display": True, "driver": "nvidia"}
                            for s in ("01:00.0", "02:00.0", "41:00.0", "c1:00.0")],
            "cuda_jobs": [{"pid": 4242, "name": "python3", "gpu": "01:00.0"}]}  # a host job: not the plugin's


def pod(uid: str, gpus: int = 1, *, running: bool = True, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"uid": uid, "namespace": "ml", "name": f"pod-{uid[0]}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-07T18:00:00Z"
    status = {"phase": "Running", "containerStatuses": [{"ready": True, "state": {"running": {}}}]} if running \
        else {"phase": "Pending"}
    return {"metadata": meta, "status": status,
            "spec": {"containers": [{"name": "c", "command": ["/usr/bin/train.py"],
                                     "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}


def test_running_gpu_pods_get_free_gpus_in_slot_order_and_a_job_on_each() -> None:
    state = host()
    start, left = assign(state, [pod(UID_A), pod(UID_B, 2), {"metadata": {"uid": "x"}, "spec": {"containers": []}}])
    assert state["pod_gpus"][UID_A]["gpus"] == ["01:00.0"]
    assert state["pod_gpus"][UID_B]["gpus"] == ["02:00.0", "41:00.0"]
    assert [(j["pod_uid"], j["gpu"], j["name"]) for j in start] == [
        (UID_A, "01:00.0", "train.py"), (UID_B, "02:00.0", "train.py"), (UID_B, "41:00.0", "train.py")]
    assert left == []
    for pid, job in enumerate(start, 100):
        assert add_job(state, job, pid)
    assert assign(state, [pod(UID_A), pod(UID_B, 2)]) == ([], [])  # steady: nothing to start


def test_a_pod_that_goes_takes_its_jobs_with_it_and_its_gpu_is_free_again() -> None:
    state = host()
    for pid, job in enumerate(assign(state, [pod(UID_A), pod(UID_B)])[0], 100):
        add_job(state, job, pid)
    start, left = assign(state, [pod(UID_A), pod(UID_B, deleting=True)])
    assert (start, left) == ([], [101]) and UID_B not in state["pod_gpus"]
    assert [j["pid"] for j in state["cuda_jobs"]] == [4242, 100]
    assert state.get("cuda_jobs_killed", 0) == 0  # a clean exit, not a kill
    start, _ = assign(state, [pod(UID_A), pod(UID_C)])
    assert [(j["pod_uid"], j["gpu"]) for j in start] == [(UID_C, "02:00.0")]


def test_no_gpu_for_a_new_pod_on_a_withheld_gpu_and_no_process_on_a_faulted_one() -> None:
    state = host()
    state["gpu_health"] = {"01:00.0": {"remap_pending": True}, "02:00.0": {"xid": 48, "unhealthy": True}}
    start, _ = assign(state, [pod(UID_A)])
    assert state["pod_gpus"][UID_A]["gpus"] == ["41:00.0"]
    # an assigned GPU that faulted: its job died with the Xid and does not start again until a reset
    state["pod_gpus"][UID_B] = {"pod": "ml/pod-b", "gpus": ["02:00.0"], "name": "train.py"}
    start, _ = assign(state, [pod(UID_A), pod(UID_B)])
    assert [j["gpu"] for j in start] == ["41:00.0"]
    assert not add_job(state, {"pod_uid": UID_C, "gpu": "c1:00.0", "pod": "ml/x", "name": "x"}, 7)  # not its GPU
    # a pending remap (Xid 63) lets workloads run: a pod's process on it (re)starts
    state["gpu_health"]["41:00.0"] = {"xid": 63, "remap_pending": True, "unhealthy": True}
    start, _ = assign(state, [pod(UID_A), pod(UID_B)])
    assert [j["gpu"] for j in start] == ["41:00.0"]


def test_the_cgroup_line_is_what_kubelet_makes_and_the_host_fact_reads_the_pod_back() -> None:
    line = cgroup_line(UID_A, "0123abcd")
    assert line.startswith("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podaaaaaaaa_0000")
    assert parse_cgroup(line)[1] == UID_A
