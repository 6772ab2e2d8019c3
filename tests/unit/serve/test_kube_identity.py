"""engine.serve.kube_identity over our own fake reviewer (the real API server's answers are tested in
tests/integration/test_kube_identity.py): roles from the verbs allowed, the cache and its bounds,
what is never sent to the API server, and failing closed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from engine.connectors.base import AccessReviewResult, TokenReviewResult
from engine.errors import Forbidden, KubeError
from engine.serve.access import Identity
from engine.serve.kube_identity import MAX_TOKEN_BYTES, IdentityUnavailable, KubeIdentity


class FakeReviews:
    """Tokens -> users, (user, verb, namespace) -> allowed; every review asked is recorded."""

    def __init__(self, users: Mapping[str, str], grants: set[tuple[str, str, str]]) -> None:
        self.users, self.grants = dict(users), set(grants)
        self.asked: list[tuple[str, ...]] = []
        self.fail: KubeError | None = None

    def review_token(self, token: str, audiences: Sequence[str] = ()) -> TokenReviewResult:
        self.asked.append(("token", token))
        if self.fail:
            raise self.fail
        user = self.users.get(token)
        return TokenReviewResult(authenticated=user is not None, username=user or "", groups=("system:authenticated",),
                                 audiences=tuple(audiences))

    def review_access(self, *, user: str, groups: Sequence[str], uid: str, extra: Mapping[str, Sequence[str]],
                      verb: str, resource: str, group: str, namespace: str) -> AccessReviewResult:
        self.asked.append(("access", user, verb, resource, group, namespace))
        return AccessReviewResult(allowed=(user, verb, namespace) in self.grants)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _identity(fake: FakeReviews, clock: Clock | None = None, cache: float = 10.0) -> KubeIdentity:
    return KubeIdentity(lambda: fake, "runbook-system", cache_seconds=cache, clock=clock or Clock())


def test_approve_makes_an_approver_get_and_list_a_reader_and_each_review_names_remediationruns_in_the_namespace(
        ) -> None:
    fake = FakeReviews({"t-a": "alice", "t-r": "rita", "t-g": "gus"},
                       {("alice", "approve", "runbook-system"), ("rita", "get", "runbook-system"),
                        ("rita", "list", "runbook-system"), ("gus", "get", "runbook-system"),
                        ("gus", "approve", "elsewhere")})
    ident = _identity(fake)
    assert ident.identify("t-a") == Identity("alice", "approver")
    assert ident.identify("t-r") == Identity("rita", "reader")
    assert ident.identify("t-g") == Identity("gus", "none")  # get without list; approve elsewhere
    assert ident.identify("t-unknown") is None
    assert {a[3:] for a in fake.asked if a[0] == "access"} == {("remediationruns", "runbook.io", "runbook-system")}


def test_answers_are_cached_per_token_and_a_rejected_token_for_two_seconds_at_most() -> None:
    fake = FakeReviews({"t-a": "alice"}, {("alice", "approve", "runbook-system")})
    clock = Clock()
    ident = _identity(fake, clock, cache=10.0)
    for _ in range(3):
        assert ident.identify("t-a") == Identity("alice", "approver")
        assert ident.identify("t-x") is None
    assert len(fake.asked) == 3  # alice: token + approve; t-x: token
    clock.now += 2.5
    ident.identify("t-a")
    ident.identify("t-x")
    assert len(fake.asked) == 4  # the rejection expired, alice's answer did not
    clock.now += 8.0
    ident.identify("t-a")
    assert len(fake.asked) == 6


def test_a_token_too_long_or_with_whitespace_is_never_sent_to_the_api_server() -> None:
    fake = FakeReviews({}, set())
    ident = _identity(fake)
    for token in ("x" * (MAX_TOKEN_BYTES + 1), "two words", "line\nbreak", "", "   "):
        assert ident.identify(token) is None
    assert fake.asked == []


def test_an_api_server_that_cannot_answer_fails_closed_and_the_failure_is_not_cached() -> None:
    fake = FakeReviews({"t-a": "alice"}, {("alice", "approve", "runbook-system")})
    ident = _identity(fake)
    fake.fail = Forbidden("create tokenreview: forbidden", status=403)
    with pytest.raises(IdentityUnavailable, match="system:auth-delegator"):
        ident.identify("t-a")
    fake.fail = KubeError("create tokenreview: API server unreachable", retryable=True)
    with pytest.raises(IdentityUnavailable, match="unreachable"):
        ident.identify("t-a")
    fake.fail = None
    assert ident.identify("t-a") == Identity("alice", "approver")


def test_a_connector_that_cannot_be_built_fails_closed() -> None:
    def broken() -> FakeReviews:
        raise KubeError("cannot load the default kubeconfig")

    with pytest.raises(IdentityUnavailable, match="cannot load the default kubeconfig"):
        KubeIdentity(broken, "runbook-system").identify("t-a")
