"""The lab kubelet's client certificate and its TLS bootstrap, as a kubeadm node's kubelet has them.

Every SSH node host gets kubeadm's files (``seed_host``): ``/etc/kubernetes/kubelet.conf`` (the lab's
API server, its CA, the client certificate at ``/var/lib/kubelet/pki/kubelet-client-current.pem``)
and that certificate (with its key), signed by the lab's CA for ``system:node:<node>`` in
``system:nodes``; already expired on a node whose scenario says ``client_cert_expired``.

A kubelet whose client certificate expired (host state ``kubelet.client_cert_expired``) exits at
start with kubelet's own lines (``sim_kubelet.EXPIRED_CERT_LINES``) unless a bootstrap kubeconfig exists
(``/etc/kubernetes/bootstrap-kubelet.conf``, read here from the host's /etc overlay, read-only).
With one it does what kubelet's ``bootstrap.LoadClientCert`` does, for real against the lab's API
server with the bootstrap token of that file: a CertificateSigningRequest (signer
``kubernetes.io/kube-apiserver-client-kubelet``, ``CN=system:node:<node>, O=system:nodes``, a new
ECDSA key), then it waits until the request is approved and the controller-manager's ``csrsigning``
issued the certificate, which it keeps (``kubelet-client.pem`` in the host's state folder, seen in the
host at ``/run/runbook-lab``), and comes up. A token the API server refuses ends the start as
kubelet's does (``Unauthorized``, exit, auto-restart). The simulator drives this (``Simulator``);
the pure life cycle stays in ``sim_kubelet``.

Must not: write anything outside a host (its namespace, through ``NodeHost.run``) or its state folder.
"""

from __future__ import annotations

import base64
import datetime
import json
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from engine.lab.errors import LabError
from engine.lab.nodehosts import STATE_MOUNT

KUBELET_CONF = "/etc/kubernetes/kubelet.conf"
BOOTSTRAP_CONF = "/etc/kubernetes/bootstrap-kubelet.conf"
CLIENT_PEM = "/var/lib/kubelet/pki/kubelet-client-current.pem"
SIGNER = "kubernetes.io/kube-apiserver-client-kubelet"
ISSUED_FILE = "kubelet-client.pem"  # in the host's state folder


class BootstrapRefused(Exception):
    """The API server refused the kubelet's bootstrap credential (HTTP status and message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


# -- kubeadm's files on a host -----------------------------------------------------------------------

def client_pem(ca_crt: Path, ca_key: Path, node: str, *, expired: bool) -> str:
    """A client certificate and its key (PEM, as kubelet keeps them in one file) for ``node``."""
    ca = x509.load_pem_x509_certificate(ca_crt.read_bytes())
    signer = serialization.load_pem_private_key(ca_key.read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    start, end = (now - datetime.timedelta(days=400), now - datetime.timedelta(days=35)) if expired else (
        now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=365))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
                                     x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{node}")]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(signer, hashes.SHA256()))  # type: ignore[arg-type]  # the lab's CA key is ECDSA
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM).decode() + key_pem.decode()


def kubelet_conf(server: str, ca_pem: bytes) -> str:
    """kubeadm's kubelet.conf after the TLS bootstrap: the client certificate by path."""
    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "system:node@kubernetes",
        "clusters": [{"name": "kubernetes", "cluster": {
            "server": server, "certificate-authority-data": base64.b64encode(ca_pem).decode()}}],
        "contexts": [{"name": "system:node@kubernetes", "context": {"cluster": "kubernetes", "user": "system:node"}}],
        "users": [{"name": "system:node", "user": {"client-certificate": CLIENT_PEM, "client-key": CLIENT_PEM}}],
    }, indent=2) + "\n"


