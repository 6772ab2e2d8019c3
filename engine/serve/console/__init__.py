"""The web console of ``runbook serve``: server-rendered pages for runs, their plans and approvals.

Routes (mounted by ``engine.serve.app``)::

    GET  /ui/                      runs, newest first, waiting-approval pinned; ?state= ?node= ?runbook=
    GET  /ui/runs/{id}             one run: params, preconditions, steps, diffs, timeline, report
    GET  /ui/runs/{id}/live        server-sent events: the run's live part, re-rendered on each change
    POST /ui/runs/{id}/decision    approve (the digest the page showed) or reject (a reason) - form, CSRF
                                   token, approver session
    GET  /ui/plans                 the plans page: request a plan, or upload a saved plan file
    POST /ui/plans/request         runbook + node (+ params) -> its plan now (read-only), shown - form, CSRF
    POST /ui/plans/upload          a plan file (``runbook plan --out``) -> checked and shown - multipart, CSRF
    GET  /ui/login, POST /ui/login a credential -> a session cookie; POST /ui/logout ends it
    GET  /ui/static/{name}         the stylesheet and script (package data; nothing from a CDN)

Pages are Jinja2 templates with autoescape on: labels, params and journal text are data, never
markup. A session holds the identity its credential is bound to (``engine.serve.access``); the
approver recorded is that identity. Every form carries a CSRF token bound to the session (the login
form: to a short-lived cookie). The plans page plans through ``RunStarter.preview`` (recorded
nowhere, changing nothing) and parses uploads in ``engine.serve.console.plans``. This module renders
and authenticates; it decides nothing about runs (the ``Dispatcher`` does) and never writes the
journal itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, quote

from jinja2 import Environment, PackageLoader, select_autoescape
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from engine.errors import ConnectorError, LoadError, RunbookError, StalePlan, UsageError
from engine.model import Plan, RunState
from engine.serve.access import Access, Identity, ReviewsBusy, TooManyFailures, client_of
from engine.serve.config import ConsoleConfig, ServeConfig
from engine.serve.console.plans import (
    MAX_PLAN_BYTES,
    PartScanner,
    UploadError,
    multipart_fields,
    parse_params,
    parse_plan_file,
    plan_view,
)
from engine.serve.dispatcher import Dispatcher, NotFound, SelfApproval
from engine.serve.http import BodyBudget, BodyTimeout, BodyTooLarge, ServerBusy, read_body, release_body
from engine.serve.kube_identity import IdentityUnavailable

log = logging.getLogger(__name__)

SESSION_COOKIE = "runbook_session"
LOGIN_COOKIE = "runbook_login"
MAX_FORM_BYTES = 16 * 1024
MAX_REASON = 500
MAX_UPLOAD_BYTES = MAX_PLAN_BYTES + 64 * 1024  # the plan file and the form around it
MAX_DRAIN_BYTES = 8 * 1024 * 1024  # a larger upload is read to its end (so the browser shows our answer)
MAX_PLANNING = 2  # plans being made at once from the page (each gathers facts over SSH)
FINAL = frozenset(s.value for s in RunState if s.is_final)  # the live stream ends for these
# the runs page's state filter: the run states, those waiting for a person first
STATES = tuple(s.value for s in sorted(RunState, key=lambda s: s is not RunState.WAITING_APPROVAL))
_STATIC = {"console.css": "text/css; charset=utf-8", "console.js": "text/javascript; charset=utf-8"}


_NOTICES = {"approved": "approval recorded", "rejected": "rejection recorded: the run is cancelled"}


class FormError(Exception):
    """A form body that is too large, late or not a form."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class RunWatch:
    """One run followed for the live pages: the latest rendering input, shared by every viewer."""

    run: Mapping[str, Any] | None = None
    mark: str = ""
    version: int = 0
    done: bool = False
    viewers: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    task: asyncio.Task[None] | None = None

    def moved(self, since: int) -> bool:
        return self.version != since or self.done


class SessionsFull(Exception):
    """Every session slot is held by a live session (of other identities): the login is refused."""


