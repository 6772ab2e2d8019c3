"""A resolved alert is recorded against the run its firing started, once, and never starts anything."""

from __future__ import annotations

from tests.fakes import Served, alert, served


def _events(s: Served, run_id: str) -> list[dict[str, object]]:
    return list(s.starter.run(run_id).get("events", []))


def test_the_resolution_of_an_alert_that_started_a_run_is_recorded_against_that_run_once() -> None:
    with served() as s:
        run_id = s.post_alerts(alert("omen2", fingerprint="fp-1")).json()["runs"][0]
        r = s.post_alerts(alert("omen2", status="resolved", fingerprint="fp-1"))
        assert r.status_code == 200 and r.json()["status"] == "ignored", r.text
        (decision,) = r.json()["decisions"]
        assert decision["run_id"] == run_id and f"recorded against run {run_id}" in decision["reason"]
        assert _events(s, run_id) == [{"kind": "alert.resolved", "fingerprint": "fp-1",
                                       "alert": decision["alert"], "ends_at": "2026-07-10T16:39:51+00:00"}]
        again = s.post_alerts(alert("omen2", status="resolved", fingerprint="fp-1"))
        assert "recorded" not in again.json()["decisions"][0]["reason"]
        assert len(_events(s, run_id)) == 1
        assert len(s.starter.requests) == 1  # nothing new started


def test_a_resolved_alert_whose_firing_started_nothing_is_only_ignored() -> None:
    with served() as s:
        run_id = s.post_alerts(alert("omen2", fingerprint="fp-1")).json()["runs"][0]
        dup = s.post_alerts(alert("omen2", alertname="KubeNodeUnreachable", fingerprint="fp-2"))
        assert dup.json()["decisions"][0]["outcome"] == "duplicate"
        r = s.post_alerts(alert("omen2", alertname="KubeNodeUnreachable", status="resolved", fingerprint="fp-2"))
        assert r.json()["decisions"][0]["reason"] == "resolved alerts never start runs"
        assert _events(s, run_id) == []
