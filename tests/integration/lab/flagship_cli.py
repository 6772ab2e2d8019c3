"""Running the ``runbook`` CLI from the flagship's lab tests: this checkout's code and runbooks (not
whatever ``runbook`` is first on PATH), a journal of the test's own, and read-outs of the lab's state."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
RUNBOOKS = ROOT / "runbooks"
LABEL = "nvidia.com/gpu.workload.config"


def _prefix(journal: Path | None) -> str:
    env = {"PYTHONPATH": str(ROOT), "RUNBOOK_RUNBOOKS_DIR": str(RUNBOOKS)}
    if journal is not None:
        env["RUNBOOK_JOURNAL"] = str(journal)
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())


def runbook(sh: Callable[..., Any], args: str, *, journal: Path | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``runbook ARGS`` (as ``python -m engine``), output captured."""
    return sh(f"{_prefix(journal)} {shlex.quote(sys.executable)} -m engine {args}", timeout=timeout)


def start_runbook(env: dict[str, str], args: list[str], *, journal: Path, log: Path) -> subprocess.Popen[str]:
    """``runbook ARGS`` in the background (another terminal), output to ``log``."""
    full = {**env, "PYTHONPATH": str(ROOT), "RUNBOOK_RUNBOOKS_DIR": str(RUNBOOKS), "RUNBOOK_JOURNAL": str(journal)}
    out = open(log, "w")  # noqa: SIM115 - closed by the caller through proc.stdout
    return subprocess.Popen([sys.executable, "-m", "engine", *args], env=full, stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, cwd=os.getcwd())


def lab_status(sh: Callable[..., Any]) -> dict[str, Any]:
    """``runbook lab status -o json``."""
    r = runbook(sh, "lab status -o json")
    assert r.returncode == 0, r.stdout + r.stderr
    return dict(json.loads(r.stdout))


def node_status(sh: Callable[..., Any], name: str) -> dict[str, Any]:
    return next(n for n in lab_status(sh)["nodes"] if n["name"] == name)


def vm_statuses(sh: Callable[..., Any]) -> dict[str, str]:
    return {f"{v['namespace']}/{v['name']}": v["status"] for v in lab_status(sh)["vms"]}


def host_lines(sh: Callable[..., Any], host: str, command: str) -> list[str]:
    """Output lines of a command run on a node host as root, through Ansible, as an operator would."""
    quoted = command.replace("'", "'\\''")
    r = sh(f"ansible -i \"$RUNBOOK_INVENTORY\" {host} -b -m command -a '{quoted}'")
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.splitlines()[1:]


def fstab(sh: Callable[..., Any], host: str) -> list[str]:
    return host_lines(sh, host, "cat /etc/fstab")


def cuda_pids(sh: Callable[..., Any], host: str) -> list[str]:
    lines = host_lines(sh, host, "nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader")
    return sorted(line.split(",")[0].strip() for line in lines if "," in line)


def kube_node(sh: Callable[..., Any], name: str) -> dict[str, Any]:
    r = sh(f"kubectl get node {name} -o json")
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def ready(node: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))
