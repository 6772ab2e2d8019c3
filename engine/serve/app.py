"""The HTTP face of ``runbook serve``: a Starlette ASGI app (run it with uvicorn).

Routes::

    POST /hooks/alertmanager   Alertmanager webhook v4 (Bearer token or basic auth, password = token)
    POST /hooks/pagerduty      PagerDuty v3 webhook (X-PagerDuty-Signature verified before parsing)
    GET  /healthz              liveness + worker/breaker status
    GET  /metrics              Prometheus text format
    GET  /runs[?limit=N]       runs, newest first          (token when protect_reads)
    GET  /runs/{id}            one run (404 if unknown)    (token when protect_reads)
    POST /runs/{id}/approve    {"plan_digest": "...", "approved_by": "..."} (token when set)
    GET  /breaker              breaker state
    POST /breaker/reset        {"node": N} | {"runbook": R} | {} = everything (token when set)
    GET  /triggers             the trigger index

Each handler authenticates, reads a bounded body, parses at the boundary (bad input is a 4xx with
a clear message, never a 500) and hands typed values to the ``Dispatcher`` in a thread, so the
event loop never blocks. This module decides nothing about runs.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse as StarletteJSON
from starlette.responses import Response
from starlette.routing import Route

from engine.errors import StalePlan, UsageError
from engine.serve.alertmanager import PayloadError, load_json, parse_webhook
from engine.serve.cluster import ClusterView
from engine.serve.config import ServeConfig
from engine.serve.dispatcher import Decision, Dispatcher, NotFound, summarize
from engine.serve.guards import Guards, ReplayGuard
from engine.serve.metrics import ServeMetrics
from engine.serve.notify import Notifier
from engine.serve.pagerduty import (
    MAX_BODY_BYTES,
    SIGNATURE_HEADER,
    WEBHOOK_ID_HEADER,
    SignatureMismatch,
    SignatureMissing,
    header_signatures,
    parse_delivery,
    verify_signature,
)
from engine.serve.starter import RunStarter
from engine.serve.triggers import TriggerIndex
from engine.serve.worker import WorkerPool

log = logging.getLogger(__name__)
_SMALL_BODY = 64 * 1024
_APPROVER = re.compile(r"^[\w.@+ -]{1,100}$")


class BodyTooLarge(Exception):
    pass


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    return str(value)


class JSONResponse(StarletteJSON):
    """JSON that also takes read-only mappings and tuples (run summaries may hold them)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, default=_plain, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, or BodyTooLarge as soon as more than ``limit`` bytes are announced or read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    size = 0
    chunks: list[bytes] = []
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def token_ok(request: Request, token: str | None) -> bool:
    """``Authorization: Bearer <token>`` or basic auth with the token as password (any user)."""
    if not token:
        return True
    scheme, _, cred = request.headers.get("authorization", "").partition(" ")
    cred = cred.strip()
    expected = token.encode("utf-8")
    if scheme.lower() == "bearer":
        return hmac.compare_digest(cred.encode("utf-8"), expected)
    if scheme.lower() == "basic":
        try:
            _, _, password = base64.b64decode(cred, validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        return hmac.compare_digest(password.encode("utf-8"), expected)
    return False


def _unauthorized() -> JSONResponse:
    return JSONResponse({"error": "missing or wrong credentials (Authorization: Bearer <token>)"},
                        status_code=401, headers={"WWW-Authenticate": 'Bearer realm="runbook"'})


def _answer(decisions: list[Decision], **extra: Any) -> tuple[JSONResponse, str]:
    status, outcome = summarize(decisions)
    body = {"status": outcome, "runs": [d.run_id for d in decisions if d.run_id],
            "decisions": [d.as_dict() for d in decisions], **extra}
    return JSONResponse(body, status_code=status), outcome


class ServeApp:
    """Route handlers bound to one dispatcher; ``create_app`` wires it into Starlette."""

    def __init__(self, config: ServeConfig, dispatcher: Dispatcher, metrics: ServeMetrics,
                 replays: ReplayGuard) -> None:
        self.config = config
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.replays = replays

    async def _timed(self, endpoint: str, handler: Callable[[], Awaitable[tuple[Response, str]]]) -> Response:
        started = time.perf_counter()
        try:
            response, outcome = await handler()
        except BodyTooLarge:
            response, outcome = _error(413, "body too large"), "too-large"
        except Exception:
            log.exception("%s failed", endpoint)
            response, outcome = _error(500, "internal error; see the server log"), "error"
        self.metrics.webhook_requests.labels(endpoint=endpoint, outcome=outcome).inc()
        self.metrics.webhook_seconds.labels(endpoint=endpoint).observe(time.perf_counter() - started)
        return response

    # -- webhooks -------------------------------------------------------------------------------

    async def alertmanager(self, request: Request) -> Response:
        async def handle() -> tuple[Response, str]:
            if not token_ok(request, self.config.webhook_token):
                return _unauthorized(), "unauthorized"
            body = await read_body(request, self.config.max_body_bytes)
            try:
                payload = parse_webhook(body)
            except PayloadError as e:
                return _error(400, str(e)), "bad-request"
            decisions = self.dispatcher.quick_alerts(payload)
            if decisions is None:
                decisions = await run_in_threadpool(self.dispatcher.handle_alerts, payload)
            extra = {"truncated_alerts": payload.truncated_alerts} if payload.truncated_alerts else {}
            return _answer(decisions, **extra)

        return await self._timed("alertmanager", handle)

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
            body = await read_body(request, MAX_BODY_BYTES)
            started = time.perf_counter()
            try:
                verify_signature(body, header, secrets)
            except SignatureMissing as e:
                return _error(400, str(e)), "bad-request"
            except SignatureMismatch as e:
                return _error(403, str(e)), "forbidden"
            finally:
                self.metrics.verify_seconds.observe(time.perf_counter() - started)
            webhook_id = request.headers.get(WEBHOOK_ID_HEADER, "").strip()[:200]
            if webhook_id and not self.replays.claim(webhook_id):
                return JSONResponse({"status": "duplicate", "reason": f"webhook {webhook_id} already received",
                                     "runs": []}), "duplicate"
            try:
                return await self._incident(body)
            except Exception:
                if webhook_id:
                    self.replays.release(webhook_id)  # we answer 5xx: PagerDuty retries, let it in
                raise

        return await self._timed("pagerduty", handle)

    async def _incident(self, body: bytes) -> tuple[Response, str]:
        try:
            delivery = parse_delivery(body)
        except PayloadError as e:
            return _error(400, str(e)), "bad-request"
        event = delivery.event
        if event.event_type not in self.config.pagerduty.event_types or event.resource_type not in ("", "incident"):
            return JSONResponse({"status": "ignored", "runs": [],
                                 "reason": f"event type {event.event_type} starts nothing"}), "ignored"
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

    async def metrics_endpoint(self, request: Request) -> Response:
        self.dispatcher.refresh_gauges()
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    def _read_refused(self, request: Request) -> Response | None:
        if self.config.protect_reads and not token_ok(request, self.config.webhook_token):
            return _unauthorized()
        return None

    async def runs(self, request: Request) -> Response:
        if (refused := self._read_refused(request)) is not None:
            return refused
        raw = request.query_params.get("limit", "100")
        if not raw.isdigit() or not 1 <= int(raw) <= 1000:
            return _error(400, "limit must be an integer from 1 to 1000")
        return JSONResponse(await run_in_threadpool(self.dispatcher.runs, int(raw)))

    async def run(self, request: Request) -> Response:
        if (refused := self._read_refused(request)) is not None:
            return refused
        try:
            return JSONResponse(await run_in_threadpool(self.dispatcher.run, request.path_params["run_id"]))
        except NotFound as e:
            return _error(404, str(e))

    async def _json_object(self, request: Request, *, allow_empty: bool) -> dict[str, Any]:
        body = await read_body(request, _SMALL_BODY)
        if not body.strip() and allow_empty:
            return {}
        data = load_json(body)
        if not isinstance(data, dict):
            raise PayloadError("expected a JSON object")
        return data

    async def approve(self, request: Request) -> Response:
        if not token_ok(request, self.config.webhook_token):
            return _unauthorized()
        try:
            data = await self._json_object(request, allow_empty=False)
        except BodyTooLarge:
            return _error(413, "body too large")
        except PayloadError as e:
            return _error(400, str(e))
        digest, by = data.get("plan_digest"), data.get("approved_by", "api")
        if not isinstance(digest, str) or not 0 < len(digest) <= 200:
            return _error(400, 'expected {"plan_digest": "<the digest of the plan you reviewed>"}')
        if not isinstance(by, str) or not _APPROVER.match(by):
            return _error(400, "approved_by must be a short name (letters, digits, . _ @ + - and spaces)")
        run_id = request.path_params["run_id"]
        try:
            result = await run_in_threadpool(self.dispatcher.approve, run_id, digest, by)
        except NotFound as e:
            return _error(404, str(e))
        except StalePlan as e:
            return _error(409, str(e))
        except UsageError as e:
            return _error(422, str(e))
        return JSONResponse(result, status_code=202 if result.get("queued") else 200)

    async def breaker(self, request: Request) -> Response:
        if (refused := self._read_refused(request)) is not None:
            return refused
        return JSONResponse(self.dispatcher.guards.state())

    async def breaker_reset(self, request: Request) -> Response:
        if not token_ok(request, self.config.webhook_token):
            return _unauthorized()
        try:
            data = await self._json_object(request, allow_empty=True)
        except BodyTooLarge:
            return _error(413, "body too large")
        except PayloadError as e:
            return _error(400, str(e))
        node, runbook = data.get("node"), data.get("runbook")
        if not all(v is None or isinstance(v, str) for v in (node, runbook)):
            return _error(400, "node and runbook must be strings")
        done = self.dispatcher.reset_breaker(node=node, runbook=runbook)
        log.warning("breaker reset (%s): %s", json.dumps(data), ", ".join(done) or "nothing was open")
        return JSONResponse({"reset": done})

    async def triggers(self, request: Request) -> Response:
        if (refused := self._read_refused(request)) is not None:
            return refused
        return JSONResponse(self.dispatcher.index.describe())


def create_app(config: ServeConfig, starter: RunStarter, *, cluster: ClusterView,
               notifier: Notifier | None = None, metrics: ServeMetrics | None = None,
               clock: Callable[[], float] = time.time, sweep_interval: float = 30.0) -> Starlette:
    """The ASGI app. Startup (lifespan) recovers runs from the journal; shutdown drains workers.

    ``app.state.dispatcher`` gives tests and the CLI the dispatcher (worker pool, guards, notifier).
    """
    metrics = metrics or ServeMetrics()
    notifier = notifier or Notifier(config.notify.url, events=config.notify.events, timeout=config.notify.timeout)
    index = TriggerIndex(starter.trigger_index(), config.pagerduty.mappings)
    dispatcher = Dispatcher(config, starter, cluster, index=index, guards=Guards(config, clock=clock),
                            worker=WorkerPool(config.workers, config.queue_size), notifier=notifier,
                            metrics=metrics, clock=clock)
    handlers = ServeApp(config, dispatcher, metrics, ReplayGuard(config.dedup.webhook_id_window, clock=clock))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await run_in_threadpool(dispatcher.start, sweep_interval=sweep_interval)
        try:
            yield
        finally:
            await run_in_threadpool(dispatcher.stop)

    routes = [
        Route("/hooks/alertmanager", handlers.alertmanager, methods=["POST"]),
        Route("/hooks/pagerduty", handlers.pagerduty, methods=["POST"]),
        Route("/healthz", handlers.healthz, methods=["GET"]),
        Route("/metrics", handlers.metrics_endpoint, methods=["GET"]),
        Route("/runs", handlers.runs, methods=["GET"]),
        Route("/runs/{run_id}", handlers.run, methods=["GET"]),
        Route("/runs/{run_id}/approve", handlers.approve, methods=["POST"]),
        Route("/breaker", handlers.breaker, methods=["GET"]),
        Route("/breaker/reset", handlers.breaker_reset, methods=["POST"]),
        Route("/triggers", handlers.triggers, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.dispatcher = dispatcher
    app.state.metrics = metrics
    return app
