"""Approvals authorised by RBAC on the real 1.20 API server (issue 15): a SelfSubjectAccessReview for
verb ``approve`` on ``remediationruns`` with the approver's own credential (a TokenRequest token of a
ServiceAccount), and the approver's authenticated username from a TokenReview of that token (1.20
serves no SelfSubjectReview). The ClusterRole is the base's ``deploy/kubernetes/approver-rbac.yaml``."""

from __future__ import annotations

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
              ) -> Iterator[dict[str, KubeConnector]]:
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
    for sa in ("approver-alice", "approver-bob", "approver-nobody"):
        kubectl("-n", NS, "create", "serviceaccount", sa)
    kubectl("-n", NS, "create", "rolebinding", "alice-approves", "--clusterrole=runbook-approver",
            f"--serviceaccount={NS}:approver-alice")
    kubectl("-n", NS, "create", "rolebinding", "bob-approves-only", "--clusterrole=approve-only",
            f"--serviceaccount={NS}:approver-bob")
    tmp = tmp_path_factory.mktemp("approvers")
    conns = {sa: KubeConnector(kubeconfig=str(control_plane.service_account_kubeconfig(NS, sa, tmp / sa)))
             for sa in ("approver-alice", "approver-bob", "approver-nobody")}
    try:
        yield conns
    finally:
        for kind, name in made:
            kubectl("-n", NS, "delete", kind, name, "--ignore-not-found", check=False)
        kubectl("delete", "clusterrolebinding", "alice-identity", "--ignore-not-found", check=False)
        kubectl("delete", "clusterrole", "approve-only", "runbook-approver", "runbook-approver-identity",
                "--ignore-not-found", check=False)


def test_an_approver_bound_to_runbook_approver_is_allowed_and_recorded_by_its_authenticated_username(
        approvers: dict[str, KubeConnector]) -> None:
    who = authorize_approval(approvers["approver-alice"], NS, "r-20261203-1")
    assert who == f"system:serviceaccount:{NS}:approver-alice"


def test_an_identity_without_the_approve_verb_is_refused_with_exit_3_naming_the_permission(
        approvers: dict[str, KubeConnector]) -> None:
    with pytest.raises(ApprovalForbidden) as refused:
        authorize_approval(approvers["approver-nobody"], NS, "r-20261203-1")
    message = str(refused.value)
    assert refused.value.exit_code == ExitCode.BLOCKED == 3
    assert message.startswith("forbidden") and 'verb "approve" on "remediationruns"' in message
    assert f"namespace {NS}" in message and "runbook-approver" in message


def test_the_binding_is_namespaced_an_approver_here_may_not_approve_runs_in_another_namespace(
        approvers: dict[str, KubeConnector]) -> None:
    with pytest.raises(ApprovalForbidden) as refused:
        authorize_approval(approvers["approver-alice"], "default", "r-20261203-1")
    assert 'verb "approve" on "remediationruns" (apiGroup runbook.io) in namespace default' in str(refused.value)


def test_on_1_20_an_approver_who_may_not_review_tokens_is_refused_naming_tokenreviews(
        approvers: dict[str, KubeConnector]) -> None:
    # bob holds `approve` but not tokenreviews/create: 1.20 has no other way to tell his username
    with pytest.raises(ApprovalForbidden, match=r'"create" on "tokenreviews".*runbook-approver-identity'):
        authorize_approval(approvers["approver-bob"], NS, "r-20261203-1")
