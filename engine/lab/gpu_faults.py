"""The GPU faults of the catalogue (docs/catalogue.md), as a real node shows them, for ``runbook lab inject``.

Each inject function changes the node's host state the way the fault changes a real host, so the
shims (nvidia-smi, journalctl -k, lspci, systemctl, rmmod/modprobe) and the simulator (allocatable,
the device plugin's pod) show what a real node shows (sources: /work/shared/gpu-failure-facts.md):

``xid79``              kernel ``NVRM: Xid (PCI:0000:SS:00): 79, ... GPU has fallen off the bus.``; nvidia-smi
                       exits 15 (``GPU is lost``); the GPU's CUDA jobs die; the device plugin marks it
                       unhealthy (allocatable drops). Only a reboot brings it back.
``xid48`` / ``xid95``  kernel Xid 48 (double-bit ECC) / 95 (uncontained memory error) on one GPU: its
                       CUDA jobs die, the device plugin marks it unhealthy; a reset of that GPU clears it.
``row-remap-pending``  ``nvidia-smi -q -d ROW_REMAPPER`` shows ``Pending: Yes`` on one GPU (kernel Xid 63):
                       workloads keep running; a reset of that GPU applies the remap.
``driver-mismatch``    a driver upgrade installed newer libraries over the loaded module: nvidia-smi says
                       ``Failed to initialize NVML: Driver/library version mismatch`` (exit 18), the kernel
                       ``NVRM: API mismatch``; the device plugin cannot start (allocatable 0).
``device-plugin``      the device plugin's pod crash-loops: allocatable nvidia.com/gpu 0 while capacity
                       keeps the host's GPUs; the GPUs themselves are fine.
``fabric-manager``     an NVSwitch system (its NVSwitches on lspci) whose ``nvidia-fabricmanager`` failed:
                       CUDA jobs cannot start (``cudaErrorSystemNotReady``, 802).

The host state fields they write (``engine.lab.hoststate`` documents the format): ``gpu_health``
(per slot: ``xid``, ``fallen``, ``unhealthy``, ``remap_pending``, ``rows_uncorrectable``),
``nvidia`` (``loaded``/``installed`` driver versions, ``fabric_manager`` version, ``nvswitch``) and
``device_plugin`` (``crashloop_pod``).
"""

from __future__ import annotations

import time
from typing import Any

from engine.lab.errors import LabError
from engine.lab.inject import Injection, register_fault

DRIVER_VERSION = "570.133.07"  # the lab's loaded driver (the nvidia-smi shim's default)
UPGRADED_VERSION = "570.158.01"  # what a driver upgrade installs in driver-mismatch
NVSWITCH = {"vendor_device": "10de:22a3", "class": "Bridge [0680]", "name": "GH100 [H100 NVSwitch]",
            "subsystem": "NVIDIA Corporation Device [10de:1796]", "rev": "a1", "driver": "nvidia",
            "modules": ["nvidia"], "display": False}
NVSWITCH_SLOTS = ("05:00.0", "06:00.0", "07:00.0", "08:00.0")
FM_UNIT = "nvidia-fabricmanager"
XID_TEXT = {
    79: "GPU has fallen off the bus.",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, "
        "subpartition 0.",
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
    63: "Row Remapper: New row marked for remapping, reset gpu to activate.",
}


def xid_line(slot: str, code: int, pid: int | None = None, name: str = "") -> str:
    """The kernel's Xid line for the GPU in ``slot`` (``01:00.0``): the PCI address without the function."""
    where = f"pid={pid}, name={name}, " if pid else ""
    return f"NVRM: Xid (PCI:0000:{slot.rsplit('.', 1)[0]}): {code}, {where}{XID_TEXT[code]}"


def health(state: dict[str, Any], slot: str) -> dict[str, Any]:
    out: dict[str, Any] = state.setdefault("gpu_health", {}).setdefault(slot, {})
    return out


def jobs_on(state: dict[str, Any], slot: str) -> list[dict[str, Any]]:
    from engine.lab.sim_gpu import job_gpu

    return [j for j in state.get("cuda_jobs", []) if job_gpu(state, j) == slot]


def _kill_jobs_on(state: dict[str, Any], slot: str) -> list[dict[str, Any]]:
    dead = jobs_on(state, slot)
    pids = {int(j["pid"]) for j in dead}
    state["cuda_jobs"] = [j for j in state.get("cuda_jobs", []) if int(j["pid"]) not in pids]
    state["cuda_jobs_killed"] = int(state.get("cuda_jobs_killed", 0)) + len(dead)
    return dead


def _xid(inj: Injection, code: int, *, fallen: bool = False) -> str:
    assert inj.gpu is not None
    slot = inj.gpu
    dead: list[dict[str, Any]] = []

    def change(state: dict[str, Any]) -> None:
        dead.extend(_kill_jobs_on(state, slot))
        h = health(state, slot)
        h.update(xid=code, unhealthy=True, marked_at=time.time())
        if fallen:
            h["fallen"] = True

    inj.host.update(change)
    first = dead[0] if dead else {}
    lines = [xid_line(slot, code, first.get("pid"), first.get("name", ""))]
    if fallen:
        lines.append(f"NVRM: GPU 0000:{slot}: GPU has fallen off the bus.")
        lines.append(f"NVRM: GPU 0000:{slot}: GPU serial number is unavailable.")
    inj.journal("kernel", "kernel", lines)
    killed = f"; CUDA jobs killed with it: {', '.join(str(j['pid']) for j in dead)}" if dead else ""
    return f"{inj.node}: GPU {slot}: Xid {code}{' (fallen off the bus)' if fallen else ''}{killed}"


