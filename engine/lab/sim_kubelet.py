"""The simulated kubelet's unit life cycle on a node host, as systemd and kubelet would write it.

Pure functions over a host's ``state.json`` dict (see ``hoststate``): ``step`` moves the kubelet unit
along (a start that fails or comes up, ``activating (auto-restart)``, the next try after RestartSec)
and returns the journal entries to append. The systemctl shim starts, stops and restarts the unit;
only this module decides whether kubelet survives its start:

* swap active and ``failSwapOn`` (the default) -> the exact kubelet error line, then systemd's
  ``Main process exited ... status=1/FAILURE`` and ``Failed with result 'exit-code'``;
* a scenario fault (``exit``: other crash lines, e.g. containerd down; ``no-heartbeat``: kubelet runs
  but cannot post status);
* an expired client certificate (``client_cert_expired``) and no bootstrap kubeconfig -> kubelet's
  lines, exit; with one (``bootstrap_kubeconfig``, the simulator looks at start) kubelet runs without
  heartbeat while the simulator does its TLS bootstrap against the API server (``kubelet_certs``),
  and exits (``fail_bootstrap``) when the API server refuses its token;
* otherwise kubelet is up and the simulator heartbeats for it (``state["kubelet"]["healthy"]``).

No I/O here: the simulator applies ``step`` under the host state's lock and writes the entries.
"""

from __future__ import annotations

import time
from typing import Any

from engine.lab.hoststate import proc_swaps_text

UNIT = "kubelet"
DESCRIPTION = "kubelet: The Kubernetes Node Agent"
SWAP_ERROR = ('run.go:72] "command failed" err="failed to run Kubelet: running with swap on is not '
              'supported, please disable swap or set --fail-swap-on flag to false"')

Entry = dict[str, Any]

# a kubelet whose client certificate expired and that has no bootstrap kubeconfig (kubelet_certs)
EXPIRED_CERT_LINES = [
    "E bootstrap.go:266] part of the existing bootstrap client certificate in /etc/kubernetes/kubelet.conf "
    "is expired: 2025-03-20 08:12:44 +0000 UTC",
    'E run.go:72] "command failed" err="failed to run Kubelet: unable to load bootstrap kubeconfig: stat '
    '/etc/kubernetes/bootstrap-kubelet.conf: no such file or directory"',
]
# ... with one: it requests a certificate and waits for it (no heartbeat meanwhile)
BOOTSTRAP_LINES = [
    "I bootstrap.go:154] Using bootstrap kubeconfig to generate TLS client cert, key and kubeconfig file",
    'I certificate_manager.go:412] "Rotating certificates"',
]


def bootstrap_refused_lines(error: str) -> list[str]:
    """kubelet's lines when the API server refuses its bootstrap credential."""
    return ['E certificate_manager.go:488] "Failed while requesting a signed certificate from the control plane" '
            f'err="cannot create certificate signing request: {error}"',
            f'E run.go:72] "command failed" err="failed to run Kubelet: failed to bootstrap client certificate: '
            f'{error}"']


def klog_line(level: str, ts: float, pid: int, rest: str) -> str:
    """``E0710 15:39:51.123456    2345 run.go:72] ...``: klog's header, then ``rest``."""
    stamp = time.strftime("%m%d %H:%M:%S", time.localtime(ts))
    return f"{level}{stamp}.{int(ts % 1 * 1e6):06d} {pid:>7} {rest}"


def entry(ts: float, ident: str, pid: int, msg: str) -> Entry:
    return {"ts": ts, "unit": UNIT, "ident": ident, "pid": pid, "msg": msg}


def _systemd(ts: float, msg: str) -> Entry:
    return entry(ts, "systemd", 1, msg)


def proc_swaps_lines(state: dict[str, Any]) -> list[str]:
    return proc_swaps_text(state).rstrip("\n").split("\n")


def failure_lines(state: dict[str, Any], ts: float, pid: int) -> list[str] | None:
    """The kubelet lines of a start that fails now, or None when kubelet would come up."""
    kubelet, units = state["kubelet"], state.get("units", {})
    fault = kubelet.get("fault")
    if fault and fault.get("mode", "exit") == "exit":
        needed = fault.get("until_unit_active")
        if not needed or units.get(needed, {}).get("active") != "active":
            return [klog_line(line[0], ts, pid, line[2:]) for line in fault["lines"]]
    if kubelet.get("client_cert_expired") and not kubelet.get("bootstrap_kubeconfig"):
        return [klog_line(line[0], ts, pid, line[2:]) for line in EXPIRED_CERT_LINES]
    if kubelet.get("fail_swap_on", True) and state.get("swap", {}).get("active"):
        contents = "[" + ",".join(f'"{line}"' for line in proc_swaps_lines(state)).replace("\t", "\\t") + "]"
        return [
            klog_line("I", ts, pid, 'server.go:484] "Kubelet version" kubeletVersion="v1.20.2"'),
            klog_line("E", ts, pid, f'container_manager_linux.go:248] "Swap is on" /proc/swaps contents={contents}'),
            klog_line("E", ts, pid, SWAP_ERROR),
        ]
    return None


def heartbeat_blocked(state: dict[str, Any]) -> list[str] | None:
    """Lines of a ``no-heartbeat`` fault that holds now (kubelet runs but cannot post), else None."""
    kubelet = state["kubelet"]
    if kubelet.get("client_cert_expired") and kubelet.get("bootstrap_kubeconfig"):
        return list(BOOTSTRAP_LINES)  # requesting its certificate (the simulator's TLS bootstrap)
    fault = kubelet.get("fault")
    if fault and fault.get("mode") == "no-heartbeat":
        needed = fault.get("until_unit_active")
        if not needed or state.get("units", {}).get(needed, {}).get("active") != "active":
            return list(fault["lines"])
    return None


