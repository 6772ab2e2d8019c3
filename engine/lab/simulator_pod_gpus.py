"""The GPUs of a node's pods, and their CUDA processes on the node host, as a real node has them.

On a real node kubelet's device manager hands each container asking for ``nvidia.com/gpu`` some of
the healthy GPUs the device plugin advertises (kept for the pod's life), and the container's CUDA
process runs on them inside the pod's cgroup: ``/proc/PID/cgroup`` names
``/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<UID>.slice/cri-containerd-<ID>.scope``.
That is how runbook's host facts tell which pod holds which GPU (engine/hostfacts.py).

For a node whose scenario host has ``pod_cuda_jobs: true`` the simulator does the same:

* ``assign`` (pure, on the host state under its lock): each running pod of the node asking for
  ``nvidia.com/gpu`` gets that many GPUs (``state["pod_gpus"][UID] = {"pod": "ns/name", "gpus": [slots]}``):
  the free ones (no other pod's) on the ``nvidia`` driver without a fault, in slot order. A pod that is
  gone or being deleted loses them, and its CUDA jobs leave (a clean exit: not counted as killed). Each
  assigned GPU without its pod's job, and without a fault that kills CUDA work (an Xid NVIDIA answers
  with a reset or a reboot, fallen off the bus), is to get one: the container's process (re)starting;
* ``start_process`` (impure): the job is a real process (``sleep``) in the host's mount namespace,
  whose ``/proc/PID/cgroup`` is a file of the state folder bind-mounted over it (as LXCFS does for
  /proc files): the kernel drops that mount when the process ends. Its pid is the job's pid, so
  nvidia-smi's listing and the cgroup file agree;
* jobs whose process the simulator started and that left ``cuda_jobs`` (a fault killed them, a reset,
  a reboot, ``lab job stop``) have their process ended by PID.

Must not: touch anything but the lab's host state folders and the processes it started, by PID.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from engine.lab.hoststate import IN_HOST_PATH
from engine.lab.sim_pods import is_running

GPU = "nvidia.com/gpu"
CGROUP_DIR = "cgroups"  # in the state folder: one file per job process, bind-mounted over /proc/PID/cgroup
MEMORY_MIB = 16384
Obj = dict[str, Any]


def gpus_asked(pod: Obj) -> int:
    """How many ``nvidia.com/gpu`` the pod's containers ask for (limits, else requests)."""
    total = 0
    for c in pod.get("spec", {}).get("containers") or []:
        res = c.get("resources") or {}
        value = (res.get("limits") or {}).get(GPU) or (res.get("requests") or {}).get(GPU) or 0
        with contextlib.suppress(TypeError, ValueError):
            total += int(str(value))
    return total


def cgroup_line(uid: str, container_id: str) -> str:
    """The unified-hierarchy line of a pod container's process (kubelet's systemd cgroup driver)."""
    return (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid.replace('-', '_')}.slice/"
            f"cri-containerd-{container_id}.scope\n")


def _process_name(pod: Obj) -> str:
    for c in pod.get("spec", {}).get("containers") or []:
        command = c.get("command") or []
        if command:
            return os.path.basename(str(command[0]))
    return "python3"


# the Xids after which a GPU runs no CUDA work until it is reset (or the host rebooted); Xid 63 (a row
# remap recorded, pending) lets workloads run [MEM-FLAGS]
FATAL_XIDS = frozenset({48, 62, 64, 79, 95, 119, 120})


def _usable(state: Obj, slot: str) -> bool:
    """A GPU a CUDA process can run on: on the nvidia driver, not fallen off the bus, no fatal Xid."""
    dev = next((d for d in state.get("pci_devices", []) if d.get("slot") == slot and d.get("display")), None)
    health = state.get("gpu_health", {}).get(slot, {})
    return dev is not None and dev.get("driver") == "nvidia" and not health.get("fallen") and \
        health.get("xid") not in FATAL_XIDS


def _allocatable(state: Obj, slot: str) -> bool:
    """A GPU the device plugin hands to a new pod: usable, and not withheld (Unhealthy, remap pending)."""
    health = state.get("gpu_health", {}).get(slot, {})
    return _usable(state, slot) and not health.get("unhealthy") and not health.get("remap_pending")


