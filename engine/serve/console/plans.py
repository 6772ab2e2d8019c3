"""The plans page's boundary: an uploaded plan file (``runbook plan --out``) or a plan request form ->
typed values, or one clear, located error.

An upload is a ``multipart/form-data`` body (parsed with the standard library's MIME parser, after
its size was bounded by the caller); the plan file in it must be UTF-8 JSON (``file: line L, column
C: ...``), a valid ``Plan`` (``file: steps.0.kind: ...``) and carry the digest of its own content
(``file: digest: ...``: a file changed after ``runbook plan`` made it is refused). A request form's
params are ``name=value`` lines. This module parses only: it plans nothing, records nothing and
never touches a run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from email import policy
from email.message import EmailMessage
from email.parser import BytesParser
from typing import Any

from pydantic import ValidationError

from engine.model import Plan

MAX_PLAN_BYTES = 1024 * 1024  # a plan file with its previews is tens of KB; beyond this: refused (413)
MAX_PARAMS = 20


class UploadError(Exception):
    """A bad upload or request form; ``str()`` is the located message shown in the page."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def multipart_fields(content_type: str, body: bytes, *, max_fields: int = 10) -> dict[str, tuple[str | None, bytes]]:
    """A ``multipart/form-data`` body -> field name -> (file name or None, bytes)."""
    if not content_type.lower().startswith("multipart/form-data") or "boundary=" not in content_type.lower():
        raise UploadError("expected a file upload (multipart/form-data with a boundary)", 415)
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1", "replace")
    message = BytesParser(policy=policy.HTTP).parsebytes(head + body)
    if not isinstance(message, EmailMessage) or not message.is_multipart():
        raise UploadError("the upload is not a readable multipart form")
    out: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        if len(out) >= max_fields:
            raise UploadError(f"the form has more than {max_fields} fields")
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str) or not name:
            continue
        payload = part.get_payload(decode=True)
        out[name] = (part.get_filename(), payload if isinstance(payload, bytes) else b"")
    return out


def parse_plan_file(name: str, data: bytes) -> Plan:
    """A saved plan file's bytes -> the ``Plan``, or ``UploadError`` naming the file and the place."""
    name = (name or "the file")[:120]
    if not data.strip():
        raise UploadError(f"{name}: the file is empty; choose a plan file saved by `runbook plan --out FILE`")
    if len(data) > MAX_PLAN_BYTES:
        raise UploadError(f"{name}: {len(data)} bytes is more than a plan file ({MAX_PLAN_BYTES} bytes at most)", 413)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UploadError(f"{name}: byte {e.start}: not UTF-8 text, so not a plan file (`runbook plan --out` "
                          "writes JSON)") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise UploadError(f"{name}: line {e.lineno}, column {e.colno}: not JSON ({e.msg}); a plan file is the "
                          "JSON `runbook plan --out` writes") from None
    if not isinstance(raw, dict):
        raise UploadError(f"{name}: line 1: a plan file is a JSON object, not a {type(raw).__name__}")
    if raw.get("format") != "runbook-plan/v1":
        raise UploadError(f"{name}: format: expected runbook-plan/v1, found {str(raw.get('format'))[:40]}: not a "
                          "plan saved by `runbook plan --out`")
    try:
        plan = Plan.model_validate(raw)
    except ValidationError as e:
        errors = e.errors()
        first = errors[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top)"
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise UploadError(f"{name}: {where}: {first['msg']}{more}: not a valid plan") from None
    if not plan.digest:
        raise UploadError(f"{name}: digest: missing; a plan saved by `runbook plan --out` carries the digest of "
                          "its content")
    actual = plan.compute_digest()
    if actual != plan.digest:
        raise UploadError(f"{name}: digest: the file says {plan.digest[:16]}... but its content hashes to "
                          f"{actual[:16]}...: it was changed after `runbook plan` saved it; make a new plan",
                          422)
    return plan


def parse_params(text: str) -> dict[str, str]:
    """``name=value`` lines (blank lines ignored) -> params; ``UploadError`` naming the line."""
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UploadError(f"params, line {n}: expected name=value, found {line[:60]!r}")
        if key == "node":
            raise UploadError(f"params, line {n}: give the node in the Node field, not as a param")
        if len(out) >= MAX_PARAMS:
            raise UploadError(f"params: more than {MAX_PARAMS} params")
        out[key[:100]] = value.strip()
    return out


def plan_view(plan: Plan | Mapping[str, Any]) -> dict[str, Any]:
    """The plan as the templates read it (the JSON shape a run's ``plan`` has)."""
    return plan.model_dump(mode="json") if isinstance(plan, Plan) else dict(plan)
