"""Leader election of ``runbook serve`` replicas on the real 1.20 API server (issue 15): the Lease
``runbook-serve`` in the store namespace, one leader among replicas, a take-over only after the leader
stopped renewing (observed-time expiry: a leader whose clock is 200 s behind keeps its Lease), an
immediate hand-over when the leader stops cleanly, and ``/readyz`` naming each replica's role."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from engine.connectors.kube import KubeConnector
from engine.lab.controlplane import ControlPlane
from engine.serve.leader import LEASE_NAME, LeaderElector
from tests.fakes import FakeRunStarter, served, trigger_spec

pytestmark = pytest.mark.integration

NS = "runbook-system"


@pytest.fixture(scope="module")
def plane(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    from kubernetes import client

    with control_plane.new_api_client() as api:
        core = client.CoreV1Api(api)
        if NS not in {n.metadata.name for n in core.list_namespace().items}:
            core.create_namespace({"metadata": {"name": NS}})
    yield control_plane


@pytest.fixture
def kube(plane: ControlPlane) -> Iterator[KubeConnector]:
    kube = KubeConnector(kubeconfig=str(plane.kubeconfig))
    yield kube
    lease = kube.read_lease(NS, LEASE_NAME)
    if lease is not None:
        kube.delete_lease(lease)


def elector(plane: ControlPlane, name: str, *, ttl: int = 3, skew: float = 0.0) -> LeaderElector:
    conn = KubeConnector(kubeconfig=str(plane.kubeconfig), clock=lambda: time.time() + skew)
    return LeaderElector(lambda: conn, namespace=NS, identity=name, ttl=ttl, retry=0.3)


def until(predicate: Callable[[], bool], timeout: float) -> float:
    """Seconds it took ``predicate`` to hold; fails after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.05)
    return time.monotonic() - start


def test_one_replica_leads_and_the_other_follows_naming_the_leader(plane: ControlPlane, kube: KubeConnector) -> None:
    a, b = elector(plane, "replica-a"), elector(plane, "replica-b")
    a.start()
    b.start()
    try:
        until(lambda: a.is_leader() or b.is_leader(), 10)
        time.sleep(2)  # several retry periods: still exactly one
        assert a.is_leader() != b.is_leader()
        leader, follower = (a, b) if a.is_leader() else (b, a)
        assert follower.describe() | {"role": "follower", "leader": leader.identity} == follower.describe()
        lease = kube.read_lease(NS, LEASE_NAME)
        assert lease is not None and lease.holder == leader.identity and lease.duration_seconds == 3
    finally:
        a.stop()
        b.stop()


def test_a_follower_takes_over_only_after_observing_the_silent_leader_for_a_ttl(
        plane: ControlPlane, kube: KubeConnector) -> None:
    leader = elector(plane, "replica-a", skew=-200.0)  # stamps renewTime 200 s in the past
    assert leader.try_once()
    ahead = elector(plane, "replica-b")
    ahead.start()
    try:
        time.sleep(4)  # over a TTL of 3 s while the leader renews (every 1 s): never taken
        assert leader.is_leader() and not ahead.is_leader()
        held = leader._held
        assert held is not None and held._stop is not None
        held._stop.set()  # the leader freezes: its renewals stop, nothing is released (kill -9)
        took = until(ahead.is_leader, 15)
        assert 2.0 <= took <= 9.0  # ~TTL of observation (+ a retry period), never at once
        lease = kube.read_lease(NS, LEASE_NAME)
        assert lease is not None and lease.holder == "replica-b" and lease.transitions == 1
        # the frozen leader's fence now refuses: it would do no singleton duty if it woke up
        assert held.lost is None
        with pytest.raises(Exception, match="now held by replica-b"):
            held.fence()
        assert not leader.is_leader()
    finally:
        ahead.stop()


def test_a_leader_that_stops_cleanly_hands_over_within_a_retry_period(plane: ControlPlane, kube: KubeConnector) -> None:
    a, b = elector(plane, "replica-a", ttl=10), elector(plane, "replica-b", ttl=10)
    assert a.try_once()
    b.start()
    try:
        time.sleep(1)
        assert not b.is_leader()
        a.stop()  # holder emptied: no TTL to wait out
        assert until(b.is_leader, 5) < 3.0
        assert not a.is_leader()
    finally:
        b.stop()


def test_readyz_of_two_replicas_says_which_leads_and_the_follower_leads_when_the_leader_stops(
        plane: ControlPlane, kube: KubeConnector) -> None:
    def starter() -> FakeRunStarter:
        return FakeRunStarter([trigger_spec(mode="auto", matchers=('node=~"omen.*"',))])

    a, b = elector(plane, "replica-a"), elector(plane, "replica-b")
    replica_a = served(starter=starter(), elector=a)
    sa = replica_a.__enter__()
    a_running = True
    try:
        with served(starter=starter(), elector=b) as sb:
            ra, rb = sa.client.get("/readyz"), sb.client.get("/readyz")
            assert ra.status_code == rb.status_code == 200
            assert ra.json()["role"] == "leader" and ra.json()["store"] == "ok"
            assert rb.json()["role"] == "follower" and rb.json()["leader"] == "replica-a"
            assert sb.client.get("/healthz").json()["role"] == "follower"
            a_running = False
            replica_a.__exit__(None, None, None)  # replica a shuts down (lifespan end: Lease given up)
            until(lambda: sb.client.get("/readyz").json()["role"] == "leader", 5)
    finally:
        if a_running:
            replica_a.__exit__(None, None, None)
    lease = kube.read_lease(NS, LEASE_NAME)
    assert lease is not None and lease.holder == ""  # b gave it up in turn
