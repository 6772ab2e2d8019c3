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

import asyncio
import base64
import binascii
import hashlib
import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from starlette.requests import HTTPConnection

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


class TooManyFailures(Exception):
    """This client presented too many unknown credentials lately: 429, nothing is asked."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"too many failed logins from this client; retry in {retry_after:.0f} s")
        self.retry_after = retry_after


class ReviewsBusy(Exception):
    """Every TokenReview slot is taken and the short queue is full: 503, try again."""


class FailureThrottle:
    """Failed credentials per client: a bucket of ``burst`` failures that refills at ``per_minute``;
    an empty bucket refuses the client's next credentials without checking them (event loop only).
    At most ``max_clients`` clients are remembered (the least recently failed are forgotten)."""

    def __init__(self, per_minute: int, *, burst: int | None = None, max_clients: int = 10000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = per_minute / 60.0
        self.burst = float(burst if burst is not None else max(1, per_minute))
        self.max_clients = max_clients
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, at)

    def _level(self, client: str) -> float:
        tokens, at = self._buckets.get(client, (self.burst, self._clock()))
        return min(self.burst, tokens + (self._clock() - at) * self.rate)

    def check(self, client: str) -> None:
        """``TooManyFailures`` when ``client`` has no failure left to spend."""
        if client in self._buckets and self._level(client) < 1.0:
            wait = (1.0 - self._level(client)) / self.rate if self.rate > 0 else 3600.0
            raise TooManyFailures(wait)

    def failed(self, client: str) -> None:
        self._buckets[client] = (self._level(client) - 1.0, self._clock())
        self._buckets.move_to_end(client)
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)


def client_of(request: HTTPConnection) -> str:
    """The caller's address: the key of the per-client failure throttle."""
    return request.client.host if request.client else ""


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
        k = auth.kubernetes
        self.failures = FailureThrottle(auth.failures_per_minute)
        # Why a pool of its own: TokenReviews wait on the API server; in the shared thread pool a
        # flood of made-up tokens would hold every thread the webhooks and pages need
        self.max_reviews = k.max_concurrent_reviews
        self._review_pool: ThreadPoolExecutor | None = None
        self._reviews_waiting = 0
        self.reviews_asked = 0  # TokenReviews handed to the pool (tests, metrics)

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

    async def resolve(self, authorization: str | None, client: str = "") -> Identity | None:
        """``identify`` for the event loop: a configured credential at once; Kubernetes (a cached
        answer, else a TokenReview in this object's own pool of ``max_concurrent_reviews`` threads).

        ``client`` (its address): a credential that is not known counts as one failure of it; a
        client out of failures gets ``TooManyFailures`` (429) before anything is checked. Raises
        ``ReviewsBusy`` (503) when the reviews' queue is full."""
        cred, known = self._configured(authorization)
        if not cred:
            return known
        # Why before the lookup: a throttled client must not learn that a guess was right
        self.failures.check(client)
        if known is not None:
            return known
        if self.kube is None:
            self.failures.failed(client)
            return None
        hit, answer = self.kube.cached(cred)
        if not hit:
            answer = await self._review(cred)
        if answer is None:
            self.failures.failed(client)
        return answer

    async def _review(self, cred: str) -> Identity | None:
        assert self.kube is not None
        if self._reviews_waiting >= 4 * self.max_reviews:
            raise ReviewsBusy("too many credentials are being checked at once; retry later")
        if self._review_pool is None:
            self._review_pool = ThreadPoolExecutor(self.max_reviews, thread_name_prefix="runbook-tokenreview")
        self._reviews_waiting += 1
        self.reviews_asked += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._review_pool, self.kube.identify, cred)
        finally:
            self._reviews_waiting -= 1

    def close(self) -> None:
        """Stop the reviews' threads (the server's shutdown)."""
        if self._review_pool is not None:
            self._review_pool.shutdown(wait=False, cancel_futures=True)

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
