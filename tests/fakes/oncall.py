"""Local fakes (127.0.0.1) of the on-call services, speaking their documented wire formats.

* PagerDuty REST API v2: ``POST /incidents/{id}/notes`` (``{"note": {"content"}}``, 201) and
  ``PUT /incidents/{id}`` (``{"incident": {"type": "incident_reference", "status"}}``), with
  ``Authorization: Token token=<key>``, a ``From`` header and PagerDuty's ``Accept`` (400/401/404
  like PagerDuty otherwise); ``rate_limit(n)`` answers the next ``n`` requests ``429`` with
  ``Retry-After``. Events API v2 ``POST /v2/enqueue`` too (``tests.fakes.notify.enqueue``), so a
  test sees whether a second alert would have been opened.
* Slack Web API: ``POST /api/chat.postMessage`` and ``/api/chat.update`` (``Authorization: Bearer``,
  JSON; ``{"ok": true, "channel", "ts"}``, or HTTP 200 ``{"ok": false, "error"}`` as Slack does).
  ``click`` builds a ``block_actions`` interaction for a posted message, form-encoded as
  ``payload=<JSON>`` and signed with Slack's v0 algorithm.
* Alertmanager ``GET /api/v2/status`` serving a configuration (``config.original``).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from engine.serve.slack import sign
from tests.fakes.http import JsonHandler, LoopbackServer, serving
from tests.fakes.notify import enqueue

PD_TOKEN = "y_NbAkKc66ryYTWUXYEu"  # the shape of a PagerDuty REST API key (20 characters)
PD_FROM = "oncall-bot@example.org"
SLACK_BOT_TOKEN = "xoxb-1234567890-0987654321-AbCdEfGhIjKlMnOpQrStUv"
SLACK_SIGNING_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"  # the value of Slack's documented example
SLACK_CHANNEL = "C0RUNBOOK1"
PD_ACCEPT = "application/vnd.pagerduty+json;version=2"


@dataclass
class Incident:
    id: str
    status: str = "triggered"
    notes: list[str] = field(default_factory=list)
    history: list[str] = field(default_factory=list)  # statuses set, in order


@dataclass
class SlackMessage:
    channel: str
    ts: str
    text: str
    blocks: list[dict[str, Any]]
    thread_ts: str | None = None
    updates: list[dict[str, Any]] = field(default_factory=list)

    def buttons(self) -> dict[str, dict[str, Any]]:
        return {e["action_id"]: e for b in self.blocks if b.get("type") == "actions" for e in b["elements"]}

    def shown(self) -> str:
        """All text of the message's blocks."""
        return json.dumps(self.blocks)


