"""AnsibleConnector against real SSH node hosts: facts, errors, isolation, secrets, process trees."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.connectors.ansible import AnsibleConnector
from engine.connectors.base import TaskEvent
from engine.errors import HostError
from engine.facts import HostFacts
from engine.lab.nodehosts import NodeHostSet, NodeHostSpec
from engine.lab.ports import free_loopback_block

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PLAYBOOKS = REPO / "playbooks"
PASSWORD = "Become-7f3Kq-9zX"  # the ops user's sudo password on the test hosts (nowhere else)
FSTAB = ("UUID=1111-2222 / ext4 errors=remount-ro 0 1\n"
         "# swap was on /dev/sda3 during installation\n"
         "#/dev/sda3 none swap sw 0 0\n"
         "/dev/sdb1 /data/swapfiles-backup ext4 defaults 0 2\n"
         "/swapfile none swap sw 0 0\n")


def inventory_without_passwords(hosts: NodeHostSet, path: Path, **extra_hosts: dict[str, Any]) -> Path:
    """The test bed's inventory, minus the become passwords: the connector must supply them."""
    inventory = yaml.safe_load(hosts.inventory_path.read_text())
    for entry in inventory["all"]["hosts"].values():
        entry.pop("ansible_become_password", None)
    inventory["all"]["hosts"].update(extra_hosts)
    path.write_text(yaml.safe_dump(inventory))
    return path


def unused_loopback_address() -> str:
    """An address in a fresh 127.x.y.0/24 where nothing listens (connection refused at once)."""
    return free_loopback_block(1)[0]


def sleep_playbook(tmp_path: Path, seconds: int) -> Path:
    folder = tmp_path / "playbooks"
    folder.mkdir(exist_ok=True)
    (folder / "sleep.yml").write_text(f"""
- name: Sleep
  hosts: "{{{{ target | default('all') }}}}"
  gather_facts: false
  become: true
  tasks:
    - name: First task
      ansible.builtin.command: "true"
    - name: Sleep on the host
      ansible.builtin.command: "sleep {{{{ seconds | default({seconds}) }}}}"
""")
    return folder


def processes_of(connector: AnsibleConnector, *tokens: str) -> list[tuple[int, str]]:
    """Processes this connector started (its dir in their environment or command line: ansible-playbook,
    workers, ssh clients and control masters) plus any whose command line contains one of ``tokens``
    (e.g. the remote command, visible here since node hosts share this machine's PID namespace)."""
    mark = str(connector.private_data_dir).encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            environ = Path(f"/proc/{name}/environ").read_bytes()
        except OSError:
            continue
        text = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
        if not text:
            continue  # a zombie
        if mark in environ or mark in cmdline or any(t in text for t in tokens):
            found.append((int(name), text[:100]))
    return found


@pytest.fixture
def two_hosts(node_hosts: Callable[..., NodeHostSet]) -> NodeHostSet:
    return node_hosts([NodeHostSpec("omen2", sudo="password", become_password=PASSWORD),
                       NodeHostSpec("gpu-box-1", k8s_node_name="omen1", sudo="nopasswd")], fstab=FSTAB)


@pytest.fixture
def omen2(node_hosts: Callable[..., NodeHostSet]) -> NodeHostSet:
    return node_hosts([NodeHostSpec("omen2", sudo="password", become_password=PASSWORD)], fstab=FSTAB)


def this_machines_swap() -> tuple[str, ...]:
    lines = Path("/proc/swaps").read_text().splitlines()[1:]
    return tuple(line.split()[0] for line in lines if line.split())


