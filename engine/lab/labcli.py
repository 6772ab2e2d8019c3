"""``runbook lab``: a click group over ``engine.lab.manager`` (thin: parse options, call, print).

Attach it to the main command with ``main.add_command(lab_group)``. Every subcommand takes
``--lab-dir`` (env ``RUNBOOK_LAB_DIR``; default ``${XDG_STATE_HOME:-~/.local/state}/runbook/lab``).
Errors print as one line and exit with ``engine.errors`` exit codes.
"""

from __future__ import annotations

import functools
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from engine.errors import RunbookError

F = TypeVar("F", bound=Callable[..., Any])


def _lab_dir_option(func: F) -> F:
    @click.option("--lab-dir", envvar="RUNBOOK_LAB_DIR", type=click.Path(file_okay=False),
                  help="The lab's folder (env RUNBOOK_LAB_DIR; default $XDG_STATE_HOME/runbook/lab).")
    @functools.wraps(func)
    def wrapper(*args: Any, lab_dir: str | None, **kwargs: Any) -> Any:
        from engine.lab.manager import Lab

        try:
            return func(Lab(lab_dir), *args, **kwargs)
        except RunbookError as e:
            click.echo(f"runbook lab: {e}", err=True)
            sys.exit(e.exit_code)

    return wrapper  # type: ignore[return-value]


class _Phases:
    """What a long lab command waits for: a rich status line (spinner, phase, seconds) on a terminal,
    one plain line per phase with its start time otherwise (pipes, CI, NO_COLOR)."""

    def __init__(self) -> None:
        import os
        import time

        self._clock = time.monotonic
        self.t0 = self._clock()
        self.live = sys.stderr.isatty() and "NO_COLOR" not in os.environ
        self._status: Any = None
        self._phase = ""
        self._phase_t0 = self.t0

    def __call__(self, message: str) -> None:
        now = self._clock()
        if not self.live:
            click.echo(f"[{now - self.t0:5.1f}s] {message}", err=True)
            return
        from rich.console import Console

        if self._status is None:
            self._status = Console(stderr=True).status(message)
            self._status.start()
        elif self._phase:
            self._status.console.print(f"[green]✓[/] {self._phase} [dim]({now - self._phase_t0:.1f} s)[/]",
                                       highlight=False)
        self._phase, self._phase_t0 = message, now
        self._status.update(message)

    def __enter__(self) -> _Phases:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            if self._phase and exc[0] is None:
                self._status.console.print(
                    f"[green]✓[/] {self._phase} [dim]({self._clock() - self._phase_t0:.1f} s)[/]", highlight=False)
            self._status.stop()


@click.group("lab")
def lab_group() -> None:
    """The lab: a simulated GPU cluster reproducing the omen2 incident, on this machine."""


