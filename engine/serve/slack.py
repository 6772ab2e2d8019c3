"""Slack: interactive approval messages, and the clicks on them (``POST /hooks/slack``).

**Messages** (``SlackTarget``, a notification target: ``chat.postMessage`` / ``chat.update`` with the
bot token, ``Authorization: Bearer xoxb-...``). A run waiting for approval becomes a Block Kit
message: the plan (its steps when known), its digest, the console link, a reason field and two
buttons, *Approve this plan* and *Reject with a reason*, whose value carries the run id and the
plan digest shown. The run's other events are posted in the message's thread (or to the channel).
Slack answers HTTP 200 with ``"ok": false`` for an error: counted as a failure, not retried.

**Clicks** (``SlackInteractions``): Slack POSTs ``application/x-www-form-urlencoded`` with one field,
``payload`` (the ``block_actions`` JSON). Before anything is parsed the request is verified as Slack
documents (signing secret, ``X-Slack-Signature: v0=<hex HMAC-SHA256(secret, "v0:<ts>:<raw body>")>``,
``X-Slack-Request-Timestamp`` within ``max_age`` (5 minutes) of our clock, compared in constant
time); a request already received (its signature) is refused as a replay. The Slack user id is
mapped to an approver name by the configuration (``notify.slack.users``); an unmapped user decides
nothing. The decision then goes through the **same server-side functions the console calls**
(``Dispatcher.approve`` / ``Dispatcher.reject``): the requester rule, the approval policy and the
way approvals are recorded are theirs, not this module's. The message is updated with who decided
and the outcome; a click on a plan that changed (a stale digest) is refused and the message says
why. The bot token and the signing secret are secrets: never logged, never in a message.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import parse_qs

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.errors import StalePlan, UsageError
from engine.serve.access import Identity
from engine.serve.delivery import Sender
from engine.serve.dispatcher import NotFound, SelfApproval
from engine.serve.notify import Notification

log = logging.getLogger(__name__)
SIGNATURE_HEADER = "X-Slack-Signature"
TIMESTAMP_HEADER = "X-Slack-Request-Timestamp"
APPROVE, REJECT = "runbook-approve", "runbook-reject"
REASON_BLOCK, REASON_ACTION = "runbook-reason", "reason"
DECISION = "slack-decision"  # the internal notification that updates a message after a click
MAX_BODY = 256 * 1024
MAX_REASON = 500
_MAX_MESSAGES = 10_000


class SlackSignatureError(Exception):
    """Missing headers (400), or a signature that does not match or is too old (403)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def sign(body: bytes, secret: str, timestamp: int | str) -> str:
    """``v0=<hex HMAC-SHA256(secret, "v0:<timestamp>:<body>")>``: what Slack sends."""
    base = f"v0:{timestamp}:".encode() + body
    return "v0=" + hmac.new(secret.encode("utf-8"), base, hashlib.sha256).hexdigest()


def verify(body: bytes, timestamp: str | None, signature: str | None, secret: str, *, now: float,
           max_age: float = 300.0) -> None:
    """Return when ``signature`` signs ``body`` at ``timestamp`` with ``secret`` and the timestamp is
    within ``max_age`` of ``now``; raise ``SlackSignatureError`` otherwise."""
    if not timestamp or not signature:
        raise SlackSignatureError(f"missing {TIMESTAMP_HEADER} or {SIGNATURE_HEADER}", 400)
    if not timestamp.strip().isdigit() or not signature.startswith("v0=") or len(signature) != 67:
        raise SlackSignatureError(f"malformed {TIMESTAMP_HEADER} or {SIGNATURE_HEADER}", 400)
    if abs(now - int(timestamp)) > max_age:
        raise SlackSignatureError(f"request signed {now - int(timestamp):.0f}s from our clock, more than the "
                                  f"{max_age:.0f}s accepted: refused as a possible replay", 403)
    if not hmac.compare_digest(sign(body, secret, timestamp.strip()), signature):
        raise SlackSignatureError("signature does not match", 403)


