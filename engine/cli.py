"""The ``runbook`` command: a thin layer of options over library functions.

Each command parses its options and calls one function of ``engine.app`` (or
``engine.lab.labcli`` / ``engine.serve``). Heavy imports happen inside commands so that
``runbook --help`` stays fast. Errors print as one line (``PATH:LINE: message`` for files)
and map to the exit codes in ``engine.errors.ExitCode``; tracebacks only with ``--debug``.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click

from engine.errors import ExitCode, RunbookError
from engine.settings import DEFAULT_STORE, DEFAULT_STORE_NAMESPACE, STORES, Settings

if TYPE_CHECKING:
    from engine.store import RunStore

F = TypeVar("F", bound=Callable[..., Any])

OUTPUT = click.Choice(["text", "json", "yaml"])
OUTPUT_MD = click.Choice(["text", "json", "yaml", "markdown"])
OUTPUT_WIDE = click.Choice(["text", "wide", "json", "yaml"])


# -- completion of names: runbooks, nodes (from the API, briefly), run ids ------------------------


def _settings_for_completion(ctx: click.Context) -> Settings:
    p = ctx.params
    return Settings(kubeconfig=p.get("kubeconfig"), context=p.get("kube_context"),
                    runbooks_dir=Path(p["runbooks_dir"]) if p.get("runbooks_dir") else None,
                    journal=Path(p["journal"]) if p.get("journal") else None, request_timeout=2.0,
                    store=p.get("store") or DEFAULT_STORE,
                    store_namespace=p.get("store_namespace") or DEFAULT_STORE_NAMESPACE)


def complete_runbook(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[Any]:
    """Runbook names in the runbooks directory (``runbook run gpu-<TAB>``)."""
    from click.shell_completion import CompletionItem

    try:
        from engine.loader import list_runbooks

        loaded, _ = list_runbooks(_settings_for_completion(ctx).runbooks_dir)
    except Exception:  # Why: completion must never print a traceback into the user's shell
        return []
    return [CompletionItem(lr.name, help=lr.runbook.description.strip().split("\n")[0])
            for lr in loaded if lr.name.startswith(incomplete)]


def complete_node(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[str]:
    """Node names from the API (a 2 s request timeout: a slow cluster gives no names, not a hang)."""
    try:
        names = [n.name for n in _settings_for_completion(ctx).kube().list_nodes()]
    except Exception:  # Why: completion must never print a traceback into the user's shell
        return []
    return sorted(n for n in names if n.startswith(incomplete))


def complete_run_id(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[str]:
    """Run ids from the run store, newest first."""
    try:
        runs = _settings_for_completion(ctx).open_journal().list_runs(limit=200)
    except Exception:  # Why: completion must never print a traceback into the user's shell
        return []
    return [r.id for r in runs if r.id.startswith(incomplete)]


SHARED_OPTIONS = (
    click.option("--kubeconfig", envvar="KUBECONFIG", type=click.Path(dir_okay=False),
                 help="Kubeconfig file (env KUBECONFIG); in-cluster config when unset inside a pod."),
    click.option("--context", "kube_context", help="Kubeconfig context to use."),
    click.option("--inventory", "-i", envvar="RUNBOOK_INVENTORY", type=click.Path(),
                 help="Ansible inventory for node hosts (env RUNBOOK_INVENTORY)."),
    click.option("--runbooks-dir", envvar="RUNBOOK_RUNBOOKS_DIR", type=click.Path(file_okay=False),
                 help="Where runbooks live (env RUNBOOK_RUNBOOKS_DIR; default ./runbooks or the packaged ones)."),
    click.option("--journal", envvar="RUNBOOK_JOURNAL", type=click.Path(dir_okay=False),
                 help="SQLite journal of runs (env RUNBOOK_JOURNAL; default under $XDG_STATE_HOME/runbook)."),
    click.option("--store", envvar="RUNBOOK_STORE", type=click.Choice(list(STORES)), default=DEFAULT_STORE,
                 show_default=True, help="Where runs are recorded: the SQLite journal, or RemediationRun objects "
                                         "in the cluster (env RUNBOOK_STORE; docs/cluster.md)."),
    click.option("--store-namespace", envvar="RUNBOOK_STORE_NAMESPACE", default=DEFAULT_STORE_NAMESPACE,
                 show_default=True,
                 help="Namespace of the RemediationRuns with --store kubernetes (env RUNBOOK_STORE_NAMESPACE)."),
    click.option("--become-password-file", type=click.Path(exists=True, dir_okay=False),
                 help="File holding the sudo password for node hosts (or env RUNBOOK_BECOME_PASSWORD)."),
    click.option("--ask-become-pass", "-K", is_flag=True, help="Prompt for the sudo password."),
    click.option("--guards-config", envvar="RUNBOOK_GUARDS_CONFIG", type=click.Path(dir_okay=False),
                 help="YAML file whose `guards:` section configures the run guards (env RUNBOOK_GUARDS_CONFIG; "
                      "default: the built-in guards, see docs/guards.md)."),
    click.option("--namespace", "-n", envvar="RUNBOOK_NAMESPACE",
                 help="Namespace of the node Leases (env RUNBOOK_NAMESPACE; default kube-system)."),
    click.option("--request-timeout", type=click.FloatRange(0, min_open=True), envvar="RUNBOOK_REQUEST_TIMEOUT",
                 help="Seconds an API request may take before it fails (env RUNBOOK_REQUEST_TIMEOUT; default 30)."),
    click.option("--no-tty", is_flag=True, help="Plain progress lines even on a terminal (no live display)."),
    click.option("--no-color", is_flag=True, help="No colours and no live display (as env NO_COLOR)."),
    click.option("--debug", is_flag=True, help="Show tracebacks and connector debug output."),
)
SHARED_NAMES = ("kubeconfig", "kube_context", "inventory", "runbooks_dir", "journal", "store", "store_namespace",
                "become_password_file",
                "ask_become_pass", "guards_config", "namespace", "request_timeout", "no_tty", "no_color", "debug")


def shared_options(func: F) -> F:
    """Add the options every command (and ``runbook serve``) takes, declared once."""
    for option in reversed(SHARED_OPTIONS):
        func = option(func)
    return func


def settings_from(opts: dict[str, Any]) -> Settings:
    """Pop the shared options out of a command's keyword arguments into one ``Settings``."""
    v = {name: opts.pop(name) for name in SHARED_NAMES}
    if v["no_color"]:
        os.environ["NO_COLOR"] = "1"  # one switch for rich, click and the plain progress lines
    return Settings(
        namespace=v["namespace"], request_timeout=v["request_timeout"], no_tty=v["no_tty"],
        kubeconfig=v["kubeconfig"], context=v["kube_context"],
        inventory=Path(v["inventory"]) if v["inventory"] else None,
        runbooks_dir=Path(v["runbooks_dir"]) if v["runbooks_dir"] else None,
        journal=Path(v["journal"]) if v["journal"] else None,
        store=v["store"], store_namespace=v["store_namespace"],
        become_password_file=Path(v["become_password_file"]) if v["become_password_file"] else None,
        ask_become_pass=v["ask_become_pass"], debug=v["debug"],
        guards_config=Path(v["guards_config"]) if v["guards_config"] else None,
    )


