"""The flagship on every way a systemd host can have swap on (issue 19), on the lab's real SSH hosts.

Each case gives a node host another swap setup - written in the scenario format (``SWAP_SOURCES``
below, validated and seeded by the lab's own code: the host state the shims read and the generated
/etc/fstab) - then runs ``runbook run gpu-node-recovery`` on it, as an operator would:

* swap the flagship can keep off - fstab entries by path, ``UUID=``, ``LABEL=``, ``PARTUUID=`` and
  an LVM ``/dev/mapper`` path, with ``pri=`` / ``nofail``, a ``noauto`` entry, and a device turned on
  by hand, all at once: every active device turned off, only the active fstab swap lines commented
  out (the ``noauto`` one too is left as it is), every other line byte for byte; the node Ready;
* swap turned on by hand only (a transient unit): turned off, /etc/fstab untouched (no backup);
* swap it cannot keep off by editing fstab (zram-generator's zram, a ``.swap`` unit file): refused
  at plan time (exit 3), the source and the manual fix named, before the relabel - omen2 keeps its
  ``vm-passthrough`` label, no command runs on its host.

The refusals run on omen2 and put its swap back afterwards; the recoveries run on gpu-3090-1 (a
``container`` node: no label to change) and leave the lab to be reset.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.lab.hoststate import HostState
from engine.lab.scenario import Node, Scenario, parse_scenario
from engine.lab.sim_seed import fstab_text, host_state
from tests.integration.lab.flagship_cli import LABEL, fstab, host_lines, kube_node, node_status, ready, runbook
from tests.integration.lab.lab_helpers import ansible, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.lab]

SWAP_SOURCES = """\
apiVersion: runbook.lab/v1
name: swap-sources
nodes:
  - name: healthy
  - name: fstab-every-way                 # several devices at once, every way fstab names one
    host:
      swap:
        devices:
          /swap.img: {size: 8Gi}
          /dev/sdb2: {size: 2Gi, type: partition, uuid: 5d2e6b1a-9f0e-4b5c-8c11-7a7c1b0d2e3f,
                      fstab_options: "sw,pri=5"}
          /dev/sdc1: {size: 2Gi, type: partition, label: fastswap, fstab_spec: LABEL=fastswap,
                      fstab_options: nofail}
          /dev/nvme0n1p3: {size: 2Gi, type: partition, partuuid: 0a1b2c3d-02, fstab_spec: PARTUUID=0a1b2c3d-02,
                           fstab_options: "sw,pri=10,nofail"}
          /dev/dm-1: {size: 4Gi, type: partition, aliases: [/dev/mapper/vg0-swap, /dev/vg0/swap],
                      fstab_spec: /dev/mapper/vg0-swap}
          /dev/sdd1: {size: 1Gi, type: partition, label: spare, fstab_spec: LABEL=spare, fstab_options: noauto}
          /swapfile2: {size: 1Gi, in_fstab: false, unit_file: false}
        active: [/swap.img, /dev/sdb2, /dev/sdc1, /dev/nvme0n1p3, /dev/dm-1, /swapfile2]
  - name: by-hand                         # `swapon /swapfile2`: a transient unit, nothing in fstab
    host:
      swap:
        devices: {/swapfile2: {size: 1Gi, in_fstab: false, unit_file: false}}
        active: [/swapfile2]
  - name: zram-generator                  # omen2's swapfile, and zram-generator's /dev/zram0
    host:
      fstab: "/swapfile none swap sw 0 0\\n"
      swap:
        devices:
          /swapfile: {size: 32Gi}
          /dev/zram0: {size: 4Gi, type: partition, in_fstab: false, generator: /etc/systemd/zram-generator.conf,
                       description: Compressed Swap on /dev/zram0}
        active: [/swapfile, /dev/zram0]
  - name: unit-file                       # omen2's swapfile, and a .swap unit file of its own
    host:
      fstab: "/swapfile none swap sw 0 0\\n"
      swap:
        devices: {/swapfile: {size: 32Gi}, /swap2.img: {size: 1Gi, in_fstab: false}}
        active: [/swapfile, /swap2.img]