@lab_group.command("up")
@click.option("--scenario", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Scenario file (default: the packaged incident-omen2 scenario).")
@click.option("--timeout", default=180.0, show_default=True, help="Seconds to wait for the scenario's state.")
@click.option("--with-monitoring", is_flag=True,
              help="Also start Prometheus and Alertmanager (paging runbook serve); on a running lab, add them.")
@click.option("--alert-webhook", metavar="URL",
              help="Where Alertmanager sends its webhooks (default http://127.0.0.1:8080/hooks/alertmanager).")
@click.option("--monitoring-rules", "monitoring_rules", multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Extra Prometheus rule files to load (e.g. deploy/monitoring/runbook-alerts.yaml); repeatable.")
@click.option("--with-cluster-mode", is_flag=True,
              help="Also apply deploy/kubernetes and run its Deployment's replicas as pods (docs/cluster.md); "
                   "with --with-monitoring, Alertmanager pages their Service.")
@click.option("--cluster-base", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The kustomize base for --with-cluster-mode (default: this repository's deploy/kubernetes).")
@_lab_dir_option
def up_command(lab: Any, scenario: Path | None, timeout: float, with_monitoring: bool, alert_webhook: str | None,
               monitoring_rules: tuple[Path, ...], with_cluster_mode: bool, cluster_base: Path | None) -> None:
    """Start control plane, node hosts and simulator; wait until the scenario's state is reached.

    Alertmanager's bearer token is $RUNBOOK_WEBHOOK_TOKEN (or a new one): `runbook lab env` exports it
    for `runbook serve`."""
    with _Phases() as say:
        summary = lab.up(scenario, timeout=timeout, progress=say, with_monitoring=with_monitoring,
                         alert_webhook=alert_webhook, monitoring_rules=monitoring_rules,
                         with_cluster_mode=with_cluster_mode, cluster_base=cluster_base)
    for line in summary["started"] or ["nothing new: the lab was already running"]:
        click.echo(f"started {line}" if summary["started"] else line)
    click.echo(f"lab ready in {summary['lab_dir']}: eval \"$(runbook lab env)\" to use it")


@lab_group.command("env")
@_lab_dir_option
def env_command(lab: Any) -> None:
    """Print shell exports: eval "$(runbook lab env)" makes runbook, kubectl and ansible target the lab."""
    for key, value in lab.env().items():
        click.echo(f"export {key}={shlex.quote(value)}")


@lab_group.command("status")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text", show_default=True)
@_lab_dir_option
def status_command(lab: Any, output: str) -> None:
    """Per node: Ready, workload label, GPU driver, CUDA jobs running/killed; VM statuses; with
    monitoring, the alerts Prometheus has pending or firing."""
    data = lab.status()
    if output == "json":
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(f"lab {data['lab_dir']} ({'running' if data['running'] else 'NOT fully running'})")
    click.echo(f"kubeconfig {data['kubeconfig']}\ninventory  {data['inventory']}")
    click.echo(f"{'NODE':<14}{'READY':<7}{'KUBELET':<12}{'SWAP':<6}{'WORKLOAD':<16}{'DRIVER':<10}"
               f"{'CUDA':<6}{'KILLED':<7}GPU ALLOCATABLE")
    for n in data["nodes"]:
        alloc = ", ".join(f"{k.removeprefix('nvidia.com/')}={v}" for k, v in n["gpu_allocatable"].items())
        click.echo(f"{n['name']:<14}{'yes' if n['ready'] else 'no':<7}{n['kubelet']:<12}"
                   f"{'on' if n['swap_active'] else 'off':<6}{n['workload'] or '-':<16}{n['gpu_driver']:<10}"
                   f"{n['cuda_jobs_running']:<6}{n['cuda_jobs_killed']:<7}{alloc or '-'}")
        for gpu in n["gpus"] if len(n["gpus"]) > 1 else []:  # a node with several GPUs: one line each
            click.echo(f"  gpu {gpu['slot']} {gpu['model']} {gpu['name']}: {gpu['driver']}, "
                       f"{gpu['cuda_jobs']} CUDA job{'s' if gpu['cuda_jobs'] != 1 else ''}")
    for vm in data["vms"]:
        click.echo(f"vm {vm['namespace']}/{vm['name']}: {vm['status']}")
    cluster = data.get("cluster_mode")
    if cluster:
        click.echo(f"cluster mode: Service {cluster['service_dns']} at {cluster['service_url']}")
        for pod in cluster["pods"]:
            click.echo(f"pod {pod['name']} on {pod['node']}: pid {pod['pid']}, ip {pod['pod_ip']}, "
                       f"{'ready' if pod['ready'] else 'not ready'}")
    monitoring = data.get("monitoring")
    if monitoring:
        click.echo(f"prometheus {monitoring['prometheus']}  alertmanager {monitoring['alertmanager']}  "
                   f"paging {monitoring['webhook_url']}")
        alerts = monitoring["alerts"]
        if isinstance(alerts, str):
            click.echo(f"alerts: unknown ({alerts})")
        elif not alerts:
            click.echo("alerts: none")
        for a in alerts if isinstance(alerts, list) else []:
            click.echo(f"alert {a['alertname']} node={a['node'] or '-'}: {a['state']} since {a['active_at']}")


@lab_group.group("job")
def job_group() -> None:
    """Start or stop the host CUDA job on a node (one per GPU at most)."""


_gpu_option = click.option("--gpu", "gpu", metavar="SLOT", default=None,
                           help="The GPU's PCI slot, e.g. 02:00.0 (start: default the first GPU on nvidia; "
                                "stop: default every GPU).")


@job_group.command("start")
@click.argument("node")
@_gpu_option
@_lab_dir_option
def job_start(lab: Any, node: str, gpu: str | None) -> None:
    result = lab.job(node, "start", gpu)
    click.echo(f"{node}: CUDA jobs {[j['pid'] for j in result['cuda_jobs']]}")


@job_group.command("stop")
@click.argument("node")
@_gpu_option
@_lab_dir_option
def job_stop(lab: Any, node: str, gpu: str | None) -> None:
    result = lab.job(node, "stop", gpu)
    click.echo(f"{node}: no CUDA job" + (f" on {gpu}" if gpu and result["cuda_jobs"] else ""))


@lab_group.command("inject")
@click.argument("fault", required=False)
@click.option("--node", metavar="NODE", help="The node to put the fault into.")
@click.option("--gpu", "gpu", metavar="SLOT", default=None,
              help="The GPU's PCI slot, e.g. 02:00.0, for a fault of one GPU (default: the node's first GPU).")
@click.option("--list", "listing", is_flag=True, help="List the faults and what each does.")
@_lab_dir_option
def inject_command(lab: Any, fault: str | None, node: str | None, gpu: str | None, listing: bool) -> None:
    """Put FAULT into NODE of the running lab, as a real node shows it (game days: rehearse the fix).

    `runbook diagnose -o json` names each fault's cause after the same word."""
    from engine.lab.inject import faults, inject

    if listing:
        if fault or node or gpu:
            raise click.UsageError("--list takes no FAULT, --node or --gpu")
        known = faults()
        width = max((len(n) for n in known), default=0)
        for name, f in known.items():
            click.echo(f"{name:<{width}}  {'[--gpu SLOT] ' if f.gpu else ''}{f.summary}")
        return
    if not fault or not node:
        raise click.UsageError("inject needs FAULT and --node NODE (or --list)")
    result = inject(lab, fault, node, gpu)
    click.echo(result["did"])


@lab_group.command("reset")
@click.option("--timeout", default=120.0, show_default=True)
@_lab_dir_option
def reset_command(lab: Any, timeout: float) -> None:
    """Back to the scenario's initial state (host files and state, API objects, Leases, counters)."""
    with _Phases() as say:
        result = lab.reset(timeout=timeout, progress=say)
    click.echo(f"lab reset to its initial state in {result['seconds']} s")


@lab_group.command("down")
@_lab_dir_option
def down_command(lab: Any) -> None:
    """Stop every process the lab started (by PID) and remove its folder."""
    result = lab.down()
    for line in result["stopped"]:
        click.echo(f"stopped {line}")
    click.echo(f"removed {result['removed']}")
