"""Kubernetes identity for ``runbook serve`` (``auth.mode: kubernetes``): who a bearer token is, and
what RBAC lets them do with runs.

A token (a ServiceAccount's from TokenRequest, or a user's from the cluster's authenticator) is
checked with a **TokenReview**: the API server says whose it is (username, uid, groups). Then
**SubjectAccessReviews** ask what that user may do with ``remediationruns`` (group ``runbook.io``) in
the store namespace:

* verb ``approve`` allowed -> role ``approver`` (approves runs under the TokenReview username);
* else ``get`` and ``list`` allowed -> role ``reader``;
* else role ``none`` (authenticated, may do nothing here).

The TokenReview names an audience: ``runbook`` by default (``auth.kubernetes.audiences``), and the
answer's ``status.audiences`` must contain it. A token made for the API server alone (a kubeconfig's,
``kubectl create token`` without ``--audience``) is therefore not a login here; a person presents a
token made for runbook (``kubectl create token NAME --audience runbook``). An operator who wants the
API server's own tokens accepted sets ``auth.kubernetes.api_server_audience: true`` (the review then
names no audience, so the API server's own apply: ``audiences=()`` here).

So granting or revoking approval is an RBAC change (a Role with ``verbs: [approve]`` and a binding),
never a change of runbook's configuration. Answers are cached per token for ``cache_seconds`` (a
revoked binding takes effect within that time); a token the API server does not authenticate is
cached too, for at most 2 s. The server's own identity needs ClusterRole ``system:auth-delegator``
(create tokenreviews and subjectaccessreviews).

Fails closed: when the API server cannot be asked (unreachable, or our identity may not create
reviews), ``IdentityUnavailable`` is raised and the caller refuses the request (503); nothing is
ever allowed on an unanswered question. The reviews go through ``engine.connectors.kube`` (this
module never imports ``kubernetes``); it decides identities only, never reads bodies or starts runs.

API (stable; ``engine.serve.access.Access`` uses it, cluster mode reuses it)::

    ident = KubeIdentity(lambda: connector, "runbook-system", cache_seconds=10)  # built on first use
    ident.identify(token) -> Identity | None       # role approver | reader | none; None: not a valid token
    ident.authenticate(token) -> KubeUser | None   # TokenReview only (name, uid, groups, extra)
    ident.allowed(user, verb) -> bool              # one SubjectAccessReview (not cached)
    ident.role_of(user) -> Identity                # the SubjectAccessReviews of identify
    ident.forget()                                 # drop the cache
    # all raise IdentityUnavailable when the API server cannot answer (fail closed)
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from engine.connectors.base import KubeReviews
from engine.errors import Forbidden, KubeError
from engine.serve.access import Identity

GROUP = "runbook.io"
RESOURCE = "remediationruns"
APPROVE_VERB = "approve"
READ_VERBS = ("get", "list")
DEFAULT_AUDIENCE = "runbook"  # the audience a person's token must carry (auth.kubernetes.audiences)
MAX_TOKEN_BYTES = 8192  # longer is not a token any authenticator issues: refused without asking
_NEGATIVE_SECONDS = 2.0


class IdentityUnavailable(Exception):
    """The API server could not be asked who a caller is or what they may do: refuse (fail closed)."""


@dataclass(frozen=True)
class KubeUser:
    """A caller as TokenReview names them."""

    name: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


class KubeIdentity:
    """Tokens -> identities with a role, through TokenReview and SubjectAccessReview (thread-safe)."""

    def __init__(self, reviews: Callable[[], KubeReviews], namespace: str, *,
                 cache_seconds: float = 10.0, audiences: Sequence[str] = (DEFAULT_AUDIENCE,), max_cached: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``reviews`` builds the connector on first use (``Settings.kube``, or ``lambda: connector``).
        ``audiences``: those the TokenReview names, one of which the answer must confirm; empty: the
        API server's own (its tokens are accepted: ``auth.kubernetes.api_server_audience``)."""
        self._factory = reviews
        self._reviews: KubeReviews | None = None
        self.namespace = namespace
        self.cache_seconds = cache_seconds
        self.audiences = tuple(audiences)
        self._max = max_cached
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, tuple[float, Identity | None]] = OrderedDict()

    def _api(self) -> KubeReviews:
        if self._reviews is None:
            try:
                self._reviews = self._factory()
            except Exception as e:  # a connector that cannot even be built: fail closed
                raise IdentityUnavailable(f"cannot reach the Kubernetes API to check credentials: {e}") from e
        return self._reviews

    @staticmethod
    def _unavailable(e: KubeError, what: str) -> IdentityUnavailable:
        if isinstance(e, Forbidden):
            return IdentityUnavailable(
                f"cannot check credentials: runbook's own identity may not create {what} (bind it to "
                f"ClusterRole system:auth-delegator): {e}")
        return IdentityUnavailable(f"cannot check credentials with the Kubernetes API ({what}): {e}")

    def authenticate(self, token: str) -> KubeUser | None:
        """TokenReview: the user ``token`` belongs to, or None when the API server does not know it."""
        token = token.strip()
        if not token or len(token.encode("utf-8", "replace")) > MAX_TOKEN_BYTES or any(c.isspace() for c in token):
            return None
        try:
            review = self._api().review_token(token, self.audiences)
        except KubeError as e:
            raise self._unavailable(e, "tokenreviews") from e
        if not review.authenticated or not review.username:
            return None
        if self.audiences and not set(self.audiences) & set(review.audiences):
            # Why: an authenticator that ignored the audiences asked for must not make a token meant
            # for another service (the API server) a login here
            return None
        return KubeUser(review.username, review.uid, review.groups, review.extra)

    def allowed(self, user: KubeUser, verb: str) -> bool:
        """SubjectAccessReview: may ``user`` ``verb`` remediationruns.runbook.io in the namespace."""
        try:
            result = self._api().review_access(user=user.name, groups=user.groups, uid=user.uid, extra=user.extra,
                                               verb=verb, resource=RESOURCE, group=GROUP, namespace=self.namespace)
        except KubeError as e:
            raise self._unavailable(e, "subjectaccessreviews") from e
        return result.allowed and not result.denied

    def role_of(self, user: KubeUser) -> Identity:
        if self.allowed(user, APPROVE_VERB):
            return Identity(user.name, "approver")
        if all(self.allowed(user, verb) for verb in READ_VERBS):
            return Identity(user.name, "reader")
        return Identity(user.name, "none")

    def identify(self, token: str) -> Identity | None:
        """The identity and role of ``token``'s owner (cached), None for a token that is not valid.

        Raises ``IdentityUnavailable`` when the API server cannot answer."""
        key = hashlib.sha256(token.encode("utf-8", "replace")).digest()
        now = self._clock()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] > now:
                return hit[1]
        user = self.authenticate(token)
        ident = self.role_of(user) if user is not None else None
        ttl = self.cache_seconds if ident is not None else min(self.cache_seconds, _NEGATIVE_SECONDS)
        if ttl > 0:
            with self._lock:
                self._cache[key] = (now + ttl, ident)
                self._cache.move_to_end(key)
                while len(self._cache) > self._max:
                    self._cache.popitem(last=False)
        return ident

    def cached(self, token: str) -> tuple[bool, Identity | None]:
        """(True, the answer) when ``token``'s answer is cached and fresh; never asks the API server
        (cheap: the event loop uses it before handing a review to its own small thread pool)."""
        key = hashlib.sha256(token.encode("utf-8", "replace")).digest()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] > self._clock():
                return True, hit[1]
        return False, None

    def forget(self) -> None:
        """Drop every cached answer (the next request asks the API server again)."""
        with self._lock:
            self._cache.clear()