def _esc(text: str) -> str:
    """Slack mrkdwn: ``&``, ``<`` and ``>`` are control characters (links, mentions)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _link(url: str | None, label: str = "open in the console") -> str:
    return f"<{_esc(url)}|{label}>" if url else ""


def _head(runbook: str, node: str | None, run_id: str | None) -> str:
    where = f" on *{_esc(node)}*" if node else ""
    return f"*runbook {_esc(runbook)}*{where}: run `{_esc(run_id or '?')}`"


def approval_blocks(n: Notification) -> list[dict[str, Any]]:
    """The interactive message of a run waiting for approval."""
    b = n.bounded()
    digest = str(b.extra.get("plan_digest") or "")
    lines = [f":raised_hand: {_head(b.runbook, b.node, b.run_id)} has a plan waiting for approval"]
    if b.reason:
        lines.append(_esc(b.reason))
    lines += [f":warning: {_esc(w)}" for w in b.warnings]
    blocks: list[dict[str, Any]] = [{"type": "section", "text": {"type": "mrkdwn", "text": "\n".join(lines)[:2900]}}]
    if b.extra.get("plan"):
        blocks.append({"type": "section", "text": {"type": "mrkdwn",
                                                   "text": f"*Plan:* {_esc(str(b.extra['plan']))}"[:2900]}})
    context = f"plan digest `{_esc(digest)}`" + (f" · {_link(b.link)}" if b.link else "")
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": context}]})
    value = json.dumps({"run_id": b.run_id, "plan_digest": digest}, separators=(",", ":"))
    blocks += [
        {"type": "input", "block_id": REASON_BLOCK, "optional": True,
         "label": {"type": "plain_text", "text": "Reason (needed to reject)"},
         "element": {"type": "plain_text_input", "action_id": REASON_ACTION, "max_length": MAX_REASON}},
        {"type": "actions", "block_id": "runbook-decision", "elements": [
            {"type": "button", "action_id": APPROVE, "style": "primary", "value": value,
             "text": {"type": "plain_text", "text": "Approve this plan"}},
            {"type": "button", "action_id": REJECT, "style": "danger", "value": value,
             "text": {"type": "plain_text", "text": "Reject with a reason"}}]},
    ]
    return blocks


def decided_blocks(n: Notification, lines: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The message after a click or a change of the run: what happened to it (``lines``, oldest
    first: who decided, the outcome); the buttons again only when the run still waits for a
    decision (a click refused for a reason the clicker can fix)."""
    extra = n.extra
    shown = "\n".join(_esc(line) for line in lines[-10:])
    head = f"{_head(n.runbook, n.node, n.run_id)}\n{shown}"[:2900]
    blocks: list[dict[str, Any]] = [{"type": "section", "text": {"type": "mrkdwn", "text": head}}]
    context = f"plan digest `{_esc(str(extra.get('plan_digest', '')))}`" + (f" · {_link(n.link)}" if n.link else "")
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": context}]})
    if extra.get("keep_buttons") and n.extra.get("plan_digest"):
        blocks += approval_blocks(n)[-2:]
    return blocks


_STATE_LINES = {"started": ":arrow_forward: run started", "finished": ":white_check_mark: run succeeded",
                "failed": ":x: run failed", "blocked": ":no_entry: run blocked"}