# -- facts -------------------------------------------------------------------------------------------
def test_gather_facts_reads_every_node_in_one_run_keyed_by_node_name(two_hosts: NodeHostSet,
                                                                    tmp_path: Path) -> None:
    with AnsibleConnector(two_hosts.inventory_path, PLAYBOOKS) as automation:
        assert automation.inventory_host("omen1") == "gpu-box-1"
        start = time.monotonic()
        facts = automation.gather_facts(["omen2", "omen1"])
        elapsed = time.monotonic() - start
    assert set(facts) == {"omen2", "omen1"}
    for node in ("omen2", "omen1"):
        f = facts[node]
        assert isinstance(f, HostFacts), f
        assert f.fstab_active_swap == ("/swapfile none swap sw 0 0",)  # not the comments, not /data/swap...
        # without the lab's shims swapon shows this machine's (unchanged) swap state
        assert tuple(d.name for d in f.swap_devices) == this_machines_swap()
        assert f.unhandled_swap_sources == ()
        assert f.service("kubelet").state in ("unknown", "inactive")  # no kubelet on a test host
        assert f.gpus == () and f.gpu_driver == "none"  # no lspci/NVIDIA device here
        assert f.cuda_processes == ()
    omen1 = facts["omen1"]
    assert isinstance(omen1, HostFacts) and omen1.host == "gpu-box-1"
    assert elapsed < 15  # one run for both hosts, not one per host


def test_gather_facts_reports_the_files_a_runbook_asks_about(omen2: NodeHostSet) -> None:
    with AnsibleConnector(omen2.inventory_path, PLAYBOOKS) as automation:
        facts = automation.gather_facts(["omen2"], files=["/etc/hostname", "/etc/no such file"])["omen2"]
    assert isinstance(facts, HostFacts)
    assert facts.files["/etc/hostname"].exists and facts.files["/etc/hostname"].content == "omen2\n"
    assert len(facts.files["/etc/hostname"].sha256) == 64
    assert not facts.files["/etc/no such file"].exists


def test_an_unreachable_host_and_an_unknown_node_are_host_errors_per_node(omen2: NodeHostSet,
                                                                          tmp_path: Path) -> None:
    dead = unused_loopback_address()
    inventory = inventory_without_passwords(omen2, tmp_path / "inv.yml", ghost={"ansible_host": dead})
    with AnsibleConnector(inventory, PLAYBOOKS) as automation:
        start = time.monotonic()
        facts = automation.gather_facts(["omen2", "ghost", "no-such-node"])
        assert time.monotonic() - start < 15
    assert isinstance(facts["omen2"], HostFacts)
    ghost = facts["ghost"]
    assert isinstance(ghost, HostError) and ghost.unreachable and ghost.retryable
    assert "ghost unreachable" in str(ghost)
    unknown = facts["no-such-node"]
    assert isinstance(unknown, HostError) and not unknown.unreachable
    assert "not in the inventory" in str(unknown)
    with pytest.raises(HostError, match="not in the inventory"):
        AnsibleConnector(inventory, PLAYBOOKS).run_playbook(Path("node-facts.yml"), ["no-such-node"])


def test_host_keys_are_checked_an_unknown_key_makes_the_host_unreachable(omen2: NodeHostSet,
                                                                         tmp_path: Path) -> None:
    (tmp_path / "empty_known_hosts").write_text("")
    inventory = yaml.safe_load(omen2.inventory_path.read_text())
    inventory["all"]["vars"]["ansible_ssh_common_args"] = omen2.ssh_common_args.replace(
        str(omen2.known_hosts_path), str(tmp_path / "empty_known_hosts"))
    (tmp_path / "inv.yml").write_text(yaml.safe_dump(inventory))
    with AnsibleConnector(tmp_path / "inv.yml", PLAYBOOKS) as automation:
        result = automation.gather_facts(["omen2"])["omen2"]
    assert isinstance(result, HostError) and result.unreachable
    assert "Host key verification failed" in str(result)
    assert (tmp_path / "empty_known_hosts").read_text() == ""  # nothing was learnt silently


