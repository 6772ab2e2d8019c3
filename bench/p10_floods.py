"""P10 floods (issue 25, items 6 and 9): the answers that must not wait while the server is attacked.

* ``p10_webhook_flood_delta_ms``: a real Alertmanager webhook's p95 latency during a flood of 120
  requests with random bearer tokens (to ``/breaker/reset``, ``/runs/{id}/approve``, ``/runs`` and
  ``/hooks/alertmanager``), minus its p95 at rest. Target: within 100 ms of its usual time.
* ``p10_healthz_upload_ms``: the slowest ``/healthz`` answer while an unauthenticated 1 MiB
  multipart body of 20,000 parts is posted to ``/ui/plans/upload`` (repeated). Target: 100 ms.

The server is ``runbook serve``'s own app under uvicorn as ``engine.serve.cli.serve`` runs it
(``python -m bench.p10_floods --serve HOST:PORT``), over ``FakeRunStarter`` with ``auth.mode:
kubernetes`` and a reviewer that answers each TokenReview after 20 ms, as a busy API server would
(no lab: what is measured is the server's own handling). Both load and server share the machine's
cores: run it on an idle machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.common import ENGINE_ROOT, Context, Metric, base_env, log, started_server, summary

TOKEN = "bench-p10-sender-token-0123456789"
REVIEW_SECONDS = 0.02
FLOOD = 120
BOUNDARY = "p10flood0123456789"


class SlowReviews:
    """TokenReviews that take ``REVIEW_SECONDS`` and know no token (every flooding token is made up)."""

    def review_token(self, token: str, audiences: Sequence[str] = ()) -> Any:
        from engine.connectors.base import TokenReviewResult

        time.sleep(REVIEW_SECONDS)
        return TokenReviewResult(authenticated=False, audiences=tuple(audiences))

    def review_access(self, *, user: str, groups: Sequence[str], uid: str, extra: Mapping[str, Sequence[str]],
                      verb: str, resource: str, group: str, namespace: str) -> Any:
        from engine.connectors.base import AccessReviewResult

        return AccessReviewResult(allowed=False)


def serve(listen: str) -> None:
    import logging

    import uvicorn

    from engine.serve.app import create_app
    from engine.serve.cli import uvicorn_options
    from engine.serve.config import load_config, split_listen
    from engine.serve.kube_identity import KubeIdentity
    from tests.fakes import INCIDENT_NODES, FakeRunStarter, StaticClusterView, trigger_spec

    config = load_config(None, overrides={"listen": listen, "auth": {"mode": "kubernetes", "reads": "token"}})
    starter = FakeRunStarter([trigger_spec("gpu-node-recovery", mode="approve", matchers=('node=~"omen.*"',))])
    identity = KubeIdentity(SlowReviews, "runbook-system", cache_seconds=2)
    app = create_app(config, starter, cluster=StaticClusterView(INCIDENT_NODES), identity=identity)
    host, port = split_listen(config.listen)
    logging.basicConfig(level=logging.WARNING)
    uvicorn.run(app, host=host, port=port, log_level="warning", lifespan="on", **uvicorn_options(config))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _server(ctx: Context) -> Iterator[str]:

    listen = f"127.0.0.1:{_free_port()}"
    env = base_env({"RUNBOOK_WEBHOOK_TOKEN": TOKEN, "PYTHONPATH": str(ENGINE_ROOT)})
    base = f"http://{listen}"
    with started_server([sys.executable, "-m", "bench.p10_floods", "--serve", listen], env=env,
                        log=ctx.log_path("p10-serve.log"), ready_url=base + "/healthz", timeout=30,
                        new_session=False):
        yield base


def _webhook_latencies(base: str, count: int, stop: threading.Event | None = None) -> list[float]:

    import httpx

    from tests.fakes import alert, webhook

    body = json.dumps(webhook(alert("omen2", fingerprint="bench-p10"))).encode()
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    out: list[float] = []
    with httpx.Client(timeout=30) as client:
        for _ in range(count):
            if stop is not None and stop.is_set():
                break
            t = time.perf_counter()
            r = client.post(base + "/hooks/alertmanager", content=body, headers=headers)
            out.append((time.perf_counter() - t) * 1000)
            if r.status_code not in (200, 202):
                raise RuntimeError(f"webhook answered {r.status_code}: {r.text[:200]}")
    return out


def _flood(base: str, n: int) -> dict[int, int]:
    """``n`` requests with made-up bearer tokens over 32 concurrent raw connections; status counts.

    Why raw sockets: an HTTP client library per request (``httpx.request``) costs ~50 ms of the
    load generator's CPU (its TLS context), which would be measured as the server's latency."""
    host, port = base.removeprefix("http://").split(":")
    paths = [("POST", "/breaker/reset"), ("POST", "/runs/r-bench/approve"), ("GET", "/runs"),
             ("POST", "/hooks/alertmanager")]

    def one(i: int) -> int:
        method, path = paths[i % len(paths)]
        head = (f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer "
                f"{secrets.token_urlsafe(32)}\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                "Connection: close\r\n\r\n{}").encode()
        with contextlib.suppress(OSError, ValueError, IndexError):
            with socket.create_connection((host, int(port)), timeout=30) as s:
                s.sendall(head)
                answer = s.recv(64)
            return int(answer.split(b" ", 2)[1])
        return 0

    codes: dict[int, int] = {}
    with ThreadPoolExecutor(32) as pool:
        for code in pool.map(one, range(n)):
            codes[code] = codes.get(code, 0) + 1
    return codes


def _flood_process(base: str, n: int) -> None:
    """``--flood BASE N``: say ``ready``, flood, print the status counts as JSON (one line)."""

    print("ready", flush=True)
    print(json.dumps(_flood(base, n)), flush=True)

def _p95(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]

def webhook_under_flood(base: str, *, rounds: int, quick: bool) -> Metric:
    count = 20 if quick else 100
    _webhook_latencies(base, 5)  # warm up (the first page starts a run; the rest are duplicates)
    at_rest = _webhook_latencies(base, count)
    during: list[float] = []
    codes: dict[int, int] = {}
    for _ in range(rounds):
        # Why a separate process: the flood's client work must not hold the measurer's interpreter
        flooder = subprocess.Popen([sys.executable, "-m", "bench.p10_floods", "--flood", base, str(FLOOD)],
                                   cwd=ENGINE_ROOT, env=base_env({"PYTHONPATH": str(ENGINE_ROOT)}),
                                   stdout=subprocess.PIPE, text=True)
        assert flooder.stdout is not None
        if flooder.stdout.readline().strip() != "ready":
            raise RuntimeError("the P10 flooder did not start")
        stop = threading.Event()
        result: list[float] = []
        measurer = threading.Thread(target=lambda r=result, s=stop: r.extend(_webhook_latencies(base, count, s)))
        measurer.start()
        out, _ = flooder.communicate(timeout=300)
        stop.set()
        measurer.join()
        for code, n in json.loads(out.strip().splitlines()[-1]).items():
            codes[int(code)] = codes.get(int(code), 0) + n
        during.extend(result)
    delta = _p95(during) - _p95(at_rest)
    return Metric("p10_webhook_flood_delta_ms", delta, rounds, {
        "at_rest_p95_ms": round(_p95(at_rest), 2), "flood_p95_ms": round(_p95(during), 2),
        "at_rest": summary(at_rest, 2)["median"], "flood_samples": len(during), "flood_answers": codes,
        "flood_requests_per_round": FLOOD, "token_review_ms": REVIEW_SECONDS * 1000})


def _upload_body(parts: int = 20000) -> bytes:
    filler = f"--{BOUNDARY}\r\nX: \r\n\r\nv\r\n".encode()
    filler = filler.replace(b"X: ", b"X: " + b"p" * (52 - len(filler)))
    return filler * parts + f"--{BOUNDARY}--\r\n".encode()

def _post_raw(base: str, body: bytes) -> None:
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        head = (f"POST /ui/plans/upload HTTP/1.1\r\nHost: {host}\r\nContent-Type: multipart/form-data; "
                f"boundary={BOUNDARY}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        s.sendall(head)
        with contextlib.suppress(OSError):
            for i in range(0, len(body), 16384):
                s.sendall(body[i:i + 16384])
        with contextlib.suppress(OSError):
            s.recv(65536)

def healthz_during_uploads(base: str, *, rounds: int) -> Metric:
    import httpx

    body = _upload_body()
    worst: list[float] = []
    for _ in range(rounds):
        done = threading.Event()
        uploader = threading.Thread(target=lambda d=done: (_post_raw(base, body), d.set()))
        samples: list[float] = []
        with httpx.Client(timeout=30) as client:
            uploader.start()
            while not done.is_set():
                t = time.perf_counter()
                client.get(base + "/healthz")
                samples.append((time.perf_counter() - t) * 1000)
                time.sleep(0.005)
        uploader.join()
        worst.append(max(samples) if samples else 0.0)
    return Metric("p10_healthz_upload_ms", max(worst), rounds, {
        "worst_per_round": summary(worst, 2), "upload_bytes": len(body), "upload_parts": 20000})

def run(ctx: Context) -> list[Metric]:
    rounds = 1 if ctx.quick else ctx.runs
    with _server(ctx) as base:
        log("p10: webhook latency at rest and under a flood of made-up bearer tokens")
        flood = webhook_under_flood(base, rounds=rounds, quick=ctx.quick)
        log("p10: /healthz during unauthenticated 1 MiB / 20,000-part uploads")
        upload = healthz_during_uploads(base, rounds=rounds)
    return [flood, upload]

if __name__ == "__main__":
    if sys.argv[1:2] == ["--flood"]:
        _flood_process(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1:2] == ["--serve"]:
        os.environ.setdefault("RUNBOOK_LOG_FORMAT", "text")
        serve(sys.argv[2])
