"""``runbook lab inject`` words for the node faults that are not GPU faults: ``kubelet-cert-expired``,
``swap``, ``containerd`` (the incident scenario's gpu-3090-3, gpu-3090-1 and gpu-3090-2, put into any
SSH node of a running lab). Each changes the node's host state as the fault would, then has kubelet
restarted (as systemd would after a crash, or an operator after a change), so the node goes NotReady
the way the scenario's node is: kubelet's own lines in its journal, the crash loop, no heartbeat.

* ``kubelet-cert-expired``: kubeadm's client certificate on the host replaced by an expired one (signed
  by the lab's CA), kubelet's state ``client_cert_expired``, no bootstrap kubeconfig.
* ``swap``: an 8 GiB ``/swap.img`` swapfile turned on and in /etc/fstab (gpu-3090-1's).
* ``containerd``: containerd failed, kubelet unable to reach its CRI socket until it runs again
  (gpu-3090-2's lines).

Must not: touch anything but the named node's host (its state folder, its files through its own
namespace) of this lab.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from engine.lab import kubelet_certs
from engine.lab.errors import LabError
from engine.lab.hoststate import write_proc_swaps
from engine.lab.inject import Injection, register_fault
from engine.lab.scenario import load_scenario

SWAP_FILE = "/swap.img"
SWAP_SIZE = 8 << 30
CONTAINERD_TEMPLATE_NODE = "gpu-3090-2"  # the incident scenario's node whose containerd failed


def restart_kubelet(state: dict[str, Any], now: float) -> None:
    """What ``systemctl restart kubelet`` does to the unit (the shim's start): the simulator then
    evaluates the new start (swap, certificate, CRI) and kubelet exits or comes up."""
    unit = state["units"]["kubelet"]
    pid = int(state.get("next_pid", 3000))
    state["next_pid"] = pid + 1
    unit.update(active="active", sub="running", desired="running", since=now, result="success", main_pid=pid,
                exec_status=None, generation=int(unit.get("generation", 0)) + 1)
    unit.pop("next_restart_at", None)
    state["kubelet"]["healthy"] = False


def _host_pid(inj: Injection) -> int | None:
    host = inj.lab.record().get("hosts", {}).get(inj.node)
    return int(host["process"]["pid"]) if host else None


def _host_read(pid: int, path: str) -> str:
    result = subprocess.run(["nsenter", f"--target={pid}", "--mount", "--", "cat", path], capture_output=True,
                            text=True, check=False)
    if result.returncode != 0:
        raise LabError(f"could not read {path} in host pid {pid}: {result.stderr.strip()}")
    return result.stdout


@register_fault("kubelet-cert-expired", "kubelet's client certificate in kubelet.conf expires (no bootstrap "
                                        "kubeconfig): kubelet exits at start, the node goes NotReady")
def inject_kubelet_cert_expired(inj: Injection) -> str:
    pid = _host_pid(inj)
    if pid is not None:
        record = inj.lab.record()
        certs = Path(record["controlplane_dir"]) / "certs"
        kubelet_certs.seed_host(pid, record["api_url"], certs / "ca.crt", certs / "ca.key", inj.node, expired=True)
    now = time.time()

    def expire(state: dict[str, Any]) -> None:
        state["kubelet"].update(client_cert_expired=True, bootstrap_kubeconfig=False, bootstrap=None)
        restart_kubelet(state, now)

    inj.host.update(expire)
    return (f"{inj.node}: kubelet's client certificate expired"
            + (" (kubeadm's files rewritten on the host)" if pid is not None else "") + "; kubelet restarted")


@register_fault("swap", "an 8 GiB /swap.img swapfile turned on and put in /etc/fstab; kubelet restarted "
                        "refuses to start (failSwapOn)")
def inject_swap(inj: Injection) -> str:
    pid = _host_pid(inj)
    if pid is not None:
        fstab = _host_read(pid, "/etc/fstab")
        if not any(line.split()[:1] == [SWAP_FILE] for line in fstab.splitlines() if line.strip()):
            inj.lab.write_host_file(inj.node, "/etc/fstab",
                                    fstab + ("" if fstab.endswith("\n") or not fstab else "\n")
                                    + f"{SWAP_FILE} none swap sw 0 0\n")
    now = time.time()

    def swap_on(state: dict[str, Any]) -> None:
        swap = state.setdefault("swap", {"devices": {}, "active": []})
        swap["devices"].setdefault(SWAP_FILE, {"type": "file", "size": SWAP_SIZE, "used": 0, "in_fstab": True})
        if SWAP_FILE not in swap["active"]:
            swap["active"].append(SWAP_FILE)
        restart_kubelet(state, now)

    inj.host.update(swap_on)
    write_proc_swaps(inj.host.proc_swaps_path, inj.host.read())
    inj.journal("kernel", "kernel", [f"Adding {SWAP_SIZE >> 10}k swap on {SWAP_FILE}.  Priority:-2 extents:1"])
    return f"{inj.node}: swap on ({SWAP_FILE}, in /etc/fstab); kubelet restarted"


@register_fault("containerd", "containerd fails; kubelet cannot reach its CRI socket and crash-loops until "
                              "containerd runs again")
def inject_containerd(inj: Injection) -> str:
    fault = load_scenario().node(CONTAINERD_TEMPLATE_NODE).host.kubelet.fault
    if fault is None:  # the packaged scenario always has it; a changed one must say so
        raise LabError(f"the default scenario's {CONTAINERD_TEMPLATE_NODE} has no containerd fault to copy")
    now = time.time()

    def containerd_down(state: dict[str, Any]) -> None:
        unit = state["units"].setdefault("containerd", {"description": "containerd container runtime",
                                                        "enabled": True, "generation": 1})
        unit.update(active="failed", sub="failed", result="exit-code", desired="stopped", since=now, exec_status=1)
        state["kubelet"]["fault"] = fault.model_dump()
        restart_kubelet(state, now)

    inj.host.update(containerd_down)
    inj.journal("containerd", "systemd", [
        "containerd.service: Main process exited, code=exited, status=1/FAILURE",
        "containerd.service: Failed with result 'exit-code'.",
        "Failed to start containerd.service - containerd container runtime."], pid=1)
    return f"{inj.node}: containerd failed; kubelet restarted (it cannot reach the CRI socket)"