def _exit(state: dict[str, Any], now: float, lines: list[str], restart_seconds: float) -> list[Entry]:
    unit = state["units"][UNIT]
    pid = int(unit.get("main_pid", 0))
    entries = [entry(now, "kubelet", pid, line) for line in lines]
    entries += [_systemd(now, f"{UNIT}.service: Main process exited, code=exited, status=1/FAILURE"),
                _systemd(now, f"{UNIT}.service: Failed with result 'exit-code'.")]
    unit.update(active="activating", sub="auto-restart", result="exit-code", exec_status=1, since=now,
                next_restart_at=now + restart_seconds)
    state["kubelet"].update(healthy=False, evaluated_generation=unit.get("generation", 0))
    return entries


def fail_bootstrap(state: dict[str, Any], now: float, error: str, restart_seconds: float) -> list[Entry]:
    """The running kubelet's certificate request was refused: it exits (systemd restarts it later)."""
    pid = int(state["units"][UNIT].get("main_pid", 0))
    return _exit(state, now, [klog_line(line[0], now, pid, line[2:]) for line in bootstrap_refused_lines(error)],
                 restart_seconds)


def come_up(state: dict[str, Any], now: float) -> list[Entry]:
    """kubelet started: it heartbeats (``healthy``) unless a ``no-heartbeat`` fault holds."""
    unit = state["units"][UNIT]
    pid = int(unit.get("main_pid", 0))
    blocked = heartbeat_blocked(state)
    state["kubelet"].update(healthy=blocked is None, healthy_since=now,
                            evaluated_generation=unit.get("generation", 0))
    lines = [klog_line("I", now, pid, 'server.go:484] "Kubelet version" kubeletVersion="v1.20.2"'),
             klog_line("I", now, pid, 'server.go:1255] "Started kubelet"'),
             klog_line("I", now, pid, 'kubelet.go:2375] "Starting kubelet main sync loop"')]
    lines += [klog_line(line[0], now, pid, line[2:]) for line in blocked or []]
    return [entry(now, "kubelet", pid, line) for line in lines]


def _new_pid(state: dict[str, Any]) -> int:
    pid = int(state.get("next_pid", 3000))
    state["next_pid"] = pid + 1
    return pid


def due(state: dict[str, Any], now: float, start_seconds: float) -> bool:
    """Whether ``step`` has something to do (cheap check before taking the lock)."""
    unit = state.get("units", {}).get(UNIT)
    if unit is None:
        return False
    kubelet = state["kubelet"]
    if unit.get("desired") != "running":
        return bool(kubelet.get("healthy"))
    if unit["active"] == "active":
        if kubelet.get("evaluated_generation") != unit.get("generation", 0):
            return now - float(unit.get("since", 0)) >= start_seconds
        return bool(kubelet.get("healthy")) == (heartbeat_blocked(state) is not None)
    if unit["active"] == "activating":
        return now >= float(unit.get("next_restart_at", 0))
    return False


def step(state: dict[str, Any], now: float, start_seconds: float, restart_seconds: float) -> list[Entry]:
    """Advance the kubelet unit; return journal entries. Call under the host state's lock."""
    if not due(state, now, start_seconds):
        return []
    unit, kubelet = state["units"][UNIT], state["kubelet"]
    if unit.get("desired") != "running":
        kubelet["healthy"] = False
        return []
    if unit["active"] == "active" and kubelet.get("evaluated_generation") != unit.get("generation", 0):
        lines = failure_lines(state, now, int(unit.get("main_pid", 0)))
        return _exit(state, now, lines, restart_seconds) if lines else come_up(state, now)
    if unit["active"] == "active":  # a no-heartbeat fault appeared or cleared while running
        kubelet["healthy"] = heartbeat_blocked(state) is None
        kubelet["healthy_since"] = now
        return []
    # activating (auto-restart): RestartSec has passed, systemd starts kubelet again
    restarts = int(unit.get("restarts", 0)) + 1
    desc = f"{UNIT}.service - {DESCRIPTION}"
    entries = [_systemd(now, f"{UNIT}.service: Scheduled restart job, restart counter is at {restarts}."),
               _systemd(now, f"Stopped {desc}."), _systemd(now, f"Started {desc}.")]
    unit.update(active="active", sub="running", result="success", restarts=restarts, since=now,
                main_pid=_new_pid(state), exec_status=None, generation=int(unit.get("generation", 0)) + 1)
    unit.pop("next_restart_at", None)
    # an automatic retry fails at once (so `is-active` keeps printing "activating"), or comes up
    lines = failure_lines(state, now, int(unit["main_pid"]))
    return entries + (_exit(state, now, lines, restart_seconds) if lines else come_up(state, now))


def crash_history(state: dict[str, Any], now: float, tries: int, restart_seconds: float) -> list[Entry]:
    """Journal of the last ``tries`` failed starts before ``now`` (a crash loop already under way)."""
    entries: list[Entry] = []
    unit = state["units"][UNIT]
    for i in range(tries, 0, -1):
        ts = now - i * (restart_seconds + 0.05)
        if entries:
            unit["restarts"] = int(unit.get("restarts", 0)) + 1
            desc = f"{UNIT}.service - {DESCRIPTION}"
            entries += [_systemd(ts, f"{UNIT}.service: Scheduled restart job, restart counter is at "
                                     f"{unit['restarts']}."),
                        _systemd(ts, f"Stopped {desc}."), _systemd(ts, f"Started {desc}.")]
        unit["main_pid"] = _new_pid(state)
        lines = failure_lines(state, ts + 0.04, unit["main_pid"]) or []
        entries += _exit(state, ts + 0.05, lines, restart_seconds)
    return entries
