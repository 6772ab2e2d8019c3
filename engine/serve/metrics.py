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
  ``runbook`` while its rate limit is reached, ``cluster`` while too much is unhealthy).

This module only counts; it decides nothing and never raises into a request.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

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

    def set_breaker(self, kind: str, key: str, is_open: bool) -> None:
        self.breaker_open.labels(kind=kind, key=key).set(1 if is_open else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
