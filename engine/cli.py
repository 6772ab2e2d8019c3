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
from typing import Any, TypeVar

import click

from engine.errors import ExitCode, RunbookError
from engine.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])

OUTPUT = click.Choice(["text", "json"])
OUTPUT_MD = click.Choice(["text", "json", "markdown"])


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
    click.option("--become-password-file", type=click.Path(exists=True, dir_okay=False),
                 help="File holding the sudo password for node hosts (or env RUNBOOK_BECOME_PASSWORD)."),
    click.option("--ask-become-pass", "-K", is_flag=True, help="Prompt for the sudo password."),
    click.option("--debug", is_flag=True, help="Show tracebacks and connector debug output."),
)
SHARED_NAMES = ("kubeconfig", "kube_context", "inventory", "runbooks_dir", "journal", "become_password_file",
                "ask_become_pass", "debug")


def shared_options(func: F) -> F:
    """Add the options every command (and ``runbook serve``) takes, declared once."""
    for option in reversed(SHARED_OPTIONS):
        func = option(func)
    return func


def settings_from(opts: dict[str, Any]) -> Settings:
    """Pop the shared options out of a command's keyword arguments into one ``Settings``."""
    v = {name: opts.pop(name) for name in SHARED_NAMES}
    return Settings(
        kubeconfig=v["kubeconfig"], context=v["kube_context"],
        inventory=Path(v["inventory"]) if v["inventory"] else None,
        runbooks_dir=Path(v["runbooks_dir"]) if v["runbooks_dir"] else None,
        journal=Path(v["journal"]) if v["journal"] else None,
        become_password_file=Path(v["become_password_file"]) if v["become_password_file"] else None,
        ask_become_pass=v["ask_become_pass"], debug=v["debug"],
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
            _print_error(e)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("cancelled", err=True)
            sys.exit(ExitCode.CANCELLED)
        ctx = click.get_current_context()
        if isinstance(ctx.command, click.Group) and ctx.invoked_subcommand:
            return None  # a group's own options were taken; its subcommand runs next
        sys.exit(code or 0)

    return wrapper  # type: ignore[return-value]


def _print_error(e: RunbookError) -> None:
    color = "NO_COLOR" not in os.environ and sys.stderr.isatty()
    for line in str(e).splitlines() or [type(e).__name__]:
        click.echo(click.style(line, fg="red") if color else line, err=True)


def params_option(func: F) -> F:
    func = click.option("--param", "-p", "params", multiple=True, metavar="KEY=VALUE",
                        help="Runbook parameter (repeatable).")(func)
    return func


def target_options(func: F) -> F:
    func = click.option("--node", help="Target node (shorthand for -p node=NODE).")(func)
    func = click.option("--selector", "-l", help="Label selector: run on every matching node (fleet).")(func)
    func = click.option("--max-parallel", type=click.IntRange(1), default=1, show_default=True,
                        help="Fleet: nodes remediated at once.")(func)
    func = click.option("--settle", type=click.FloatRange(0), default=0.0, show_default=True,
                        help="Fleet: seconds to wait between batches.")(func)
    return func


def metrics_textfile_option(func: F) -> F:
    """``--metrics-textfile PATH``: after the command, rewrite PATH (``*.prom``) for node_exporter's
    textfile collector from the journal (``engine.textfile_metrics``). A failure to write is a
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
                write_textfile(path, settings.journal)
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

        from engine.cli_notify import load_notify_config, send_cli_notifications

        config = load_notify_config(notify_config)  # bad input: refused before anything runs
        if len(pagerduty_dedup_key) > 255:
            raise click.UsageError("--pagerduty-dedup-key: PagerDuty accepts at most 255 characters")
        since = time.time()
        try:
            return func(settings, *args, **kwargs)
        finally:
            try:
                send_cli_notifications(config, settings.journal, since, pagerduty_key=pagerduty_dedup_key,
                                       timeout=max(5.0, 3 * config.notify.timeout))
            except Exception as e:  # Why: notifications must never change a run's outcome or exit code
                click.echo(f"runbook: warning: could not send notifications: {e}", err=True)

    return wrapper  # type: ignore[return-value]


class LazyGroup(click.Group):
    """Sub-groups that live in their own packages load only when used (``runbook --help`` stays fast)."""

    LAZY = {"lab": ("engine.lab.labcli", "lab_group",
                    "The lab: a simulated GPU cluster reproducing the omen2 incident."),
            "serve": ("engine.serve.cli", "serve_command",
                      "Receive Alertmanager and PagerDuty webhooks and start runbooks inside guards.")}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.LAZY])

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            if name in self.LAZY:
                rows.append((name, self.LAZY[name][2]))
            else:
                rows.append((name, self.commands[name].get_short_help_str(70)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.LAZY:
            import importlib

            module, attr, _ = self.LAZY[cmd_name]
            return getattr(importlib.import_module(module), attr)
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
@click.option("-o", "--output", type=OUTPUT, default="text")
def list_cmd(settings: Settings, output: str) -> int:
    """List the runbooks found in the runbooks directory."""
    from engine import app

    return app.list_runbooks(settings, output)


@main.command()
@common_options
@click.argument("name")
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
@click.argument("name")
@target_options
@params_option
@click.option("-o", "--output", type=OUTPUT_MD, default="text")
@click.option("--out", "out_file", type=click.Path(dir_okay=False), help="Save the plan to FILE for `runbook apply`.")
@click.option("--expires", default="1h", show_default=True, help="Saved plan lifetime (e.g. 30m, 2h).")
def plan(settings: Settings, name: str, node: str | None, selector: str | None, max_parallel: int,
         settle: float, params: tuple[str, ...], output: str, out_file: str | None, expires: str) -> int:
    """Show what a run would do to the node now (live facts, dry-run previews). Changes nothing."""
    from engine import app

    return app.plan(settings, name, node=node, selector=selector, raw_params=params, output=output,
                    out_file=Path(out_file) if out_file else None, expires=expires)


@main.command()
@common_options
@click.argument("name")
@target_options
@params_option
@click.option("--dry-run", is_flag=True, help="Plan and preview only; change nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("-o", "--output", type=OUTPUT, default="text")
@click.option("--lock-wait", type=click.FloatRange(0), default=0.0, help="Seconds to wait for the node's Lease.")
@metrics_textfile_option
@notify_option
def run(settings: Settings, name: str, node: str | None, selector: str | None, max_parallel: int,
        settle: float, params: tuple[str, ...], dry_run: bool, yes: bool, output: str, lock_wait: float) -> int:
    """Run a runbook: preconditions, then per step guards -> act -> verify; stop at the first failure."""
    from engine import app

    return app.run(settings, name, node=node, selector=selector, raw_params=params, dry_run=dry_run,
                   yes=yes, output=output, max_parallel=max_parallel, settle=settle, lock_wait=lock_wait)


@main.command()
@common_options
@click.argument("plan_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("-o", "--output", type=OUTPUT, default="text")
@metrics_textfile_option
@notify_option
def apply(settings: Settings, plan_file: str, yes: bool, output: str) -> int:
    """Execute a saved plan, refusing (exit 5) if the runbook, the facts or the clock moved on."""
    from engine import app

    return app.apply(settings, Path(plan_file), yes=yes, output=output)


@main.command()
@common_options
@click.argument("run_id")
@click.option("--plan-digest", required=True, help="Digest of the plan you reviewed.")
@click.option("--by", "approved_by", default=None, help="Who approves (default: $USER).")
def approve(settings: Settings, run_id: str, plan_digest: str, approved_by: str | None) -> int:
    """Approve a run waiting for approval; refused (exit 5) for any other plan digest."""
    from engine import app

    return app.approve(settings, run_id, plan_digest, approved_by)


@main.command()
@common_options
@click.argument("run_id")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("-o", "--output", type=OUTPUT, default="text")
@metrics_textfile_option
@notify_option
def resume(settings: Settings, run_id: str, yes: bool, output: str) -> int:
    """Continue an interrupted or approved run; completed steps are not redone."""
    from engine import app

    return app.resume(settings, run_id, yes=yes, output=output)


@main.group(invoke_without_command=True)
@common_options
@click.option("-o", "--output", type=OUTPUT, default="text")
@click.option("--limit", type=click.IntRange(1), default=50, show_default=True)
def runs(settings: Settings, output: str, limit: int) -> int:
    """History of runs (id, runbook, params, state, started, finished)."""
    if click.get_current_context().invoked_subcommand is not None:
        return 0
    from engine import app

    return app.list_runs(settings, output, limit)


@runs.command("show")
@common_options
@click.argument("run_id")
@click.option("-o", "--output", type=OUTPUT, default="text")
def runs_show(settings: Settings, run_id: str, output: str) -> int:
    """Every recorded event of one run."""
    from engine import app

    return app.show_run(settings, run_id, output)


@main.command()
@common_options
@click.option("--node", required=True, help="The node to examine.")
@click.option("-o", "--output", type=OUTPUT, default="text")
def diagnose(settings: Settings, node: str, output: str) -> int:
    """Collect evidence read-only and name the cause and the runbook that fixes it."""
    from engine import diagnose as diag

    return diag.diagnose_command(settings, node, output)


