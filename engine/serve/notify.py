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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger(__name__)
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
        return "\n".join(parts)

    def payload(self) -> dict[str, Any]:
        return {"text": self.text(), "runbook_event": {
            "event": self.event, "run_id": self.run_id, "runbook": self.runbook, "node": self.node,
            "mode": self.mode, "reason": self.reason, "warnings": list(self.warnings), **dict(self.extra)}}


class Notifier:
    """Posts notifications to ``url`` in a background thread; ``None`` url: only logs them."""

    def __init__(self, url: str | None, *, events: Sequence[str] = (), timeout: float = 5.0,
                 max_queue: int = 1000, transport: httpx.BaseTransport | None = None) -> None:
        self.url = url
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
