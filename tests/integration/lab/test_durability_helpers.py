"""What the durability, fault-injection and secrets tests share (this file holds no tests).

* :class:`Engine`: the real CLI (``python -m engine``) as its own process, against the lab, with its
  own journal, HOME and TMPDIR. Every process it starts can be found: its environment carries
  ``RUNBOOK_TEST_TAG=<tag>`` (inherited by ansible-playbook, its workers and ssh), and the ssh control
  masters, whose /proc environment their process title overwrites, show the private TMPDIR in their
  command line. :meth:`Engine.leftovers` lists them by reading /proc (no psutil).
* :class:`Effects`: the mutating effects on omen2 since it was made: the label PATCHes the engine
  sent (the control plane's audit log) and the ``swapoff`` / ``systemctl restart kubelet`` calls the
  host's shims logged (``calls.jsonl``). Fault tests assert each happened exactly once.
* :func:`stop_kubelet`: kubelet stopped on purpose (``systemctl stop``), so only the runbook's
  restart brings it back and ``restart-kubelet`` really acts (otherwise systemd's auto-restart in the
  lab may bring kubelet back on its own once swap is off, and the step is skipped as already done).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path
from typing import Any

from engine.journal import EventRecord, Journal, RunRecord
from engine.lab.controlplane import ControlPlane
from engine.lab.hoststate import HostState

REPO = Path(__file__).resolve().parents[3]
FLAGSHIP = "gpu-node-recovery"
NODE = "omen2"
LABEL = "nvidia.com/gpu.workload.config"
LEASE = f"runbook-node-{NODE}"


class Engine:
    """``python -m engine ...`` in its own process group, environment and folders."""

    def __init__(self, lab: Any, root: Path) -> None:
        self.lab = lab
        self.root = root
        self.tag = uuid.uuid4().hex
        self.journal_path = root / "journal.sqlite"
        self.tmpdir = root / "tmp"
        self.home = root / "home"
        for d in (self.tmpdir, self.home):
            d.mkdir(parents=True, exist_ok=True)
        self._outputs = 0
        self._journal: Journal | None = None

    @classmethod
    @contextmanager
    def for_lab(cls, lab: Any) -> Iterator[Engine]:
        # short: ssh control sockets live under TMPDIR, and a unix socket path has 108 bytes at most
        root = Path(tempfile.mkdtemp(prefix="rbt-", dir="/tmp"))
        engine = cls(lab, root)
        try:
            yield engine
        finally:
            engine.kill_leftovers()
            if engine._journal is not None:
                engine._journal.close()
            shutil.rmtree(root, ignore_errors=True)

    # -- running the CLI ---------------------------------------------------------------------------
    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in self.lab.env().items() if k != "RUNBOOK_TEST_KILL_AT"}
        env.update(HOME=str(self.home), TMPDIR=str(self.tmpdir), RUNBOOK_JOURNAL=str(self.journal_path),
                   RUNBOOK_RUNBOOKS_DIR=str(REPO / "runbooks"), RUNBOOK_TEST_TAG=self.tag, NO_COLOR="1",
                   PYTHONPATH=str(REPO))
        env.update(extra or {})
        return env

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "engine", *args]

    def run(self, *args: str, env: dict[str, str] | None = None, timeout: float = 420,
            stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*args), env=self.env(env), cwd=self.root, capture_output=True, text=True,
                              timeout=timeout, check=False, input=stdin if stdin is not None else "")

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        self._outputs += 1
        out = open(self.root / f"out-{self._outputs}.txt", "w")  # noqa: SIM115 - closed with the process
        return subprocess.Popen(self.argv(*args), env=self.env(env), cwd=self.root, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)

    def output(self, n: int | None = None) -> str:
        return (self.root / f"out-{n or self._outputs}.txt").read_text()

    # -- the journal ---------------------------------------------------------------------------------
    @property
    def journal(self) -> Journal:
        if self._journal is None:
            self._journal = Journal(self.journal_path)
        return self._journal

    def last_run(self) -> RunRecord:
        runs = self.journal.list_runs(limit=1)
        assert runs, "no run was recorded"
        return runs[0]

    def events(self, run_id: str) -> list[EventRecord]:
        return self.journal.events(run_id)

    def wait_for_event(self, kind: str, step: str | None, timeout: float = 180) -> str:
        """Poll the journal until the latest run has event ``kind`` (of ``step``); return the run id."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.journal_path.exists():
                runs = self.journal.list_runs(limit=1)
                if runs and any(e.kind == kind and (step is None or e.step == step) for e in self.events(runs[0].id)):
                    return runs[0].id
            time.sleep(0.05)
        raise AssertionError(f"no {kind} event for step {step} within {timeout:.0f} s")

    def runs_json(self) -> list[dict[str, Any]]:
        done = self.run("runs", "-o", "json")
        assert done.returncode == 0, done.stderr
        return list(json.loads(done.stdout))

    def show_json(self, run_id: str) -> dict[str, Any]:
        done = self.run("runs", "show", run_id, "-o", "json")
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout))

    # -- processes -------------------------------------------------------------------------------------
    def leftovers(self) -> list[str]:
        """Processes this engine started (or inherited its tag) that are still alive."""
        marker = f"RUNBOOK_TEST_TAG={self.tag}".encode()
        folder = str(self.tmpdir).encode()
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    environ = f.read()
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if marker in environ.split(b"\0") or folder in cmdline:
                command = cmdline.replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{name}: {command[:160]}")
        return found

    def wait_no_leftovers(self, timeout: float = 5.0) -> list[str]:
        """What is still alive ``timeout`` seconds after the engine exited (processes being reaped go)."""
        deadline = time.monotonic() + timeout
        left = self.leftovers()
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = self.leftovers()
        return left

    def kill_leftovers(self) -> None:
        """Cleanup after a failed test: end only this engine's processes, by pid."""
        for line in self.leftovers():
            with suppress(ProcessLookupError, PermissionError):
                os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)


