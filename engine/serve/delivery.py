"""Delivery of notifications: one lane (a bounded queue and a thread) per target, retries with backoff.

A *target* (the generic webhook, PagerDuty Events v2, PagerDuty REST, Slack) turns a notification
into HTTP requests; this module sends them. Each target has its own lane, so a target that is down
or rate-limited delays only itself: never a run (``Lane.put`` never blocks; a full lane drops the
notification and counts it), never a webhook answer, never another target. Within a lane requests
go out in order (a PagerDuty note before its resolve, a Slack message before its update).

A request that meets a transport error, ``429`` or a ``5xx`` is retried ``attempts - 1`` times,
waiting ``Retry-After`` (seconds or an HTTP date; PagerDuty's ``ratelimit-reset`` too) when the
answer gives one, else ``backoff * 2**n`` (at most ``max_backoff``); other answers are final.
Waiting is interruptible: ``close`` ends it at once. Every outcome is counted per target
(``TargetStats``; ``observer`` feeds the metrics) and the last error is kept with its time for
``/readyz``. Errors are logged without request bodies or headers: secrets never reach a log.
This module knows nothing of runs.
"""

from __future__ import annotations

import email.utils
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import httpx

from engine.secrecy import mask_http_log

log = logging.getLogger(__name__)
Observer = Callable[[str, str], None]  # (target, outcome: success | failure | retry | dropped)
# accept(response) -> None when the answer means success, else the error (Slack: HTTP 200 with ok: false)
Accept = Callable[[httpx.Response], str | None]


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5  # tries per request, the first included
    backoff: float = 1.0  # seconds before the first retry; doubled each time
    max_backoff: float = 60.0
    max_retry_after: float = 300.0  # a Retry-After longer than this is cut to it

    def delay(self, attempt: int, response: httpx.Response | None) -> float:
        """Seconds to wait before try ``attempt + 1`` (``attempt`` counts from 1)."""
        if response is not None:
            told = retry_after(response)
            if told is not None:
                return min(max(told, 0.0), self.max_retry_after)
        return min(self.backoff * 2 ** (attempt - 1), self.max_backoff)


def retry_after(response: httpx.Response) -> float | None:
    """Seconds the server asks us to wait: ``Retry-After`` (delta seconds or HTTP date), else
    PagerDuty's ``ratelimit-reset``; None when it says nothing usable."""
    for name in ("retry-after", "ratelimit-reset"):
        raw = response.headers.get(name, "").strip()
        if not raw:
            continue
        try:
            return float(raw)
        except ValueError:
            pass
        try:
            when = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError):
            continue
        return when.timestamp() - time.time()
    return None


def retryable(status: int) -> bool:
    return status == 429 or status >= 500


@dataclass
class TargetStats:
    sent: int = 0  # requests delivered
    failed: int = 0  # requests given up (after retries, or refused), notifications dropped
    retries: int = 0
    last_error: str = ""
    last_error_at: float | None = None

    def as_dict(self) -> dict[str, Any]:
        at = None if self.last_error_at is None else \
            datetime.fromtimestamp(self.last_error_at, UTC).isoformat(timespec="seconds")
        return {"sent": self.sent, "failed": self.failed, "retries": self.retries,
                "last_error": self.last_error or None, "last_error_at": at}


class Sender:
    """Sends one request with the lane's retries; what a target's ``deliver`` calls."""

    def __init__(self, lane: Lane, client: httpx.Client) -> None:
        self._lane = lane
        self._client = client

    def __call__(self, method: str, url: str, body: bytes | None, headers: Mapping[str, str], *,
                 what: str, accept: Accept | None = None) -> httpx.Response | None:
        """The final answer when it was a success; None when given up (counted, logged)."""
        lane, policy = self._lane, self._lane.retry
        for attempt in range(1, max(policy.attempts, 1) + 1):
            response: httpx.Response | None = None
            try:
                response = self._client.request(method, url, content=body, headers=dict(headers))
            except httpx.HTTPError as e:  # connection refused, timeout, protocol error
                error, again = f"{type(e).__name__}: {mask_http_log(str(e))[:200]}", True  # no URL path: a credential
            else:
                if response.status_code >= 300:
                    error, again = f"HTTP {response.status_code}", retryable(response.status_code)
                else:
                    problem = accept(response) if accept is not None else None
                    if problem is None:
                        lane.record("success")
                        return response
                    error, again = problem[:300], False
            if not again or attempt >= policy.attempts or lane.stopping.is_set():
                lane.record("failure", f"{what}: {error}")
                log.warning("notification target %s: %s: %s (given up after %d attempts)", lane.name, what,
                            error, attempt)
                return None
            lane.record("retry")
            delay = policy.delay(attempt, response)
            log.info("notification target %s: %s: %s; retry %d in %.1fs", lane.name, what, error, attempt, delay)
            if lane.stopping.wait(delay):
                lane.record("failure", f"{what}: {error} (shutting down)")
                return None
        return None  # pragma: no cover - the loop returns


class Target(Protocol):
    """One place notifications go (``engine.serve.notify``, ``pagerduty_rest``, ``slack``)."""

    name: str

    def wants(self, item: Any) -> bool:
        ...

    def deliver(self, item: Any, send: Sender) -> None:
        """Send what ``item`` becomes, through ``send`` (in order; may read earlier answers)."""
        ...


class Lane:
    """A target's bounded queue and the thread that delivers from it."""

    def __init__(self, target: Target, *, retry: RetryPolicy, timeout: float, max_queue: int,
                 transport: httpx.BaseTransport | None = None, observer: Observer | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.target = target
        self.name = target.name
        self.retry = retry
        self.timeout = timeout
        self.observer = observer
        self.stats = TargetStats()
        self.stopping = threading.Event()
        self._clock = clock
        self._transport = transport
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def record(self, outcome: str, error: str = "") -> None:
        with self._lock:
            if outcome == "success":
                self.stats.sent += 1
            elif outcome == "retry":
                self.stats.retries += 1
            else:
                self.stats.failed += 1
                if error:
                    self.stats.last_error, self.stats.last_error_at = error[:500], self._clock()
        if self.observer is not None:
            try:
                self.observer(self.name, outcome)
            except Exception:  # Why: counting must never break delivery
                log.exception("notification observer failed")

    def put(self, item: Any) -> None:
        """Queue ``item``; never blocks (a full lane drops it, counted)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=f"runbook-notify-{self.name}", daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.record("dropped", "queue full: notification dropped")
            log.warning("notification target %s: queue full, dropped one", self.name)

    def _loop(self) -> None:
        with httpx.Client(timeout=self.timeout, transport=self._transport, follow_redirects=False) as client:
            send = Sender(self, client)
            while True:
                item = self._queue.get()
                try:
                    if item is None:
                        return
                    self.target.deliver(item, send)
                except Exception as e:  # Why: a broken target must never break paging or runs
                    self.record("failure", f"{type(e).__name__}: {mask_http_log(str(e))[:200]}")
                    log.warning("notification target %s failed: %s: %s", self.name, type(e).__name__,
                                mask_http_log(str(e)))
                finally:
                    self._queue.task_done()

    def join(self) -> None:
        self._queue.join()

    def close(self, timeout: float) -> None:
        self.stopping.set()
        with self._lock:
            thread = self._thread
        if thread is not None and thread.is_alive():
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                return
            thread.join(timeout)
