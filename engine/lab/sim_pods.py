"""Pod statuses as a kubelet writes them, and what the simulated kubelet does with the pods of its node.

A running kubelet (as KWOK does) force-deletes its node's terminating pods (grace 0: no container
runtime to wait for), starts pending pods, and restarts crashed ones (restartPolicy Always). Pods
labelled ``runbook.lab/completes=true`` (one-shot validators) run to ``Completed``. A kubelet that is
down does nothing: its pods keep their last status (the real node lifecycle controller sets their
Ready condition False once the node is NotReady), and deleting them never finishes. A kubelet that
comes back posts fresh statuses, as a real one's status manager does: pods whose containers ran
before the host's last boot died with it (restarted: restartCount + 1, a new start time, last state
``terminated``/``Unknown``/255); running pods marked not ready are Ready again. Pure.
"""

from __future__ import annotations

import hashlib
from typing import Any

from engine.lab.sim_kube import parse_time, rfc3339

COMPLETES_LABEL = "runbook.lab/completes"
PROCESS_ANNOTATION = "runbook.lab/process"  # engine.lab.cluster_mode's pods
Obj = dict[str, Any]


def _container_id(pod: Obj, container: str, ts: float) -> str:
    seed = f"{pod['metadata'].get('uid', pod['metadata'].get('name'))}/{container}/{int(ts)}"
    return "containerd://" + hashlib.sha256(seed.encode()).hexdigest()


