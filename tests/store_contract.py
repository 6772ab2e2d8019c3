"""The run store's contract: every guarantee ``engine.store.RunStore`` promises, written once and run
over every store (docs/design.md, "How to add a store").

A test module runs the suite by importing these tests and defining the fixture ``bed``: a
:class:`StoreBed` over one store. tests/unit/test_store_contract.py runs it over the SQLite journal
and over RemediationRuns on ``tests.fakes.FakeKube``'s object API (fast, in-process);
tests/integration/test_kube_store_real_api.py runs it over RemediationRuns on the test bed's real
API server. A new store adds its ``StoreBed`` to the unit module (and to an integration module when
it needs a real backend).

The guarantees: a run's record, plan, events and state (``run.state`` events, final states with
their exit code); intent before action (an event is durable, and visible to another process's
store, when ``append`` returns); optimistic concurrency (two writers on one run never lose or
overwrite an event, an approval is decided on the current plan only, an owner's claim is
exclusive); resume (the progress a resume reads, from any process); owner detection; retention;
redaction (secret-looking keys and registered secret values never reach the store).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from engine.errors import StalePlan, UsageError
from engine.journal import Journal
from engine.kube_store import KubeRunStore
from engine.store import RunStore, _process_start


@dataclass
class StoreBed:
    """One store under test: ``store``; ``reopen()`` another process's view of the same backend (a
    new connection, a new client); ``set_owner(run_id, pid, start)`` changes the recorded owner as
    another process would (a test's hand on the backend, bypassing the store's rules)."""

    store: RunStore
    reopen: Callable[[], RunStore]
    set_owner: Callable[[str, int | None, str | None], None]


def set_owner_in(store: RunStore) -> Callable[[str, int | None, str | None], None]:
    """``StoreBed.set_owner`` for our two stores, through their own backends."""

    def set_owner(run_id: str, pid: int | None, start: str | None) -> None:
        if isinstance(store, Journal):
            with store._tx() as db:
                db.execute("UPDATE runs SET owner_pid=?, owner_start=? WHERE id=?", (pid, start, run_id))
            return
        assert isinstance(store, KubeRunStore)

        def put(status: dict[str, object]) -> tuple[bool, None]:
            owner = status.setdefault("owner", {})
            assert isinstance(owner, dict)
            owner.update({"pid": pid, "start": start})
            return True, None

        KubeRunStore(store.api, store.namespace)._update(run_id, put, fresh=True)  # another writer

    return set_owner


@pytest.fixture
def store(bed: StoreBed) -> RunStore:
    return bed.store


def _set_owner(store: RunStore, run_id: str, pid: int | None, start: str | None) -> None:
    set_owner_in(store)(run_id, pid, start)


# -- records ----------------------------------------------------------------------------------------


def test_the_store_satisfies_the_run_store_interface(store: RunStore) -> None:
    assert isinstance(store, RunStore)


def test_a_run_records_its_plan_events_and_final_state(store: RunStore) -> None:
    run_id = store.create_run("gpu-node-recovery", {"node": "omen2"}, ["omen2"], source="cli")
    rec = store.get_run(run_id)
    assert (rec.runbook, rec.nodes, rec.state, rec.source, rec.owner_pid) == (
        "gpu-node-recovery", ["omen2"], "pending", "cli", os.getpid())
    store.set_plan(run_id, {"steps": [{"id": "swap-off"}]}, "sha256:abc")
    assert [store.append(run_id, "step.start", step="swap-off"),
            store.append(run_id, "action.intent", step="swap-off", action="ansible")] == [1, 2]
    store.set_state(run_id, "running")
    store.append(run_id, "step.outcome", step="swap-off", status="succeeded", reason="swap is off")
    store.set_state(run_id, "succeeded", exit_code=0)
    rec = store.get_run(run_id)
    assert (rec.state, rec.exit_code, rec.plan_digest, rec.plan) == (
        "succeeded", 0, "sha256:abc", {"steps": [{"id": "swap-off"}]})
    assert rec.started is not None and rec.finished is not None and rec.finished >= rec.started
    events = store.events(run_id)
    assert [(e.seq, e.kind, e.step) for e in events] == [
        (1, "step.start", "swap-off"), (2, "action.intent", "swap-off"), (3, "run.state", None),
        (4, "step.outcome", "swap-off"), (5, "run.state", None)]
    assert events[1].data == {"action": "ansible"}
    assert store.progress(run_id).completed == frozenset({"swap-off"})
    assert store.step_progress(run_id) == ({"swap-off"}, None)


def test_the_progress_of_a_run_left_after_an_intent_names_that_step(store: RunStore) -> None:
    run_id = store.create_run("rb", {}, ["omen2"], state="running")
    store.append(run_id, "step.start", step="relabel")
    store.append(run_id, "step.outcome", step="relabel", status="succeeded")
    store.append(run_id, "step.start", step="swap-off")
    store.append(run_id, "action.intent", step="swap-off")
    store.append(run_id, "action.result", step="swap-off", ok=True)
    p = store.progress(run_id)
    assert (p.completed, p.interrupted_step, p.action_finished) == (frozenset({"relabel"}), "swap-off", True)


def test_an_approval_must_name_the_current_plan_of_a_run_waiting_for_one(store: RunStore) -> None:
    run_id = store.create_run("rb", {}, ["omen2"], approval_required=True)
    store.set_plan(run_id, {"x": 1}, "sha256:one")
    with pytest.raises(StalePlan, match="not waiting for approval"):
        store.record_approval(run_id, "sha256:one", "alice")
    store.set_state(run_id, "waiting-approval")
    with pytest.raises(StalePlan, match="sha256:one"):
        store.record_approval(run_id, "sha256:other", "alice")
    rec = store.record_approval(run_id, "sha256:one", "alice")
    assert (rec.approved_by, rec.approved_digest, rec.approval_required) == ("alice", "sha256:one", True)
    assert store.events(run_id)[-1].kind == "approval.granted"
    with pytest.raises(UsageError, match="unknown run id"):
        store.record_approval("r-nope", "sha256:one", "alice")


def test_runs_list_newest_first_and_filter_by_state(store: RunStore) -> None:
    ids = [store.create_run("rb", {"i": i}, ["omen2"]) for i in range(3)]
    store.set_state(ids[1], "failed", exit_code=1)
    assert [r.id for r in store.list_runs()] == list(reversed(ids))
    assert [r.id for r in store.list_runs(limit=2)] == [ids[2], ids[1]]
    assert [r.id for r in store.list_runs(states=("failed",))] == [ids[1]]
    with pytest.raises(UsageError, match="unknown run id"):
        store.get_run("r-nope")


def test_runs_list_filters_by_source_and_by_state_and_source(store: RunStore) -> None:
    paged = [store.create_run("rb", {}, [f"gpu-{i}"], source=src)
             for i, src in enumerate(("alertmanager", "cli", "pagerduty", "alertmanager"))]
    store.set_state(paged[0], "failed", exit_code=1)
    webhook = ("alertmanager", "pagerduty")
    assert [r.id for r in store.list_runs(sources=webhook)] == [paged[3], paged[2], paged[0]]
    assert [r.id for r in store.list_runs(sources=("cli",))] == [paged[1]]
    assert [r.id for r in store.list_runs(states=("failed",), sources=webhook)] == [paged[0]]
    assert store.list_runs(states=("failed",), sources=("cli",)) == []


def test_a_run_whose_owner_is_gone_reads_interrupted_and_a_live_owner_keeps_it(store: RunStore) -> None:
    run_id = store.create_run("rb", {}, ["omen2"], state="running")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ident = None
        while ident is None:
            ident = _process_start(other.pid)
        _set_owner(store, run_id, other.pid, ident)
        assert store.get_run(run_id).state == "running"
        assert store.claim(run_id) is False  # two executors of one run never both proceed
        assert store.get_run(run_id).owner_pid == other.pid
    finally:
        other.kill()
        other.wait()
    assert store.get_run(run_id).state == "interrupted"
    assert store.list_runs()[0].state == "interrupted"
    assert store.claim(run_id) is True
    assert store.get_run(run_id).owner_pid == os.getpid()


def test_a_parked_run_has_no_owner_and_stays_waiting(store: RunStore) -> None:
    run_id = store.create_run("rb", {}, ["omen2"], state="waiting-approval")
    store.disown(run_id)
    _set_owner(store, run_id, None, None)
    rec = store.get_run(run_id)
    assert (rec.state, rec.owner_pid) == ("waiting-approval", None)


def test_secrets_and_secret_looking_keys_are_masked_in_every_store(store: RunStore) -> None:
    store.add_secret("s3cr3t-Become")
    run_id = store.create_run("rb", {"node": "omen2", "api_token": "t0k"}, ["omen2"])
    store.append(run_id, "action.result", step="s", stdout="sudo said s3cr3t-Become", password="pw")
    assert store.get_run(run_id).params == {"node": "omen2", "api_token": "***"}
    assert store.events(run_id)[0].data == {"stdout": "sudo said ***", "password": "***"}
    assert store.redact({"token": "x", "y": "s3cr3t-Become"}) == {"token": "***", "y": "***"}


def test_retention_deletes_old_and_surplus_finished_runs_never_active_ones(store: RunStore) -> None:
    ids = [store.create_run("rb", {"i": i}, ["omen2"]) for i in range(5)]
    for run_id in ids[:4]:
        store.set_state(run_id, "succeeded", exit_code=0)
    # ids[4] is pending: never pruned. Keep the 2 newest finished: ids[3], ids[2].
    assert sorted(store.prune(keep=2)) == sorted(ids[:2])
    assert {r.id for r in store.list_runs()} == set(ids[2:])
    assert store.prune(keep=10, max_age=3600) == []
    far = store.get_run(ids[3]).finished
    assert far is not None
    assert sorted(store.prune(keep=10, max_age=60, now=far + 61)) == sorted(ids[2:4])
    assert [r.id for r in store.list_runs()] == [ids[4]]
    with pytest.raises(UsageError):
        store.prune(keep=-1)


def test_a_name_that_is_not_a_run_state_is_refused_and_nothing_is_recorded(store: RunStore) -> None:
    run_id = store.create_run("rb", {}, ["omen2"])
    for bogus in ("approved", "rolled-back", "Running"):
        with pytest.raises(UsageError, match="unknown run state"):
            store.set_state(run_id, bogus)
    with pytest.raises(UsageError, match="unknown run state"):
        store.create_run("rb", {}, ["omen2"], state="approved")
    assert store.get_run(run_id).state == "pending"
    assert [e.kind for e in store.events(run_id)] == []
    assert len(store.list_runs()) == 1


# -- intent before action ---------------------------------------------------------------------------


def test_an_event_is_durable_and_seen_by_another_process_when_append_returns(bed: StoreBed) -> None:
    run_id = bed.store.create_run("rb", {"node": "omen2"}, ["omen2"], state="running",
                                  events=[("run.requested", {"by": "alice"})])
    seq = bed.store.append(run_id, "action.intent", step="swap-off", action="ansible")
    other = bed.reopen()  # nothing of this process's store is shared with it
    try:
        seen = other.events(run_id)
        assert [(e.seq, e.kind, e.step) for e in seen] == [
            (1, "run.requested", None), (seq, "action.intent", "swap-off")]
        assert seen[-1].data == {"action": "ansible"}
        assert other.get_run(run_id).state == "running"
    finally:
        other.close()


# -- optimistic concurrency -------------------------------------------------------------------------


def test_two_writers_on_one_run_never_lose_or_overwrite_an_event(bed: StoreBed) -> None:
    run_id = bed.store.create_run("rb", {}, ["omen2"], state="running")
    other = bed.reopen()
    try:
        bed.store.append(run_id, "step.start", step="a")  # this process's view is current now
        for i in range(4):  # each write lands on a record the other writer changed since
            other.append(run_id, "note", who="other", i=i)
            bed.store.append(run_id, "note", who="mine", i=i)
        other.set_state(run_id, "succeeded", exit_code=0)
        events = bed.store.events(run_id)
    finally:
        other.close()
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    notes = [(e.data["who"], e.data["i"]) for e in events if e.kind == "note"]
    assert notes == [(w, i) for i in range(4) for w in ("other", "mine")]
    assert bed.store.get_run(run_id).state == "succeeded"


def test_an_approval_is_decided_on_the_plan_stored_now_not_on_a_stale_view(bed: StoreBed) -> None:
    run_id = bed.store.create_run("rb", {}, ["omen2"], approval_required=True)
    bed.store.set_plan(run_id, {"v": 1}, "sha256:one")
    bed.store.set_state(run_id, "waiting-approval")
    assert bed.store.get_run(run_id).plan_digest == "sha256:one"  # this process has seen plan one
    other = bed.reopen()
    try:
        other.set_plan(run_id, {"v": 2}, "sha256:two")  # re-planned elsewhere meanwhile
    finally:
        other.close()
    with pytest.raises(StalePlan, match="sha256:two"):
        bed.store.record_approval(run_id, "sha256:one", "alice")
    assert bed.store.get_run(run_id).approved_by is None
    assert bed.store.record_approval(run_id, "sha256:two", "alice").approved_digest == "sha256:two"


# -- resume -----------------------------------------------------------------------------------------


def test_another_process_reads_where_a_dead_run_stands(bed: StoreBed) -> None:
    run_id = bed.store.create_run("rb", {}, ["omen2"], state="running")
    for kind, step, data in [("step.start", "relabel", {}), ("step.outcome", "relabel", {"status": "skipped"}),
                             ("step.start", "swap-off", {}), ("action.intent", "swap-off", {})]:
        bed.store.append(run_id, kind, step=step, **data)
    bed.set_owner(run_id, 999999, "a-boot-long-gone/1")  # its process is gone
    other = bed.reopen()
    try:
        assert other.get_run(run_id).state == "interrupted"
        p = other.progress(run_id)
        assert (p.completed, p.interrupted_step, p.action_finished) == (frozenset({"relabel"}), "swap-off", False)
        assert other.claim(run_id) is True
        assert other.get_run(run_id).owner_pid == os.getpid()
    finally:
        other.close()


def test_an_interrupted_run_has_no_owner_and_running_again_clears_its_end(store: RunStore) -> None:
    run_id = store.create_run("rb", {}, ["omen2"], state="running")
    store.set_state(run_id, "interrupted", exit_code=4)
    rec = store.get_run(run_id)
    assert (rec.state, rec.exit_code, rec.owner_pid) == ("interrupted", 4, None)
    assert rec.finished is not None
    assert store.claim(run_id) is True
    store.set_state(run_id, "running")
    rec = store.get_run(run_id)
    assert (rec.state, rec.exit_code, rec.finished) == ("running", None, None)


# -- redaction --------------------------------------------------------------------------------------


def test_what_the_store_masked_is_masked_for_every_reader(bed: StoreBed) -> None:
    bed.store.add_secret("hunter2-become")
    run_id = bed.store.create_run("rb", {"node": "omen2", "vault_password": "pw"}, ["omen2"],
                                  events=[("run.note", {"reason": "become hunter2-become"})])
    bed.store.set_plan(run_id, {"vars": {"ssh_token": "t", "cmd": "echo hunter2-become"}}, "sha256:x")
    other = bed.reopen()  # knows no secret: it reads what was written
    try:
        assert other.get_run(run_id).params == {"node": "omen2", "vault_password": "***"}
        assert other.get_run(run_id).plan == {"vars": {"ssh_token": "***", "cmd": "echo ***"}}
        assert other.events(run_id)[0].data == {"reason": "become ***"}
    finally:
        other.close()


__all__ = [name for name in dir() if name.startswith("test_")] + ["StoreBed", "set_owner_in", "store"]
