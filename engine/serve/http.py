"""Connection-level limits uvicorn does not have: a deadline for a new connection's request headers.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) and caps connections
(``limit_concurrency``), but a fresh connection that sends its headers a byte at a time (slowloris)
is never timed out. ``header_timeout_protocol`` returns uvicorn's h11 protocol with such a deadline:
a connection that has not delivered a complete request head within ``seconds`` of connecting is
closed. Body deadlines live in the app (``engine.serve.app.read_body``). No routing, no decisions.
"""

from __future__ import annotations

import asyncio
from typing import Any

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
            super().connection_made(transport, *args)
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
