"""A burst of pages (issue 32): the webhook's answer says, node by node, whether its run executes
now (``started``), waits for a worker at its place (``queued``, ``queue_position``) or was refused
(``refused``, with the reason); the shared breaker reads the store once per delivery, not once per
alert, and still counts every automatic run it lets through."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from engine.serve.dispatcher import Decision
from engine.serve.starter import RunOutcome
from engine.serve.worker import WorkerPool
from tests.fakes import FakeLeadership, FakeRunStarter, alert, make_node, served, trigger_spec

NODES = tuple(make_node(f"omen{i}", gpus=1) for i in range(1, 31))  # thirty healthy GPU nodes
TRIGGER = trigger_spec(mode="auto", matchers=('node=~"omen.*"',))


class GatedStarter(FakeRunStarter):
    """Runs execute only once ``gate`` is set (the burst is answered while they wait); counts lists."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.gate = threading.Event()
        self.lists = 0
        self.began: set[str] = set()

    def execute(self, run_id: str) -> Any:
        self.began.add(run_id)
        self.gate.wait(10)
        return super().execute(run_id)

    def hand_back(self, run_id: str) -> bool:
        return run_id not in self.began and super().hand_back(run_id)

    def runs(self, limit: int = 100, *, sources: tuple[str, ...] | None = None) -> Sequence[Mapping[str, Any]]:
        self.lists += 1
        return super().runs(limit, sources=sources)


def test_the_pool_says_where_each_job_went_first_in_first_out() -> None:
    pool = WorkerPool(workers=2, queue_size=3)
    gate = threading.Event()
    places = [pool.enqueue(lambda: gate.wait(5), reserved=False) for _ in range(6)]
    assert places == [0, 0, 1, 2, 3, None]  # two execute, three wait in order, the sixth is refused
    assert pool.stats()["waiting"] == 3
    gate.set()
    assert pool.wait_idle(5)
    assert pool.stats()["waiting"] == 0
    pool.shutdown(grace=1)


def test_each_decision_names_what_became_of_its_node() -> None:
    assert Decision("started", "x", node="a", run_id="r1").as_dict()["decision"] == "started"
    queued = Decision("started", "x", node="a", run_id="r1", queue_position=4).as_dict()
    assert (queued["outcome"], queued["decision"], queued["queue_position"]) == ("started", "queued", 4)
    assert Decision("blocked", "pool full", node="a").as_dict()["decision"] == "refused"
    assert Decision("rejected", "bad param").as_dict()["decision"] == "refused"
    assert Decision("duplicate", "seen").as_dict()["decision"] == "duplicate"
    assert "queue_position" not in Decision("started", "x", node="a").as_dict()


def test_a_burst_in_one_delivery_is_answered_started_queued_with_places_or_refused_node_by_node() -> None:
    starter = GatedStarter([TRIGGER])
    with served(starter=starter, nodes=NODES, workers=2, queue_size=5,
                breaker={"max_unhealthy_nodes": 100, "max_auto_runs": 100}) as s:
        r = s.post_alerts(*(alert(f"omen{i}") for i in range(1, 11)))
        body = r.json()
        assert r.status_code == 202
        by_node = {d["node"]: d for d in body["decisions"]}
        assert len(by_node) == 10  # every node answered
        assert [by_node[f"omen{i}"]["decision"] for i in range(1, 11)] == \
            ["started"] * 2 + ["queued"] * 5 + ["refused"] * 3
        assert [by_node[f"omen{i}"]["queue_position"] for i in range(3, 8)] == [1, 2, 3, 4, 5]
        assert "place 3 in this replica's queue" in by_node["omen5"]["reason"]
        assert all(by_node[f"omen{i}"]["outcome"] == "started" for i in range(1, 8))  # the contract's field
        assert "worker pool is full" in by_node["omen9"]["reason"]
        assert body["counts"] == {"started": 2, "queued": 5, "refused": 3}
        assert len(body["runs"]) == 7
        starter.gate.set()
        s.idle()
        assert sorted(starter.executed) == sorted(body["runs"])  # the queued ones ran in turn


