"""No secret of the engine's environment reaches Ansible, its workers, the node host or the artifacts
(issue 14, item 12): ansible-playbook gets an allow-listed environment, not the parent's minus a
deny-list.

Every ``RUNBOOK_*`` name the engine's source mentions (the webhook token, the PagerDuty secret, the
become password, approval credentials, whatever is added later) plus secrets the engine knows
nothing about (a cloud key) get a unique canary value in the engine's environment. A real playbook
then runs over real SSH on a node host; while it runs, the environment of every process on both
sides is read from /proc: on the controller, ansible-playbook, its workers and ssh (found by the
private dir in their environment); on the host (which shares this machine's PID namespace), the
shell of a plain task and of a become (sudo) task, found by a token in their command line. The
artifacts folder (``artifacts/<id>/command`` holds the child's whole environment) is read too, and
after a SIGKILL mid-run it is checked, then swept by the next connector.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from engine.connectors.ansible import CHILD_ENV_ALLOWED, PASS_ENV, RUN_MARKER, AnsibleConnector
from engine.lab.nodehosts import NodeHostSet, NodeHostSpec

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "Become-7f3Kq-9zX"
OURS = {RUN_MARKER, "RUNBOOK_ANSIBLE_DIR"}
NOT_OURS = ("RUNBOOK_APPROVER_TOKEN", "RUNBOOK_READER_TOKEN", "RUNBOOK_SENDER_TOKEN", "RUNBOOK_FUTURE_SECRET",
            "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "ANSIBLE_VAULT_PASSWORD", "LC_SECRET_NOT")


def engine_secret_names() -> list[str]:
    """Every RUNBOOK_* variable the engine's source mentions, plus secrets of other tools."""
    names = set()
    for path in (REPO / "engine").rglob("*.py"):
        names |= set(re.findall(r"\bRUNBOOK_[A-Z][A-Z0-9_]*\b", path.read_text()))
    names -= CHILD_ENV_ALLOWED | OURS | {PASS_ENV}  # PASS_ENV names what passes: a canary value is no list
    assert {"RUNBOOK_WEBHOOK_TOKEN", "RUNBOOK_PAGERDUTY_SECRET", "RUNBOOK_BECOME_PASSWORD"} <= names
    return sorted(names | {n for n in NOT_OURS if not n.startswith("LC_")})


def canaries() -> dict[str, str]:
    return {name: f"canary-{secrets.token_hex(12)}" for name in engine_secret_names()}


def playbook(folder: Path, token: str) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "env.yml").write_text(f"""
- name: Environment on the host
  hosts: "{{{{ target | default('all') }}}}"
  gather_facts: false
  tasks:
    - name: A plain task
      ansible.builtin.shell: "sleep 3 # {token}-plain"
      become: false
    - name: A become task
      ansible.builtin.shell: "sleep 3 # {token}-root"
      become: true
""")
    return folder


def inventory_without_passwords(hosts: NodeHostSet, path: Path) -> Path:
    inventory = yaml.safe_load(hosts.inventory_path.read_text())
    for entry in inventory["all"]["hosts"].values():
        entry.pop("ansible_become_password", None)
    path.write_text(yaml.safe_dump(inventory))
    return path


def environ_of(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def processes(marker: bytes, in_environ: bool) -> dict[int, str]:
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            hay = environ_of(int(name)) if in_environ else cmdline
        except OSError:
            continue
        if marker in hay:
            found[int(name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")[:120]
    return found


def leaks_in(data: bytes, values: dict[str, str], where: str) -> list[str]:
    return [f"{where} holds {name}" for name, value in values.items() if value.encode() in data]


def test_no_secret_of_the_engine_reaches_ansible_its_workers_the_host_or_the_artifacts(
        node_hosts: Callable[..., NodeHostSet], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hosts = node_hosts([NodeHostSpec("omen2", sudo="password", become_password=PASSWORD)])
    values = canaries()
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LC_SECRET_NOT", "fine")  # LC_* passes (locale), whatever its name: not a canary
    token = f"envcheck-{secrets.token_hex(6)}"
    automation = AnsibleConnector(inventory_without_passwords(hosts, tmp_path / "inv.yml"),
                                  playbook(tmp_path / "playbooks", token), become_password=PASSWORD)
    private = automation.private_data_dir
    seen: dict[str, dict[int, str]] = {"controller": {}, "plain": {}, "root": {}}
    leaks: list[str] = []
    artifacts_seen: list[Path] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for side, marker, in_environ in (("controller", f"RUNBOOK_ANSIBLE_DIR={private}".encode(), True),
                                             ("plain", f"{token}-plain".encode(), False),
                                             ("root", f"{token}-root".encode(), False)):
                for pid, cmd in processes(marker, in_environ).items():
                    environ = environ_of(pid)
                    if environ:
                        seen[side][pid] = cmd
                        leaks.extend(leaks_in(environ, values, f"{side} process {pid} ({cmd})"))
            for path in (private / "artifacts").rglob("*"):
                if path.is_file():
                    artifacts_seen.append(path)
                    leaks.extend(leaks_in(path.read_bytes(), values, str(path)))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        watcher.start()
        result = automation.run_playbook(Path("env.yml"), ["omen2"])
    finally:
        stop.set()
        watcher.join(10)
        automation.close()
    assert result.ok, (result.failed_hosts, result.unreachable_hosts)
    # the checks were not vacuous: each side was seen, ansible-playbook among the controller's
    assert any("ansible-playbook" in cmd for cmd in seen["controller"].values()), seen
    assert seen["plain"] and seen["root"], seen
    assert any(p.name == "command" for p in artifacts_seen)
    assert leaks == []


def test_a_killed_engines_artifacts_hold_no_secret_and_are_swept_at_the_next_start(
        node_hosts: Callable[..., NodeHostSet], tmp_path: Path) -> None:
    hosts = node_hosts([NodeHostSpec("omen2", sudo="password", become_password=PASSWORD)])
    values = canaries()
    token = f"envcheck-{secrets.token_hex(6)}"
    folder = playbook(tmp_path / "playbooks", token)
    inventory = inventory_without_passwords(hosts, tmp_path / "inv.yml")
    script = tmp_path / "killed.py"
    script.write_text(f"""
import os, signal, threading, time
from pathlib import Path
from engine.connectors.ansible import AnsibleConnector
automation = AnsibleConnector(Path({str(inventory)!r}), Path({str(folder)!r}), become_password={PASSWORD!r})
print(automation.private_data_dir, flush=True)
def die():
    while not list((automation.private_data_dir / "artifacts").rglob("command")):
        time.sleep(0.05)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
threading.Thread(target=die, daemon=True).start()
automation.run_playbook(Path("env.yml"), ["omen2"])
""")
    env = {**os.environ, **values, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, env=env,
                         timeout=180)
    assert out.returncode == -signal.SIGKILL, out.stderr
    left = Path(out.stdout.strip().splitlines()[0])
    commands = list((left / "artifacts").rglob("command"))
    assert commands, "the killed run's artifacts should still be there"
    assert [leak for c in commands for leak in leaks_in(c.read_bytes(), values, str(c))] == []
    with AnsibleConnector(hosts.inventory_path, folder) as automation:
        automation.private_data_dir  # noqa: B018  (made on first use: sweeps first)
        assert not left.exists()
    time.sleep(0.5)
    assert processes(str(left).encode(), in_environ=True) == {}
