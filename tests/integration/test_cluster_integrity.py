"""The store is no control surface (issue 25 items 1-3), on the real 1.20 API server with the base's
manifests: a RemediationRun created with kubectl by an identity that may create them starts
nothing and changes nothing (the audit log: the engine's ServiceAccount only records it Blocked and
an Event); the approver role can no longer edit a run's status; a status edited with an admin
identity to claim an approval is detected before any action; and `runbook approve --store
kubernetes` by an approver leaves a request whose author the API server records, which the
server verifies (SubjectAccessReview) and records sealed.

The server side is the engine's own ``JournalRunStarter`` (what `runbook serve` runs) in this
process, with the base's `runbook` ServiceAccount token: it creates the run key Secret at first
start, as a real first start does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.connectors.kube import KubeConnector
from engine.errors import Forbidden
from engine.integrity import KEY_SECRET
from engine.lab.controlplane import ControlPlane
from engine.lab.kubectl import Kubectl
from engine.params import prepare_run
from engine.serve_starter import JournalRunStarter
from engine.settings import Settings
from tests.fakes import saved_plan
from tests.integration.audit_helpers import is_phase_label_write

pytestmark = [pytest.mark.integration, pytest.mark.keep_cluster]

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "deploy" / "kubernetes"
NS = "runbook-system"
SA_USER = f"system:serviceaccount:{NS}:runbook"
ALICE = f"system:serviceaccount:{NS}:approver-alice"
WRITER_ROLE = """
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: rr-writer, namespace: runbook-system}
rules:
  - apiGroups: [runbook.io]
    resources: [remediationruns]
    verbs: [get, list, create]
  - apiGroups: [runbook.io]
    resources: [remediationruns/status]
    verbs: [get, update, patch]
