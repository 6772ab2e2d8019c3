"""The lab's simulated reboot, as the node host's shims play it (engine/lab/shims/_reboot.py).

``shutdown -r`` (as Ansible's reboot module issues it) is recorded and announced; the boot then
re-reads /etc/fstab (swap left there comes back on, swap turned on by hand does not), starts the
services per their enabled state, binds the GPUs to their default driver unless driverctl saved an
override, forgets the CUDA jobs and writes a new boot id. Run on a temporary state folder
(``RUNBOOK_LAB_HOST_STATE``): nothing is taken down here, the namespace part is the lab test's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.lab import sim_kubelet
from engine.lab.hoststate import HostState
from engine.lab.scenario import load_scenario
from engine.lab.sim_seed import fstab_text, host_state

SHIMS = Path(__file__).resolve().parents[3] / "engine" / "lab" / "shims"
NOW = 1_752_161_991.0

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="shutdown refuses non-root users, like the real one")


@pytest.fixture
def host(tmp_path: Path) -> HostState:
    sc = load_scenario()
    node = sc.node("omen2")
    state, journal = host_state(node, sc, NOW)
    hs = HostState(tmp_path / "state")
    hs.initialise(state, journal)
    (tmp_path / "fstab").write_text(fstab_text(node))
    (hs.folder / "boot_id").write_text("11111111-2222-3333-4444-555555555555\n")
    return hs


def run(host: HostState, tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RUNBOOK_LAB_HOST_STATE": str(host.folder),
           "RUNBOOK_LAB_FSTAB": str(host.folder.parent / "fstab"), "RUNBOOK_LAB_BOOT_SECONDS": "0"}
    return subprocess.run([sys.executable, str(SHIMS / tool), *args], capture_output=True, text=True, env=env,
                          check=False)


@needs_root
def test_shutdown_reboots_now_only_and_is_recorded(host: HostState) -> None:
    assert run(host, "shutdown", "-h", "now").returncode == 1
    later = run(host, "shutdown", "-r", "+5", "later")
    assert later.returncode == 1 and "now only" in later.stderr
    assert host.calls() == []

    done = run(host, "shutdown", "-r", "0", "runbook node-reboot")

    assert done.returncode == 0, done.stderr
    assert [(c["cmd"], c["argv"]) for c in host.calls()] == [("shutdown", ["-r", "0", "runbook node-reboot"])]
    assert host.journal("systemd-logind")[-1]["msg"] == "The system will reboot now!"
    assert "requested" in host.read()["boot"]


def test_the_boot_rereads_fstab_starts_enabled_services_and_rebinds_the_gpus(host: HostState) -> None:
    def before(state: dict) -> None:
        state["swap"]["devices"]["/swapfile2"] = {"size": 1 << 30, "in_fstab": False, "unit_file": False}
        state["swap"]["active"] = ["/swapfile2"]  # /swapfile was turned off, /swapfile2 on by hand
        state["units"]["containerd"]["enabled"] = False
        gpus = [d for d in state["pci_devices"] if d.get("display")]
        gpus[0]["driver"] = "vfio-pci"  # left there by a passthrough phase, no saved override
        state["kubelet"]["healthy"] = True

    host.update(before)
    generation = host.read()["units"]["kubelet"]["generation"]
    assert host.read()["cuda_jobs"]

    done = run(host, "_reboot.py", "boot")

    assert done.returncode == 0, done.stderr
    state = host.read()
    assert state["swap"]["active"] == ["/swapfile"]  # fstab's entry is back on, the by-hand one stays off
    assert Path(host.proc_swaps_path).read_text().splitlines()[1].startswith("/swapfile ")
    assert (state["units"]["kubelet"]["active"], state["units"]["kubelet"]["generation"]) == ("active",
                                                                                              generation + 1)
    assert (state["units"]["containerd"]["active"], state["units"]["containerd"]["desired"]) == ("inactive",
                                                                                                 "stopped")
    assert [d["driver"] for d in state["pci_devices"] if d.get("display")] == ["nvidia"]
    assert state["cuda_jobs"] == []
    boot_id = (host.folder / "boot_id").read_text().strip()
    assert boot_id != "11111111-2222-3333-4444-555555555555" and state["boot"]["id"] == boot_id
    assert state["boot"]["count"] == 1
    messages = [e["msg"] for e in host.journal("systemd")]
    assert f"-- Boot {boot_id.replace('-', '')} --" in messages and "Activated swap /swapfile." in messages
    # the swap fstab brought back is what kubelet finds: it exits, as on a real node
    entries: list[dict] = []
    host.update(lambda s: entries.extend(sim_kubelet.step(s, NOW + 10**9, 0.0, 2.0)))
    assert any("running with swap on is not supported" in e["msg"] for e in entries)


def test_the_boot_keeps_a_saved_driverctl_override_and_turns_on_nothing_fstab_no_longer_lists(
        host: HostState) -> None:
    (host.folder.parent / "fstab").write_text("UUID=5b1f / ext4 errors=remount-ro 0 1\n# /swapfile none swap sw 0 0\n")

    def before(state: dict) -> None:
        gpu = next(d for d in state["pci_devices"] if d.get("display"))
        gpu["driver"] = gpu["driver_override"] = "vfio-pci"

    host.update(before)
    assert run(host, "_reboot.py", "boot").returncode == 0
    state = host.read()
    assert state["swap"]["active"] == []
    assert [d["driver"] for d in state["pci_devices"] if d.get("display")] == ["vfio-pci"]
