"""The node Lease under faults: renewal never dies silently, expiry ignores clock skew, stale holders
are fenced (issue 14, items 13-15).

Renewal errors are injected into our own fake Kubernetes connector (``FlakyKube``); time is a
``FakeClock`` except in the two tests that run the real renewal thread (TTL 3 s).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import pytest

from engine.connectors.base import LeaseRecord
from engine.errors import Conflict, KubeError, LockHeld, LockLost
from engine.locks import DEFAULT_NAMESPACE, NodeLock, acquire_node_lock, holder_for, lease_name
from engine.model import RunState, StepStatus
from tests.fakes import FakeClock, FakeKube, FakeNodes
from tests.unit.test_journal import World, world  # noqa: F401  (the fixture: a flagship run on fakes)

KEY = (DEFAULT_NAMESPACE, lease_name("omen2"))


class FlakyKube(FakeKube):
    """FakeKube whose Lease calls raise the scripted exceptions first (one per call, in order)."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock=clock)
        self.update_errors: list[BaseException] = []
        self.read_errors: list[BaseException] = []
        self.fail_updates_forever: BaseException | None = None

    def update_lease(self, lease: LeaseRecord, holder: str, duration_seconds: int, *, acquire: bool) -> LeaseRecord:
        if self.fail_updates_forever is not None:
            raise self.fail_updates_forever
        if self.update_errors:
            raise self.update_errors.pop(0)
        return super().update_lease(lease, holder, duration_seconds, acquire=acquire)

    def read_lease(self, namespace: str, name: str) -> LeaseRecord | None:
        if self.read_errors:
            raise self.read_errors.pop(0)
        return super().read_lease(namespace, name)


def held(ttl: int = 120) -> tuple[FakeClock, FlakyKube, NodeLock, list[str]]:
    clock = FakeClock()
    kube = FlakyKube(clock)
    lock = acquire_node_lock(kube, "omen2", "r-1", ttl=ttl, clock=clock.now, sleep=clock.sleep, wall=clock.wall)
    told: list[str] = []
    lock.on_lost = told.append
    return clock, kube, lock, told


def take_over(kube: FakeKube, run: str = "r-2") -> None:
    """Another run's engine takes the Lease (what acquire_node_lock does once it may)."""
    cur = kube.leases[KEY]
    kube.update_lease(cur, holder_for(run), cur.duration_seconds, acquire=True)


API_AWAY = KubeError("API server unreachable", retryable=True)
CONFLICT = Conflict("stale lease", status=409)


# -- 13. renewal ends renewed or lost, whatever the error ----------------------------------------------

@pytest.mark.parametrize("error", [API_AWAY, KubeError("500 etcd timeout", status=500), ValueError("bad renewTime"),
                                   TypeError("None is not a mapping")], ids=["unreachable", "500", "value", "type"])
def test_a_renewal_error_is_retried_and_a_later_success_keeps_the_lease(error: BaseException) -> None:
    clock, kube, lock, told = held()
    kube.update_errors = [error, error]
    assert lock.renew_once() is False and lock.lost is None
    clock.sleep(20)
    assert lock.renew_once() is False and lock.lost is None  # 20 s of 80 s renew deadline
    rv = kube.leases[KEY].resource_version
    assert lock.renew_once() is True
    assert kube.leases[KEY].resource_version != rv and lock.lost is None and told == []
    assert lock.fence()["holder"] == "runbook/r-1"


@pytest.mark.parametrize("error", [API_AWAY, ValueError("bad renewTime")], ids=["unreachable", "unexpected"])
def test_renewals_failing_until_the_renew_deadline_lose_the_lease_before_anyone_may_take_it(
        error: BaseException) -> None:
    clock, kube, lock, told = held(ttl=120)
    kube.fail_updates_forever = error
    clock.sleep(79)
    assert lock.renew_once() is False and lock.lost is None
    clock.sleep(1)  # 80 s = 2/3 of the TTL since the last renewal: a contender needs 120 s of observation
    assert lock.renew_once() is False
    assert lock.lost == "(unknown)" and told == ["(unknown)"]
    assert "not renewed for 80s" in lock.lost_reason and type(error).__name__ in lock.lost_reason
    with pytest.raises(LockLost, match="no longer holds its Lease"):
        lock.fence()


def test_a_conflict_whose_re_read_fails_is_retried_not_fatal_to_the_thread() -> None:
    _clock, kube, lock, told = held()
    kube.update_errors = [CONFLICT]
    kube.read_errors = [API_AWAY]
    assert lock.renew_once() is False and lock.lost is None
    assert lock.renew_once() is True and told == []