def common_options(func: F) -> F:
    """Shared options + error handling: one red line and the phase's exit code (``runbook runs --journal F``)."""

    @shared_options
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        settings = settings_from(kwargs)
        debug = settings.debug
        try:
            code = func(settings, *args, **kwargs)
        except RunbookError as e:
            if debug:
                raise
            _print_error(e, settings)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("cancelled", err=True)
            sys.exit(ExitCode.CANCELLED)
        ctx = click.get_current_context()
        if isinstance(ctx.command, click.Group) and ctx.invoked_subcommand:
            return None  # a group's own options were taken; its subcommand runs next
        sys.exit(code or 0)

    return wrapper  # type: ignore[return-value]


def _print_error(e: RunbookError, settings: Settings | None = None) -> None:
    from engine.errors import HostError, KubeError, NotFound

    color = "NO_COLOR" not in os.environ and sys.stderr.isatty()
    lines = str(e).splitlines() or [type(e).__name__]
    if settings is not None and isinstance(e, KubeError) and not isinstance(e, NotFound) and (
            e.retryable or "unreachable" in str(e)) and "used kubeconfig" not in str(e):
        lines.append(settings.kube_hint())
    if settings is not None and isinstance(e, HostError) and "used inventory" not in str(e):
        lines.append(settings.inventory_hint())
    for line in lines:
        click.echo(click.style(line, fg="red") if color else line, err=True)


