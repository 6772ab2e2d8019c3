"""Helpers for the end-to-end tests of ``runbook serve`` on the lab (imported as ``serve_helpers``).

* ``serving(...)``: ``runbook serve`` as a real subprocess (its own journal, config file, sender
  token, approver tokens for ``alice`` and ``bob``, and port on 127.0.0.1), ready once
  ``/healthz`` answers; on exit it is stopped with SIGTERM, then SIGKILL, and so is every process
  it started (ansible-playbook and ssh of a run).
* ``alertmanager(...)``: Debian's ``prometheus-alertmanager`` on loopback, gossip off, with a webhook
  receiver that sends ``Authorization: Bearer <token>`` to the server.
* small probes: a run's state, omen2 as the API shows it, ``runbook lab status -o json``.

Every loop here has a deadline; nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from engine.lab.ports import free_port
from engine.lab.procs import ProcessRef, die_with_parent, reap_child, stop_processes

REPO = Path(__file__).resolve().parents[3]
TOKEN = "lab-serve-token-7f3a"  # the Alertmanager sender's credential
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Approvers: the identity bound to the token is what the journal records as approved_by.
APPROVERS = {"alice": "lab-approver-alice-5d1e", "bob": "lab-approver-bob-0c47"}
PD_SECRET = "lab-pagerduty-secret-91c2"
FINAL = ("succeeded", "failed", "blocked", "cancelled")
# Test servers give running runs little time on SIGTERM (nothing should be running when they stop).
BASE_CONFIG: dict[str, Any] = {"shutdown_grace": "5s"}
_ENV_DROPPED = ("RUNBOOK_SERVE_CONFIG", "RUNBOOK_SERVE_FORCE_MODE", "RUNBOOK_NOTIFY_URL",
                "RUNBOOK_WEBHOOK_TOKEN", "RUNBOOK_PAGERDUTY_SECRET", "RUNBOOK_JOURNAL", "RUNBOOK_TOKEN")
_ENV_DROPPED_PREFIXES = ("RUNBOOK_SENDER_TOKEN_", "RUNBOOK_APPROVER_TOKEN_", "RUNBOOK_READER_TOKEN_")


def runbook_command() -> list[str]:
    """The installed ``runbook`` script of this interpreter, else ``python -m engine``."""
    beside = Path(sys.executable).with_name("runbook")
    if beside.exists():
        return [str(beside)]
    return [sys.executable, "-m", "engine"]


def descendants(pid: int) -> list[ProcessRef]:
    """Every live process below ``pid`` (children, grandchildren...), as refs safe against PID reuse."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[ProcessRef] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        ref = ProcessRef.of(child)
        if ref.start_time != -1:
            found.append(ref)
        todo.extend(children.get(child, []))
    return found