class Effects:
    """Mutating effects on omen2 from now on: engine label PATCHes, swapoff and kubelet restarts."""

    def __init__(self, lab: Any) -> None:
        record = lab.lab.record()
        self.plane = ControlPlane.from_state(record["controlplane_dir"])
        self.host = HostState(record["nodes"][NODE]["state_dir"])
        self._audit_mark = self.plane.audit_mark()
        self._calls_mark = len(self.host.calls())

    def _label_patch_events(self) -> list[tuple[float, str]]:
        """(when the API server completed it, value) of each workload label PATCH onto omen2 (audit log)."""
        found = []
        for e in self.plane.mutations(since=self._audit_mark):
            ref = e.get("objectRef", {})
            if e.get("verb") != "patch" or ref.get("resource") != "nodes" or ref.get("name") != NODE \
                    or ref.get("subresource"):
                continue
            labels = ((e.get("requestObject") or {}).get("metadata") or {}).get("labels") or {}
            if LABEL in labels:
                when = datetime.fromisoformat(str(e["stageTimestamp"]).replace("Z", "+00:00")).timestamp()
                found.append((when, str(labels[LABEL])))
        return found

    def label_patches(self) -> list[str]:
        """The workload label values the engine PATCHed onto omen2, in order (audit log)."""
        return [value for _, value in self._label_patch_events()]

    def timeline(self) -> list[str]:
        """The effects on omen2 in time order, from outside the engine: ``label=<value>`` for each label
        PATCH (the audit log's ResponseComplete time), ``swapoff`` and ``systemctl <verb> kubelet``
        (start, stop, restart) for each shim call (the call log's time, written when the command ended).
        Both clocks are this machine's: a node host is a namespace on it, not another machine."""
        items = [(when, f"label={value}") for when, value in self._label_patch_events()]
        for c in self._calls():
            if c["cmd"] == "swapoff":
                items.append((float(c["ts"]), "swapoff"))
            elif c["cmd"] == "systemctl" and c["argv"][:1] in (["start"], ["stop"], ["restart"]) \
                    and any(a in ("kubelet", "kubelet.service") for a in c["argv"]):
                items.append((float(c["ts"]), f"systemctl {c['argv'][0]} kubelet"))
        return [what for _, what in sorted(items)]

    def _calls(self) -> list[dict[str, Any]]:
        return self.host.calls()[self._calls_mark:]

    def swapoffs(self) -> int:
        return sum(1 for c in self._calls() if c["cmd"] == "swapoff")

    def kubelet_restarts(self) -> int:
        return sum(1 for c in self._calls() if c["cmd"] == "systemctl" and c["argv"][:1] == ["restart"]
                   and any(a in ("kubelet", "kubelet.service") for a in c["argv"]))

    def cuda_jobs(self) -> tuple[int, int]:
        """(host CUDA jobs running, host CUDA jobs killed since the lab's reset) on omen2, from its state."""
        state = self.host.read()
        return len(state.get("cuda_jobs") or []), int(state.get("cuda_jobs_killed", 0))

    def counts(self) -> dict[str, int]:
        return {"label": len(self.label_patches()), "swapoff": self.swapoffs(), "restart": self.kubelet_restarts()}


def stop_kubelet(lab: Any, node: str = NODE) -> None:
    """What ``systemctl stop kubelet`` does to the lab host's state: no automatic restarts any more."""
    host = HostState(lab.lab.record()["nodes"][node]["state_dir"])

    def change(state: dict[str, Any]) -> None:
        unit = state["units"]["kubelet"]
        unit.update(active="inactive", sub="dead", desired="stopped", since=time.time(), result="success")
        unit.pop("next_restart_at", None)

    host.update(change)


def lease_holder(lab: Any, namespace: str = "kube-system") -> str | None:
    """The holder of omen2's remediation Lease, or None when there is none (``namespace``: where
    Leases live; the store namespace in cluster mode, ``Settings.lease_namespace``)."""
    done = subprocess.run(["kubectl", "get", "lease", "-n", namespace, LEASE, "-o",
                           "jsonpath={.spec.holderIdentity}"], env=lab.env(), capture_output=True, text=True,
                          timeout=30, check=False)
    if done.returncode != 0:
        assert "NotFound" in done.stderr or "not found" in done.stderr, done.stderr
        return None
    return done.stdout.strip() or None


def node_label(lab: Any) -> str | None:
    done = subprocess.run(["kubectl", "get", "node", NODE, "-o", "json"], env=lab.env(), capture_output=True,
                          text=True, timeout=30, check=True)
    return json.loads(done.stdout)["metadata"].get("labels", {}).get(LABEL)


def inventory_without_become_passwords(lab: Any, path: Path, **host_vars: Any) -> Path:
    """A copy of the lab's inventory with no ``ansible_become_password``: the password must come from
    the engine (environment, file or prompt). ``host_vars`` override omen2's variables."""
    import yaml

    data = yaml.safe_load(Path(lab.lab.record()["inventory"]).read_text())
    for host in data["all"]["hosts"].values():
        host.pop("ansible_become_password", None)
    data["all"]["hosts"][NODE].update(host_vars)
    path.write_text(yaml.safe_dump(data))
    return path