"""
FORGED = {"apiVersion": "runbook.io/v1alpha1", "kind": "RemediationRun",
          "metadata": {"name": "r-forged-omen3", "namespace": NS},
          "spec": {"runbook": "gpu-node-recovery", "node": "omen3", "nodes": ["omen3"], "params": {"node": "omen3"},
                   "source": "alertmanager", "mode": "auto"}}


@pytest.fixture(scope="module")
def cluster(kubectl: Kubectl, control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, Any]]:
    for name in ("namespace.yaml", "crd-remediationruns.yaml", "serviceaccount.yaml", "rbac.yaml",
                 "approver-rbac.yaml"):
        kubectl("apply", "-f", str(BASE / name))
    kubectl("wait", "--for=condition=Established", "crd/remediationruns.runbook.io", "--timeout=30s")
    kubectl("apply", "-f", "-", input=WRITER_ROLE)
    for sa in ("rr-writer", "approver-alice"):
        kubectl("-n", NS, "create", "serviceaccount", sa, check=False)
    kubectl("-n", NS, "create", "rolebinding", "rr-writer", "--role=rr-writer", f"--serviceaccount={NS}:rr-writer",
            check=False)
    kubectl("-n", NS, "create", "rolebinding", "alice-approves-integrity", "--clusterrole=runbook-approver",
            f"--serviceaccount={NS}:approver-alice", check=False)
    for role in ("runbook-approver-identity", "runbook-approver-requests"):
        kubectl("create", "clusterrolebinding", f"alice-{role}", f"--clusterrole={role}",
                f"--serviceaccount={NS}:approver-alice", check=False)
    kubectl("-n", NS, "delete", "secret", KEY_SECRET, "--ignore-not-found")  # the server's first start makes it
    home = tmp_path_factory.mktemp("integrity")
    paths = {sa: control_plane.service_account_kubeconfig(NS, sa, home / sa)
             for sa in ("runbook", "rr-writer", "approver-alice")}
    settings = Settings(kubeconfig=str(paths["runbook"]), store="kubernetes", store_namespace=NS,
                        runbooks_dir=REPO / "runbooks", journal=home / "unused.sqlite")
    mark = control_plane.audit_mark()
    starter = JournalRunStarter(settings)  # first start: the run key Secret is created here
    try:
        yield {"paths": paths, "starter": starter, "home": home, "first_start": mark}
    finally:
        settings.close()
        kubectl("-n", NS, "delete", "rr", "--all", check=False)
        kubectl("delete", "csr", "-l", "runbook.io/approval=true", check=False)
        for role in ("runbook-approver-identity", "runbook-approver-requests"):
            kubectl("delete", "clusterrolebinding", f"alice-{role}", "--ignore-not-found", check=False)
        kubectl("-n", NS, "delete", "rolebinding", "rr-writer", "alice-approves-integrity", "--ignore-not-found",
                check=False)
        kubectl("-n", NS, "delete", "role", "rr-writer", "--ignore-not-found", check=False)
        kubectl("-n", NS, "delete", "serviceaccount", "rr-writer", "approver-alice", "--ignore-not-found", check=False)


def _rr(kubectl: Kubectl, name: str) -> dict[str, Any]:
    return dict(kubectl.json("-n", NS, "get", "rr", name))


def _effects(plane: ControlPlane, since: int) -> list[tuple[str, str, str]]:
    """What the engine's ServiceAccount changed since ``since`` beyond recording runs (their status,
    their phase label with the spec untouched, Events): (verb, resource, name)."""
    out = []
    for e in plane.mutations(since=since, user=SA_USER):
        if is_phase_label_write(e):
            continue
        ref = e.get("objectRef") or {}
        resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        if resource not in ("remediationruns/status", "events"):
            out.append((e["verb"], resource, ref.get("name", "")))
    return out


def test_the_server_creates_its_run_key_secret_at_first_start(cluster: dict[str, Any],
                                                              control_plane: ControlPlane) -> None:
    made = [e for e in control_plane.mutations(since=cluster["first_start"], user=SA_USER)
            if (e.get("objectRef") or {}).get("resource") == "secrets"]
    assert [(e["verb"], e["objectRef"]["name"]) for e in made] == [("create", KEY_SECRET)]


def test_a_run_created_with_kubectl_by_an_identity_that_may_create_them_starts_nothing_and_changes_nothing(
        cluster: dict[str, Any], control_plane: ControlPlane, kubectl: Kubectl) -> None:
    writer = Kubectl(cluster["paths"]["rr-writer"], cluster["home"])
    writer("create", "-f", "-", input=json.dumps(FORGED))
    mark = control_plane.audit_mark()
    starter: JournalRunStarter = cluster["starter"]
    assert starter.recover() == []  # the leader's sweep: never claimed, never queued
    outcome = starter.execute(FORGED["metadata"]["name"])  # as if a worker were handed it anyway
    assert outcome.state == "blocked", outcome  # the sweep blocked it already: "already finished"
    rr = _rr(kubectl, FORGED["metadata"]["name"])
    assert rr["status"]["phase"] == "Blocked"
    assert "not created by runbook" in rr["status"]["message"]
    events = kubectl.json("-n", NS, "get", "events", "--field-selector",
                          f"involvedObject.name={FORGED['metadata']['name']}")["items"]
    assert [(e["reason"], e["type"]) for e in events][:1] == [("RunIntegrityRefused", "Warning")], events
    assert _effects(control_plane, mark) == []  # no Lease, no node, no pod: only the run's record and an Event


def test_the_approver_role_can_no_longer_edit_a_run_s_status(cluster: dict[str, Any], kubectl: Kubectl) -> None:
    starter: JournalRunStarter = cluster["starter"]
    run_id, digest = _waiting_run(starter)
    alice = KubeConnector(kubeconfig=str(cluster["paths"]["approver-alice"]))
    obj = alice.read_object("runbook.io/v1alpha1", "remediationruns", NS, run_id)
    assert obj is not None
    obj["status"]["approval"] = {"by": ALICE, "at": "2026-12-03T00:00:00.000000Z", "digest": digest}
    with pytest.raises(Forbidden, match="remediationruns/status"):
        alice.replace_object("runbook.io/v1alpha1", "remediationruns", NS, obj, subresource="status")
    assert _rr(kubectl, run_id)["status"].get("approval") is None


def test_a_status_edited_with_an_admin_identity_to_claim_an_approval_is_refused_before_any_action(
        cluster: dict[str, Any], control_plane: ControlPlane, kubectl: Kubectl) -> None:
    starter: JournalRunStarter = cluster["starter"]
    run_id, digest = _waiting_run(starter)
    admin = KubeConnector(kubeconfig=str(control_plane.kubeconfig))
    obj = admin.read_object("runbook.io/v1alpha1", "remediationruns", NS, run_id)
    assert obj is not None
    obj["status"]["approval"] = {"by": ALICE, "at": "2026-12-03T00:00:00.000000Z", "digest": digest}
    admin.replace_object("runbook.io/v1alpha1", "remediationruns", NS, obj, subresource="status")
    mark = control_plane.audit_mark()
    assert starter.recover() == []  # approved, says the store: refused all the same
    rr = _rr(kubectl, run_id)
    assert rr["status"]["phase"] == "Blocked"
    assert "approved_by" in rr["status"]["message"] and "approved_digest" in rr["status"]["message"]
    assert _effects(control_plane, mark) == []


def test_runbook_approve_by_an_approver_leaves_a_request_the_server_verifies_and_records_sealed(
        cluster: dict[str, Any], kubectl: Kubectl) -> None:
    starter: JournalRunStarter = cluster["starter"]
    run_id, digest = _waiting_run(starter)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNBOOK_")}
    done = subprocess.run([sys.executable, "-m", "engine", "approve", run_id, "--plan-digest", digest,
                           "--store", "kubernetes", "--store-namespace", NS,
                           "--kubeconfig", str(cluster["paths"]["approver-alice"])],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CertificateSigningRequest" in done.stdout
    (csr,) = [c for c in kubectl.json("get", "csr", "-l", "runbook.io/approval=true")["items"]
              if run_id in c["metadata"]["name"]]
    assert csr["spec"]["username"] == ALICE  # recorded by the API server, not by the client
    assert _rr(kubectl, run_id)["status"].get("approval") is None  # alice wrote nothing into the run
    assert starter.recover() == [run_id]  # the leader's sweep: verified, recorded, queued
    rec = starter.journal.get_run(run_id)
    assert (rec.approved_by, rec.approved_digest) == (ALICE, digest)
    assert starter.service.integrity.problem(run_id) is None


def _waiting_run(starter: JournalRunStarter) -> tuple[str, str]:
    """An approve-mode paged run as the server records it (sealed), parked for approval."""
    prepared = prepare_run(starter._runbooks["gpu-node-recovery"], {"node": "omen2"})
    run_id = starter.service.create(prepared, None, source="alertmanager", approval_required=True,
                                    requested_by="alertmanager")
    plan = saved_plan("omen2")
    starter.service.record_plan(run_id, plan)
    starter.service.park(run_id, plan, "approve-mode run")
    return run_id, plan.digest