def test_the_shared_breaker_reads_the_store_to_allow_a_run_and_never_again_once_it_tripped() -> None:
    starter = GatedStarter([TRIGGER])
    starter.gate.set()
    with served(starter=starter, nodes=NODES, elector=FakeLeadership(True), workers=4, queue_size=40,
                dedup={"node_cooldown": 0}, breaker={"max_unhealthy_nodes": 100, "max_auto_runs": 5,
                                                     "max_pending_approvals": 3}) as s:
        before = starter.lists
        body = s.post_alerts(*(alert(f"omen{i}") for i in range(1, 21))).json()
        assert starter.lists - before == 5  # one read per automatic run allowed; none after the trip
        modes = [d.get("mode") for d in body["decisions"]]
        assert modes[:5] == ["auto"] * 5  # the window's five automatic runs
        assert modes[5:8] == ["approve"] * 3  # the breaker tripped: for a person, within the approval budget
        assert all("5 automatic runs of gpu-node-recovery" in d["warnings"][0] for d in body["decisions"][5:8])
        refused = body["decisions"][8:]
        assert {d["decision"] for d in refused} == {"refused"} and len(refused) == 12
        assert all("not paging for approval" in d["reason"] for d in refused)
        s.idle()
        # the next delivery reads again and sees the five automatic runs in the store
        nxt = s.post_alerts(alert("omen25")).json()["decisions"][0]
        assert nxt["decision"] == "refused" and starter.lists - before == 6


def test_a_replica_that_stops_hands_its_queued_runs_back_to_the_store_for_the_leader() -> None:
    starter = GatedStarter([TRIGGER])
    with served(starter=starter, nodes=NODES, workers=1, queue_size=10, shutdown_grace=0.2,
                breaker={"max_unhealthy_nodes": 100, "max_auto_runs": 100}) as s:
        body = s.post_alerts(*(alert(f"omen{i}") for i in range(1, 5))).json()
        assert body["counts"] == {"started": 1, "queued": 3}
        queued = [d["run_id"] for d in body["decisions"] if d["decision"] == "queued"]
    # the app stopped (its lifespan ended) while one run executed and three waited
    assert sorted(starter.handed_back) == sorted(queued)
    starter.gate.set()


class StopsWaitingStarter(GatedStarter):
    """Its run waits for room in the budget until the gate opens, then returns ``pending`` (the real
    starter's run stops waiting when the server stops); a run executing now is never handed back."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.executing: set[str] = set()

    def execute(self, run_id: str) -> Any:
        self.executing.add(run_id)
        try:
            self.gate.wait(10)
            return RunOutcome(run_id, "pending", reason="stopped waiting for room in the budget")
        finally:
            self.executing.discard(run_id)

    def hand_back(self, run_id: str) -> bool:
        if run_id in self.executing:
            return False
        with self._cond:
            if self._runs[run_id]["state"] != "pending":
                return False
            self.handed_back.append(run_id)
            return True


def test_a_run_that_stops_waiting_for_budget_after_the_stops_hand_back_pass_is_handed_back_still() -> None:
    """The race test_serve_burst_real_api.py hit under load: the stop's pass found the run executing
    (waiting for budget room), the run then returned pending, and nobody gave it back."""
    starter = StopsWaitingStarter([TRIGGER])
    with served(starter=starter, nodes=NODES, workers=1, queue_size=10, shutdown_grace=0.2,
                breaker={"max_unhealthy_nodes": 100, "max_auto_runs": 100}) as s:
        body = s.post_alerts(alert("omen1")).json()
        run_id = body["decisions"][0]["run_id"]
        deadline = time.monotonic() + 5
        while run_id not in starter.executing and time.monotonic() < deadline:
            time.sleep(0.01)
    assert starter.handed_back == []  # the stop's pass: it was executing
    starter.gate.set()
    deadline = time.monotonic() + 5
    while not starter.handed_back and time.monotonic() < deadline:
        time.sleep(0.01)
    assert starter.handed_back == [run_id]
