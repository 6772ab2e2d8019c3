"""Alertmanager webhook payloads (version "4") -> typed, frozen objects.

The one place where Alertmanager JSON becomes values. Unknown keys are ignored (newer
Alertmanagers add keys); wrong types are a ``PayloadError`` whose message names the field path,
which the HTTP layer turns into a 400. This module never decides what to run.
"""

from __future__ import annotations

import hashlib
import json
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


def load_json(body: bytes) -> Any:
    """Raw bytes -> JSON value, or PayloadError naming the position of the first problem."""
    if not body:
        raise PayloadError("empty body: expected a JSON object")
    try:
        return json.loads(body.decode("utf-8"))  # RFC 8259: JSON between systems is UTF-8
    except UnicodeDecodeError as e:
        raise PayloadError(f"body is not UTF-8: {e.reason} at byte {e.start}") from e
    except json.JSONDecodeError as e:
        raise PayloadError(f"body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    except RecursionError as e:
        raise PayloadError("body is nested too deeply") from e


def parse_webhook(body: bytes) -> WebhookPayload:
    """Bytes of an Alertmanager webhook -> ``WebhookPayload``; PayloadError when malformed."""
    data = load_json(body)
    if not isinstance(data, dict):
        raise PayloadError(f"expected a JSON object, got {type(data).__name__}")
    try:
        return WebhookPayload.model_validate(data)
    except ValidationError as e:
        raise PayloadError(f"not an Alertmanager v4 webhook: {format_validation_error(e)}") from e
