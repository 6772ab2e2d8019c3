"""Prometheus metrics of ``runbook serve``, in a registry of their own (one per app).

Names (all prefixed ``runbook_serve_``):

* ``runs_started_total{runbook,mode}``: runs created (mode ``auto`` or ``approve``);
* ``runs_succeeded_total{runbook}``, ``runs_failed_total{runbook}``;
* ``runs_blocked_total{runbook,reason}``: something the guards kept from happening
  (``excluded``, ``kured-lock``, ``cluster-unreadable``, ``approvals-limit``, ``queue-full``,
  ``run-blocked``), and automatic runs turned into approve-mode runs (``breaker``);
* ``webhook_requests_total{endpoint,outcome}``: ``started``, ``nothing-started``, ``duplicate``,
  ``ignored``, ``unauthorized``, ``bad-request``, ``forbidden``, ``too-large``, ``unavailable``;
* ``webhook_seconds{endpoint}``: time to answer a webhook;
* ``signature_verify_seconds``: PagerDuty signature verification time;
* ``breaker_open{kind,key}``: 1 while a breaker is open (``node`` after a failed automatic run,
  ``runbook`` while its rate limit is reached, ``cluster`` while too much is unhealthy);
* ``runs_finished_total{runbook,state,trigger}``: runs this server saw end, by final state and by
  what paged (``alertmanager``, ``pagerduty``);
* ``step_seconds{runbook,step,status}``, ``verify_seconds{runbook,step,holds}``: histograms, from the
  run's journal events (``step.outcome`` started/finished times, ``verify.result`` elapsed);
* ``alert_to_run_start_seconds{runbook}``: from the alert's ``startsAt`` to the run's creation;
  ``alert_to_recovery_seconds{runbook}``: from ``startsAt`` to the end of a succeeded run;
* ``guard_blocks_total{runbook,guard}``: step guards that did not hold (the check, cut to 100 chars);
* ``lock_wait_seconds{runbook}``: from the event before ``lock.acquired`` (the run being claimed) to
  its node Lease being acquired;
* ``journal_errors_total{operation}``: journal/store reads or writes that failed in the server;
* ``notifications_total{target,outcome}``: notification requests per target (``webhook``,
  ``pagerduty-events``, ``pagerduty-rest``, ``slack``) by outcome: ``success``, ``failure`` (given up
  after retries, or refused), ``retry`` (one per retry), ``dropped`` (the target's queue was full).

This module only counts; it decides nothing and never raises into a request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_SLOW = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServeMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.runs_started = Counter("runbook_serve_runs_started", "Runs created by the server",
                                    ["runbook", "mode"], registry=r)
        self.runs_succeeded = Counter("runbook_serve_runs_succeeded", "Runs that succeeded",
                                      ["runbook"], registry=r)
        self.runs_failed = Counter("runbook_serve_runs_failed", "Runs that failed", ["runbook"], registry=r)
        self.runs_blocked = Counter("runbook_serve_runs_blocked",
                                    "Runs the guards stopped or turned into approve-mode runs",
                                    ["runbook", "reason"], registry=r)
        self.webhook_requests = Counter("runbook_serve_webhook_requests", "Webhook requests by outcome",
                                        ["endpoint", "outcome"], registry=r)
        self.webhook_seconds = Histogram("runbook_serve_webhook_seconds", "Time to answer a webhook",
                                         ["endpoint"], buckets=_FAST, registry=r)
        self.verify_seconds = Histogram("runbook_serve_signature_verify_seconds",
                                        "PagerDuty signature verification time", buckets=_FAST, registry=r)
        self.breaker_open = Gauge("runbook_serve_breaker_open", "1 while a breaker is open",
                                  ["kind", "key"], registry=r)

        self.runs_finished = Counter("runbook_serve_runs_finished", "Runs that ended, by final state and trigger",
                                     ["runbook", "state", "trigger"], registry=r)
        self.step_seconds = Histogram("runbook_serve_step_seconds", "Step durations", ["runbook", "step", "status"],
                                      buckets=_SLOW, registry=r)
        self.verify_seconds_hist = Histogram("runbook_serve_verify_seconds", "Verification durations",
                                             ["runbook", "step", "holds"], buckets=_SLOW, registry=r)
        self.alert_to_run_start = Histogram("runbook_serve_alert_to_run_start_seconds",
                                            "From the alert's startsAt to the run's creation", ["runbook"],
                                            buckets=_SLOW, registry=r)
        self.alert_to_recovery = Histogram("runbook_serve_alert_to_recovery_seconds",
                                           "From the alert's startsAt to the end of a succeeded run", ["runbook"],
                                           buckets=_SLOW, registry=r)
        self.guard_blocks = Counter("runbook_serve_guard_blocks", "Step guards that did not hold",
                                    ["runbook", "guard"], registry=r)
        self.lock_wait_seconds = Histogram("runbook_serve_lock_wait_seconds",
                                           "Until the node Lease was acquired", ["runbook"],
                                           buckets=_FAST + _SLOW[3:], registry=r)
        self.journal_errors = Counter("runbook_serve_journal_errors", "Journal/store operations that failed",
                                      ["operation"], registry=r)
        self.notifications = Counter("runbook_serve_notifications", "Notification requests by target and outcome",
                                     ["target", "outcome"], registry=r)

    def notification_result(self, target: str, outcome: str) -> None:
        """One notification request's outcome (``engine.serve.delivery``'s observer)."""
        self.notifications.labels(target=target, outcome=outcome).inc()

    def observe_run(self, runbook: str, events: Sequence[Mapping[str, Any]]) -> None:
        """Step, verification, guard and lock figures of one ended run, from its journal events
        (``as_dict`` form: ``kind``, ``step``, ``time`` and the event's data)."""
        previous: float | None = None
        for e in events:
            kind, step = e.get("kind"), str(e.get("step") or "")
            at = _ts(e.get("time"))
            if kind == "step.outcome":
                a, b = e.get("started_at"), e.get("finished_at")
                if isinstance(a, int | float) and isinstance(b, int | float):
                    self.step_seconds.labels(runbook=runbook, step=step, status=str(e.get("status", ""))
                                             ).observe(max(0.0, float(b) - float(a)))
            elif kind == "verify.result" and isinstance(e.get("elapsed"), int | float):
                self.verify_seconds_hist.labels(runbook=runbook, step=step, holds=str(bool(e.get("holds"))).lower()
                                                ).observe(max(0.0, float(e["elapsed"])))
            elif kind == "guard.result" and e.get("holds") is not True:
                self.guard_blocks.labels(runbook=runbook, guard=str(e.get("check", ""))[:100]).inc()
            elif kind == "lock.acquired" and previous is not None and at is not None:
                self.lock_wait_seconds.labels(runbook=runbook).observe(max(0.0, at - previous))
            previous = at if at is not None else previous

    def set_breaker(self, kind: str, key: str, is_open: bool) -> None:
        self.breaker_open.labels(kind=kind, key=key).set(1 if is_open else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _ts(iso: Any) -> float | None:
    if not isinstance(iso, str):
        return None
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