def seed_host(pid: int, server: str, ca_crt: Path, ca_key: Path, node: str, *, expired: bool) -> None:
    """Write kubelet.conf and the client certificate into the host whose namespace ``pid`` holds, as
    root; a bootstrap kubeconfig or certificates moved aside by an earlier run are removed (a lab reset)."""
    pem = client_pem(ca_crt, ca_key, node, expired=expired)
    script = (f"set -e; umask 077; mkdir -p /etc/kubernetes /var/lib/kubelet/pki; "
              f"rm -f {BOOTSTRAP_CONF} {CLIENT_PEM}.* {STATE_MOUNT}/{ISSUED_FILE}; "
              f"cat > {KUBELET_CONF}; printf '%s' \"$PEM\" > {CLIENT_PEM}")
    result = subprocess.run(["nsenter", f"--target={pid}", "--mount", "--", "env", f"PEM={pem}", "/bin/sh", "-c",
                             script], input=kubelet_conf(server, ca_crt.read_bytes()), capture_output=True,
                            text=True, check=False)
    if result.returncode != 0:
        raise LabError(f"could not write kubelet's certificate into host pid {pid}: {result.stderr.strip()}")


# -- what the simulated kubelet reads on its host ----------------------------------------------------

def host_file(layers_dir: Path | str | None, path: str) -> bytes | None:
    """A file the host wrote (its overlay's upper layer; read-only here), or None."""
    if not layers_dir:
        return None
    top, _, rest = path.lstrip("/").partition("/")
    candidate = Path(layers_dir) / f"{top}-up" / rest
    try:
        if candidate.is_file() and not candidate.is_symlink():
            return candidate.read_bytes()
    except OSError:
        return None
    return None


def bootstrap_credentials(text: bytes) -> tuple[str, bytes, str] | None:
    """(server, CA PEM, token) of a bootstrap kubeconfig, or None when it has none of them."""
    try:
        doc = yaml.safe_load(text)
        cluster = doc["clusters"][0]["cluster"]
        token = str(doc["users"][0]["user"]["token"])
        return str(cluster["server"]), base64.b64decode(cluster["certificate-authority-data"]), token
    except (yaml.YAMLError, KeyError, IndexError, TypeError, ValueError):
        return None


# -- the TLS bootstrap, over HTTP as the kubelet ----------------------------------------------------

def _request(server: str, ca_pem: bytes, token: str, method: str, path: str,
             body: dict[str, Any] | None = None) -> dict[str, Any]:
    context = ssl.create_default_context(cadata=ca_pem.decode())
    request = urllib.request.Request(server + path, method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return dict(json.loads(response.read()))
    except urllib.error.HTTPError as e:
        raise BootstrapRefused(e.code, e.read().decode(errors="replace")[:300]) from e


def request_certificate(server: str, ca_pem: bytes, token: str, node: str) -> tuple[str, str]:
    """Create the kubelet's CSR with the bootstrap ``token``: (CSR name, the new key's PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
                                    x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{node}")]))
           .sign(key, hashes.SHA256()))
    body = {"apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest",
            "metadata": {"generateName": "csr-"},
            "spec": {"request": base64.b64encode(csr.public_bytes(serialization.Encoding.PEM)).decode(),
                     "signerName": SIGNER, "usages": ["digital signature", "key encipherment", "client auth"]}}
    created = _request(server, ca_pem, token, "POST", "/apis/certificates.k8s.io/v1/certificatesigningrequests",
                       body)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
    return str(created["metadata"]["name"]), key_pem


def issued_certificate(server: str, ca_pem: bytes, token: str, name: str) -> str | None:
    """The certificate (PEM) issued for CSR ``name``, None while there is none; ``BootstrapRefused``
    when the request was denied or failed."""
    csr = _request(server, ca_pem, token, "GET", f"/apis/certificates.k8s.io/v1/certificatesigningrequests/{name}")
    status = csr.get("status") or {}
    for condition in status.get("conditions") or ():
        if condition.get("type") in ("Denied", "Failed"):
            raise BootstrapRefused(403, f"certificate signing request {name} {condition.get('type')}: "
                                        f"{condition.get('message', '')}")
    if status.get("certificate"):
        return base64.b64decode(status["certificate"]).decode()
    return None
