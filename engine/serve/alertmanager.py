"""Alertmanager webhook payloads (version "4") -> typed, frozen objects.

The one place where Alertmanager JSON becomes values. Unknown keys are ignored (newer
Alertmanagers add keys); wrong types are a ``PayloadError`` whose message names the field path,
which the HTTP layer turns into a 400. This module never decides what to run.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class PayloadError(ValueError):
    """A webhook body that is not valid JSON or not the expected shape (-> HTTP 400)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


class Alert(_Frozen):
    status: Literal["firing", "resolved"]
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    starts_at: datetime | None = Field(default=None, alias="startsAt")
    ends_at: datetime | None = Field(default=None, alias="endsAt")
    generator_url: str = Field(default="", alias="generatorURL")
    fingerprint: str = ""

    @property
    def name(self) -> str:
        return self.labels.get("alertname", "")

    @property
    def firing(self) -> bool:
        return self.status == "firing"

    @property
    def dedup_key(self) -> str:
        """Alertmanager's fingerprint; when absent, a stable hash of the label set."""
        if self.fingerprint:
            return self.fingerprint
        blob = json.dumps(sorted(self.labels.items()), separators=(",", ":")).encode()
        return "labels-" + hashlib.sha256(blob).hexdigest()[:16]

    def describe(self) -> str:
        """``KubeNodeNotReady{node="omen2"}``: the alert name and its other labels, for reasons."""
        rest = ",".join(f'{k}="{v}"' for k, v in sorted(self.labels.items()) if k != "alertname")
        return f"{self.name}{{{rest}}}"


class WebhookPayload(_Frozen):
    version: Literal["4"]
    group_key: str = Field(default="", alias="groupKey")
    truncated_alerts: int = Field(default=0, alias="truncatedAlerts", ge=0)
    status: Literal["firing", "resolved"]
    receiver: str = ""
    group_labels: dict[str, str] = Field(default_factory=dict, alias="groupLabels")
    common_labels: dict[str, str] = Field(default_factory=dict, alias="commonLabels")
    common_annotations: dict[str, str] = Field(default_factory=dict, alias="commonAnnotations")
    external_url: str = Field(default="", alias="externalURL")
    alerts: tuple[Alert, ...]


def format_validation_error(e: ValidationError, limit: int = 5) -> str:
    """``alerts[0].labels.node: Input should be a valid string; ...`` (at most ``limit`` problems)."""
    parts: list[str] = []
    for err in e.errors()[:limit]:
        path = ""
        for loc in err["loc"]:
            path += f"[{loc}]" if isinstance(loc, int) else (f".{loc}" if path else str(loc))
        parts.append(f"{path or '(body)'}: {err['msg']}")
    more = len(e.errors()) - limit
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)


# A lone surrogate can only enter through a ``\uD800``-``\uDFFF`` escape (raw surrogate bytes are not
# UTF-8 and fail to decode), so bodies without such an escape need no walk.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
TRUNCATED = "...[truncated]"


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (key or value) holding a lone surrogate, or None."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return p or "(body)"
        elif isinstance(v, dict):
            for k, item in v.items():
                if _SURROGATE.search(k):
                    return f"{p}.{k.encode('utf-8', 'backslashreplace').decode()}" if p else "(a key)"
                stack.append((item, f"{p}.{k}" if p else k))
        elif isinstance(v, list):
            stack.extend((item, f"{p}[{i}]") for i, item in enumerate(v))
    return None


