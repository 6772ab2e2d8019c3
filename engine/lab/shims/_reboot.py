"""A host reboot for a runbook lab node host: going down (``shutdown -r``, ``reboot``, ``systemctl
reboot``) and booting again (run by the host's init loop, engine/lab/nodehosts.py).

Going down: the request is logged (calls.jsonl), systemd's lines go to the journal, and a detached
child, a moment later, stops every unit, forgets the CUDA jobs and kills every process of the host's
mount namespace but its init loop (sshd and every SSH session with it: the connection drops). The init
loop then runs ``boot``: a new boot id (``/proc/sys/kernel/random/boot_id`` is a bind mount of the
state folder's ``boot_id``), swap from /etc/fstab as ``swapon -a`` reads it at boot (what was turned on
by hand stays off; what fstab still lists comes back), services started per their enabled state, the
GPUs bound to their default driver or their saved driverctl override, then sshd starts again.

Installed inside each node host at /usr/local/lib/runbook-lab/_reboot.py. Standard library only.
"""
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

sys.path[:0] = [p for p in (os.path.dirname(os.path.realpath(__file__)), "/usr/local/lib/runbook-lab")
                if os.path.exists(os.path.join(p, "_labstate.py"))]

from _labstate import append_journal, fstab_swap_entries, log_call, resolve_spec, state_file, update_state  # noqa: E402

INIT_PID_FILE = "/run/runbook-init.pid"  # written by the host's init loop (its own tmpfs /run)
REBOOT_FLAG = "/run/runbook-reboot"      # the init loop boots again (instead of exiting) when sshd ends
DOWN_DELAY = 0.5                          # seconds between the request and the host going down
BOOT_SECONDS = float(os.environ.get("RUNBOOK_LAB_BOOT_SECONDS", "1.0"))  # the host is away this long
DEFAULT_DRIVER = {"10de": "nvidia"}


def request(cmd: str, argv: list[str]) -> int:
    """``shutdown -r`` and friends: log it, announce it, go down a moment later (detached). Returns 0."""
    log_call(cmd, argv, 0)

    def change(state: dict[str, Any]) -> None:
        boot = state.setdefault("boot", {"count": 0})
        boot["requested"] = time.time()
    update_state(change)
    append_journal("systemd-logind", "systemd-logind", 700, ["The system will reboot now!"])
    if os.environ.get("RUNBOOK_LAB_HOST_STATE"):  # unit tests: no namespace to take down
        return 0
    subprocess.Popen([sys.executable, os.path.realpath(__file__), "down"], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    return 0


def stop_everything(state: dict[str, Any]) -> list[str]:
    """What the host loses going down: every unit stopped, every process (the CUDA jobs) gone."""
    lines = []
    for name, unit in sorted(state.get("units", {}).items()):
        if unit.get("active") in ("active", "activating"):
            lines.append(f"Stopped {name}.service - {unit.get('description', name)}.")
        unit.update(active="inactive", sub="dead", desired="stopped", since=time.time(), result="success")
        unit.pop("next_restart_at", None)
    state.setdefault("kubelet", {})["healthy"] = False
    state["cuda_jobs"] = []
    return lines


def down() -> int:
    time.sleep(DOWN_DELAY)
    lines: list[str] = []
    update_state(lambda state: lines.extend(stop_everything(state)))
    append_journal("systemd", "systemd", 1, [*lines, "Reached target System Reboot.", "Rebooting."])
    with open(REBOOT_FLAG, "w") as f:  # the init loop waits for "down" before it boots
        f.write("going-down")
    with open(INIT_PID_FILE) as f:
        init = int(f.read().strip())
    mine = os.readlink("/proc/self/ns/mnt")
    for _ in range(3):  # sessions may fork while we kill
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in (init, os.getpid()):
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/mnt") == mine:
                    os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.1)
    with open(REBOOT_FLAG, "w") as f:
        f.write("down")
    return 0


