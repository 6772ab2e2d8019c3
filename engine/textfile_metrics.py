"""Metrics of CLI runs for node_exporter's textfile collector (``--metrics-textfile PATH``).

A CLI process does not live long enough to be scraped, so after a command that runs runbooks
(``run``, ``apply``, ``resume``) the whole file is rewritten from the run store (``--store``), atomically (a
temporary file renamed over it: node_exporter never reads half a file). Being derived from the
journal, the counters only grow, whatever process wrote the file last. Only runs with source
``cli`` are counted (``runbook serve`` exposes its own runs on ``/metrics``).

Series (every one prefixed ``runbook_cli_``):

* ``runs_finished_total{runbook,state}``: runs that ended (succeeded, failed, blocked, cancelled),
  by final state;
* ``run_last_finished_timestamp_seconds{runbook,node,state}``, ``run_last_duration_seconds{runbook,node}``,
  ``run_last_exit_code{runbook,node}``: the latest finished run per runbook and node;
* ``step_last_duration_seconds{runbook,node,step,status}``: the steps of that latest run;
* ``textfile_written_timestamp_seconds``: when this file was written.

Must not: change a run, raise into the command (the CLI reports a failure to write as a warning and
keeps the command's exit code), or write anywhere but ``PATH`` and its temporary sibling.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.errors import UsageError
from engine.journal import opened
from engine.store import RunRecord, RunStore

SOURCE = "cli"
_MAX_RUNS = 1_000_000


def check_textfile_path(path: str | Path) -> Path:
    """``PATH`` as node_exporter's textfile collector reads it: ``*.prom`` in an existing folder."""
    p = Path(path)
    if p.suffix != ".prom":
        raise UsageError(f"--metrics-textfile {path}: node_exporter's textfile collector reads only *.prom files")
    if not p.parent.is_dir():
        raise UsageError(f"--metrics-textfile {path}: folder {p.parent} does not exist")
    return p


class _JournalRuns(Collector):
    def __init__(self, journal: RunStore, now: float) -> None:
        self.journal, self.now = journal, now

    def collect(self) -> Iterator[Metric]:
        runs = [r for r in self.journal.list_runs(limit=_MAX_RUNS, sources=(SOURCE,)) if r.source == SOURCE]
        finished = CounterMetricFamily("runbook_cli_runs_finished", "CLI runs that ended, by final state",
                                       labels=["runbook", "state"])
        counts: dict[tuple[str, str], int] = {}
        latest: dict[tuple[str, str], RunRecord] = {}
        for r in runs:  # newest first
            if not r.state.is_final:
                continue
            counts[(r.runbook, r.state.value)] = counts.get((r.runbook, r.state.value), 0) + 1
            for node in r.nodes or [""]:
                latest.setdefault((r.runbook, node), r)
        for (runbook, state), n in sorted(counts.items()):
            finished.add_metric([runbook, state], float(n))
        yield finished
        when = GaugeMetricFamily("runbook_cli_run_last_finished_timestamp_seconds",
                                 "When the latest CLI run per runbook and node ended",
                                 labels=["runbook", "node", "state"])
        duration = GaugeMetricFamily("runbook_cli_run_last_duration_seconds",
                                     "Duration of the latest CLI run per runbook and node", labels=["runbook", "node"])
        code = GaugeMetricFamily("runbook_cli_run_last_exit_code",
                                 "Exit code of the latest CLI run per runbook and node", labels=["runbook", "node"])
        steps = GaugeMetricFamily("runbook_cli_step_last_duration_seconds",
                                  "Step durations of the latest CLI run per runbook and node",
                                  labels=["runbook", "node", "step", "status"])
        for (runbook, node), r in sorted(latest.items()):
            end = r.finished or r.created
            when.add_metric([runbook, node, r.state.value], end)
            duration.add_metric([runbook, node], max(0.0, end - (r.started or r.created)))
            if r.exit_code is not None:
                code.add_metric([runbook, node], float(r.exit_code))
            for e in self.journal.events(r.id):
                if e.kind != "step.outcome" or not e.step:
                    continue
                began, ended = e.data.get("started_at"), e.data.get("finished_at")
                if isinstance(began, int | float) and isinstance(ended, int | float):
                    steps.add_metric([runbook, node, e.step, str(e.data.get("status", ""))],
                                     max(0.0, float(ended) - float(began)))
        yield from (when, duration, code, steps)
        written = GaugeMetricFamily("runbook_cli_textfile_written_timestamp_seconds", "When this file was written")
        written.add_metric([], self.now)
        yield written


def write_textfile(path: Path, store: RunStore | Path | None, *, now: float | None = None) -> None:
    """Rewrite ``path`` from the run store (or the SQLite journal at that path), atomically.
    Errors propagate to the caller."""
    with opened(store) as journal:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_JournalRuns(journal, time.time() if now is None else now))
        write_to_textfile(str(path), registry)
