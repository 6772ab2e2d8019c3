"""The server's run metrics: by runbook/state/trigger, step/verification/lock histograms from the run's
journal events, alert-to-run and alert-to-recovery times, guard blocks, journal errors."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.fakes import READ, FakeRunStarter, alert, served, trigger_spec

STARTS_AT = datetime.fromisoformat("2026-07-10T15:39:51+00:00").timestamp()  # alert()'s startsAt


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _outcome(run: dict[str, Any]) -> str:
    run.setdefault("events", []).extend([
        {"kind": "run.state", "time": "2026-07-10T15:40:40.000Z", "state": "running"},
        {"kind": "lock.acquired", "time": "2026-07-10T15:40:40.250Z", "node": "omen2"},
        {"kind": "guard.result", "step": "restart-kubelet", "check": "swap is off", "holds": False},
        {"kind": "verify.result", "step": "relabel", "check": "label set", "holds": True, "elapsed": 2.5},
        {"kind": "step.outcome", "step": "relabel", "status": "succeeded", "started_at": 100.0,
         "finished_at": 103.0}])
    return "succeeded"


def test_a_run_s_figures_come_from_its_journal_events_and_the_alert_s_start() -> None:
    clock = [STARTS_AT + 42.0]
    starter = FakeRunStarter([trigger_spec(mode="auto", matchers=('node=~"omen.*"',))], outcome=_outcome)
    with served("auto", starter=starter, clock=lambda: clock[0]) as s:
        assert s.post_alerts(alert("omen2")).status_code == 202
        s.idle()
        m = _samples(s.client.get("/metrics", headers=READ).text)
    rb = ("runbook", "gpu-node-recovery")
    assert m[("runbook_serve_runs_finished_total", (rb, ("state", "succeeded"), ("trigger", "alertmanager")))] == 1
    assert m[("runbook_serve_alert_to_run_start_seconds_sum", (rb,))] == 42.0
    assert m[("runbook_serve_alert_to_recovery_seconds_count", (rb,))] == 1
    assert m[("runbook_serve_step_seconds_sum", (rb, ("status", "succeeded"), ("step", "relabel")))] == 3.0
    assert m[("runbook_serve_verify_seconds_sum", (("holds", "true"), rb, ("step", "relabel")))] == 2.5
    assert m[("runbook_serve_guard_blocks_total", (("guard", "swap is off"), rb))] == 1
    assert abs(m[("runbook_serve_lock_wait_seconds_sum", (rb,))] - 0.25) < 1e-6


class _BrokenReads(FakeRunStarter):
    def run(self, run_id: str) -> Any:
        raise OSError("database disk image is malformed")


def test_a_journal_that_cannot_be_read_is_counted_and_the_outcome_still_notified() -> None:
    starter = _BrokenReads([trigger_spec(mode="auto", matchers=('node=~"omen.*"',))])
    with served("auto", starter=starter) as s:
        assert s.post_alerts(alert("omen2")).status_code == 202
        s.idle()
        m = _samples(s.client.get("/metrics", headers=READ).text)
        assert s.events()[-1] == "finished"
    assert m[("runbook_serve_journal_errors_total", (("operation", "read-run"),))] == 1
