"""PagerDuty v3 webhooks: signature verification first, then typed parsing.

``X-PagerDuty-Signature`` holds one or more comma-separated ``v1=<hex>`` values: each an
HMAC-SHA256 of the raw body with a subscription secret (several during a secret rotation). A
delivery is authentic when any ``v1`` value equals ours, compared in constant time. A missing
header, or one without a well-formed ``v1`` value, is a ``SignatureMissing`` (HTTP 400); a
well-formed header that does not match is a ``SignatureMismatch`` (HTTP 403). The body is only
parsed after it verified. This module never decides what to run.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.serve.alertmanager import PayloadError, format_validation_error, load_json

SIGNATURE_HEADER = "X-PagerDuty-Signature"
WEBHOOK_ID_HEADER = "X-Webhook-Id"
MAX_BODY_BYTES = 2 * 1024 * 1024  # PagerDuty's own client reads at most 2 MB
_V1 = re.compile(r"^v1=([0-9a-fA-F]{64})$")


class SignatureError(Exception):
    """Base of the two signature failures."""


class SignatureMissing(SignatureError):
    """No header, or no well-formed ``v1=<64 hex>`` value in it (-> 400)."""


class SignatureMismatch(SignatureError):
    """Well-formed, but no value matches the body and our secret(s) (-> 403)."""


def sign(body: bytes, secret: str) -> str:
    """The ``v1=<hex>`` value PagerDuty sends for ``body`` with ``secret``."""
    return "v1=" + hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()


def header_signatures(header: str | None) -> list[bytes]:
    """The decoded ``v1`` digests of a header value. Values of other versions are skipped."""
    if not header or not header.strip():
        raise SignatureMissing(f"missing {SIGNATURE_HEADER} header")
    found: list[bytes] = []
    for part in header.split(","):
        m = _V1.match(part.strip())
        if m:
            found.append(bytes.fromhex(m.group(1)))
    if not found:
        raise SignatureMissing(f"malformed {SIGNATURE_HEADER} header: no v1=<64 hex digits> value")
    return found


def verify_signature(body: bytes, header: str | None, secrets: Iterable[str]) -> None:
    """Return when some ``v1`` value matches ``body`` under some secret; raise SignatureError otherwise.

    Every candidate is compared (no early exit) so the time taken does not depend on which matched.
    """
    given = header_signatures(header)
    ok = False
    for secret in secrets:
        expected = hmac.new(secret.encode("utf-8"), body, hashlib.sha256).digest()
        for sig in given:
            ok |= hmac.compare_digest(expected, sig)
    if not ok:
        raise SignatureMismatch("signature does not match")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


class Reference(_Frozen):
    id: str = ""
    summary: str = ""
    type: str = ""


class Incident(_Frozen):
    id: str
    title: str = ""
    status: str = ""
    urgency: str = ""
    number: int | None = None
    service: Reference = Field(default_factory=Reference)
    html_url: str = ""


class Event(_Frozen):
    id: str
    event_type: str
    resource_type: str = ""
    occurred_at: str = ""
    data: dict[str, Any] = Field(default_factory=dict)

    def incident(self) -> Incident:
        """The event's incident (``resource_type: incident``); PayloadError when it has none."""
        try:
            return Incident.model_validate(self.data)
        except ValidationError as e:
            raise PayloadError(f"event.data is not an incident: {format_validation_error(e)}") from e


class Delivery(_Frozen):
    event: Event


class StaleDelivery(Exception):
    """A verified delivery whose signed ``occurred_at`` is outside the accepted window (-> 403)."""


def check_fresh(event: Event, now: float, *, max_age: float, skew: float) -> float:
    """The signed ``occurred_at`` as epoch seconds, when it lies within ``max_age`` (+ ``skew``) in the
    past and at most ``skew`` in the future. PayloadError when missing or not a timestamp;
    StaleDelivery when outside the window: a captured delivery replayed later starts nothing."""
    raw = event.occurred_at.strip()
    if not raw:
        raise PayloadError("event.occurred_at is missing: a delivery must carry its signed time")
    try:
        at = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError as e:
        raise PayloadError(f"event.occurred_at is not an ISO 8601 time: {raw[:40]!r}") from e
    if at.tzinfo is None:
        raise PayloadError(f"event.occurred_at has no time zone: {raw[:40]!r}")
    epoch = at.timestamp()
    if now - epoch > max_age + skew:
        raise StaleDelivery(f"delivery occurred {now - epoch:.0f}s ago, more than the "
                            f"{max_age:.0f}s (+{skew:.0f}s skew) accepted: refused as a possible replay")
    if epoch - now > skew:
        raise StaleDelivery(f"delivery is dated {epoch - now:.0f}s in the future (more than {skew:.0f}s skew)")
    return epoch


def content_key(body: bytes) -> str:
    """The replay key of a verified delivery: its signed content, whatever ``X-Webhook-Id`` says."""
    return "body-" + hashlib.sha256(body).hexdigest()


def parse_delivery(body: bytes) -> Delivery:
    """Verified bytes -> ``Delivery``; PayloadError when malformed."""
    data = load_json(body)
    if not isinstance(data, dict):
        raise PayloadError(f"expected a JSON object, got {type(data).__name__}")
    try:
        return Delivery.model_validate(data)
    except ValidationError as e:
        raise PayloadError(f"not a PagerDuty v3 webhook: {format_validation_error(e)}") from e
