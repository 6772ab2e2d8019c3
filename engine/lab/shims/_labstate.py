"""Shared by the runbook lab's shims: the host state folder's format and locking.

Installed inside each node host at /usr/local/lib/runbook-lab/_labstate.py (the shims add that folder,
or their own when run from the source tree, to ``sys.path``). Keep in step with
``engine/lab/hoststate.py``: the shims cannot import the engine (it is not installed in the hosts).
Standard library only.
"""
import fcntl
import json
import os
import time
from collections.abc import Callable
from typing import Any

STATE_DIR = os.environ.get("RUNBOOK_LAB_HOST_STATE", "/run/runbook-lab")
FSTAB = os.environ.get("RUNBOOK_LAB_FSTAB", "/etc/fstab")


def state_file(name: str) -> str:
    return os.path.join(STATE_DIR, name)


def load_state() -> dict[str, Any]:
    with open(state_file("state.json")) as f:  # replaced by rename: a plain read is consistent
        return dict(json.load(f))


def update_state(change: Callable[[dict[str, Any]], Any]) -> Any:
    """Apply change(state) under the exclusive lock, write state.json and /proc/swaps back."""
    with open(state_file("state.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(state_file("state.json")) as f:
            state = json.load(f)
        result = change(state)
        state["seq"] = int(state.get("seq", 0)) + 1
        tmp = state_file("state.tmp")
        with open(tmp, "w") as f:
            json.dump(state, f, indent=1, sort_keys=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, state_file("state.json"))
        write_proc_swaps(state)
    return result


def write_proc_swaps(state: dict[str, Any]) -> None:
    lines = ["Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority"]
    devices = state.get("swap", {}).get("devices", {})
    for index, name in enumerate(state.get("swap", {}).get("active", [])):
        dev = devices.get(name, {})
        size_kib = max(int(dev.get("size", 0)) // 1024 - 4, 0)
        used_kib = int(dev.get("used", 0)) // 1024
        prio = dev.get("prio", -2 - index)
        lines.append(f"{name:<40}{dev.get('type', 'file')}\t\t{size_kib}\t{used_kib}\t\t{prio}")
    path = state_file("proc_swaps")
    with open(path, "r+" if os.path.exists(path) else "w") as f:  # in place: /proc/swaps is a bind mount
        f.seek(0)
        f.write("\n".join(lines) + "\n")
        f.truncate()


def append_journal(unit: str, ident: str, pid: int, messages: list[str]) -> None:
    with open(state_file("journal.jsonl"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        for msg in messages:
            f.write(json.dumps({"ts": time.time(), "unit": unit, "ident": ident, "pid": pid, "msg": msg}) + "\n")


def log_call(cmd: str, argv: list[str], rc: int) -> None:
    with open(state_file("calls.jsonl"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps({"ts": time.time(), "cmd": cmd, "argv": argv, "uid": os.geteuid(), "rc": rc}) + "\n")


# -- swap in /etc/fstab (swapon -a, systemd's fstab generator) -------------------------------------
BY_TAG = {"UUID": "/dev/disk/by-uuid/", "LABEL": "/dev/disk/by-label/", "PARTUUID": "/dev/disk/by-partuuid/"}


def fstab_swap_entries() -> list[tuple[str, list[str]]]:
    """The uncommented /etc/fstab entries of type swap: (device spec, options)."""
    entries: list[tuple[str, list[str]]] = []
    try:
        with open(FSTAB) as f:
            lines = f.read().splitlines()
    except OSError:
        return entries
    for line in lines:
        fields = line.split()
        if len(fields) < 3 or fields[0].startswith("#") or fields[2] != "swap":
            continue
        entries.append((fields[0], fields[3].split(",") if len(fields) > 3 else []))
    return entries


def spec_path(spec: str) -> str:
    """The device path a fstab spec names: ``UUID=x`` -> /dev/disk/by-uuid/x (what systemd's unit is named after)."""
    tag, sep, value = spec.partition("=")
    if sep and tag in BY_TAG:
        return BY_TAG[tag] + value.strip('"')
    return spec


def resolve_spec(state: dict[str, Any], spec: str) -> str | None:
    """The swap device (its /proc/swaps name) a fstab spec or device path denotes: the name itself,
    one of its ``aliases`` (LVM's /dev/mapper/vg-lv), ``UUID=`` / ``LABEL=`` / ``PARTUUID=`` or their
    /dev/disk/by-* links. None: no such device."""
    devices = state.get("swap", {}).get("devices", {})
    path = spec_path(spec)
    for name, dev in devices.items():
        if path == name or path in dev.get("aliases", []):
            return name
        for tag, folder in BY_TAG.items():
            value = dev.get(tag.lower())
            if value and path == folder + value:
                return name
    return None
