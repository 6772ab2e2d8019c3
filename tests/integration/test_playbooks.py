"""The playbooks of playbooks/ on real SSH node hosts: what they change, what they leave alone."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.connectors.ansible import AnsibleConnector
from engine.lab.hoststate import HostState
from engine.lab.nodehosts import NodeHostSet, NodeHostSpec

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PLAYBOOKS = REPO / "playbooks"
SHIMS = REPO / "engine" / "lab" / "shims"

TRICKY_FSTAB = """\
# /etc/fstab: static file system information.
UUID=1111-2222 /               ext4    errors=remount-ro 0       1
# swap was on /dev/sda3 during installation; keep swap off for kubelet
#/dev/sda3 none swap sw 0 0
/dev/sdb1 /data/swapfiles-backup ext4 defaults 0 2
/swapfile                                 none            swap    sw              0       0
UUID=5d2e6b1a-9f0e-4b5c-8c11-7a7c1b0d2e3f none swap sw,pri=5 0 0
tmpfs /tmp tmpfs defaults 0 0
"""
EXPECTED_FSTAB = TRICKY_FSTAB.replace(
    "\n/swapfile ", "\n# /swapfile ").replace("\nUUID=5d2e6b1a", "\n# UUID=5d2e6b1a")


@pytest.fixture
def host(node_hosts: Callable[..., NodeHostSet]) -> NodeHostSet:
    return node_hosts([NodeHostSpec("omen2", sudo="nopasswd")], fstab=TRICKY_FSTAB)


@pytest.fixture
def automation(host: NodeHostSet) -> Iterator[AnsibleConnector]:
    with AnsibleConnector(host.inventory_path, PLAYBOOKS) as connector:
        yield connector


def backups(host: NodeHostSet) -> list[str]:
    listing = host["omen2"].run("ls", "/etc").stdout.split()
    return [name for name in listing if name.startswith("fstab.") and name.endswith("~")]


# -- swap-off.yml --------------------------------------------------------------------------------------
def test_swap_off_comments_out_only_the_active_swap_entries_and_keeps_a_backup(
        host: NodeHostSet, automation: AnsibleConnector) -> None:
    result = automation.run_playbook(Path("swap-off.yml"), ["omen2"])
    assert result.ok, result.failed_hosts
    assert result.changed == {"omen2": True}
    assert host["omen2"].read_file("/etc/fstab") == EXPECTED_FSTAB
    (backup,) = backups(host)
    assert host["omen2"].read_file(f"/etc/{backup}") == TRICKY_FSTAB
    facts = result.host_facts["omen2"]  # the facts the playbook returns after acting
    assert facts.fstab_active_swap == ()


def test_swap_off_a_second_time_changes_nothing(host: NodeHostSet, automation: AnsibleConnector) -> None:
    assert automation.run_playbook(Path("swap-off.yml"), ["omen2"]).changed == {"omen2": True}
    again = automation.run_playbook(Path("swap-off.yml"), ["omen2"])
    assert again.ok and again.changed == {"omen2": False}
    assert [e["status"] for e in again.tasks if e["status"] == "changed"] == []
    assert host["omen2"].read_file("/etc/fstab") == EXPECTED_FSTAB
    assert len(backups(host)) == 1


def test_swap_off_in_check_mode_shows_the_diff_and_changes_nothing(
        host: NodeHostSet, automation: AnsibleConnector) -> None:
    result = automation.run_playbook(Path("swap-off.yml"), ["omen2"], check=True)
    assert result.ok
    assert result.changed == {"omen2": True}  # would change
    (diff,) = result.diffs["omen2"]
    assert diff.startswith("--- /etc/fstab")
    removed = [line[1:] for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert removed == [line for line in TRICKY_FSTAB.splitlines() if line.startswith(("/swapfile", "UUID=5d"))]
    assert added == ["# " + line for line in removed]
    assert host["omen2"].read_file("/etc/fstab") == TRICKY_FSTAB
    assert backups(host) == []
    # the facts in check mode are read for real: the fstab still has its active entries
    assert len(result.host_facts["omen2"].fstab_active_swap) == 2


def test_node_facts_is_read_only_even_without_check_mode(host: NodeHostSet,
                                                         automation: AnsibleConnector) -> None:
    result = automation.run_playbook(Path("node-facts.yml"), ["omen2"], become=False)
    assert result.ok and result.changed == {"omen2": False}
    checked = automation.run_playbook(Path("node-facts.yml"), ["omen2"], become=False, check=True)
    assert checked.ok and checked.host_facts["omen2"] == result.host_facts["omen2"]


# -- with the lab's command shims: real swap state, systemctl, journal -----------------------------------
def lab_host(node_hosts: Callable[..., NodeHostSet], *, active: list[str]) -> NodeHostSet:
    """A node host whose swapon/swapoff/systemctl/journalctl act on a lab state folder."""
    hosts = node_hosts([NodeHostSpec("omen2", sudo="nopasswd")], fstab=TRICKY_FSTAB, shims_dir=SHIMS)
    HostState(hosts["omen2"].state_dir).initialise({
        "host": "omen2",
        "swap": {"devices": {"/swapfile": {"type": "file", "size": 34359738368},
                             "/dev/zram0": {"type": "partition", "size": 8589934592}},
                 "active": active},
        "units": {"kubelet": {"active": "activating", "sub": "auto-restart", "result": "exit-code",
                              "enabled": True, "desired": "running", "restarts": 9676, "main_pid": 0,
                              "since": time.time(), "generation": 1}},
        "kubelet": {"fail_swap_on": True, "fault": None},
        "pci_devices": [], "cuda_jobs": [], "cuda_jobs_killed": 0,
    }, journal=[{"ts": time.time(), "unit": "kubelet", "ident": "kubelet", "pid": 2345,
                 "msg": '"command failed" err="failed to run Kubelet: running with swap on is not supported"'}])
    return hosts


def test_swap_off_turns_the_active_swapfile_off_and_the_facts_show_it(
        node_hosts: Callable[..., NodeHostSet]) -> None:
    host = lab_host(node_hosts, active=["/swapfile"])
    with AnsibleConnector(host.inventory_path, PLAYBOOKS) as automation:
        before = automation.gather_facts(["omen2"])["omen2"]
        assert not isinstance(before, Exception)
        assert before.swap_active and before.service("kubelet").state == "activating"
        assert "swap on is not supported" in before.service("kubelet").journal_tail
        result = automation.run_playbook(Path("swap-off.yml"), ["omen2"])
    assert result.ok, result.failed_hosts
    after = result.host_facts["omen2"]
    assert not after.swap_active and after.fstab_active_swap == ()
    calls = HostState(host["omen2"].state_dir).calls("swapoff")
    assert [c["argv"] for c in calls] == [["/swapfile"]]


def test_swap_turned_on_by_hand_is_turned_off_with_the_fstab_entries_and_is_not_refused(
        node_hosts: Callable[..., NodeHostSet]) -> None:
    host = lab_host(node_hosts, active=["/swapfile"])
    state = HostState(host["omen2"].state_dir)

    def by_hand(s: dict[str, Any]) -> None:  # `swapon /swapfile2`: a transient unit, no unit file
        s["swap"]["devices"]["/swapfile2"] = {"type": "file", "size": 1 << 30, "in_fstab": False,
                                              "unit_file": False}
        s["swap"]["active"].append("/swapfile2")

    state.update(by_hand)
    with AnsibleConnector(host.inventory_path, PLAYBOOKS) as automation:
        before = automation.gather_facts(["omen2"])["omen2"]
        assert not isinstance(before, Exception)
        assert [d.name for d in before.swap_devices] == ["/swapfile", "/swapfile2"]
        assert before.unhandled_swap_sources == ()  # a transient unit is ours to turn off
        result = automation.run_playbook(Path("swap-off.yml"), ["omen2"])
    assert result.ok, result.failed_hosts
    after = result.host_facts["omen2"]
    assert not after.swap_active
    assert sorted(c["argv"][0] for c in state.calls("swapoff")) == ["/swapfile", "/swapfile2"]
    assert host["omen2"].read_file("/etc/fstab") == EXPECTED_FSTAB  # only the fstab entries, by path and UUID=


def test_a_swap_unit_file_is_an_unhandled_source(node_hosts: Callable[..., NodeHostSet]) -> None:
    host = lab_host(node_hosts, active=[])
    state = HostState(host["omen2"].state_dir)
    state.update(lambda s: (s["swap"]["devices"].update({"/swap2.img": {"type": "file", "size": 1 << 30,
                                                                       "in_fstab": False}}),
                            s["swap"]["active"].append("/swap2.img")))
    with AnsibleConnector(host.inventory_path, PLAYBOOKS) as automation:
        facts = automation.gather_facts(["omen2"])["omen2"]
    assert not isinstance(facts, Exception)
    assert facts.unhandled_swap_sources == ("systemd unit swap2.img.swap (/etc/systemd/system/swap2.img.swap)",)


def test_swap_off_refuses_a_zram_swap_it_cannot_keep_off_and_changes_nothing(
        node_hosts: Callable[..., NodeHostSet]) -> None:
    host = lab_host(node_hosts, active=["/dev/zram0", "/swapfile"])
    with AnsibleConnector(host.inventory_path, PLAYBOOKS) as automation:
        result = automation.run_playbook(Path("swap-off.yml"), ["omen2"])
    assert result.status == "failed"
    assert "zram device /dev/zram0" in result.failed_hosts["omen2"]
    assert "Nothing was changed" in result.failed_hosts["omen2"]
    assert HostState(host["omen2"].state_dir).calls("swapoff") == []
    assert host["omen2"].read_file("/etc/fstab") == TRICKY_FSTAB
    facts = result.host_facts["omen2"]  # published even though the play failed
    assert facts.unhandled_swap_sources == ("zram device /dev/zram0",)


def test_restart_kubelet_in_check_mode_only_says_it_would(node_hosts: Callable[..., NodeHostSet]) -> None:
    host = lab_host(node_hosts, active=[])
    with AnsibleConnector(host.inventory_path, PLAYBOOKS) as automation:
        result = automation.run_playbook(Path("restart-kubelet.yml"), ["omen2"], check=True)
    assert result.ok
    assert any(e["msg"] == "would restart kubelet on omen2" for e in result.tasks)
    assert HostState(host["omen2"].state_dir).calls("systemctl") == []


def test_restart_kubelet_restarts_it_and_returns_the_new_state(
        node_hosts: Callable[..., NodeHostSet]) -> None:
    host = lab_host(node_hosts, active=[])
    with AnsibleConnector(host.inventory_path, PLAYBOOKS) as automation:
        result = automation.run_playbook(Path("restart-kubelet.yml"), ["omen2"])
    assert result.ok, result.failed_hosts
    assert result.changed == {"omen2": True}
    calls = HostState(host["omen2"].state_dir).calls("systemctl")
    assert [c["argv"] for c in calls] == [["restart", "kubelet"]]
    assert calls[0]["uid"] == 0  # through sudo
    # whatever state kubelet is in now is reported, not assumed: the engine verifies it
    assert result.host_facts["omen2"].service("kubelet").state in ("active", "activating")


# -- lint ------------------------------------------------------------------------------------------------
def test_the_playbooks_pass_ansible_lint_with_the_production_profile(tmp_path: Path) -> None:
    lint = shutil.which("ansible-lint")
    if lint is None:
        pytest.skip("ansible-lint is not installed (pip install -e '.[dev]')")
    files = [str(PLAYBOOKS / name) for name in
             ("node-facts.yml", "swap-off.yml", "restart-kubelet.yml", "gpu-bind-driver.yml",
              "example-touch-file.yml", "kubelet-bootstrap.yml", "tasks/facts.yml", "gpu-reset.yml",
              "gpu-driver-reload.yml", "fabric-manager-restart.yml")]
    out = subprocess.run([lint, "--offline", "--nocolor", "--profile", "production", *files],
                         capture_output=True, text=True, cwd=tmp_path)  # its cache: not in the repo
    assert out.returncode == 0, out.stdout + out.stderr