def test_a_conflict_whose_re_read_keeps_failing_loses_the_lease_at_the_deadline() -> None:
    clock, kube, lock, told = held(ttl=30)
    for _ in range(30):
        kube.update_errors.append(CONFLICT)
        kube.read_errors.append(API_AWAY)
        lock.renew_once()
        if lock.lost is not None:
            break
        clock.sleep(2)
    assert lock.lost == "(unknown)" and told == ["(unknown)"]
    assert "409 on renewal, then the re-read failed" in lock.lost_reason
    assert clock.now() - 1000.0 == pytest.approx(20)  # 2/3 of the 30 s TTL


def test_a_conflict_from_our_own_unanswered_write_renews_on_the_fresh_version() -> None:
    _clock, kube, lock, told = held()
    cur = kube.leases[KEY]
    kube.leases[KEY] = replace(cur, resource_version=str(int(cur.resource_version) + 1))  # our write went through
    assert lock.renew_once() is True and lock.lost is None and told == []


@pytest.mark.parametrize("what", ["taken", "deleted", "released"])
def test_a_conflict_showing_another_holder_or_no_lease_loses_it_at_once(what: str) -> None:
    _clock, kube, lock, told = held()
    if what == "taken":
        take_over(kube)
    elif what == "deleted":
        del kube.leases[KEY]
    else:
        kube.update_lease(kube.leases[KEY], "", 120, acquire=False)
    assert lock.renew_once() is False
    assert told == [{"taken": "runbook/r-2", "deleted": "(deleted)", "released": "(released)"}[what]]


def test_a_failing_on_lost_callback_still_leaves_the_lock_lost_and_fenced() -> None:
    _clock, kube, lock, _ = held()

    def broken(holder: str) -> None:
        raise OSError("journal disk full")

    lock.on_lost = broken
    take_over(kube)
    assert lock.renew_once() is False and lock.lost == "runbook/r-2"
    with pytest.raises(LockLost):
        lock.fence()


def _wait_lost(lock: NodeLock, told: threading.Event) -> bool:
    ok = told.wait(15)
    lock.release()
    return ok


@pytest.mark.parametrize("script", ["conflict-then-unreadable", "unexpected-exception", "base-exception"])
def test_the_real_renewal_thread_ends_lost_and_says_so_whatever_kills_its_attempts(script: str) -> None:
    """The thread (TTL 3 s: renew every 1 s, retry every 0.5 s, deadline 2 s) on the real clock."""
    clock = FakeClock()
    kube = FlakyKube(clock)
    lock = acquire_node_lock(kube, "omen2", "r-1", ttl=3)  # real monotonic clock
    told = threading.Event()
    lock.on_lost = lambda holder: told.set()
    if script == "conflict-then-unreadable":
        kube.fail_updates_forever = CONFLICT
        kube.read_errors = [API_AWAY] * 1000
    elif script == "unexpected-exception":
        kube.fail_updates_forever = RuntimeError("a connector bug")
    else:
        kube.fail_updates_forever = SystemExit(3)  # not even an Exception: the thread still reports
    lock.start_renewing()
    assert _wait_lost(lock, told)
    assert lock.lost == "(unknown)" and lock.lost_reason
    with pytest.raises(LockLost):
        lock.fence()


# -- 14. clock skew: expiry is observed on our own monotonic clock ----------------------------------

def test_a_process_whose_clock_is_200s_ahead_cannot_take_a_lease_renewed_1s_ago() -> None:
    holder_clock = FakeClock()
    kube = FakeKube(clock=holder_clock)
    acquire_node_lock(kube, "omen2", "r-live", ttl=120, clock=holder_clock.now, wall=holder_clock.wall)
    holder_clock.sleep(1)
    kube.update_lease(kube.leases[KEY], holder_for("r-live"), 120, acquire=False)  # renewed 1 s ago
    ahead = FakeClock(start=holder_clock.now() + 200)  # the contender's clocks (wall and monotonic) run 200 s ahead
    for wait in (0, 30):
        with pytest.raises(LockHeld, match="runbook/r-live"):
            acquire_node_lock(kube, "omen2", "r-skewed", wait=wait, clock=ahead.wall, sleep=ahead.sleep,
                              wall=ahead.wall)
    assert kube.leases[KEY].holder == "runbook/r-live"


def test_a_live_holder_that_keeps_renewing_is_never_taken_over_whatever_the_skew() -> None:
    clock = FakeClock()
    kube = FakeKube(clock=clock)
    live = acquire_node_lock(kube, "omen2", "r-live", ttl=60, clock=clock.now)

    def renew() -> None:
        live.lease = kube.update_lease(live.lease, "runbook/r-live", 60, acquire=False)
        clock.after(20, renew)

    clock.after(20, renew)
    skewed = lambda: clock.wall() + 3600.0  # noqa: E731  an hour ahead
    with pytest.raises(LockHeld):
        acquire_node_lock(kube, "omen2", "r-skewed", wait=300, clock=skewed, sleep=clock.sleep, wall=skewed)
    assert kube.leases[KEY].holder == "runbook/r-live"


