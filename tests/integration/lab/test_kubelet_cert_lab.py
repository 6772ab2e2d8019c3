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
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from engine.lab import kubelet_certs
from engine.lab.controlplane import ControlPlane
from engine.lab.hoststate import HostState
from tests.integration.lab.flagship_cli import kube_node, ready, runbook
from tests.integration.lab.lab_helpers import kubectl_json

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
    assert diagnosis["cause"] == "kubelet-client-cert-expired", diagnosis
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
