"""Approvals authorised by RBAC on the real 1.20 API server (issue 15): a SelfSubjectAccessReview for
verb ``approve`` on ``remediationruns`` with the approver's own credential (a TokenRequest token of a
ServiceAccount), and the approver's authenticated username from a TokenReview of that token (1.20
serves no SelfSubjectReview). The ClusterRole is the base's ``deploy/kubernetes/approver-rbac.yaml``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.cluster_auth import ApprovalForbidden, authorize_approval
from engine.connectors.kube import KubeConnector
from engine.errors import ExitCode
from engine.lab.controlplane import ControlPlane
from engine.lab.kubectl import Kubectl

pytestmark = [pytest.mark.integration, pytest.mark.keep_cluster]

BASE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
NS = "runbook-system"


@pytest.fixture(scope="module")
def approvers(kubectl: Kubectl, control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[dict[str, Path]]:
    """The approvers' kubeconfigs, each carrying only a TokenRequest token of its ServiceAccount."""
    kubectl("apply", "-f", str(BASE / "namespace.yaml"))
    kubectl("apply", "-f", str(BASE / "crd-remediationruns.yaml"))
    kubectl("wait", "--for=condition=Established", "crd/remediationruns.runbook.io", "--timeout=30s")
    kubectl("apply", "-f", str(BASE / "approver-rbac.yaml"))
    kubectl("create", "clusterrole", "approve-only", "--verb=approve", "--resource=remediationruns.runbook.io")
    made = [("serviceaccount", "approver-alice"), ("serviceaccount", "approver-bob"),
            ("serviceaccount", "approver-nobody"), ("rolebinding", "alice-approves"),
            ("rolebinding", "bob-approves-only")]
    kubectl("create", "clusterrolebinding", "alice-identity", "--clusterrole=runbook-approver-identity",
            f"--serviceaccount={NS}:approver-alice")
    kubectl("create", "clusterrolebinding", "alice-requests", "--clusterrole=runbook-approver-requests",
            f"--serviceaccount={NS}:approver-alice")
    for sa in ("approver-alice", "approver-bob", "approver-nobody"):
        kubectl("-n", NS, "create", "serviceaccount", sa)
    kubectl("-n", NS, "create", "rolebinding", "alice-approves", "--clusterrole=runbook-approver",
            f"--serviceaccount={NS}:approver-alice")
    kubectl("-n", NS, "create", "rolebinding", "bob-approves-only", "--clusterrole=approve-only",
            f"--serviceaccount={NS}:approver-bob")
    tmp = tmp_path_factory.mktemp("approvers")
    paths = {sa: control_plane.service_account_kubeconfig(NS, sa, tmp / sa)
             for sa in ("approver-alice", "approver-bob", "approver-nobody")}
    try:
        yield paths
    finally:
        for kind, name in made:
            kubectl("-n", NS, "delete", kind, name, "--ignore-not-found", check=False)
        kubectl("delete", "clusterrolebinding", "alice-identity", "alice-requests", "--ignore-not-found", check=False)
        kubectl("delete", "clusterrole", "approve-only", "runbook-approver", "runbook-approver-identity",
                "runbook-approver-requests", "--ignore-not-found", check=False)
        kubectl("delete", "csr", "-l", "runbook.io/approval=true", check=False)


def _as(sa: str, approvers: dict[str, Path]) -> KubeConnector:
    return KubeConnector(kubeconfig=str(approvers[sa]))


def test_an_approver_bound_to_runbook_approver_is_allowed_and_recorded_by_its_authenticated_username(
        approvers: dict[str, Path]) -> None:
    who = authorize_approval(_as("approver-alice", approvers), NS, "r-20261203-1")
    assert who == f"system:serviceaccount:{NS}:approver-alice"


def test_an_identity_without_the_approve_verb_is_refused_with_exit_3_naming_the_permission(
        approvers: dict[str, Path]) -> None:
    with pytest.raises(ApprovalForbidden) as refused:
        authorize_approval(_as("approver-nobody", approvers), NS, "r-20261203-1")
    message = str(refused.value)
    assert refused.value.exit_code == ExitCode.BLOCKED == 3
    assert message.startswith("forbidden") and 'verb "approve" on "remediationruns"' in message
    assert f"namespace {NS}" in message and "runbook-approver" in message


def test_the_binding_is_namespaced_an_approver_here_may_not_approve_runs_in_another_namespace(
        approvers: dict[str, Path]) -> None:
    with pytest.raises(ApprovalForbidden) as refused:
        authorize_approval(_as("approver-alice", approvers), "default", "r-20261203-1")
    assert 'verb "approve" on "remediationruns" (apiGroup runbook.io) in namespace default' in str(refused.value)


def test_on_1_20_an_approver_who_may_not_review_tokens_is_refused_naming_tokenreviews(
        approvers: dict[str, Path]) -> None:
    # bob holds `approve` but not tokenreviews/create: 1.20 has no other way to tell his username
    with pytest.raises(ApprovalForbidden, match=r'"create" on "tokenreviews".*runbook-approver-identity'):
        authorize_approval(_as("approver-bob", approvers), NS, "r-20261203-1")


def _cli(*args: str, kubeconfig: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNBOOK_")}
    return subprocess.run([sys.executable, "-m", "engine", *args, "--store", "kubernetes", "--store-namespace", NS,
                           "--kubeconfig", str(kubeconfig)], capture_output=True, text=True, env=env,
                          timeout=120, check=False)


def test_runbook_approve_with_the_kubernetes_store_requests_the_approval_as_the_authenticated_user_or_exits_3(
        approvers: dict[str, Path], control_plane: ControlPlane, kubectl: Kubectl) -> None:
    from engine.settings import Settings

    store = Settings(kubeconfig=str(control_plane.kubeconfig), store="kubernetes", store_namespace=NS).open_journal()
    run_id = store.create_run("gpu-node-recovery", {"node": "omen2"}, ["omen2"], source="alertmanager",
                              state="waiting-approval", approval_required=True)
    store.set_plan(run_id, {"steps": []}, "d" * 64)
    kubeconfigs = approvers
    try:
        refused = _cli("approve", run_id, "--plan-digest", "d" * 64, kubeconfig=kubeconfigs["approver-nobody"])
        assert refused.returncode == 3, refused.stdout + refused.stderr
        assert 'forbidden: you may not approve run' in refused.stderr and '"remediationruns"' in refused.stderr
        assert store.get_run(run_id).approved_by is None  # nothing recorded
        typed = _cli("approve", run_id, "--plan-digest", "d" * 64, "--by", "the-boss",
                     kubeconfig=kubeconfigs["approver-alice"])
        assert typed.returncode == 2 and "--by is refused" in typed.stderr, typed.stderr
        done = _cli("approve", run_id, "--plan-digest", "d" * 64, kubeconfig=kubeconfigs["approver-alice"])
        assert done.returncode == 0, done.stdout + done.stderr
        # issue 25: an approver writes nothing into the run (no status rights, no run key); the request
        # names its author as the API server authenticated it, and the server records it after a
        # SubjectAccessReview (tests/integration/test_cluster_integrity.py)
        assert store.get_run(run_id).approved_by is None
        csrs = kubectl("get", "csr", "-l", "runbook.io/approval=true", "-o", "json").stdout
        assert f'"username": "system:serviceaccount:{NS}:approver-alice"' in csrs and run_id in csrs
    finally:
        kubectl("-n", NS, "delete", "rr", run_id, "--ignore-not-found", check=False)
