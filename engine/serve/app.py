"""The HTTP face of ``runbook serve``: a Starlette ASGI app (run it with uvicorn).

Routes (roles from ``engine.serve.access``)::

    POST /hooks/alertmanager   Alertmanager webhook v4                      sender
    POST /hooks/pagerduty      PagerDuty v3 webhook (signature, then fresh signed time, then replay)
    POST /hooks/slack          Slack interactions: approve/reject clicks (signature, time, replay)  Slack
    GET  /healthz              liveness + counts (no node, run or breaker)  open
    GET  /readyz               the store answers; leader or follower (503: not ready)  open
    GET  /metrics              Prometheus text format                       reads
    GET  /runs[?limit=N]       runs, newest first                           reads
    GET  /runs/{id}            one run (404 if unknown)                     reads
    POST /runs/{id}/approve    {"plan_digest": "..."}                       approver (recorded by name)
    GET  /breaker              breaker state                                reads
    POST /breaker/reset        {"node": N} | {"runbook": R} | {} = everything   approver
    GET  /triggers             the trigger index                            reads
    GET  /, /ui/...            the web console (engine.serve.console)       session (login form)

("reads": open, or a reader/approver credential, per ``auth.reads``.) Every request but
``/healthz`` and ``/readyz`` must carry an allowed ``Host`` (and ``Origin``, when a browser sends one); every POST
must be ``application/json``. Each handler authenticates, reads a bounded body under a deadline and
a server-wide byte budget, parses at the boundary off the event loop (bad input is a 4xx with a
clear message, never a 500) and hands typed values to the ``Dispatcher`` in a thread, so the event
loop never blocks. This module decides nothing about runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse as StarletteJSON
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.errors import StalePlan, UsageError
from engine.serve.access import Access, Identity, ReviewsBusy, TooManyFailures, client_of
from engine.serve.alertmanager import PayloadError, WebhookPayload, load_json, parse_alertmanager
from engine.serve.cluster import ClusterView
from engine.serve.config import ServeConfig
from engine.serve.console import console_routes
from engine.serve.dispatcher import Decision, Dispatcher, NotFound, SelfApproval, summarize
from engine.serve.guards import Guards, ReplayGuard
from engine.serve.http import (
    BodyBudget,
    BodyTimeout,
    BodyTooLarge,
    ServerBusy,
    read_body,
    release_body,
)
from engine.serve.kube_identity import IdentityUnavailable, KubeIdentity
from engine.serve.leader import LeaderElector
from engine.serve.metrics import ServeMetrics
from engine.serve.notify import Notifier
from engine.serve.pagerduty import (
    MAX_BODY_BYTES,
    SIGNATURE_HEADER,
    WEBHOOK_ID_HEADER,
    Delivery,
    SignatureMismatch,
    SignatureMissing,
    StaleDelivery,
    check_fresh,
    content_key,
    header_signatures,
    parse_delivery,
    verify_signature,
)
from engine.serve.remediator import cluster_loops
from engine.serve.routing import warn_about_routing
from engine.serve.slack import SlackInteractions
from engine.serve.starter import RunStarter
from engine.serve.triggers import TriggerIndex
from engine.serve.worker import WorkerPool

log = logging.getLogger(__name__)
_SMALL_BODY = 64 * 1024
# Bodies up to this size are parsed on the event loop (well under a millisecond: cheaper than the
# hop to a thread); larger ones in a worker thread, validated in pieces (see parse_alertmanager).
_INLINE_PARSE_BYTES = 32 * 1024
_PARSED_KEPT = 64  # deliveries kept parsed (each <= _INLINE_PARSE_BYTES: at most 2 MB)
_PROBES = frozenset({"/healthz", "/readyz"})
_JSON_POSTS = frozenset({"/hooks/alertmanager", "/hooks/pagerduty", "/breaker/reset"})
SWITCH_INTERVAL = 0.001  # seconds: the interpreter's thread switch interval while the server runs


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    return str(value)


class JSONResponse(StarletteJSON):
    """JSON that also takes read-only mappings and tuples (run summaries may hold them).

    Always renders: text that is not valid Unicode (a lone surrogate that reached a record by some
    other path) is written as a ``\\udXXX`` escape instead of failing the answer."""

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, default=_plain, ensure_ascii=False, separators=(",", ":"))
        return text.encode("utf-8", "backslashreplace")


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


def _closing(status: int, message: str) -> JSONResponse:
    """An error after which the connection is closed (its unread body is abandoned)."""
    return JSONResponse({"error": message}, status_code=status, headers={"Connection": "close"})


def _unauthorized() -> JSONResponse:
    # Why close: an unauthenticated client must not keep a connection by trickling its body
    return JSONResponse({"error": "missing or wrong credentials (Authorization: Bearer <token>)"},
                        status_code=401, headers={"WWW-Authenticate": 'Bearer realm="runbook"',
                                                  "Connection": "close"})


def _throttled(e: TooManyFailures | ReviewsBusy) -> JSONResponse:
    if isinstance(e, TooManyFailures):
        return JSONResponse({"error": str(e)}, status_code=429,
                            headers={"Retry-After": str(max(1, round(e.retry_after))), "Connection": "close"})
    return JSONResponse({"error": str(e)}, status_code=503, headers={"Retry-After": "1", "Connection": "close"})


def _forbidden_role(who: Identity, needs: str) -> JSONResponse:
    return JSONResponse({"error": f"credential of {who.name} ({who.role}) may not {needs}"}, status_code=403,
                        headers={"Connection": "close"})


def _answer(decisions: list[Decision], **extra: Any) -> tuple[JSONResponse, str]:
    status, outcome = summarize(decisions)
    counts: dict[str, int] = {}
    for d in decisions:
        counts[d.verdict] = counts.get(d.verdict, 0) + 1
    body = {"status": outcome, "runs": [d.run_id for d in decisions if d.run_id],
            "decisions": [d.as_dict() for d in decisions], "counts": counts, **extra}
    return JSONResponse(body, status_code=status), outcome


class NoSniff:
    """ASGI middleware: ``X-Content-Type-Options: nosniff`` on every answer (a browser never guesses
    a JSON error or an uploaded name into HTML or script)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_nosniff(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-content-type-options"]
                message = {**message, "headers": [*headers, (b"x-content-type-options", b"nosniff")]}
            await send(message)

        await self.app(scope, receive, send_nosniff)


class HostGuard:
    """ASGI middleware: refuse requests whose ``Host`` (or browser ``Origin``) is not ours (DNS
    rebinding, cross-site posts), and POSTs that are not ``application/json`` (HTML forms can send
    only form types without a CORS preflight). ``/healthz`` and ``/readyz`` are exempt (probes use any
    address)."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in _PROBES:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())
                   if k in (b"host", b"origin", b"content-type")}
        problem: tuple[int, str] | None = None
        if not self.access.host_allowed(headers.get("host")):
            problem = (421, "this server does not answer to that Host name (see auth.allowed_hosts)")
        elif not self.access.origin_allowed(headers.get("origin")):
            problem = (403, "cross-origin requests are refused")
        elif scope.get("method") == "POST" and (scope.get("path") in _JSON_POSTS
                                                or str(scope.get("path", "")).endswith("/approve")):
            media = headers.get("content-type", "").partition(";")[0].strip().lower()
            if media != "application/json":
                problem = (415, "the body must be JSON (Content-Type: application/json)")
        if problem is not None:
            await _closing(*problem)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class ServeApp:
    """Route handlers bound to one dispatcher; ``create_app`` wires it into Starlette."""

    def __init__(self, config: ServeConfig, dispatcher: Dispatcher, metrics: ServeMetrics,
                 replays: ReplayGuard, *, access: Access | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.replays = replays
        self.access = access or Access(config)
        self.budget = BodyBudget(config.limits.max_body_reads, config.limits.buffered_bytes)
        self._parsed: dict[bytes, tuple[WebhookPayload, int]] = {}  # ``_parse_alerts``: body digest -> parse
        self._counted: dict[tuple[str, str], tuple[Any, Any]] = {}  # (endpoint, outcome) -> its metric children
        self._clock = clock
        slack = config.notify.slack
        self.slack_clicks = None if slack is None else SlackInteractions(
            slack, dispatcher, replays=replays, notify=dispatcher.notifier.notify, clock=clock,
            body_timeout=config.limits.body_timeout)

    async def _body(self, request: Request, limit: int) -> bytes:
        return await read_body(request, limit, budget=self.budget, timeout=self.config.limits.body_timeout)

    async def _timed(self, endpoint: str, handler: Callable[[], Awaitable[tuple[Response, str]]],
                     request: Request | None = None) -> Response:
        started = time.perf_counter()
        try:
            response, outcome = await handler()
        except BodyTooLarge:
            response, outcome = _closing(413, "body too large"), "too-large"
        except BodyTimeout:
            response, outcome = _closing(408, "the body did not arrive in time"), "timeout"
        except ServerBusy:
            response, outcome = _closing(503, "too many requests in flight; retry later"), "busy"
        except ClientDisconnect:
            response, outcome = _closing(400, "the client went away"), "disconnected"
        except IdentityUnavailable as e:
            log.error("%s: %s", endpoint, e)
            response, outcome = _closing(503, str(e)), "unavailable"
        except (TooManyFailures, ReviewsBusy) as e:
            response, outcome = _throttled(e), "throttled"
        except Exception:
            log.exception("%s failed", endpoint)
            response, outcome = _error(500, "internal error; see the server log"), "error"
        finally:
            if request is not None:
                release_body(request, self.budget)
        counted = self._counted.get((endpoint, outcome))
        if counted is None:  # Why kept: labels() is a locked lookup, twice per request under a storm
            counted = self._counted[(endpoint, outcome)] = (
                self.metrics.webhook_requests.labels(endpoint=endpoint, outcome=outcome),
                self.metrics.webhook_seconds.labels(endpoint=endpoint))
        counted[0].inc()
        counted[1].observe(time.perf_counter() - started)
        return response

    async def _caller(self, request: Request) -> Identity | None:
        """The caller's identity (``IdentityUnavailable`` when Kubernetes cannot say: 503;
        ``TooManyFailures`` / ``ReviewsBusy``: 429 / 503)."""
        return await self.access.resolve(request.headers.get("authorization"), client_of(request))

    # -- webhooks -------------------------------------------------------------------------------

    def _parse_alerts(self, body: bytes) -> tuple[WebhookPayload, int]:
        """The delivery, parsed and bounded; a body seen lately (a re-send, byte for byte the same)
        is not parsed again. Why: Alertmanager re-sends a firing group's delivery every
        ``repeat_interval`` and after every failure, and in a storm most pages are such re-sends; the
        parse (JSON, bounds, validation) was a fifth of a duplicate's answer (P5). The result is
        frozen, so sharing it is safe; a body that fails to parse is never kept."""
        small = len(body) <= _INLINE_PARSE_BYTES
        key = hashlib.blake2b(body, digest_size=16).digest() if small else b""
        if small and (seen := self._parsed.get(key)) is not None:
            return seen
        lim = self.config.limits
        parsed = parse_alertmanager(body, max_alerts=lim.max_alerts, max_labels=lim.max_labels,
                                    max_value_bytes=lim.max_value_bytes)
        if small:
            if len(self._parsed) >= _PARSED_KEPT:
                self._parsed.pop(next(iter(self._parsed)), None)  # the oldest
            self._parsed[key] = parsed
        return parsed

    async def alertmanager(self, request: Request) -> Response:
        async def handle() -> tuple[Response, str]:
            # Why configured credentials only: a sender is never a Kubernetes identity, so a bearer
            # token on this endpoint is never sent to the API server (a flood here asks it nothing)
            who = self.access.identify_configured(request.headers.get("authorization"))
            if who is None:
                return _unauthorized(), "unauthorized"
            if not who.may("sender"):
                return _forbidden_role(who, "send alerts"), "forbidden"
            body = await self._body(request, self.config.max_body_bytes)
            try:
                # Why a thread: parsing a large delivery must not stall the event loop (/healthz)
                if len(body) <= _INLINE_PARSE_BYTES:
                    payload, dropped = self._parse_alerts(body)
                else:
                    payload, dropped = await run_in_threadpool(self._parse_alerts, body)
            except PayloadError as e:
                return _error(400, str(e)), "bad-request"
            decisions = self.dispatcher.quick_alerts(payload) if len(payload.alerts) <= 20 else None
            if decisions is None:
                decisions = await run_in_threadpool(self.dispatcher.handle_alerts, payload, who.name)
            if dropped:
                decisions = [*decisions, self.dispatcher.refused_excess(dropped)]
            extra: dict[str, Any] = {"truncated_alerts": payload.truncated_alerts} if payload.truncated_alerts else {}
            if dropped:
                extra["refused_alerts"] = dropped
            return _answer(decisions, **extra)

        return await self._timed("alertmanager", handle, request)

    async def pagerduty(self, request: Request) -> Response:
        async def handle() -> tuple[Response, str]:
            secrets = self.config.pagerduty.secrets
            if not secrets:
                return _error(503, "no PagerDuty secret configured (RUNBOOK_PAGERDUTY_SECRET)"), "unavailable"
            header = request.headers.get(SIGNATURE_HEADER)
            try:
                header_signatures(header)  # 400 before reading a body we could never trust
            except SignatureMissing as e:
                return _error(400, str(e)), "bad-request"
            body = await self._body(request, MAX_BODY_BYTES)
            started = time.perf_counter()
            try:
                if len(body) <= _INLINE_PARSE_BYTES:
                    verify_signature(body, header, secrets)
                else:
                    await run_in_threadpool(verify_signature, body, header, secrets)
            except SignatureMissing as e:
                return _error(400, str(e)), "bad-request"
            except SignatureMismatch as e:
                return _error(403, str(e)), "forbidden"
            finally:
                self.metrics.verify_seconds.observe(time.perf_counter() - started)
            try:
                delivery = parse_delivery(body) if len(body) <= _INLINE_PARSE_BYTES else \
                    await run_in_threadpool(parse_delivery, body)
            except PayloadError as e:
                return _error(400, str(e)), "bad-request"
            pd = self.config.pagerduty
            try:
                check_fresh(delivery.event, self._clock(), max_age=pd.max_age, skew=pd.clock_skew)
            except PayloadError as e:
                return _error(400, str(e)), "bad-request"
            except StaleDelivery as e:
                return _error(403, str(e)), "stale"
            # Why the content: X-Webhook-Id is not signed, so a replayer can change it at will.
            claims = [content_key(body)]
            webhook_id = request.headers.get(WEBHOOK_ID_HEADER, "").strip()[:200]
            if webhook_id:
                claims.append("id-" + webhook_id)
            for i, key in enumerate(claims):
                if not self.replays.claim(key):
                    for done in claims[:i]:
                        self.replays.release(done)
                    return JSONResponse({"status": "duplicate", "runs": [],
                                         "reason": "this delivery was already received"}), "duplicate"
            try:
                return await self._incident(delivery)
            except Exception:
                for key in claims:
                    self.replays.release(key)  # we answer 5xx: PagerDuty retries, let it in
                raise

        return await self._timed("pagerduty", handle, request)

    async def slack(self, request: Request) -> Response:
        async def handle() -> tuple[Response, str]:
            if self.slack_clicks is None:
                return _error(503, "no Slack app configured (notify.slack)"), "unavailable"
            return await self.slack_clicks.handle(request)

        return await self._timed("slack", handle)

    async def _incident(self, delivery: Delivery) -> tuple[Response, str]:
        event = delivery.event
        if event.event_type not in self.config.pagerduty.event_types or event.resource_type not in ("", "incident"):
            return JSONResponse({"status": "ignored", "runs": [],
                                 "reason": f"event type {event.event_type[:100]} starts nothing"}), "ignored"
        try:
            incident = event.incident()
        except PayloadError as e:
            return _error(400, str(e)), "bad-request"
        decisions = self.dispatcher.quick_incident(incident)
        if decisions is None:
            decisions = await run_in_threadpool(self.dispatcher.handle_incident, incident)
        return _answer(decisions)

    # -- runs -----------------------------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", **self.dispatcher.status()})

    async def readyz(self, request: Request) -> Response:
        """Ready: the store answered a read just now. Leader and follower are both ready (both serve)."""
        state = await run_in_threadpool(self.dispatcher.readiness)
        return JSONResponse({"status": "ready" if state["ready"] else "not-ready", **state},
                            status_code=200 if state["ready"] else 503)

    async def _read_refused(self, request: Request) -> Response | None:
        if self.access.open_reads:
            return None
        try:
            who = await self._caller(request)
        except IdentityUnavailable as e:
            log.error("%s: %s", request.url.path, e)
            return _closing(503, str(e))
        except (TooManyFailures, ReviewsBusy) as e:
            return _throttled(e)
        if who is None:
            return _unauthorized()
        if not who.may("reader", "approver"):
            return _forbidden_role(who, "read")
        return None

    async def metrics_endpoint(self, request: Request) -> Response:
        if (refused := await self._read_refused(request)) is not None:
            return refused
        self.dispatcher.refresh_gauges()
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def runs(self, request: Request) -> Response:
        if (refused := await self._read_refused(request)) is not None:
            return refused
        raw = request.query_params.get("limit", "100")
        if not raw.isdigit() or not 1 <= int(raw) <= 1000:
            return _error(400, "limit must be an integer from 1 to 1000")
        return JSONResponse(await run_in_threadpool(self.dispatcher.runs, int(raw)))

    async def run(self, request: Request) -> Response:
        if (refused := await self._read_refused(request)) is not None:
            return refused
        try:
            return JSONResponse(await run_in_threadpool(self.dispatcher.run, request.path_params["run_id"]))
        except NotFound as e:
            return _error(404, str(e))

    async def _json_object(self, request: Request, *, allow_empty: bool) -> dict[str, Any]:
        body = await self._body(request, _SMALL_BODY)
        if not body.strip() and allow_empty:
            return {}
        data = load_json(body)
        if not isinstance(data, dict):
            raise PayloadError("expected a JSON object")
        return data

    async def approve(self, request: Request) -> Response:
        async def handle() -> tuple[Response, str]:
            who = await self._caller(request)
            if who is None:
                return _unauthorized(), "unauthorized"
            if not who.may("approver"):
                return _forbidden_role(who, "approve runs"), "forbidden"
            try:
                data = await self._json_object(request, allow_empty=False)
            except PayloadError as e:
                return _error(400, str(e)), "bad-request"
            digest, by = data.get("plan_digest"), data.get("approved_by")
            if not isinstance(digest, str) or not 0 < len(digest) <= 200:
                return _error(400, 'expected {"plan_digest": "<the digest of the plan you reviewed>"}'), "bad-request"
            if by is not None and by != who.name:
                # Why refuse rather than ignore: the caller believes another name will be recorded.
                return _error(400, f"approved_by is the identity of your credential ({who.name}), "
                                   "not a field you choose; leave it out"), "bad-request"
            run_id = request.path_params["run_id"]
            try:
                result = await run_in_threadpool(self.dispatcher.approve, run_id, digest, who)
            except NotFound as e:
                return _error(404, str(e)), "not-found"
            except SelfApproval as e:
                return _error(403, str(e)), "forbidden"
            except StalePlan as e:
                return _error(409, str(e)), "conflict"
            except UsageError as e:
                return _error(422, str(e)), "invalid"
            return JSONResponse(result, status_code=202 if result.get("queued") else 200), "approved"

        return await self._timed("approve", handle, request)

    async def breaker(self, request: Request) -> Response:
        if (refused := await self._read_refused(request)) is not None:
            return refused
        return JSONResponse(self.dispatcher.guards.state())

    async def breaker_reset(self, request: Request) -> Response:
        async def handle() -> tuple[Response, str]:
            who = await self._caller(request)
            if who is None:
                return _unauthorized(), "unauthorized"
            if not who.may("approver"):
                return _forbidden_role(who, "reset breakers"), "forbidden"
            try:
                data = await self._json_object(request, allow_empty=True)
            except PayloadError as e:
                return _error(400, str(e)), "bad-request"
            node, runbook = data.get("node"), data.get("runbook")
            if not all(v is None or (isinstance(v, str) and len(v) <= 253) for v in (node, runbook)):
                return _error(400, "node and runbook must be short strings"), "bad-request"
            done = self.dispatcher.reset_breaker(node=node, runbook=runbook, by=who.name)
            log.warning("breaker reset by %s (%s): %s", who.name, json.dumps(data)[:300],
                        ", ".join(done) or "nothing was open")
            return JSONResponse({"reset": done, "by": who.name}), "reset"

        return await self._timed("breaker-reset", handle, request)

    async def triggers(self, request: Request) -> Response:
        if (refused := await self._read_refused(request)) is not None:
            return refused
        return JSONResponse(self.dispatcher.index.describe())


def create_app(config: ServeConfig, starter: RunStarter, *, cluster: ClusterView,
               notifier: Notifier | None = None, metrics: ServeMetrics | None = None,
               clock: Callable[[], float] = time.time, sweep_interval: float = 30.0,
               identity: KubeIdentity | None = None, elector: LeaderElector | None = None,
               kube: Callable[[], Any] | None = None) -> Starlette:
    """The ASGI app. Startup (lifespan) recovers runs from the journal; shutdown drains workers.

    ``identity``: the Kubernetes identity backend (required with ``auth.mode: kubernetes``).
    ``elector``: several replicas share a store; it decides which one does the singleton duties
    (started before the dispatcher, so a sole replica leads from its first second; given up last).
    ``kube``: the Kubernetes connection for the leader's loops over cluster objects (the
    RunbookRemediation reconciler, Node-condition triggers: ``engine.serve.remediator.cluster_loops``).

    ``app.state.dispatcher`` gives tests and the CLI the dispatcher (worker pool, guards, notifier).
    """
    metrics = metrics or ServeMetrics()
    notifier = notifier or Notifier.from_config(config.notify, public_url=config.public_url)
    if notifier.observer is None:
        notifier.observer = metrics.notification_result  # per target successes and failures
    index = TriggerIndex(starter.trigger_index(), config.pagerduty.mappings)
    dispatcher = Dispatcher(config, starter, cluster, index=index, guards=Guards(config, clock=clock),
                            worker=WorkerPool(config.workers, config.queue_size), notifier=notifier,
                            metrics=metrics, clock=clock, leadership=elector)
    if elector is not None:
        elector.on_change = dispatcher.on_leadership
    loops = cluster_loops(config, dispatcher, kube)
    pd = config.pagerduty
    # Why this window: an older delivery is refused by its signed time anyway, so remembering
    # content keys longer buys nothing; X-Webhook-Id values share the same bounded memory.
    replays = ReplayGuard(max(config.dedup.webhook_id_window, pd.max_age + 2 * pd.clock_skew), clock=clock,
                          max_ids=config.limits.max_dedup_entries)
    handlers = ServeApp(config, dispatcher, metrics, replays, clock=clock, access=Access(config, kube=identity))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        previous = sys.getswitchinterval()
        # Why: runs plan and execute in worker threads of this process. With CPython's default 5 ms
        # switch interval a webhook's answer waits up to 5 ms at each hand-over of the GIL from a busy
        # worker; 1 ms halves the answers' latency under such load (docs/performance.md, P8).
        sys.setswitchinterval(min(previous, SWITCH_INTERVAL))
        if elector is not None:
            await run_in_threadpool(elector.try_once)
            elector.start()
        await run_in_threadpool(dispatcher.start, sweep_interval=sweep_interval)
        for loop in loops:
            loop.start()
        if config.alertmanager.url:
            # Why a task: Alertmanager being slow or away must not delay the server's start
            asyncio.get_running_loop().run_in_executor(None, warn_about_routing, config, index)
        try:
            yield
        finally:
            for loop in loops:
                await run_in_threadpool(loop.stop)
            await run_in_threadpool(dispatcher.stop)
            handlers.access.close()
            sys.setswitchinterval(previous)
            if elector is not None:
                await run_in_threadpool(elector.stop)

    routes = [
        Route("/hooks/alertmanager", handlers.alertmanager, methods=["POST"]),
        Route("/hooks/pagerduty", handlers.pagerduty, methods=["POST"]),
        Route("/hooks/slack", handlers.slack, methods=["POST"]),
        Route("/healthz", handlers.healthz, methods=["GET"]),
        Route("/readyz", handlers.readyz, methods=["GET"]),
        Route("/metrics", handlers.metrics_endpoint, methods=["GET"]),
        Route("/runs", handlers.runs, methods=["GET"]),
        Route("/runs/{run_id}", handlers.run, methods=["GET"]),
        Route("/runs/{run_id}/approve", handlers.approve, methods=["POST"]),
        Route("/breaker", handlers.breaker, methods=["GET"]),
        Route("/breaker/reset", handlers.breaker_reset, methods=["POST"]),
        Route("/triggers", handlers.triggers, methods=["GET"]),
        *console_routes(config, dispatcher, handlers.access, handlers.budget),  # the web console: /, /ui/...
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.dispatcher = dispatcher
    app.state.loops = loops
    app.state.metrics = metrics
    app.state.handlers = handlers
    app.add_middleware(HostGuard, access=handlers.access)
    app.add_middleware(NoSniff)  # outermost: also on HostGuard's refusals
    return app
