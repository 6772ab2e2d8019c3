"""Notifications for CLI runs (``--notify-config``): the server's targets, told when a run ends."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from engine.cli import main
from engine.cli_notify import notifications_since, send_cli_notifications
from engine.journal import Journal
from engine.serve.config import load_config
from engine.serve.notify import verify_webhook
from tests.fakes.notify import ROUTING_KEY, SECRET, Receiver, running


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with running() as r:
        yield r


def _config(tmp_path: Path, receiver: Receiver) -> Path:
    path = tmp_path / "notify.yaml"
    path.write_text(yaml.safe_dump({"public_url": "https://runbook.example.org", "notify": {
        "url": receiver.url + "/hook", "secret": SECRET,
        "pagerduty": {"routing_key": ROUTING_KEY, "url": receiver.url + "/v2/enqueue"}}}))
    return path


def _run(journal: Journal, node: str, state: str, *, source: str = "cli") -> str:
    run_id = journal.create_run("gpu-node-recovery", {"node": node}, [node], source=source)
    journal.set_state(run_id, "running")
    journal.append(run_id, "step.outcome", step="relabel-container", status="succeeded", reason="",
                   started_at=1000.0, finished_at=1001.5)
    if state == "blocked":
        journal.append(run_id, "run.blocked", reason="precondition down-only-because-of-swap: containerd.sock")
    journal.set_state(run_id, state, exit_code={"succeeded": 0, "blocked": 3}[state])
    return run_id


def test_cli_runs_that_ended_during_the_command_are_told_to_the_webhook_and_pagerduty(
        tmp_path: Path, receiver: Receiver) -> None:
    db = tmp_path / "journal.sqlite"
    journal = Journal(db)
    _run(journal, "omen1", "succeeded")  # before the command: not told again
    time.sleep(0.05)
    since = time.time()
    ok = _run(journal, "omen2", "succeeded")
    blocked = _run(journal, "gpu-3090-2", "blocked")
    _run(journal, "omen3", "succeeded", source="alertmanager")  # the server tells its own runs
    journal.close()
    config = load_config(_config(tmp_path, receiver), env={})
    assert send_cli_notifications(config, db, since, pagerduty_key="incident-42") == 4  # 2 steps, 2 ends
    hooks = [json.loads(b)["runbook_event"] for b, _ in receiver.hooks]
    assert [(h["event"], h["node"], h["state"]) for h in hooks] == [
        ("finished", "omen2", "succeeded"), ("blocked", "gpu-3090-2", "blocked")]
    assert hooks[1]["report"].endswith("run blocked: precondition down-only-because-of-swap: containerd.sock")
    assert hooks[0]["link"] == f"https://runbook.example.org/ui/runs/{ok}"
    assert all(verify_webhook(b, h, SECRET, now=time.time()) for b, h in receiver.hooks)
    assert receiver.refused == []
    assert [(e["event_action"], e.get("payload", {}).get("class")) for e in receiver.events] == [
        ("trigger", "step"), ("trigger", "finished"), ("resolve", None), ("trigger", "step"), ("trigger", "blocked")]
    assert {e["dedup_key"] for e in receiver.events} == {"incident-42"}
    assert receiver.events[-1]["links"][0]["href"].endswith(f"/ui/runs/{blocked}")


def test_without_a_pagerduty_key_a_cli_run_never_opens_an_incident(tmp_path: Path, receiver: Receiver) -> None:
    db = tmp_path / "journal.sqlite"
    since = time.time()
    journal = Journal(db)
    _run(journal, "omen2", "succeeded")
    journal.close()
    found = notifications_since(db, since)
    assert [n.event for n in found] == ["step", "finished"]
    send_cli_notifications(load_config(_config(tmp_path, receiver), env={}), db, since)
    assert receiver.events == [] and len(receiver.hooks) == 1


@pytest.mark.parametrize(("content", "needle"), [
    ("notify: [\n", "invalid YAML"),
    ("notify:\n  url: ftp://x\n", "notify.url must be an http(s) URL"),
    ("notify:\n  secret: short\n", "notify.secret: is shorter than 16 bytes"),
])
def test_a_bad_notify_config_is_refused_with_its_location_before_anything_runs(
        tmp_path: Path, content: str, needle: str) -> None:
    bad = tmp_path / "notify.yaml"
    bad.write_text(content)
    env = {"RUNBOOK_JOURNAL": str(tmp_path / "journal.sqlite"), "KUBECONFIG": "/nonexistent/kubeconfig"}
    r = CliRunner().invoke(main, ["run", "gpu-node-recovery", "--node", "omen2", "--yes",
                                  "--notify-config", str(bad)], env=env)
    assert r.exit_code == 2 and needle in r.output and str(bad) in r.output, r.output
    assert not (tmp_path / "journal.sqlite").exists() or Journal(tmp_path / "journal.sqlite").list_runs() == []


def test_the_command_exit_code_stands_when_the_targets_are_unreachable(tmp_path: Path) -> None:
    cfg = tmp_path / "notify.yaml"
    cfg.write_text("notify:\n  url: http://127.0.0.1:9/hook\n  timeout: 1s\n")
    env = {"RUNBOOK_JOURNAL": str(tmp_path / "journal.sqlite"), "KUBECONFIG": "/nonexistent/kubeconfig"}
    r = CliRunner().invoke(main, ["run", "no-such-runbook", "--node", "omen2", "--notify-config", str(cfg)], env=env)
    assert r.exit_code == 2, r.output


def test_the_signing_secret_can_never_be_a_senders_token() -> None:
    from engine.errors import UsageError

    needle = "RUNBOOK_NOTIFY_SECRET: the same token is also given to RUNBOOK_WEBHOOK_TOKEN"
    with pytest.raises(UsageError, match=needle):
        load_config(None, env={"RUNBOOK_WEBHOOK_TOKEN": "x" * 20, "RUNBOOK_NOTIFY_SECRET": "x" * 20})


def test_a_command_tells_only_about_the_runs_it_created_or_resumed_never_another_operators(
        tmp_path: Path, receiver: Receiver) -> None:
    """#25 item 14: two operators share one store; each command's --notify-config reports its own runs."""
    from engine.cli import notify_option
    from engine.settings import Settings

    db = tmp_path / "journal.sqlite"
    seed = Journal(db)
    parked = seed.create_run("gpu-node-recovery", {"node": "omen4"}, ["omen4"], source="alertmanager")
    seed.set_state(parked, "interrupted")
    seed.close()
    cfg = _config(tmp_path, receiver)
    mine: list[str] = []

    def command(settings: Settings) -> int:
        journal = settings.open_journal()
        mine.append(_run(journal, "omen2", "succeeded"))  # created by this command
        other = Journal(db)  # meanwhile another operator's command, on the same store
        _run(other, "omen3", "succeeded")
        other.close()
        assert journal.claim(parked)  # this command resumes the server's interrupted run
        journal.set_state(parked, "failed", exit_code=1)
        return 0

    settings = Settings(journal=db)
    assert notify_option(command)(settings, notify_config=str(cfg), pagerduty_dedup_key="") == 0
    told = sorted((h["runbook_event"]["node"], h["runbook_event"]["event"])
                  for h in (json.loads(b) for b, _ in receiver.hooks))
    assert told == [("omen2", "finished"), ("omen4", "failed")], told  # never omen3
