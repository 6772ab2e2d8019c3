"""The lab kubelet's client certificate (engine.lab.kubelet_certs, sim_kubelet): an expired one makes
kubelet exit with its own lines unless a bootstrap kubeconfig exists; with one it runs without heartbeat
while it requests a certificate; a refused token ends the start like kubelet's. The control plane
authenticates bootstrap tokens and signs kubelet certificates, or (on request) does not."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from engine.lab import kubelet_certs, sim_kubelet
from engine.lab.controlplane import ControlPlane
from engine.lab.scenario import load_scenario, starts_ready
from engine.lab.sim_seed import host_state

NOW = 1_780_000_000.0


def _state(**kubelet: Any) -> dict[str, Any]:
    state, _ = host_state(load_scenario().node("gpu-3090-3"), load_scenario(), NOW)
    state["kubelet"].update(kubelet)
    return state


def test_the_incident_node_crash_loops_with_kubelets_expired_certificate_lines() -> None:
    state, journal = host_state(load_scenario().node("gpu-3090-3"), load_scenario(), NOW)
    text = "\n".join(e["msg"] for e in journal)
    assert "part of the existing bootstrap client certificate in /etc/kubernetes/kubelet.conf is expired" in text
    assert "unable to load bootstrap kubeconfig" in text
    assert state["units"]["kubelet"]["active"] == "activating" and state["kubelet"]["client_cert_expired"] is True
    assert not starts_ready(load_scenario().node("gpu-3090-3"))  # `lab up` waits for it NotReady


def test_with_a_bootstrap_kubeconfig_kubelet_runs_silent_while_it_requests_its_certificate() -> None:
    state = _state(client_cert_expired=True, bootstrap_kubeconfig=True)
    assert sim_kubelet.failure_lines(state, NOW, 1) is None
    assert sim_kubelet.heartbeat_blocked(state) == sim_kubelet.BOOTSTRAP_LINES
    state["kubelet"]["client_cert_expired"] = False  # the certificate was issued
    assert sim_kubelet.heartbeat_blocked(state) is None


def test_a_refused_bootstrap_token_ends_the_start_like_kubelet() -> None:
    state = _state(client_cert_expired=True, bootstrap_kubeconfig=True)
    state["units"]["kubelet"].update(active="active", sub="running")
    entries = sim_kubelet.fail_bootstrap(state, NOW, "Unauthorized", 2.0)
    text = "\n".join(e["msg"] for e in entries)
    assert "cannot create certificate signing request: Unauthorized" in text and "status=1/FAILURE" in text
    assert state["units"]["kubelet"]["active"] == "activating" and state["kubelet"]["healthy"] is False


@pytest.fixture
def ca(tmp_path: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "runbook-lab-ca")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=10))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (tmp_path / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "ca.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
    return tmp_path / "ca.crt", tmp_path / "ca.key"


@pytest.mark.parametrize("expired", [True, False])
def test_the_hosts_client_certificate_is_the_nodes_signed_by_the_lab_ca(ca: tuple[Path, Path], expired: bool) -> None:
    pem = kubelet_certs.client_pem(*ca, "gpu-3090-3", expired=expired)
    cert = x509.load_pem_x509_certificate(pem.encode())
    assert cert.subject.rfc4514_string() == "CN=system:node:gpu-3090-3,O=system:nodes"
    assert cert.issuer.rfc4514_string() == "CN=runbook-lab-ca"
    now = datetime.datetime.now(datetime.UTC)
    assert (cert.not_valid_after_utc < now) is expired
    assert "PRIVATE KEY" in pem  # kubelet keeps certificate and key in one file


def test_a_bootstrap_kubeconfig_as_the_playbook_writes_it_gives_server_ca_and_token(ca: tuple[Path, Path]) -> None:
    conf = yaml.safe_load(kubelet_certs.kubelet_conf("https://127.0.0.1:6443", ca[0].read_bytes()))
    cluster = conf["clusters"][0]["cluster"]
    doc = {"apiVersion": "v1", "kind": "Config", "clusters": [{"name": "kubernetes", "cluster": cluster}],
           "users": [{"name": "tls-bootstrap-token-user", "user": {"token": "abcdef.0123456789abcdef"}}]}
    creds = kubelet_certs.bootstrap_credentials(yaml.safe_dump(doc).encode())
    assert creds == ("https://127.0.0.1:6443", ca[0].read_bytes(), "abcdef.0123456789abcdef")
    assert kubelet_certs.bootstrap_credentials(b"users: []") is None


def test_only_a_regular_file_the_host_wrote_counts(tmp_path: Path) -> None:
    upper = tmp_path / "etc-up" / "kubernetes"
    upper.mkdir(parents=True)
    assert kubelet_certs.host_file(tmp_path, kubelet_certs.BOOTSTRAP_CONF) is None
    (upper / "bootstrap-kubelet.conf").symlink_to("/etc/passwd")
    assert kubelet_certs.host_file(tmp_path, kubelet_certs.BOOTSTRAP_CONF) is None
    (upper / "bootstrap-kubelet.conf").unlink()
    (upper / "bootstrap-kubelet.conf").write_text("x")
    assert kubelet_certs.host_file(tmp_path, kubelet_certs.BOOTSTRAP_CONF) == b"x"
    assert kubelet_certs.host_file(None, kubelet_certs.BOOTSTRAP_CONF) is None


def _argv(tmp_path: Path, **settings: Any) -> dict[str, list[str]]:
    plane = ControlPlane(tmp_path / "cp", assets=tmp_path, **settings)
    plane.ports = {k: 1 for k in ("etcd_client", "etcd_peer", "apiserver", "controller_manager", "scheduler")}
    return plane._argvs()


def test_the_lab_authenticates_bootstrap_tokens_and_signs_kubelet_certificates_with_its_ca(tmp_path: Path) -> None:
    argv = _argv(tmp_path)
    assert "--enable-bootstrap-token-auth" in argv["kube-apiserver"]
    cm = argv["kube-controller-manager"]
    controllers = next(a for a in cm if a.startswith("--controllers=")).split("=", 1)[1].split(",")
    assert "csrsigning" in controllers and "csrapproving" not in controllers  # approving is the runbook's job
    assert any(a.startswith("--cluster-signing-cert-file=") and a.endswith("certs/ca.crt") for a in cm)
    assert any(a.startswith("--cluster-signing-key-file=") and a.endswith("certs/ca.key") for a in cm)


def test_a_lab_without_the_bootstrap_authenticator_on_request(tmp_path: Path) -> None:
    assert "--enable-bootstrap-token-auth" not in _argv(tmp_path, bootstrap_token_auth=False)["kube-apiserver"]