def yaml_or_direct(output: str, call: Callable[[str], int]) -> int:
    """``-o yaml``: the command's JSON document(s), printed as YAML (the same fields); else ``call(output)``."""
    if output != "yaml":
        return call(output)
    import contextlib
    import io
    import json

    import yaml

    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            code = call("json")
    finally:
        text = buffer.getvalue()
        docs, pos, decoder = [], 0, json.JSONDecoder()
        while pos < len(text):
            if text[pos].isspace():
                pos += 1
                continue
            try:
                doc, pos = decoder.raw_decode(text, pos)
            except ValueError:
                sys.stdout.write(text[pos:])
                break
            docs.append(doc)
        if docs:
            sys.stdout.write(yaml.safe_dump_all(docs, sort_keys=False, allow_unicode=True))
        sys.stdout.flush()
    return code


def params_option(func: F) -> F:
    func = click.option("--param", "-p", "params", multiple=True, metavar="KEY=VALUE",
                        help="Runbook parameter (repeatable).")(func)
    return func


def target_options(func: F) -> F:
    func = click.option("--node", help="Target node (shorthand for -p node=NODE).", shell_complete=complete_node)(func)
    func = click.option("--selector", "-l", help="Label selector: run on every matching node (fleet).")(func)
    func = click.option("--max-parallel", type=click.IntRange(1), default=1, show_default=True,
                        help="Fleet: nodes remediated at once.")(func)
    func = click.option("--settle", type=click.FloatRange(0), default=0.0, show_default=True,
                        help="Fleet: seconds to wait between batches.")(func)
    return func


def fleet_options(func: F) -> F:
    func = click.option("--max-failures", type=click.IntRange(1), default=1, show_default=True,
                        help="Fleet: after this many failed nodes no further batch starts.")(func)
    func = click.option("--fail-fast", is_flag=True,
                        help="Fleet: refuse the whole fleet when any node's plan is blocked.")(func)
    return func


def override_options(func: F) -> F:
    func = click.option("--override-guard", "override_guards", multiple=True, metavar="NAME",
                        help="Pass the run guard NAME deliberately (repeatable; each needs a --reason, "
                             "journaled with your user name).")(func)
    func = click.option("--reason", "override_reasons", multiple=True, metavar="TEXT",
                        help="Why the guard named by the matching --override-guard is passed.")(func)
    return func


def overrides_from(names: tuple[str, ...], reasons: tuple[str, ...]) -> dict[str, str]:
    """``--override-guard A --reason X --override-guard B --reason Y`` -> {A: X, B: Y}; exit 2 otherwise."""
    from engine.errors import UsageError

    if len(names) != len(reasons):
        raise UsageError(f"give one --reason per --override-guard ({len(names)} guards, {len(reasons)} reasons)")
    out: dict[str, str] = {}
    for name, reason in zip(names, reasons, strict=True):
        if name in out:
            raise UsageError(f"--override-guard {name} given twice")
        out[name] = reason
    return out