class SlackTarget:
    """Posts and updates messages in one channel through the Web API."""

    name = "slack"

    def __init__(self, bot_token: str, channel: str, *, api_url: str = "https://slack.com/api",
                 events: Sequence[str] = ("started", "waiting-approval", "finished", "failed", "blocked")) -> None:
        self._token = bot_token
        self.channel = channel
        self.api_url = api_url.rstrip("/")
        self.events = frozenset(events)
        self.messages: OrderedDict[str, tuple[str, str]] = OrderedDict()  # run id -> (channel, ts)
        self.history: dict[str, list[str]] = {}  # run id -> what became of its approval message
        self.digests: dict[str, str] = {}  # run id -> the digest its approval message showed

    def __repr__(self) -> str:  # Why: the bot token must never reach a log
        return f"SlackTarget(channel={self.channel!r}, api_url={self.api_url!r})"

    @classmethod
    def from_config(cls, cfg: Any) -> SlackTarget:
        return cls(cfg.bot_token, cfg.channel, api_url=cfg.api_url, events=cfg.events)

    def wants(self, n: Notification) -> bool:
        return n.event == DECISION or n.event in self.events

    def _call(self, send: Sender, method: str, body: Mapping[str, Any], what: str) -> dict[str, Any] | None:
        headers = {"Authorization": f"Bearer {self._token}", "Content-Type": "application/json; charset=utf-8"}
        answer: dict[str, Any] = {}

        def accept(response: Any) -> str | None:
            try:
                data = response.json()
            except ValueError:
                return "slack: the answer is not JSON"
            if not isinstance(data, dict) or data.get("ok") is not True:
                error = data.get("error") if isinstance(data, dict) else None
                return f"slack {method}: {str(error or 'not ok')[:100]}"
            answer.update(data)
            return None

        done = send("POST", f"{self.api_url}/{method}", json.dumps(body, separators=(",", ":")).encode("utf-8"),
                    headers, what=what, accept=accept)
        return answer if done is not None else None

    def deliver(self, n: Notification, send: Sender) -> None:
        what = f"{n.event} for {n.run_id or n.runbook}"
        if n.event == DECISION:
            channel, ts = str(n.extra.get("channel", "")), str(n.extra.get("ts", ""))
            lines = self.history.setdefault(n.run_id or "", [])
            lines.append(str(n.extra.get("outcome", "")))
            if channel and ts:
                self._call(send, "chat.update", {"channel": channel, "ts": ts, "text": lines[-1],
                                                 "blocks": decided_blocks(n, lines)}, what)
            return
        text = n.text()[:3000]
        body: dict[str, Any] = {"channel": self.channel, "text": text, "unfurl_links": False}
        known = self.messages.get(n.run_id or "")
        if n.event == "waiting-approval":
            body["blocks"] = approval_blocks(n)
        elif known is not None:
            body["thread_ts"] = known[1]
        answer = self._call(send, "chat.postMessage", body, what)
        if answer is not None and n.event == "waiting-approval" and n.run_id:
            self.messages[n.run_id] = (str(answer.get("channel") or self.channel), str(answer.get("ts") or ""))
            self.history[n.run_id] = []
            self.digests[n.run_id] = str(n.extra.get("plan_digest") or "")
            while len(self.messages) > _MAX_MESSAGES:
                gone, _ = self.messages.popitem(last=False)
                self.history.pop(gone, None)
                self.digests.pop(gone, None)
        elif known is not None and n.event in _STATE_LINES and n.run_id:
            # Why: the approval message must stop offering buttons once the run moved on (approved in
            # the console, ended), and show what became of it
            lines = self.history.setdefault(n.run_id, [])
            lines.append(_STATE_LINES[n.event] + (f": {n.reason.splitlines()[0][:300]}" if n.reason else ""))
            done = Notification(n.event, n.runbook, node=n.node, run_id=n.run_id, link=n.link,
                                extra={"plan_digest": self.digests.get(n.run_id, "")})
            self._call(send, "chat.update", {"channel": known[0], "ts": known[1], "text": lines[-1],
                                             "blocks": decided_blocks(done, lines)}, f"update for {n.run_id}")


class SlackInteractions:
    """``POST /hooks/slack``: verified clicks on approval messages -> the dispatcher's approve/reject."""

    def __init__(self, cfg: Any, dispatcher: Any, *, replays: Any, notify: Callable[[Notification], None],
                 clock: Callable[[], float] = time.time, body_timeout: float = 10.0) -> None:
        self.cfg = cfg
        self.dispatcher = dispatcher
        self.replays = replays
        self.notify = notify
        self._clock = clock
        self.body_timeout = body_timeout

    async def _body(self, request: Request) -> bytes | None:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY:
            return None
        chunks, size = [], 0
        async with asyncio.timeout(self.body_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY:
                    return None
                chunks.append(chunk)
        return b"".join(chunks)

    async def handle(self, request: Request) -> tuple[Response, str]:
        try:
            body = await self._body(request)
        except TimeoutError:
            return JSONResponse({"error": "the body did not arrive in time"}, status_code=408), "timeout"
        if body is None:
            return JSONResponse({"error": "body too large"}, status_code=413), "too-large"
        signature = request.headers.get(SIGNATURE_HEADER)
        try:
            verify(body, request.headers.get(TIMESTAMP_HEADER), signature, self.cfg.signing_secret,
                   now=self._clock(), max_age=self.cfg.max_age)
        except SlackSignatureError as e:
            return JSONResponse({"error": str(e)}, status_code=e.status), \
                "bad-request" if e.status == 400 else "forbidden"
        # Why the signature: it covers the timestamp and the body, so a replay inside the window
        # carries the same one; a fresh request never does.
        if not self.replays.claim("slack-" + str(signature)):
            return JSONResponse({"error": "this request was already received"}, status_code=409), "duplicate"
        try:
            action = parse_action(body)
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=400), "bad-request"
        outcome = await run_in_threadpool(self.decide, action)
        return JSONResponse({"status": outcome}), outcome

    def decide(self, a: ClickAction) -> str:
        """Apply one verified click; queue the message's update; the outcome for metrics."""
        name = self.cfg.users.get(a.user_id)
        try:
            run = self.dispatcher.run(a.run_id)
        except NotFound:
            self._update(a, None, f"no run {a.run_id} on this server: nothing was done", keep=False)
            return "not-found"
        if name is None:
            self._update(a, run, f"Slack user {a.user_id} is not mapped to an approver (notify.slack.users): "
                                 "nothing was done", keep=True)
            return "forbidden"
        who = Identity(name, "approver")
        try:
            if a.action == REJECT:
                if not 0 < len(a.reason) <= MAX_REASON:
                    self._update(a, run, f"{name}: to reject, write the reason in the field first "
                                         f"(1 to {MAX_REASON} characters); nothing was done", keep=True)
                    return "invalid"
                self.dispatcher.reject(a.run_id, a.reason, who)
                self._update(a, run, f":no_entry: Rejected by {name} (Slack): {a.reason}. The run is cancelled.",
                             keep=False)
                return "rejected"
            result = self.dispatcher.approve(a.run_id, a.plan_digest, who)
        except SelfApproval as e:
            self._update(a, run, f"approval by {name} refused: {e}", keep=True)
            return "forbidden"
        except StalePlan as e:
            changed = run.get("plan_digest") and run.get("plan_digest") != a.plan_digest
            why = ("the plan changed since this message was posted (its digest is no longer the run's): "
                   "review the new plan in the console" if changed else str(e))
            self._update(a, run, f"{'rejection' if a.action == REJECT else 'approval'} by {name} refused: {why}",
                         keep=False)
            return "conflict"
        except (UsageError, NotFound) as e:
            self._update(a, run, f"decision by {name} refused: {e}", keep=True)
            return "invalid"
        note = result.get("note") if isinstance(result, Mapping) else None
        # An approval policy wanting more approvers ("1 of 2 approvals"): the buttons stay for the next one.
        more = isinstance(result, Mapping) and not (result.get("approvals") or {}).get("satisfied", True)
        self._update(a, run, f":white_check_mark: Approved by {name} (Slack)."
                             + (f" {note}" if note else " The run executes now."), keep=more)
        return "approved"

    def _update(self, a: ClickAction, run: Mapping[str, Any] | None, outcome: str, *, keep: bool) -> None:
        log.info("slack click on run %s by %s: %s", a.run_id, a.user_id, outcome)
        nodes = (run or {}).get("nodes") or [None]
        self.notify(Notification(DECISION, str((run or {}).get("runbook") or "?"), node=nodes[0], run_id=a.run_id,
                                 extra={"channel": a.channel, "ts": a.message_ts, "outcome": outcome,
                                        "plan_digest": a.plan_digest, "keep_buttons": keep}))


