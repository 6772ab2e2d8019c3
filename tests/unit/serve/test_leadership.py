"""Singleton duties of ``runbook serve`` run on the leader only (issue 15): a follower resumes no
orphaned run, a replica that wins leadership resumes them at once."""

from __future__ import annotations

import time
from typing import Any

from tests.fakes import FakeLeadership, FakeRunStarter, served, trigger_spec

ORPHAN = {"id": "r-orphan", "runbook": "gpu-node-recovery", "params": {"node": "omen2"}, "nodes": ["omen2"],
          "state": "interrupted", "source": "alertmanager", "plan_digest": None, "approval_required": False,
          "approved_by": None, "started": "2026-01-01T00:00:00.000Z", "finished": None, "exit_code": None}


def test_a_follower_resumes_no_orphan_and_resumes_it_at_once_when_it_becomes_leader() -> None:
    starter = FakeRunStarter([trigger_spec(mode="auto", matchers=('node=~"omen.*"',))],
                             preload=[ORPHAN], recover_ids=["r-orphan"])
    leadership = FakeLeadership()
    with served(starter=starter, elector=leadership, sweep_interval=0.2) as s:
        time.sleep(0.8)  # several sweeps as a follower
        assert starter.executed == []
        assert s.client.get("/readyz").json()["role"] == "follower"
        leadership.win()
        assert starter.wait_until(lambda st: st.executed == ["r-orphan"], timeout=5)
        time.sleep(0.6)  # later sweeps do not queue it twice
        assert starter.executed == ["r-orphan"]


def _finished(i: int) -> dict[str, Any]:
    return {**ORPHAN, "id": f"r-old-{i:02d}", "state": "succeeded", "finished": "2026-01-01T00:00:00.000Z"}


def test_only_the_leader_prunes_finished_runs_beyond_the_retention() -> None:
    starter = FakeRunStarter([trigger_spec(mode="auto", matchers=('node=~"omen.*"',))],
                             preload=[_finished(i) for i in range(5)])
    leadership = FakeLeadership()
    with served(starter=starter, elector=leadership, sweep_interval=0.2, retention={"keep": 2}) as s:
        time.sleep(0.8)
        assert len(starter.runs()) == 5  # a follower prunes nothing
        leadership.win()
        assert starter.wait_until(lambda st: len(st.runs()) == 2, timeout=5)
        assert [r["id"] for r in s.client.get("/runs").json()] == ["r-old-04", "r-old-03"]  # the newest kept


def test_replicas_sharing_a_store_start_one_run_for_one_page_and_a_new_one_after_the_window(tmp_path: Any) -> None:
    from pathlib import Path

    import pytest

    from engine.serve.starter import AlreadyStarted, RunRequest
    from engine.serve_starter import JournalRunStarter
    from engine.settings import Settings

    repo = Path(__file__).resolve().parents[3]
    import time as _time

    offset = [0.0]  # the store stamps runs with the real clock: the replicas' clock runs ahead of it

    def replica() -> JournalRunStarter:
        settings = Settings(journal=tmp_path / "shared.sqlite", runbooks_dir=repo / "runbooks")
        return JournalRunStarter(settings, shared_dedup_window=3600, clock=lambda: _time.time() + offset[0])

    a, b = replica(), replica()
    page = RunRequest(runbook="gpu-node-recovery", params={"node": "omen2"}, node="omen2", mode="approve",
                      source="alertmanager", reason="KubeNodeNotReady{node=omen2}", dedup_key="4f2a9c")
    first = a.submit(page).run_id
    with pytest.raises(AlreadyStarted) as again:
        b.submit(page)
    assert again.value.run_id == first
    offset[0] += 3600 - _time.time() % 3600 + 1  # the next window begins; the run is younger than a window
    with pytest.raises(AlreadyStarted, match=first):
        b.submit(page)
    offset[0] += 3600.0  # more than a window later: a new run
    second = b.submit(page).run_id
    assert second != first
    other = a.submit(RunRequest(**{**page.__dict__, "dedup_key": "77b1"})).run_id  # another alert
    assert len({first, second, other}) == 3
    assert [r["id"] for r in a.runs()] == [other, second, first]


def _sealed_run(starter: Any, node: str) -> str:
    """A running paged run as the engine records it (sealed: engine.integrity)."""
    from engine.params import prepare_run

    prepared = prepare_run(starter._runbooks["gpu-node-recovery"], {"node": node})
    run_id: str = starter.service.create(prepared, None, source="alertmanager", state="running")
    return run_id