def metrics_textfile_option(func: F) -> F:
    """``--metrics-textfile PATH``: after the command, rewrite PATH (``*.prom``) for node_exporter's
    textfile collector from the run store (``engine.textfile_metrics``). A failure to write is a
    warning: the command's exit code stands."""

    @click.option("--metrics-textfile", envvar="RUNBOOK_METRICS_TEXTFILE", type=click.Path(dir_okay=False),
                  help="After the run, write CLI run metrics for node_exporter's textfile collector to this "
                       "*.prom file (env RUNBOOK_METRICS_TEXTFILE).")
    @functools.wraps(func)
    def wrapper(settings: Settings, *args: Any, metrics_textfile: str | None, **kwargs: Any) -> Any:
        if metrics_textfile is None:
            return func(settings, *args, **kwargs)
        from engine.textfile_metrics import check_textfile_path, write_textfile

        path = check_textfile_path(metrics_textfile)  # bad input: refused before anything runs
        try:
            return func(settings, *args, **kwargs)
        finally:
            try:
                write_textfile(path, settings.open_journal())
            except Exception as e:  # Why: metrics must never change a run's outcome or exit code
                click.echo(f"runbook: warning: could not write metrics to {path}: {e}", err=True)

    return wrapper  # type: ignore[return-value]


def notify_option(func: F) -> F:
    """``--notify-config FILE``: when the command ends, send the notifications of the CLI runs that
    ended meanwhile to the targets of FILE's ``notify:`` section (``engine.cli_notify``). The file is
    checked before anything runs; a failure to send is a warning: the command's exit code stands."""

    @click.option("--notify-config", envvar="RUNBOOK_NOTIFY_CONFIG", type=click.Path(dir_okay=False),
                  help="Serve configuration whose notify: section (webhook, Slack, PagerDuty) is told about "
                       "the runs of this command when they end (env RUNBOOK_NOTIFY_CONFIG).")
    @click.option("--pagerduty-dedup-key", envvar="RUNBOOK_PAGERDUTY_DEDUP_KEY", default="",
                  help="With --notify-config: the PagerDuty alert (dedup_key) these runs answer; PagerDuty "
                       "is only told when given (env RUNBOOK_PAGERDUTY_DEDUP_KEY).")
    @functools.wraps(func)
    def wrapper(settings: Settings, *args: Any, notify_config: str | None, pagerduty_dedup_key: str,
                **kwargs: Any) -> Any:
        if notify_config is None:
            return func(settings, *args, **kwargs)
        import time

        from engine.cli_notify import OwnRuns, load_notify_config, send_cli_notifications

        config = load_notify_config(notify_config)  # bad input: refused before anything runs
        if len(pagerduty_dedup_key) > 255:
            raise click.UsageError("--pagerduty-dedup-key: PagerDuty accepts at most 255 characters")
        since = time.time()
        own: list[OwnRuns] = []

        def note(store: RunStore) -> RunStore:
            own.append(OwnRuns(store))
            return cast("RunStore", own[0])

        try:
            # Why: a shared store holds other operators' runs; this command tells about its own only
            settings.wrap_journal(note)
            return func(settings, *args, **kwargs)
        finally:
            try:
                if own and own[0].ids:
                    send_cli_notifications(config, settings.open_journal(), since,
                                           pagerduty_key=pagerduty_dedup_key,
                                           timeout=max(5.0, 3 * config.notify.timeout), only=own[0].ids)
            except Exception as e:  # Why: notifications must never change a run's outcome or exit code
                click.echo(f"runbook: warning: could not send notifications: {e}", err=True)

    return wrapper  # type: ignore[return-value]


def _overrides_as_dict(func: F) -> F:
    """Hand the command ``overrides`` ({guard: reason}) instead of the two option tuples."""

    @functools.wraps(func)
    def wrapper(*args: Any, override_guards: tuple[str, ...], override_reasons: tuple[str, ...],
                **kwargs: Any) -> Any:
        return func(*args, overrides=overrides_from(override_guards, override_reasons), **kwargs)

    return wrapper  # type: ignore[return-value]


Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def execution_options(*, between: tuple[Decorator, ...] = (), metrics_and_notify: bool = True) -> Decorator:
    """The options of every command that executes a run (run, apply, resume, rollback), declared
    once and shown in this order: ``--yes``, ``-o/--output``, the command's own ``between`` (run's
    ``--lock-wait`` and fleet options), the guard overrides (handed to the command as ``overrides``:
    one ``--reason`` per ``--override-guard``, exit 2 otherwise), then, with ``metrics_and_notify``,
    ``--metrics-textfile`` and ``--notify-config``/``--pagerduty-dedup-key``."""
    yes = click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
    output = click.option("-o", "--output", type=OUTPUT, default="text")
    after: tuple[Decorator, ...] = (metrics_textfile_option, notify_option) if metrics_and_notify else ()
    stack: tuple[Decorator, ...] = (yes, output, *between, override_options, *after, _overrides_as_dict)

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        for decorator in reversed(stack):  # as if written one above the other, top first
            func = decorator(func)
        return func

    return decorate


