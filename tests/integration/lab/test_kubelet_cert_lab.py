"""The expired kubelet client certificate on the incident's gpu-3090-3, renewed for real (issue 31):
`runbook diagnose` names it; `runbook run kubelet-client-cert-expired` creates a bootstrap token through
the lab's API server (bootstrap-token authenticator on), writes the bootstrap kubeconfig on the host,
moves the expired certificate aside and restarts kubelet; the simulated kubelet requests its
certificate with that token (a real CertificateSigningRequest); the runbook approves exactly that
request, the controller-manager's csrsigning issues it, the node turns Ready and the token is deleted.
The token never reaches the journal, the output or the audit log. A second run changes nothing.
(The refusal on a cluster without the authenticator: tests/unit/kube_verbs/test_node_bootstrap.py.)"""

from __future__ import annotations

import base64
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from engine.lab import kubelet_certs
from engine.lab.controlplane import ControlPlane
from engine.lab.hoststate import HostState
from tests.integration.lab.flagship_cli import kube_node, ready, runbook
from tests.integration.lab.lab_helpers import kubectl_json, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.lab]

NODE = "gpu-3090-3"


@pytest.mark.timeout(900)
def test_the_expired_certificate_is_renewed_through_a_bootstrap_token_for_exactly_that_node(
        fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    record = fresh_lab.lab.record()
    state = HostState(record["nodes"][NODE]["state_dir"])
    layers = record["nodes"][NODE]["layers_dir"]
    plane = ControlPlane.from_state(record["controlplane_dir"])
    diagnosis = json.loads(runbook(sh, "diagnose --node gpu-3090-3 -o json").stdout)
    assert diagnosis["cause"] == "kubelet-cert-expired", diagnosis
    assert kubelet_certs.host_file(layers, kubelet_certs.CLIENT_PEM) is not None  # kubeadm's expired certificate
    journal = tmp_path / "j.sqlite"
    restarts_before = len(state.calls("systemctl"))

    r = runbook(sh, "run kubelet-client-cert-expired --node gpu-3090-3 --yes -o json", journal=journal)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout)
    assert result["state"] == "succeeded"
    assert [(o["step"], o["status"]) for o in result["outcomes"]] == [
        ("create-bootstrap-token", "succeeded"), ("write-bootstrap-kubeconfig", "succeeded"),
        ("approve-node-csr", "succeeded"), ("delete-bootstrap-token", "succeeded")]
    assert ready(kube_node(sh, NODE))

    # the host: a bootstrap kubeconfig with the token, the expired certificate moved aside, one restart
    conf = kubelet_certs.host_file(layers, kubelet_certs.BOOTSTRAP_CONF)
    assert conf is not None
    creds = kubelet_certs.bootstrap_credentials(conf)
    assert creds is not None
    server, _, token = creds
    assert server == record["api_url"]
    assert kubelet_certs.host_file(layers, kubelet_certs.CLIENT_PEM) is None
    restarts = [c["argv"] for c in state.calls("systemctl")[restarts_before:] if "kubelet" in c["argv"]]
    assert restarts == [["stop", "kubelet"], ["start", "kubelet"]]  # stopped while its files changed

    # every approved kubelet CSR is the kubelet's, made with that token, for exactly gpu-3090-3, and issued
    # (a crash-looping kubelet may pick up the bootstrap kubeconfig on its own restart before the
    # playbook's: two requests of the node, each checked and approved)
    csrs = [c for c in kubectl_json(sh, "get csr")["items"]
            if c["spec"]["signerName"] == "kubernetes.io/kube-apiserver-client-kubelet"]
    approved = [c for c in csrs if any(x["type"] == "Approved" for x in c["status"].get("conditions", []))]
    assert approved and len(approved) == len(csrs), [c["metadata"]["name"] for c in csrs]
    for csr in approved:
        assert csr["spec"]["username"] == f"system:bootstrap:{token.split('.')[0]}"
        cert = x509.load_pem_x509_certificate(base64.b64decode(csr["status"]["certificate"]))
        assert cert.subject.rfc4514_string() == "CN=system:node:gpu-3090-3,O=system:nodes"
        assert cert.issuer.rfc4514_string() == "CN=runbook-lab-ca"

    # the token is gone, and was never written where the run leaves its traces
    secrets = kubectl_json(sh, "-n kube-system get secrets -l runbook.io/bootstrap-for=gpu-3090-3")["items"]
    assert secrets == []
    secret_part = token.split(".")[1]
    assert secret_part not in r.stdout + r.stderr
    assert secret_part.encode() not in journal.read_bytes()
    assert secret_part.encode() not in plane.audit_log.read_bytes()

    # a second run: the node is Ready, nothing to do, nothing changed
    calls_before, mark = state.calls(), plane.audit_mark()
    again = runbook(sh, "run kubelet-client-cert-expired --node gpu-3090-3 --yes -o json", journal=journal)
    assert again.returncode == 0, again.stdout + again.stderr
    assert all(o["status"] == "skipped" for o in json.loads(again.stdout)["outcomes"]), again.stdout
    assert state.calls() == calls_before
    # (the run's node Lease and its Events are the run's own bookkeeping, not changes to the node)
    assert [e["requestURI"] for e in plane.mutations(mark) if "/leases" not in e["requestURI"]
            and "/events" not in e["requestURI"]] == []