class StreamSlots:
    """Live streams open at once: in total, per session and per client address (event loop only)."""

    def __init__(self, config: ConsoleConfig) -> None:
        self.config = config
        self.total = 0
        self.by_session: dict[str, int] = {}
        self.by_client: dict[str, int] = {}

    def admit(self, session: str, client: str) -> tuple[int, str] | None:
        """Take a slot; else (status, why): 503 when the server is full, 429 for this caller."""
        c = self.config
        if self.total >= c.max_streams:
            return 503, f"{c.max_streams} live streams are open on this server; reload later"
        if self.by_session.get(session, 0) >= c.max_streams_per_session:
            return 429, f"this session has {c.max_streams_per_session} live streams open already"
        if self.by_client.get(client, 0) >= c.max_streams_per_client:
            return 429, f"this address has {c.max_streams_per_client} live streams open already"
        self.total += 1
        self.by_session[session] = self.by_session.get(session, 0) + 1
        self.by_client[client] = self.by_client.get(client, 0) + 1
        return None

    def release(self, session: str, client: str) -> None:
        self.total -= 1
        for counts, key in ((self.by_session, session), (self.by_client, client)):
            counts[key] -= 1
            if counts[key] <= 0:
                del counts[key]


class CountedStream(StreamingResponse):
    """A streaming answer that gives its stream slot back however it ends (finished, cancelled, the
    client gone before the first byte)."""

    def __init__(self, *args: Any, on_close: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


@dataclass
class Session:
    identity: Identity
    csrf: str
    expires: float
    created: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.time)  # the idle timeout counts from here
    # a Kubernetes token (auth.mode kubernetes), kept in memory only: asked about again before each
    # approval or rejection, so a revoked RoleBinding or an expired token stops the session from acting
    kube_token: str = field(default="", repr=False)


def _parse_time(iso: Any) -> datetime | None:
    if not isinstance(iso, str) or not iso:
        return None
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return None


def duration(started: Any, finished: Any, now: float | None = None) -> str:
    """``"1m 05s"`` from two ISO times (to now while running); ``""`` when unknown."""
    start = _parse_time(started)
    if start is None:
        return ""
    end = _parse_time(finished)
    seconds = (end.timestamp() if end else (now or time.time())) - start.timestamp()
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


def _epoch_iso(value: Any) -> str:
    if isinstance(value, int | float) and value > 0:
        return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    return str(value or "")


def node_of(run: Mapping[str, Any]) -> str:
    nodes = run.get("nodes") or []
    if nodes:
        return str(nodes[0])
    params = run.get("params") or {}
    return str(params.get("node", "")) if isinstance(params, Mapping) else ""


def trigger_text(run: Mapping[str, Any]) -> str:
    source = str(run.get("source") or "")
    label = {"cli": "CLI", "alertmanager": "Alertmanager", "pagerduty": "PagerDuty", "node-condition": "Node condition",
             "remediation": "RunbookRemediation"}.get(source, source)
    # paged runs' reasons read "alertmanager: KubeNodeNotReady{node=...} ..." (engine.serve.triggers)
    reason = str(run.get("reason") or "")
    alert = ""
    if source and reason.startswith(f"{source}: "):
        rest = reason[len(source) + 2:]
        words = 2 if source == "pagerduty" else 1  # "incident PXXXX"
        alert = " ".join(rest.split("{", 1)[0].split(" ")[:words])[:80]
    return f"{label} ({alert})" if alert and alert != label else label


