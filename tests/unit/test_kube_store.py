"""The run store interface, and its Kubernetes implementation on our fake connector.

The same contract is checked on both stores (the SQLite journal and RemediationRuns on
``FakeKube``'s object API, which keeps an API server's semantics: resourceVersions, 409 on a stale
one, a status subresource). Then what only the Kubernetes store does: a conflict re-read and
re-applied (never written over), bounded evidence, the phase and step summary ``kubectl get rr``
shows, retention; and whole runs killed at a step boundary and resumed with every effect once. The
real API server's behaviour is tested in tests/integration/test_kube_store_real_api.py.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import kube_store
from engine.errors import Conflict, JournalError, UsageError
from engine.journal import Journal, JournalSink, _process_start
from engine.kube_store import API_VERSION, CREATED_LEVELS, PLURAL, KubeRunStore
from engine.model import RunState
from engine.params import prepare_run
from engine.runs import RunService
from engine.settings import Settings
from engine.store import RunStore
from tests.fakes import FakeClock, FakeKube, FakeNodes, incident_host, incident_node, install_recovery_effects
from tests.unit.test_journal import FLAGSHIP, REPO, Died, DyingSink, World

NS = "runbook-system"


def _objects(kube: FakeKube) -> list[dict[str, Any]]:
    return [dict(o) for o in kube.objects.get((API_VERSION, PLURAL), [])]


def _obj(kube: FakeKube, run_id: str) -> dict[str, Any]:
    return next(o for o in _objects(kube) if o["metadata"]["name"] == run_id)


def _set_owner(store: RunStore, run_id: str, pid: int | None, start: str | None) -> None:
    """Make the recorded owner another process (a test's hand on the store's own record)."""
    if isinstance(store, Journal):
        with store._tx() as db:
            db.execute("UPDATE runs SET owner_pid=?, owner_start=? WHERE id=?", (pid, start, run_id))
    else:
        assert isinstance(store, KubeRunStore)
        kube = store.api
        assert isinstance(kube, FakeKube)
        obj = _obj(kube, run_id)
        obj["status"]["owner"].update({"pid": pid, "start": start})
        obj["metadata"]["resourceVersion"] = kube._next_rv()  # a write by someone else


# -- the contract, on both stores: tests/store_contract.py (tests/unit/test_store_contract.py) ---


# -- the Kubernetes store ---------------------------------------------------------------------


@pytest.fixture
def kube() -> FakeKube:
    return FakeKube()


def test_a_run_is_a_remediation_run_with_spec_once_and_progress_in_the_status(kube: FakeKube) -> None:
    store = KubeRunStore(kube, NS)
    run_id = store.create_run("gpu-node-recovery", {"node": "omen2"}, ["omen2"], source="alertmanager",
                              approval_required=True)
    spec_after_create = copy.deepcopy(_obj(kube, run_id)["spec"])
    assert spec_after_create == {"runbook": "gpu-node-recovery", "node": "omen2", "nodes": ["omen2"],
                                 "params": {"node": "omen2"}, "source": "alertmanager", "mode": "approve"}
    store.set_state(run_id, "running")
    store.append(run_id, "step.start", step="swap-off")
    store.append(run_id, "step.outcome", step="swap-off", status="failed", reason="swap still on")
    store.set_state(run_id, "failed", exit_code=1)
    obj = _obj(kube, run_id)
    created = {k: v for k, v in obj["metadata"]["labels"].items() if k.startswith("runbook.io/created-")}
    assert sorted(created) == sorted(label for label, _, _ in CREATED_LEVELS)  # list_runs reads newest first
    assert {k: v for k, v in obj["metadata"]["labels"].items() if k not in created} == {
                                         "app.kubernetes.io/managed-by": "runbook",
                                         "runbook.io/runbook": "gpu-node-recovery", "runbook.io/node": "omen2",
                                         "runbook.io/trigger": "alertmanager", "runbook.io/phase": "Failed"}
    assert obj["spec"] == spec_after_create  # every later write went to the status subresource ...
    # ... but the phase label's (issue 32: lists select by it), which write the labels only
    assert {c[1][3] for c in kube.calls if c[0] == "replace_object"} == {"status", None}
    st = obj["status"]
    assert (st["phase"], st["exitCode"]) == ("Failed", 1)
    assert [(s["id"], s["status"], s["reason"]) for s in st["steps"]] == [("swap-off", "failed", "swap still on")]
    assert "startedAt" in st and "finishedAt" in st


@pytest.mark.parametrize(("state", "phase"), list(kube_store.PHASES.items()))
def test_every_run_state_maps_to_the_crd_phase_and_back(kube: FakeKube, state: str, phase: str) -> None:
    store = KubeRunStore(kube, NS)
    run_id = store.create_run("rb", {}, ["omen2"])
    store.set_state(run_id, state)
    assert _obj(kube, run_id)["status"]["phase"] == phase
    crd = (REPO / "deploy" / "kubernetes" / "crd-remediationruns.yaml").read_text()
    assert phase in crd
    assert store.get_run(run_id).state == state


def test_a_conflicting_writer_is_re_read_and_never_written_over(kube: FakeKube) -> None:
    mine, theirs = KubeRunStore(kube, NS), KubeRunStore(kube, NS)
    run_id = mine.create_run("rb", {}, ["omen2"])
    mine.append(run_id, "step.start", step="a")  # mine's copy is now current
    raced: list[int] = []

    def other_writer(body: dict[str, Any]) -> None:
        kube.before_write = None  # once: between mine's read and mine's write, another process appends
        raced.append(theirs.append(run_id, "approval.granted", approved_by="bob"))

    kube.before_write = other_writer
    seq = mine.append(run_id, "action.intent", step="a")
    assert raced == [2] and seq == 3
    events = mine.events(run_id)
    assert [(e.seq, e.kind) for e in events] == [(1, "step.start"), (2, "approval.granted"), (3, "action.intent")]
    assert kube.writes[-1]["status"]["events"][1]["data"] == {"approved_by": "bob"}


def test_writers_that_keep_conflicting_get_an_error_and_nothing_is_written(kube: FakeKube) -> None:
    store = KubeRunStore(kube, NS)
    run_id = store.create_run("rb", {}, ["omen2"])
    before = len(store.events(run_id))
    kube.fail["replace_object"] = [Conflict("modified", status=409)] * kube_store.CONFLICT_RETRIES
    with pytest.raises(Exception, match="still changed by other writers"):
        store.append(run_id, "action.intent", step="a")
    assert len(store.events(run_id)) == before


def test_a_decision_that_may_not_write_is_taken_on_a_fresh_read_not_on_this_process_copy(kube: FakeKube) -> None:
    server, other = KubeRunStore(kube, NS), KubeRunStore(kube, NS)
    run_id = server.create_run("rb", {}, ["omen2"], approval_required=True)
    server.set_plan(run_id, {"x": 1}, "sha256:one")  # server's copy: pending
    other.set_state(run_id, "waiting-approval")  # another process parked it meanwhile
    rec = server.record_approval(run_id, "sha256:one", "alice")  # not refused on server's stale copy
    assert (rec.state, rec.approved_by) == ("waiting-approval", "alice")


def test_large_evidence_is_truncated_and_the_object_stays_within_its_budget(kube: FakeKube) -> None:
    store = KubeRunStore(kube, NS)
    run_id = store.create_run("rb", {}, ["omen2"], state="running")
    store.append(run_id, "action.result", step="s", ok=True, stdout="x" * 100_000)
    data = store.events(run_id)[-1].data
    assert data["ok"] is True and len(data["stdout"]) < 2100 and "98000 characters truncated" in data["stdout"]
    store.append(run_id, "verify.result", step="s", holds=True, lines=[f"line {i} " + "y" * 50 for i in range(2000)])
    data = store.events(run_id)[-1].data
    assert data["holds"] is True and data["truncated"] is True and "truncated" in str(data["lines"])
    assert len(json.dumps(data)) <= kube_store.EVENT_MAX + 100
    for i in range(80):  # a long run with big evidence: old events are compacted, never dropped
        store.append(run_id, "step.start", step=f"s{i}")
        store.append(run_id, "step.outcome", step=f"s{i}", status="succeeded", reason="ok",
                     evidence={f"k{j}": "z" * 1900 for j in range(4)})
    obj = _obj(kube, run_id)
    assert len(json.dumps(obj)) <= kube_store.OBJECT_BUDGET
    assert obj["status"]["compactedEvents"] > 0
    events = store.events(run_id)
    assert [e.seq for e in events] == list(range(1, 163))
    assert store.progress(run_id).completed == frozenset(f"s{i}" for i in range(80))


def test_a_plan_too_large_for_one_object_is_refused_and_not_recorded(kube: FakeKube) -> None:
    store = KubeRunStore(kube, NS)
    run_id = store.create_run("rb", {}, ["omen2"])
    with pytest.raises(JournalError, match="KiB"):
        store.set_plan(run_id, {"blob": ["q" * 1000] * 400}, "sha256:big")
    assert store.get_run(run_id).plan is None


def test_a_dead_owner_is_recorded_as_interrupted_for_kubectl_unless_the_run_changed_meanwhile(kube: FakeKube) -> None:
    store = KubeRunStore(kube, NS)
    run_id = store.create_run("rb", {}, ["omen2"], state="running")
    _set_owner(store, run_id, 999999, "a-boot-long-gone/1")
    assert store.get_run(run_id).state == "interrupted"
    st = _obj(kube, run_id)["status"]
    assert st["phase"] == "Interrupted" and st["owner"]["pid"] is None and "runbook resume" in st["message"]

    other = store.create_run("rb", {}, ["omen2"], state="running")
    _set_owner(store, other, 999999, "a-boot-long-gone/1")
    def resumed_meanwhile(body: dict[str, Any]) -> None:
        kube.before_write = None
        _set_owner(store, other, os.getpid(), _process_start(os.getpid()))

    kube.before_write = resumed_meanwhile
    assert store.get_run(other).state == "interrupted"  # what it read; the write lost the race
    assert _obj(kube, other)["status"]["phase"] == "Running"  # a resume's claim is never written over


# -- whole runs through RunService on the Kubernetes store ---------------------------------------


@pytest.fixture
def kube_world(tmp_path: Path) -> Iterator[World]:
    clock = FakeClock()
    kube = FakeKube([incident_node()], clock=clock)
    nodes = FakeNodes({"omen2": incident_host()}, clock=clock)
    install_recovery_effects(kube, nodes, ready_after=20.0, gpu_after=40.0)
    settings = Settings(store="kubernetes", store_namespace=NS, runbooks_dir=REPO / "runbooks",
                        journal=tmp_path / "must-not-exist.sqlite")
    settings._cache.update(kube=kube, nodes=nodes)  # our fakes instead of the real connectors
    service = RunService(settings, executor_options={"clock": clock, "sleep": clock.sleep, "wall": clock.wall})
    assert isinstance(service.journal, KubeRunStore)
    loaded = service.load(str(FLAGSHIP))
    yield World(clock, kube, nodes, service, prepare_run(loaded, {"node": "omen2"}))
    assert not (tmp_path / "must-not-exist.sqlite").exists()


@pytest.mark.parametrize(("step", "phase"), [("relabel-container", "after-action"), ("swap-off", "before-action"),
                                             ("restart-kubelet", "after-verify")])
def test_a_run_on_the_kubernetes_store_killed_at_a_step_boundary_resumes_doing_each_effect_once(
        kube_world: World, step: str, phase: str) -> None:
    world = kube_world
    plan = world.plan()
    store = world.service.journal
    run_id = world.service.create(world.prepared, plan)
    store.set_state(run_id, RunState.RUNNING.value)
    verify_count = len(next(s for s in world.prepared.runbook.steps if s.id == step).verify)
    with pytest.raises(Died):
        world.executor(DyingSink(JournalSink(store, run_id), step, phase, verify_count)).execute(
            plan, world.prepared.runbook, world.prepared.params)
    _set_owner(store, run_id, os.getpid(), "a-boot-long-gone/1")
    assert store.get_run(run_id).state == "interrupted"
    assert _obj(world.kube, run_id)["status"]["phase"] == "Interrupted"
    effect = {"relabel-container": "label", "swap-off": "swap-off", "restart-kubelet": "restart"}[step]
    assert world.effects()[effect] == (0 if phase == "before-action" else 1)
    result = world.resume(run_id)
    assert result.state is RunState.SUCCEEDED, result.reason
    assert world.effects() == {"label": 1, "swap-off": 1, "restart": 1}
    st = _obj(world.kube, run_id)["status"]
    assert (st["phase"], st["exitCode"]) == ("Succeeded", 0)
    summary = {s["id"]: s["status"] for s in st["steps"]}
    # bind-gpus: the flagship's every-GPU-on-nvidia step, a no-op on one-GPU omen2
    assert set(summary) == {"relabel-container", "swap-off", "bind-gpus", "restart-kubelet"}
    assert set(summary.values()) <= {"succeeded", "skipped"}  # skipped: its effect was already there
    resumed = next(e.data for e in store.events(run_id) if e.kind == "run.resume")
    assert resumed["started_without_outcome"] == step


def test_runbook_runs_prune_applies_the_retention_once_and_refuses_a_bad_age(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from engine.cli import main

    path = tmp_path / "j.sqlite"
    journal = Journal(path)
    ids = [journal.create_run("rb", {"i": i}, ["omen2"]) for i in range(4)]
    for run_id in ids[:3]:
        journal.set_state(run_id, "failed", exit_code=1)
    journal.close()
    bad = CliRunner().invoke(main, ["runs", "prune", "--journal", str(path), "--max-age", "a week"])
    assert bad.exit_code == 2 and "--max-age" in bad.output
    done = CliRunner().invoke(main, ["runs", "prune", "--journal", str(path), "--keep", "1", "-o", "json"])
    assert done.exit_code == 0, done.output
    assert sorted(json.loads(done.output)["deleted"]) == sorted(ids[:2])
    assert {r.id for r in Journal(path).list_runs()} == {ids[2], ids[3]}


def test_serve_records_paged_runs_as_remediation_runs_with_the_kubernetes_store(tmp_path: Path) -> None:
    from engine.serve.cli import load_run_starter
    from engine.serve.config import ServeConfig
    from engine.serve.starter import RunRequest

    kube = FakeKube([incident_node()])
    settings = Settings(store="kubernetes", store_namespace="ops", runbooks_dir=REPO / "runbooks",
                        journal=tmp_path / "unused.sqlite")
    settings._cache.update(kube=kube)
    starter = load_run_starter(settings, ServeConfig())
    ticket = starter.submit(RunRequest(runbook="gpu-node-recovery", params={}, node="omen2", mode="approve",
                                       source="alertmanager", reason="alertmanager: KubeNodeNotReady{node=omen2}"))
    obj = next(o for o in _objects(kube) if o["metadata"]["name"] == ticket.run_id)
    assert obj["metadata"]["namespace"] == "ops"
    assert (obj["spec"]["source"], obj["spec"]["mode"], obj["status"]["phase"]) == (
        "alertmanager", "approve", "Pending")
    assert [r["id"] for r in starter.runs()] == [ticket.run_id]
    assert starter.run(ticket.run_id)["reason"] == "alertmanager: KubeNodeNotReady{node=omen2}"
    assert not (tmp_path / "unused.sqlite").exists()


def test_a_store_namespace_that_is_no_namespace_name_is_a_usage_error_before_any_request() -> None:
    kube = FakeKube()
    settings = Settings(store="kubernetes", store_namespace="Runbook_System")
    settings._cache.update(kube=kube)
    with pytest.raises(UsageError, match="--store-namespace 'Runbook_System': not a namespace name"):
        settings.open_journal()
    assert kube.calls == []
