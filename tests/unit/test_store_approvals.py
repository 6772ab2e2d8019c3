"""Approvals through the store that cannot be forged (issue 25 item 3): `runbook approve --store
kubernetes` by an approver leaves a CertificateSigningRequest whose author the API server records;
the server's leader records the approval only for an author RBAC lets approve, for exactly the plan
digest named, never for the run's requester, sealed (engine.integrity)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine import store_approvals
from engine.connectors.base import AccessReviewResult
from engine.params import prepare_run
from engine.serve_starter import JournalRunStarter
from engine.settings import Settings
from tests.fakes import FakeKube, saved_plan

REPO = Path(__file__).resolve().parents[2]
NS = "runbook-system"
ALICE = f"system:serviceaccount:{NS}:approver-alice"


class ReviewingKube(FakeKube):
    """The fake API server, answering SubjectAccessReviews: only alice may approve, in NS only."""

    def __init__(self) -> None:
        super().__init__()
        self.reviews: list[dict[str, Any]] = []

    def review_access(self, **kw: Any) -> AccessReviewResult:
        self.reviews.append(kw)
        return AccessReviewResult(allowed=kw["user"] == ALICE and kw["namespace"] == NS and kw["verb"] == "approve")


def _csr(kube: FakeKube, run_id: str, digest: str, author: str) -> str:
    body = store_approvals.request_body(NS, run_id, digest)
    body["spec"].update({"username": author, "uid": "u-1", "groups": ["system:authenticated"]})  # the API server's
    kube.create_object(store_approvals.API_VERSION, store_approvals.PLURAL, "", body)
    return str(body["metadata"]["name"])


def _waiting_run(tmp_path: Path) -> tuple[ReviewingKube, JournalRunStarter, str, str]:
    kube = ReviewingKube()
    settings = Settings(store="kubernetes", store_namespace=NS, runbooks_dir=REPO / "runbooks",
                        journal=tmp_path / "unused.sqlite")
    settings._cache["kube"] = kube
    starter = JournalRunStarter(settings, kube=lambda: kube)
    prepared = prepare_run(starter._runbooks["gpu-node-recovery"], {"node": "omen2"})
    run_id = starter.service.create(prepared, None, source="alertmanager", approval_required=True,
                                    requested_by="alertmanager")
    plan = saved_plan("omen2")
    starter.service.record_plan(run_id, plan)
    starter.service.park(run_id, plan, "approve-mode run")
    return kube, starter, run_id, plan.digest


def test_an_approval_request_by_an_approver_is_recorded_sealed_with_its_author_as_the_api_server_named_it(
        tmp_path: Path) -> None:
    kube, starter, run_id, digest = _waiting_run(tmp_path)
    name = _csr(kube, run_id, digest, ALICE)
    assert starter.recover() == [run_id]  # approved: queued for execution
    rec = starter.journal.get_run(run_id)
    assert (rec.approved_by, rec.approved_digest) == (ALICE, digest)
    assert starter.service.integrity.problem(run_id) is None
    assert any(e.kind == "approval.request" and e.data["request"] == name for e in starter.journal.events(run_id))
    assert kube.reviews[0]["groups"] == ("system:authenticated",)


def test_a_request_by_someone_rbac_does_not_let_approve_or_by_the_requester_or_for_another_digest_approves_nothing(
        tmp_path: Path) -> None:
    kube, starter, run_id, digest = _waiting_run(tmp_path)
    _csr(kube, run_id, digest, "mallory")
    _csr(kube, run_id, digest, "alertmanager")  # the run's requester
    _csr(kube, run_id, "e" * 64, ALICE)  # another plan
    assert starter.recover() == []
    rec = starter.journal.get_run(run_id)
    assert rec.approved_by is None and rec.state == "waiting-approval"
    refused = [e.data["reason"] for e in starter.journal.events(run_id) if e.kind == "approval.refused"]
    assert len(refused) == 2
    assert any("mallory may not approve" in r for r in refused)
    assert any("requested this run" in r for r in refused)


def test_an_object_of_another_signer_or_a_name_not_ours_is_no_approval() -> None:
    body = store_approvals.request_body(NS, "r-1", "d" * 64)
    body["spec"]["username"] = ALICE
    assert store_approvals.parse(body) is not None
    assert store_approvals.parse({**body, "spec": {**body["spec"], "signerName": "kubernetes.io/kubelet-serving"}}) \
        is None
    assert store_approvals.parse({**body, "metadata": {"name": "runbook-approval.x.r-1"}}) is None
    assert store_approvals.parse({**body, "spec": {**body["spec"], "username": ""}}) is None
