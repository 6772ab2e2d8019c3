"""`preview: facts` says what the playbook's own check mode says: the engine's models of swap-off.yml
and gpu-bind-driver.yml (engine/playbook_previews.py) against ``ansible-playbook --check --diff`` on
real SSH node hosts with the lab's command shims, case by case (every case a model distinguishes).

A model that drifted from its playbook (the fstab rule, a message, a GPU it would not bind) fails
here: the plan would show a change the run does not make, or miss one it does."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import playbook_previews
from engine.connectors.ansible import AnsibleConnector
from engine.lab.hoststate import HostState
from engine.lab.nodehosts import NodeHostSet, NodeHostSpec
from engine.previews import check_mode_text
from tests.integration.test_playbooks import PLAYBOOKS, SHIMS, TRICKY_FSTAB

pytestmark = pytest.mark.integration

# the tricky fstab of test_playbooks.py, plus a noauto entry and a tab-indented LVM one
FSTAB = TRICKY_FSTAB + "LABEL=spare none swap noauto 0 0\n\t/dev/mapper/vg-swap\tnone\tswap\tdefaults,nofail\t0\t0\n"
CLEAN_FSTAB = "UUID=1111-2222 / ext4 errors=remount-ro 0 1\n#/swapfile none swap sw 0 0\n"
GPU = {"slot": "01:00.0", "vendor_device": "10de:2204", "class": "VGA compatible controller [0300]",
       "name": "GA102 [GeForce RTX 3090]", "driver": "nvidia", "display": True,
       "modules": ["nvidiafb", "nouveau", "nvidia"]}
AUDIO = {"slot": "01:00.1", "vendor_device": "10de:1aef", "class": "Audio device [0403]",
         "name": "GA102 High Definition Audio Controller", "driver": "snd_hda_intel", "display": False}


def initial_state(host: str) -> dict[str, Any]:
    return {
        "host": host,
        "swap": {"devices": {"/swapfile": {"type": "file", "size": 34359738368},
                             "/dev/zram0": {"type": "partition", "size": 8589934592}},
                 "active": []},
        "units": {"kubelet": {"active": "activating", "sub": "auto-restart", "result": "exit-code",
                              "enabled": True, "desired": "running", "restarts": 3, "main_pid": 0,
                              "since": time.time(), "generation": 1}},
        "kubelet": {"fail_swap_on": True, "fault": None},
        "pci_devices": [], "cuda_jobs": [], "cuda_jobs_killed": 0,
    }


@pytest.fixture(scope="module")
def hosts(node_hosts_module: Callable[..., NodeHostSet],
          tmp_path_factory: pytest.TempPathFactory) -> dict[str, NodeHostSet]:
    """omen2 with every shim; bare without driverctl (as on a node where it is not installed)."""
    without = tmp_path_factory.mktemp("shims-without-driverctl") / "shims"
    shutil.copytree(SHIMS, without, ignore=shutil.ignore_patterns("driverctl", "__pycache__"))
    out = {"omen2": node_hosts_module([NodeHostSpec("omen2", sudo="nopasswd")], fstab=FSTAB, shims_dir=SHIMS),
           "bare": node_hosts_module([NodeHostSpec("bare", sudo="nopasswd")], fstab=FSTAB, shims_dir=without)}
    for name, hs in out.items():
        HostState(hs[name].state_dir).initialise(initial_state(name), journal=[])
    return out


@pytest.fixture(scope="module")
def automation(hosts: dict[str, NodeHostSet]) -> Iterator[dict[str, AnsibleConnector]]:
    with AnsibleConnector(hosts["omen2"].inventory_path, PLAYBOOKS) as one, \
            AnsibleConnector(hosts["bare"].inventory_path, PLAYBOOKS) as other:
        yield {"omen2": one, "bare": other}


def arrange(hosts: dict[str, NodeHostSet], name: str, *, fstab: str = FSTAB, active: list[str] | None = None,
            gpus: list[dict[str, Any]] | None = None) -> None:
    hosts[name][name].run("tee", "/etc/fstab", input=fstab)

    def change(s: dict[str, Any]) -> None:
        s["swap"]["active"] = list(active or [])
        s["pci_devices"] = list(gpus or [])

    HostState(hosts[name][name].state_dir).update(change)


def both(automation: dict[str, AnsibleConnector], hosts: dict[str, NodeHostSet], name: str, playbook: str,
         variables: dict[str, Any]) -> tuple[str, str]:
    """(the model's preview from a facts run, the playbook's check-mode preview); nothing changed."""
    host = hosts[name][name]
    fstab = host.read_file("/etc/fstab")
    facts = automation[name].gather_facts([name])[name]
    assert not isinstance(facts, Exception), facts
    modelled = playbook_previews.preview(playbook, facts, variables)
    assert modelled is not None
    checked = check_mode_text(automation[name].run_playbook(Path(playbook), [name], extravars=dict(variables),
                                                            become=True, check=True))
    assert host.read_file("/etc/fstab") == fstab  # neither changed anything
    return modelled, checked


# -- swap-off.yml -------------------------------------------------------------------------------------
SLOW = pytest.mark.slow  # the CI time budget: the in-between cases, docs/reliability.md


@pytest.mark.parametrize(("case", "fstab", "active"), [
    ("a swapfile on, every kind of fstab entry", FSTAB, ["/swapfile"]),
    pytest.param("swap off, active entries left in fstab", FSTAB, [], marks=SLOW),
    pytest.param("swap on, fstab already clean", CLEAN_FSTAB, ["/swapfile"], marks=SLOW),
    ("nothing to do", CLEAN_FSTAB, []),
], ids=["swap-on", "entries-left", "fstab-clean", "nothing"])
def test_the_swap_off_model_says_what_check_mode_says(
        hosts: dict[str, NodeHostSet], automation: dict[str, AnsibleConnector], case: str, fstab: str,
        active: list[str]) -> None:
    arrange(hosts, "omen2", fstab=fstab, active=active)
    modelled, checked = both(automation, hosts, "omen2", "swap-off.yml", {})
    assert modelled == checked, case


def test_the_swap_off_model_refuses_swap_it_cannot_keep_off_as_the_playbook_does(
        hosts: dict[str, NodeHostSet], automation: dict[str, AnsibleConnector]) -> None:
    arrange(hosts, "omen2", active=["/dev/zram0", "/swapfile"])
    modelled, checked = both(automation, hosts, "omen2", "swap-off.yml", {})
    assert checked.startswith("check mode: failed")
    assert modelled.startswith("check mode: failed") and "zram device /dev/zram0" in modelled


# -- gpu-bind-driver.yml ------------------------------------------------------------------------------
@pytest.mark.parametrize(("case", "gpus"), [
    pytest.param("on nvidia already", [GPU, AUDIO], marks=SLOW),
    ("one of two on vfio-pci, one without a driver", [{**GPU, "driver": "vfio-pci"}, AUDIO,
                                                      {**GPU, "slot": "41:00.0", "driver": None}]),
], ids=["on-nvidia", "to-bind"])
def test_the_gpu_bind_model_says_what_check_mode_says(
        hosts: dict[str, NodeHostSet], automation: dict[str, AnsibleConnector], case: str,
        gpus: list[dict[str, Any]]) -> None:
    arrange(hosts, "omen2", gpus=gpus)
    modelled, checked = both(automation, hosts, "omen2", "gpu-bind-driver.yml", {"driver": "nvidia"})
    assert modelled == checked, case


@pytest.mark.parametrize(("case", "name", "gpus"), [
    ("no NVIDIA GPU", "omen2", [AUDIO]),
    ("driverctl not installed", "bare", [{**GPU, "driver": "vfio-pci"}]),
], ids=["no-gpu", "no-driverctl"])
def test_the_gpu_bind_model_refuses_as_the_playbook_does(
        hosts: dict[str, NodeHostSet], automation: dict[str, AnsibleConnector], case: str, name: str,
        gpus: list[dict[str, Any]]) -> None:
    arrange(hosts, name, gpus=gpus)
    modelled, checked = both(automation, hosts, name, "gpu-bind-driver.yml", {"driver": "nvidia"})
    assert checked.startswith("check mode: failed"), case
    assert modelled.startswith("check mode: failed"), case


@SLOW
def test_without_driverctl_on_nvidia_already_nothing_is_refused(
        hosts: dict[str, NodeHostSet], automation: dict[str, AnsibleConnector]) -> None:
    arrange(hosts, "bare", gpus=[GPU])
    modelled, checked = both(automation, hosts, "bare", "gpu-bind-driver.yml", {"driver": "nvidia"})
    assert modelled == checked == "check mode: no changes"
