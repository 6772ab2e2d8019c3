"""Node hosts are real SSH machines for Ansible, and nothing done to them reaches this machine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ansible_runner
import pytest
import yaml

from engine.lab.nodehosts import NodeHostSet, NodeHostSpec, _shim_targets
from engine.lab.ports import free_loopback_block, require_loopback
from engine.lab.procs import ProcessRef

COMMENT_OUT_SWAP = [{
    "hosts": "all", "become": True, "gather_facts": False,
    "tasks": [{"name": "comment out swap in fstab",
               "ansible.builtin.replace": {"path": "/etc/fstab", "regexp": r"^([^#].*\sswap\s.*)$",
                                           "replace": r"# \1", "backup": True}}],
}]


def this_machine() -> dict[str, str]:
    """What must never change while the test bed runs playbooks."""
    return {"fstab": Path("/etc/fstab").read_text(), "swaps": Path("/proc/swaps").read_text(),
            "hostname": socket.gethostname(), "sudoers.d": " ".join(sorted(os.listdir("/etc/sudoers.d")))}


def run_playbook(hosts: NodeHostSet, workdir: Path, play: list[dict[str, Any]], **kwargs: Any) -> Any:
    """ansible-runner, isolated as the connector will run it: its own ANSIBLE_HOME, temp and control paths."""
    private = workdir / f"runner-{time.monotonic_ns()}"
    private.mkdir()
    with tempfile.TemporaryDirectory(prefix="rb-cp-") as control_paths:  # a socket path has <= 107 bytes
        envvars = {"ANSIBLE_HOME": str(private / "home"), "ANSIBLE_LOCAL_TEMP": str(private / "tmp"),
                   "ANSIBLE_SSH_CONTROL_PATH_DIR": control_paths}
        return ansible_runner.run(private_data_dir=str(private), playbook=play,
                                  inventory=str(hosts.inventory_path), envvars=envvars, quiet=True,
                                  timeout=120, **kwargs)


def ansible_cli(hosts: NodeHostSet, pattern: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The plain ``ansible`` command with nothing but the generated inventory."""
    return subprocess.run(["ansible", "-i", str(hosts.inventory_path), pattern, *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_ansible_runner_edits_a_node_hosts_fstab_over_ssh_with_become_and_this_machine_is_untouched(
        node_hosts: Any, tmp_path: Path) -> None:
    before = this_machine()
    hosts = node_hosts([NodeHostSpec("omen2")])

    result = run_playbook(hosts, tmp_path, COMMENT_OUT_SWAP)

    assert (result.status, result.rc) == ("successful", 0)
    assert result.stats["changed"] == {"omen2": 1}
    assert hosts["omen2"].read_file("/etc/fstab") == (
        "UUID=1111-2222 / ext4 errors=remount-ro 0 1\n# /swapfile none swap sw 0 0\n")
    seen_over_ssh = ansible_cli(hosts, "omen2", "-b", "-m", "command", "-a", "cat /etc/fstab")
    assert "# /swapfile none swap sw 0 0" in seen_over_ssh.stdout, seen_over_ssh.stdout + seen_over_ssh.stderr
    assert this_machine() == before


def test_an_unreachable_host_is_reported_unreachable(node_hosts: Any, tmp_path: Path) -> None:
    hosts = node_hosts(["omen1", "omen2"])
    hosts["omen1"].stop()

    result = run_playbook(hosts, tmp_path, [{"hosts": "all", "gather_facts": False,
                                             "tasks": [{"ansible.builtin.ping": {}}]}])

    assert result.rc == 4
    assert set(result.stats["dark"]) == {"omen1"}
    assert set(result.stats["ok"]) == {"omen2"}
    assert any(e["event"] == "runner_on_unreachable" and e["event_data"]["host"] == "omen1" for e in result.events)


def test_the_inventory_alone_lets_ansible_become_root_with_password_and_with_nopasswd_sudo(node_hosts: Any) -> None:
    hosts = node_hosts([NodeHostSpec("withpass", sudo="password", become_password="s3cret-Pass"),
                        NodeHostSpec("nopass", sudo="nopasswd")])
    inventory = yaml.safe_load(hosts.inventory_path.read_text())["all"]["hosts"]
    assert inventory["withpass"]["ansible_become_password"] == "s3cret-Pass"
    assert "ansible_become_password" not in inventory["nopass"]
    assert hosts.inventory_path.stat().st_mode & 0o077 == 0

    login = ansible_cli(hosts, "all", "-m", "command", "-a", "id -un")
    become = ansible_cli(hosts, "all", "-b", "-m", "command", "-a", "id -un")

    assert login.returncode == 0, login.stdout + login.stderr
    assert login.stdout.count("CHANGED | rc=0 >>\nops") == 2
    assert become.returncode == 0, become.stdout + become.stderr
    assert become.stdout.count("CHANGED | rc=0 >>\nroot") == 2


def test_password_sudo_really_checks_the_password(node_hosts: Any) -> None:
    hosts = node_hosts([NodeHostSpec("withpass", sudo="password")])

    wrong = ansible_cli(hosts, "withpass", "-b", "-e", "ansible_become_password=wrong", "-m", "command", "-a", "id")
    no_password = ansible_cli(hosts, "withpass", "-b", "-e", "ansible_become_password=", "-m", "command", "-a", "id")

    assert wrong.returncode != 0 and "Incorrect sudo password" in wrong.stdout + wrong.stderr
    assert no_password.returncode != 0


def test_host_keys_are_pinned_in_the_generated_known_hosts(node_hosts: Any, tmp_path: Path) -> None:
    hosts = node_hosts(["omen2"])
    ok = subprocess.run(hosts.ssh_argv("omen2", "hostname"), capture_output=True, text=True, timeout=30)
    assert (ok.returncode, ok.stdout) == (0, "omen2\n")

    hosts.known_hosts_path.write_text(hosts.known_hosts_path.read_text().replace("AAAA", "AAAB", 1))
    forged = subprocess.run(hosts.ssh_argv("omen2", "hostname"), capture_output=True, text=True, timeout=30)

    assert forged.returncode == 255  # strict checking refuses a key that does not match


def test_each_host_has_its_own_hostname_fstab_and_resolvable_name(node_hosts: Any) -> None:
    hosts = node_hosts([NodeHostSpec("omen1", fstab="LABEL=root / ext4 defaults 0 1\n"), NodeHostSpec("omen2")],
                       fstab="/dev/sda1 / ext4 defaults 0 1\n/dev/sda2 none swap sw 0 0\n")

    assert hosts["omen1"].run("hostname").stdout == "omen1\n"
    assert hosts["omen2"].run("hostname").stdout == "omen2\n"
    assert hosts["omen1"].read_file("/etc/fstab") == "LABEL=root / ext4 defaults 0 1\n"
    assert hosts["omen2"].read_file("/etc/fstab") == "/dev/sda1 / ext4 defaults 0 1\n/dev/sda2 none swap sw 0 0\n"
    assert hosts["omen2"].run("getent", "hosts", "omen2").returncode == 0
    assert socket.gethostname() not in {"omen1", "omen2"}


def test_shims_replace_commands_at_their_real_paths_and_write_the_shared_state_folder(
        node_hosts: Any, tmp_path: Path) -> None:
    shims = tmp_path / "shims"
    (shims / "usr/local/bin").mkdir(parents=True)
    (shims / "swapoff").write_text('#!/bin/sh\necho "swapoff $*" >> /run/runbook-lab/calls.log\n')
    (shims / "usr__bin__nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI 570.00'\n")
    (shims / "usr/local/bin/hello").write_text("#!/bin/sh\necho hello from $(hostname)\n")
    before = this_machine()
    hosts = node_hosts(["omen2"], shims_dir=shims)

    by_path = ansible_cli(hosts, "omen2", "-b", "-m", "command", "-a", "/usr/sbin/swapoff -a")
    by_name = ansible_cli(hosts, "omen2", "-b", "-m", "shell", "-a", "swapoff -v /swapfile; nvidia-smi; hello")

    assert by_path.returncode == 0, by_path.stdout + by_path.stderr
    assert "NVIDIA-SMI 570.00\nhello from omen2" in by_name.stdout
    assert (hosts["omen2"].state_dir / "calls.log").read_text() == "swapoff -a\nswapoff -v /swapfile\n"
    assert this_machine() == before


def test_plain_shim_names_go_where_this_machine_has_the_command() -> None:
    assert _shim_targets(Path("usr__sbin__swapoff")) == ["usr/sbin/swapoff"]
    assert _shim_targets(Path("usr/sbin/swapon")) == ["usr/sbin/swapon"]
    assert _shim_targets(Path("_common.py")) == ["usr/local/lib/runbook-lab/_common.py"]
    assert _shim_targets(Path("no-such-command-here")) == ["usr/bin/no-such-command-here"]
    if Path("/usr/sbin/swapoff").exists():
        assert "usr/sbin/swapoff" in _shim_targets(Path("swapoff"))


def test_a_proc_file_shows_the_lab_controlled_file_and_follows_in_place_rewrites(node_hosts: Any) -> None:
    real_swaps = Path("/proc/swaps").read_text()
    hosts = node_hosts(["omen2"], proc_files={"/proc/swaps": "proc_swaps"})
    state_file = hosts["omen2"].state_dir / "proc_swaps"
    header = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
    with state_file.open("w") as f:  # in place: the bind mount follows the inode
        f.write(header + "/swapfile                               file\t\t33554428\t0\t\t-2\n")

    seen = ansible_cli(hosts, "omen2", "-m", "command", "-a", "cat /proc/swaps")

    assert "/swapfile" in seen.stdout
    assert Path("/proc/swaps").read_text() == real_swaps


def test_a_restarted_host_keeps_its_etc_like_a_rebooted_machine(node_hosts: Any, tmp_path: Path) -> None:
    hosts = node_hosts(["omen2"])
    run_playbook(hosts, tmp_path, COMMENT_OUT_SWAP)
    old_pid = hosts["omen2"].pid

    hosts["omen2"].stop()
    hosts["omen2"].start()

    assert hosts["omen2"].pid != old_pid
    assert "# /swapfile" in hosts["omen2"].read_file("/etc/fstab")
    assert ansible_cli(hosts, "omen2", "-b", "-m", "command", "-a", "true").returncode == 0


def test_stopping_hosts_ends_every_process_of_theirs_by_pid(node_hosts: Any, tmp_path: Path) -> None:
    hosts = node_hosts(["omen1", "omen2"])
    run_playbook(hosts, tmp_path, COMMENT_OUT_SWAP)  # leaves ControlPersist sessions open on the hosts
    refs = [ProcessRef.of(pid) for h in hosts for pid in h.namespace_pids()]
    assert len(refs) >= 2

    hosts.stop()

    assert hosts.pids() == {}
    assert not any(ref.alive() for ref in refs)
    assert all(h.namespace_pids() == [] for h in hosts)
    assert all(not _listens(h.address) for h in hosts)


def test_another_process_can_stop_the_hosts_through_the_state_file(node_hosts: Any) -> None:
    hosts = node_hosts(["omen1", "omen2"])
    refs = [ProcessRef.of(pid) for pid in hosts.pids().values()]

    stopper = subprocess.run(  # what `runbook lab down` does
        [sys.executable, "-c", "import sys; from engine.lab.nodehosts import NodeHostSet; "
         "NodeHostSet.from_state(sys.argv[1]).stop()", str(hosts.workdir)],
        capture_output=True, text=True, timeout=60)

    assert stopper.returncode == 0, stopper.stderr
    deadline = time.monotonic() + 10
    while any(r.alive() for r in refs) and time.monotonic() < deadline:
        hosts.pids()
        for host in hosts:
            if host._popen is not None:
                host._popen.poll()
        time.sleep(0.05)
    assert not any(r.alive() for r in refs)
    assert all(h.namespace_pids() == [] for h in hosts)


def test_a_hundred_hosts_start_in_seconds_on_their_own_loopback_addresses(node_hosts: Any) -> None:
    started = time.monotonic()
    hosts = node_hosts(100)
    elapsed = time.monotonic() - started

    addresses = [h.address for h in hosts]
    assert len(set(addresses)) == 100
    assert all(require_loopback(a) and not a.startswith("127.0.") for a in addresses)
    assert all(_listens(a) for a in addresses)
    assert elapsed < 60
    hosts.stop()
    assert hosts.pids() == {}


def test_two_host_sets_never_share_addresses(node_hosts: Any) -> None:
    first = node_hosts(["a", "b"])
    second = node_hosts(["a", "b"])

    assert {h.address for h in first}.isdisjoint({h.address for h in second})
    assert free_loopback_block(2)[0] not in {h.address for h in first}


def _listens(address: str) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((address, 22)) == 0


pytestmark = pytest.mark.integration