# -- events, become ----------------------------------------------------------------------------------
def test_task_events_stream_live_while_the_playbook_runs(omen2: NodeHostSet, tmp_path: Path) -> None:
    seen: list[tuple[float, TaskEvent]] = []
    with AnsibleConnector(omen2.inventory_path, sleep_playbook(tmp_path, 2)) as automation:
        result = automation.run_playbook(Path("sleep.yml"), ["omen2"],
                                         on_event=lambda e: seen.append((time.monotonic(), e)))
        finished = time.monotonic()
    assert result.ok
    first = next(t for t, e in seen if e["task"] == "First task")
    assert finished - first > 1.5  # delivered while the sleep was still running
    assert [(e["host"], e["task"], e["status"]) for _, e in seen] == [
        ("omen2", "First task", "changed"), ("omen2", "Sleep on the host", "changed")]
    assert result.tasks == tuple(e for _, e in seen)


@pytest.mark.parametrize(("password", "expected"), [
    ("not-the-password", "become password rejected on omen2"),
    (None, "become password needed on omen2"),
])
def test_a_wrong_or_missing_become_password_is_a_clear_error_and_changes_nothing(
        omen2: NodeHostSet, tmp_path: Path, password: str | None, expected: str) -> None:
    inventory = inventory_without_passwords(omen2, tmp_path / "inv.yml")
    with AnsibleConnector(inventory, PLAYBOOKS, become_password=password) as automation:
        result = automation.run_playbook(Path("swap-off.yml"), ["omen2"])
    assert result.status == "failed" and result.rc == 2
    assert result.failed_hosts["omen2"].startswith(expected), result.failed_hosts
    assert omen2["omen2"].read_file("/etc/fstab") == FSTAB


def test_the_become_password_given_to_the_connector_reaches_sudo(omen2: NodeHostSet, tmp_path: Path) -> None:
    inventory = inventory_without_passwords(omen2, tmp_path / "inv.yml")
    with AnsibleConnector(inventory, PLAYBOOKS, become_password=PASSWORD) as automation:
        result = automation.run_playbook(Path("swap-off.yml"), ["omen2"])
    assert result.ok, result.failed_hosts
    assert result.changed == {"omen2": True}
    assert result.host_facts["omen2"].fstab_active_swap == ()


# -- process trees -----------------------------------------------------------------------------------
def test_a_timeout_kills_the_whole_process_tree_here_and_on_the_host(omen2: NodeHostSet,
                                                                     tmp_path: Path) -> None:
    inventory = inventory_without_passwords(omen2, tmp_path / "inv.yml")
    automation = AnsibleConnector(inventory, sleep_playbook(tmp_path, 3131), become_password=PASSWORD)
    during: list[tuple[int, str]] = []
    stop = threading.Event()

    def watch() -> None:  # the tree while it runs: up to the moment the remote sleep has started
        while not stop.is_set():
            snapshot = processes_of(automation, "sleep 3131")
            if any("sleep 3131" in cmd and "ansible" not in cmd for _, cmd in snapshot):
                during.extend(snapshot)
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    try:
        assert processes_of(automation, "sleep 3131") == []
        watcher.start()
        start = time.monotonic()
        result = automation.run_playbook(Path("sleep.yml"), ["omen2"], timeout=8)
        elapsed = time.monotonic() - start
        stop.set()
        watcher.join()
        assert result.status == "timeout" and not result.ok
        assert 8 <= elapsed < 10, elapsed
        assert any("ansible-playbook" in cmd for _, cmd in during), during
        assert any(cmd.startswith("ssh") for _, cmd in during), during
        assert any(cmd.startswith("sleep 3131") for _, cmd in during), during  # the remote command
        deadline = time.monotonic() + 5  # the host's sshd notices the closed session
        while processes_of(automation, "sleep 3131") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes_of(automation, "sleep 3131") == []
        # the connector still works afterwards (stale control sockets were removed)
        assert automation.run_playbook(Path("sleep.yml"), ["omen2"], extravars={"seconds": 0}).ok
    finally:
        stop.set()
        automation.close()
    assert processes_of(automation, "sleep 3131") == []


