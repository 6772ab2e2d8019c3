"""``runbook serve`` command line: options, the starter hook, loopback safety, breaker-reset."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from click.testing import CliRunner

from engine.errors import UsageError
from engine.lab.ports import free_port
from engine.serve import cli as serve_cli
from engine.serve.app import create_app
from engine.serve.cli import build_app, load_run_starter, serve_command, start_banner
from engine.serve.config import ServeConfig, load_config
from engine.serve.notify import Notifier
from engine.serve_starter import JournalRunStarter
from engine.settings import Settings
from tests.fakes import INCIDENT_NODES, FakeRunStarter, StaticClusterView, trigger_spec


@pytest.fixture
def fake_engine_app(monkeypatch: pytest.MonkeyPatch) -> list[ServeConfig]:
    """Stand in for the engine's starter (``load_run_starter``: the run service's adapter)."""
    seen: list[ServeConfig] = []

    def create_run_starter(settings: Settings, config: ServeConfig) -> FakeRunStarter:
        seen.append(config)
        return FakeRunStarter([trigger_spec()])

    monkeypatch.setattr(serve_cli, "load_run_starter", create_run_starter)
    return seen


def test_serve_is_a_runbook_command_with_its_options() -> None:
    from engine.cli import main

    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0, result.output
    out = result.output
    for option in ("--listen", "--config", "--journal", "--kubeconfig", "breaker-reset", "RUNBOOK_WEBHOOK_TOKEN"):
        assert option in out


def test_build_app_uses_the_engines_starter_and_keeps_breakers_beside_the_journal(
        tmp_path: Path, fake_engine_app: list[ServeConfig], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNBOOK_WEBHOOK_TOKEN", raising=False)
    settings = Settings(journal=tmp_path / "state" / "journal.sqlite")
    app, config = build_app(settings, None, "127.0.0.1:18080")
    assert config.listen == "127.0.0.1:18080"
    assert config.breaker.state_file == tmp_path / "state" / "serve-breaker.json"
    assert fake_engine_app[0].breaker.state_file == config.breaker.state_file
    assert app.state.dispatcher.index.describe()[0]["runbook"] == "gpu-node-recovery"


def test_listening_on_every_address_needs_the_allowed_host_names(
        tmp_path: Path, fake_engine_app: list[ServeConfig], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNBOOK_WEBHOOK_TOKEN", "a-sender-token-0123456789")
    settings = Settings(journal=tmp_path / "j.sqlite")
    with pytest.raises(UsageError, match=r"auth\.allowed_hosts"):
        build_app(settings, None, "0.0.0.0:8080")
    assert fake_engine_app == []  # refused before anything was built
    conf = tmp_path / "serve.yaml"
    conf.write_text("auth: {allowed_hosts: [runbook.example.org]}\n")
    build_app(settings, conf, "0.0.0.0:8080")  # built, not listening


def test_insecure_no_auth_is_refused_beyond_loopback_and_announced_loudly(
        tmp_path: Path, fake_engine_app: list[ServeConfig], monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(journal=tmp_path / "j.sqlite")
    conf = tmp_path / "serve.yaml"
    conf.write_text("auth: {allowed_hosts: [runbook.example.org]}\n")
    for listen in ("0.0.0.0:8080", "10.1.2.3:8080"):
        with pytest.raises(UsageError, match="--insecure-no-auth is refused"):
            build_app(settings, conf, listen, insecure_no_auth=True)
    conf.write_text("auth: {insecure_no_auth: true}\n")
    with pytest.raises(UsageError, match="only be set by the --insecure-no-auth option"):
        build_app(settings, conf, "127.0.0.1:8080")
    app, config = build_app(settings, None, "127.0.0.1:8080", insecure_no_auth=True)
    assert config.auth.insecure_no_auth
    banner = start_banner(config)
    assert banner is not None and "NO CREDENTIALS ARE CHECKED" in banner and "127.0.0.1:8080" in banner
    assert app.state.handlers.access.identify(None).name == "insecure-no-auth"


def test_the_servers_starter_is_the_run_service_and_its_runs_are_automatic(tmp_path: Path) -> None:
    starter = load_run_starter(Settings(journal=tmp_path / "j.sqlite"), ServeConfig())
    assert isinstance(starter, JournalRunStarter)
    assert starter.service.automatic  # no guard override can reach a paged run
    with pytest.raises(UsageError, match="for people"):
        starter.service.check_overrides({"exclusion": "the server tried"})


def test_a_bad_config_file_exits_2_with_the_file_named(tmp_path: Path, fake_engine_app: list[ServeConfig]) -> None:
    bad = tmp_path / "serve.yaml"
    bad.write_text("breaker: {max_auto_runs: many}\n")
    result = CliRunner().invoke(serve_command, ["--config", str(bad), "--journal", str(tmp_path / "j.sqlite")])
    assert result.exit_code == 2
    assert str(bad) in result.output and "breaker.max_auto_runs" in result.output


@pytest.fixture
def live_server() -> Iterator[tuple[str, Any]]:
    port = free_port("127.0.0.1")
    config = load_config(None, env={"RUNBOOK_WEBHOOK_TOKEN": "cli-sender-token-0123",
                                    "RUNBOOK_APPROVER_TOKEN_OPS": "cli-approver-token-0123"})
    app = create_app(config, FakeRunStarter([trigger_spec()]), cluster=StaticClusterView(INCIDENT_NODES),
                     notifier=Notifier(None), sweep_interval=0)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        yield f"127.0.0.1:{port}", app.state.dispatcher
    finally:
        server.should_exit = True
        thread.join(10)


def test_breaker_reset_closes_a_node_breaker_on_the_running_server(live_server: tuple[str, Any]) -> None:
    listen, dispatcher = live_server
    dispatcher.guards.finished("omen2", "r-1", state="failed", automatic=True)
    runner = CliRunner()
    refused = runner.invoke(serve_command, ["--listen", listen, "breaker-reset", "--node", "omen2"], env={
        "RUNBOOK_TOKEN": ""})
    assert refused.exit_code == 1 and "401" in refused.output
    sender = runner.invoke(serve_command, ["--listen", listen, "breaker-reset", "--node", "omen2"],
                           env={"RUNBOOK_TOKEN": "cli-sender-token-0123"})
    assert sender.exit_code == 1 and "403" in sender.output
    ok = runner.invoke(serve_command, ["--listen", listen, "breaker-reset", "--node", "omen2"],
                       env={"RUNBOOK_TOKEN": "cli-approver-token-0123"})
    assert ok.exit_code == 0, ok.output
    assert "reset: node:omen2" in ok.output
    assert list(dispatcher.guards.open_nodes()) == []


def test_auth_mode_kubernetes_asks_kubernetes_in_the_store_namespace_and_refuses_configured_approvers(
        tmp_path: Path, fake_engine_app: list[ServeConfig], monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RUNBOOK_WEBHOOK_TOKEN", "RUNBOOK_APPROVER_TOKEN_ALICE"):
        monkeypatch.delenv(var, raising=False)
    # the store namespace of the command (--store-namespace), not the environment of the process:
    # approve rights in one namespace never approve the runs stored in another (#25 item 5)
    monkeypatch.setenv("RUNBOOK_STORE_NAMESPACE", "runbook-system")
    settings = Settings(journal=tmp_path / "journal.sqlite", store_namespace="ops-runbook")
    conf = tmp_path / "serve.yaml"
    conf.write_text("auth: {mode: kubernetes}\n")
    app, _ = build_app(settings, conf, "127.0.0.1:8080")
    access = app.state.handlers.access
    assert access.kube is not None and access.kube.namespace == "ops-runbook"
    assert access.kube.audiences == ("runbook",)  # a token must be made for runbook (#25 item 7)
    assert access.roles_configured() == {"sender": 0, "approver": -1, "reader": -1}
    conf.write_text("auth: {mode: kubernetes, kubernetes: {namespace: ops-runbook, cache_seconds: 3, "
                    "api_server_audience: true}}\n")
    app, _ = build_app(settings, conf, "127.0.0.1:8080")
    kube = app.state.handlers.access.kube
    assert (kube.namespace, kube.cache_seconds, kube.audiences) == ("ops-runbook", 3.0, ())
    conf.write_text("auth: {mode: kubernetes, kubernetes: {namespace: runbook-system}}\n")
    with pytest.raises(UsageError, match=r"auth.kubernetes.namespace is runbook-system but the runs are stored "
                                         r"in namespace ops-runbook"):
        build_app(settings, conf, "127.0.0.1:8080")
    conf.write_text("auth: {mode: kubernetes, kubernetes: {namespace: ops-runbook, cache_seconds: 3}}\n")
    monkeypatch.setenv("RUNBOOK_APPROVER_TOKEN_ALICE", "0123456789abcdef-alice")
    with pytest.raises(UsageError, match=r"remove approvers\.alice"):
        build_app(settings, conf, "127.0.0.1:8080")
