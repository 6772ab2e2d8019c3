"""The become password (and the API token) never land anywhere the engine writes, whichever way given.

The flagship is planned with the password typed at the ``-K`` prompt (a real pty), planned again
with ``--become-password-file``, and run with ``RUNBOOK_BECOME_PASSWORD``, against an inventory
copy without ``ansible_become_password`` (so sudo on omen2 can only succeed with the engine's
password). Then every byte the run could have written is searched for it: the journal (with its
WAL), the saved plan, stdout/stderr, the engine's HOME and TMPDIR (Ansible's private data dir, if
any remained), and every file under /tmp, /var/tmp and /dev/shm modified during the test. While
the run goes, the environment and command line of every process it started are checked too
(ansible-runner copies its child's environment into its artifacts; ours must not hold it).
The API server token of the kubeconfig the engine uses is searched for in the same places.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.lab.test_durability_helpers import FLAGSHIP, NODE, Engine, inventory_without_become_passwords

pytestmark = [pytest.mark.integration, pytest.mark.lab]

SCANNED_ROOTS = ("/tmp", "/var/tmp", "/dev/shm")
MAX_SCANNED_BYTES = 64 << 20


@pytest.fixture
def engine(fresh_lab: Any) -> Iterator[Engine]:
    with Engine.for_lab(fresh_lab) as e:
        yield e


def files_modified_since(roots: tuple[str, ...], since: float, skip: set[Path]) -> Iterator[Path]:
    for root in roots:
        for folder, dirs, files in os.walk(root, onerror=lambda e: None):
            dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
            for name in files:
                path = Path(folder, name)
                try:
                    st = path.lstat()
                except OSError:
                    continue
                if path in skip or not path.is_file() or st.st_mtime < since or st.st_size > MAX_SCANNED_BYTES:
                    continue
                yield path


def holders_of(secrets: list[bytes], paths: Iterator[Path] | list[Path]) -> list[str]:
    found = []
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        found += [f"{path} holds secret #{i}" for i, secret in enumerate(secrets) if secret in data]
    return found


def secret_counts(secrets: list[bytes], paths: Iterator[Path] | list[Path]) -> dict[tuple[str, int], int]:
    """How often each secret stands in each file: (path, secret index) -> count, zeros left out."""
    counts = {}
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        for i, secret in enumerate(secrets):
            if (n := data.count(secret)) > 0:
                counts[(str(path), i)] = n
    return counts


def process_leaks(engine: Engine, secrets: list[bytes], own_pid: int) -> list[str]:
    """Processes of the run (not the engine itself, whose environment we filled) showing the secret."""
    leaks = []
    for line in engine.leftovers():
        pid = int(line.split(":", 1)[0])
        if pid == own_pid:
            continue
        for part in ("environ", "cmdline"):
            try:
                data = Path(f"/proc/{pid}/{part}").read_bytes()
                leaks += [f"{part} of {line} holds secret #{i}" for i, secret in enumerate(secrets) if secret in data]
            except OSError:
                continue
    return leaks


def test_the_become_password_appears_nowhere_the_run_wrote(engine: Engine) -> None:
    import pexpect

    from engine.lab.controlplane import ControlPlane

    text = engine.lab.env()["RUNBOOK_BECOME_PASSWORD"]
    token = ControlPlane.from_state(engine.lab.lab.record()["controlplane_dir"]).token
    secrets = [text.encode(), token.encode()]
    assert len(text) >= 12 and len(token) >= 16
    inventory = inventory_without_become_passwords(engine.lab, engine.root / "inventory.yml")
    assert secrets[0] not in inventory.read_bytes()
    password_file = engine.root / "become-password"
    password_file.write_text(text + "\n")
    password_file.chmod(0o600)
    without_env = {k: v for k, v in engine.env({"RUNBOOK_INVENTORY": str(inventory)}).items()
                   if k != "RUNBOOK_BECOME_PASSWORD"}
    # Why: the session's lab is shared; its etcd may hold the become password already (the cluster-mode
    # module's Secret, as an operator stores it). Such a file may be written during the run, but it
    # may not hold a secret more often than before.
    held_before = secret_counts(secrets, files_modified_since(SCANNED_ROOTS, 0, skip={password_file}))
    started = time.time() - 1
    outputs: list[bytes] = []

    # 1. the prompt (-K), on a real terminal
    plan_file = engine.root / "plan.json"
    child = pexpect.spawn(engine.argv()[0], [*engine.argv()[1:], "plan", FLAGSHIP, "--node", NODE, "-K",
                                             "--out", str(plan_file)],
                          env=without_env, cwd=str(engine.root), timeout=240)
    child.expect("BECOME password: ")
    child.sendline(text)
    child.expect(pexpect.EOF)
    child.close()
    outputs.append(child.before or b"")
    assert child.exitstatus == 0, (child.before or b"").decode(errors="replace")
    assert b"state: ready" in (child.before or b"")  # facts were read with the prompted password

    # 2. a file
    done = engine.run("plan", FLAGSHIP, "--node", NODE, "--become-password-file", str(password_file), "-o", "json",
                      env={"RUNBOOK_INVENTORY": str(inventory), "RUNBOOK_BECOME_PASSWORD": ""})
    outputs += [done.stdout.encode(), done.stderr.encode()]
    assert done.returncode == 0, done.stderr

    # 3. the environment: the real run, watched while it goes
    proc = engine.start("run", FLAGSHIP, "--node", NODE, "--yes", env={"RUNBOOK_INVENTORY": str(inventory)})
    leaks: list[str] = []
    seen_children = 0
    while proc.poll() is None:
        seen_children = max(seen_children, len(engine.leftovers()) - 1)
        leaks += process_leaks(engine, secrets, proc.pid)
        time.sleep(0.2)
    assert proc.returncode == 0, engine.output()
    outputs.append(engine.output().encode())
    assert seen_children > 0 and leaks == []
    run_id = engine.last_run().id
    shown = engine.run("runs", "show", run_id, "-o", "json")
    outputs += [shown.stdout.encode(), shown.stderr.encode()]

    assert [(i, j) for i, out in enumerate(outputs) for j, s in enumerate(secrets) if s in out] == []
    written = [*engine.root.glob("journal.sqlite*"), plan_file]
    assert (engine.root / "journal.sqlite").exists() and plan_file.exists()
    assert holders_of(secrets, written) == []
    assert holders_of(secrets, [p for p in engine.root.rglob("*") if p.is_file() and p != password_file]) == []
    scanned = list(files_modified_since(SCANNED_ROOTS, started, skip={password_file}))
    assert len(scanned) > 0
    grown = {k: n for k, n in secret_counts(secrets, scanned).items() if n > held_before.get(k, 0)}
    assert grown == {}
    assert not list(engine.tmpdir.glob("runbook-ansible-*"))  # the private data dir is gone
    assert engine.wait_no_leftovers() == []
