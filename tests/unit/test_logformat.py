"""``--log-format json``: one JSON object per log line, run events with run id, step, node, event; no secret."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from engine import logformat
from engine.cli import main
from engine.journal import Journal, JournalSink


@pytest.fixture
def root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level, fmt = list(root.handlers), root.level, logformat.current_format()
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logformat._current = fmt


def test_a_record_becomes_one_json_object_with_its_run_fields_and_no_secret() -> None:
    formatter = logformat.JsonFormatter(frozenset({"s3cr3t-token-value"}))
    record = logging.LogRecord("runbook.events", logging.INFO, __file__, 1, "step.outcome %s", ("swap-off",), None)
    record.run_id, record.step, record.node, record.event = "r-1", "swap-off", "omen2", "step.outcome"
    record.reason = "sudo with s3cr3t-token-value failed"
    line = json.loads(formatter.format(record))
    assert line["msg"] == "step.outcome swap-off" and line["level"] == "info" and line["logger"] == "runbook.events"
    assert (line["run_id"], line["step"], line["node"], line["event"]) == ("r-1", "swap-off", "omen2", "step.outcome")
    assert line["reason"] == "sudo with *** failed"
    assert "status" not in line  # absent fields are left out


def test_credentials_in_the_environment_are_known_secrets() -> None:
    env = {"RUNBOOK_WEBHOOK_TOKEN": "abcd1234", "RUNBOOK_BECOME_PASSWORD": "pw-9876",
           "RUNBOOK_APPROVER_TOKEN_ALICE": "alice-xyz", "RUNBOOK_JOURNAL": "/tmp/j.sqlite", "HOME": "/root"}
    assert logformat.secrets_from_env(env) == {"abcd1234", "pw-9876", "alice-xyz"}


def test_run_events_are_logged_with_run_id_runbook_node_step_and_masked_reasons(
        tmp_path: Path, root_logging: None) -> None:
    journal = Journal(tmp_path / "j.sqlite")
    journal.add_secret("hunter2-password")
    run_id = journal.create_run("gpu-node-recovery", {"node": "omen2"}, ["omen2"])
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logformat.JsonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    sink = JournalSink(journal, run_id)
    sink.emit("step.outcome", step="swap-off", status="succeeded", reason="ran with hunter2-password",
              evidence={"token": "zzz"})
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert lines == [{**lines[0], "run_id": run_id, "runbook": "gpu-node-recovery", "node": "omen2",
                      "step": "swap-off", "event": "step.outcome", "status": "succeeded",
                      "reason": "ran with ***"}]
    assert "hunter2" not in stream.getvalue() and "zzz" not in stream.getvalue()
    assert journal.events(run_id)[0].kind == "step.outcome"  # the journal still comes first


def test_the_json_format_installs_a_json_handler_and_an_unknown_format_is_a_usage_error(root_logging: None) -> None:
    logformat.configure_logging("json")
    (handler,) = logging.getLogger().handlers
    assert isinstance(handler.formatter, logformat.JsonFormatter) and logformat.current_format() == "json"
    bad = CliRunner().invoke(main, ["--log-format", "yaml", "list"])
    assert bad.exit_code == 2 and "yaml" in bad.output
