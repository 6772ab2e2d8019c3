"""Notification delivery: retries with backoff off the run's thread, one lane per target, counted."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx

from engine.serve.delivery import RetryPolicy, retry_after
from engine.serve.notify import Notification, Notifier, PagerDutyTarget

ROUTING_KEY = "R0ut1ngK3yF0rT3stsXXXXXXXXXXXXXX"


def test_the_wait_before_a_retry_is_what_retry_after_says_else_an_exponential_backoff() -> None:
    policy = RetryPolicy(attempts=5, backoff=1.0, max_backoff=10.0, max_retry_after=300.0)
    assert policy.delay(1, httpx.Response(429, headers={"Retry-After": "7"})) == 7.0
    later = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    assert 25 < policy.delay(1, httpx.Response(503, headers={"Retry-After": later})) <= 30
    assert policy.delay(1, httpx.Response(429, headers={"ratelimit-reset": "12"})) == 12.0  # PagerDuty's header
    assert policy.delay(1, httpx.Response(429, headers={"Retry-After": "86400"})) == 300.0  # capped
    assert [policy.delay(n, httpx.Response(500)) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 8.0, 10.0]
    assert retry_after(httpx.Response(429, headers={"Retry-After": "soon"})) is None


def test_429_and_5xx_and_outages_are_retried_other_refusals_are_final_and_each_is_counted() -> None:
    answers = [httpx.Response(429, headers={"Retry-After": "0"}), httpx.Response(502), httpx.Response(202),
               httpx.Response(400)]
    seen: list[str] = []
    counted: list[tuple[str, str]] = []

    def receive(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if len(seen) == 1:
            raise httpx.ConnectError("connection refused")
        return answers[len(seen) - 2]

    n = Notifier(None, pagerduty=PagerDutyTarget(ROUTING_KEY, url="http://127.0.0.1:9/v2/enqueue"),
                 transport=httpx.MockTransport(receive), retry=RetryPolicy(attempts=5, backoff=0.01),
                 observer=lambda target, outcome: counted.append((target, outcome)))
    n.notify(Notification("failed", "rb", run_id="r-1", alert_key="fp-1"))  # outage, 429, 502, then 202
    n.notify(Notification("failed", "rb", run_id="r-2", alert_key="fp-2"))  # 400: final at once
    assert n.flush(5)
    assert len(seen) == 5
    assert counted == [("pagerduty-events", o) for o in ("retry", "retry", "retry", "success", "failure")]
    health = n.health()["pagerduty-events"]
    assert (health["sent"], health["failed"], health["retries"]) == (1, 1, 3)
    assert health["last_error"] == "trigger for r-2: HTTP 400"
    n.close()


def test_a_target_that_hangs_delays_neither_the_caller_nor_the_other_targets() -> None:
    release = threading.Event()
    pagerduty: list[bytes] = []

    def receive(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/hook":
            release.wait(15)  # the webhook receiver hangs
            return httpx.Response(200)
        pagerduty.append(request.content)
        return httpx.Response(202)

    n = Notifier("http://127.0.0.1:9/hook", pagerduty=PagerDutyTarget(ROUTING_KEY, url="http://127.0.0.1:9/v2"),
                 transport=httpx.MockTransport(receive))
    started = time.monotonic()
    for i in range(5):
        n.notify(Notification("failed", "rb", run_id=f"r-{i}", alert_key=f"fp-{i}"))
    assert time.monotonic() - started < 1.0
    deadline = time.monotonic() + 5
    while len(pagerduty) < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(pagerduty) == 5 and not release.is_set()  # PagerDuty got all five while the webhook hung
    release.set()
    assert n.flush(5)
    n.close()
