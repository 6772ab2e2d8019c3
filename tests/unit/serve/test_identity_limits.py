"""Identity in cluster mode, #25 items 5-7, over our own fake reviewer (the real API server's answers,
audiences included, are in tests/integration/test_kube_identity.py): TokenReview is asked only where a
person can be (never on a sender endpoint), by a small pool of its own (a flood of made-up tokens
holds at most ``max_concurrent_reviews`` threads), unknown credentials are throttled per client, and
the review names runbook's audience, which the answer must confirm."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.connectors.base import AccessReviewResult, TokenReviewResult
from engine.serve.access import FailureThrottle, TooManyFailures
from engine.serve.kube_identity import DEFAULT_AUDIENCE, KubeIdentity
from tests.fakes import alert, served


class SlowReviews:
    """TokenReviews that wait for ``release`` (an API server under load); counts those in flight."""

    def __init__(self, users: Mapping[str, str] | None = None, *, echo_audiences: bool = True) -> None:
        self.users = dict(users or {})
        self.echo = echo_audiences
        self.release = threading.Event()
        self.release.set()
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most = 0
        self.tokens: list[str] = []
        self.audiences: list[tuple[str, ...]] = []

    def review_token(self, token: str, audiences: Sequence[str] = ()) -> TokenReviewResult:
        with self.lock:
            self.tokens.append(token)
            self.audiences.append(tuple(audiences))
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        try:
            self.release.wait(10)
            user = self.users.get(token)
            return TokenReviewResult(authenticated=user is not None, username=user or "",
                                     audiences=tuple(audiences) if self.echo else ())
        finally:
            with self.lock:
                self.in_flight -= 1

    def review_access(self, *, user: str, groups: Sequence[str], uid: str, extra: Mapping[str, Sequence[str]],
                      verb: str, resource: str, group: str, namespace: str) -> AccessReviewResult:
        return AccessReviewResult(allowed=True)


def _bearer() -> dict[str, str]:
    return {"Authorization": f"Bearer {secrets.token_urlsafe(24)}"}


def test_a_sender_endpoint_never_sends_a_bearer_token_to_the_api_server() -> None:
    fake = SlowReviews()
    with served(identity=KubeIdentity(lambda: fake, "runbook-system", cache_seconds=0)) as s:
        for _ in range(30):
            assert s.post_alerts(alert("omen2"), headers=_bearer()).status_code == 401
        assert s.post_alerts(alert("omen2")).status_code == 202  # the configured sender still works
    assert fake.tokens == []  # today's code asked a TokenReview for each of the 30


def test_concurrent_token_reviews_are_capped_by_their_own_small_pool_and_an_overflow_is_refused_503() -> None:
    fake = SlowReviews()
    fake.release.clear()  # every review hangs until released: the requests pile up
    ident = KubeIdentity(lambda: fake, "runbook-system", cache_seconds=0)
    with served(identity=ident, auth={"kubernetes": {"max_concurrent_reviews": 3},
                                      "failures_per_minute": 1000}) as s:

        def reset() -> int:
            # each request from its own "client" address is not what the throttle is about here
            return s.client.post("/breaker/reset", json={}, headers=_bearer()).status_code

        with ThreadPoolExecutor(24) as pool:
            answers = [pool.submit(reset) for _ in range(24)]
            for _ in range(1500):  # until every request is held (3 reviewing, 12 queued) or refused
                if fake.in_flight >= 3 and s.client.app.state.handlers.access._reviews_waiting >= 12 and \
                        sum(a.done() for a in answers) >= 24 - 12 - 3:
                    break
                threading.Event().wait(0.02)
            assert fake.in_flight == 3  # no more than the pool's size, though 24 wait
            fake.release.set()
            codes = sorted(a.result() for a in answers)
        assert fake.most == 3, f"{fake.most} TokenReviews at once (today: one per request, up to 24)"
        assert set(codes) <= {401, 503} and 503 in codes, codes  # beyond 4 x 3 waiting: refused at once
        assert codes.count(401) <= 12 + 3


def test_unknown_credentials_are_throttled_per_client_before_the_api_server_is_asked() -> None:
    fake = SlowReviews()
    with served(identity=KubeIdentity(lambda: fake, "runbook-system", cache_seconds=0),
                auth={"failures_per_minute": 5}) as s:
        codes = [s.client.post("/breaker/reset", json={}, headers=_bearer()).status_code for _ in range(12)]
        assert codes == [401] * 5 + [429] * 7, codes  # today: twelve 401s, twelve TokenReviews
        refused = s.client.post("/breaker/reset", json={}, headers=_bearer())
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert len(fake.tokens) == 5


def test_the_failure_throttle_refills_and_forgets_the_least_recent_clients() -> None:
    now = [0.0]
    throttle = FailureThrottle(6, burst=2, max_clients=2, clock=lambda: now[0])
    throttle.failed("a")
    throttle.failed("a")
    with pytest.raises(TooManyFailures):
        throttle.check("a")
    throttle.check("b")  # another client is not held by a's failures
    now[0] += 10.0  # 6 a minute: one failure back after 10 s
    throttle.check("a")
    throttle.failed("b")
    throttle.failed("c")
    assert list(throttle._buckets) == ["b", "c"]  # bounded memory


def test_token_review_names_runbooks_audience_and_an_answer_that_does_not_confirm_it_is_no_identity() -> None:
    users = {"t-runbook": "alice"}
    confirming = SlowReviews(users)
    ident = KubeIdentity(lambda: confirming, "runbook-system", cache_seconds=0)
    assert ident.audiences == (DEFAULT_AUDIENCE,) == ("runbook",)
    assert ident.identify("t-runbook") is not None
    assert confirming.audiences == [("runbook",)]
    # an authenticator that ignored the audience (status.audiences without it): not a login here
    ignoring = SlowReviews(users, echo_audiences=False)
    assert KubeIdentity(lambda: ignoring, "runbook-system", cache_seconds=0).identify("t-runbook") is None
    # the operator's opt-in (auth.kubernetes.api_server_audience): no audience asked, none required
    assert KubeIdentity(lambda: ignoring, "runbook-system", audiences=()).identify("t-runbook") is not None
    assert ignoring.audiences[-1] == ()


def test_the_audience_settings_are_validated() -> None:
    from engine.errors import UsageError
    from engine.serve.config import load_config

    assert load_config(None, env={}).auth.kubernetes.audiences == ("runbook",)
    custom = load_config(None, env={}, overrides={"auth": {"kubernetes": {"audiences": ["runbook.example.org"]}}})
    assert custom.auth.kubernetes.audiences == ("runbook.example.org",)
    with pytest.raises(UsageError, match="audiences"):
        load_config(None, env={}, overrides={"auth": {"kubernetes": {"audiences": []}}})
