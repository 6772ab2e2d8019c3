"""``runbook serve`` over real sockets (issue 14, items 5 and 6): slow and partial bodies, connection
caps, and a big delivery, against uvicorn on 127.0.0.1 with an ephemeral port.

The server runs in a thread of this process with the same uvicorn options ``runbook serve`` uses
(``engine.serve.cli.uvicorn_options``). Every loop here is bounded and stops by itself.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import httpx
import pytest
import uvicorn

from engine.lab.ports import free_port
from engine.serve import app as app_module
from engine.serve.app import create_app
from engine.serve.cli import uvicorn_options
from engine.serve.config import load_config
from engine.serve.notify import Notifier
from tests.fakes import INCIDENT_NODES, TOKEN, FakeRunStarter, StaticClusterView, alert, trigger_spec, webhook


@contextmanager
def live(**cfg: Any) -> Iterator[str]:
    """The app under uvicorn on 127.0.0.1:<free port>; yields ``host:port``."""
    port = free_port("127.0.0.1")
    config = load_config(None, env={"RUNBOOK_WEBHOOK_TOKEN": TOKEN},
                         overrides={"listen": f"127.0.0.1:{port}", **cfg})
    starter = FakeRunStarter([trigger_spec(mode="approve", matchers=('node=~"omen.*"',))])
    app = create_app(config, starter, cluster=StaticClusterView(INCIDENT_NODES), notifier=Notifier(None),
                     sweep_interval=0)
    opts = uvicorn_options(config)
    opts["timeout_graceful_shutdown"] = 1
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **opts))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _head(addr: str, length: int, *, auth: bool = True) -> bytes:
    return (f"POST /hooks/alertmanager HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n"
            + (f"Authorization: Bearer {TOKEN}\r\n" if auth else "")
            + f"Content-Length: {length}\r\n\r\n").encode()


def _connect(addr: str) -> socket.socket:
    host, port = addr.split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _until_closed(sock: socket.socket, limit: float) -> tuple[float, bytes]:
    """Seconds until the server closed ``sock`` (at most ``limit``) and what it sent."""
    started = time.monotonic()
    got = b""
    sock.settimeout(0.2)
    while time.monotonic() - started < limit:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
        if not chunk:
            break
        got += chunk
    return time.monotonic() - started, got


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_the_body_read_timeout_defaults_to_10_seconds() -> None:
    limits = load_config(None, env={}).limits
    assert (limits.body_timeout, limits.header_timeout, limits.keep_alive) == (10.0, 10.0, 5.0)
    assert limits.buffered_bytes == 16 * 1024 * 1024


def test_a_stalled_body_is_answered_408_and_its_connection_dropped() -> None:
    with live(limits={"body_timeout": 1}) as addr:
        sock = _connect(addr)
        with sock:
            sock.sendall(_head(addr, 5000) + b'{"version": "4", "alerts": [')
            took, got = _until_closed(sock, 10)
        assert got.startswith(b"HTTP/1.1 408"), got[:100]
        assert took < 3, f"dropped after {took:.1f}s"


def test_a_connection_that_never_finishes_its_headers_is_closed() -> None:
    with live(limits={"header_timeout": 1}) as addr:
        sock = _connect(addr)
        with sock:
            sock.sendall(f"POST /hooks/alertmanager HTTP/1.1\r\nHost: {addr}\r\n".encode())
            took, got = _until_closed(sock, 10)
        assert got == b"" and took < 3, f"open for {took:.1f}s"


def test_connections_are_capped_and_the_cap_frees_itself() -> None:
    with live(limits={"max_connections": 8, "header_timeout": 1.5}) as addr:
        idle = [_connect(addr) for _ in range(10)]
        try:
            time.sleep(0.2)
            r = httpx.get(f"http://{addr}/healthz", timeout=5)
            assert r.status_code == 503  # over the cap: refused at once, not queued
            time.sleep(2.5)  # the idle ones were closed at their header deadline
            assert httpx.get(f"http://{addr}/healthz", timeout=5).status_code == 200
        finally:
            for s in idle:
                s.close()


@pytest.mark.parametrize("limits", [
    {"max_body_reads": 1000},  # the byte budget alone bounds memory
    {"buffered_bytes": 1024 ** 3},  # the cap on bodies in flight alone bounds memory
], ids=["byte-budget", "bodies-in-flight"])
def test_under_a_flood_of_half_sent_bodies_healthz_answers_and_memory_stays_flat(limits: dict[str, int]) -> None:
    """Every /healthz during the flood is answered (how fast is the benchmark's ``p10_webhook_flood_delta_ms``),
    and the bodies held are bounded: 300 half-sent 2 MB bodies would hold 75 MB."""
    with live(limits={"body_timeout": 3, **limits}) as addr, \
            httpx.Client(base_url=f"http://{addr}", timeout=5) as client:
        assert client.get("/healthz").status_code == 200
        rss0 = _rss_kib()
        flood: list[socket.socket] = []
        chunk = b"x" * 16384
        try:
            for i in range(300):  # half without credentials; each sends 256 KiB of 2 MB, then stalls
                sock = _connect(addr)
                flood.append(sock)
                with suppress(OSError):
                    sock.sendall(_head(addr, 2_000_000, auth=i % 2 == 0))
                    sock.settimeout(0.05)
                    for _ in range(16):
                        sock.sendall(chunk)
            for _ in range(40):
                assert client.get("/healthz").status_code == 200
                time.sleep(0.02)
            grown = (_rss_kib() - rss0) / 1024
        finally:
            for s in flood:
                with suppress(OSError):
                    s.close()
        assert grown < 30, f"RSS grew by {grown:.1f} MB"


def _big_delivery() -> bytes:
    alerts = []
    for i in range(1000):
        a = alert(f"omen{i % 8 + 1}" if i % 2 else f"gpu{i}", fingerprint=f"fp-{i}",
                  **{f"pad{j}": "p" * 400 for j in range(4)})
        alerts.append(a)
    body = json.dumps(webhook(*alerts)).encode()
    assert 1_900_000 < len(body) < 2 * 1024 * 1024, len(body)
    return body


def test_healthz_is_answered_while_a_2_mb_delivery_is_being_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parse of a large delivery runs off the event loop: a /healthz sent while the parser is
    at work is answered before the parser returns (the parser waits for that answer; on the event
    loop it would wait in vain). How long /healthz takes meanwhile is the benchmark's
    (``p10_healthz_upload_ms``), not this test's."""
    body = _big_delivery()
    parsing, answered = threading.Event(), threading.Event()
    seen: list[bool] = []
    real = app_module.parse_alertmanager

    def watched(*args: Any, **kwargs: Any) -> Any:
        parsing.set()
        seen.append(answered.wait(5))
        return real(*args, **kwargs)

    monkeypatch.setattr(app_module, "parse_alertmanager", watched)
    with live() as addr, httpx.Client(base_url=f"http://{addr}", timeout=10) as client:
        answers: list[int] = []

        def send() -> None:
            with httpx.Client(timeout=30) as c:
                r = c.post(f"http://{addr}/hooks/alertmanager", content=body,
                           headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
                answers.append(r.status_code)

        sender = threading.Thread(target=send)
        sender.start()
        assert parsing.wait(10), "the delivery never reached the parser"
        assert client.get("/healthz").status_code == 200
        answered.set()
        sender.join(30)
        assert seen == [True], "/healthz was not answered while the delivery was parsed"
        assert answers and answers[0] in (200, 202), answers


def test_the_per_request_access_log_is_off_unless_configured() -> None:
    quiet = uvicorn.Config(lambda *a: None, **uvicorn_options(load_config(None)))
    loud = uvicorn.Config(lambda *a: None, **uvicorn_options(load_config(None, overrides={"access_log": True})))
    assert (quiet.access_log, loud.access_log) == (False, True)


def test_a_responses_head_and_body_written_in_one_loop_step_leave_in_one_send() -> None:
    """``CoalescingTransport`` (uvicorn writes a response's head and body separately: two segments)."""
    import asyncio

    from engine.serve.http import CoalescingTransport

    sent: list[Any] = []

    class Recording:
        def write(self, data: bytes) -> None:
            sent.append(data)

        def is_closing(self) -> bool:
            return False

        def close(self) -> None:
            sent.append("closed")

        def get_write_buffer_size(self) -> int:
            return 0

    loop = asyncio.new_event_loop()
    try:
        transport = CoalescingTransport(Recording(), loop)

        async def respond() -> None:
            transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
            transport.write(b"{}")
            assert sent == [] and transport.get_write_buffer_size() == 40
            await asyncio.sleep(0)
            transport.write(b"next")
            transport.close()  # what is pending leaves first

        loop.run_until_complete(respond())
    finally:
        loop.close()
    assert sent == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}", b"next", "closed"]
