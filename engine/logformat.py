"""Log output of every command: ``runbook --log-format text|json`` (env ``RUNBOOK_LOG_FORMAT``).

``text`` (the default) leaves logging as it always was: commands print their results, the server
logs readable lines. ``json`` sends every log record to stderr as one JSON object per line:
``ts``, ``level``, ``logger``, ``msg`` and, when the record carries them, ``run_id``, ``runbook``,
``step``, ``node``, ``event``, ``status``, ``reason`` (run events are logged by
``engine.store.JournalSink`` on logger ``runbook.events``). No secret is written: keys that look
secret (password, token, secret, authorization) are masked; so is the value of every setting typed
``engine.secrecy.Secret`` in a loaded configuration (tokens, signing secrets, notification URLs,
routing keys: masked by their type, ``engine.secrecy.register``), and of every ``RUNBOOK_*``
environment variable whose name says it holds a token, secret or password. In both formats the HTTP
client libraries (httpx, urllib3, the Kubernetes client) log no request URL path, query or body at
any level (``engine.secrecy.quiet_http_client_logs``).

This module formats and installs a handler; it decides nothing and reads only the environment.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from engine import secrecy
from engine.store import redact

FORMATS = ("text", "json")
FIELDS = ("run_id", "runbook", "step", "node", "event", "status", "reason")
_SECRET_NAMES = ("TOKEN", "SECRET", "PASSWORD")
_current = "text"


def secrets_from_env(env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The values of ``RUNBOOK_*`` variables whose names mark them as credentials."""
    env = os.environ if env is None else env
    return frozenset(v for k, v in env.items()
                     if k.startswith("RUNBOOK_") and any(m in k for m in _SECRET_NAMES) and len(v) >= 4)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, secrets masked."""

    def __init__(self, secrets: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.secrets = secrets

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None and value != "":
                out[name] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(redact(out, self.secrets | secrecy.known()), default=str, separators=(",", ":"))


def configure_logging(fmt: str, *, debug: bool = False) -> None:
    """Install the handler for ``fmt`` (``json``); ``text`` changes nothing."""
    global _current
    if fmt not in FORMATS:
        raise ValueError(f"log format is one of {', '.join(FORMATS)}, not {fmt!r}")
    _current = fmt
    secrecy.quiet_http_client_logs()
    if fmt == "text":
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(secrets_from_env()))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    for noisy in ("urllib3", "kubernetes", "httpx", "httpcore", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def current_format() -> str:
    """The format chosen for this process (``text`` until ``configure_logging``)."""
    return _current