def test_cancel_from_another_thread_ends_a_running_playbook_and_its_processes(omen2: NodeHostSet,
                                                                              tmp_path: Path) -> None:
    automation = AnsibleConnector(omen2.inventory_path, sleep_playbook(tmp_path, 3132))
    try:
        threading.Timer(2.0, automation.cancel).start()
        start = time.monotonic()
        result = automation.run_playbook(Path("sleep.yml"), ["omen2"], timeout=60)
        assert result.status == "canceled"
        assert time.monotonic() - start < 4
        assert [p for p in processes_of(automation) if "ansible-playbook" in p[1]] == []
        # a cancelled connector refuses further work
        assert automation.run_playbook(Path("sleep.yml"), ["omen2"]).status == "canceled"
    finally:
        automation.close()
    assert processes_of(automation, "sleep 3132") == []


def test_ssh_connections_are_reused_across_runs_and_ended_by_close(omen2: NodeHostSet) -> None:
    automation = AnsibleConnector(omen2.inventory_path, PLAYBOOKS)
    try:
        automation.gather_facts(["omen2"])
        masters = [p for p in processes_of(automation) if "[mux]" in p[1]]
        assert len(masters) == 1, processes_of(automation)
        automation.gather_facts(["omen2"])
        assert [p for p in processes_of(automation) if "[mux]" in p[1]] == masters
    finally:
        automation.close()
    assert processes_of(automation) == []
    assert not automation.private_data_dir.exists()


# -- isolation and secrets ---------------------------------------------------------------------------
def files_containing(text: str, *roots: Path, skip: tuple[Path, ...] = ()) -> list[str]:
    found = []
    for root in roots:
        for folder, dirs, files in os.walk(root):
            if any(Path(folder).is_relative_to(s) for s in skip):
                dirs[:] = []
                continue
            for name in files:
                path = Path(folder) / name
                try:
                    if path.is_file() and not path.is_symlink() and text.encode() in path.read_bytes():
                        found.append(str(path))
                except OSError:
                    continue
    return found


