"""What the GPU faults of a host's state (``engine.lab.gpu_faults``) do to its Node and pods: the kubelet's
device manager and the NVIDIA device plugin, as gpu-failure-facts.md §5 describes them.

* The device plugin marks a GPU Unhealthy on a critical Xid (a GPU with ``gpu_health[slot].unhealthy``
  or ``fallen``), and every GPU when NVML fails (a driver/library mismatch, no module loaded). It only
  reports changes *to* Unhealthy: a GPU it marked stays withheld until the plugin's pod is replaced,
  even once the GPU is reset (``marked_at`` later than the pod's start).
* Kubelet keeps capacity and withholds the unhealthy GPUs from allocatable; a plugin that does not
  run (its pod crash-looping: ``device_plugin.crashloop_pod``) leaves allocatable 0, capacity stays.
* An NVSwitch system whose fabric manager is not active refuses new CUDA work (error 802).

Pure decisions over the host state and API dicts; the simulator applies them.
"""

from __future__ import annotations

from typing import Any

from engine.lab.sim_pods import running_since

GPU = "nvidia.com/gpu"
FM_UNIT = "nvidia-fabricmanager"
Obj = dict[str, Any]


def nvml_broken(state: Obj) -> bool:
    """NVML cannot start: the module is unloaded, or the installed libraries differ from it."""
    nvidia = state.get("nvidia") or {}
    loaded = nvidia.get("loaded", "default")
    return loaded is None or nvidia.get("installed", loaded) != loaded


def unhealthy_gpus(state: Obj, plugin_started: float | None) -> set[str]:
    """The GPU slots the device plugin reports Unhealthy now (see the module docstring)."""
    slots = {str(d["slot"]) for d in state.get("pci_devices", []) if d.get("display")}
    if nvml_broken(state):
        return slots
    marked_all = float((state.get("nvidia") or {}).get("marked_at", 0))
    out = set()
    for slot in slots:
        h = (state.get("gpu_health") or {}).get(slot) or {}
        marked = max(float(h.get("marked_at", 0)), marked_all)
        if h.get("unhealthy") or h.get("fallen") or (plugin_started is not None and marked >= plugin_started):
            out.add(slot)
    return out


def crashlooping(state: Obj, pod: Obj) -> bool:
    return bool((state.get("device_plugin") or {}).get("crashloop_pod") == pod["metadata"].get("name"))


def plugin_pod(pods: list[Obj]) -> Obj | None:
    from engine.lab.sim_gpu import OPERAND_LABEL

    live = [p for p in pods if (p["metadata"].get("labels") or {}).get(OPERAND_LABEL) == "device-plugin"
            and not p["metadata"].get("deletionTimestamp")]
    return live[0] if live else None


def withhold(status: Obj, state: Obj, pods: list[Obj]) -> None:
    """Lower ``status``'s allocatable nvidia.com/gpu (capacity stays) for the GPUs the plugin withholds."""
    allocatable = status.get("allocatable") or {}
    on_nvidia = {str(d["slot"]) for d in state.get("pci_devices", []) if d.get("display")
                 and d.get("driver") == "nvidia"}
    pod = plugin_pod(pods)
    if pod is not None and crashlooping(state, pod) and GPU in status.get("capacity", {}):
        # kubelet keeps the plugin's last capacity (for endpointStopGracePeriod) and allocates none
        status["capacity"][GPU] = str(len(on_nvidia))
        allocatable[GPU] = "0"
        return
    if GPU not in allocatable:
        return
    started = running_since(pod) if pod is not None else None
    unhealthy = unhealthy_gpus(state, started)
    if unhealthy:
        allocatable[GPU] = str(max(int(allocatable[GPU]) - len(unhealthy & on_nvidia), 0))


def crashloop_status(pod: Obj, now: float) -> Obj | None:
    """The status patch of a crash-looping device plugin pod (None: it already shows it)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    if statuses and all(((cs.get("state") or {}).get("waiting") or {}).get("reason") == "CrashLoopBackOff"
                        for cs in statuses):
        return None
    from engine.lab.sim_kube import rfc3339

    containers = [c["name"] for c in pod["spec"]["containers"]]
    restarts = max((int(cs.get("restartCount", 0)) for cs in statuses), default=0) + 5
    return {"phase": "Running", "containerStatuses": [
        {"name": name, "image": pod["spec"]["containers"][i].get("image", ""), "ready": False, "started": False,
         "restartCount": restarts,
         "state": {"waiting": {"reason": "CrashLoopBackOff",
                               "message": f"back-off 5m0s restarting failed container={name} pod="
                                          f"{pod['metadata']['name']}"}},
         "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "finishedAt": rfc3339(now)}}}
        for i, name in enumerate(containers)],
        "conditions": [{"type": "Ready", "status": "False", "reason": "ContainersNotReady"},
                       {"type": "ContainersReady", "status": "False", "reason": "ContainersNotReady"}]}


def cuda_start_problem(state: Obj) -> str | None:
    """Why a new CUDA job cannot start on this host (None: it can)."""
    if nvml_broken(state):
        return "CUDA driver version is insufficient for CUDA runtime version (the driver's libraries do not " \
               "match its loaded module)"
    nvidia = state.get("nvidia") or {}
    fm = (state.get("units") or {}).get(FM_UNIT) or {}
    if nvidia.get("nvswitch") and fm.get("active") != "active":
        return "cudaErrorSystemNotReady (802): system not yet initialized (nvidia-fabricmanager is not running)"
    return None