class OnCallFakes(LoopbackServer):
    """One loopback server for PagerDuty (REST and Events v2), Slack's Web API and Alertmanager."""

    def __init__(self) -> None:
        self.incidents: dict[str, Incident] = {}
        self.events: list[dict[str, Any]] = []  # Events API v2 bodies accepted
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # method, path, headers
        self.refused: list[str] = []
        self.messages: list[SlackMessage] = []
        self.am_config = ""  # Alertmanager's configuration YAML (GET /api/v2/status)
        self._limited = 0
        self._ts = 0
        self._lock = threading.Lock()
        outer = self

        class Handler(JsonHandler):
            def do_GET(self) -> None:
                if self.path == "/api/v2/status":
                    self.answer(200, {"config": {"original": outer.am_config}, "cluster": {"status": "disabled"}})
                else:
                    self.answer(404, {})

            def do_POST(self) -> None:
                outer._handle(self, "POST", self.body())

            def do_PUT(self) -> None:
                outer._handle(self, "PUT", self.body())

        super().__init__(Handler)

    # -- test controls -----------------------------------------------------------------------

    def incident(self, incident_id: str) -> Incident:
        with self._lock:
            return self.incidents.setdefault(incident_id, Incident(incident_id))

    def rate_limit(self, n: int) -> None:
        """Answer the next ``n`` PagerDuty REST or Slack requests 429 with ``Retry-After: 1``."""
        with self._lock:
            self._limited = n

    def approval_message(self, run_id: str) -> SlackMessage | None:
        return next((m for m in self.messages if run_id in json.dumps(m.blocks) and m.buttons()), None)

    # -- the wire ----------------------------------------------------------------------------

    def _handle(self, h: JsonHandler, method: str, body: bytes) -> None:
        headers = {k.lower(): v for k, v in h.headers.items()}
        with self._lock:
            self.requests.append((method, h.path, headers))
            limited = self._limited > 0 and not h.path.startswith("/v2/enqueue")
            if limited:
                self._limited -= 1
        if limited:
            h.answer(429, {"error": {"message": "Rate Limit Exceeded", "code": 2020}}, {"Retry-After": "1"})
            return
        if h.path == "/v2/enqueue":
            code, answer, errors = enqueue(body)
            if errors:
                self.refused.append("; ".join(errors))
            else:
                with self._lock:
                    self.events.append(json.loads(body))
            h.answer(code, answer)
        elif h.path.startswith("/api/"):
            self._slack(h, h.path[len("/api/"):], headers, body)
        elif h.path.startswith("/incidents/"):
            self._pagerduty(h, method, h.path, headers, body)
        else:
            h.answer(404, {})

    def _pagerduty(self, h: JsonHandler, method: str, path: str, headers: Mapping[str, str], body: bytes) -> None:
        if headers.get("authorization") != f"Token token={PD_TOKEN}":
            self.refused.append(f"{method} {path}: Authorization")
            h.answer(401, {"error": {"message": "Unauthorized", "code": 2006}})
            return
        if headers.get("accept") != PD_ACCEPT or "application/json" not in headers.get("content-type", ""):
            self.refused.append(f"{method} {path}: Accept/Content-Type")
            h.answer(400, {"error": {"message": "Invalid Input Provided", "code": 2001}})
            return
        if not re.fullmatch(r"[^@\s]+@[^@\s]+", headers.get("from", "")):
            self.refused.append(f"{method} {path}: From")
            h.answer(400, {"error": {"message": "Requester User Not Found", "code": 2100,
                                    "errors": ["A valid From header is required"]}})
            return
        m = re.fullmatch(r"/incidents/([A-Z0-9]+)(/notes)?", path)
        with self._lock:
            inc = self.incidents.get(m.group(1)) if m else None
        if inc is None or m is None:
            h.answer(404, {"error": {"message": "Not Found", "code": 2100}})
            return
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if method == "POST" and m.group(2):
            content = (data or {}).get("note", {}).get("content") if isinstance(data, dict) else None
            if not isinstance(content, str) or not content or len(content) > 25_000:
                self.refused.append(f"note: {str(data)[:80]}")
                h.answer(400, {"error": {"message": "Invalid Input Provided", "code": 2001}})
                return
            with self._lock:
                inc.notes.append(content)
            h.answer(201, {"note": {"id": f"PN{len(inc.notes)}", "content": content,
                                   "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}})
        elif method == "PUT" and not m.group(2):
            ref = (data or {}).get("incident") if isinstance(data, dict) else None
            if not isinstance(ref, dict) or ref.get("type") != "incident_reference" or \
                    ref.get("status") not in ("acknowledged", "resolved"):
                self.refused.append(f"update: {str(data)[:80]}")
                h.answer(400, {"error": {"message": "Invalid Input Provided", "code": 2001}})
                return
            with self._lock:
                inc.status = ref["status"]
                inc.history.append(ref["status"])
            h.answer(200, {"incident": {"id": inc.id, "type": "incident", "status": inc.status}})
        else:
            h.answer(405, {})

    def _slack(self, h: JsonHandler, method: str, headers: Mapping[str, str], body: bytes) -> None:
        if headers.get("authorization") != f"Bearer {SLACK_BOT_TOKEN}":
            h.answer(200, {"ok": False, "error": "invalid_auth"})
            return
        try:
            data = json.loads(body)
        except ValueError:
            h.answer(200, {"ok": False, "error": "invalid_json"})
            return
        if method == "chat.postMessage":
            if not data.get("channel") or not (data.get("text") or data.get("blocks")):
                h.answer(200, {"ok": False, "error": "no_text"})
                return
            with self._lock:
                self._ts += 1
                msg = SlackMessage(data["channel"], f"1700000000.{self._ts:06d}", data.get("text", ""),
                                   list(data.get("blocks") or []), data.get("thread_ts"))
                self.messages.append(msg)
            h.answer(200, {"ok": True, "channel": msg.channel, "ts": msg.ts,
                          "message": {"type": "message", "text": msg.text, "ts": msg.ts}})
        elif method == "chat.update":
            with self._lock:
                msg = next((m for m in self.messages if (m.channel, m.ts) == (data.get("channel"), data.get("ts"))),
                           None)
                if msg is not None:
                    msg.updates.append(data)
                    msg.text, msg.blocks = data.get("text", msg.text), list(data.get("blocks") or msg.blocks)
            if msg is None:
                h.answer(200, {"ok": False, "error": "message_not_found"})
                return
            h.answer(200, {"ok": True, "channel": msg.channel, "ts": msg.ts, "text": msg.text})
        else:
            h.answer(200, {"ok": False, "error": "unknown_method"})


def click(message: SlackMessage, *, user: str, action: str = "runbook-approve", reason: str = "",
          secret: str = SLACK_SIGNING_SECRET, timestamp: int | None = None) -> tuple[bytes, dict[str, str]]:
    """A signed ``block_actions`` interaction on ``message``'s button ``action``, as Slack POSTs it."""
    button = message.buttons()[action]
    payload = {
        "type": "block_actions", "user": {"id": user, "username": user.lower(), "team_id": "T0TEAM"},
        "api_app_id": "A0RUNBOOK", "token": "deprecated-verification-token",
        "container": {"type": "message", "message_ts": message.ts, "channel_id": message.channel,
                      "is_ephemeral": False},
        "trigger_id": "12345.98765.abcd", "team": {"id": "T0TEAM", "domain": "example"},
        "channel": {"id": message.channel, "name": "oncall"},
        "message": {"type": "message", "ts": message.ts, "text": message.text, "blocks": message.blocks},
        "state": {"values": {"runbook-reason": {"reason": {"type": "plain_text_input", "value": reason or None}}}},
        "response_url": "https://hooks.slack.com/actions/T0TEAM/1/xyz",
        "actions": [{"action_id": action, "block_id": "runbook-decision", "value": button["value"],
                     "type": "button", "action_ts": f"{time.time():.6f}", "text": button["text"]}],
    }
    body = urlencode({"payload": json.dumps(payload)}).encode()
    ts = int(time.time()) if timestamp is None else timestamp
    return body, {"Content-Type": "application/x-www-form-urlencoded", "X-Slack-Request-Timestamp": str(ts),
                  "X-Slack-Signature": sign(body, secret, ts)}


def running() -> AbstractContextManager[OnCallFakes]:
    """Started ``OnCallFakes``, closed after the ``with`` block."""
    return serving(OnCallFakes())
