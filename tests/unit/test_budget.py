"""One budget for the whole cluster (``engine.budget``), on our fakes: claims with a precondition,
dead claims pruned, fail closed; and through the run service, two services (two processes) sharing
one cluster count each other's runs against the GPU budget and the concurrency limit."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from engine.budget import (
    BUDGET_LEASE,
    CLAIMS_ANNOTATION,
    LEASES,
    BudgetUnreadable,
    Claim,
    ClusterBudget,
)
from engine.locks import acquire_node_lock
from engine.model import PlanState, RunState
from engine.run_guards import Concurrency, GpuBudget, GuardConfig
from engine.runs import RunService
from engine.settings import Settings
from tests.fakes import GPU_LABEL, FakeClock, FakeKube, FakeNodes, healthy_host, healthy_node, install_recovery_effects

NS = "runbook-system"
RUNBOOK = Path(__file__).parent / "data" / "runbooks" / "gpu-recovery.yaml"


def room_for(n: int) -> Any:
    def decide(others: Sequence[Claim]) -> str | None:
        return f"full: {len(others)} in flight" if len(others) >= n else None
    return decide


def budget(kube: FakeKube, clock: FakeClock | None = None) -> ClusterBudget:
    clock = clock or kube.clock
    return ClusterBudget(kube, NS, wall=clock.wall, sleep=lambda s: None)


def test_two_deciders_that_read_the_same_version_cannot_both_pass_a_budget_with_room_for_one() -> None:
    kube = FakeKube([healthy_node("a"), healthy_node("b")])
    first, second = budget(kube), budget(kube)
    first.claims()  # the object exists (version v)

    def the_other_writes_first(body: dict[str, Any]) -> None:
        kube.before_write = None
        # the second process decided on the same version and its write lands first
        assert second.claim("run-b", "b", room_for(1)).granted

    kube.before_write = the_other_writes_first
    result = first.claim("run-a", "a", room_for(1))
    assert not result.granted and result.reason == "full: 1 in flight"
    assert result.attempts == 2  # its first write was refused (409); the second read saw run-b
    assert [c.run for c in first.claims()] == ["run-b"]


def test_a_claim_is_kept_by_its_run_and_given_back_once() -> None:
    kube = FakeKube([healthy_node("a")])
    b = budget(kube)
    assert b.claim("run-a", "a", room_for(1), gpus=8).granted
    again = b.claim("run-a", "a", room_for(0))  # a resume of the same run keeps its place
    assert again.granted
    assert [(c.run, c.node, c.gpus) for c in b.claims()] == [("run-a", "a", 8)]
    assert b.release("run-a") is True and b.release("run-a") is False
    assert b.claims() == []


def test_a_dead_claim_is_pruned_when_it_stands_in_the_way_and_a_live_one_is_not() -> None:
    clock = FakeClock()
    kube = FakeKube([healthy_node("a"), healthy_node("b"), healthy_node("c")], clock=clock)
    b = budget(kube, clock)
    assert b.claim("run-live", "a", room_for(2)).granted
    acquire_node_lock(kube, "a", "run-live", namespace=NS, ttl=60)  # its run holds the node's Lease
    assert b.claim("run-dead", "b", room_for(2)).granted  # its process dies before taking the Lease
    assert not b.claim("run-c", "c", room_for(2)).granted  # within the grace both count
    clock.sleep(b.grace + 1)
    result = b.claim("run-c", "c", room_for(2))
    assert result.granted and [c.run for c in result.pruned] == ["run-dead"]
    assert sorted(c.run for c in b.claims()) == ["run-c", "run-live"]


def test_a_holder_that_stopped_renewing_its_lease_loses_its_claim_after_the_ttl_and_the_grace() -> None:
    clock = FakeClock()
    kube = FakeKube([healthy_node("a"), healthy_node("b")], clock=clock)
    b = budget(kube, clock)
    assert b.claim("run-a", "a", room_for(1)).granted
    acquire_node_lock(kube, "a", "run-a", namespace=NS, ttl=60)
    clock.sleep(60 + b.grace - 1)
    assert not b.claim("run-b", "b", room_for(1)).granted
    clock.sleep(2)
    assert b.claim("run-b", "b", room_for(1)).granted


def test_a_budget_object_that_cannot_be_read_refuses() -> None:
    kube = FakeKube([healthy_node("a")])
    b = budget(kube)
    obj = b._read()
    obj["metadata"]["annotations"][CLAIMS_ANNOTATION] = "{not json"
    kube.replace_object(*LEASES, NS, obj)
    with pytest.raises(BudgetUnreadable, match="cannot be read"):
        b.claim("run-a", "a", room_for(5))
    assert kube.read_object(*LEASES, NS, BUDGET_LEASE) is not None


# -- through the run service: two services (two processes) sharing one cluster -----------------------


def _service(tmp_path: Path, kube: FakeKube, nodes: FakeNodes, name: str, guards: GuardConfig) -> RunService:
    settings = Settings(journal=tmp_path / f"{name}.sqlite", inventory=tmp_path / "hosts.yml", namespace=NS)
    settings._cache.update(kube=kube, nodes=nodes)
    clock = kube.clock
    return RunService(settings, guards=guards, executor_options={"clock": clock, "sleep": clock.sleep,
                                                                  "wall": clock.wall})


def _race(tmp_path: Path, guards: GuardConfig) -> tuple[FakeKube, dict[str, Any]]:
    """Service A remediates gpu-1; in the middle of its first action, service B decides on gpu-2."""
    clock = FakeClock()
    kube = FakeKube([healthy_node("gpu-1"), healthy_node("gpu-2")], clock=clock)
    nodes = FakeNodes({n: healthy_host(n) for n in ("gpu-1", "gpu-2")}, clock=clock)
    install_recovery_effects(kube, nodes, ready_after=0.0, gpu_after=0.0)
    for n in ("gpu-1", "gpu-2"):
        kube.set_label(n, GPU_LABEL, "vm-passthrough")  # their plans change something
    a, b = _service(tmp_path, kube, nodes, "a", guards), _service(tmp_path, kube, nodes, "b", guards)
    out: dict[str, Any] = {}

    def plan(service: RunService, node: str) -> Any:
        (prep,) = [t for t in service.targets(str(RUNBOOK), [], selector="") if t.node == node]
        (p,) = service.plan_targets([prep], preview=False)
        assert p.state is PlanState.READY
        return prep, p

    prep_a, plan_a = plan(a, "gpu-1")
    prep_b, plan_b = plan(b, "gpu-2")
    inner = kube.on_patch

    def b_decides_meanwhile(name: str, patch: Any) -> None:
        if inner is not None:
            inner(name, patch)
        if name == "gpu-1" and "b" not in out:
            out["b"] = b.execute(b.create(prep_b, plan_b), prep_b, plan_b)

    kube.on_patch = b_decides_meanwhile
    out["a"] = a.execute(a.create(prep_a, plan_a), prep_a, plan_a)
    out["claims_after"] = ClusterBudget(kube, NS).claims()
    for s in (a, b):
        s.journal.close()
    return kube, out


def test_a_second_service_counts_the_first_ones_run_against_the_gpu_budget(tmp_path: Path) -> None:
    # one GPU each, at most one GPU out of service: the run of the other process takes it
    kube, out = _race(tmp_path, GuardConfig(gpu_budget=GpuBudget(max_gpus=1, max_percent=None)))
    assert out["a"].state is RunState.SUCCEEDED, out["a"].reason
    assert out["b"].state is RunState.BLOCKED
    assert "guard gpu-budget" in out["b"].reason and "gpu-1" in out["b"].reason
    assert {name for name, _, _ in kube.patches} == {"gpu-1"}
    assert out["claims_after"] == []  # every place was given back


def test_a_second_service_counts_the_first_ones_run_against_the_concurrency_limit(tmp_path: Path) -> None:
    kube, out = _race(tmp_path, GuardConfig(gpu_budget=GpuBudget(max_percent=None),
                                            concurrency=Concurrency(max_runs=1)))
    assert out["a"].state is RunState.SUCCEEDED, out["a"].reason
    assert out["b"].state is RunState.BLOCKED
    assert "guard concurrency: 1 runs in flight in the cluster (gpu-1); at most 1" in out["b"].reason
    assert {name for name, _, _ in kube.patches} == {"gpu-1"}


def test_the_claim_and_its_release_are_journaled(tmp_path: Path) -> None:
    clock = FakeClock()
    kube = FakeKube([healthy_node("gpu-1")], clock=clock)
    nodes = FakeNodes({"gpu-1": healthy_host("gpu-1")}, clock=clock)
    install_recovery_effects(kube, nodes, ready_after=0.0, gpu_after=0.0)
    kube.set_label("gpu-1", GPU_LABEL, "vm-passthrough")
    service = _service(tmp_path, kube, nodes, "one", GuardConfig(gpu_budget=GpuBudget(max_percent=None),
                                                                concurrency=Concurrency(max_runs=3)))
    (prep,) = service.targets(str(RUNBOOK), [], selector="")
    (p,) = service.plan_targets([prep], preview=False)
    run_id = service.create(prep, p)
    assert service.execute(run_id, prep, p).state is RunState.SUCCEEDED
    kinds = [e.kind for e in service.journal.events(run_id)]
    assert kinds.index("guards") < kinds.index("budget") < kinds.index("lock.acquired")
    assert kinds.index("lock.released") < kinds.index("budget.released")
    claim = next(e.data for e in service.journal.events(run_id) if e.kind == "budget")
    assert claim["granted"] is True and claim["in_flight"] == 0
    raw = kube.read_object(*LEASES, NS, BUDGET_LEASE)
    assert raw is not None and json.loads(raw["metadata"]["annotations"][CLAIMS_ANNOTATION]) == []
    service.journal.close()


# -- a queued server run whose turn comes while the budget is full waits for room -------------------


def _automatic_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wait: float) -> tuple[FakeKube, RunService, Any]:
    """An automatic (server) service on gpu-1 while another process's run on gpu-2 fills the
    concurrency limit (one run); polls every 10 ms instead of 2 s."""
    import engine.runs

    monkeypatch.setattr(engine.runs, "BUDGET_POLL_SECONDS", 0.01)
    clock = FakeClock()
    kube = FakeKube([healthy_node("gpu-1"), healthy_node("gpu-2")], clock=clock)
    nodes = FakeNodes({n: healthy_host(n) for n in ("gpu-1", "gpu-2")}, clock=clock)
    install_recovery_effects(kube, nodes, ready_after=0.0, gpu_after=0.0)
    kube.set_label("gpu-1", GPU_LABEL, "vm-passthrough")
    assert ClusterBudget(kube, NS).claim("run-other", "gpu-2", room_for(5)).granted
    acquire_node_lock(kube, "gpu-2", "run-other", namespace=NS, ttl=600)  # live: its run holds the Lease
    guards = GuardConfig(gpu_budget=GpuBudget(max_percent=None), concurrency=Concurrency(max_runs=1),
                         budget_wait=wait)
    service = _service(tmp_path, kube, nodes, "server", guards)
    service.automatic = True
    (prep,) = [t for t in service.targets(str(RUNBOOK), [], selector="") if t.node == "gpu-1"]
    (p,) = service.plan_targets([prep], preview=False)
    return kube, service, (prep, p, service.create(prep, p))


def test_a_queued_run_whose_turn_comes_while_the_budget_is_full_waits_pending_and_runs_when_room_comes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kube, service, (prep, p, run_id) = _automatic_run(tmp_path, monkeypatch, wait=30.0)
    seen: list[str] = []

    def watch_and_release() -> None:
        import time as real_time

        deadline = real_time.monotonic() + 10
        while real_time.monotonic() < deadline:
            state = service.journal.get_run(run_id).state.value
            if not seen or seen[-1] != state:
                seen.append(state)
            if any(e.kind == "budget.waiting" for e in service.journal.events(run_id)):
                real_time.sleep(0.1)  # a few polls find no room
                ClusterBudget(kube, NS).release("run-other")
                return
            real_time.sleep(0.005)

    import threading

    helper = threading.Thread(target=watch_and_release)
    helper.start()
    result = service.execute(run_id, prep, p)
    helper.join(10)
    assert result.state is RunState.SUCCEEDED, result.reason
    events = service.journal.events(run_id)
    kinds = [e.kind for e in events]
    assert kinds.count("budget.waiting") == 1 and "run.blocked" not in kinds
    waiting = next(e.data for e in events if e.kind == "budget.waiting")
    assert "guard concurrency: 1 runs in flight in the cluster (gpu-2)" in waiting["reason"]
    assert "pending" in seen  # it waited as a queued run, not as a running one
    claims = [e.data for e in events if e.kind == "budget"]
    assert [c["granted"] for c in claims] == [False, True]  # the quiet looks wrote nothing
    service.journal.close()


def test_a_queued_run_that_waited_its_bound_for_room_ends_blocked_saying_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kube, service, (prep, p, run_id) = _automatic_run(tmp_path, monkeypatch, wait=0.2)
    result = service.execute(run_id, prep, p)
    assert result.state is RunState.BLOCKED
    assert "waited 0s (guards.budget_wait) for room in the cluster's budget and none came" in result.reason
    assert "guard concurrency" in result.reason
    assert kube.patches == []  # nothing was done to gpu-1
    service.journal.close()


def test_a_person_s_run_does_not_wait_for_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _kube, service, (prep, p, run_id) = _automatic_run(tmp_path, monkeypatch, wait=30.0)
    service.automatic = False  # the CLI: refused at once, as before
    result = service.execute(run_id, prep, p)
    assert result.state is RunState.BLOCKED and "budget_wait" not in result.reason
    assert "budget.waiting" not in [e.kind for e in service.journal.events(run_id)]
    service.journal.close()


def test_a_run_waiting_for_room_when_the_server_stops_is_handed_back_pending_and_writes_nothing_more(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import time as real_time

    from engine.runs import BUDGET_HANDED_BACK

    kube, service, (prep, p, run_id) = _automatic_run(tmp_path, monkeypatch, wait=30.0)
    assert service.hand_back_waiting(run_id) is False  # not waiting (yet): nothing to hand back

    def stop_while_it_waits() -> None:
        deadline = real_time.monotonic() + 10
        while real_time.monotonic() < deadline:
            if service.hand_back_waiting(run_id):
                return
            real_time.sleep(0.005)

    helper = threading.Thread(target=stop_while_it_waits)
    helper.start()
    result = service.execute(run_id, prep, p)
    helper.join(10)
    assert (result.state, result.reason) == (RunState.PENDING, BUDGET_HANDED_BACK)
    assert service.journal.get_run(run_id).state is RunState.PENDING  # for the leader to resume
    kinds = [e.kind for e in service.journal.events(run_id)]
    assert kinds[-1] == "budget.waiting"  # nothing written after it: no state, no claim, no Lease
    assert kube.patches == []
    service.journal.close()


def test_a_run_whose_turn_comes_after_the_server_began_to_stop_does_not_wait_it_is_handed_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.runs import BUDGET_HANDED_BACK

    kube, service, (prep, p, run_id) = _automatic_run(tmp_path, monkeypatch, wait=30.0)
    service.stop_waiting()  # the server's stop began (its grace: workers still take their runs)
    result = service.execute(run_id, prep, p)
    assert (result.state, result.reason) == (RunState.PENDING, BUDGET_HANDED_BACK)
    assert service.hand_back_waiting(run_id) is True  # its wait ended handed back: the caller disowns it
    assert kube.patches == []
    service.journal.close()
