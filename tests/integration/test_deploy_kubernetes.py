"""deploy/kubernetes against the real (1.20) API server: a server-side dry run of the kustomize base,
the RemediationRun CRD's columns and validation, and ServiceAccount tokens from TokenRequest under the
base's RBAC.

The base targets current clusters. Kinds whose current version 1.20 does not serve are left out of the
dry run, each with its reason (``NOT_SERVED_BY_1_20``), and a test checks that 1.20 really refuses them.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.lab.controlplane import ControlPlane
from engine.lab.kubectl import Kubectl

pytestmark = [pytest.mark.integration, pytest.mark.keep_cluster]

BASE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
# file in the base -> why the 1.20 test server cannot take it (everything else must pass the dry run)
NOT_SERVED_BY_1_20 = {
    "pdb.yaml": "PodDisruptionBudget policy/v1 is served from Kubernetes 1.21; 1.20 serves only policy/v1beta1",
}
SA = "system:serviceaccount:runbook-system:runbook"


def _base_without(tmp: Path, left_out: set[str]) -> Path:
    copy = tmp / "base"
    shutil.copytree(BASE, copy)
    kustomization = yaml.safe_load((copy / "kustomization.yaml").read_text())
    assert left_out <= set(kustomization["resources"]), "a left-out file is not in the base"
    kustomization["resources"] = [r for r in kustomization["resources"] if r not in left_out]
    (copy / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return copy


@pytest.fixture(scope="module")
def namespace(kubectl: Kubectl) -> str:
    # A server-side dry run creates nothing, so the objects *in* runbook-system need the namespace to
    # exist already (kubectl's own limitation, not the base's): it is created for real first.
    kubectl("apply", "-f", str(BASE / "namespace.yaml"))
    return "runbook-system"


def test_the_base_passes_a_server_side_dry_run_except_the_kinds_1_20_does_not_serve(
        kubectl: Kubectl, namespace: str, tmp_path: Path) -> None:
    base = _base_without(tmp_path, set(NOT_SERVED_BY_1_20))
    result = kubectl("apply", "-k", str(base), "--dry-run=server", check=False)
    assert result.returncode == 0, result.stderr
    applied = result.stdout
    for expected in ("customresourcedefinition.apiextensions.k8s.io/remediationruns.runbook.io",
                     "customresourcedefinition.apiextensions.k8s.io/runbookremediations.runbook.io",
                     "customresourcedefinition.apiextensions.k8s.io/runbookremediationtemplates.runbook.io",
                     "clusterrole.rbac.authorization.k8s.io/runbook-ext-remediation",
                     "role.rbac.authorization.k8s.io/runbook-medik8s-leases",
                     "serviceaccount/runbook", "clusterrole.rbac.authorization.k8s.io/runbook",
                     "role.rbac.authorization.k8s.io/runbook", "deployment.apps/runbook", "service/runbook",
                     "configmap/runbook-serve", "configmap/runbook-inventory", "configmap/runbook-known-hosts",
                     "clusterrolebinding.rbac.authorization.k8s.io/runbook-auth-delegator"):
        assert expected in applied, applied
    assert "(server dry run)" in applied


@pytest.mark.parametrize("left_out", sorted(NOT_SERVED_BY_1_20))
def test_each_kind_left_out_of_the_dry_run_is_really_refused_by_1_20(kubectl: Kubectl, namespace: str,
                                                                     left_out: str) -> None:
    result = kubectl("apply", "-f", str(BASE / left_out), "--dry-run=server", check=False)
    assert result.returncode != 0
    doc = yaml.safe_load((BASE / left_out).read_text())
    assert f'no matches for kind "{doc["kind"]}" in version "{doc["apiVersion"]}"' in result.stderr


def test_the_deployment_runs_two_non_root_read_only_replicas_with_probes_and_anti_affinity() -> None:
    docs = [d for d in yaml.safe_load_all((BASE / "deployment.yaml").read_text()) if d]
    spec = docs[0]["spec"]
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    assert spec["replicas"] == 2 and pod["serviceAccountName"] == "runbook"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]


def test_kubectl_get_rr_shows_runbook_node_phase_and_age_and_an_unknown_phase_is_refused(
        kubectl: Kubectl, namespace: str) -> None:
    kubectl("apply", "-f", str(BASE / "crd-remediationruns.yaml"))
    kubectl("wait", "--for=condition=Established", "crd/remediationruns.runbook.io", "--timeout=60s")
    run: dict[str, Any] = {"apiVersion": "runbook.io/v1alpha1", "kind": "RemediationRun",
                           "metadata": {"name": "r-columns", "namespace": namespace},
                           "spec": {"runbook": "gpu-node-recovery", "node": "omen2"}}
    kubectl("apply", "-f", "-", input=yaml.safe_dump(run))
    kubectl("patch", "rr", "r-columns", "-n", namespace, "--subresource=status", "--type=merge",
            "-p", '{"status":{"phase":"Succeeded"}}')
    table = kubectl("get", "rr", "-n", namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "RUNBOOK", "NODE", "PHASE", "AGE"]
    assert table[1].split()[:4] == ["r-columns", "gpu-node-recovery", "omen2", "Succeeded"]
    wrong_phase = kubectl("patch", "rr", "r-columns", "-n", namespace, "--subresource=status", "--type=merge",
                          "-p", '{"status":{"phase":"Done"}}', check=False)
    assert wrong_phase.returncode != 0 and "status.phase" in wrong_phase.stderr
    no_node = {**run, "metadata": {"name": "r-no-node", "namespace": namespace}, "spec": {"runbook": "x"}}
    refused = kubectl("apply", "-f", "-", input=yaml.safe_dump(no_node), check=False)
    # the server's CRD validation ("spec.node: Required value") or kubectl's check against the OpenAPI the
    # server publishes from the same schema (when kubectl already has it): both come from the CRD
    assert refused.returncode != 0
    assert "spec.node" in refused.stderr or 'missing required field "node"' in refused.stderr, refused.stderr


def test_a_token_request_token_acts_as_the_service_account_under_the_base_rbac(
        control_plane: ControlPlane, kubectl: Kubectl, namespace: str, tmp_path: Path) -> None:
    kubectl("apply", "-f", str(BASE / "serviceaccount.yaml"), "-f", str(BASE / "rbac.yaml"))
    config = control_plane.service_account_kubeconfig("runbook-system", "runbook", tmp_path / "kubeconfig")
    as_sa = Kubectl(config, tmp_path / "home")
    assert as_sa("get", "nodes").returncode == 0
    assert as_sa("auth", "can-i", "patch", "nodes").stdout.strip() == "yes"
    # issue 25 item 8: Leases only in the store namespace; kube-system's leader Leases out of reach
    assert as_sa("auth", "can-i", "create", "leases", "-n", "runbook-system").stdout.strip() == "yes"
    for verb in ("get", "create", "update", "delete"):
        assert as_sa("auth", "can-i", verb, "leases", "-n", "kube-system", check=False).stdout.strip() == "no"
    assert as_sa("auth", "can-i", "update", "nodes", check=False).stdout.strip() == "no"
    # system:auth-delegator, for serve's auth.mode kubernetes (TokenReview + SubjectAccessReview)
    assert as_sa("auth", "can-i", "create", "tokenreviews.authentication.k8s.io").stdout.strip() == "yes"
    assert as_sa("auth", "can-i", "create", "subjectaccessreviews.authorization.k8s.io").stdout.strip() == "yes"
    denied = as_sa("get", "secrets", "-n", "kube-system", check=False)
    assert denied.returncode != 0
    assert f'User "{SA}" cannot list resource "secrets"' in denied.stderr
