"""A real Alertmanager (Debian's prometheus-alertmanager) pages ``runbook serve`` over loopback.

Alertmanager is started by the test with a webhook receiver whose ``http_config.authorization``
carries the server's token (it arrives as ``Authorization: Bearer <token>``); the server runs under
uvicorn in a thread with the fake starter. An alert posted to Alertmanager's ``/api/v2/alerts`` the
way Prometheus posts it must arrive as a real v4 webhook and submit the run (what the run does is
proven on the lab, test_serve_lab.py). Every address is
127.0.0.1 with ports chosen at run time; gossip is off (``--cluster.listen-address=``).
Skipped only when the binary is missing outside CI; in CI (``CI=true``) a missing binary fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from engine.lab.ports import free_port
from engine.lab.procs import ProcessRef, die_with_parent, reap_child, stop_processes
from engine.serve.app import create_app
from engine.serve.config import load_config
from engine.serve.notify import Notifier
from tests.fakes import INCIDENT_NODES, FakeRunStarter, StaticClusterView, trigger_spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
TOKEN = "am-integration-token"
BINARY = shutil.which("prometheus-alertmanager") or (
    "/usr/bin/prometheus-alertmanager" if Path("/usr/bin/prometheus-alertmanager").exists() else None)


def _require_binary() -> str:
    if BINARY is None:
        if os.environ.get("CI") == "true":
            pytest.fail("prometheus-alertmanager is missing (apt-get install prometheus-alertmanager)")
        pytest.skip("prometheus-alertmanager is not installed")
    return BINARY


class HeaderRecorder:
    """ASGI middleware: remember the Authorization header of every webhook delivery."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: list[tuple[str, str]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/hooks/alertmanager":
            headers = dict(scope["headers"])
            self.seen.append((scope["path"], headers.get(b"authorization", b"").decode()))
        await self.app(scope, receive, send)


@dataclass
class Server:
    url: str
    starter: FakeRunStarter
    recorder: HeaderRecorder


@pytest.fixture
def runbook_server() -> Iterator[Server]:
    port = free_port("127.0.0.1")
    config = load_config(None, env={"RUNBOOK_WEBHOOK_TOKEN": TOKEN}, overrides={"listen": f"127.0.0.1:{port}"})
    starter = FakeRunStarter([trigger_spec(mode="auto", matchers=('node=~"omen.*"',))])
    app = create_app(config, starter, cluster=StaticClusterView(INCIDENT_NODES), notifier=Notifier(None),
                     sweep_interval=0)
    recorder = HeaderRecorder(app)
    server = uvicorn.Server(uvicorn.Config(recorder, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, name="runbook-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield Server(f"http://127.0.0.1:{port}", starter, recorder)
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture
def alertmanager(tmp_path: Path, runbook_server: Server, request: pytest.FixtureRequest) -> Iterator[str]:
    binary = _require_binary()
    credentials = getattr(request, "param", TOKEN)
    port = free_port("127.0.0.1")
    config = tmp_path / "am.yml"
    config.write_text(f"""\
route:
  receiver: runbook
  group_by: [alertname, node]
  group_wait: 1s
  group_interval: 5s
  repeat_interval: 1h
receivers:
- name: runbook
  webhook_configs:
  - url: {runbook_server.url}/hooks/alertmanager
    send_resolved: true
    http_config:
      authorization:
        credentials: {credentials}
""")
    log = (tmp_path / "alertmanager.log").open("wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=", "--log.level=debug"],
        stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    ref = ProcessRef.of(proc.pid)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{base}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (tmp_path / "alertmanager.log").read_text()
            assert time.monotonic() < deadline, "alertmanager did not become ready"
            time.sleep(0.1)
        yield base
    finally:
        stop_processes([ref], timeout=10, reap=reap_child)
        proc.wait(5)
        log.close()


def _fire(am: str, node: str) -> None:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    r = httpx.post(f"{am}/api/v2/alerts", json=[{
        "labels": {"alertname": "KubeNodeNotReady", "node": node, "condition": "Ready", "status": "true",
                   "severity": "warning", "job": "kube-state-metrics"},
        "annotations": {"summary": f"{node} has been unready for more than 15 minutes."},
        "startsAt": now, "generatorURL": "http://127.0.0.1:9/graph"}], timeout=5)
    assert r.status_code == 200, r.text


def test_an_alert_posted_to_a_real_alertmanager_arrives_with_bearer_credentials_and_submits_the_run(
        runbook_server: Server, alertmanager: str) -> None:
    _fire(alertmanager, "omen2")
    assert runbook_server.starter.wait_until(lambda s: len(s.requests) >= 1, timeout=30), \
        "no webhook reached runbook serve"
    (req,) = runbook_server.starter.requests
    assert (req.runbook, dict(req.params), req.node, req.mode, req.source) == (
        "gpu-node-recovery", {"node": "omen2"}, "omen2", "auto", "alertmanager")
    assert "fingerprint" in req.reason and req.dedup_key  # Alertmanager's own fingerprint
    assert ("/hooks/alertmanager", f"Bearer {TOKEN}") in runbook_server.recorder.seen
    # what the run then does is the fake starter's, not proven here: test_serve_lab.py runs it for real
    metrics = httpx.get(f"{runbook_server.url}/metrics", timeout=5).text
    assert 'runbook_serve_webhook_requests_total{endpoint="alertmanager",outcome="started"} 1.0' in metrics


@pytest.mark.parametrize("alertmanager", ["not-the-token"], indirect=True)
def test_alertmanager_with_wrong_credentials_is_refused_and_starts_nothing(
        runbook_server: Server, alertmanager: str) -> None:
    _fire(alertmanager, "omen3")
    deadline = time.monotonic() + 15
    while not runbook_server.recorder.seen and time.monotonic() < deadline:
        time.sleep(0.1)
    assert runbook_server.recorder.seen, "alertmanager never delivered"
    assert runbook_server.recorder.seen[0][1] == "Bearer not-the-token"
    time.sleep(0.5)
    assert runbook_server.starter.requests == []
    metrics = httpx.get(f"{runbook_server.url}/metrics", timeout=5).text
    assert 'runbook_serve_webhook_requests_total{endpoint="alertmanager",outcome="unauthorized"}' in metrics
