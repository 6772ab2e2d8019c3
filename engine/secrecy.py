"""Secrets by construction: a ``Secret`` string type for configuration models, the values of every
such field (``secret_values``) registered once per process (``register``) for the JSON log masking
(``engine.logformat``), and HTTP client libraries that log no request URL at any level.

A setting that holds a credential (a token, a signing secret, a webhook URL, a routing key) is
declared ``Secret`` in its model: its ``repr`` is withheld, and whoever loads the configuration calls
``register(*secret_values(config))``, so the log formatter masks its value wherever it appears. No
list of names to keep in step: a new field typed ``Secret`` is masked because of its type.

``quiet_http_client_logs`` wraps the logging record factory: a record of ``httpx``, ``httpcore``,
``urllib3``, ``requests`` or the Kubernetes client keeps its level and logger, but any URL in it
is cut to its scheme and host (a Slack webhook's path is its credential), a request line's path is
withheld, and a response body is never shown. This module only masks; it reads no file and decides
nothing.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel


class _SecretMarker:
    """The metadata that makes an ``Annotated[str, ...]`` a secret."""

    def __repr__(self) -> str:
        return "SECRET"


SECRET = _SecretMarker()
Secret = Annotated[str, SECRET]  # a credential: masked in logs (its fields also say repr=False)

_lock = threading.Lock()
_known: set[str] = set()
MIN_MASKED = 4  # shorter values would mask ordinary words


def register(*values: str | None) -> None:
    """Mask these values in every JSON log line of this process from now on."""
    with _lock:
        _known.update(v for v in values if isinstance(v, str) and len(v) >= MIN_MASKED)


def known() -> frozenset[str]:
    with _lock:
        return frozenset(_known)


def _is_secret(metadata: Any) -> bool:
    return any(m is SECRET for m in metadata)


def _collect(value: Any, annotation: Any, metadata: Any, out: set[str]) -> None:
    if value is None:
        return
    if _is_secret(metadata):
        if isinstance(value, str):
            out.add(value)
        return
    if isinstance(value, BaseModel):
        out.update(secret_values(value))
        return
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is Annotated:
        _collect(value, args[0], args[1:], out)
    elif origin in (Union, UnionType):
        for arg in args:
            _collect(value, arg, (), out)
    elif isinstance(value, Mapping) and len(args) == 2:
        for v in value.values():
            _collect(v, args[1], (), out)
    elif isinstance(value, list | tuple | set | frozenset) and args:
        for v in value:
            _collect(v, args[0], (), out)


def secret_values(model: BaseModel) -> set[str]:
    """Every value held by a ``Secret`` field of ``model`` and of the models inside it."""
    out: set[str] = set()
    for name, info in type(model).model_fields.items():
        _collect(getattr(model, name), info.annotation, info.metadata, out)
    return out


# ---------------------------------------------------------------------------- HTTP client logs

HTTP_CLIENT_LOGGERS = ("httpx", "httpcore", "urllib3", "requests", "kubernetes")
_URL = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*)://([^/\s'\"<>]*)[^\s'\"<>]*")
_REQUEST_LINE = re.compile(r"\b(GET|POST|PUT|PATCH|DELETE|HEAD|OPTIONS) (/[^\s'\"]*)")
_BODY = re.compile(r"(response body|request body|body)\s*[:=].*", re.IGNORECASE | re.DOTALL)
_installed = False


def mask_http_log(text: str) -> str:
    """``text`` without URL paths, queries or credentials, request paths or bodies."""
    text = _URL.sub(lambda m: f"{m.group(1)}://{m.group(2).rpartition('@')[2]}/...", text)
    text = _REQUEST_LINE.sub(lambda m: f"{m.group(1)} /...", text)
    return _BODY.sub(lambda m: f"{m.group(1)}: (withheld)", text)


def _http_client(name: str) -> bool:
    return name.partition(".")[0] in HTTP_CLIENT_LOGGERS


def quiet_http_client_logs() -> None:
    """Install (once per process) the record factory that masks the HTTP client libraries' records."""
    global _installed
    with _lock:
        if _installed:
            return
        previous = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            if _http_client(record.name):
                try:
                    text = record.getMessage()
                except Exception:  # a record whose arguments do not fit its format: show the format only
                    text = str(record.msg)
                record.msg, record.args = mask_http_log(text), None
            return record

        logging.setLogRecordFactory(factory)
        _installed = True
