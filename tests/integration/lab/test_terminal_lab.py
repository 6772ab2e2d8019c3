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
from flagship_cli import ROOT, RUNBOOKS

pytestmark = [pytest.mark.integration, pytest.mark.lab]

STEPS = ("relabel-container", "swap-off", "restart-kubelet")
WAIT_LINE = re.compile(r"(\S+=\S+|[^,\n]+), (\d+) s of (\d+) s")


def _script(lab: Any, tmp: Path, command: str) -> Path:
    env = {**lab.lab.env(), "HOME": str(lab.home), "ANSIBLE_HOME": str(lab.home / "ansible"),
           "ANSIBLE_LOCAL_TEMP": str(lab.home / "ansible-tmp"), "ANSIBLE_NOCOLOR": "1",
           "PYTHONPATH": str(ROOT), "RUNBOOK_RUNBOOKS_DIR": str(RUNBOOKS), "RUNBOOK_JOURNAL": str(tmp / "journal.db"),
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
        assert f"step {step}: start" in out and f"step {step}: succeeded" in out, out
    assert re.search(r"verify .*: (waiting|ok) \(", out), out
    assert re.search(r"gpu-node-recovery on omen2: succeeded \(exit 0\)", out), out


def test_on_a_terminal_the_run_shows_steps_a_verification_bar_and_the_closing_table(
        fresh_lab: Any, tmp_path: Path) -> None:
    tmux = shutil.which("tmux")
    if tmux is None:
        pytest.skip("no tmux (apt-get install tmux; scripts/prepare.sh installs it)")
    sock = str(tmp_path / "tmux.sock")
    script = _script(fresh_lab, tmp_path, f"{_run_cmd()}; echo \"EXIT=$?\"; sleep 600")
    base = [tmux, "-S", sock, "-f", "/dev/null"]
    subprocess.run([*base, "new-session", "-d", "-x", "160", "-y", "60", "-s", "rb", f"TERM=xterm-256color bash "
                    f"{shlex.quote(str(script))}"], check=True, timeout=30)

    def screen() -> str:
        got = subprocess.run([*base, "capture-pane", "-p", "-t", "rb", "-S", "-200"], capture_output=True,
                             text=True, timeout=30, check=False)
        return got.stdout

    waits: list[str] = []
    final = ""
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            shown = screen()
            if WAIT_LINE.search(shown) and "running" in shown:
                waits.append(shown)
            if "EXIT=" in shown:
                final = shown
                break
            time.sleep(0.2)
    finally:
        subprocess.run([*base, "kill-server"], timeout=30, check=False)
    assert final, "the run did not end within 600 s"
    assert "EXIT=0" in final, final
    assert waits, "no verification wait was ever on the screen:\n" + final
    during = waits[0]
    # the steps with their state while a verification waits: the one running, the others done or pending
    assert "gpu-node-recovery on omen2" in during
    for step in STEPS:
        assert step in during, during
    assert re.search(r"\brunning\b", during)
    assert "verify " in during
    m = WAIT_LINE.search(during)
    assert m and int(m.group(2)) <= int(m.group(3)) and int(m.group(3)) in (30, 60, 120, 180, 300), during
    assert "━" in during  # rich's bar
    # at the end: every step succeeded (the live display's last frame), then the closing table and run id
    for step in STEPS:
        assert re.search(rf"✓\s+{step}\s+succeeded", final), final
    assert re.search(r"gpu-node-recovery on omen2: succeeded", final), final
    assert re.search(r"┃\s*step\s*┃\s*status", final) or re.search(r"step\s+│?\s*status", final), final
    assert "run id: " in final
    assert "\x1b" not in final  # capture-pane without -e: the text a person reads