class ClickAction:
    """One click of a ``block_actions`` payload, as far as runbook reads it."""

    def __init__(self, *, action: str, run_id: str, plan_digest: str, user_id: str, channel: str,
                 message_ts: str, reason: str) -> None:
        self.action, self.run_id, self.plan_digest = action, run_id, plan_digest
        self.user_id, self.channel, self.message_ts, self.reason = user_id, channel, message_ts, reason


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def parse_action(body: bytes) -> ClickAction:
    """A verified form body (``payload=<JSON>``) -> the click; ValueError naming what is wrong."""
    try:
        form = parse_qs(body.decode("utf-8"), max_num_fields=10, strict_parsing=False)
        data = json.loads(form["payload"][0])
    except (UnicodeDecodeError, KeyError, IndexError, ValueError, RecursionError) as e:
        raise ValueError("expected a form with a payload field holding JSON (a Slack interaction)") from e
    if not isinstance(data, dict) or data.get("type") != "block_actions":
        raise ValueError("only block_actions interactions are handled")
    actions = [x for x in data.get("actions") or [] if isinstance(x, dict) and x.get("action_id") in (APPROVE, REJECT)]
    if len(actions) != 1:
        raise ValueError("expected one runbook-approve or runbook-reject action")
    try:
        value = json.loads(str(actions[0].get("value") or ""))
        run_id, digest = str(value["run_id"]), str(value["plan_digest"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError("the button's value is not a runbook run and plan digest") from e
    user = _obj(data.get("user"))
    container = _obj(data.get("container"))
    channel = container.get("channel_id") or _obj(data.get("channel")).get("id") or ""
    ts = container.get("message_ts") or _obj(data.get("message")).get("ts") or ""
    state = _obj(_obj(_obj(data.get("state")).get("values")).get(REASON_BLOCK))
    reason = str(_obj(state.get(REASON_ACTION)).get("value") or "").strip()
    if not run_id or not 0 < len(digest) <= 200 or not user.get("id"):
        raise ValueError("the click names no run, plan digest or user")
    return ClickAction(action=str(actions[0]["action_id"]), run_id=run_id[:200], plan_digest=digest,
                       user_id=str(user["id"])[:40], channel=str(channel)[:80], message_ts=str(ts)[:40],
                       reason=reason[:MAX_REASON + 1])
