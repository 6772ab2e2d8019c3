"""What every loopback HTTP fake shares: a server on 127.0.0.1 (a free port) on a daemon thread,
a handler that reads bodies and answers JSON quietly, and closing it when the test is done."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar


class JsonHandler(BaseHTTPRequestHandler):
    """A request handler with the body read in one call and JSON answers; it logs nothing."""

    def body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length", "0")))

    def answer(self, code: int, data: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> None:
        out = json.dumps(data).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class LoopbackServer:
    """``handler`` served on 127.0.0.1 at ``url`` from a daemon thread until ``close``."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


ServerT = TypeVar("ServerT", bound=LoopbackServer)


@contextmanager
def serving(server: ServerT) -> Iterator[ServerT]:
    """``server`` for the ``with`` block, closed after it."""
    try:
        yield server
    finally:
        server.close()