"""
VARIANTS: Scenario = parse_scenario(SWAP_SOURCES.encode(), "test_flagship_swap_sources.py:SWAP_SOURCES")


def _state(lab: Any, node: str) -> HostState:
    return HostState(lab.lab.record()["nodes"][node]["state_dir"])


def give(lab: Any, target: str, variant: Node, scenario: Scenario = VARIANTS) -> str:
    """Reset ``target``'s host to ``variant``'s swap: the state the shims read, and its /etc/fstab."""
    state, _ = host_state(variant, scenario, time.time())
    _state(lab, target).update(lambda s: s.update(swap=state["swap"]))
    text = fstab_text(variant)
    lab.lab.write_host_file(target, "/etc/fstab", text)
    return text


def backups(sh: Any, node: str) -> list[str]:
    return [name for name in host_lines(sh, node, "ls /etc") if name.startswith("fstab.") and name.endswith("~")]


@pytest.fixture
def omen2_swap(incident: Any) -> Iterator[Any]:
    """omen2 as the incident has it afterwards (its swapfile, its fstab), whatever the test gave it."""
    try:
        yield incident
    finally:
        original = incident.lab.scenario()
        give(incident, "omen2", original.node("omen2"), original)


@pytest.mark.parametrize(("variant", "sources", "fix"), [
    ("zram-generator", ["zram device /dev/zram0",
                        "systemd unit dev-zram0.swap (/run/systemd/generator/dev-zram0.swap)"],
     "remove /etc/systemd/zram-generator.conf"),
    ("unit-file", ["systemd unit swap2.img.swap (/etc/systemd/system/swap2.img.swap)"],
     "`systemctl disable --now UNIT` and remove or `systemctl mask` it"),
])
def test_swap_that_editing_fstab_cannot_keep_off_is_refused_at_plan_time_before_the_relabel(
        omen2_swap: Any, sh: Any, tmp_path: Path, variant: str, sources: list[str], fix: str) -> None:
    fstab_before = give(omen2_swap, "omen2", VARIANTS.node(variant))
    calls_before = _state(omen2_swap, "omen2").calls()
    r = runbook(sh, "run gpu-node-recovery --node omen2 --yes", journal=tmp_path / "j.sqlite")
    assert r.returncode == 3, r.stdout + r.stderr
    out = " ".join(r.stdout.split())
    assert "precondition swap-can-be-kept-off" in out
    assert f"comes from sources this runbook cannot keep off by editing /etc/fstab: {', '.join(sources)}." in out
    assert "Nothing was changed" in out and fix in out
    # before any change: the label the relabel step would have changed, the host, its swap and fstab
    assert kube_node(sh, "omen2")["metadata"]["labels"][LABEL] == "vm-passthrough"
    assert _state(omen2_swap, "omen2").calls() == calls_before
    assert node_status(sh, "omen2")["swap_active"] is True
    assert "\n".join(fstab(sh, "omen2")) + "\n" == fstab_before


@pytest.mark.timeout(900)
def test_several_swap_devices_named_every_way_in_fstab_and_by_hand_are_all_turned_off_and_only_active_lines_commented(
        incident: Any, sh: Any, tmp_path: Path) -> None:
    incident.dirty = True
    variant = VARIANTS.node("fstab-every-way")
    before = give(incident, "gpu-3090-1", variant).splitlines()
    active_lines = [ln for ln in before if " swap " in ln and "noauto" not in ln]
    assert [ln.split()[0] for ln in active_lines] == [
        "/swap.img", "UUID=5d2e6b1a-9f0e-4b5c-8c11-7a7c1b0d2e3f", "LABEL=fastswap", "PARTUUID=0a1b2c3d-02",
        "/dev/mapper/vg0-swap"]
    state = _state(incident, "gpu-3090-1")
    earlier = len(state.calls("swapoff"))
    r = runbook(sh, "run gpu-node-recovery --node gpu-3090-1 --yes", journal=tmp_path / "j.sqlite")
    assert r.returncode == 0, r.stdout + r.stderr

    after = fstab(sh, "gpu-3090-1")
    assert len(after) == len(before)
    changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert changed == [(line, f"# {line}") for line in active_lines]  # every other line byte for byte
    assert "LABEL=spare none swap noauto 0 0" in after  # never turns swap on at boot: left as it is
    swapoffs = sorted(c["argv"][0] for c in state.calls("swapoff")[earlier:])
    assert swapoffs == sorted(variant.host.swap.active)  # all of them, by their /proc/swaps names
    assert [ln for ln in host_lines(sh, "gpu-3090-1", "swapon --show --noheadings") if ln.strip()] == []
    node = kube_node(sh, "gpu-3090-1")
    assert ready(node) and node["status"]["allocatable"]["nvidia.com/gpu"] == "1"
    assert node_status(sh, "gpu-3090-1")["kubelet"] == "active"


@pytest.mark.timeout(900)
def test_swap_turned_on_by_hand_is_turned_off_and_fstab_is_left_untouched(
        incident: Any, sh: Any, tmp_path: Path) -> None:
    incident.dirty = True
    before = give(incident, "gpu-3090-1", VARIANTS.node("by-hand"))
    # kubelet restarted with swap on: it refuses and crash-loops, as in the incident
    assert ansible(sh, "gpu-3090-1", "systemctl restart kubelet").returncode == 0
    wait_for(lambda: node_status(sh, "gpu-3090-1")["kubelet"] != "active", 60, "kubelet to refuse swap")
    # ... and the node goes NotReady, as in the incident. Planned while its Node still read Ready, the
    # run would count its GPU as newly taken out of service: with the incident's other GPU nodes down
    # in this shared lab, the GPU budget guard (rightly) blocks it.
    wait_for(lambda: not ready(kube_node(sh, "gpu-3090-1")), 120, "gpu-3090-1 to turn NotReady")
    state = _state(incident, "gpu-3090-1")
    earlier = len(state.calls("swapoff"))
    backups_before = backups(sh, "gpu-3090-1")
    r = runbook(sh, "run gpu-node-recovery --node gpu-3090-1 --yes", journal=tmp_path / "j.sqlite")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [c["argv"] for c in state.calls("swapoff")[earlier:]] == [["/swapfile2"]]
    assert "\n".join(fstab(sh, "gpu-3090-1")) + "\n" == before  # untouched
    assert backups(sh, "gpu-3090-1") == backups_before  # not even rewritten
    status = node_status(sh, "gpu-3090-1")
    assert (status["swap_active"], status["kubelet"]) == (False, "active")
    assert ready(kube_node(sh, "gpu-3090-1"))