@register_fault("xid79", "GPU fallen off the bus (Xid 79): nvidia-smi exits 15, its CUDA jobs die; a reboot "
                "brings it back", gpu=True)
def inject_xid79(inj: Injection) -> str:
    return _xid(inj, 79, fallen=True)


@register_fault("xid48", "double-bit ECC error (Xid 48) on one GPU: its CUDA jobs die, the device plugin marks "
                "it unhealthy; a reset of that GPU clears it", gpu=True)
def inject_xid48(inj: Injection) -> str:
    return _xid(inj, 48)


@register_fault("xid95", "uncontained memory error (Xid 95) on one GPU: its CUDA jobs die, the device plugin "
                "marks it unhealthy; a reset of that GPU clears it", gpu=True)
def inject_xid95(inj: Injection) -> str:
    return _xid(inj, 95)


@register_fault("row-remap-pending", "a row remap pending on one GPU (nvidia-smi -q -d ROW_REMAPPER: Pending "
                "Yes): jobs keep running; a reset of that GPU applies it", gpu=True)
def inject_row_remap_pending(inj: Injection) -> str:
    assert inj.gpu is not None
    slot = inj.gpu

    def change(state: dict[str, Any]) -> None:
        h = health(state, slot)
        # the device plugin marks the GPU Unhealthy on Xid 63 too (it ignores only application Xids)
        h.update(remap_pending=True, rows_uncorrectable=int(h.get("rows_uncorrectable", 0)) + 1, xid=63,
                 unhealthy=True, marked_at=time.time())

    inj.host.update(change)
    inj.journal("kernel", "kernel", [xid_line(slot, 63)])
    return f"{inj.node}: GPU {slot}: a row remap is pending (applied by a reset of this GPU)"


@register_fault("driver-mismatch", "a driver upgrade left the old kernel module loaded: NVML 'Driver/library "
                "version mismatch', the device plugin down (allocatable 0)")
def inject_driver_mismatch(inj: Injection) -> str:
    def change(state: dict[str, Any]) -> None:
        nvidia = state.setdefault("nvidia", {})
        nvidia.setdefault("loaded", DRIVER_VERSION)
        nvidia["installed"] = UPGRADED_VERSION
        nvidia["marked_at"] = time.time()  # NVML fails: the device plugin marks every GPU Unhealthy

    inj.host.update(change)
    inj.journal("kernel", "kernel", [
        f"NVRM: API mismatch: the client has the version {UPGRADED_VERSION}, but", "NVRM: this kernel module has "
        f"the version {DRIVER_VERSION}.  Please make sure that this kernel module and", "NVRM: all NVIDIA driver "
        "components have the same version."])
    return f"{inj.node}: driver {UPGRADED_VERSION} installed over the loaded module {DRIVER_VERSION}"


@register_fault("device-plugin", "the NVIDIA device plugin's pod crash-loops: allocatable nvidia.com/gpu 0 "
                "while capacity keeps the GPUs (the GPUs are fine)")
def inject_device_plugin(inj: Injection) -> str:
    from engine.lab.sim_gpu import OPERAND_LABEL
    from engine.lab.sim_kube import PODS

    namespace = inj.lab.scenario().gpu_operator.namespace
    kube = inj.lab.kube()
    try:
        pods = [p for p in kube.list(PODS, namespace)[0]
                if (p["spec"].get("nodeName") == inj.node
                    and (p["metadata"].get("labels") or {}).get(OPERAND_LABEL) == "device-plugin"
                    and not p["metadata"].get("deletionTimestamp"))]
    finally:
        kube.close()
    if not pods:
        raise LabError(f"{inj.node} runs no device-plugin pod (is it a GPU node serving containers, and Ready?)")
    name = str(pods[0]["metadata"]["name"])
    inj.host.update(lambda state: state.__setitem__("device_plugin", {"crashloop_pod": name}))
    return f"{inj.node}: device plugin pod {namespace}/{name} crash-loops"


@register_fault("fabric-manager", "an NVSwitch system whose nvidia-fabricmanager failed: CUDA jobs cannot start "
                "(cudaErrorSystemNotReady, 802)")
def inject_fabric_manager(inj: Injection) -> str:
    now = time.time()

    def change(state: dict[str, Any]) -> None:
        nvidia = state.setdefault("nvidia", {})
        nvidia["nvswitch"] = True
        nvidia.setdefault("fabric_manager", nvidia.get("loaded", DRIVER_VERSION))
        devices = state.setdefault("pci_devices", [])
        have = {d["slot"] for d in devices}
        devices.extend({**NVSWITCH, "slot": s} for s in NVSWITCH_SLOTS if s not in have)
        unit = state.setdefault("units", {}).setdefault(FM_UNIT, {"description": "NVIDIA fabric manager service",
                                                                  "enabled": True})
        unit.update(active="failed", sub="failed", result="exit-code", desired="running", since=now,
                    exec_status=1, main_pid=0)

    inj.host.update(change)
    inj.journal(FM_UNIT, "nv-fabricmanager", [
        "request to query NVSwitch device information from NVSwitch driver failed",
        "fabric manager NVSwitch GPU failed to initialize"], pid=2211)
    inj.journal(FM_UNIT, "systemd", [f"{FM_UNIT}.service: Main process exited, code=exited, status=1/FAILURE",
                                      f"{FM_UNIT}.service: Failed with result 'exit-code'."], pid=1)
    return f"{inj.node}: NVSwitch system, {FM_UNIT} failed"
