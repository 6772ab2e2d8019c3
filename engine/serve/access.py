"""Who is calling and what they may do: credentials -> identities with one role each, Host/Origin checks.

A credential is a bearer token (or the password of basic auth) bound to one identity (``alice``) and
one role: ``sender`` (posts Alertmanager webhooks), ``approver`` (approves runs, resets breakers,
reads) or ``reader`` (reads). The identity, never a field of the request body, is what the journal
records as the approver. With ``auth.mode: kubernetes`` the approvers and readers are not configured
here: a bearer token that is not a configured credential is asked about through
``engine.serve.kube_identity`` (TokenReview + SubjectAccessReview; use ``resolve`` on the event loop,
it asks in a thread). ``Host`` must name the bound address or a configured name (DNS rebinding),
and a browser's ``Origin`` must be one of those too (cross-site posts). This module decides access
only; it never reads bodies or starts anything.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from starlette.concurrency import run_in_threadpool

from engine.serve.config import ServeConfig, split_listen

if TYPE_CHECKING:
    from engine.serve.kube_identity import KubeIdentity

Role = Literal["sender", "approver", "reader"]
INSECURE_IDENTITY = "insecure-no-auth"


@dataclass(frozen=True)
class Identity:
    """The caller a credential is bound to."""

    name: str
    role: Role | Literal["any", "none"]  # none: authenticated (Kubernetes) but granted nothing here

    def may(self, *roles: Role) -> bool:
        return self.role == "any" or self.role in roles


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def _host_only(value: str) -> str:
    """``"127.0.0.1:8080"`` / ``"[::1]:8080"`` / ``"Example.org"`` -> the lower-case host name."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        return value.partition(":")[0]
    return value


class Access:
    """Credentials and names of one server configuration."""

    def __init__(self, config: ServeConfig, *, kube: KubeIdentity | None = None) -> None:
        """``kube``: the Kubernetes identity backend, required when ``auth.mode`` is ``kubernetes``."""
        auth = config.auth
        self.insecure = auth.insecure_no_auth
        if auth.mode == "kubernetes" and kube is None and not self.insecure:
            raise ValueError("auth.mode kubernetes needs the Kubernetes identity backend (KubeIdentity)")
        self.kube = kube if auth.mode == "kubernetes" else None
        # Why digests: a dict lookup on SHA-256(token) does not reveal the token through timing, and
        # costs the same for one credential or a hundred.
        self._by_digest: dict[bytes, Identity] = {}
        roles: Mapping[Role, Mapping[str, str]] = {"sender": auth.senders, "approver": auth.approvers,
                                                   "reader": auth.readers}
        for role, creds in roles.items():
            for name, token in creds.items():
                self._by_digest[_digest(token)] = Identity(name, role)
        host, _ = split_listen(config.listen)
        self.loopback = is_loopback(host)
        names = {h.lower() for h in auth.allowed_hosts}
        if self.loopback:
            names |= {"localhost", "127.0.0.1", "::1"}
        if not _wildcard(host):
            names.add(host.lower())
        self.hosts = frozenset(names)
        self.open_reads = auth.reads == "open" or (auth.reads == "auto" and self.loopback)

    def roles_configured(self) -> dict[str, int]:
        """Configured credentials per role (``-1``: decided by Kubernetes RBAC)."""
        out = {"sender": 0, "approver": 0, "reader": 0}
        if self.kube is not None:
            out["approver"] = out["reader"] = -1
        for ident in self._by_digest.values():
            out[ident.role] += 1
        return out

    def identify(self, authorization: str | None) -> Identity | None:
        """``Authorization: Bearer <token>`` or basic auth with the token as password (any user name).

        Blocks while Kubernetes is asked (``auth.mode: kubernetes``); on the event loop use ``resolve``.
        Raises ``kube_identity.IdentityUnavailable`` when Kubernetes cannot answer."""
        cred, known = self._configured(authorization)
        if known is not None or self.kube is None or not cred:
            return known
        return self.kube.identify(cred)

    async def resolve(self, authorization: str | None) -> Identity | None:
        """``identify`` for the event loop: a configured credential at once, Kubernetes in a thread."""
        cred, known = self._configured(authorization)
        if known is not None or self.kube is None or not cred:
            return known
        return await run_in_threadpool(self.kube.identify, cred)

    def identify_configured(self, authorization: str | None) -> Identity | None:
        """Only the configured credentials (never asks Kubernetes)."""
        return self._configured(authorization)[1]

    def _configured(self, authorization: str | None) -> tuple[str, Identity | None]:
        """The credential of the header and the configured identity it is bound to (or None)."""
        if self.insecure:
            return "", Identity(INSECURE_IDENTITY, "any")
        scheme, _, cred = (authorization or "").partition(" ")
        cred = cred.strip()
        scheme = scheme.lower()
        if scheme == "basic":
            try:
                _, _, cred = base64.b64decode(cred, validate=True).decode("utf-8").partition(":")
            except (binascii.Error, UnicodeDecodeError, ValueError):
                return "", None
        elif scheme != "bearer":
            return "", None
        if not cred:
            return "", None
        return cred, self._by_digest.get(_digest(cred))

    def host_allowed(self, host_header: str | None) -> bool:
        return bool(host_header) and _host_only(host_header or "") in self.hosts

    def origin_allowed(self, origin: str | None) -> bool:
        """No ``Origin`` (not a browser) is fine; ``null`` or another site's origin is not."""
        if origin is None:
            return True
        try:
            netloc = urlsplit(origin).netloc
        except ValueError:
            return False
        return bool(netloc) and _host_only(netloc) in self.hosts
