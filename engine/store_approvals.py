"""Approvals through the store that cannot be forged: a CertificateSigningRequest the API server signs the author of.

``runbook approve --store kubernetes`` by an approver who holds no run key (engine.integrity: only
the engine's ServiceAccount does) cannot write the run's approval itself, and must not: anything
written into a RemediationRun's status by hand is refused before any action. Instead it creates a
``certificates.k8s.io/v1`` CertificateSigningRequest named
``runbook-approval.<store namespace>.<run id>.<plan digest>.<nonce>`` with the signer
``runbook.io/remediation-approval`` (a signer nobody runs: no certificate is ever issued).

Why a CSR: it is the one object whose author the API server itself records, unforgeably, on every
API server we support (1.20 included): ``spec.username``, ``spec.uid``, ``spec.groups`` and
``spec.extra`` are set from the authenticated requester and a create cannot choose them; the name
and spec are immutable after creation. A custom ``RemediationApproval`` resource would carry only
what its author typed (``managedFields`` names a client-chosen field manager, never the user), and
an admission webhook or ValidatingAdmissionPolicy to stamp the author is not available on 1.20.

The server's leader (``ingest``, from ``RunStarter.recover``) lists these requests, and for a run
waiting for approval of exactly that plan digest asks the API server with a SubjectAccessReview
whether the request's author may ``approve`` remediationruns in the store namespace (and that the
author is not who requested the run); only then it records the approval, sealed with the run key,
as an approval through its HTTP API is. The request's creator is the approver the run records.

This module builds and reads those requests; it never records an approval itself.
"""

from __future__ import annotations

import base64
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

API_VERSION = "certificates.k8s.io/v1"
PLURAL = "certificatesigningrequests"
SIGNER = "runbook.io/remediation-approval"
LABEL = "runbook.io/approval"
PREFIX = "runbook-approval"
# A fixed, valid PKCS#10 request (the API server validates one): its key was thrown away, nothing
# is ever signed for it; what counts is who created the object and the name it was given.
REQUEST_PEM = """-----BEGIN CERTIFICATE REQUEST-----
MIH3MIGeAgEAMDwxEzARBgNVBAoMCnJ1bmJvb2suaW8xJTAjBgNVBAMMHHJ1bmJv
b2sgcmVtZWRpYXRpb24gYXBwcm92YWwwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNC
AAQRz2BKUqOA0MVaEP7HsMtgB1KgJl1BICX9N380nE9DvuQwQi+BcEGHSDuAsRNd
oFnNCaw7u0p4e5a7ro+AMUXPoAAwCgYIKoZIzj0EAwIDSAAwRQIgTw/QSrezIo5y
N1e0hVRxEM9/jZEcZ4ce1A1odZVelq8CIQD7dWTNP90yk6pyQd8/dOyFwGj6QrEg
5WffhOJZCdZYbA==
-----END CERTIFICATE REQUEST-----
"""
log = logging.getLogger("runbook.approvals")


@dataclass(frozen=True)
class StoreApproval:
    """One approval request as the API server recorded it."""

    name: str
    namespace: str
    run_id: str
    digest: str
    username: str
    uid: str
    groups: tuple[str, ...]
    extra: Mapping[str, tuple[str, ...]]


def request_body(namespace: str, run_id: str, digest: str) -> dict[str, Any]:
    """The CertificateSigningRequest ``runbook approve --store kubernetes`` creates."""
    name = f"{PREFIX}.{namespace}.{run_id}.{digest}.{secrets.token_hex(4)}"
    return {"apiVersion": API_VERSION, "kind": "CertificateSigningRequest",
            "metadata": {"name": name, "labels": {LABEL: "true"}},
            "spec": {"request": base64.b64encode(REQUEST_PEM.encode()).decode(), "signerName": SIGNER,
                     "usages": ["digital signature"]}}


def parse(obj: Mapping[str, Any]) -> StoreApproval | None:
    """The approval an object records, or None when it is not one of ours (another signer, a name
    not ours, no author recorded)."""
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    name = str(meta.get("name") or "")
    parts = name.split(".")
    if spec.get("signerName") != SIGNER or len(parts) != 5 or parts[0] != PREFIX:
        return None
    _, namespace, run_id, digest, _ = parts
    username = str(spec.get("username") or "")
    if not username or len(digest) != 64:
        return None
    extra = {str(k): tuple(str(x) for x in v) for k, v in (spec.get("extra") or {}).items() if isinstance(v, list)}
    return StoreApproval(name, namespace, run_id, digest, username, str(spec.get("uid") or ""),
                         tuple(str(g) for g in spec.get("groups") or ()), extra)


__all__ = ["API_VERSION", "LABEL", "PLURAL", "SIGNER", "StoreApproval", "parse", "request_body"]
