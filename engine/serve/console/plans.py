"""The plans page's boundary: an uploaded plan file (``runbook plan --out``) or a plan request form ->
typed values, or one clear, located error.

An upload is a ``multipart/form-data`` body. While it arrives, ``PartScanner`` counts its parts
(reading stops past the limit) and hands over the first part as soon as it is complete (the form's
CSRF token, checked before the rest is read). The whole body is then split into fields here, meant
to run in a worker thread. The plan file in it must be UTF-8 JSON (``file: line L, column C: ...``;
nesting, huge numbers, ``NaN`` and lone surrogates are located 4xx errors, never a 500), a valid
``Plan`` (``file: steps.0.kind: ...``) and carry the digest of its own content (``file: digest:
...``: a file changed after ``runbook plan`` made it is refused). A request form's params are
``name=value`` lines. This module parses only: it plans nothing, records nothing and never touches
a run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from email import policy
from email.message import EmailMessage
from email.parser import BytesHeaderParser
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


_BOUNDARY = re.compile(r'boundary=(?:"([^"]{1,70})"|([^\s;"]{1,70}))', re.IGNORECASE)


def boundary_of(content_type: str) -> bytes:
    """The multipart boundary of a ``Content-Type``; ``UploadError`` (415) when it is not a form upload."""
    found = _BOUNDARY.search(content_type)
    if not content_type.lower().startswith("multipart/form-data") or found is None:
        raise UploadError("expected a file upload (multipart/form-data with a boundary)", 415)
    return (found.group(1) or found.group(2)).encode("latin-1", "replace")


class PartScanner:
    """Follows a multipart body while it arrives (``feed``): counts its parts, refusing more than
    ``max_parts`` at once (the reader stops there), and knows when the first part is complete."""

    def __init__(self, content_type: str, *, max_parts: int) -> None:
        self.boundary = boundary_of(content_type)
        self.delimiter = b"--" + self.boundary
        self.max_parts = max_parts
        self.buffer = bytearray()
        self.delimiters = 0
        self._scan = 0

    def feed(self, chunk: bytes) -> None:
        """Take the next piece of the body (counting stops once there are too many parts)."""
        self.buffer += chunk
        while not self.too_many():
            at = self.buffer.find(self.delimiter, self._scan)
            if at < 0:
                self._scan = max(self._scan, len(self.buffer) - len(self.delimiter) + 1)
                return
            self.delimiters += 1
            self._scan = at + len(self.delimiter)

    def too_many(self) -> bool:
        return self.delimiters - 1 > self.max_parts

    def check_parts(self) -> None:
        """``UploadError`` once more than ``max_parts`` parts have arrived."""
        if self.too_many():
            raise UploadError(f"the form has more than {self.max_parts} parts")

    def first_part(self) -> tuple[str, bytes] | None:
        """(field name, content) of the first part once it is complete (None until then)."""
        if self.delimiters < 2:
            return None
        fields = _split_parts(bytes(self.buffer), self.boundary, max_fields=1, partial=True)
        return next(((name, data) for name, (_, data) in fields.items()), ("", b""))


def _split_parts(body: bytes, boundary: bytes, *, max_fields: int,
                 partial: bool = False) -> dict[str, tuple[str | None, bytes]]:
    pieces = body.split(b"--" + boundary)
    if len(pieces) < 2 or (not partial and not any(p.startswith(b"--") for p in pieces[1:])):
        raise UploadError("the upload is not a readable multipart form")
    out: dict[str, tuple[str | None, bytes]] = {}
    for piece in pieces[1:]:
        if piece.startswith(b"--"):
            break
        if partial and len(out) >= max_fields:
            break
        if len(out) >= max_fields:
            raise UploadError(f"the form has more than {max_fields} fields")
        piece = piece[2:] if piece.startswith(b"\r\n") else piece
        head, sep, content = piece.partition(b"\r\n\r\n")
        if not sep:
            raise UploadError("the upload is not a readable multipart form (a part without headers)")
        headers = BytesHeaderParser(policy=policy.HTTP).parsebytes(head + b"\r\n\r\n")
        if not isinstance(headers, EmailMessage):
            raise UploadError("the upload is not a readable multipart form")
        name = headers.get_param("name", header="content-disposition")
        if not isinstance(name, str) or not name:
            continue
        out[name] = (headers.get_filename(), content[:-2] if content.endswith(b"\r\n") else content)
    return out


def multipart_fields(content_type: str, body: bytes, *, max_fields: int = 10) -> dict[str, tuple[str | None, bytes]]:
    """A ``multipart/form-data`` body -> field name -> (file name or None, bytes). Runs in a worker thread."""
    return _split_parts(body, boundary_of(content_type), max_fields=max_fields)


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
        raw = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise UploadError(f"{name}: line {e.lineno}, column {e.colno}: not JSON ({e.msg}); a plan file is the "
                          "JSON `runbook plan --out` writes") from None
    except RecursionError:
        raise UploadError(f"{name}: nested too deeply to be a plan file") from None
    except ValueError as e:  # a number of thousands of digits, NaN or Infinity
        raise UploadError(f"{name}: not a plan file: {str(e)[:120]}") from None
    try:
        json.dumps(raw, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise UploadError(f"{name}: nested too deeply to be a plan file") from None
    except UnicodeEncodeError as e:
        raise UploadError(f"{name}: character {e.start}: text is not valid Unicode (a lone surrogate "
                          "\\uD800-\\uDFFF)") from None
    try:
        return _checked_plan(name, raw)
    except RecursionError:
        raise UploadError(f"{name}: nested too deeply to be a plan file") from None


def _no_constant(value: str) -> Any:
    raise ValueError(f"{value} is not a number a plan holds")


def _checked_plan(name: str, raw: Any) -> Plan:
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
