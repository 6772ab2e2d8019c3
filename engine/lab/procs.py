"""Child processes of the lab, identified by PID *and* start time so a recycled PID is never killed.

Every lab process is stopped through here: by PID, never by name. Must not start anything itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):  # a zombie has ended; only its exit status is left
        return None
    return int(fields[19])


@dataclass(frozen=True)
class ProcessRef:
    """A process we started: its PID and its start time (guards against PID reuse)."""

    pid: int
    start_time: int

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        start = process_start_time(pid)
        return cls(pid, start if start is not None else -1)

    def alive(self) -> bool:
        return process_start_time(self.pid) == self.start_time

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def to_json(self) -> dict[str, int]:
        return {"pid": self.pid, "start_time": self.start_time}

    @classmethod
    def from_json(cls, data: dict[str, int]) -> ProcessRef:
        return cls(int(data["pid"]), int(data["start_time"]))


def stop_processes(refs: Iterable[ProcessRef], timeout: float = 10.0,
                   reap: Callable[[int], None] | None = None) -> None:
    """SIGTERM every process, wait up to ``timeout`` s, then SIGKILL the rest and wait for them."""
    refs = [r for r in refs if r.alive()]
    for ref in refs:
        ref.signal(signal.SIGTERM)
    _wait_gone(refs, timeout, reap)
    left = [r for r in refs if r.alive()]
    for ref in left:
        ref.signal(signal.SIGKILL)
    _wait_gone(left, 10.0, reap)


def _wait_gone(refs: list[ProcessRef], timeout: float, reap: Callable[[int], None] | None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if reap is not None:
            for ref in refs:
                reap(ref.pid)
        if not any(r.alive() for r in refs) or time.monotonic() > deadline:
            return
        time.sleep(0.02)


def reap_child(pid: int) -> None:
    """Collect the exit status of our own child ``pid`` if it has ended (no zombie is left)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGKILL when its parent dies (tests: nothing outlives a killed pytest).

    Linux ties this to the parent *thread*: start such children from a thread that lives as long as
    they should (the main thread), never from a short-lived worker thread.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def pids_in_mount_namespace(ns_inode: str, uts_inode: str | None = None) -> list[int]:
    """Every PID whose mount namespace is ``ns_inode`` (as ``readlink /proc/PID/ns/mnt`` prints it) and,
    when given, whose UTS namespace is ``uts_inode``. Why both: the kernel reuses a freed namespace's
    inode number, so a namespace that ended long ago may name another session's processes now; the pair
    of a mount and a UTS namespace recorded together does not come back by chance."""
    found: list[int] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry.name}/ns/mnt") == ns_inode and (
                    uts_inode is None or os.readlink(f"/proc/{entry.name}/ns/uts") == uts_inode):
                found.append(int(entry.name))
        except OSError:
            continue
    return found