@dataclass
class Server:
    """A running ``runbook serve`` subprocess."""

    url: str
    port: int
    proc: subprocess.Popen[bytes]
    ref: ProcessRef
    log_path: Path
    journal: Path
    leftovers: list[ProcessRef] = field(default_factory=list)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10, **kw)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.post(self.url + path, timeout=10, **kw)

    def alert(self, payload: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> httpx.Response:
        return self.post("/hooks/alertmanager", json=dict(payload), headers=dict(AUTH if headers is None else headers))

    def runs(self) -> list[dict[str, Any]]:
        r = self.get("/runs")
        assert r.status_code == 200, r.text
        runs: list[dict[str, Any]] = r.json()
        return runs

    def run(self, run_id: str) -> dict[str, Any]:
        r = self.get(f"/runs/{run_id}")
        assert r.status_code == 200, r.text
        run: dict[str, Any] = r.json()
        return run

    def approve(self, run_id: str, digest: str, by: str = "alice") -> httpx.Response:
        """Approve as ``by``: with that approver's credential (its identity is what gets recorded)."""
        return self.post(f"/runs/{run_id}/approve", json={"plan_digest": digest},
                         headers={"Authorization": f"Bearer {APPROVERS[by]}"})

    def wait_state(self, run_id: str, states: tuple[str, ...], timeout: float) -> dict[str, Any]:
        """Poll ``GET /runs/{id}`` until its state is one of ``states``; fail early on another final state."""
        deadline = time.monotonic() + timeout
        while True:
            run = self.run(run_id)
            if run["state"] in states:
                return run
            if run["state"] in FINAL or time.monotonic() > deadline:
                events = [f"{e['kind']} {e.get('step') or ''} {e.get('reason') or e.get('error') or ''}".strip()
                          for e in run.get("events", [])][-15:]
                raise AssertionError(
                    f"run {run_id} is {run['state']} ({run.get('outcome_reason', '')}), expected {states}; "
                    f"events: {events}\nserver log:\n{self.log_tail()}")
            assert self.proc.poll() is None, f"runbook serve exited {self.proc.returncode}:\n{self.log_tail()}"
            time.sleep(0.5)

    def wait_runs(self, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float,
                  what: str) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            runs = self.runs()
            if predicate(runs):
                return runs
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; runs: {runs}\nserver log:\n{self.log_tail()}")
            time.sleep(0.3)

    def stop(self, timeout: float = 20.0) -> list[ProcessRef]:
        """SIGTERM (the server drains for ``shutdown_grace``), SIGKILL after ``timeout``; then stop
        whatever it started that outlived it. Returns those leftovers (empty after a clean stop)."""
        seen: set[ProcessRef] = set()
        if self.proc.poll() is None:
            seen.update(descendants(self.proc.pid))
            self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                seen.update(descendants(self.proc.pid))  # children started while it drains
                time.sleep(0.05)
            if self.proc.poll() is None:
                seen.update(descendants(self.proc.pid))
                self.proc.kill()
            self.proc.wait(10)
        # Why: a run's ansible-playbook calls setsid; a server stopped mid-run would leave it behind.
        leftovers = [r for r in seen if r.alive()]
        stop_processes(leftovers, timeout=5, reap=reap_child)
        self.leftovers = leftovers
        return leftovers

    def stopped_cleanly(self) -> bool:
        """uvicorn drains, then re-raises the SIGTERM it caught: exit 0 or "killed by SIGTERM"."""
        return self.proc.returncode in (0, -signal.SIGTERM) and "Application shutdown complete" in self.log_tail(200)


def write_config(path: Path, config: Mapping[str, Any]) -> Path:
    path.write_text(yaml.safe_dump({**BASE_CONFIG, **dict(config)}, sort_keys=True))
    return path


@contextmanager
def serving(env: Mapping[str, str], workdir: Path, config: Mapping[str, Any] | None = None, *,
            journal: Path | None = None, name: str = "serve", pd_secret: str | None = None,
            token: str | None = TOKEN, timeout: float = 90.0,
            runbooks_dir: Path | None = None) -> Iterator[Server]:
    """``runbook serve --listen 127.0.0.1:PORT --config CFG`` with the lab's environment; stopped on exit.
    ``runbooks_dir``: another runbooks folder (default: the repository's; its playbooks beside it)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = write_config(workdir / f"{name}.yaml", config or {})
    journal = journal or workdir / "journal.sqlite"
    port = free_port("127.0.0.1")
    child_env = {k: v for k, v in env.items()
                 if k not in _ENV_DROPPED and not k.startswith(_ENV_DROPPED_PREFIXES)}
    child_env["RUNBOOK_JOURNAL"] = str(journal)
    if token:
        child_env["RUNBOOK_WEBHOOK_TOKEN"] = token
    for approver, secret in APPROVERS.items():
        child_env[f"RUNBOOK_APPROVER_TOKEN_{approver.upper()}"] = secret
    if pd_secret:
        child_env["RUNBOOK_PAGERDUTY_SECRET"] = pd_secret
    log_path = workdir / f"{name}.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [*runbook_command(), "serve", "--listen", f"127.0.0.1:{port}", "--config", str(cfg),
             "--runbooks-dir", str(runbooks_dir or REPO / "runbooks")],
            cwd=REPO, env=child_env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent)
    server = Server(f"http://127.0.0.1:{port}", port, proc, ProcessRef.of(proc.pid), log_path, journal)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"runbook serve exited {proc.returncode} at start:\n{server.log_tail()}")
            try:
                if httpx.get(server.url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"runbook serve did not answer /healthz in {timeout:.0f} s:\n{server.log_tail()}")
            time.sleep(0.1)
        yield server
    finally:
        server.stop()


# -- the real Alertmanager ----------------------------------------------------------------------------


def alertmanager_binary() -> str:
    """Debian's prometheus-alertmanager; skip when missing, unless CI=true (then fail)."""
    found = shutil.which("prometheus-alertmanager") or (
        "/usr/bin/prometheus-alertmanager" if Path("/usr/bin/prometheus-alertmanager").exists() else None)
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("prometheus-alertmanager is missing (apt-get install prometheus-alertmanager)")
        pytest.skip("prometheus-alertmanager is not installed")
    return found


@contextmanager
def alertmanager(workdir: Path, serve_url: str, token: str = TOKEN, timeout: float = 20.0) -> Iterator[str]:
    """A real Alertmanager whose only receiver is ``serve_url``'s webhook; yields its base URL."""
    binary = alertmanager_binary()
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port("127.0.0.1")
    config = workdir / "am.yml"
    config.write_text(yaml.safe_dump({
        "route": {"receiver": "runbook", "group_by": ["alertname", "node"], "group_wait": "1s",
                  "group_interval": "5s", "repeat_interval": "1h"},
        "receivers": [{"name": "runbook", "webhook_configs": [{
            "url": f"{serve_url}/hooks/alertmanager", "send_resolved": True,
            "http_config": {"authorization": {"credentials": token}}}]}],
    }))
    log_path = workdir / "alertmanager.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.path={workdir / 'am-data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=", "--log.level=debug"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    ref = ProcessRef.of(proc.pid)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{base}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() < deadline, "alertmanager did not become ready"
            time.sleep(0.1)
        yield base
    finally:
        stop_processes([ref], timeout=10, reap=reap_child)
        proc.wait(5)


def fire(am_url: str, node: str, alertname: str = "KubeNodeNotReady") -> None:
    """Post a firing alert to Alertmanager the way Prometheus does (``POST /api/v2/alerts``)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    r = httpx.post(f"{am_url}/api/v2/alerts", json=[{
        "labels": {"alertname": alertname, "node": node, "condition": "Ready", "status": "true",
                   "severity": "warning", "job": "kube-state-metrics"},
        "annotations": {"summary": f"{node} has been unready for more than 15 minutes."},
        "startsAt": now, "generatorURL": "http://127.0.0.1:9/graph"}], timeout=5)
    assert r.status_code == 200, r.text


# -- what the lab shows ---------------------------------------------------------------------------------


def lab_status_all(sh: Callable[..., Any]) -> list[dict[str, Any]]:
    """``runbook lab status -o json``'s nodes."""
    nodes: list[dict[str, Any]] = json.loads(sh("runbook lab status -o json", check=True).stdout)["nodes"]
    return nodes


def lab_status(sh: Callable[..., Any], node: str = "omen2") -> dict[str, Any]:
    """``runbook lab status -o json``'s entry for ``node``."""
    return next(n for n in lab_status_all(sh) if n["name"] == node)


def node_json(sh: Callable[..., Any], node: str = "omen2") -> dict[str, Any]:
    obj: dict[str, Any] = json.loads(sh(f"kubectl get node {node} -o json", check=True).stdout)
    return obj


def ready_status(obj: Mapping[str, Any]) -> str | None:
    for c in obj.get("status", {}).get("conditions", []):
        if c.get("type") == "Ready":
            return str(c.get("status"))
    return None


def start_replica(kubeconfig: Path, workdir: Path, host: str, *, config: Mapping[str, Any], namespace: str,
                  token: str, runbooks_dir: Path, timeout: float = 60) -> Server:
    """``runbook serve --store kubernetes`` in a UTS namespace of its own with the host name ``host``
    (as a pod of its own: the run owner and the replica's liveness Lease name it), ready (``/readyz``
    200); an ``AssertionError`` with its log when it exits or is not ready within ``timeout``."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare --uts (root): each replica has its own host name")
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "serve.yaml").write_text(yaml.safe_dump(dict(config)))
    port = free_port("127.0.0.1")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNBOOK_")}
    env.update(HOME=str(workdir), KUBECONFIG=str(kubeconfig), RUNBOOK_STORE="kubernetes",
               RUNBOOK_STORE_NAMESPACE=namespace, RUNBOOK_JOURNAL=str(workdir / "journal.sqlite"),
               RUNBOOK_WEBHOOK_TOKEN=token, RUNBOOK_RUNBOOKS_DIR=str(runbooks_dir))
    log_path = workdir / "serve.log"
    with log_path.open("ab") as log:
        # unshare and sh exec: the pid is the server's own (SIGKILL reaches it, nothing else)
        proc = subprocess.Popen(
            ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host,
             *runbook_command(), "serve", "--listen", f"127.0.0.1:{port}", "--config", str(workdir / "serve.yaml")],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent)
    server = Server(f"http://127.0.0.1:{port}", port, proc, ProcessRef.of(proc.pid), log_path, workdir)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"runbook serve ({host}) exited {proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(server.url + "/readyz", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"runbook serve ({host}) not ready:\n{server.log_tail()}"
        time.sleep(0.1)


def replica_role(server: Server) -> str:
    """``leader`` or ``follower``, as the replica's ``/readyz`` says."""
    return str(httpx.get(server.url + "/readyz", timeout=5).json().get("role"))


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, seen: Callable[[], Any] | None = None) -> None:
    """Poll ``predicate`` every 0.2 s; an ``AssertionError`` naming ``what`` (and ``seen()``) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out: {what}" + (f": {seen()}" if seen else "")
        time.sleep(0.2)
