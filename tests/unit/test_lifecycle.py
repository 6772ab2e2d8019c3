"""A recorded run's life (engine.lifecycle): ``continue_run`` is the one door every front end takes
to continue a recorded run (``runbook resume`` as a person, the server's starter automatically, a
takeover), so what it decides is decided once; ``take_over``, ``approve``, ``reject``, ``cancel``.
Whole runs on the fakes (tests/unit/test_journal.py's ``world``)."""

from __future__ import annotations

import pytest

from engine import lifecycle
from engine.errors import StalePlan, UsageError
from engine.model import RunState
from tests.unit.test_journal import World, world  # noqa: F401  (the fixture: a flagship run on fakes)


@pytest.fixture
def w(world: World) -> World:  # noqa: F811  (test_journal's flagship run on fakes)
    return world


def _kinds(w: World, run_id: str) -> list[str]:
    return [e.kind for e in w.service.journal.events(run_id)]


def test_a_dead_run_is_continued_from_its_progress_with_each_effect_once(w: World) -> None:
    run_id = w.start_and_die("swap-off", "after-outcome")
    seen: list[lifecycle.Continuation] = []
    done = lifecycle.continue_run(w.service, run_id, automatic=False, before_execute=seen.append)
    assert (done.state, done.exit_code, done.executed) == (RunState.SUCCEEDED, 0, True)
    assert len(seen) == 1 and "restart-kubelet" in seen[0].steps_left
    assert not {"relabel-container", "swap-off"} & set(seen[0].steps_left)
    assert w.effects() == {"label": 1, "swap-off": 1, "restart": 1}
    assert "run.resume" in _kinds(w, run_id)


def test_a_finished_run_is_answered_not_run_again(w: World) -> None:
    run_id = w.service.create(w.prepared, w.plan())
    w.service.journal.set_state(run_id, RunState.SUCCEEDED, exit_code=0)
    for automatic in (True, False):
        done = lifecycle.continue_run(w.service, run_id, automatic=automatic)
        assert (done.state, done.exit_code, done.reason, done.executed) == (
            RunState.SUCCEEDED, 0, "already finished", False)
    assert w.effects() == {"label": 0, "swap-off": 0, "restart": 0}


def test_a_person_cannot_continue_a_run_another_process_still_has(w: World) -> None:
    run_id = w.service.create(w.prepared, None)  # pending, owned by this (live) process
    with pytest.raises(UsageError, match="still pending"):
        lifecycle.continue_run(w.service, run_id, automatic=False)


def test_an_unplanned_approve_mode_run_is_parked_by_the_server_and_left_waiting_for_a_person(w: World) -> None:
    run_id = w.service.create(w.prepared, None, approval_required=True, source="alertmanager")
    parked = lifecycle.continue_run(w.service, run_id, automatic=True)
    rec = w.service.journal.get_run(run_id)
    assert (parked.state, parked.exit_code, rec.state, rec.owner_pid) == (
        RunState.WAITING_APPROVAL, None, RunState.WAITING_APPROVAL, None)
    assert parked.plan_digest == rec.plan_digest is not None
    waiting = lifecycle.continue_run(w.service, run_id, automatic=False)
    assert (waiting.state, waiting.exit_code, waiting.executed) == (RunState.WAITING_APPROVAL, 3, False)
    assert w.effects() == {"label": 0, "swap-off": 0, "restart": 0}
    # approved (through the lifecycle), the same door runs it
    assert lifecycle.approve(w.service, run_id, rec.plan_digest or "", "alice")["approved_by"] == "alice"
    done = lifecycle.continue_run(w.service, run_id, automatic=True)
    assert (done.state, done.executed) == (RunState.SUCCEEDED, True)
    assert w.effects() == {"label": 1, "swap-off": 1, "restart": 1}


def test_a_rejected_run_is_cancelled_and_a_racing_continuation_does_nothing(w: World) -> None:
    run_id = w.service.create(w.prepared, None, approval_required=True, source="alertmanager")
    lifecycle.continue_run(w.service, run_id, automatic=True)
    rec = lifecycle.reject(w.service, run_id, "not now", "bob")
    assert (rec.state, rec.exit_code) == (RunState.CANCELLED, 4)
    assert _kinds(w, run_id)[-3:] == ["approval.rejected", "run.state", "run.cancelled"]
    with pytest.raises(StalePlan, match="not waiting for approval"):
        lifecycle.reject(w.service, run_id, "again", "bob")
    done = lifecycle.continue_run(w.service, run_id, automatic=True)
    assert (done.state, done.executed) == (RunState.CANCELLED, False)
    assert w.effects() == {"label": 0, "swap-off": 0, "restart": 0}


def test_a_taken_over_run_records_why_and_whose_it_was(w: World) -> None:
    run_id = w.start_and_die("relabel-container", "after-outcome")
    rec = w.service.journal.get_run(run_id)
    assert lifecycle.take_over(w.service, rec, "its executor went silent") is True
    taken = [e.data for e in w.service.journal.events(run_id) if e.kind == "run.taken_over"]
    assert taken == [{"reason": "its executor went silent", "previous_owner": f"{rec.owner_host}/{rec.owner_pid}"}]
    done = lifecycle.continue_run(w.service, run_id, automatic=True, taken_over=True)
    assert (done.state, done.executed) == (RunState.SUCCEEDED, True)
    assert w.effects() == {"label": 1, "swap-off": 1, "restart": 1}
