"""bench/ finds ``kubectl``, ``ansible`` and ``runbook`` as the CLI does (issue 32): this Python's
scripts folder first, then ``PATH``; never only beside the interpreter (a venv without the
``kubectl`` extra made P8 fail with ``.../bin/kubectl: No such file or directory``)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench import p8_alert_to_run as p8  # noqa: E402


def _executable(folder: Path, name: str, body: str = "exit 0") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_tool_missing_beside_the_interpreter_is_found_on_path(tmp_path: Path) -> None:
    venv_bin = tmp_path / "venv-bin"
    venv_bin.mkdir()
    system = _executable(tmp_path / "usr-bin", "kubectl")
    assert common.tool("kubectl", path=str(system.parent), scripts=[venv_bin]) == str(system)


def test_the_scripts_folder_comes_before_path(tmp_path: Path) -> None:
    mine = _executable(tmp_path / "venv-bin", "ansible-playbook")
    other = _executable(tmp_path / "pyenv-shims", "ansible-playbook")
    assert common.tool("ansible-playbook", path=str(other.parent), scripts=[mine.parent]) == str(mine)


def test_a_tool_found_nowhere_is_a_clear_error_naming_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(common.ToolNotFound) as e:
        common.tool("kubectl", path=str(tmp_path / "nothing"), scripts=[tmp_path / "venv-bin"])
    text = str(e.value)
    assert "kubectl not found" in text and "kubernetes-client" in text and str(tmp_path / "nothing") in text


def test_the_default_search_is_this_python_then_the_process_path(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    assert common.scripts_dirs()[0] == Path(sys.executable).parent
    found = _executable(tmp_path / "elsewhere", "bench-tool-probe-xyz")
    monkeypatch.setenv("PATH", os.pathsep.join([str(found.parent), os.environ.get("PATH", "")]))
    assert common.tool("bench-tool-probe-xyz") == str(found)


def test_runbook_is_this_pythons_console_script_or_this_python(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # never a `runbook` of another install found on PATH: that would measure another engine
    _executable(tmp_path / "other-install", "runbook")
    monkeypatch.setenv("PATH", str(tmp_path / "other-install"))
    monkeypatch.setattr(common, "scripts_dirs", lambda: [tmp_path / "venv-bin"])
    assert common.runbook_cmd("plan") == [sys.executable, "-m", "engine", "plan"]
    script = _executable(tmp_path / "venv-bin", "runbook")
    assert common.runbook_cmd("plan") == [str(script), "plan"]


def test_the_fallback_without_a_console_script_runs_the_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # `python -m engine.cli` imported the module and exited 0 without running anything
    monkeypatch.setattr(common, "scripts_dirs", lambda: [tmp_path])
    r = subprocess.run([*common.runbook_cmd("--version")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip(), (r.returncode, r.stdout, r.stderr)


def test_p8_reads_nodes_with_the_kubectl_on_path_in_a_venv_without_the_extra(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv_bin = tmp_path / "venv-bin"
    venv_bin.mkdir()
    monkeypatch.setattr(common, "scripts_dirs", lambda: [venv_bin])
    monkeypatch.setattr(common, "BIN", venv_bin)
    kubectl = _executable(tmp_path / "usr-bin", "kubectl", body='echo \'{"items": [], "argv": "\'"$*"\'"}\'')
    env = {"PATH": str(kubectl.parent), "HOME": str(tmp_path)}
    out = p8._kubectl_json(env, "get", "nodes")
    assert out["items"] == [] and out["argv"] == "get nodes -o json"
