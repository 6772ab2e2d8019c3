"""PagerDuty REST API v2 as a notification target: a run paged by a PagerDuty incident reports on
**that incident** (Events API v2 cannot address an incident; its events would open another alert).

Requests (``Authorization: Token token=<REST API key>``, ``From: <a PagerDuty user's e-mail>``,
``Accept: application/vnd.pagerduty+json;version=2``), per notification of such a run:

* ``started`` (the run executes: automatically, or once approved) -> a note (the plan's steps when
  known, the console link), then ``PUT /incidents/{id}`` ``status: acknowledged`` (``acknowledge``):
  someone is on it. A run that waits for approval does **not** acknowledge: the page must keep
  escalating until a person approves;
* ``waiting-approval`` -> a note with the plan, its digest and the console link;
* ``step`` -> a note per step outcome;
* ``finished`` -> a note with the run's report, then ``status: resolved`` only when the trigger
  says so (``resolve_incident``) - the notification's ``resolve``;
* ``failed`` / ``blocked`` -> a note with the reason and the report: the incident stays open.

Notes are ``POST /incidents/{id}/notes`` ``{"note": {"content": ...}}`` (cut to 25,000
characters). Retries (429 with ``Retry-After``, 5xx, outages) are ``engine.serve.delivery``'s. The
token and the From address are secrets: never logged, never in a note. This module builds and sends
requests; it decides nothing about runs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from engine.serve.delivery import Sender
from engine.serve.notify import Notification

MAX_NOTE = 25_000
ACCEPT = "application/vnd.pagerduty+json;version=2"


def note_text(n: Notification) -> str:
    """The note a notification becomes on its incident."""
    b = n.bounded()
    run = f"run {b.run_id}" if b.run_id else "runbook"
    where = f" on {b.node}" if b.node else ""
    lines: list[str]
    if n.event == "started":
        lines = [f"runbook {b.runbook}{where}: {run} started ({b.mode or '?'} mode)."]
        if b.reason:
            lines.append(b.reason)
        plan = b.extra.get("plan")
        lines.append(f"Plan: {plan}" if plan else "The plan is being prepared with live facts.")
    elif n.event == "waiting-approval":
        lines = [f"runbook {b.runbook}{where}: {run} has a plan waiting for approval."]
        if b.extra.get("plan"):
            lines.append(f"Plan: {b.extra['plan']}")
        if b.extra.get("plan_digest"):
            lines.append(f"Plan digest: {b.extra['plan_digest']}")
        lines += [f"warning: {w}" for w in b.warnings]
    elif n.event == "step":
        why = f": {b.reason}" if b.reason else ""
        lines = [f"runbook {b.runbook}{where}: {run} step {b.extra.get('step', '?')} "
                 f"{b.extra.get('status', '')}{why}"]
    else:
        outcome = {"finished": "succeeded", "failed": "failed", "blocked": "was blocked"}.get(n.event, n.event)
        lines = [f"runbook {b.runbook}{where}: {run} {outcome}."]
        if b.reason:
            lines.append(b.reason)
        if b.report:
            lines.append(b.report)
        if n.event != "finished" or not n.resolve:
            lines.append("The incident stays open.")
    if b.link:
        lines.append(f"Console: {b.link}")
    text = "\n".join(lines)
    return text if len(text) <= MAX_NOTE else text[: MAX_NOTE - 14] + "...[truncated]"


class PagerDutyRestTarget:
    """Notes, acknowledge and resolve on the incident a run was paged by (``Notification.incident_id``)."""

    name = "pagerduty-rest"

    def __init__(self, token: str, from_email: str, *, url: str = "https://api.pagerduty.com",
                 acknowledge: bool = True) -> None:
        self._token = token
        self._from = from_email
        self.url = url.rstrip("/")
        self.acknowledge = acknowledge

    def __repr__(self) -> str:  # Why: the token and the From address must never reach a log
        return f"PagerDutyRestTarget(url={self.url!r})"

    @classmethod
    def from_config(cls, cfg: Any) -> PagerDutyRestTarget:
        return cls(cfg.token, cfg.from_email, url=cfg.url, acknowledge=cfg.acknowledge)

    def wants(self, n: Notification) -> bool:
        return bool(n.incident_id) and n.event in ("started", "waiting-approval", "step", "finished",
                                                   "failed", "blocked")

    def _headers(self) -> Mapping[str, str]:
        return {"Authorization": f"Token token={self._token}", "From": self._from, "Accept": ACCEPT,
                "Content-Type": "application/json"}

    def _status(self, n: Notification, status: str, send: Sender) -> None:
        body = {"incident": {"type": "incident_reference", "status": status}}
        send("PUT", f"{self.url}/incidents/{quote(n.incident_id, safe='')}", json.dumps(body).encode(),
             self._headers(), what=f"{status} incident {n.incident_id} for {n.run_id}")

    def deliver(self, n: Notification, send: Sender) -> None:
        incident = quote(n.incident_id, safe="")
        note = {"note": {"content": note_text(n)}}
        send("POST", f"{self.url}/incidents/{incident}/notes", json.dumps(note).encode("utf-8"), self._headers(),
             what=f"note ({n.event}) on incident {n.incident_id} for {n.run_id}")
        if n.event == "started" and self.acknowledge:
            self._status(n, "acknowledged", send)
        elif n.event == "finished" and n.resolve:
            self._status(n, "resolved", send)
