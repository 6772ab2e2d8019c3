"""Notifications: a generic webhook with Slack-compatible JSON, and PagerDuty Events API v2.

Events: ``started``, ``waiting-approval``, ``step`` (one per step outcome), ``finished``, ``failed``,
``blocked``. Each webhook POST carries ``{"text": "<one readable line>", "runbook_event": {event,
run_id, runbook, node, state, mode, reason, warnings, report, link, ...}}``; Slack shows ``text`` and
ignores the rest. ``link`` is the run's console page, ``<public_url>/ui/runs/<run id>``, when
``public_url`` is configured. With
``notify.secret`` every webhook POST is signed: ``X-Runbook-Signature: t=<unix seconds>,v1=<hex of
HMAC-SHA256(secret, "<t>.<body>")>`` (``verify_webhook`` is what a receiver does). PagerDuty events
are built by ``engine.serve.pagerduty_events``. Delivery happens in one background thread through a
bounded queue: a slow or dead receiver never delays a webhook answer or a run, and failures are
logged, never raised. Secrets are never put in a notification.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal
from urllib.parse import quote

import httpx

from engine.secrecy import mask_http_log, quiet_http_client_logs, register

log = logging.getLogger(__name__)
MAX_NOTIFICATION_BYTES = 60 * 1024  # every POST stays under 64 KiB whatever an alert carried
_MAX_FIELD = 2048
_MAX_WARNINGS = 5
SIGNATURE_HEADER = "X-Runbook-Signature"
_MAX_REPORT = 16 * 1024
_ICONS = {"step": ":small_blue_diamond:", "started": ":arrow_forward:",
          "waiting-approval": ":raised_hand:", "finished": ":white_check_mark:",
          "failed": ":x:", "blocked": ":no_entry:"}


@dataclass(frozen=True)
class Notification:
    event: str  # started | waiting-approval | step | finished | failed | blocked
    runbook: str
    node: str | None = None
    run_id: str | None = None
    mode: str | None = None
    reason: str = ""
    warnings: Sequence[str] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    state: str | None = None  # the run's state when this was sent
    report: str = ""  # the run's report (final notifications)
    link: str | None = None  # <public_url>/ui/runs/<id> (the console), when public_url is configured
    alert_key: str = ""  # the alert fingerprint or PagerDuty incident id that paged
    group_key: str = ""  # Alertmanager's groupKey of that page (PagerDuty dedup_key)
    pagerduty_key: str = ""  # an explicit PagerDuty dedup_key (CLI: --pagerduty-dedup-key)

    def text(self) -> str:
        icon = _ICONS.get(self.event, "")
        target = f" on {self.node}" if self.node else ""
        run = f" run {self.run_id}" if self.run_id else ""
        what = self.event
        if self.event == "step":
            what = f"step {self.extra.get('step', '?')} {self.extra.get('status', '')}".strip()
        head = f"{icon} runbook {self.runbook}{target}:{run} {what}".strip()
        if self.mode:
            head += f" ({self.mode} mode)"
        parts = [head]
        if self.reason:
            parts.append(self.reason)
        if self.event == "waiting-approval" and self.extra.get("plan_digest"):
            parts.append(f"approve with: runbook approve {self.run_id} --plan-digest {self.extra['plan_digest']}")
        parts += [f"warning: {w}" for w in self.warnings]
        if self.link:
            parts.append(f"open: {self.link}")  # the run's console page
        return "\n".join(parts)

    def payload(self) -> dict[str, Any]:
        """The POST body, bounded (< 64 KiB): long fields are cut with a marker, at most 5 warnings,
        10 extra fields of 1 KiB."""
        b = self.bounded()
        return {"text": b.text(), "runbook_event": {
            "event": b.event, "run_id": b.run_id, "runbook": b.runbook, "node": b.node,
            "state": b.state, "mode": b.mode, "reason": b.reason, "warnings": list(b.warnings),
            "report": b.report, "link": b.link, **{k: v for k, v in b.extra.items() if k not in _KEYS}}}

    def bounded(self) -> Notification:
        warnings = [_cut(w) for w in list(self.warnings)[:_MAX_WARNINGS]]
        if len(self.warnings) > _MAX_WARNINGS:
            warnings.append(f"... and {len(self.warnings) - _MAX_WARNINGS} more warnings")
        extra = {_cut(str(k), 64): (_cut(v, 1024) if isinstance(v, str) else v if isinstance(v, int | float | None)
                                   else _cut(str(v), 1024))
                 for k, v in list(self.extra.items())[:10]}
        return Notification(self.event, _cut(self.runbook, 256), node=_cut(self.node, 256) if self.node else None,
                            run_id=self.run_id, mode=self.mode, reason=_cut(self.reason), warnings=warnings,
                            extra=extra, state=self.state, report=_cut(self.report, _MAX_REPORT),
                            link=_cut(self.link, 1024) if self.link else None, alert_key=_cut(self.alert_key, 200),
                            group_key=_cut(self.group_key, 4096), pagerduty_key=self.pagerduty_key[:255])


_KEYS = frozenset({"event", "run_id", "runbook", "node", "state", "mode", "reason", "warnings", "report", "link"})


def sign_webhook(body: bytes, secret: str, timestamp: int) -> str:
    """The ``X-Runbook-Signature`` value: ``t=<unix>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>``."""
    mac = hmac.new(secret.encode("utf-8"), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify_webhook(body: bytes, header: str | None, secret: str, *, now: float, tolerance: float = 300.0) -> bool:
    """What a receiver does: True when ``header`` signs ``body`` with ``secret`` and its ``t`` is within
    ``tolerance`` seconds of ``now`` (a captured request replayed later is refused)."""
    if not header:
        return False
    parts = dict(p.strip().split("=", 1) for p in header.split(",") if "=" in p)
    t, given = parts.get("t", ""), parts.get("v1", "")
    if not t.isdigit() or abs(now - int(t)) > tolerance:
        return False
    return hmac.compare_digest(sign_webhook(body, secret, int(t)).split("v1=", 1)[1], given)


def _cut(text: str, limit: int = _MAX_FIELD) -> str:
    if len(text) <= limit:
        return text
    return text[: limit - 14] + "...[truncated]"


class RefusalDigest:
    """Summarises refused and blocked pages so a storm cannot become a notification storm.

    Per window (``dedup.node_cooldown``): the first refusal of each node (or runbook, when there is
    no node) is notified on its own, at most ``max_individual`` of them; a refusal repeating one
    already seen in the window (same runbook, node and kind: a re-sent group) counts for nothing;
    every other one is counted, and when the window is over one aggregate "N alerts refused in the
    last M minutes" notification reports them. Memory is bounded by ``max_keys``. Thread-safe."""

    def __init__(self, window: float, *, max_individual: int = 20, max_keys: int = 10_000,
                 clock: Callable[[], float] = time.time) -> None:
        self.window = max(window, 1.0)
        self.max_individual = max_individual
        self.max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._start: float | None = None
        self._notified: set[str] = set()
        self._seen: set[tuple[str, str, str]] = set()
        self._count = 0
        self._kinds: dict[str, int] = {}

    def admit(self, runbook: str, node: str | None, kind: str) -> bool | None:
        """True: notify this one; False: counted for the aggregate; None: a repeat (ignore)."""
        with self._lock:
            now = self._clock()
            if self._start is None:
                self._start = now
            key = (runbook, node or "", kind)
            if key in self._seen:
                return None
            if len(self._seen) < self.max_keys:
                self._seen.add(key)
            target = node or f"runbook:{runbook}"
            if target not in self._notified and len(self._notified) < self.max_individual:
                self._notified.add(target)
                return True
            self._count += 1
            if len(self._kinds) < 50 or kind in self._kinds:
                self._kinds[kind] = self._kinds.get(kind, 0) + 1
            return False

    def count(self, n: int, kind: str) -> None:
        """``n`` refusals that are never notified one by one (e.g. alerts over the per-delivery cap)."""
        with self._lock:
            if self._start is None:
                self._start = self._clock()
            self._count += n
            self._kinds[kind] = self._kinds.get(kind, 0) + n

    def due(self, *, force: bool = False) -> Notification | None:
        """The aggregate notification when the window is over (and starts a new window)."""
        with self._lock:
            if self._start is None or (not force and self._clock() - self._start < self.window):
                return None
            count, kinds = self._count, self._kinds
            self._start, self._notified, self._seen, self._count, self._kinds = None, set(), set(), 0, {}
        if not count:
            return None
        minutes = max(1, round(self.window / 60))
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:10])
        return Notification("blocked", "(all)", reason=f"{count} alerts refused in the last {minutes} minutes "
                            f"without a notification of their own ({detail})", extra={"refused": count})


