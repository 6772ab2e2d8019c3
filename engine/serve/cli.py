"""``runbook serve``: run the webhook server; ``runbook serve breaker-reset``: close a breaker.

Thin: options -> ``load_config`` -> ``create_app`` -> uvicorn. The run machinery is the run
service's adapter ``engine.serve_starter.JournalRunStarter`` (the ``RunStarter`` of
``engine.serve.starter``), imported plainly: the same road to the executor as the CLI's;
the cluster view reads through ``Settings.kube()``. Options shared with the other commands are
declared here again rather than imported from ``engine.cli``, which loads this module (no cycle).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import click

from engine.cli import settings_from, shared_options
from engine.errors import ExitCode, RunbookError, UsageError
from engine.serve.access import Access, is_loopback
from engine.serve.config import ServeConfig, load_config, split_listen
from engine.serve.kube_identity import KubeIdentity
from engine.serve.starter import RunStarter
from engine.serve_starter import JournalRunStarter
from engine.settings import Settings


def load_run_starter(settings: Settings, config: ServeConfig) -> RunStarter:
    """The engine's ``RunStarter``: automatic runs through the run service, under the run guards
    of the server's configuration (never overridden). Replicas sharing a store (``--store
    kubernetes``) share the webhook dedup through it."""
    shared = config.dedup.fingerprint_window if settings.cluster_mode else None
    settings._cache["approvals"] = config.approvals  # the serve configuration's approval policy
    return JournalRunStarter(settings, guards=config.run_guards(), shared_dedup_window=shared)


INSECURE_BANNER = """\
**********************************************************************
*  runbook serve --insecure-no-auth: NO CREDENTIALS ARE CHECKED.      *
*  Anyone who can reach {listen:<44}*
*  can start runs, approve them and reset breakers. Local experiments *
*  only; never on a machine that can reach production nodes.          *
**********************************************************************"""


def build_app(settings: Settings, config_file: Path | None, listen: str | None, *,
              insecure_no_auth: bool = False) -> tuple[Any, ServeConfig]:
    """The configured ASGI app and its configuration (nothing listens yet)."""
    from engine.serve.app import create_app
    from engine.serve.cluster import KubeClusterView

    config = load_config(config_file, overrides={"listen": listen} if listen else None)
    if config.auth.insecure_no_auth and not insecure_no_auth:
        raise UsageError("auth.insecure_no_auth can only be set by the --insecure-no-auth option")
    if insecure_no_auth:
        config = config.model_copy(update={"auth": config.auth.model_copy(update={"insecure_no_auth": True})})
    if config.breaker.state_file is None:
        journal = settings.journal
        if journal is None:
            from engine.journal import default_journal_path

            journal = default_journal_path()
        state = Path(journal).parent / "serve-breaker.json"
        config = config.model_copy(update={"breaker": config.breaker.model_copy(update={"state_file": state})})
    host, _ = split_listen(config.listen)
    if not is_loopback(host):
        if insecure_no_auth:
            raise UsageError(f"--insecure-no-auth is refused on {host}: only on a loopback address (127.0.0.1, ::1)")
        if host in ("0.0.0.0", "::", "") and not config.auth.allowed_hosts:
            raise UsageError(f"listening on {host or 'every address'} needs auth.allowed_hosts: the names "
                             "clients use to reach this server (requests for any other Host are refused)")
    if settings.cluster_mode and config.console.live_poll_seconds is None:
        # each read of a followed run is an API request: once a second, not ten times
        config = config.model_copy(update={"console": config.console.model_copy(update={"live_poll_seconds": 1.0})})
    starter = load_run_starter(settings, config)
    cluster = KubeClusterView(settings.kube, config.run_guards(), ttl=config.cluster_cache_ttl,
                              refresh=config.cluster_refresh)
    identity = kube_identity(settings, config)
    if not settings.cluster_mode:
        return create_app(config, starter, cluster=cluster, identity=identity, kube=settings.kube), config
    from engine.serve.leader import LeaderElector

    # Replicas share the store: one of them (the Lease's holder) does the singleton duties, at
    # least once per Lease duration, so an orphaned run is resumed within two Lease durations.
    # Each replica also holds its liveness Lease, so the leader adopts the queue of one that dies.
    elector = LeaderElector(settings.kube, namespace=settings.store_namespace, ttl=config.replicas.lease_duration,
                            replica_lease=True)
    return create_app(config, starter, cluster=cluster, identity=identity, elector=elector, kube=settings.kube,
                      sweep_interval=min(30.0, float(config.replicas.lease_duration))), config


def review_namespace(settings: Settings, config: ServeConfig) -> str:
    """Where SubjectAccessReviews ask about ``remediationruns``: the store's namespace
    (``--store-namespace`` / ``RUNBOOK_STORE_NAMESPACE``), so approve rights in one namespace never
    approve runs stored in another. ``auth.kubernetes.namespace``, when given, must name it too."""
    store_ns = settings.store_namespace
    given = config.auth.kubernetes.namespace
    if given is not None and given != store_ns:
        raise UsageError(f"auth.kubernetes.namespace is {given} but the runs are stored in namespace {store_ns} "
                         "(--store-namespace / RUNBOOK_STORE_NAMESPACE): approve rights are asked where the runs "
                         "are; remove auth.kubernetes.namespace or make both the same")
    return store_ns


def kube_identity(settings: Settings, config: ServeConfig) -> KubeIdentity | None:
    """The Kubernetes identity backend when ``auth.mode`` is ``kubernetes`` (None otherwise): reviews
    through the same connector as the cluster view, roles in the store namespace
    (``review_namespace``), tokens made for ``auth.kubernetes.audiences`` (or the API server's own with
    ``api_server_audience``)."""
    if config.auth.mode != "kubernetes":
        return None
    namespace = review_namespace(settings, config)
    from engine.connectors.kube import KubeConnector

    def reviews() -> KubeConnector:
        kube = settings.kube()
        if not isinstance(kube, KubeConnector):
            raise UsageError("auth.mode kubernetes needs the Kubernetes API connector")
        return kube

    k = config.auth.kubernetes
    return KubeIdentity(reviews, namespace, cache_seconds=k.cache_seconds,
                        audiences=() if k.api_server_audience else k.audiences)


def uvicorn_options(config: ServeConfig) -> dict[str, Any]:
    """The connection limits of ``config.limits`` as uvicorn options (shared with the tests and bench)."""
    from engine.serve.http import header_timeout_protocol

    lim = config.limits
    return {"limit_concurrency": lim.max_connections, "timeout_keep_alive": max(1, int(lim.keep_alive)),
            "h11_max_incomplete_event_size": 16 * 1024, "http": header_timeout_protocol(lim.header_timeout),
            "timeout_graceful_shutdown": int(config.shutdown_grace) + 5, "access_log": config.access_log}


def start_banner(config: ServeConfig) -> str | None:
    """The warning printed at start when no credential is checked (``--insecure-no-auth``)."""
    return INSECURE_BANNER.format(listen=config.listen + " ") if config.auth.insecure_no_auth else None


def serve(settings: Settings, config_file: Path | None, listen: str | None, *, insecure_no_auth: bool = False) -> int:
    """Load the configuration, build the app and serve until SIGINT/SIGTERM."""
    import uvicorn

    app, config = build_app(settings, config_file, listen, insecure_no_auth=insecure_no_auth)
    host, port = split_listen(config.listen)
    logging.basicConfig(level=logging.DEBUG if settings.debug else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    banner = start_banner(config)
    if banner is not None:
        click.echo(banner, err=True)
    else:
        roles = Access(config, kube=kube_identity(settings, config)).roles_configured()
        missing = [r for r, n in roles.items() if not n]
        if missing:
            logging.getLogger(__name__).warning(
                "no %s credential configured: those requests are all refused (401)", "/".join(missing))
    from uvicorn.config import LOGGING_CONFIG

    from engine.logformat import current_format

    # json: uvicorn's own lines go through the root logger's JSON handler too
    log_config = None if current_format() == "json" else LOGGING_CONFIG
    uvicorn.run(app, host=host, port=port, log_level="debug" if settings.debug else "info", log_config=log_config,
                lifespan="on", **uvicorn_options(config))
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
@click.option("--insecure-no-auth", is_flag=True,
              help="Check no credential at all (local experiments only; refused beyond loopback).")
@shared_options
@click.pass_context
def serve_command(ctx: click.Context, listen: str | None, config_file: str | None, insecure_no_auth: bool,
                  **opts: Any) -> None:
    """Receive Alertmanager and PagerDuty webhooks and start runbooks inside strict guards.

    \b
    Credentials (at least 16 bytes each) come from the configuration's auth
    section or the environment: RUNBOOK_WEBHOOK_TOKEN (the Alertmanager sender),
    RUNBOOK_APPROVER_TOKEN_<NAME> (an approver, recorded as <name>),
    RUNBOOK_READER_TOKEN_<NAME>, RUNBOOK_PAGERDUTY_SECRET.
    See docs/serve.md for the configuration file, guards and breaker.
    """
    ctx.ensure_object(dict)
    ctx.obj["config_file"] = Path(config_file) if config_file else None
    ctx.obj["listen"] = listen
    if ctx.invoked_subcommand is not None:
        return
    settings = settings_from(opts)
    try:
        code = serve(settings, ctx.obj["config_file"], listen, insecure_no_auth=insecure_no_auth)
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
    """Close breakers on a running server (all of them when neither --node nor --runbook is given).

    Presents the approver token in RUNBOOK_TOKEN (a sender's token may not reset breakers)."""
    import httpx

    try:
        config = load_config(ctx.obj.get("config_file"),
                             overrides={"listen": ctx.obj["listen"]} if ctx.obj.get("listen") else None)
    except RunbookError as e:
        _fail(e, False)
        return
    host, port = split_listen(config.listen)
    base = url or f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
    token = os.environ.get("RUNBOOK_TOKEN", "")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
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