def test_an_abandoned_lease_is_taken_after_its_ttl_of_observation_even_if_its_renew_time_is_in_our_future() -> None:
    holder_clock = FakeClock(start=10_000.0)  # the dead holder's clock ran ~2.5 h ahead of ours
    kube = FakeKube(clock=holder_clock)
    acquire_node_lock(kube, "omen2", "r-dead", ttl=60, clock=holder_clock.now)  # never renewed again
    ours = FakeClock(start=1000.0)
    start = ours.now()
    lock = acquire_node_lock(kube, "omen2", "r-new", wait=90, clock=ours.now, sleep=ours.sleep, wall=ours.wall)
    assert lock.lease.holder == "runbook/r-new"
    assert 60 <= ours.now() - start <= 62
    assert lock.lease.transitions == 1


def test_a_lease_that_changes_restarts_the_observation() -> None:
    clock = FakeClock()
    kube = FakeKube(clock=clock)
    acquire_node_lock(kube, "omen2", "r-slow", ttl=60, clock=clock.now)
    # one late renewal, 50 s in
    clock.after(50, lambda: kube.update_lease(kube.leases[KEY], "runbook/r-slow", 60, acquire=False))
    start = clock.now()
    lock = acquire_node_lock(kube, "omen2", "r-new", wait=200, clock=clock.now, sleep=clock.sleep, wall=clock.wall)
    assert lock.lease.holder == "runbook/r-new"
    assert 110 <= clock.now() - start <= 112  # 50 s, then 60 s unchanged after the renewal


# -- 15. fencing ------------------------------------------------------------------------------------

def test_the_fence_token_names_our_holder_and_tenure_and_refuses_once_the_lease_changed_hands() -> None:
    _clock, kube, lock, told = held()
    token = lock.fence()
    assert token == {"lease": f"{DEFAULT_NAMESPACE}/runbook-node-omen2", "holder": "runbook/r-1",
                     "transitions": 0, "resource_version": kube.leases[KEY].resource_version}
    take_over(kube)
    with pytest.raises(LockLost, match="now held by runbook/r-2"):
        lock.fence()
    assert told == ["runbook/r-2"]


def test_the_fence_refuses_when_the_same_holder_came_back_in_another_tenure() -> None:
    _clock, kube, lock, _told = held()
    take_over(kube, "r-2")
    take_over(kube, "r-1")  # our run id again (another process resumed it): transitions 0 -> 2
    with pytest.raises(LockLost, match="leaseTransitions 0 -> 2"):
        lock.fence()


def test_the_fence_fails_closed_when_it_cannot_read_and_our_last_renewal_is_too_old() -> None:
    clock, kube, lock, _told = held(ttl=120)
    kube.read_errors = [API_AWAY]
    assert lock.fence()["holder"] == "runbook/r-1"  # renewed just now: nobody can have taken it
    clock.sleep(81)
    kube.read_errors = [API_AWAY]
    with pytest.raises(LockLost, match="not renewed for 81s"):
        lock.fence()


def test_a_run_whose_lease_is_taken_mid_run_does_not_act_again_and_journals_the_loss(world: World) -> None:  # noqa: F811
    """The Lease changes hands while swap-off runs: restart-kubelet is never started (the renewal
    thread, 40 s away, has not noticed yet: the fence has), the run ends cancelled, exit 4."""
    original = world.nodes.effects["swap-off.yml"]

    def swap_off_then_lose_the_lease(fn: FakeNodes, node: str, ev: Any) -> Any:
        take_over(world.kube, "r-other-engine")
        return original(fn, node, ev)

    world.nodes.effects["swap-off.yml"] = swap_off_then_lose_the_lease
    plan = world.plan()
    run_id = world.service.create(world.prepared, plan)
    result = world.service.execute(run_id, world.prepared, plan)
    assert (result.state, result.exit_code) == (RunState.CANCELLED, 4)
    assert world.effects()["restart"] == 0 and world.effects()["swap-off"] == 1
    events = world.service.journal.events(run_id)
    kinds = [(e.kind, e.step) for e in events]
    assert ("lock.lost", None) in kinds
    lost = next(e for e in events if e.kind == "lock.lost")
    assert lost.data["holder"] == "runbook/r-other-engine"
    assert ("action.intent", "restart-kubelet") not in kinds
    outcome = next(e for e in events if e.kind == "step.outcome" and e.step == "restart-kubelet")
    assert outcome.data["status"] == StepStatus.CANCELLED.value and "not acted" in outcome.data["reason"]
    intents = [e for e in events if e.kind == "action.intent"]
    assert intents and all(e.data["fence"]["holder"] == holder_for(run_id) for e in intents)
    assert world.kube.leases[KEY].holder == "runbook/r-other-engine"  # our release left theirs alone

