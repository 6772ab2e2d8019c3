"""PagerDuty Events API v2 as a notification target: what runbook tells the incident about a run.

Events API v2 (``POST https://events.pagerduty.com/v2/enqueue``) knows three actions on an alert,
addressed by ``dedup_key``: ``trigger``, ``acknowledge``, ``resolve``. It has no "add a note": a
``trigger`` whose ``dedup_key`` names an open alert is, as documented, deduplicated into that alert
and appended to its log with its summary, ``custom_details`` and ``links``. So, per notification:

* ``started`` -> ``acknowledge`` (only with ``acknowledge_on_start``): someone (runbook) is on it;
* ``waiting-approval``, ``step`` (one per step outcome), ``failed``, ``blocked`` -> a ``trigger``
  "note" with the run's state, the step or the evidence, and a link to the run: the incident stays
  open with the evidence attached;
* ``finished`` (the run succeeded) -> a ``trigger`` note carrying the run's report, then ``resolve``
  (``resolve`` events carry no payload PagerDuty keeps, hence the note first), unless the
  notification says not to resolve (``Notification.resolve``: other nodes of the page's
  Alertmanager group are not recovered yet; the note says which).

``dedup_key`` (at most 255 characters) is derived from the alert: with ``dedup_key: alertmanager-group``
(the default) it is the SHA-256 hex of Alertmanager's ``groupKey``, which is exactly the key
Alertmanager's own ``pagerduty_configs`` uses, so runbook's events land on the incident the page
opened; with ``dedup_key: alert`` (or when no group key is known: PagerDuty-sourced runs) it is
``runbook-<alert fingerprint or incident id>``. CLI runs answer no alert: they use the key given
with ``--pagerduty-dedup-key``. A notification with neither (the "N alerts refused"
summary) is not sent to PagerDuty. Bodies stay under the documented 512 KB (we cap at 64 KiB),
``summary`` under 1024 characters. This module builds request bodies; it sends nothing and holds
no secret beyond the routing key it is given.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from engine.serve.notify import Notification

EVENTS_URL = "https://events.pagerduty.com/v2/enqueue"
MAX_SUMMARY = 1024
MAX_DEDUP_KEY = 255
MAX_EVENT_BYTES = 64 * 1024  # PagerDuty accepts 512 KB; ours stay far below
SEVERITIES = ("critical", "error", "warning", "info")
Action = Literal["trigger", "acknowledge", "resolve"]


def dedup_key(n: Notification, mode: Literal["alertmanager-group", "alert"] = "alertmanager-group") -> str | None:
    """The alert's PagerDuty ``dedup_key`` for ``n``; None when ``n`` is about no alert."""
    if n.pagerduty_key:
        return n.pagerduty_key[:MAX_DEDUP_KEY]
    if mode == "alertmanager-group" and n.group_key:
        return hashlib.sha256(n.group_key.encode("utf-8")).hexdigest()
    if n.alert_key:
        return ("runbook-" + n.alert_key)[:MAX_DEDUP_KEY]
    return None


def _summary(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= MAX_SUMMARY else line[: MAX_SUMMARY - 14] + "...[truncated]"


def events_for(n: Notification, *, routing_key: str, source: str = "runbook", severity: str = "critical",
               acknowledge_on_start: bool = False,
               dedup: Literal["alertmanager-group", "alert"] = "alertmanager-group") -> list[dict[str, Any]]:
    """The Events API v2 bodies ``n`` becomes, in sending order (possibly none)."""
    key = dedup_key(n, dedup)
    if key is None:
        return []
    b = n.bounded()
    base: dict[str, Any] = {"routing_key": routing_key, "dedup_key": key, "client": "runbook"}
    if b.link:
        base["client_url"] = b.link
        base["links"] = [{"href": b.link, "text": f"runbook run {b.run_id}" if b.run_id else "runbook"}]
    if n.event == "started":
        return [{**base, "event_action": "acknowledge"}] if acknowledge_on_start else []

    details: dict[str, Any] = {"event": b.event, "run_id": b.run_id, "runbook": b.runbook, "node": b.node,
                               "state": b.state, "mode": b.mode, "reason": b.reason}
    if b.warnings:
        details["warnings"] = list(b.warnings)
    if b.report:
        details["report"] = b.report
    details.update({k: v for k, v in b.extra.items() if k not in details})
    note = {**base, "event_action": "trigger", "payload": {
        "summary": _summary(b.text().replace("\n", " | ")), "source": (b.node or source)[:255],
        "severity": severity, "timestamp": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "component": b.runbook[:255], "group": "runbook", "class": b.event, "custom_details": details}}
    # Why only the group's key obeys ``resolve``: a key of one alert (or runbook's own) is this run's
    # alone; the group's is shared by every node of the page (engine.serve.page_groups)
    shared = dedup == "alertmanager-group" and bool(n.group_key) and not n.pagerduty_key
    if n.event == "finished" and (n.resolve or not shared):
        return [note, {**base, "event_action": "resolve"}]
    return [note]
