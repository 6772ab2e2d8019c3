"""``--metrics-textfile``: CLI runs as node_exporter textfile metrics, rewritten from the journal."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from engine.cli import main
from engine.errors import UsageError
from engine.journal import Journal
from engine.textfile_metrics import check_textfile_path, write_textfile


def _samples(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(path.read_text()) for s in f.samples}


def _run(journal: Journal, runbook: str, node: str, state: str, code: int, *, source: str = "cli",
         steps: tuple[tuple[str, str, float], ...] = ()) -> str:
    run_id = journal.create_run(runbook, {"node": node}, [node], source=source)
    journal.set_state(run_id, "running")
    for step, status, seconds in steps:
        journal.append(run_id, "step.outcome", step=step, status=status, started_at=1000.0,
                       finished_at=1000.0 + seconds)
    journal.set_state(run_id, state, exit_code=code)
    return run_id


def test_the_textfile_counts_finished_cli_runs_and_describes_the_latest_per_node(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite")
    _run(journal, "gpu-node-recovery", "omen2", "failed", 1)
    _run(journal, "gpu-node-recovery", "omen2", "succeeded", 0,
         steps=(("relabel-container", "succeeded", 1.5), ("swap-off", "skipped", 0.25)))
    _run(journal, "gpu-node-recovery", "gpu-3090-2", "blocked", 3)
    _run(journal, "gpu-node-recovery", "omen2", "succeeded", 0, source="alertmanager")  # the server's
    journal.close()
    out = tmp_path / "runbook.prom"
    write_textfile(out, tmp_path / "journal.sqlite", now=1234.0)
    s = _samples(out)
    rb = ("runbook", "gpu-node-recovery")
    assert s[("runbook_cli_runs_finished_total", (rb, ("state", "succeeded")))] == 1
    assert s[("runbook_cli_runs_finished_total", (rb, ("state", "failed")))] == 1
    assert s[("runbook_cli_runs_finished_total", (rb, ("state", "blocked")))] == 1
    assert s[("runbook_cli_run_last_exit_code", (("node", "omen2"), rb))] == 0  # the newest, not the failed one
    assert s[("runbook_cli_run_last_exit_code", (("node", "gpu-3090-2"), rb))] == 3
    assert ("runbook_cli_run_last_finished_timestamp_seconds", (("node", "omen2"), rb, ("state", "succeeded"))) in s
    assert s[("runbook_cli_step_last_duration_seconds",
              (("node", "omen2"), rb, ("status", "succeeded"), ("step", "relabel-container")))] == 1.5
    assert s[("runbook_cli_step_last_duration_seconds",
              (("node", "omen2"), rb, ("status", "skipped"), ("step", "swap-off")))] == 0.25
    assert s[("runbook_cli_textfile_written_timestamp_seconds", ())] == 1234.0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("runbook.prom")] == ["runbook.prom"]


@pytest.mark.parametrize(("path", "needle"), [("metrics.txt", "only *.prom"),
                                             ("missing/runbook.prom", "does not exist")])
def test_a_textfile_path_node_exporter_would_not_read_is_refused(tmp_path: Path, path: str, needle: str) -> None:
    with pytest.raises(UsageError, match=re.escape(needle)):
        check_textfile_path(tmp_path / path)


def test_a_bad_textfile_path_is_refused_before_anything_runs_and_a_good_one_is_written_even_on_error(
        tmp_path: Path) -> None:
    env = {"RUNBOOK_JOURNAL": str(tmp_path / "journal.sqlite"), "KUBECONFIG": "/nonexistent/kubeconfig"}
    bad = CliRunner().invoke(main, ["run", "gpu-node-recovery", "--node", "omen2", "--metrics-textfile",
                                    str(tmp_path / "m.txt")], env=env)
    assert bad.exit_code == 2 and "only *.prom" in bad.output, bad.output
    assert not (tmp_path / "journal.sqlite").exists() or Journal(tmp_path / "journal.sqlite").list_runs() == []
    good = tmp_path / "runbook.prom"
    result = CliRunner().invoke(main, ["run", "no-such-runbook", "--node", "omen2", "--metrics-textfile",
                                       str(good)], env=env)
    assert result.exit_code == 2, result.output  # the command's own exit code stands
    assert ("runbook_cli_textfile_written_timestamp_seconds", ()) in _samples(good)
