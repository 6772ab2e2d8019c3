"""``runbook serve``: run the webhook server; ``runbook serve breaker-reset``: close a breaker.

Thin: options -> ``load_config`` -> ``create_app`` -> uvicorn. The run machinery is the run
service's adapter ``engine.serve_starter.JournalRunStarter`` (the ``RunStarter`` of
``engine.serve.starter``), imported plainly: the same road to the executor as the CLI's;
the cluster view reads through ``Settings.kube()``. Options shared with the other commands are
declared here again rather than imported from ``engine.cli``, which loads this module (no cycle).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import sys
from pathlib import Path
from typing import Any

import click

from engine.cli import settings_from, shared_options
from engine.errors import ExitCode, RunbookError, UsageError
from engine.serve.config import ServeConfig, load_config, split_listen
from engine.serve.starter import RunStarter
from engine.serve_starter import JournalRunStarter
from engine.settings import Settings


def load_run_starter(settings: Settings, config: ServeConfig) -> RunStarter:
    """The engine's ``RunStarter``: automatic runs through the run service, under the run guards
    of the server's configuration (never overridden)."""
    return JournalRunStarter(settings, guards=config.run_guards())


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_app(settings: Settings, config_file: Path | None, listen: str | None) -> tuple[Any, ServeConfig]:
    """The configured ASGI app and its configuration (nothing listens yet)."""
    from engine.serve.app import create_app
    from engine.serve.cluster import KubeClusterView

    config = load_config(config_file, overrides={"listen": listen} if listen else None)
    if config.breaker.state_file is None:
        journal = settings.journal
        if journal is None:
            from engine.journal import default_journal_path

            journal = default_journal_path()
        state = Path(journal).parent / "serve-breaker.json"
        config = config.model_copy(update={"breaker": config.breaker.model_copy(update={"state_file": state})})
    host, _ = split_listen(config.listen)
    if not _is_loopback(host) and not config.webhook_token:
        raise UsageError(f"refusing to listen on {host} without RUNBOOK_WEBHOOK_TOKEN: anyone could start runs")
    starter = load_run_starter(settings, config)
    cluster = KubeClusterView(settings.kube, config.run_guards(), ttl=config.cluster_cache_ttl)
    return create_app(config, starter, cluster=cluster), config


def serve(settings: Settings, config_file: Path | None, listen: str | None) -> int:
    """Load the configuration, build the app and serve until SIGINT/SIGTERM."""
    import uvicorn

    app, config = build_app(settings, config_file, listen)
    host, port = split_listen(config.listen)
    logging.basicConfig(level=logging.DEBUG if settings.debug else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from uvicorn.config import LOGGING_CONFIG

    from engine.logformat import current_format

    # json: uvicorn's own lines go through the root logger's JSON handler too
    log_config = None if current_format() == "json" else LOGGING_CONFIG
    uvicorn.run(app, host=host, port=port, log_level="debug" if settings.debug else "info", log_config=log_config,
                lifespan="on", timeout_graceful_shutdown=int(config.shutdown_grace) + 5)
    return 0


def _fail(e: RunbookError, debug: bool) -> None:
    if debug:
        raise e
    for line in str(e).splitlines() or [type(e).__name__]:
        click.echo(line, err=True)
    sys.exit(e.exit_code)


@click.group("serve", invoke_without_command=True)
@click.option("--listen", default=None, metavar="HOST:PORT",
              help="Address to listen on (default from the config, else 127.0.0.1:8080).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, exists=True),
              envvar="RUNBOOK_SERVE_CONFIG", help="Serve configuration YAML (env RUNBOOK_SERVE_CONFIG).")
@shared_options
@click.pass_context
def serve_command(ctx: click.Context, listen: str | None, config_file: str | None, **opts: Any) -> None:
    """Receive Alertmanager and PagerDuty webhooks and start runbooks inside strict guards.

    \b
    Secrets come from the environment: RUNBOOK_WEBHOOK_TOKEN (Bearer token for
    /hooks/alertmanager, approvals and breaker resets), RUNBOOK_PAGERDUTY_SECRET.
    See docs/serve.md for the configuration file, guards and breaker.
    """
    ctx.ensure_object(dict)
    ctx.obj["config_file"] = Path(config_file) if config_file else None
    ctx.obj["listen"] = listen
    if ctx.invoked_subcommand is not None:
        return
    settings = settings_from(opts)
    try:
        code = serve(settings, ctx.obj["config_file"], listen)
    except RunbookError as e:
        _fail(e, settings.debug)
        return
    sys.exit(code)


@serve_command.command("breaker-reset")
@click.option("--node", help="Close the breaker of this node (after a failed automatic run).")
@click.option("--runbook", help="Clear this runbook's automatic-run window.")
@click.option("--url", help="Server base URL (default: http://<listen>).")
@click.pass_context
def breaker_reset(ctx: click.Context, node: str | None, runbook: str | None, url: str | None) -> None:
    """Close breakers on a running server (all of them when neither --node nor --runbook is given)."""
    import httpx

    try:
        config = load_config(ctx.obj.get("config_file"),
                             overrides={"listen": ctx.obj["listen"]} if ctx.obj.get("listen") else None)
    except RunbookError as e:
        _fail(e, False)
        return
    host, port = split_listen(config.listen)
    base = url or f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
    headers = {"Authorization": f"Bearer {config.webhook_token}"} if config.webhook_token else {}
    body = {k: v for k, v in (("node", node), ("runbook", runbook)) if v}
    try:
        resp = httpx.post(base.rstrip("/") + "/breaker/reset", json=body, headers=headers, timeout=10)
    except httpx.HTTPError as e:
        click.echo(f"cannot reach {base}: {e}", err=True)
        sys.exit(ExitCode.FAILED)
    if resp.status_code != 200:
        click.echo(f"{base}: HTTP {resp.status_code}: {resp.text.strip()}", err=True)
        sys.exit(ExitCode.FAILED)
    done = resp.json().get("reset") or []
    click.echo("reset: " + (", ".join(done) if done else "nothing was open"))
    sys.exit(os.EX_OK)
