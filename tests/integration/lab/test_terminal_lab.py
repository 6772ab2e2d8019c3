"""What a person sees: ``runbook run gpu-node-recovery --node omen2`` on the lab in a real terminal
(tmux's pseudo-terminal) and through a pipe.

On the terminal the live display shows the steps with their state and, while a verification waits,
a bar with its elapsed time against the timeout; the closing table follows. Through a pipe the same
run prints plain lines, one per event, with no control characters.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.lab.flagship_cli import ROOT, RUNBOOKS

pytestmark = [pytest.mark.integration, pytest.mark.lab]

STEPS = ("relabel-container", "swap-off", "restart-kubelet")
WAIT_LINE = re.compile(r"(\S+=\S+|[^,\n]+), (\d+) s of (\d+) s")


def _script(lab: Any, tmp: Path, command: str, runbooks: Path = RUNBOOKS) -> Path:
    env = {**lab.lab.env(), "HOME": str(lab.home), "ANSIBLE_HOME": str(lab.home / "ansible"),
           "ANSIBLE_LOCAL_TEMP": str(lab.home / "ansible-tmp"), "ANSIBLE_NOCOLOR": "1",
           "PYTHONPATH": str(ROOT), "RUNBOOK_RUNBOOKS_DIR": str(runbooks), "RUNBOOK_JOURNAL": str(tmp / "journal.db"),
           "PATH": os.environ.get("PATH", "")}
    lines = ["#!/bin/bash", "unset NO_COLOR CI"] + [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines.append(command)
    script = tmp / "cmd.sh"
    script.write_text("\n".join(lines) + "\n")
    return script


def _run_cmd() -> str:
    return f"{shlex.quote(sys.executable)} -m engine run gpu-node-recovery --node omen2 --yes"


def test_through_a_pipe_the_run_prints_plain_lines_without_control_characters(
        fresh_lab: Any, tmp_path: Path) -> None:
    script = _script(fresh_lab, tmp_path, f"{_run_cmd()} 2>&1 | cat; exit ${{PIPESTATUS[0]}}")
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=600, check=False)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "\x1b" not in out and "\r" not in out
    for step in STEPS:
        assert f"step {step}: start" in out, out
    for step in STEPS[:2]:
        assert f"step {step}: succeeded in " in out, out
    # kubelet may already be up by itself once swap is off: the last step then says so (skipped)
    assert re.search(r"step restart-kubelet: (succeeded|skipped) in ", out), out
    assert re.search(r"verify .*: (waiting|ok) \(", out), out
    assert re.search(r"gpu-node-recovery on omen2: succeeded \(exit 0\)", out), out


class Tmux:
    """A detached tmux session (its own socket) running one script in a 160x60 pseudo-terminal."""

    def __init__(self, tmp: Path, script: Path) -> None:
        tmux = shutil.which("tmux")
        if tmux is None:
            pytest.skip("no tmux (apt-get install tmux; scripts/prepare.sh installs it)")
        self.base = [tmux, "-S", str(tmp / "tmux.sock"), "-f", "/dev/null"]
        subprocess.run([*self.base, "new-session", "-d", "-x", "160", "-y", "60", "-s", "rb",
                        f"TERM=xterm-256color bash {shlex.quote(str(script))}"], check=True, timeout=30)

    def screen(self) -> str:
        """The text a person reads (capture-pane without -e: no escape codes), with 200 lines of scroll-back."""
        got = subprocess.run([*self.base, "capture-pane", "-p", "-t", "rb", "-S", "-200"], capture_output=True,
                             text=True, timeout=30, check=False)
        return got.stdout

    def watch(self, seen: Any, timeout: float = 600) -> str:
        """Poll the screen every 0.2 s, handing each capture to ``seen``, until the script echoes EXIT=."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            shown = self.screen()
            seen(shown)
            if "EXIT=" in shown:
                return shown
            time.sleep(0.2)
        raise AssertionError(f"the command did not end within {timeout} s:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], timeout=30, check=False)


def test_on_a_terminal_the_recovery_shows_its_steps_live_and_the_closing_table(
        fresh_lab: Any, tmp_path: Path) -> None:
    term = Tmux(tmp_path, _script(fresh_lab, tmp_path, f"stty size; {_run_cmd()}; echo \"EXIT=$?\"; sleep 600"))
    frames: list[str] = []
    try:
        final = term.watch(lambda shown: frames.append(shown) if "● " in shown and "EXIT=" not in shown else None)
    finally:
        term.close()
    (tmp_path / "screen-final.txt").write_text(final)  # kept by pytest: docs quote these captures
    assert "EXIT=0" in final, final
    assert frames, "the live display never showed a running step:\n" + final
    # while swap-off runs: the relabel done, swap-off running with its Ansible task, restart-kubelet pending
    during = next((f for f in frames if re.search(r"●\s+swap-off\s+running", f)), None)
    assert during is not None, frames[-1]
    assert "gpu-node-recovery on omen2  running" in during
    assert re.search(r"✓\s+relabel-container\s+succeeded", during), during
    assert re.search(r"○\s+restart-kubelet\s+pending", during), during
    # the action, then the playbook's tasks as they end (a task of the swap-off playbook was seen)
    tasks = {m.group(1) for f in frames for m in re.finditer(r"●\s+swap-off\s+running\s+\S+s\s+last task: ([^(\n]+?)"
                                                            r" \((ok|changed|skipped)\)", f)}
    assert tasks & {"Turn off active swap devices", "Comment out active swap entries in fstab",
                    "Set the swap devices and the unhandled swap sources", "Publish runbook_facts for the engine",
                    "Probe swap, services, GPU driver binding and CUDA processes (read-only)"}, frames[-1]
    # at the end: the last frame (every step done), then the closing table and the run id
    assert re.search(r"✓\s+relabel-container\s+succeeded", final) and re.search(r"✓\s+swap-off\s+succeeded", final)
    assert re.search(r"(✓|↷)\s+restart-kubelet\s+(succeeded|skipped)", final), final
    assert "gpu-node-recovery on omen2: succeeded" in final
    assert re.search(r"┃\s*step\s*┃\s*status\s*┃\s*time\s*┃\s*reason", final), final
    assert re.search(r"│ swap-off\s+│ succeeded │", final), final
    assert "run id: r-" in final


SIGN_OFF = """\
apiVersion: runbook/v1
name: wait-for-sign-off
version: "1.0.0"
description: Mark a node, then wait until a person labels it checked.
params:
  node: {type: node, required: true, description: The node}
steps:
  - id: mark-started
    action: {kube: {label: {runbook.test/started: "yes"}}}
    verify:
      - {check: {node_label: {key: runbook.test/started, equals: "yes"}}, timeout: 30s}
  - id: wait-for-sign-off
    action: {kube: {label: {runbook.test/asked: "yes"}}}
    verify:
      - {check: {node_label: {key: runbook.test/checked, equals: "yes"}}, timeout: 90s}
"""


def test_on_a_terminal_a_verification_wait_shows_a_bar_of_elapsed_time_against_its_timeout(
        lab: Any, tmp_path: Path) -> None:
    # The recovery's own waits on the lab are often over at the first observation (kubelet comes back
    # by itself once swap is off), so this wait is held open by the test: it labels the node only after
    # it has seen the bar, as a person signing off would. worker-1 has no GPU: the run guards let it be.
    runbooks = tmp_path / "runbooks"
    runbooks.mkdir()
    (runbooks / "wait-for-sign-off.yaml").write_text(SIGN_OFF)
    lab.dirty = True
    cmd = f"{shlex.quote(sys.executable)} -m engine run wait-for-sign-off --node worker-1 --yes"
    term = Tmux(tmp_path, _script(lab, tmp_path, f"{cmd}; echo \"EXIT=$?\"; sleep 600", runbooks=runbooks))
    waits: list[tuple[int, str]] = []
    signed = False
    labels: list[str] = []
    env = {**lab.env()}

    def seen(shown: str) -> None:
        nonlocal signed
        m = WAIT_LINE.search(shown)
        if m and "EXIT=" not in shown:
            waits.append((int(m.group(2)), shown))
            if int(m.group(2)) >= 3 and not signed:
                subprocess.run(["kubectl", "label", "node", "worker-1", "runbook.test/checked=yes", "--overwrite"],
                               env=env, capture_output=True, timeout=60, check=True)
                labels.append(subprocess.run(["kubectl", "get", "node", "worker-1", "--show-labels"], env=env,
                                             capture_output=True, text=True, timeout=60, check=False).stdout)
                signed = True

    try:
        final = term.watch(seen, timeout=300)
    finally:
        term.close()
        subprocess.run(["kubectl", "label", "node", "worker-1", "runbook.test/checked-", "runbook.test/started-",
                        "runbook.test/asked-"], env=env, capture_output=True, timeout=60, check=False)
    assert "EXIT=0" in final, f"{final}\nkubectl saw: {labels}"
    assert signed and waits, final
    seconds, during = waits[-1]
    (tmp_path / "screen-during.txt").write_text(during)
    assert re.search(r"✓\s+mark-started\s+succeeded", during), during
    assert re.search(r"●\s+wait-for-sign-off\s+running", during), during
    assert "verify label runbook.test/checked = yes" in during, during
    line = next(ln for ln in during.splitlines() if WAIT_LINE.search(ln))
    assert re.search(r"━+.*, \d+ s of 90 s", line), line  # the bar, then the observed value and the timeout
    assert seconds >= 3 and len({s for s, _ in waits}) >= 2  # the clock moved while nothing else happened
    assert re.search(r"✓\s+wait-for-sign-off\s+succeeded", final), final
    assert "wait-for-sign-off on worker-1: succeeded" in final and "of 90 s" not in final.split("EXIT=")[0][-2000:]
