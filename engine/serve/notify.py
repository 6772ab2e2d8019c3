"""Notifications: a generic webhook with Slack-compatible JSON, and PagerDuty Events API v2.

Events: ``started``, ``waiting-approval``, ``step`` (one per step outcome), ``finished``, ``failed``,
``blocked``. Each webhook POST carries ``{"text": "<one readable line>", "runbook_event": {event,
run_id, runbook, node, state, mode, reason, warnings, report, link, ...}}``; Slack shows ``text`` and
ignores the rest. ``link`` is the run's console page, ``<public_url>/ui/runs/<run id>``, when
``public_url`` is configured. With
``notify.secret`` every webhook POST is signed: ``X-Runbook-Signature: t=<unix seconds>,v1=<hex of
HMAC-SHA256(secret, "<t>.<body>")>`` (``verify_webhook`` is what a receiver does). PagerDuty events
are built by ``engine.serve.pagerduty_events``; PagerDuty REST notes by ``engine.serve.pagerduty_rest``;
Slack messages by ``engine.serve.slack``. Delivery is ``engine.serve.delivery``'s: one lane (bounded
queue, thread) per target, retries with backoff: a slow or dead receiver never delays a webhook
answer, a run or another target, and failures are counted and logged, never raised. Secrets are
never put in a notification.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal
from urllib.parse import quote

import httpx

from engine.secrecy import quiet_http_client_logs, register
from engine.serve.delivery import Lane, Observer, RetryPolicy, Sender, Target

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
    incident_id: str = ""  # the PagerDuty incident that paged (REST notes go to it)
    # a ``finished`` notification resolves the page: False while other nodes of the page's
    # Alertmanager group are not recovered, or when a PagerDuty trigger does not resolve incidents
    resolve: bool = True

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
                            group_key=_cut(self.group_key, 4096), pagerduty_key=self.pagerduty_key[:255],
                            incident_id=self.incident_id[:100], resolve=self.resolve)


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


class WebhookTarget:
    """The generic (Slack-compatible) webhook: one signed JSON POST per wanted event."""

    name = "webhook"

    def __init__(self, url: str, *, events: frozenset[str] | None, secret: str | None,
                 clock: Callable[[], float]) -> None:
        self.url = url
        self.events = events
        self._secret = secret
        self._clock = clock

    def wants(self, n: Notification) -> bool:
        if n.event not in _ICONS:
            return False  # internal events (a Slack decision) are for their own target only
        return n.event != "step" if self.events is None else n.event in self.events

    def deliver(self, n: Notification, send: Sender) -> None:
        body = json.dumps(n.payload(), separators=(",", ":")).encode("utf-8")
        headers = {"Content-Type": "application/json"}
        if self._secret:
            headers[SIGNATURE_HEADER] = sign_webhook(body, self._secret, int(self._clock()))
        send("POST", self.url, body, headers, what=f"{n.event} for {n.run_id or n.runbook}")


class PagerDutyEventsTarget:
    """PagerDuty Events API v2. A run paged by a PagerDuty incident is left to the REST target when
    one is configured (``skip_incidents``): an Events v2 event would open a second alert."""

    name = "pagerduty-events"

    def __init__(self, pd: PagerDutyTarget, *, skip_incidents: bool = False) -> None:
        self.pd = pd
        self.skip_incidents = skip_incidents

    def wants(self, n: Notification) -> bool:
        if n.event not in _ICONS or (self.skip_incidents and n.incident_id):
            return False
        from engine.serve.pagerduty_events import dedup_key

        return dedup_key(n, self.pd.dedup_key) is not None

    def deliver(self, n: Notification, send: Sender) -> None:
        from engine.serve.pagerduty_events import events_for

        pd = self.pd
        for ev in events_for(n, routing_key=pd.routing_key, source=pd.source, severity=pd.severity,
                             acknowledge_on_start=pd.acknowledge_on_start, dedup=pd.dedup_key):
            send("POST", pd.url, json.dumps(ev, separators=(",", ":")).encode("utf-8"),
                 {"Content-Type": "application/json"}, what=f"{ev['event_action']} for {n.run_id or n.runbook}")


class Notifier:
    """Sends notifications to its targets (``engine.serve.delivery``: one lane per target, retries);
    no target: only logs.

    ``step`` notifications go to PagerDuty only, unless ``events`` names ``step`` for the webhook.
    ``targets`` adds targets built elsewhere (PagerDuty REST, Slack)."""

    def __init__(self, url: str | None, *, events: Sequence[str] = (), timeout: float = 5.0,
                 max_queue: int = 1000, transport: httpx.BaseTransport | None = None,
                 secret: str | None = None, pagerduty: PagerDutyTarget | None = None,
                 public_url: str | None = None, clock: Callable[[], float] = time.time,
                 targets: Sequence[Target] = (), retry: RetryPolicy | None = None,
                 observer: Observer | None = None) -> None:
        quiet_http_client_logs()  # httpx logs each request's URL at INFO: a webhook URL is a credential
        register(url, secret)
        self.url = url
        self.events = frozenset(events) if events else None
        self.timeout = timeout
        self.pagerduty = pagerduty
        # set: each run's notification links to its console page, {public_url}/ui/runs/{id}
        self.public_url = public_url.rstrip("/") if public_url else None
        self.retry = retry or RetryPolicy()
        self.observer = observer
        self._clock = clock
        own: list[Target] = []
        if url is not None:
            own.append(WebhookTarget(url, events=self.events, secret=secret, clock=clock))
        if pagerduty is not None:
            skip = any(t.name == "pagerduty-rest" for t in targets)
            own.append(PagerDutyEventsTarget(pagerduty, skip_incidents=skip))
        self.lanes = [Lane(t, retry=self.retry, timeout=timeout, max_queue=max_queue, transport=transport,
                           observer=self._observe, clock=clock) for t in [*own, *targets]]

    def _observe(self, target: str, outcome: str) -> None:
        if self.observer is not None:
            self.observer(target, outcome)

    @classmethod
    def from_config(cls, notify: Any, *, public_url: str | None = None,
                    transport: httpx.BaseTransport | None = None) -> Notifier:
        """A notifier for a ``NotifyConfig`` (the serve config's ``notify:`` section)."""
        from engine.serve.pagerduty_rest import PagerDutyRestTarget
        from engine.serve.slack import SlackTarget

        pd = notify.pagerduty
        target = None if pd is None else PagerDutyTarget(
            routing_key=pd.routing_key, url=pd.url, source=pd.source, severity=pd.severity,
            acknowledge_on_start=pd.acknowledge_on_start, dedup_key=pd.dedup_key)
        extra: list[Target] = []
        if notify.pagerduty_rest is not None:
            extra.append(PagerDutyRestTarget.from_config(notify.pagerduty_rest))
        if notify.slack is not None:
            extra.append(SlackTarget.from_config(notify.slack))
        r = notify.retry
        return cls(notify.url, events=notify.events, timeout=notify.timeout, secret=notify.secret,
                   pagerduty=target, public_url=public_url, targets=extra, transport=transport,
                   retry=RetryPolicy(attempts=r.attempts, backoff=r.backoff, max_backoff=r.max_backoff,
                                     max_retry_after=r.max_retry_after))

    def target(self, name: str) -> Any:
        """The target called ``name`` (None when not configured)."""
        return next((lane.target for lane in self.lanes if lane.name == name), None)

    @property
    def sent(self) -> int:
        return sum(lane.stats.sent for lane in self.lanes)

    @property
    def failed(self) -> int:
        return sum(lane.stats.failed for lane in self.lanes)

    def health(self) -> dict[str, dict[str, Any]]:
        """Per target: requests sent, failed, retried, and the last error with its time (``/readyz``)."""
        return {lane.name: lane.stats.as_dict() for lane in self.lanes}

    def notify(self, n: Notification) -> None:
        """Queue ``n`` for every target that wants it; never blocks and never raises."""
        if n.event in _ICONS and n.event != "step":
            log.info("%s", n.text().replace("\n", " | "))
        if self.public_url and n.run_id and not n.link:
            n = replace(n, link=f"{self.public_url}/ui/runs/{quote(n.run_id, safe='')}")
        for lane in self.lanes:
            try:
                wanted = lane.target.wants(n)
            except Exception:  # Why: a broken target must never break paging or runs
                log.exception("notification target %s", lane.name)
                continue
            if wanted:
                lane.put(n)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until queued notifications were attempted (tests, shutdown). True when drained."""
        done = threading.Event()

        def wait() -> None:
            for lane in self.lanes:
                lane.join()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        return done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        for lane in self.lanes:
            lane.stopping.set()  # Why all first: every lane stops waiting for a retry at once
        for lane in self.lanes:
            lane.close(timeout)


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