@dataclass(frozen=True)
class PagerDutyTarget:
    """Where and how to send Events API v2 events (see ``engine.serve.pagerduty_events``)."""

    routing_key: str = field(repr=False)
    url: str = "https://events.pagerduty.com/v2/enqueue"
    source: str = "runbook"
    severity: str = "critical"
    acknowledge_on_start: bool = False
    dedup_key: Literal["alertmanager-group", "alert"] = "alertmanager-group"


class Notifier:
    """Posts notifications to ``url`` (and PagerDuty) in a background thread; no target: only logs.

    ``step`` notifications go to PagerDuty only, unless ``events`` names ``step`` for the webhook."""

    def __init__(self, url: str | None, *, events: Sequence[str] = (), timeout: float = 5.0,
                 max_queue: int = 1000, transport: httpx.BaseTransport | None = None,
                 secret: str | None = None, pagerduty: PagerDutyTarget | None = None,
                 public_url: str | None = None, clock: Callable[[], float] = time.time) -> None:
        quiet_http_client_logs()  # httpx logs each request's URL at INFO: a webhook URL is a credential
        register(url, secret)
        self.url = url
        self.events = frozenset(events) if events else None
        self.timeout = timeout
        self.secret = secret
        self.pagerduty = pagerduty
        # set: each run's notification links to its console page, {public_url}/ui/runs/{id}
        self.public_url = public_url.rstrip("/") if public_url else None
        self.sent = 0
        self.failed = 0
        self._clock = clock
        self._queue: queue.Queue[Notification | None] = queue.Queue(maxsize=max_queue)
        self._transport = transport
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, notify: Any, *, public_url: str | None = None) -> Notifier:
        """A notifier for a ``NotifyConfig`` (the serve config's ``notify:`` section)."""
        pd = notify.pagerduty
        target = None if pd is None else PagerDutyTarget(
            routing_key=pd.routing_key, url=pd.url, source=pd.source, severity=pd.severity,
            acknowledge_on_start=pd.acknowledge_on_start, dedup_key=pd.dedup_key)
        return cls(notify.url, events=notify.events, timeout=notify.timeout, secret=notify.secret,
                   pagerduty=target, public_url=public_url)

    def _wants_webhook(self, event: str) -> bool:
        if self.url is None:
            return False
        if self.events is None:
            return event != "step"
        return event in self.events

    def notify(self, n: Notification) -> None:
        """Queue ``n``; never blocks and never raises."""
        if n.event != "step":
            log.info("%s", n.text().replace("\n", " | "))
        if not self._wants_webhook(n.event) and self.pagerduty is None:
            return
        if self.public_url and n.run_id and not n.link:
            n = replace(n, link=f"{self.public_url}/ui/runs/{quote(n.run_id, safe='')}")
        self._ensure_thread()
        try:
            self._queue.put_nowait(n)
        except queue.Full:
            self.failed += 1
            log.warning("notification queue full: dropped %s for %s", n.event, n.run_id or n.runbook)

    def _requests(self, n: Notification) -> list[tuple[str, bytes, dict[str, str]]]:
        out: list[tuple[str, bytes, dict[str, str]]] = []
        if self._wants_webhook(n.event):
            assert self.url is not None
            body = json.dumps(n.payload(), separators=(",", ":")).encode("utf-8")
            headers = {"Content-Type": "application/json"}
            if self.secret:
                headers[SIGNATURE_HEADER] = sign_webhook(body, self.secret, int(self._clock()))
            out.append((self.url, body, headers))
        if self.pagerduty is not None:
            from engine.serve.pagerduty_events import events_for

            pd = self.pagerduty
            for ev in events_for(n, routing_key=pd.routing_key, source=pd.source, severity=pd.severity,
                                 acknowledge_on_start=pd.acknowledge_on_start, dedup=pd.dedup_key):
                out.append((pd.url, json.dumps(ev, separators=(",", ":")).encode("utf-8"),
                            {"Content-Type": "application/json"}))
        return out

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="runbook-notify", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        with httpx.Client(timeout=self.timeout, transport=self._transport, follow_redirects=False) as client:
            while True:
                n = self._queue.get()
                try:
                    if n is None:
                        return
                    for url, body, headers in self._requests(n):
                        self._post(client, n, url, body, headers)
                except Exception as e:  # Why: a broken receiver must never break paging or runs
                    self.failed += 1
                    log.warning("notification %s could not be sent: %s", n.event if n else "?", mask_http_log(str(e)))
                finally:
                    self._queue.task_done()

    def _post(self, client: httpx.Client, n: Notification, url: str, body: bytes, headers: dict[str, str]) -> None:
        try:
            resp = client.post(url, content=body, headers=headers)
        except Exception as e:  # Why: one dead target must not keep the others from being told
            self.failed += 1
            log.warning("notification %s for %s could not be sent: %s", n.event, n.run_id or n.runbook,
                        mask_http_log(str(e)))  # an httpx error may quote the URL
            return
        if resp.status_code >= 300:
            self.failed += 1
            log.warning("notification %s for %s: HTTP %s", n.event, n.run_id or n.runbook, resp.status_code)
        else:
            self.sent += 1

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until queued notifications were attempted (tests, shutdown). True when drained."""
        done = threading.Event()

        def wait() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        return done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            thread = self._thread
        if thread is not None and thread.is_alive():
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                return
            thread.join(timeout)


def step_outcomes(events: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """``{step, status, reason}`` of every ``step.outcome`` event (journal ``as_dict`` form), in order."""
    return [{"step": str(e.get("step") or ""), "status": str(e.get("status") or ""),
             "reason": str(e.get("reason") or "")} for e in events if e.get("kind") == "step.outcome"]


def run_report(events: Sequence[Mapping[str, Any]], state: str, reason: str) -> str:
    """The run's report in a few lines: each step's outcome (with its duration), the failing guards'
    and verifications' evidence, and why the run ended as it did."""
    lines: list[str] = []
    for e in events:
        kind = e.get("kind")
        if kind == "step.outcome":
            a, b = e.get("started_at"), e.get("finished_at")
            timed = isinstance(a, int | float) and isinstance(b, int | float)
            took = f" in {float(b) - float(a):.1f}s" if timed else ""  # type: ignore[arg-type]
            why = f": {e.get('reason')}" if e.get("reason") else ""
            lines.append(f"step {e.get('step')}: {e.get('status')}{took}{why}")
        elif kind == "guard.result" and e.get("holds") is not True:
            lines.append(f"  guard {e.get('check')} did not hold (observed {e.get('observed')!r})")
        elif kind == "verify.result" and not e.get("holds"):
            lines.append(f"  verification {e.get('check')} did not hold after {e.get('attempts')} attempts")
    lines.append(f"run {state}: {reason}" if reason and reason != state else f"run {state}")
    return "\n".join(lines)