def assign(state: Obj, pods: Iterable[Obj]) -> tuple[list[Obj], list[int]]:
    """Bring ``state``'s pod GPUs in line with the node's ``pods`` (in place). Returns the jobs to start
    (``{"pod_uid", "pod", "gpu", "name"}``, their pids to come) and the pids of the jobs that left with
    their pod."""
    alloc: dict[str, Obj] = state.setdefault("pod_gpus", {})
    running = {}
    for pod in pods:
        meta = pod.get("metadata", {})
        uid = meta.get("uid")
        if uid and gpus_asked(pod) > 0 and is_running(pod) and not meta.get("deletionTimestamp"):
            running[uid] = pod
    left: list[int] = []
    for uid in [u for u in alloc if u not in running]:
        del alloc[uid]
        gone = [j for j in state.get("cuda_jobs", []) if j.get("pod_uid") == uid]
        left += [int(j["pid"]) for j in gone]
        state["cuda_jobs"] = [j for j in state.get("cuda_jobs", []) if j.get("pod_uid") != uid]
    taken = {slot for a in alloc.values() for slot in a["gpus"]}
    slots = sorted(str(d["slot"]) for d in state.get("pci_devices", []) if d.get("display"))
    for uid, pod in running.items():
        if uid in alloc:
            continue
        free = [s for s in slots if s not in taken and _allocatable(state, s)]
        want = gpus_asked(pod)
        if len(free) < want:
            continue  # a real kubelet would not have admitted it: nothing to run on
        meta = pod["metadata"]
        alloc[uid] = {"pod": f"{meta.get('namespace')}/{meta.get('name')}", "gpus": free[:want],
                      "name": _process_name(pod)}
        taken.update(free[:want])
    start: list[Obj] = []
    for uid, a in alloc.items():
        for slot in a["gpus"]:
            has_job = any(j.get("pod_uid") == uid and j.get("gpu") == slot for j in state.get("cuda_jobs", []))
            if not has_job and _usable(state, slot):
                start.append({"pod_uid": uid, "pod": a["pod"], "gpu": slot, "name": a.get("name", "python3")})
    return start, left


def add_job(state: Obj, job: Obj, pid: int) -> bool:
    """Record a started job (in place); False when its pod lost the GPU meanwhile (end the process)."""
    a = state.get("pod_gpus", {}).get(job["pod_uid"])
    if a is None or job["gpu"] not in a["gpus"]:
        return False
    state.setdefault("cuda_jobs", []).append({"pid": pid, "name": job["name"], "used_memory_mib": MEMORY_MIB,
                                              "gpu": job["gpu"], "pod_uid": job["pod_uid"], "pod": job["pod"]})
    return True


def start_process(host_pid: int, state_dir: Path, uid: str) -> subprocess.Popen[bytes]:
    """A process in the host's mount namespace whose /proc/PID/cgroup names pod ``uid``."""
    popen = subprocess.Popen(["nsenter", f"--target={host_pid}", "--mount", "--uts", "--", "sleep", "infinity"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True, close_fds=True)
    pid = popen.pid
    try:
        target = os.readlink(f"/proc/{host_pid}/ns/mnt")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # in the host's namespace and exec'd: nothing moves it any more
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/ns/mnt") == target and \
                        os.path.basename(os.readlink(f"/proc/{pid}/exe")) == "sleep":
                    break
            time.sleep(0.01)
        folder = state_dir / CGROUP_DIR
        folder.mkdir(exist_ok=True)
        (folder / str(pid)).write_text(cgroup_line(uid, f"{pid:08x}{uid.replace('-', '')}"[:64]))
        subprocess.run(["nsenter", f"--target={host_pid}", "--mount", "--", "mount", "--bind",
                        f"{IN_HOST_PATH}/{CGROUP_DIR}/{pid}", f"/proc/{pid}/cgroup"],
                       check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        end_process(popen, state_dir)
        raise
    return popen


def end_process(popen: subprocess.Popen[bytes], state_dir: Path) -> None:
    """End a job's process (by its PID, the one this simulator started); its cgroup mount goes with it."""
    if popen.poll() is None:
        popen.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(timeout=5)
    with contextlib.suppress(OSError):
        (state_dir / CGROUP_DIR / str(popen.pid)).unlink()