def load_json(body: bytes) -> Any:
    """Raw bytes -> JSON value, or PayloadError naming the position of the first problem.

    Text must be valid Unicode: a lone surrogate (``"\ud800"``) is refused here, before anything
    could store it and fail to write it back out."""
    if not body:
        raise PayloadError("empty body: expected a JSON object")
    try:
        data = json.loads(body.decode("utf-8"))  # RFC 8259: JSON between systems is UTF-8
    except UnicodeDecodeError as e:
        raise PayloadError(f"body is not UTF-8: {e.reason} at byte {e.start}") from e
    except json.JSONDecodeError as e:
        raise PayloadError(f"body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    except RecursionError as e:
        raise PayloadError("body is nested too deeply") from e
    if _SURROGATE_ESCAPE.search(body):
        where = _lone_surrogate(data, "")
        if where is not None:
            raise PayloadError(f"{where}: text is not valid Unicode (a lone surrogate \\uD800-\\uDFFF)")
    return data


def _bounded_text(where: str, values: Any, *, max_entries: int, max_bytes: int) -> Any:
    """Label/annotation maps: at most ``max_entries`` entries (else PayloadError); values longer than
    ``max_bytes`` are cut and end with ``...[truncated]``. Other types are left to the model."""
    if not isinstance(values, Mapping):
        return values
    if len(values) > max_entries:
        raise PayloadError(f"{where}: {len(values)} entries, more than the limit of {max_entries}")
    short = max_bytes // 4  # a string of at most this many characters is at most max_bytes in UTF-8
    for k, v in values.items():
        if (isinstance(k, str) and len(k) > short) or (isinstance(v, str) and len(v) > short):
            break
    else:
        return values  # the common case: nothing to cut
    out: dict[Any, Any] = {}
    for k, v in values.items():
        if isinstance(k, str) and len(k) > max_bytes:
            raise PayloadError(f"{where}: a name is longer than {max_bytes} characters")
        if isinstance(v, str) and len(v.encode("utf-8")) > max_bytes:
            v = v.encode("utf-8")[: max_bytes - len(TRUNCATED)].decode("utf-8", "ignore") + TRUNCATED
        out[k] = v
    return out


def parse_alertmanager(body: bytes, *, max_alerts: int = 1000, max_labels: int = 64,
                       max_value_bytes: int = 1024) -> tuple[WebhookPayload, int]:
    """Bytes of an Alertmanager webhook -> (``WebhookPayload``, alerts beyond ``max_alerts``, dropped).

    Validated one alert at a time, yielding the interpreter between alerts: a single model
    validation of a 2 MB payload would hold the GIL long enough to stall the event loop."""
    data = load_json(body)
    if not isinstance(data, dict):
        raise PayloadError(f"expected a JSON object, got {type(data).__name__}")
    raw_alerts = data.get("alerts")
    if not isinstance(raw_alerts, list):
        raw_alerts = None
    head = {**data, "alerts": []} if raw_alerts is not None else dict(data)
    for key in ("groupLabels", "commonLabels", "commonAnnotations"):
        if key in head:
            head[key] = _bounded_text(key, head[key], max_entries=max_labels, max_bytes=max_value_bytes)
    kept = [_bounded_alert(i, raw, max_labels, max_value_bytes)
            for i, raw in enumerate((raw_alerts or [])[:max_alerts])]
    dropped = len(raw_alerts or []) - len(kept)
    if len(kept) <= 20:  # small (the common case): one validation is cheapest
        try:
            return WebhookPayload.model_validate({**head, "alerts": kept} if raw_alerts is not None else head), dropped
        except ValidationError as e:
            raise PayloadError(f"not an Alertmanager v4 webhook: {format_validation_error(e)}") from e
    try:
        payload = WebhookPayload.model_validate(head)
    except ValidationError as e:
        raise PayloadError(f"not an Alertmanager v4 webhook: {format_validation_error(e)}") from e
    alerts: list[Alert] = []
    for i, raw in enumerate(kept):
        if i % 20 == 19:
            time.sleep(0)  # let the event loop's thread run (see the docstring)
        try:
            alerts.append(Alert.model_validate(raw))
        except ValidationError as e:
            msg = format_validation_error(e).replace("(body)", "", 1)
            raise PayloadError(f"not an Alertmanager v4 webhook: alerts[{i}]"
                               f"{'.' if not msg.startswith(':') else ''}{msg}") from e
    return payload.model_copy(update={"alerts": tuple(alerts)}), dropped


def _bounded_alert(i: int, raw: Any, max_labels: int, max_value_bytes: int) -> Any:
    """One raw alert with its label/annotation maps bounded (copied only when something changes)."""
    if not isinstance(raw, dict):
        return raw
    out = raw
    for key in ("labels", "annotations"):
        value = raw.get(key)
        if value is not None:
            bounded = _bounded_text(f"alerts[{i}].{key}", value, max_entries=max_labels, max_bytes=max_value_bytes)
            if bounded is not value:
                out = {**out, key: bounded}
    fp = raw.get("fingerprint")
    if isinstance(fp, str) and len(fp) > 128:  # a key we keep in memory: bounded
        out = {**out, "fingerprint": "sha256-" + hashlib.sha256(fp.encode("utf-8")).hexdigest()}
    return out


def parse_webhook(body: bytes) -> WebhookPayload:
    """Bytes of an Alertmanager webhook -> ``WebhookPayload`` (default limits); PayloadError when malformed."""
    return parse_alertmanager(body)[0]