def lock_wait_option(func: F) -> F:
    return click.option("--lock-wait", type=click.FloatRange(0), default=0.0,
                        help="Seconds to wait for the node's Lease.")(func)


class LazyGroup(click.Group):
    """Sub-groups that live in their own packages load only when used (``runbook --help`` stays fast)."""

    LAZY = {"lab": "The lab: a simulated GPU cluster reproducing the omen2 incident.",
            "serve": "Receive Alertmanager and PagerDuty webhooks and start runbooks inside guards."}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.LAZY])

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            if name in self.LAZY:
                rows.append((name, self.LAZY[name]))
            else:
                rows.append((name, self.commands[name].get_short_help_str(70)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name == "lab":
            from engine.lab.labcli import lab_group

            return lab_group
        if cmd_name == "serve":
            from engine.serve.cli import serve_command

            return serve_command
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="runbook")
@click.option("--log-format", type=click.Choice(["text", "json"]), envvar="RUNBOOK_LOG_FORMAT", default="text",
              show_default=True, help="Logs on stderr: text, or JSON lines with run id, step, node and event "
                                      "(env RUNBOOK_LOG_FORMAT). Secrets are masked.")
def main(log_format: str) -> None:
    """Guarded remediation runbooks: plan, approve, run and verify recoveries of Kubernetes nodes.

    \b
    Exit codes: 0 ok (also: nothing to do), 1 a step or verification failed,
    2 usage or invalid runbook, 3 blocked (precondition, guard, lock), 4 cancelled,
    5 stale plan or invalid approval, 6 journal unavailable (locked, full, read-only, corrupt).
    """
    from engine.logformat import configure_logging

    configure_logging(log_format)


@main.command("list")
@common_options
@click.option("-o", "--output", type=OUTPUT_WIDE, default="text", help="text, wide (adds params and path), json, yaml.")
def list_cmd(settings: Settings, output: str) -> int:
    """List the runbooks found in the runbooks directory."""
    from engine import app

    return yaml_or_direct(output, lambda fmt: app.list_runbooks(settings, fmt))


@main.command()
@common_options
@click.argument("name", shell_complete=complete_runbook)
def show(settings: Settings, name: str) -> int:
    """Show a runbook: params, preconditions, steps with their guards and verifications."""
    from engine import app

    return app.show_runbook(settings, name)


@main.command()
@common_options
@click.argument("paths", nargs=-1, type=click.Path())
def validate(settings: Settings, paths: tuple[str, ...]) -> int:
    """Validate runbook files or folders (default: the runbooks directory). Errors print as PATH:LINE."""
    from engine import app

    return app.validate(settings, [Path(p) for p in paths])


@main.command()
def schema() -> None:
    """Print the JSON Schema of the runbook format (for yaml-language-server)."""
    import json

    from engine.loader import runbook_json_schema

    click.echo(json.dumps(runbook_json_schema(), indent=2))


@main.command()
@common_options
@click.argument("name", required=False, shell_complete=complete_runbook)
@target_options
@params_option
@click.option("-o", "--output", type=OUTPUT_MD, default="text")
@click.option("--out", "out_file", type=click.Path(dir_okay=False), help="Save the plan to FILE for `runbook apply`.")
@click.option("--expires", default="1h", show_default=True, help="Saved plan lifetime (e.g. 30m, 2h).")
@click.option("--rollback", "rollback_of", metavar="RUN_ID", default=None,
              help="Plan the rollback of recorded run RUN_ID instead (what `runbook rollback RUN_ID` would do).")
def plan(settings: Settings, name: str | None, node: str | None, selector: str | None, max_parallel: int,
         settle: float, params: tuple[str, ...], output: str, out_file: str | None, expires: str,
         rollback_of: str | None) -> int:
    """Show what a run would do to the node now (live facts, dry-run previews). Changes nothing."""
    settings.start_inventory_read()  # its child runs while the engine loads
    from engine import app
    from engine.errors import UsageError

    if rollback_of is not None:
        if name or node or selector or params or out_file:
            raise UsageError("--rollback RUN_ID plans that run's rollback: give no runbook, node or params")
        return yaml_or_direct(output, lambda fmt: app.plan_rollback(settings, rollback_of, output=fmt))
    if not name:
        raise UsageError("give the runbook NAME to plan (or --rollback RUN_ID)")
    return yaml_or_direct(output, lambda fmt: app.plan(
        settings, name, node=node, selector=selector, raw_params=params, output=fmt,
        out_file=Path(out_file) if out_file else None, expires=expires))


@main.command()
@common_options
@click.argument("name", shell_complete=complete_runbook)
@target_options
@params_option
@click.option("--dry-run", is_flag=True, help="Plan and preview only; change nothing.")
@execution_options(between=(lock_wait_option, fleet_options))
def run(settings: Settings, name: str, node: str | None, selector: str | None, max_parallel: int,
        settle: float, params: tuple[str, ...], dry_run: bool, yes: bool, output: str, lock_wait: float,
        max_failures: int, fail_fast: bool, overrides: dict[str, str]) -> int:
    """Run a runbook: preconditions, then per step guards -> act -> verify; stop at the first failure.

    \b
    With --selector, every matching node: blocked nodes are reported and left untouched, the others
    run in rolling batches; exit 0 all succeeded or had nothing to do, 1 any failed, 3 none failed
    but some were blocked, 4 cancelled.
    """
    settings.start_inventory_read()  # its child runs while the engine loads
    from engine import app

    return yaml_or_direct(output, lambda fmt: app.run(
        settings, name, node=node, selector=selector, raw_params=params, dry_run=dry_run, yes=yes, output=fmt,
        max_parallel=max_parallel, settle=settle, lock_wait=lock_wait, max_failures=max_failures,
        fail_fast=fail_fast, overrides=overrides))


@main.command()
@common_options
@click.argument("plan_file", type=click.Path(exists=True, dir_okay=False))
@execution_options()
def apply(settings: Settings, plan_file: str, yes: bool, output: str, overrides: dict[str, str]) -> int:
    """Execute a saved plan, refusing (exit 5) if the runbook, the facts or the clock moved on."""
    settings.start_inventory_read()  # its child runs while the engine loads
    from engine import app

    return yaml_or_direct(output, lambda fmt: app.apply(settings, Path(plan_file), yes=yes, output=fmt,
                                                        overrides=overrides))


@main.command()
@common_options
@click.argument("run_id", shell_complete=complete_run_id)
@click.option("--plan-digest", required=True, help="Digest of the plan you reviewed.")
@click.option("--by", "approved_by", default=None,
              help="Who approves (default: $USER; refused with --store kubernetes: the kubeconfig's identity).")
def approve(settings: Settings, run_id: str, plan_digest: str, approved_by: str | None) -> int:
    """Approve a run waiting for approval; refused (exit 5) for any other plan digest.

    With --store kubernetes, RBAC decides: verb approve on remediationruns (runbook.io) for your
    kubeconfig's identity, else exit 3; that identity is recorded as the approver."""
    from engine import app

    return app.approve(settings, run_id, plan_digest, approved_by)


@main.command()
@common_options
@click.argument("run_id", shell_complete=complete_run_id)
@execution_options()
def resume(settings: Settings, run_id: str, yes: bool, output: str, overrides: dict[str, str]) -> int:
    """Continue an interrupted or approved run; completed steps are not redone."""
    settings.start_inventory_read()  # its child runs while the engine loads
    from engine import app

    return yaml_or_direct(output, lambda fmt: app.resume(settings, run_id, yes=yes, output=fmt,
                                                         overrides=overrides))


@main.command()
@common_options
@click.argument("run_id", shell_complete=complete_run_id)
@execution_options(metrics_and_notify=False)
def rollback(settings: Settings, run_id: str, yes: bool, output: str, overrides: dict[str, str]) -> int:
    """Undo what run RUN_ID changed: its steps' declared inverses, newest first, as a guarded and
    verified run linked to it. Refused (exit 3) when a changed step has no inverse or an inverse's
    guard does not hold now."""
    from engine import app

    return yaml_or_direct(output, lambda fmt: app.rollback(settings, run_id, yes=yes, output=fmt,
                                                           overrides=overrides))


@main.group(invoke_without_command=True)
@common_options
@click.option("-o", "--output", type=OUTPUT_WIDE, default="text",
              help="text, wide (adds params, source, exit code), json, yaml.")
@click.option("--limit", type=click.IntRange(1), default=50, show_default=True)
def runs(settings: Settings, output: str, limit: int) -> int:
    """History of runs (id, runbook, params, state, started, finished)."""
    if click.get_current_context().invoked_subcommand is not None:
        return 0
    from engine import app

    return yaml_or_direct(output, lambda fmt: app.list_runs(settings, fmt, limit))


@runs.command("show")
@common_options
@click.argument("run_id", shell_complete=complete_run_id)
@click.option("-o", "--output", type=OUTPUT, default="text")
def runs_show(settings: Settings, run_id: str, output: str) -> int:
    """Every recorded event of one run."""
    from engine import app

    return yaml_or_direct(output, lambda fmt: app.show_run(settings, run_id, fmt))


@runs.command("prune")
@common_options
@click.option("--keep", type=click.IntRange(0), default=1000, show_default=True,
              help="Finished runs to keep, newest first (older ones are deleted).")
@click.option("--max-age", default="720h", show_default=True,
              help="Also delete finished runs that ended longer ago than this (e.g. 168h; 0 keeps no age limit).")
@click.option("-o", "--output", type=OUTPUT, default="text")
def runs_prune(settings: Settings, keep: int, max_age: str, output: str) -> int:
    """Retention: delete finished runs (never pending, waiting, running or interrupted ones)."""
    from engine import app

    return yaml_or_direct(output, lambda fmt: app.prune_runs(settings, keep, max_age, fmt))


@main.command()
@common_options
@click.option("--node", default=None, help="The node to examine.", shell_complete=complete_node)
@click.option("--all", "all_nodes", is_flag=True, help="Every NotReady, unschedulable or GPU-less node.")
@click.option("-l", "--selector", default=None, help="Like --all, among the nodes this label selector picks.")
@click.option("-o", "--output", type=OUTPUT, default="text")
def diagnose(settings: Settings, node: str | None, all_nodes: bool, selector: str | None, output: str) -> int:
    """Collect evidence read-only and name the cause and the runbook that fixes it (from the runbooks'
    declared diagnoses)."""
    from engine import app

    return yaml_or_direct(output, lambda fmt: app.diagnose(settings, node, fmt, all_nodes=all_nodes,
                                                           selector=selector))


SHELLS = ("bash", "zsh", "fish")


@main.command()
@click.argument("shell", type=click.Choice(SHELLS))
@click.option("--prog-name", default=None,
              help="The command the script completes (default: the name this was run as, e.g. kubectl-runbook).")
def completion(shell: str, prog_name: str | None) -> None:
    """Print the shell completion script (runbook names, node names from the API, run ids).

    \b
    bash:  source <(runbook completion bash)     or add that line to ~/.bashrc
    zsh:   source <(runbook completion zsh)      or add that line to ~/.zshrc
    fish:  runbook completion fish > ~/.config/fish/completions/runbook.fish
    """
    from click.shell_completion import get_completion_class

    name = prog_name or Path(sys.argv[0]).name
    if name in ("__main__.py", "python", "python3", "-c", ""):
        name = "runbook"
    cls = get_completion_class(shell)
    assert cls is not None  # click ships bash, zsh and fish
    complete_var = "_" + name.replace("-", "_").upper() + "_COMPLETE"
    click.echo(cls(main, {}, name, complete_var).source())
