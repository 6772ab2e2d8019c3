"""Notifications: a generic webhook with Slack-compatible JSON, sent off the request path.

Events: ``started``, ``waiting-approval``, ``finished``, ``failed``, ``blocked``. Each POST carries
``{"text": "<one readable line>", "runbook_event": {event, run_id, runbook, node, mode, reason,
warnings, plan_digest, ...}}``; Slack shows ``text`` and ignores the rest. Delivery happens in one
background thread through a bounded queue: a slow or dead receiver never delays a webhook answer
or a run, and failures are logged, never raised. Secrets are never put in a notification.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import quote

import httpx

log = logging.getLogger(__name__)
MAX_NOTIFICATION_BYTES = 60 * 1024  # every POST stays under 64 KiB whatever an alert carried
_MAX_FIELD = 2048
_MAX_WARNINGS = 5
_ICONS = {"started": ":arrow_forward:", "waiting-approval": ":raised_hand:", "finished": ":white_check_mark:",
          "failed": ":x:", "blocked": ":no_entry:"}


@dataclass(frozen=True)
class Notification:
    event: str  # started | waiting-approval | finished | failed | blocked
    runbook: str
    node: str | None = None
    run_id: str | None = None
    mode: str | None = None
    reason: str = ""
    warnings: Sequence[str] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        icon = _ICONS.get(self.event, "")
        target = f" on {self.node}" if self.node else ""
        run = f" run {self.run_id}" if self.run_id else ""
        head = f"{icon} runbook {self.runbook}{target}:{run} {self.event}".strip()
        if self.mode:
            head += f" ({self.mode} mode)"
        parts = [head]
        if self.reason:
            parts.append(self.reason)
        if self.event == "waiting-approval" and self.extra.get("plan_digest"):
            parts.append(f"approve with: runbook approve {self.run_id} --plan-digest {self.extra['plan_digest']}")
        parts += [f"warning: {w}" for w in self.warnings]
        if self.extra.get("url"):
            parts.append(f"open: {self.extra['url']}")  # the run's console page (public_url)
        return "\n".join(parts)

    def payload(self) -> dict[str, Any]:
        """The POST body, bounded (< 64 KiB): long fields are cut with a marker, at most 5 warnings,
        10 extra fields of 1 KiB."""
        b = self.bounded()
        return {"text": b.text(), "runbook_event": {
            "event": b.event, "run_id": b.run_id, "runbook": b.runbook, "node": b.node,
            "mode": b.mode, "reason": b.reason, "warnings": list(b.warnings), **dict(b.extra)}}

    def bounded(self) -> Notification:
        warnings = [_cut(w) for w in list(self.warnings)[:_MAX_WARNINGS]]
        if len(self.warnings) > _MAX_WARNINGS:
            warnings.append(f"... and {len(self.warnings) - _MAX_WARNINGS} more warnings")
        extra = {_cut(str(k), 64): (_cut(v, 1024) if isinstance(v, str) else v if isinstance(v, int | float | None)
                                   else _cut(str(v), 1024))
                 for k, v in list(self.extra.items())[:10]}
        return Notification(self.event, _cut(self.runbook, 256), node=_cut(self.node, 256) if self.node else None,
                            run_id=self.run_id, mode=self.mode, reason=_cut(self.reason), warnings=warnings,
                            extra=extra)


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


class Notifier:
    """Posts notifications to ``url`` in a background thread; ``None`` url: only logs them."""

    def __init__(self, url: str | None, *, events: Sequence[str] = (), timeout: float = 5.0,
                 max_queue: int = 1000, transport: httpx.BaseTransport | None = None,
                 public_url: str | None = None) -> None:
        self.url = url
        self.public_url = public_url  # set: each run's notification links to {public_url}/ui/runs/{id}
        self.events = frozenset(events) if events else None
        self.timeout = timeout
        self.sent = 0
        self.failed = 0
        self._queue: queue.Queue[Notification | None] = queue.Queue(maxsize=max_queue)
        self._transport = transport
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def notify(self, n: Notification) -> None:
        """Queue ``n``; never blocks and never raises."""
        if self.public_url and n.run_id and "url" not in n.extra:
            n = replace(n, extra={**n.extra, "url": f"{self.public_url}/ui/runs/{quote(n.run_id, safe='')}"})
        log.info("%s", n.text().replace("\n", " | "))
        if self.url is None or (self.events is not None and n.event not in self.events):
            return
        self._ensure_thread()
        try:
            self._queue.put_nowait(n)
        except queue.Full:
            self.failed += 1
            log.warning("notification queue full: dropped %s for %s", n.event, n.run_id or n.runbook)

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="runbook-notify", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        assert self.url is not None
        with httpx.Client(timeout=self.timeout, transport=self._transport, follow_redirects=False) as client:
            while True:
                n = self._queue.get()
                try:
                    if n is None:
                        return
                    resp = client.post(self.url, json=n.payload())
                    if resp.status_code >= 300:
                        self.failed += 1
                        log.warning("notification %s for %s: HTTP %s", n.event, n.run_id or n.runbook,
                                    resp.status_code)
                    else:
                        self.sent += 1
                except Exception as e:  # Why: a broken receiver must never break paging or runs
                    self.failed += 1
                    log.warning("notification %s could not be sent: %s", n.event if n else "?", e)
                finally:
                    self._queue.task_done()

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