def boot_state(state: dict[str, Any], fstab_entries: list[tuple[str, list[str]]], boot_id: str,
               now: float) -> list[str]:
    """The state after a boot (in place); returns the journal lines. Pure over its inputs (unit tests)."""
    lines = [f"-- Boot {boot_id.replace('-', '')} --", "Linux version (runbook lab node host)"]
    swap = state.setdefault("swap", {"devices": {}, "active": []})
    swap["active"] = []
    for spec, options in fstab_entries:  # systemd-fstab-generator: one .swap unit per fstab entry
        if "noauto" in options:
            continue
        name = resolve_spec(state, spec)
        if name is None:
            if "nofail" not in options:
                lines.append(f"Timed out waiting for device {spec}.")
            continue
        if name in swap["active"]:
            continue
        swap["active"].append(name)
        pri = next((o.split("=", 1)[1] for o in options if o.startswith("pri=")), None)
        if pri is not None and pri.lstrip("-").isdigit():
            swap["devices"][name]["prio"] = int(pri)
        else:
            swap["devices"][name].pop("prio", None)
        lines.append(f"Activated swap {name}.")
    for name, dev in swap.get("devices", {}).items():  # a generator's or a .swap unit file's: back at boot
        if not dev.get("in_fstab", True) and (dev.get("generator") or dev.get("unit_file", True)) \
                and name not in swap["active"]:
            swap["active"].append(name)
            lines.append(f"Activated swap {name}.")
    for dev in state.get("pci_devices", []):  # the kernel binds each device; driverctl's saved overrides win
        if dev.get("display") or dev.get("vendor_device", "").startswith("10de:"):
            default = DEFAULT_DRIVER.get(dev.get("vendor_device", ":").split(":")[0], "none") \
                if dev.get("display") else dev.get("driver", "none")
            dev["driver"] = dev.get("driver_override") or default
    state["cuda_jobs"] = []
    # a boot resets every GPU and loads the installed driver: the faults a reboot clears are gone
    # (the remap counts stay: they live in the GPU's memory); engine/lab/gpu_faults.py
    for slot, health in list(state.get("gpu_health", {}).items()):
        state["gpu_health"][slot] = {k: v for k, v in health.items() if k.startswith("rows_")}
    nvidia = state.get("nvidia")
    if nvidia:
        nvidia["loaded"] = nvidia.get("installed", nvidia.get("loaded"))
        nvidia.pop("marked_at", None)
    for name, unit in sorted(state.get("units", {}).items()):
        desc = f"{name}.service - {unit.get('description', name)}"
        if not unit.get("enabled", True):
            unit.update(active="inactive", sub="dead", desired="stopped", since=now, result="success")
            continue
        if unit.get("start_error"):
            err = unit["start_error"]
            unit.update(active="failed", sub="failed", result="exit-code", desired="running", since=now,
                        exec_status=int(err.get("status", 1)), generation=int(unit.get("generation", 0)) + 1)
            lines += [f"Starting {desc}...", f"Failed to start {desc}."]
            continue
        pid = int(state.get("next_pid", 3000))
        state["next_pid"] = pid + 1
        unit.update(active="active", sub="running", desired="running", since=now, result="success",
                    main_pid=pid, exec_status=None, generation=int(unit.get("generation", 0)) + 1)
        unit.pop("next_restart_at", None)
        lines.append(f"Started {desc}.")
    boot = state.setdefault("boot", {"count": 0})
    boot.update(id=boot_id, count=int(boot.get("count", 0)) + 1, at=now)
    boot.pop("requested", None)
    lines.append("Reached target Multi-User System.")
    return lines


def boot() -> int:
    """Run by the init loop once sshd is gone: the host is away BOOT_SECONDS, then comes back."""
    time.sleep(BOOT_SECONDS)
    boot_id = str(uuid.uuid4())
    with open(state_file("boot_id"), "r+" if os.path.exists(state_file("boot_id")) else "w") as f:
        f.seek(0)  # in place: /proc/sys/kernel/random/boot_id is a bind mount of this file
        f.write(boot_id + "\n")
        f.truncate()
    entries = fstab_swap_entries()
    lines: list[str] = []
    update_state(lambda state: lines.extend(boot_state(state, entries, boot_id, time.time())))
    append_journal("systemd", "systemd", 1, lines)
    if not os.environ.get("RUNBOOK_LAB_HOST_STATE"):  # inside the host only: /tmp is empty after a boot
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/tmp"], check=False)
    return 0


if __name__ == "__main__":
    verb = sys.argv[1] if len(sys.argv) > 1 else ""
    sys.exit(down() if verb == "down" else boot() if verb == "boot" else 2)