BASE = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"
OPT_IN = BASE / "kubelet-cert-rbac.yaml"
SA_NS, SA = "runbook-system", "runbook"
KUBELET_SIGNER = "kubernetes.io/kube-apiserver-client-kubelet"
# The renewal's reads (the lab's audit policy logs no reads; engine/kube_verbs/node_bootstrap.py makes
# them): the node's tokens listed by label, the CSRs listed, the node read (facts, verification).
READS = [("", "secrets", "", "list", "kube-system", ""),
         ("certificates.k8s.io", "certificatesigningrequests", "", "list", "", ""),
         ("", "nodes", "", "get", "", NODE)]
# Approving a CSR is also an `approve` on its signer (the API server's second authorization check).
APPROVE_SIGNER = ("certificates.k8s.io", "signers", "", "approve", "", KUBELET_SIGNER)


def _allowed(sh: Any, attrs: tuple[str, str, str, str, str, str]) -> bool:
    """A SubjectAccessReview: may the ServiceAccount runbook do ``attrs`` (group, resource, subresource,
    verb, namespace, name)? Asked as the lab's admin; the API server's RBAC authorizer answers."""
    group, resource, sub, verb, ns, name = attrs
    spec = {"user": f"system:serviceaccount:{SA_NS}:{SA}",
            "groups": ["system:serviceaccounts", f"system:serviceaccounts:{SA_NS}", "system:authenticated"],
            "resourceAttributes": {k: v for k, v in (("group", group), ("resource", resource), ("subresource", sub),
                                                     ("verb", verb), ("namespace", ns), ("name", name)) if v}}
    body = json.dumps({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec})
    r = sh(f"echo {shlex.quote(body)} | kubectl create -f - -o json", check=True)
    return bool(json.loads(r.stdout)["status"].get("allowed"))


def _calls(events: list[dict[str, Any]]) -> set[tuple[str, str, str, str, str, str]]:
    """What the renewal asked of the API server (its writes, from the audit log), as SubjectAccessReview
    attributes; the run's own bookkeeping (its node Lease and Events: the base's, tested in
    test_cluster_rbac.py) left out."""
    out = set()
    for e in events:
        ref = e.get("objectRef") or {}
        if ref.get("resource") in ("leases", "events") or not ref.get("resource"):
            continue
        name = ref.get("name", "") if e["verb"] not in ("create",) else ""
        out.add((ref.get("apiGroup", ""), ref["resource"], ref.get("subresource", ""), e["verb"],
                 ref.get("namespace", ""), name))
    return out


@pytest.mark.timeout(900)
def test_inject_kubelet_cert_expired_and_the_opt_in_rbac_as_shipped_allows_every_call_of_the_renewal(
        lab: Any, sh: Any, tmp_path: Path) -> None:
    lab.dirty = True
    record = lab.lab.record()
    plane = ControlPlane.from_state(record["controlplane_dir"])
    # the game-day word on the node the test above renewed (or, run alone, whose certificate is expired)
    put = runbook(sh, f"lab inject kubelet-cert-expired --node {NODE}")
    assert put.returncode == 0 and "client certificate expired" in put.stdout, put.stdout + put.stderr
    wait_for(lambda: not ready(kube_node(sh, NODE)), 120, f"{NODE} NotReady")
    diagnosis = json.loads(runbook(sh, f"diagnose --node {NODE} -o json").stdout)
    assert diagnosis["cause"] == "kubelet-cert-expired", diagnosis  # the cause id is the inject word

    mark = plane.audit_mark()
    r = runbook(sh, f"run kubelet-client-cert-expired --node {NODE} --yes -o json", journal=tmp_path / "j.sqlite")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ready(kube_node(sh, NODE))
    calls = _calls(plane.mutations(mark))
    # what the audit log must show: the token created and deleted, proved, the CSR approved
    assert {c[:4] for c in calls} >= {
        ("", "secrets", "", "create"), ("", "secrets", "", "delete"),
        ("authentication.k8s.io", "tokenreviews", "", "create"),
        ("certificates.k8s.io", "certificatesigningrequests", "approval", "update")}, calls
    wanted = sorted(calls | set(READS) | {APPROVE_SIGNER})

    admin = f"kubectl --kubeconfig {plane.kubeconfig}"
    for name in ("namespace.yaml", "serviceaccount.yaml", "rbac.yaml"):  # the base's RBAC, as shipped
        sh(f"{admin} apply -f {BASE / name}", check=True)
    sh(f"{admin} delete --ignore-not-found -f {OPT_IN}", check=True)
    # the base alone: the token and the approval are not granted (that is what the opt-in file is for)
    assert not _allowed(sh, ("", "secrets", "", "create", "kube-system", ""))
    assert not _allowed(sh, ("certificates.k8s.io", "certificatesigningrequests", "approval", "update", "", ""))
    assert not _allowed(sh, APPROVE_SIGNER)
    try:
        sh(f"{admin} apply -f {OPT_IN}", check=True)  # the file as shipped
        wait_for(lambda: _allowed(sh, APPROVE_SIGNER), 30, "the opt-in RBAC in force")
        denied = [c for c in wanted if not _allowed(sh, c)]
        assert denied == [], f"calls of the renewal the base + {OPT_IN.name} do not grant: {denied}"
        # and no more than the kubelet signer: another signer's CSRs stay unapprovable
        other_signer = ("certificates.k8s.io", "signers", "", "approve", "", "kubernetes.io/kube-apiserver-client")
        assert not _allowed(sh, other_signer)
        assert not _allowed(sh, ("", "secrets", "", "get", "default", ""))
    finally:
        sh(f"{admin} delete --ignore-not-found -f {OPT_IN}", check=True)