def _conditions(now_text: str, ready: bool, scheduled_at: str, containers: list[str]) -> list[Obj]:
    flag = "True" if ready else "False"
    out = [{"type": "Initialized", "status": "True", "lastProbeTime": None, "lastTransitionTime": scheduled_at},
           {"type": "Ready", "status": flag, "lastProbeTime": None, "lastTransitionTime": now_text},
           {"type": "ContainersReady", "status": flag, "lastProbeTime": None, "lastTransitionTime": now_text},
           {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": scheduled_at}]
    if not ready:
        for c in out[1:3]:
            c["reason"] = "ContainersNotReady"
            c["message"] = f"containers with unready status: [{' '.join(containers)}]"
    return out


def pod_status(pod: Obj, status: str, host_ip: str, now: float, restarts: int = 0) -> Obj:
    """A status subresource body for ``status``: Running, Error, Completed or Pending."""
    now_text = rfc3339(now)
    start = pod.get("status", {}).get("startTime") or now_text
    containers = [c["name"] for c in pod["spec"]["containers"]]
    statuses = []
    for name in containers:
        image = next(c.get("image", "") for c in pod["spec"]["containers"] if c["name"] == name)
        cs: Obj = {"name": name, "image": image, "imageID": f"{image.split(':')[0]}@sha256:{'0' * 64}",
                   "containerID": _container_id(pod, name, now), "restartCount": restarts,
                   "ready": status == "Running", "started": status == "Running"}
        if status == "Running":
            cs["state"] = {"running": {"startedAt": now_text}}
        elif status in ("Error", "Completed"):
            code, reason = (1, "Error") if status == "Error" else (0, "Completed")
            cs["state"] = {"terminated": {"exitCode": code, "reason": reason, "startedAt": start,
                                          "finishedAt": now_text, "containerID": cs["containerID"]}}
        else:
            cs["state"] = {"waiting": {"reason": "ContainerCreating"}}
        statuses.append(cs)
    phase = {"Running": "Running", "Error": "Running", "Completed": "Succeeded", "Pending": "Pending"}[status]
    if status == "Error" and pod["spec"].get("restartPolicy") == "Never":
        phase = "Failed"
    body: Obj = {"phase": phase, "hostIP": host_ip, "podIP": host_ip if status == "Running" else None,
                 "startTime": start, "containerStatuses": statuses, "qosClass": "BestEffort",
                 "conditions": _conditions(now_text, status == "Running", start, containers)}
    if status == "Running":
        body["podIPs"] = [{"ip": host_ip}]
    return body


def is_running(pod: Obj) -> bool:
    status = pod.get("status", {})
    return status.get("phase") == "Running" and all(
        cs.get("ready") and "running" in cs.get("state", {}) for cs in status.get("containerStatuses", [{}]))


def running_since(pod: Obj) -> float | None:
    """When the pod's (first) container started running, or None when it does not run."""
    if not is_running(pod) or pod.get("metadata", {}).get("deletionTimestamp"):
        return None
    statuses = pod.get("status", {}).get("containerStatuses") or [{}]
    return parse_time(statuses[0].get("state", {}).get("running", {}).get("startedAt"))


def started_at(pod: Obj) -> float | None:
    """When the pod's (first) container started its current run (None: it does not run)."""
    if not is_running(pod):
        return None
    statuses = pod.get("status", {}).get("containerStatuses") or [{}]
    return parse_time(statuses[0].get("state", {}).get("running", {}).get("startedAt"))


def is_ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod.get("status", {}).get("conditions") or [])


def kubelet_action(pod: Obj, booted_at: float | None = None) -> str | None:
    """What a running kubelet does with a pod of its node: "delete", "run", "restart" (its containers
    started before the host's boot at ``booted_at``: they died with it), "ready" (running, but marked
    not ready while the kubelet was away), "complete" or None."""
    meta, status = pod["metadata"], pod.get("status", {})
    if PROCESS_ANNOTATION in (meta.get("annotations") or {}):
        return None  # a real process of cluster mode (engine.lab.cluster_mode): its supervisor is the kubelet
    if meta.get("deletionTimestamp"):
        return "delete"
    phase = status.get("phase", "Pending")
    completes = meta.get("labels", {}).get(COMPLETES_LABEL) == "true"
    if completes:
        return "complete" if phase in ("Pending", "Running") else None
    if phase in ("Succeeded", "Failed"):
        return None
    started = started_at(pod)
    if started is None:
        return "run"
    # startedAt has whole seconds, and the kubelet was down for a second at least before the boot
    if booted_at is not None and started < int(booted_at):
        return "restart"
    return None if is_ready(pod) else "ready"


def restarted_status(pod: Obj, host_ip: str, now: float) -> Obj:
    """The status after the host rebooted under the pod: each container restarted once (its last
    state: terminated, reason Unknown, exit code 255, as a kubelet reports a container lost with the
    host), running and ready since ``now``; the pod's startTime stays."""
    before = {cs.get("name"): cs for cs in pod.get("status", {}).get("containerStatuses") or []}
    restarts = max((int(cs.get("restartCount", 0)) for cs in before.values()), default=0)
    body = pod_status(pod, "Running", host_ip, now, restarts + 1)
    for cs in body["containerStatuses"]:
        old = before.get(cs["name"], {})
        cs["restartCount"] = int(old.get("restartCount", restarts)) + 1
        cs["lastState"] = {"terminated": {
            "exitCode": 255, "reason": "Unknown", "finishedAt": rfc3339(now), "containerID": old.get("containerID"),
            "startedAt": old.get("state", {}).get("running", {}).get("startedAt")}}
    return body


def ready_again(pod: Obj, now: float) -> Obj:
    """A status patch that makes a running pod Ready again (its other conditions kept)."""
    now_text = rfc3339(now)
    conditions = []
    for c in pod.get("status", {}).get("conditions") or []:
        if c.get("type") in ("Ready", "ContainersReady") and c.get("status") != "True":
            c = {"type": c["type"], "status": "True", "lastProbeTime": None, "lastTransitionTime": now_text}
        conditions.append(c)
    for type_ in ("Ready", "ContainersReady"):
        if not any(c.get("type") == type_ for c in conditions):
            conditions.append({"type": type_, "status": "True", "lastProbeTime": None, "lastTransitionTime": now_text})
    return {"conditions": conditions}
