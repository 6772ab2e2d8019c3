"""Connection-level limits uvicorn does not have: a deadline for a new connection's request headers.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) and caps connections
(``limit_concurrency``), but a fresh connection that sends its headers a byte at a time (slowloris)
is never timed out. ``header_timeout_protocol`` returns uvicorn's h11 protocol with such a deadline:
a connection that has not delivered a complete request head within ``seconds`` of connecting is
closed. ``read_body`` reads a request body under a deadline, a size limit and the server-wide
``BodyBudget`` (bodies being received at once, bytes held); the app and the console share it. No
routing, no decisions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # uvicorn[standard]: the faster parser, when installed
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - depends on the installation
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


def header_timeout_protocol(seconds: float) -> type[Any]:
    """uvicorn's HTTP protocol (httptools when installed, else h11) that closes connections whose
    first request head has not arrived ``seconds`` after they were opened."""
    base: type[Any] = HttpToolsProtocol if HttpToolsProtocol is not None else H11Protocol

    class HeaderDeadlineProtocol(base):
        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any, *args: Any) -> None:
            super().connection_made(CoalescingTransport(transport, self.loop), *args)
            self._header_deadline = self.loop.call_later(seconds, self._head_late)

        def _head_late(self) -> None:
            self._header_deadline = None
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        def _head_arrived(self) -> None:
            if self.cycle is not None and self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def handle_events(self) -> None:  # h11
            super().handle_events()
            self._head_arrived()

        def on_headers_complete(self) -> None:  # httptools
            super().on_headers_complete()
            self._head_arrived()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None
            super().connection_lost(exc)

    return HeaderDeadlineProtocol


class CoalescingTransport:
    """A transport whose writes of one event-loop step leave in one ``send``: uvicorn writes a
    response's head and its body separately, two TCP segments on a socket with ``TCP_NODELAY``.
    Why: under a storm of small duplicate pages, the second segment (a syscall, a loopback delivery
    and its ACK) was a large part of each answer (docs/performance.md, P5). Writes are kept in order
    and flushed at the loop's next turn, and before ``close``; everything else is the transport's."""

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(bytes(data))

    def _flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def get_write_buffer_size(self) -> int:
        return int(self._transport.get_write_buffer_size()) + sum(map(len, self._pending))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


_HELD = "runbook.body_bytes"  # scope key: bytes of the byte budget this request holds


class BodyTooLarge(Exception):
    """More than the limit was announced or sent: 413."""


class BodyTimeout(Exception):
    """The body did not arrive within ``limits.body_timeout``."""


class ServerBusy(Exception):
    """Too many bodies in flight, or the byte budget is spent: 503, try again."""


class BodyBudget:
    """Bodies being received at once and the bytes they hold, server-wide (event-loop only: no lock)."""

    def __init__(self, max_reads: int, max_bytes: int) -> None:
        self.max_reads, self.max_bytes = max_reads, max_bytes
        self.reads = 0
        self.bytes = 0

    def take(self, n: int) -> None:
        if self.bytes + n > self.max_bytes:
            raise ServerBusy
        self.bytes += n


async def read_body(request: Request, limit: int, *, budget: BodyBudget | None = None,
                    timeout: float = 10.0, on_chunk: Callable[[bytes], None] | None = None) -> bytes:
    """The raw body, or BodyTooLarge as soon as more than ``limit`` bytes are announced or read,
    BodyTimeout when it does not arrive within ``timeout``, ServerBusy when the budget is spent.
    ``on_chunk`` sees each piece as it arrives; an exception it raises stops the reading there.

    The bytes stay counted against ``budget`` until ``release_body`` (the handler is done)."""
    budget = budget or BodyBudget(1, limit)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    if budget.reads >= budget.max_reads:
        raise ServerBusy
    budget.reads += 1
    held = 0
    try:
        if declared.isdigit():
            budget.take(int(declared))
            held = int(declared)
        size = 0
        chunks: list[bytes] = []
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge
                if size > held:
                    budget.take(size - held)
                    held = size
                chunks.append(chunk)
                if on_chunk is not None:
                    on_chunk(chunk)
    except TimeoutError as e:
        budget.bytes -= held
        raise BodyTimeout from e
    except BaseException:
        budget.bytes -= held
        raise
    finally:
        budget.reads -= 1
    request.scope[_HELD] = held
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def release_body(request: Request, budget: BodyBudget) -> None:
    held = request.scope.pop(_HELD, 0)
    if held:
        budget.bytes -= held