def test_no_secret_and_no_artifact_is_left_on_disk(node_hosts: Callable[..., NodeHostSet], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"Become-{secrets.token_hex(8)}"  # nowhere on this machine but the test bed's own files
    hosts = node_hosts([NodeHostSpec("omen2", sudo="password", become_password=secret)], fstab=FSTAB)
    monkeypatch.setenv("RUNBOOK_BECOME_PASSWORD", secret)  # as the CLI would have it
    inventory = inventory_without_passwords(hosts, tmp_path / "inv.yml")
    automation = AnsibleConnector(inventory, sleep_playbook(tmp_path, 2), become_password=secret)
    private = automation.private_data_dir
    leaks: list[str] = []
    looked_at: list[str] = []  # what the look saw running: it must have seen the playbook

    def look_while_running(event: TaskEvent) -> None:  # artifacts/<id>/command holds the whole environment
        if event["task"] != "First task":
            return  # the look happens once, while "Sleep on the host" runs (2 s)
        leaks.extend(files_containing(secret, private))
        for pid, cmd in processes_of(automation):
            looked_at.append(cmd)
            try:
                if secret.encode() in Path(f"/proc/{pid}/environ").read_bytes() + \
                        Path(f"/proc/{pid}/cmdline").read_bytes():
                    leaks.append(f"process {pid} {cmd}")
            except OSError:
                continue

    try:
        result = automation.run_playbook(Path("sleep.yml"), ["omen2"], on_event=look_while_running)
        assert result.ok, result.failed_hosts
        # the look was not empty: it saw the running ansible-playbook (whose environment it searched)
        assert any("ansible-playbook" in cmd for cmd in looked_at), looked_at
        assert list((private / "artifacts").iterdir()) == []  # each run's artifacts are gone
        assert automation.run_playbook(Path("sleep.yml"), ["omen2"], check=True).ok
    finally:
        automation.close()
    assert leaks == []
    assert not private.exists()
    # nothing anywhere under /tmp either (the test bed's own inventory holds it: skip that)
    assert files_containing(secret, Path("/tmp"), skip=(hosts.workdir, tmp_path)) == []


def test_the_users_ansible_configuration_and_home_are_left_alone(omen2: NodeHostSet, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    # a project ansible.cfg that would break any run that read it
    playbooks = sleep_playbook(tmp_path, 0)
    (playbooks / "ansible.cfg").write_text("[defaults]\nstrategy = no_such_strategy\n")
    monkeypatch.setenv("ANSIBLE_CONFIG", str(playbooks / "ansible.cfg"))
    with AnsibleConnector(omen2.inventory_path, playbooks) as automation:
        assert automation.run_playbook(Path("sleep.yml"), ["omen2"]).ok
    assert list(home.iterdir()) == []  # no ~/.ansible, no ~/.ssh/known_hosts entries


def test_a_connector_that_never_runs_leaves_nothing_behind(tmp_path: Path) -> None:
    (tmp_path / "inv.yml").write_text("all:\n  hosts:\n    omen2:\n")
    before = set(Path(tempfile.gettempdir()).glob("runbook-ansible-*"))
    automation = AnsibleConnector(tmp_path / "inv.yml", PLAYBOOKS)
    automation.close()
    assert set(Path(tempfile.gettempdir()).glob("runbook-ansible-*")) <= before
    with pytest.raises(HostError, match="closed"):
        automation.run_playbook(Path("node-facts.yml"), ["omen2"])


def processes_of_dir(folder: Path) -> list[tuple[int, str]]:
    mark = str(folder).encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if mark in cmdline and int(name) != os.getpid():
            found.append((int(name), cmdline.replace(b"\0", b" ").decode(errors="replace")))
    return found


def test_the_leftovers_of_a_killed_run_are_swept_by_the_next_connector(omen2: NodeHostSet,
                                                                       tmp_path: Path) -> None:
    """A runbook process killed with SIGKILL cannot close(): its dir and ssh master must not pile up."""
    script = tmp_path / "killed.py"
    script.write_text(f"""
import os, signal, sys
from pathlib import Path
from engine.connectors.ansible import AnsibleConnector
automation = AnsibleConnector(Path({str(omen2.inventory_path)!r}), Path({str(PLAYBOOKS)!r}))
automation.gather_facts(["omen2"])
print(automation.private_data_dir, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
""")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, timeout=120)
    left = Path(out.stdout.strip())
    assert left.is_dir(), out.stderr
    master = [p for p in processes_of_dir(left) if "[mux]" in p[1]]
    assert master, "the killed run's ssh control master should still be there"
    with AnsibleConnector(omen2.inventory_path, PLAYBOOKS) as automation:
        automation.private_data_dir  # noqa: B018  (made on first use: sweeps first)
        assert not left.exists()
        assert processes_of_dir(left) == []
        mine = automation.private_data_dir
    assert not mine.exists()


def test_a_playbook_that_does_not_exist_is_a_host_error(omen2: NodeHostSet) -> None:
    with AnsibleConnector(omen2.inventory_path, PLAYBOOKS) as automation, \
            pytest.raises(HostError, match="playbook not found"):
        automation.run_playbook(Path("nope.yml"), ["omen2"])


def test_a_broken_playbook_fails_with_ansibles_message(omen2: NodeHostSet, tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "broken.yml").write_text("- hosts: all\n  tasks:\n    - no_such_module: {}\n")
    with AnsibleConnector(omen2.inventory_path, folder) as automation:
        result = automation.run_playbook(Path("broken.yml"), ["omen2"])
    assert result.status == "failed" and not result.ok
    assert "no_such_module" in result.failed_hosts["omen2"]


def test_this_machine_is_untouched_by_the_runs(omen2: NodeHostSet, tmp_path: Path) -> None:
    before = (Path("/etc/fstab").read_text(), Path("/proc/swaps").read_text(), socket.gethostname())
    with AnsibleConnector(omen2.inventory_path, PLAYBOOKS) as automation:
        assert automation.run_playbook(Path("swap-off.yml"), ["omen2"]).ok
    assert (Path("/etc/fstab").read_text(), Path("/proc/swaps").read_text(), socket.gethostname()) == before
