"""A local receiver (127.0.0.1) for notification tests: PagerDuty Events API v2 at ``/v2/enqueue``,
checked against PagerDuty's documented request format (400 like PagerDuty when a body breaks it),
and a webhook endpoint at ``/hook`` that keeps bodies and their ``X-Runbook-Signature``.
``enqueue`` is PagerDuty's answer to one event (``tests.fakes.oncall`` serves it too)."""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any

from engine.serve.notify import SIGNATURE_HEADER
from tests.fakes.http import JsonHandler, LoopbackServer, serving

ROUTING_KEY = "R0ut1ngK3yF0rT3stsXXXXXXXXXXXXXX"  # 32 characters, as PagerDuty's integration keys
SECRET = "s3cret-for-signing-webhooks"


def pd_errors(body: bytes) -> list[str]:
    """What PagerDuty's Events API v2 refuses (its documented request format)."""
    errors: list[str] = []
    if len(body) > 512 * 1024:
        errors.append("event larger than 512 KB")
    try:
        ev = json.loads(body)
    except ValueError:
        return ["not JSON"]
    if not isinstance(ev, dict):
        return ["not an object"]
    if not isinstance(ev.get("routing_key"), str) or len(ev["routing_key"]) != 32:
        errors.append("routing_key must be the 32-character integration key")
    action = ev.get("event_action")
    if action not in ("trigger", "acknowledge", "resolve"):
        errors.append(f"event_action {action!r}")
    key = ev.get("dedup_key")
    if action in ("acknowledge", "resolve") and not key:
        errors.append("dedup_key is required to acknowledge or resolve")
    if key is not None and (not isinstance(key, str) or len(key) > 255):
        errors.append("dedup_key must be a string of at most 255 characters")
    if action == "trigger":
        p = ev.get("payload")
        if not isinstance(p, dict):
            return [*errors, "payload is required for a trigger"]
        if not isinstance(p.get("summary"), str) or not p["summary"] or len(p["summary"]) > 1024:
            errors.append("payload.summary: 1..1024 characters")
        if not isinstance(p.get("source"), str) or not p["source"]:
            errors.append("payload.source is required")
        if p.get("severity") not in ("critical", "error", "warning", "info"):
            errors.append(f"payload.severity {p.get('severity')!r}")
        if "timestamp" in p:
            try:
                datetime.fromisoformat(str(p["timestamp"]).replace("Z", "+00:00"))
            except ValueError:
                errors.append("payload.timestamp is not ISO 8601")
        if "custom_details" in p and not isinstance(p["custom_details"], dict):
            errors.append("payload.custom_details must be an object")
    for link in ev.get("links", []):
        if not isinstance(link, dict) or not isinstance(link.get("href"), str):
            errors.append("links[] need an href")
    return errors


def enqueue(body: bytes) -> tuple[int, dict[str, Any], list[str]]:
    """PagerDuty's Events API v2 answer to ``body``: (HTTP status, JSON answer, what it refused)."""
    errors = pd_errors(body)
    if errors:
        return 400, {"status": "invalid event", "message": "Event object is invalid", "errors": errors}, errors
    return 202, {"status": "success", "message": "Event processed",
                 "dedup_key": json.loads(body).get("dedup_key")}, []


class Receiver(LoopbackServer):
    """A PagerDuty Events v2 endpoint (``/v2/enqueue``) and a webhook endpoint (``/hook``) on loopback."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.hooks: list[tuple[bytes, str | None]] = []
        self.refused: list[list[str]] = []
        outer = self

        class Handler(JsonHandler):
            def do_POST(self) -> None:
                body = self.body()
                if self.path == "/v2/enqueue":
                    code, answer, errors = enqueue(body)
                    if errors:
                        outer.refused.append(errors)
                    else:
                        outer.events.append(json.loads(body))
                    self.answer(code, answer)
                else:
                    outer.hooks.append((body, self.headers.get(SIGNATURE_HEADER)))
                    self.answer(200, {})

        super().__init__(Handler)


def running() -> AbstractContextManager[Receiver]:
    """A started ``Receiver``, closed after the ``with`` block."""
    return serving(Receiver())
