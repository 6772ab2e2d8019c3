"""Run integrity (issue 25 items 1-4, 8) on our fakes: only runs the engine recorded, unchanged
since, are executed; the plan that runs is the approved plan for the run's node; an approval
written into the store by hand approves nothing; node Leases leave kube-system in cluster mode."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.integrity import (
    KEY_SECRET,
    SEAL_EVENT,
    IntegrityError,
    Keyring,
    RunIntegrity,
    keyring_for,
    plan_problems,
)
from engine.kube_store import KubeRunStore
from engine.model import Plan, RunState
from engine.params import PreparedRun
from engine.run_guards import GpuBudget, GuardConfig
from engine.runs import RunService
from engine.settings import Settings
from tests.fakes import (
    FakeClock,
    FakeKube,
    FakeNodes,
    RecordingSink,
    incident_host,
    incident_node,
    install_recovery_effects,
)

DATA = Path(__file__).parent / "data"
RUNBOOK = DATA / "runbooks" / "gpu-recovery.yaml"
NS = "runbook-system"


@dataclass
class Lab:
    kube: FakeKube
    nodes: FakeNodes
    service: RunService
    path: Path

    def prepared(self, node: str) -> PreparedRun:
        return self.service.targets(str(RUNBOOK), [], node=node)[0]

    def plan(self, node: str) -> tuple[PreparedRun, Plan]:
        prepared = self.prepared(node)
        return prepared, self.service.plan(prepared, preview=False)

    def changed(self) -> bool:
        return bool(self.kube.patches) or any(not r["check"] for r in self.nodes.runs)


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    clock = FakeClock()
    kube = FakeKube([incident_node("omen2"), incident_node("omen3")], clock=clock)
    nodes = FakeNodes({"omen2": incident_host("omen2"), "omen3": incident_host("omen3")}, clock=clock)
    install_recovery_effects(kube, nodes, ready_after=0.0, gpu_after=0.0)
    settings = Settings(journal=tmp_path / "journal.sqlite", inventory=tmp_path / "hosts.yml",
                        runbooks_dir=DATA / "runbooks")
    settings._cache.update(kube=kube, nodes=nodes)
    service = RunService(settings, guards=GuardConfig(gpu_budget=GpuBudget(max_percent=None)),
                         executor_options={"clock": clock, "sleep": clock.sleep, "wall": clock.wall})
    yield Lab(kube, nodes, service, tmp_path / "journal.sqlite")
    service.journal.close()


def _blocked_reason(lab: Lab, run_id: str) -> str:
    rec = lab.service.journal.get_run(run_id)
    assert rec.state == RunState.BLOCKED.value
    return str(next(e.data["reason"] for e in reversed(lab.service.journal.events(run_id))
                    if e.kind == "run.blocked"))


# -- item 1: only runs the engine recorded are executed ---------------------------------------------


def test_a_run_recorded_in_the_store_by_another_tool_is_blocked_naming_the_missing_seal_and_changes_nothing(
        lab: Lab) -> None:
    prepared, plan = lab.plan("omen2")
    journal = lab.service.journal
    forged = journal.create_run(plan.runbook, dict(plan.params), ["omen2"], source="alertmanager")
    journal.set_plan(forged, plan.model_dump(mode="json"), plan.digest)
    result = lab.service.execute(forged, prepared, plan, approved=True, wait_approval=False, resume=True)
    assert result.state is RunState.BLOCKED and result.exit_code == 3
    assert "carries no seal" in _blocked_reason(lab, forged)
    assert not lab.changed()
    assert "lock.acquired" not in [e.kind for e in journal.events(forged)]  # no Lease, no guards


def test_a_run_the_engine_recorded_executes_and_a_later_edit_of_its_params_is_named_and_refused(
        lab: Lab) -> None:
    prepared, plan = lab.plan("omen2")
    run_id = lab.service.create(prepared, plan)
    assert lab.service.integrity.problem(run_id) is None
    assert [e.kind for e in lab.service.journal.events(run_id)].count(SEAL_EVENT) == 2  # at create, at plan
    with sqlite3.connect(lab.path) as db:  # someone with write access to the journal edits the spec
        db.execute("UPDATE runs SET params=? WHERE id=?", ('{"node": "omen3"}', run_id))
    result = lab.service.execute(run_id, prepared, plan, approved=True, wait_approval=False)
    assert result.state is RunState.BLOCKED
    reason = _blocked_reason(lab, run_id)
    assert "params changed after runbook recorded them" in reason, reason
    assert not lab.changed()


def test_a_change_slipped_in_before_the_engine_seals_its_own_write_is_never_sealed(lab: Lab) -> None:
    prepared, plan = lab.plan("omen2")
    run_id = lab.service.create(prepared, None, source="alertmanager")  # the server's submit: no plan yet
    with sqlite3.connect(lab.path) as db:  # edited while the server plans
        db.execute("UPDATE runs SET params=? WHERE id=?", ('{"node": "omen3"}', run_id))
    with pytest.raises(IntegrityError, match="params changed in the store by someone else; not sealed"):
        lab.service.record_plan(run_id, plan)
    assert "params" in str(lab.service.integrity.problem(run_id))


def test_a_seal_whose_field_hashes_were_rewritten_is_named_altered(lab: Lab) -> None:
    prepared, plan = lab.plan("omen2")
    run_id = lab.service.create(prepared, plan)
    with sqlite3.connect(lab.path) as db:
        ((seq, data),) = db.execute("SELECT seq, data FROM events WHERE run_id=? AND kind='run.seal' "
                                    "ORDER BY seq DESC LIMIT 1", (run_id,)).fetchall()
        forged = data.replace('"node": "', '"node": "0')
        db.execute("UPDATE events SET data=? WHERE run_id=? AND seq=?", (forged, run_id, seq))
    assert "seal was altered" in str(lab.service.integrity.problem(run_id))


def test_a_sealed_run_runs_to_its_end(lab: Lab) -> None:
    prepared, plan = lab.plan("omen2")
    run_id = lab.service.create(prepared, plan)
    result = lab.service.execute(run_id, prepared, plan, approved=True, wait_approval=False)
    assert result.state is RunState.SUCCEEDED, result.reason
    assert lab.changed()


# -- item 2: the plan that runs is the plan approved, for the node paged -----------------------------


def test_a_recorded_plan_pointed_at_another_node_with_consistent_digests_and_approval_is_refused(
        lab: Lab) -> None:
    prepared, plan = lab.plan("omen2")
    run_id = lab.service.create(prepared, plan, approval_required=True)
    lab.service.park(run_id, plan, "approve-mode run")
    _, other = lab.plan("omen3")  # a well-formed plan for a healthy bystander, digest consistent
    journal = lab.service.journal
    journal.set_plan(run_id, other.model_dump(mode="json"), other.digest)
    journal.record_approval(run_id, other.digest, "someone")  # written into the store by hand
    again, stored = lab.service.prepare_from_record(run_id)
    assert stored.node == "omen3"
    result = lab.service.execute(run_id, again, stored, approved=True, wait_approval=False, resume=True)
    assert result.state is RunState.BLOCKED
    reason = _blocked_reason(lab, run_id)
    assert "plan_digest" in reason and "approved_by" in reason, reason
    assert not lab.changed()


def test_plan_problems_recompute_the_digest_and_hold_the_plan_to_the_run_s_node_runbook_and_params(
        lab: Lab) -> None:
    prepared, plan = lab.plan("omen2")
    run_id = lab.service.create(prepared, plan)
    rec = lab.service.journal.get_run(run_id)
    assert plan_problems(plan, rec, prepared.params) == []
    edited = plan.model_copy(update={"params": {**plan.params, "node": "omen3"}})  # digest left as it was
    problems = plan_problems(edited, rec, prepared.params)
    assert any("hashes to" in p for p in problems) and any("params" in p for p in problems)
    _, other = lab.plan("omen3")
    assert any("for node 'omen3'" in p for p in plan_problems(other, rec))
    assert any("params to execute with" in p for p in plan_problems(plan, rec, {"node": "omen3"}))


def test_the_executor_refuses_a_plan_whose_content_no_longer_hashes_to_its_digest(lab: Lab) -> None:
    from engine.errors import PlanError
    from engine.execution import Executor

    prepared, plan = lab.plan("omen2")
    edited = plan.model_copy(update={"node": "omen3"})  # the digest left as reviewed
    executor = Executor(lab.kube, lab.nodes, events=RecordingSink(), playbooks_dir=prepared.loaded.playbooks_dir,
                        cancel=threading.Event())
    with pytest.raises(PlanError, match="not the plan that was reviewed"):
        executor.execute(edited, prepared.runbook, prepared.params)
    assert not lab.changed()


def test_a_resumed_run_takes_its_params_from_the_approved_plan(lab: Lab) -> None:
    prepared, plan = lab.plan("omen2")
    run_id = lab.service.create(prepared, plan)
    again, stored = lab.service.prepare_from_record(run_id)
    assert dict(again.params) == dict(stored.params) and again.node == stored.node == "omen2"


# -- item 3: approvals cannot be forged through the store ---------------------------------------------


def test_an_approval_written_into_the_store_by_hand_is_refused_and_the_service_s_own_is_sealed(lab: Lab) -> None:
    prepared, plan = lab.plan("omen2")
    journal = lab.service.journal
    forged = lab.service.create(prepared, plan, approval_required=True, source="alertmanager")
    lab.service.park(forged, plan, "approve-mode run")
    journal.record_approval(forged, plan.digest, "mallory")
    problem = lab.service.integrity.problem(forged)
    assert problem is not None and "approved_digest" in problem and "approved_by" in problem
    assert lab.service.wait_for_approval(forged, plan.digest, timeout=0) is None  # no approval at all

    honest = lab.service.create(prepared, plan, approval_required=True, source="alertmanager")
    lab.service.park(honest, plan, "approve-mode run")
    lab.service.approve(honest, plan.digest, "alice")
    assert lab.service.integrity.problem(honest) is None
    assert lab.service.wait_for_approval(honest, plan.digest, timeout=0) is True
    with pytest.raises(IntegrityError, match="refused"):  # approving a forged run never seals it
        lab.service.approve(forged, plan.digest, "alice")


# -- keys ---------------------------------------------------------------------------------------------


def test_the_key_file_is_created_0600_beside_the_journal_and_refused_when_others_can_read_it(lab: Lab) -> None:
    ring = lab.service.integrity.keys()
    key = Path(str(lab.path) + ".key")
    assert key.stat().st_mode & 0o777 == 0o600
    assert keyring_for(lab.service.journal) == ring  # read back, not made again
    key.chmod(0o644)
    with pytest.raises(IntegrityError, match="readable by others"):
        keyring_for(lab.service.journal)


def test_a_rotated_ring_verifies_old_seals_and_signs_with_the_new_key(lab: Lab) -> None:
    prepared, plan = lab.plan("omen2")
    old_run = lab.service.create(prepared, plan)
    old = lab.service.integrity.keys()
    rotated = Keyring({**old.keys, "k2": Keyring.generate("k2").keys["k2"]}, "k2")
    integrity = RunIntegrity(lab.service.journal, rotated)
    assert integrity.problem(old_run) is None
    lab.service.integrity = integrity
    new_run = lab.service.create(prepared, plan)
    assert lab.service.journal.events(new_run)[-1].data["key"] == "k2"
    # the rotation's last step: k1 leaves the ring (the key file, as an operator edits it)
    Path(str(lab.path) + ".key").write_text(Keyring({"k2": rotated.keys["k2"]}, "k2").to_json())
    assert "key 'k1'" in str(RunIntegrity(lab.service.journal).problem(old_run))
    assert RunIntegrity(lab.service.journal).problem(new_run) is None


def test_the_kubernetes_store_s_key_is_a_secret_created_once_and_a_kubectl_made_run_is_blocked_with_an_event(
        ) -> None:
    kube = FakeKube()
    store = KubeRunStore(kube, NS)
    ring = keyring_for(store)
    assert keyring_for(KubeRunStore(kube, NS)) == ring  # a second replica reads the same Secret
    assert kube.read_object("v1", "secrets", NS, KEY_SECRET) is not None
    kube.create_object("runbook.io/v1alpha1", "remediationruns", NS, {  # as `kubectl create -f` would
        "apiVersion": "runbook.io/v1alpha1", "kind": "RemediationRun", "metadata": {"name": "r-evil"},
        "spec": {"runbook": "gpu-node-recovery", "node": "omen3", "nodes": ["omen3"], "params": {"node": "omen3"},
                 "source": "alertmanager", "mode": "auto"}})
    integrity = RunIntegrity(store)
    why = integrity.problem("r-evil")
    assert why is not None and "not created by runbook" in why
    integrity.block("r-evil", f"run r-evil refused, nothing done: {why}")
    assert store.get_run("r-evil").state == "blocked"
    (event,) = kube.objects[("v1", "events")]
    assert (event["reason"], event["type"], event["involvedObject"]["name"]) == (
        "RunIntegrityRefused", "Warning", "r-evil")


# -- item 8: node Leases in the store namespace in cluster mode -----------------------------------------


def test_node_leases_live_in_the_store_namespace_in_cluster_mode_and_in_kube_system_otherwise() -> None:
    assert Settings(store="kubernetes", store_namespace="ops").lease_namespace == "ops"
    assert Settings().lease_namespace == "kube-system"
    assert Settings(store="kubernetes", namespace="elsewhere").lease_namespace == "elsewhere"


def test_concurrent_first_uses_of_the_key_file_agree_on_one_ring(tmp_path: Path) -> None:
    from engine.journal import Journal

    journal = Journal(tmp_path / "j.sqlite")
    rings: list[Keyring] = []

    def read() -> None:
        rings.append(keyring_for(journal))

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(rings) == 4 and all(r == rings[0] for r in rings)
    journal.close()


# -- item 4: an automatic run the server now holds for approval stays held ------------------------------


def test_a_run_the_server_made_wait_for_approval_is_sealed_so_and_removing_that_record_is_refused(
        tmp_path: Path) -> None:
    from engine.params import prepare_run
    from engine.serve_starter import JournalRunStarter

    repo = Path(__file__).resolve().parents[2]
    starter = JournalRunStarter(Settings(journal=tmp_path / "j.sqlite", runbooks_dir=repo / "runbooks"))
    prepared = prepare_run(starter._runbooks["gpu-node-recovery"], {"node": "omen2"})
    run_id = starter.service.create(prepared, None, source="alertmanager")
    starter.require_approval(run_id, "the configuration (force_mode) makes this runbook approve-mode")
    assert starter.run(run_id)["approval_required"] is True
    assert starter.service.integrity.problem(run_id) is None
    with sqlite3.connect(tmp_path / "j.sqlite") as db:  # someone deletes the record of it
        db.execute("DELETE FROM events WHERE run_id=? AND kind='approval.required'", (run_id,))
    assert "approval_required" in str(starter.service.integrity.problem(run_id))


def test_an_approval_recorded_event_forged_into_the_store_does_not_count_toward_a_two_approver_policy(
        lab: Lab) -> None:
    from engine.approval_policy import load_approval_config

    cfg = lab.path.parent / "guards.yaml"
    cfg.write_text("approvals:\n  policies:\n    - {min_approvers: 2}\n")
    lab.service.settings._cache["approvals"] = load_approval_config(cfg)
    prepared, plan = lab.plan("omen2")
    run_id = lab.service.create(prepared, plan, approval_required=True, source="alertmanager")
    lab.service.park(run_id, plan, "approve-mode run")
    lab.service.journal.append(run_id, "approval.recorded", by="bob", plan_digest=plan.digest, roles=[])
    with pytest.raises(IntegrityError, match="approvals changed"):
        lab.service.approve(run_id, plan.digest, "alice")
    assert lab.service.journal.get_run(run_id).approved_digest is None