def test_the_running_run_of_a_replica_on_another_machine_is_taken_over_only_after_its_node_lease_went_silent(
        tmp_path: Any) -> None:
    import sqlite3
    from pathlib import Path

    from engine.locks import DEFAULT_NAMESPACE, holder_for, lease_name
    from engine.serve_starter import JournalRunStarter
    from engine.settings import Settings
    from tests.fakes import FakeClock, FakeKube

    repo = Path(__file__).resolve().parents[3]
    clock = FakeClock()
    kube = FakeKube(clock=clock)
    settings = Settings(journal=tmp_path / "shared.sqlite", runbooks_dir=repo / "runbooks")
    leader = JournalRunStarter(settings, shared_dedup_window=3600, kube=lambda: kube, monotonic=clock.now)
    run = _sealed_run(leader, "omen2")
    with sqlite3.connect(tmp_path / "shared.sqlite") as db:  # recorded by replica a, on another machine
        db.execute("UPDATE runs SET owner_host='runbook-7d9f-a', owner_pid=4242 WHERE id=?", (run,))
    lease = kube.create_lease(DEFAULT_NAMESPACE, lease_name("omen2"), holder_for(run), 30)
    assert leader.recover() == []  # first seen now
    clock.sleep(20)
    lease = kube.update_lease(lease, holder_for(run), 30, acquire=False)  # replica a renews: alive
    assert leader.recover() == []
    clock.sleep(29)
    assert leader.recover() == []  # unchanged for 29 s of a 30 s Lease: not yet
    clock.sleep(2)
    assert leader.recover() == [run]  # silent for a whole Lease duration: taken over, once
    assert leader.recover() == []
    taken = [e for e in leader.journal.events(run) if e.kind == "run.taken_over"]
    assert len(taken) == 1 and taken[0].data["previous_owner"] == "runbook-7d9f-a/4242"


def test_the_leader_resumes_a_run_whose_executor_died_silently_but_not_one_the_engine_stopped_on_purpose(
        tmp_path: Any) -> None:
    import sqlite3
    from pathlib import Path

    from engine.serve_starter import JournalRunStarter
    from engine.settings import Settings

    repo = Path(__file__).resolve().parents[3]
    starter = JournalRunStarter(Settings(journal=tmp_path / "j.sqlite", runbooks_dir=repo / "runbooks"),
                                shared_dedup_window=3600)
    journal = starter.journal
    died, stopped = _sealed_run(starter, "omen2"), _sealed_run(starter, "omen3")
    journal.set_state(stopped, "interrupted", exit_code=3)  # the engine stopped it (a Lease held, say)
    with sqlite3.connect(tmp_path / "j.sqlite") as db:  # what a store writes for a dead owner: no event
        db.execute("UPDATE runs SET state='interrupted', owner_pid=NULL WHERE id=?", (died,))
    assert starter.recover() == [died]


def test_a_run_this_replica_planned_and_another_replica_executed_is_resumed_here_when_recover_claims_it() -> None:
    """Cluster mode (issue 26): replica B planned the run (it waits for approval in B's memory); it was
    approved at the leader A, which executed it and died; B, now leader, claims it in ``recover``: B must
    execute it, not skip it as "already queued here" (the run hung Running in the lab test before)."""
    from tests.fakes import AUTH, alert, webhook

    starter = FakeRunStarter([trigger_spec(mode="approve", matchers=('node=~"omen.*"',))])
    leadership = FakeLeadership()
    with served(starter=starter, elector=leadership, sweep_interval=0.2) as s:
        r = s.client.post("/hooks/alertmanager", json=webhook(alert("omen2")), headers=AUTH)
        (run_id,) = r.json()["runs"]
        assert starter.wait_until(lambda st: st.run(run_id)["state"] == "waiting-approval", timeout=5)
        assert starter.executed == [run_id]  # planned here (the fake counts that execution too)
        starter._recover = [run_id]  # claimed by recover() once its executor elsewhere went silent
        leadership.win()
        assert starter.wait_until(lambda st: st.executed == [run_id, run_id], timeout=5), starter.executed


def test_a_run_queued_at_a_replica_on_another_machine_is_the_leaders_once_that_replica_handed_it_back(
        tmp_path: Any) -> None:
    import sqlite3
    from pathlib import Path

    from engine.params import prepare_run
    from engine.serve_starter import JournalRunStarter
    from engine.settings import Settings

    repo = Path(__file__).resolve().parents[3]

    def replica() -> JournalRunStarter:
        return JournalRunStarter(Settings(journal=tmp_path / "shared.sqlite", runbooks_dir=repo / "runbooks"),
                                 shared_dedup_window=3600)

    stopping, leader = replica(), replica()
    prepared = prepare_run(stopping._runbooks["gpu-node-recovery"], {"node": "omen2"})
    queued = stopping.service.create(prepared, None, source="alertmanager")  # pending: queued, never executed
    other = stopping.service.create(prepare_run(stopping._runbooks["gpu-node-recovery"], {"node": "omen3"}),
                                    None, source="alertmanager")
    assert stopping.hand_back(queued)  # the replica stops: it gives its queued run up
    with sqlite3.connect(tmp_path / "shared.sqlite") as db:  # both were queued at a pod on another machine
        db.execute("UPDATE runs SET owner_host='runbook-7d9f-a' WHERE id IN (?, ?)", (queued, other))
    assert leader.recover() == [queued]  # the handed-back one is the leader's; the other is its owner's queue
    assert [e.kind for e in leader.journal.events(queued)].count("run.handed_back") == 1
    stopping.service.journal.set_state(other, "failed", exit_code=1)
    assert not stopping.hand_back(other)  # ended: nothing to hand back
