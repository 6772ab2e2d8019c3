"""The node host's state folder: the contract between the host's shims, the simulator and the manager.

One folder per simulated node (on this machine: ``<lab>/hosts/<node>/state``; inside the node host's
namespace it is bind-mounted at ``/run/runbook-lab``). It holds:

``state.json``
    The host's state (format below), replaced atomically (write + rename) under an exclusive
    ``fcntl.flock`` on ``state.lock``; readers take a shared lock.
``journal.jsonl``
    The systemd journal, one JSON object a line: ``{"ts", "unit", "ident", "pid", "msg"}``.
``calls.jsonl``
    Append-only log of every *mutating* shim call (``swapoff``, ``swapon -a``, ``systemctl restart``...):
    ``{"ts", "cmd", "argv", "uid", "rc"}``. Fault tests count calls here.
``proc_swaps``
    What the host's ``/proc/swaps`` shows (bind-mounted over it). Rewritten *in place*, never renamed,
    since a bind mount follows the inode.

``state.json`` (version 1)::

    {"version": 1, "host": "omen2", "seq": 12,
     "swap": {"devices": {"/swapfile": {"type": "file", "size": 34359738368, "used": 0,
                          "in_fstab": true}},                                     # what could be swapped on
              "active": ["/swapfile"]},                                           # in activation order
     "units": {"kubelet": {"active": "activating", "sub": "auto-restart", "result": "exit-code",
                           "enabled": true, "desired": "running", "restarts": 9676,
                           "main_pid": 2345, "since": 1720626000.0, "generation": 3},
               "containerd": {...}},
     "kubelet": {"fail_swap_on": true,
                 "fault": null | {"mode": "exit" | "no-heartbeat", "lines": ["..."],
                                  "until_unit_active": "containerd"}},
     "pci_devices": [{"slot": "01:00.0", "vendor_device": "10de:2b85",
                      "class": "VGA compatible controller [0300]",
               "name": "GB202 [GeForce RTX 5090]", "subsystem": "NVIDIA Corporation Device [10de:2055]",
               "rev": "a1", "driver": "nvidia", "modules": ["nvidiafb", "nouveau", "nvidia_drm", "nvidia"],
               "display": true}, {"slot": "01:00.1", "class": "Audio device [0403]", ...}],
     "cuda_jobs": [{"pid": 4242, "name": "python3", "used_memory_mib": 20480,
                    "gpu": "01:00.0"}],                      # the slot of the GPU it runs on
     "cuda_jobs_killed": 0}

The GPU faults of ``runbook lab inject`` (engine/lab/gpu_faults.py; absent on a healthy host) add
``gpu_health`` (slot -> ``{"xid", "unhealthy", "fallen", "remap_pending", "rows_uncorrectable",
"marked_at", "reset_at"}``), ``nvidia`` (``{"loaded", "installed", "fabric_manager", "nvswitch",
"marked_at"}``: versions of the loaded module, the installed libraries and the fabric manager) and
``device_plugin`` (``{"crashloop_pod": NAME}``); a GPU's ``persistence_mode`` ("Enabled") lives on its
``pci_devices`` entry. nvidia-smi, rmmod/modprobe and the reboot shim change them like the real node.

A CUDA job without ``gpu`` (a state written before GPUs were modelled one by one) runs on the first
GPU bound to ``nvidia``. It dies (``cuda_jobs_killed`` grows) when its GPU leaves ``nvidia``; jobs on
the node's other GPUs live on.

``units.<name>.start_error`` (optional, set by tests: ``{"status": 1, "lines": ["level=fatal ..."]}``)
makes ``systemctl start/restart`` of that unit fail like systemd: its lines and systemd's in the
journal, the unit ``failed``, rc 1. ``crictl info`` answers while ``units.containerd`` is active.
``units.<name>.active`` is what ``systemctl is-active`` prints. ``desired`` is what systemd was last
asked for (``running`` or ``stopped``); ``generation`` grows with each start/restart request, so the
simulator notices a restart even when the state did not change. The shims under ``lab/shims/`` carry
their own copy of the locking and I/O below (they cannot import the engine): keep both in step.

This module does file I/O only; it never runs commands nor talks to Kubernetes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
IN_HOST_PATH = "/run/runbook-lab"  # where the folder is mounted inside a node host
STATE_ENV = "RUNBOOK_LAB_HOST_STATE"  # overrides IN_HOST_PATH for the shims (unit tests)
JOURNAL_KEEP = 4000  # lines kept when the journal is trimmed

State = dict[str, Any]


class HostState:
    """Read and change one host's state folder, with the same locking as the shims."""

    def __init__(self, folder: Path | str) -> None:
        self.folder = Path(folder)

    # --- paths -------------------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        return self.folder / "state.json"

    @property
    def lock_path(self) -> Path:
        return self.folder / "state.lock"

    @property
    def journal_path(self) -> Path:
        return self.folder / "journal.jsonl"

    @property
    def calls_path(self) -> Path:
        return self.folder / "calls.jsonl"

    @property
    def proc_swaps_path(self) -> Path:
        return self.folder / "proc_swaps"

    # --- state.json ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        with open(self.lock_path, "a" if exclusive else "r") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def read(self) -> State:
        with self._locked(exclusive=False):
            return json.loads(self.state_path.read_text())

    def mtime_ns(self) -> int:
        """Changes whenever the state is written (cheap change detection for the simulator)."""
        try:
            return self.state_path.stat().st_mtime_ns
        except FileNotFoundError:
            return 0

    def update(self, change: Callable[[State], Any]) -> Any:
        """Apply ``change`` to the state under the exclusive lock and write it back; return its result."""
        with self._locked(exclusive=True):
            state = json.loads(self.state_path.read_text())
            result = change(state)
            self._write(state)
        return result

    def _write(self, state: State) -> None:
        state["seq"] = int(state.get("seq", 0)) + 1
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.state_path)
        write_proc_swaps(self.proc_swaps_path, state)

    def initialise(self, state: State, journal: list[dict[str, Any]] | None = None) -> None:
        """(Re)create the folder's files from ``state``: used by ``lab up`` and ``lab reset``."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.lock_path.touch()
        os.chmod(self.lock_path, 0o644)
        with self._locked(exclusive=True):
            state = dict(state, version=FORMAT_VERSION, seq=0)
            self._write(state)
            lines = "".join(json.dumps(e) + "\n" for e in sorted(journal or [], key=lambda e: e["ts"]))
            self.journal_path.write_text(lines)  # in place: same inode
            self.calls_path.write_text("")
        for path in (self.journal_path, self.calls_path):
            os.chmod(path, 0o644)

    # --- journal and call log ---------------------------------------------------------------------------
    def append_journal(self, unit: str, ident: str, pid: int, messages: list[str],
                       ts: float | None = None) -> None:
        ts = time.time() if ts is None else ts
        with open(self.journal_path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            for msg in messages:
                f.write(json.dumps({"ts": ts, "unit": unit, "ident": ident, "pid": pid, "msg": msg}) + "\n")

    def append_entries(self, entries: list[dict[str, Any]]) -> None:
        """Append journal entries (``{"ts", "unit", "ident", "pid", "msg"}``) in one locked write."""
        if not entries:
            return
        with open(self.journal_path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write("".join(json.dumps(e) + "\n" for e in entries))

    def journal(self, unit: str | None = None) -> list[dict[str, Any]]:
        entries = [json.loads(line) for line in self.journal_path.read_text().splitlines() if line]
        return [e for e in entries if unit is None or e["unit"] == unit]

    def trim_journal(self, keep: int = JOURNAL_KEEP) -> None:
        with open(self.journal_path, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            lines = f.readlines()
            if len(lines) > keep * 2:
                f.seek(0)
                f.writelines(lines[-keep:])
                f.truncate()

    def calls(self, cmd: str | None = None) -> list[dict[str, Any]]:
        """The mutating shim calls recorded so far (optionally only those of ``cmd``)."""
        entries = [json.loads(line) for line in self.calls_path.read_text().splitlines() if line]
        return [e for e in entries if cmd is None or e["cmd"] == cmd]


def proc_swaps_text(state: State) -> str:
    """``/proc/swaps`` for ``state``: a header, then one line per active device (sizes in KiB)."""
    lines = ["Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority"]
    devices = state.get("swap", {}).get("devices", {})
    for index, name in enumerate(state.get("swap", {}).get("active", [])):
        dev = devices.get(name, {})
        size_kib = max(int(dev.get("size", 0)) // 1024 - 4, 0)  # the kernel leaves out the header page
        used_kib = int(dev.get("used", 0)) // 1024
        prio = dev.get("prio", -2 - index)  # fstab's pri=N, else the kernel's -2, -3, ...
        lines.append(f"{name:<40}{dev.get('type', 'file')}\t\t{size_kib}\t{used_kib}\t\t{prio}")
    return "\n".join(lines) + "\n"


def write_proc_swaps(path: Path, state: State) -> None:
    """Rewrite ``path`` in place (a bind mount over /proc/swaps follows the inode, not the name)."""
    text = proc_swaps_text(state)
    mode = "r+" if path.exists() else "w"
    with open(path, mode) as f:
        f.seek(0)
        f.write(text)
        f.truncate()
    os.chmod(path, 0o644)
