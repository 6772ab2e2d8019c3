"""The node Lease against the real 1.20 API server: skewed clocks, take-over, fencing, renewal faults
(issue 14, items 13-15). Two engines are two ``KubeConnector`` instances with their own clocks."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from engine.connectors.base import LeaseRecord
from engine.connectors.kube import KubeConnector
from engine.errors import KubeError, LockHeld, LockLost
from engine.lab.controlplane import ControlPlane
from engine.locks import acquire_node_lock, lease_name

pytestmark = pytest.mark.integration

NS = "kube-node-lease"


@pytest.fixture
def plane(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    yield control_plane
    kube = KubeConnector(kubeconfig=str(control_plane.kubeconfig))
    for node in ("skew", "fence", "flaky"):
        lease = kube.read_lease(NS, lease_name(node))
        if lease is not None:
            kube.delete_lease(lease)


def connector(plane: ControlPlane, skew: float = 0.0) -> KubeConnector:
    return KubeConnector(kubeconfig=str(plane.kubeconfig), clock=lambda: time.time() + skew)


def test_a_contender_200s_ahead_cannot_take_a_live_lease_and_takes_an_abandoned_one_after_its_ttl(
        plane: ControlPlane) -> None:
    holder = connector(plane)
    ahead = connector(plane, skew=200.0)  # stamps and judges with a wall clock 200 s ahead
    held = acquire_node_lock(holder, "skew", "r-live", namespace=NS, ttl=3)
    time.sleep(1)
    held.renew_once()  # renewed "now" (by the holder's clock)
    with pytest.raises(LockHeld, match="runbook/r-live"):
        acquire_node_lock(ahead, "skew", "r-ahead", namespace=NS, ttl=3, wait=0,
                          wall=lambda: time.time() + 200)
    # the holder keeps renewing (its thread: every 1 s): the contender waits 6 s and never gets it
    held.start_renewing()
    with pytest.raises(LockHeld):
        acquire_node_lock(ahead, "skew", "r-ahead", namespace=NS, ttl=3, wait=6)
    # the holder dies (renewals stop without a release): taken after ~3 s of observation
    assert held._stop is not None
    held._stop.set()
    start = time.monotonic()
    taken = acquire_node_lock(ahead, "skew", "r-ahead", namespace=NS, ttl=3, wait=30)
    assert 2.5 <= time.monotonic() - start <= 8
    assert taken.lease.holder == "runbook/r-ahead" and taken.lease.transitions == 1
    taken.release()


def test_a_stale_holder_is_fenced_by_the_real_lease_transitions(plane: ControlPlane) -> None:
    first = connector(plane)
    other = connector(plane)
    stale = acquire_node_lock(first, "fence", "r-1", namespace=NS, ttl=3)
    token = stale.fence()
    assert token["holder"] == "runbook/r-1" and token["transitions"] == 0
    told: list[str] = []
    stale.on_lost = told.append
    # its renewals stop (say the engine froze); another engine observes the Lease for its TTL and takes it
    new = acquire_node_lock(other, "fence", "r-2", namespace=NS, ttl=3, wait=30)
    assert new.lease.transitions == 1
    with pytest.raises(LockLost, match="now held by runbook/r-2"):
        stale.fence()
    assert told == ["runbook/r-2"]
    assert new.fence()["transitions"] == 1
    stale.release()  # never deletes the new holder's Lease
    assert other.read_lease(NS, lease_name("fence")) is not None
    new.release()
    assert other.read_lease(NS, lease_name("fence")) is None


class ReadsFailAfterConflict(KubeConnector):
    """The real connector, whose Lease re-reads fail once armed (the API going away mid-409)."""

    armed = False

    def read_lease(self, namespace: str, name: str) -> LeaseRecord | None:
        if self.armed:
            raise KubeError("connection refused (injected)", retryable=True)
        return super().read_lease(namespace, name)


def test_a_real_409_whose_re_read_fails_ends_the_renewal_thread_lost_not_silently(plane: ControlPlane) -> None:
    flaky = ReadsFailAfterConflict(kubeconfig=str(plane.kubeconfig))
    lock = acquire_node_lock(flaky, "flaky", "r-1", namespace=NS, ttl=3)
    lost = threading.Event()
    lock.on_lost = lambda holder: lost.set()
    # someone writes the Lease behind our back: our next renewal gets a real 409
    other = connector(plane)
    cur: Any = other.read_lease(NS, lease_name("flaky"))
    other.update_lease(cur, "runbook/r-1", 3, acquire=False)
    flaky.armed = True
    lock.start_renewing()
    assert lost.wait(15), "the renewal thread must end lost, not die"
    assert "409 on renewal, then the re-read failed" in lock.lost_reason
    flaky.armed = False
    lock.release()
