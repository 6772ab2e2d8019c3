"""One remediation per node: the node Lease is taken, renewed, released, recognised or waited out."""

from __future__ import annotations

import pytest

from engine.errors import KubeError, LockHeld
from engine.locks import DEFAULT_NAMESPACE, acquire_node_lock, holder_for, lease_name
from tests.fakes import FakeClock, FakeKube

KEY = (DEFAULT_NAMESPACE, lease_name("omen2"))


def _kube() -> tuple[FakeClock, FakeKube]:
    clock = FakeClock()
    return clock, FakeKube(clock=clock)


def test_a_free_node_is_locked_for_the_run_and_released_at_the_end() -> None:
    clock, kube = _kube()
    lock = acquire_node_lock(kube, "omen2", "r-1", ttl=120, clock=clock.wall, sleep=clock.sleep)
    assert kube.leases[KEY].holder == holder_for("r-1") == "runbook/r-1"
    assert kube.leases[KEY].duration_seconds == 120
    lock.release()
    lock.release()  # idempotent
    assert KEY not in kube.leases


def test_another_runs_live_lease_blocks_naming_its_holder() -> None:
    clock, kube = _kube()
    acquire_node_lock(kube, "omen2", "r-dead", ttl=120, clock=clock.wall, sleep=clock.sleep)
    clock.sleep(30)
    with pytest.raises(LockHeld, match=r"runbook/r-dead .*renewed 30s ago, TTL 120s"):
        acquire_node_lock(kube, "omen2", "r-new", clock=clock.now, sleep=clock.sleep, wall=clock.wall)
    assert kube.leases[KEY].holder == "runbook/r-dead"


def test_the_same_run_id_takes_over_its_own_live_lease_at_once() -> None:
    """A resumed run recognises the Lease its dead engine took (no waiting out the TTL)."""
    clock, kube = _kube()
    acquire_node_lock(kube, "omen2", "r-1", ttl=120, clock=clock.wall, sleep=clock.sleep)  # then the engine died
    clock.sleep(5)
    lock = acquire_node_lock(kube, "omen2", "r-1", ttl=120, clock=clock.wall, sleep=clock.sleep)
    assert lock.lease.holder == "runbook/r-1" and lock.lease.renew_time == clock.wall()
    assert clock.sleeps == [5]  # no waiting


def test_a_dead_runs_lease_is_waited_out_until_its_ttl_expires() -> None:
    clock, kube = _kube()
    acquire_node_lock(kube, "omen2", "r-dead", ttl=60, clock=clock.wall, sleep=clock.sleep)  # never renewed
    start = clock.now()
    lock = acquire_node_lock(kube, "omen2", "r-new", wait=120, clock=clock.wall, sleep=clock.sleep)
    assert lock.lease.holder == "runbook/r-new"
    assert 60 <= clock.now() - start <= 62


def test_waiting_gives_up_at_the_deadline_when_the_holder_keeps_renewing() -> None:
    clock, kube = _kube()
    held = acquire_node_lock(kube, "omen2", "r-alive", ttl=60, clock=clock.wall, sleep=clock.sleep)

    def renew() -> None:
        held.lease = kube.update_lease(held.lease, "runbook/r-alive", 60, acquire=False)
        clock.after(10, renew)

    clock.after(10, renew)
    with pytest.raises(LockHeld, match="r-alive"):
        acquire_node_lock(kube, "omen2", "r-new", wait=90, clock=clock.wall, sleep=clock.sleep)
    assert kube.leases[KEY].holder == "runbook/r-alive"


def test_an_unreadable_lease_counts_as_held_fail_closed() -> None:
    clock, kube = _kube()

    def down(namespace: str, name: str) -> None:
        raise KubeError("API server unreachable", retryable=True)

    kube.read_lease = down  # type: ignore[method-assign,assignment]
    with pytest.raises(LockHeld, match="cannot read Lease"):
        acquire_node_lock(kube, "omen2", "r-1", clock=clock.wall, sleep=clock.sleep)


def test_a_release_that_cannot_reach_the_api_leaves_the_lease_to_its_ttl() -> None:
    clock, kube = _kube()
    lock = acquire_node_lock(kube, "omen2", "r-1", clock=clock.wall, sleep=clock.sleep)

    def down(namespace: str, name: str) -> None:
        raise KubeError("API server unreachable", retryable=True)

    kube.read_lease = down  # type: ignore[method-assign,assignment]
    lock.release()  # never raises: a finished run does not fail over its lock
    assert kube.leases[KEY].holder == "runbook/r-1"


def test_a_lease_taken_by_someone_else_is_never_deleted_by_our_release() -> None:
    clock, kube = _kube()
    lock = acquire_node_lock(kube, "omen2", "r-1", ttl=30, clock=clock.wall, sleep=clock.sleep)
    clock.sleep(31)  # our renewals stopped (API outage); the TTL ran out and another run took the node
    acquire_node_lock(kube, "omen2", "r-2", wait=40, clock=clock.wall, sleep=clock.sleep)
    lock.release()
    assert kube.leases[KEY].holder == "runbook/r-2"


def test_a_run_whose_lease_was_taken_over_is_told_to_stop() -> None:
    """Renewals failed past the TTL and another run took the node: the holder learns it."""
    import threading

    clock, kube = _kube()
    lock = acquire_node_lock(kube, "omen2", "r-1", ttl=3, clock=clock.wall, sleep=clock.sleep)
    told: list[str] = []
    stopped = threading.Event()
    lock.on_lost = lambda holder: (told.append(holder), stopped.set())
    clock.sleep(10)
    acquire_node_lock(kube, "omen2", "r-2", wait=10, clock=clock.wall, sleep=clock.sleep)
    lock.start_renewing()  # its first renewal (after TTL/3, at least 1 s) meets the other holder
    assert stopped.wait(10)
    assert told == ["runbook/r-2"] and lock.lost == "runbook/r-2"
    lock.release()
    assert kube.leases[KEY].holder == "runbook/r-2"