def order_runs(runs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Waiting-for-approval runs first, then the rest; each group keeps its newest-first order."""
    waiting = [r for r in runs if r.get("state") == "waiting-approval"]
    return waiting + [r for r in runs if r.get("state") != "waiting-approval"]


def filter_runs(runs: Sequence[Mapping[str, Any]], *, state: str = "", node: str = "",
                runbook: str = "") -> list[Mapping[str, Any]]:
    return [r for r in runs if (not state or r.get("state") == state) and (not node or node_of(r) == node)
            and (not runbook or r.get("runbook") == runbook)]


def steps_view(run: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The plan's steps joined with what the journal says happened to each (start, outcome, checks)."""
    plan = run.get("plan") or {}
    events = [e for e in run.get("events") or [] if isinstance(e, Mapping)]
    out = []
    for step in plan.get("steps") or []:
        sid = step.get("id")
        mine = [e for e in events if e.get("step") == sid]
        outcome = next((e for e in reversed(mine) if e.get("kind") == "step.outcome"), None)
        started = next((e for e in mine if e.get("kind") == "step.start"), None)
        verifies = [e for e in mine if e.get("kind") == "verify.result"]
        status = outcome.get("status") if outcome else ("running" if started else "planned")
        out.append({"plan": step, "status": status, "outcome": outcome, "verifies": verifies,
                    "started_at": _epoch_iso(outcome.get("started_at")) if outcome else "",
                    "finished_at": _epoch_iso(outcome.get("finished_at")) if outcome else ""})
    return out


def diff_lines(text: str) -> list[tuple[str, str]]:
    """Each line of a unified diff with its class: ``add``, ``del``, ``hunk``, ``meta`` or ``ctx``."""
    out = []
    for line in text.splitlines():
        if line.startswith(("+++", "---")):
            cls = "meta"
        elif line.startswith("+"):
            cls = "add"
        elif line.startswith("-"):
            cls = "del"
        elif line.startswith("@@"):
            cls = "hunk"
        else:
            cls = "ctx"
        out.append((cls, line))
    return out


def live_mark(run: Mapping[str, Any]) -> str:
    """A short fingerprint of what the live part of a run page shows: the stream sends a new
    rendering only when it changes (and not the one the page was loaded with)."""
    mark = (run.get("state"), len(run.get("events") or []), run.get("plan_digest"), run.get("approved_by"))
    return hashlib.sha256(repr(mark).encode()).hexdigest()[:16]


def _environment() -> Environment:
    env = Environment(loader=PackageLoader("engine.serve.console", "templates"),
                      autoescape=select_autoescape(default=True, default_for_string=True),
                      trim_blocks=True, lstrip_blocks=True)
    env.globals.update(node_of=node_of, trigger_text=trigger_text, duration=duration, states=STATES,
                       diff_lines=diff_lines, final_states=FINAL)
    return env


class Console:
    """The console's handlers over one dispatcher and one set of credentials."""

    def __init__(self, config: ServeConfig, dispatcher: Dispatcher, access: Access,
                 budget: BodyBudget | None = None) -> None:
        self.config = config
        self.dispatcher = dispatcher
        self.access = access
        self.budget = budget or BodyBudget(config.limits.max_body_reads, config.limits.buffered_bytes)
        self.env = _environment()
        self.sessions: dict[str, Session] = {}
        # seconds between looks at a followed run at least: one store read per look per run being
        # watched, however many pages follow it (RunWatch); more runs followed: each looked at less
        # often, so that all of them together stay within console.live_reads_per_second
        self.poll = config.console.live_poll_seconds or 0.1
        self.watches: dict[str, RunWatch] = {}
        self.streams = StreamSlots(config.console)
        self.planning = asyncio.Semaphore(MAX_PLANNING)
        self.static = {name: resources.files(__package__).joinpath("static", name).read_bytes()
                       for name in _STATIC}

    # -- sessions -----------------------------------------------------------------------------

    def _ended(self, sess: Session, now: float) -> bool:
        return sess.expires < now or now - sess.last_seen > self.config.console.idle_seconds

    def _session(self, request: Request) -> Session | None:
        key = request.cookies.get(SESSION_COOKIE, "")
        sess = self.sessions.get(key) if key else None
        if sess is None:
            return None
        now = time.time()
        if self._ended(sess, now):
            self.sessions.pop(key, None)
            return None
        sess.last_seen = now
        return sess

    def _new_session(self, identity: Identity, kube_token: str = "") -> tuple[str, Session]:
        """A session for ``identity``: its own oldest session ends beyond
        ``console.max_sessions_per_identity``; another identity's never does (``SessionsFull``)."""
        c = self.config.console
        now = time.time()
        for key in [k for k, s in self.sessions.items() if self._ended(s, now)]:
            del self.sessions[key]
        mine = sorted((k for k, s in self.sessions.items() if s.identity.name == identity.name),
                      key=lambda k: self.sessions[k].created)
        while mine and (len(mine) >= c.max_sessions_per_identity or len(self.sessions) >= c.max_sessions):
            del self.sessions[mine.pop(0)]
        if len(self.sessions) >= c.max_sessions:
            raise SessionsFull(f"{c.max_sessions} sessions are open on this server; try again later")
        key = secrets.token_urlsafe(32)
        sess = Session(identity, secrets.token_urlsafe(32), now + c.session_seconds, created=now, last_seen=now,
                       kube_token=kube_token)
        self.sessions[key] = sess
        return key, sess

    def _secure(self, request: Request) -> bool:
        public = self.config.public_url or ""
        return request.url.scheme == "https" or str(public or "").startswith("https://")

    def _viewer(self, request: Request) -> tuple[Session | None, Response | None]:
        """The session, or a redirect to the login page when reads need a credential."""
        sess = self._session(request)
        if sess is None and not self.access.open_reads:
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            return None, RedirectResponse(f"/ui/login?next={quote(target, safe='')}", status_code=303)
        return sess, None

    async def _body(self, request: Request, limit: int, *, drain: int = 0, what: str = "form") -> bytes:
        """The body, at most ``limit`` bytes; a larger one (up to ``drain``) is read to its end and
        dropped before ``FormError`` (413), so that a browser gets the page that says why."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max(limit, drain):
            raise FormError(f"{what} too large ({int(declared)} bytes; at most {limit})", 413)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.config.limits.body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > max(limit, drain):
                        raise FormError(f"{what} too large (more than {limit} bytes)", 413)
                    if size <= limit:
                        chunks.append(chunk)
        except TimeoutError as e:
            raise FormError(f"the {what} did not arrive in time") from e
        if size > limit:
            raise FormError(f"{what} too large ({size} bytes; at most {limit})", 413)
        return b"".join(chunks)

    async def _form(self, request: Request) -> dict[str, str]:
        media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media != "application/x-www-form-urlencoded":
            raise FormError("expected a form (application/x-www-form-urlencoded)")
        body = await self._body(request, MAX_FORM_BYTES)
        try:
            parsed = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=20)
        except (UnicodeDecodeError, ValueError) as e:
            raise FormError(f"unreadable form: {e}") from e
        return {k: v[0] for k, v in parsed.items()}

    def _page(self, template: str, request: Request, status: int = 200, **context: Any) -> HTMLResponse:
        sess = self._session(request)
        html = self.env.get_template(template).render(
            viewer=sess.identity if sess else None, csrf=sess.csrf if sess else "",
            open_reads=self.access.open_reads, kube_auth=self.access.kube is not None, **context)
        return HTMLResponse(html, status_code=status, headers={
            "Cache-Control": "no-store", "X-Frame-Options": "DENY", "Referrer-Policy": "same-origin",
            "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                                       "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'"})

    # -- pages --------------------------------------------------------------------------------

    async def static_file(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in _STATIC:
            return Response("not found", status_code=404, media_type="text/plain")
        return Response(self.static[name], media_type=_STATIC[name], headers={"Cache-Control": "max-age=300"})

    async def root(self, request: Request) -> Response:
        return RedirectResponse("/ui/", status_code=303)

    async def login_form(self, request: Request, *, error: str = "", status: int = 200) -> Response:
        token = secrets.token_urlsafe(32)
        nxt = request.query_params.get("next", "/ui/")
        response = self._page("login.html", request, status=status, login_csrf=token, error=error,
                              next=nxt if nxt.startswith("/ui/") else "/ui/")
        response.set_cookie(LOGIN_COOKIE, token, max_age=600, path="/ui/", httponly=True, samesite="strict",
                            secure=self._secure(request))
        return response

    async def login(self, request: Request) -> Response:
        try:
            form = await self._form(request)
        except FormError as e:
            return await self.login_form(request, error=str(e), status=400)
        cookie = request.cookies.get(LOGIN_COOKIE, "")
        if not cookie or not hmac.compare_digest(cookie, form.get("csrf", "")):
            return await self.login_form(request, error="the login form expired; try again", status=403)
        credential = form.get("credential", "").strip()
        client = client_of(request)
        try:
            if credential and len(credential) <= 8192:
                who = await self.access.resolve(f"Bearer {credential}", client)
            else:
                self.access.failures.check(client)
                self.access.failures.failed(client)
                who = None
        except IdentityUnavailable as e:
            return await self.login_form(request, error=str(e), status=503)
        except TooManyFailures as e:
            response = await self.login_form(request, error=str(e), status=429)
            response.headers["Retry-After"] = str(max(1, round(e.retry_after)))
            return response
        except ReviewsBusy as e:
            return await self.login_form(request, error=str(e), status=503)
        if who is None:
            return await self.login_form(request, error="unknown credential", status=401)
        if not who.may("reader", "approver"):
            return await self.login_form(request, error=f"the credential of {who.name} ({who.role}) may not "
                                                        "read runs", status=403)
        kube = self.access.kube is not None and not self.access.insecure and \
            self.access.identify_configured(f"Bearer {credential}") is None
        try:
            key, _ = self._new_session(who, kube_token=credential if kube else "")
        except SessionsFull as e:
            return await self.login_form(request, error=str(e), status=503)
        nxt = form.get("next", "/ui/")
        response = RedirectResponse(nxt if nxt.startswith("/ui/") and "//" not in nxt else "/ui/", status_code=303)
        response.set_cookie(SESSION_COOKIE, key, max_age=int(self.config.console.session_seconds), path="/",
                            httponly=True, samesite="strict", secure=self._secure(request))
        response.delete_cookie(LOGIN_COOKIE, path="/ui/", httponly=True, samesite="strict")
        return response

    async def logout(self, request: Request) -> Response:
        """End the session on the server (its cookie no longer opens anything), whatever the form
        carries: a logout that only dropped the browser's cookie would leave a copied cookie valid.
        (The cookie is SameSite=strict: another site cannot log anyone out.)"""
        self.sessions.pop(request.cookies.get(SESSION_COOKIE, ""), None)
        response = RedirectResponse("/ui/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
        return response

    async def runs(self, request: Request) -> Response:
        _, redirect = self._viewer(request)
        if redirect is not None:
            return redirect
        q = request.query_params
        wanted = {k: q.get(k, "")[:253] for k in ("state", "node", "runbook")}
        runs = await run_in_threadpool(self.dispatcher.runs, 500)
        shown = order_runs(filter_runs(runs, **wanted))
        return self._page("runs.html", request, runs=shown[:200], wanted=wanted,
                          runbooks=sorted({str(r.get("runbook")) for r in runs}),
                          nodes=sorted({node_of(r) for r in runs} - {""}))

    def _run_context(self, run: Mapping[str, Any]) -> dict[str, Any]:
        events = [e for e in run.get("events") or [] if isinstance(e, Mapping)]
        report = next((e for e in reversed(events) if e.get("kind") == "run.finish"), None)
        return {"run": run, "plan": run.get("plan") or {}, "steps": steps_view(run), "events": events,
                "report": report, "node": node_of(run), "mark": live_mark(run)}

    async def _load(self, run_id: str) -> Mapping[str, Any] | None:
        try:
            return await run_in_threadpool(self.dispatcher.run, run_id)
        except NotFound:
            return None

    async def run(self, request: Request, *, error: str = "", notice: str = "", status: int = 200) -> Response:
        _, redirect = self._viewer(request)
        if redirect is not None:
            return redirect
        run = await self._load(request.path_params["run_id"])
        if run is None:
            return self._page("error.html", request, status=404, message="no such run")
        notice = notice or _NOTICES.get(request.query_params.get("notice", ""), "")
        return self._page("run.html", request, status=status, error=error, notice=notice, **self._run_context(run))

    async def decision(self, request: Request) -> Response:
        sess = self._session(request)
        try:
            form = await self._form(request)
        except FormError as e:
            return self._page("error.html", request, status=400, message=str(e))
        if sess is None:
            return self._page("error.html", request, status=401, message="log in first")
        if not hmac.compare_digest(sess.csrf, form.get("csrf", "")):
            return self._page("error.html", request, status=403, message="the form's CSRF token is missing or "
                              "wrong; reload the page")
        identity = sess.identity
        if sess.kube_token:
            try:
                now = await self.access.resolve(f"Bearer {sess.kube_token}", client_of(request))
            except (IdentityUnavailable, ReviewsBusy) as e:
                return self._page("error.html", request, status=503, message=str(e))
            except TooManyFailures as e:
                return self._page("error.html", request, status=429, message=str(e))
            if now is None or now.name != identity.name:
                self.sessions.pop(request.cookies.get(SESSION_COOKIE, ""), None)
                return self._page("error.html", request, status=401,
                                  message="your Kubernetes token is no longer valid; log in again")
            identity = now
        if not identity.may("approver"):
            return self._page("error.html", request, status=403,
                              message=f"{identity.name} ({identity.role}) may not approve runs")
        run_id = request.path_params["run_id"]
        if form.get("action") == "reject":
            return await self._reject(request, run_id, identity, form.get("reason", "").strip())
        digest = form.get("plan_digest", "")
        if form.get("action") != "approve" or not 0 < len(digest) <= 200:
            return await self.run(request, error="expected action=approve and the plan digest", status=400)
        try:
            await run_in_threadpool(self.dispatcher.approve, run_id, digest, identity)
        except NotFound:
            return self._page("error.html", request, status=404, message="no such run")
        except SelfApproval as e:
            return await self.run(request, error=str(e), status=403)
        except StalePlan as e:
            return await self.run(request, error=f"approval refused: {e}", status=409)
        except UsageError as e:
            return await self.run(request, error=f"approval refused: {e}", status=422)
        return RedirectResponse(f"/ui/runs/{quote(run_id, safe='')}?notice=approved", status_code=303)

    async def _reject(self, request: Request, run_id: str, who: Identity, reason: str) -> Response:
        if not 0 < len(reason) <= MAX_REASON:
            return await self.run(request, error=f"say why you reject the plan (1 to {MAX_REASON} characters)",
                                  status=400)
        try:
            await run_in_threadpool(self.dispatcher.reject, run_id, reason, who)
        except NotFound:
            return self._page("error.html", request, status=404, message="no such run")
        except (StalePlan, UsageError) as e:
            return await self.run(request, error=f"rejection refused: {e}", status=409)
        return RedirectResponse(f"/ui/runs/{quote(run_id, safe='')}?notice=rejected", status_code=303)

    # -- plans --------------------------------------------------------------------------------

    async def plans(self, request: Request, *, plan: Plan | Mapping[str, Any] | None = None, source: str = "",
                    error: str = "", status: int = 200, form: Mapping[str, str] | None = None) -> Response:
        _, redirect = self._viewer(request)
        if redirect is not None:
            return redirect
        names = await run_in_threadpool(self.dispatcher.starter.runbook_names)
        view = plan_view(plan) if plan is not None else None
        blocked: list[str] = []
        expired = False
        if view is not None:
            try:
                typed = plan if isinstance(plan, Plan) else Plan.model_validate(view)
                blocked = typed.blocked_reasons
            except ValidationError:
                steps: Any = view.get("steps") or []
                blocked = [f"step {s.get('id')}: {s.get('reason')}" for s in steps
                           if isinstance(s, Mapping) and s.get("kind") == "blocked"]
            ends = _parse_time(view.get("expires_at"))
            expired = ends is not None and ends.timestamp() < time.time()
        shown = {"runbook": "", "node": "", "params": "", **dict(form or {})}
        return self._page("plans.html", request, status=status, runbooks=names, plan=view, source=source,
                          error=error, form=shown, steps=steps_view({"plan": view}) if view else [],
                          blocked=blocked, expired=expired)

    def _poster(self, request: Request, csrf: str) -> tuple[Session | None, str, int]:
        """The session that may post this form, or why not (message, status)."""
        sess = self._session(request)
        if sess is None:
            return None, "log in first", 401
        if not hmac.compare_digest(sess.csrf, csrf):
            return None, "the form's CSRF token is missing or wrong; reload the page", 403
        if not sess.identity.may("reader", "approver"):
            return None, f"{sess.identity.name} ({sess.identity.role}) may not read plans", 403
        return sess, "", 200

    async def upload_plan(self, request: Request) -> Response:
        """A plan file to show. Nothing of the body is read before the caller is known: the session
        first (cookie), then the form's first part, its CSRF token, as soon as it has arrived; the
        parts are counted while they arrive (reading stops past ``console.max_upload_parts``); the
        bytes count toward the server's body budget; splitting and parsing run in worker threads."""
        sess = self._session(request)
        if sess is None:
            return self._refuse(request, 401, "log in first")
        if not sess.identity.may("reader", "approver"):
            return self._refuse(request, 403, f"{sess.identity.name} ({sess.identity.role}) may not read plans")
        content_type = request.headers.get("content-type", "")
        try:
            scanner = PartScanner(content_type, max_parts=self.config.console.max_upload_parts)
        except UploadError as e:
            return self._refuse(request, e.status, str(e))
        checked = False

        def arrived(chunk: bytes) -> None:
            nonlocal checked
            scanner.feed(chunk)
            if not checked and (first := scanner.first_part()) is not None:
                if first[0] != "csrf" or not hmac.compare_digest(sess.csrf.encode(), first[1]):
                    raise UploadError("the form's CSRF token is missing or wrong; reload the page", 403)
                checked = True
            scanner.check_parts()

        try:
            body = await read_body(request, MAX_UPLOAD_BYTES, budget=self.budget,
                                   timeout=self.config.limits.body_timeout, on_chunk=arrived)
        except UploadError as e:
            return self._refuse(request, e.status, str(e))
        except BodyTooLarge:
            await self._drain(request)
            return await self.plans(request, error=f"the upload is too large: a plan file is at most {MAX_PLAN_BYTES} "
                                    "bytes", status=413)
        except BodyTimeout:
            return self._refuse(request, 408, "the upload did not arrive in time")
        except ServerBusy:
            return self._refuse(request, 503, "too many requests in flight; retry later")
        try:
            fields = await run_in_threadpool(multipart_fields, content_type, body,
                                             max_fields=self.config.console.max_upload_parts)
            csrf = fields.get("csrf", (None, b""))[1]
            if not checked and not hmac.compare_digest(sess.csrf.encode(), csrf):
                return self._refuse(request, 403, "the form's CSRF token is missing or wrong; reload the page")
            filename, data = fields.get("plan", (None, b""))
            name = (filename or "the uploaded file").replace("\\", "/").rsplit("/", 1)[-1]
            plan = await run_in_threadpool(parse_plan_file, name, data)
        except UploadError as e:
            return await self.plans(request, error=str(e), status=e.status)
        finally:
            release_body(request, self.budget)
        return await self.plans(request, plan=plan, source=f"the file {name[:120]}, uploaded by {sess.identity.name}")

    def _refuse(self, request: Request, status: int, message: str) -> Response:
        """An error page after which the connection is closed (its unread body is abandoned)."""
        response = self._page("error.html", request, status=status, message=message)
        response.headers["Connection"] = "close"
        return response

    async def _drain(self, request: Request) -> None:
        """Read a too-large upload of a known caller to its end, up to ``MAX_DRAIN_BYTES``, keeping
        nothing, so that a browser shows the page that says why (it stops reading our answer else)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_DRAIN_BYTES:
            return
        size = 0
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.config.limits.body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > MAX_DRAIN_BYTES:
                        return

    async def request_plan(self, request: Request) -> Response:
        try:
            form = await self._form(request)
        except FormError as e:
            return await self.plans(request, error=str(e), status=e.status)
        sess, why, status = self._poster(request, form.get("csrf", ""))
        if sess is None:
            return self._page("error.html", request, status=status, message=why)
        runbook, node = form.get("runbook", "").strip()[:253], form.get("node", "").strip()[:253]
        kept = {"runbook": runbook, "node": node, "params": form.get("params", "")[:4000]}
        if not runbook or not node:
            return await self.plans(request, error="choose a runbook and name a node", status=400, form=kept)
        try:
            params = parse_params(form.get("params", ""))
        except UploadError as e:
            return await self.plans(request, error=str(e), status=e.status, form=kept)
        if self.planning.locked():
            return await self.plans(request, error=f"{MAX_PLANNING} plans are being made already; try again in a "
                                    "moment", status=503, form=kept)
        log.info("plan of %s for node %s requested in the console by %s", runbook, node, sess.identity.name)
        async with self.planning:
            try:
                plan = await run_in_threadpool(self.dispatcher.starter.preview, runbook, params, node)
            except (UsageError, LoadError) as e:
                return await self.plans(request, error=f"cannot plan: {e}", status=422, form=kept)
            except ConnectorError as e:
                return await self.plans(request, error=f"cannot plan: {e}", status=503, form=kept)
            except RunbookError as e:
                return await self.plans(request, error=f"planning failed: {e}", status=500, form=kept)
        return await self.plans(request, plan=plan, source=f"planned just now for {sess.identity.name}", form=kept)

    def poll_interval(self) -> float:
        """Seconds between two reads of one followed run: ``poll``, or longer when so many runs are
        followed that their reads together would pass ``console.live_reads_per_second``."""
        return max(self.poll, len(self.watches) / self.config.console.live_reads_per_second)

    def _watch(self, run_id: str) -> RunWatch:
        """The shared watcher of ``run_id`` (started for the first viewer; one journal read per tick
        whatever the number of pages following the run)."""
        watch = self.watches.get(run_id)
        if watch is None or watch.done:
            watch = RunWatch()
            self.watches[run_id] = watch
            watch.task = asyncio.create_task(self._follow(run_id, watch))
        watch.viewers += 1
        return watch

    async def _follow(self, run_id: str, watch: RunWatch) -> None:
        try:
            while watch.viewers > 0:
                run = await self._load(run_id)
                final = run is None or run.get("state") in FINAL
                mark = live_mark(run) if run is not None else ""
                if (run is not None and mark != watch.mark) or final:
                    async with watch.changed:
                        watch.run, watch.mark, watch.version = run, mark, watch.version + 1
                        watch.done = final
                        watch.changed.notify_all()
                if final:
                    return
                await asyncio.sleep(self.poll_interval())
        finally:
            async with watch.changed:
                watch.done = True
                watch.changed.notify_all()
            if self.watches.get(run_id) is watch:
                del self.watches[run_id]

    async def live(self, request: Request) -> Response:
        sess, redirect = self._viewer(request)
        if redirect is not None:
            return Response("log in first", status_code=401, media_type="text/plain")
        session_key = request.cookies.get(SESSION_COOKIE, "") if sess is not None else ""
        client = client_of(request)
        refused = self.streams.admit(session_key, client)
        if refused is not None:
            return Response(refused[1], status_code=refused[0], media_type="text/plain",
                            headers={"Retry-After": "10"})
        try:
            found = await self._load(request.path_params["run_id"])
        except BaseException:
            self.streams.release(session_key, client)
            raise
        if found is None:
            self.streams.release(session_key, client)
            return Response("no such run", status_code=404, media_type="text/plain")
        return CountedStream(self._stream(request, sess), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
                             on_close=partial(self.streams.release, session_key, client))

    def _stream(self, request: Request, sess: Session | None) -> AsyncIterator[str]:
        run_id = request.path_params["run_id"]
        template = self.env.get_template("_live.html")

        async def stream() -> AsyncIterator[str]:
            seen = request.query_params.get("since", "")[:16]
            # the digest the page was loaded with: a live update never rebinds the approve button to
            # a plan the reviewer has not seen (it says the plan changed; approving is then refused)
            loaded = request.query_params.get("digest", "")[:200]
            version = -1
            deadline = time.monotonic() + 3600
            beat = time.monotonic()
            watch = self._watch(run_id)
            try:
                while time.monotonic() < deadline:
                    if await request.is_disconnected():
                        return
                    async with watch.changed:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(watch.changed.wait_for(partial(watch.moved, version)),
                                                   timeout=1.0)
                        version, run, mark, done = watch.version, watch.run, watch.mark, watch.done
                    if run is not None and mark != seen:
                        seen = mark
                        html = template.render(viewer=sess.identity if sess else None,
                                               csrf=sess.csrf if sess else "", loaded_digest=loaded,
                                               **self._run_context(run))
                        yield "event: update\n" + "".join(f"data: {line}\n" for line in html.splitlines()) + "\n"
                        beat = time.monotonic()
                    if done:
                        if run is not None and run.get("state") in FINAL:
                            yield "event: end\ndata: \n\n"
                        return
                    if time.monotonic() - beat > 15:
                        yield ": keep-alive\n\n"
                        beat = time.monotonic()
            finally:
                watch.viewers -= 1

        return stream()


def console_routes(config: ServeConfig, dispatcher: Dispatcher, access: Access,
                   budget: BodyBudget | None = None) -> list[Route]:
    """The console's routes; ``budget``: the server's shared body budget (uploads count toward it)."""
    console = Console(config, dispatcher, access, budget)
    return [
        Route("/", console.root, methods=["GET"]),
        Route("/ui", console.root, methods=["GET"]),
        Route("/ui/", console.runs, methods=["GET"]),
        Route("/ui/login", console.login_form, methods=["GET"]),
        Route("/ui/login", console.login, methods=["POST"]),
        Route("/ui/logout", console.logout, methods=["POST"]),
        Route("/ui/static/{name}", console.static_file, methods=["GET"]),
        Route("/ui/plans", console.plans, methods=["GET"]),
        Route("/ui/plans/request", console.request_plan, methods=["POST"]),
        Route("/ui/plans/upload", console.upload_plan, methods=["POST"]),
        Route("/ui/runs/{run_id}", console.run, methods=["GET"]),
        Route("/ui/runs/{run_id}/live", console.live, methods=["GET"]),
        Route("/ui/runs/{run_id}/decision", console.decision, methods=["POST"]),
    ]
