"""Verbs ``bootstrap_token``, ``approve_node_csr``, ``delete_bootstrap_tokens``: a kubelet whose client
certificate expired gets a new one the way a joining node does (kubeadm's TLS bootstrap), with a
credential that lives minutes and is deleted once the node is back.

* ``bootstrap_token``: a Secret ``kube-system/bootstrap-token-<id>`` of type
  ``bootstrap.kubernetes.io/token`` (``usage-bootstrap-authentication``, the kubeadm node group,
  ``expiration`` = now + ttl), labelled for the run's node. It is then proved to authenticate: a
  TokenReview of the token must answer ``system:bootstrap:<id>`` in the group. When it does not, the
  cluster has no bootstrap-token authenticator (kube-apiserver ``--enable-bootstrap-token-auth``):
  the token is deleted and the step refused with the manual steps (``manual_steps``), before anything
  on the host is touched. The token itself goes to the run's later playbooks only (``KubeContext.handoff``,
  memory of this process; never an event, a plan or a log line: ``engine.secrecy.register``).
* ``approve_node_csr``: waits for the kubelet's CertificateSigningRequest made with the node's token
  (``spec.username`` ``system:bootstrap:<id>``) and approves it only when ``csr_problems`` finds
  nothing: signer ``kubernetes.io/kube-apiserver-client-kubelet``, client usages only, subject exactly
  ``CN=system:node:<node>, O=system:nodes``, no SAN, a valid self-signature. Anything else is refused
  with the request's content as evidence (nothing approved). Then waits for the certificate.
* ``delete_bootstrap_tokens``: deletes every token labelled for the node and proves none is left.

Why a TokenReview and not a read-only probe: whether kube-apiserver runs the bootstrap authenticator
is configuration the API does not expose (no flag endpoint; an unknown token is refused alike with
or without it), and a cluster-admin-only read of the apiserver's pod would not work on managed
control planes. A token that authenticates is the one proof; it costs one short-lived Secret that is
deleted again at once when the proof fails.

Deciding is pure (the node's name only); applying talks to Kubernetes through ``KubeAPI``'s object
calls (Secrets, TokenReviews, CertificateSigningRequests).
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from engine import secrecy
from engine.checkkind import FormatModel
from engine.errors import KubeError
from engine.facts import NodeFacts
from engine.kube_verbs.effects import BootstrapOperation, EffectFailed, KubeContext, applies, decides, previews
from engine.model import Duration, KubeVerbSpec, parse_duration

NAMESPACE = "kube-system"
TOKEN_TYPE = "bootstrap.kubernetes.io/token"
NODE_LABEL = "runbook.io/bootstrap-for"  # the node (or its digest when the name is no label value)
NODE_ANNOTATION = "runbook.io/bootstrap-node"  # the node's full name
RUN_ANNOTATION = "runbook.io/run"
KUBELET_SIGNER = "kubernetes.io/kube-apiserver-client-kubelet"
CSR_API = ("certificates.k8s.io/v1", "certificatesigningrequests")
# what kubelets ask for: 1.20 (RSA or ECDSA keys) all three; newer kubelets may leave out key encipherment
KUBELET_USAGES = (frozenset({"digital signature", "key encipherment", "client auth"}),
                  frozenset({"digital signature", "client auth"}))
HANDOFF_KEY = "bootstrap_token"  # KubeContext.handoff -> the playbooks' ``runbook_secret_bootstrap_token``
_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
POLL_SECONDS = 1.0


class BootstrapTokenSpec(FormatModel):
    """``bootstrap_token: {ttl: 15m}``: a kubelet bootstrap token for the run's node (a Secret of type
    ``bootstrap.kubernetes.io/token`` in kube-system, expiring after ``ttl``), proved to authenticate
    (TokenReview) before anything else is done with it (``engine.kube_verbs.node_bootstrap``)."""

    ttl: Duration = "15m"
    # the group kubeadm binds to system:node-bootstrapper (ClusterRoleBinding kubeadm:kubelet-bootstrap)
    group: str = Field(default="system:bootstrappers:kubeadm:default-node-token",
                       pattern=r"^system:bootstrappers:[a-z0-9:-]+$")

    @model_validator(mode="before")
    @classmethod
    def _true_is_defaults(cls, v: Any) -> Any:
        return {} if v is None or v is True else v


class ApproveNodeCsrSpec(FormatModel):
    """``approve_node_csr: {timeout: 2m}``: approve the kubelet client CSR the run's bootstrap token
    made, only if it asks for exactly the run's node (requestor, signer, usages, subject, no SANs)."""

    timeout: Duration = "120s"

    @model_validator(mode="before")
    @classmethod
    def _true_is_defaults(cls, v: Any) -> Any:
        return {} if v is None or v is True else v


class KubeBootstrapToken(KubeVerbSpec):
    KEY: ClassVar[str] = "bootstrap_token"
    ORDER: ClassVar[int] = 130
    SELF_VERIFYING: ClassVar[bool] = True  # the token exists and authenticates, or the step fails
    bootstrap_token: BootstrapTokenSpec = Field(default_factory=BootstrapTokenSpec)


class KubeApproveNodeCsr(KubeVerbSpec):
    KEY: ClassVar[str] = "approve_node_csr"
    ORDER: ClassVar[int] = 140
    SELF_VERIFYING: ClassVar[bool] = True  # approved (and issued) or the step fails
    approve_node_csr: ApproveNodeCsrSpec = Field(default_factory=ApproveNodeCsrSpec)


class KubeDeleteBootstrapTokens(KubeVerbSpec):
    KEY: ClassVar[str] = "delete_bootstrap_tokens"
    ORDER: ClassVar[int] = 150
    SELF_VERIFYING: ClassVar[bool] = True  # none of the node's tokens is left, or the step fails
    delete_bootstrap_tokens: Literal[True]


def node_label_value(node: str) -> str:
    """The label value naming ``node``: its name when it is a valid label value, else a digest."""
    if len(node) <= 63 and node.replace("-", "").replace(".", "").isalnum():
        return node
    return hashlib.sha256(node.encode()).hexdigest()[:40]


def new_token() -> tuple[str, str]:
    """(token id, token secret): ``[a-z0-9]{6}`` and ``[a-z0-9]{16}``, the bootstrap token format."""
    return (("".join(secrets.choice(_ALPHABET) for _ in range(6))),
            "".join(secrets.choice(_ALPHABET) for _ in range(16)))


def rfc3339(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def token_secret(node: str, token_id: str, token_secret_value: str, *, expires_at: float, group: str,
                 run_id: str = "") -> dict[str, Any]:
    """The Secret the bootstrap authenticator reads (kube-apiserver ``--enable-bootstrap-token-auth``):
    authentication only (no signing), one extra group, an expiration (the token controller of
    kube-controller-manager, ``tokencleaner``, deletes it once expired; this run deletes it before)."""
    return {
        "apiVersion": "v1", "kind": "Secret", "type": TOKEN_TYPE,
        "metadata": {"name": f"bootstrap-token-{token_id}", "namespace": NAMESPACE,
                     "labels": {NODE_LABEL: node_label_value(node)},
                     "annotations": {NODE_ANNOTATION: node, RUN_ANNOTATION: run_id or "runbook"}},
        "stringData": {
            "description": f"runbook: kubelet client certificate renewal of {node}",
            "token-id": token_id, "token-secret": token_secret_value,
            "expiration": rfc3339(expires_at),
            "usage-bootstrap-authentication": "true",
            "auth-extra-groups": group,
        },
    }


def manual_steps(node: str) -> str:
    """What an operator does by hand when the cluster cannot authenticate bootstrap tokens."""
    return (
        f"do it by hand, then run this runbook again to verify: (kubeadm clusters, on a control-plane node) "
        f"1. `kubeadm kubeconfig user --org system:nodes --client-name system:node:{node} > kubelet-{node}.conf` "
        f"(kubeadm >= 1.29; older: `kubeadm alpha kubeconfig user ...`); "
        f"2. copy it to {node}:/etc/kubernetes/kubelet.conf "
        f"(keep the old one: `cp -a kubelet.conf kubelet.conf.expired`) "
        f"and remove the stale /var/lib/kubelet/pki/kubelet-client-current.pem symlink; "
        f"3. on {node}: `systemctl restart kubelet`; with rotateCertificates: true kubelet then renews by itself; "
        f"4. `kubectl get csr` and `kubectl certificate approve <csr>` for a pending CSR of system:node:{node}. "
        f"(the CSR path instead) enable kube-apiserver --enable-bootstrap-token-auth, create a bootstrap token "
        f"(`kubeadm token create`), write /etc/kubernetes/bootstrap-kubelet.conf with it on the node, move the "
        f"expired client certificate aside and restart kubelet; approve its CSR (`kubectl certificate approve`)")


# -- deciding (pure) ----------------------------------------------------------------------------------

@decides(KubeBootstrapToken)
def decide_token(verb: KubeBootstrapToken, node: NodeFacts) -> BootstrapOperation:
    spec = verb.bootstrap_token
    ttl = parse_duration(spec.ttl)
    return BootstrapOperation(
        "bootstrap_token", f"create a bootstrap token for {node.name} (expires in {ttl:g}s, group {spec.group})",
        f"kubeadm token create --ttl {int(ttl)}s --groups {spec.group} --usages authentication "
        f"--description 'runbook: {node.name}'", ttl=ttl, group=spec.group)


@decides(KubeApproveNodeCsr)
def decide_approve(verb: KubeApproveNodeCsr, node: NodeFacts) -> BootstrapOperation:
    timeout = parse_duration(verb.approve_node_csr.timeout)
    return BootstrapOperation(
        "approve_node_csr", f"approve the kubelet client CSR of {node.name} made with its bootstrap token "
        f"(only CN=system:node:{node.name}, O=system:nodes; wait up to {timeout:g}s)",
        "kubectl certificate approve <csr of system:bootstrap:TOKEN-ID>", timeout=timeout)


@decides(KubeDeleteBootstrapTokens)
def decide_delete(verb: KubeDeleteBootstrapTokens, node: NodeFacts) -> BootstrapOperation:
    return BootstrapOperation(
        "delete_bootstrap_tokens", f"delete the bootstrap tokens made for {node.name}",
        f"kubectl -n {NAMESPACE} delete secret -l {NODE_LABEL}={node_label_value(node.name)}")


# -- the CSR check (pure) ------------------------------------------------------------------------------

def _b64(text: Any) -> bytes:
    try:
        return base64.b64decode(str(text), validate=True)
    except (ValueError, TypeError):
        return b""


def csr_content(csr: Mapping[str, Any]) -> dict[str, Any]:
    """What a CSR asks for, as evidence: name, requestor, groups, signer, usages, subject, SANs."""
    spec = csr.get("spec") or {}
    out: dict[str, Any] = {
        "name": (csr.get("metadata") or {}).get("name", ""), "requestor": spec.get("username", ""),
        "groups": list(spec.get("groups") or ()), "signer": spec.get("signerName", ""),
        "usages": list(spec.get("usages") or ()),
        "conditions": [c.get("type") for c in (csr.get("status") or {}).get("conditions") or ()],
    }
    # Why here: ~0.3 s to import, and only a CSR needs it (every command imports the verbs)
    from cryptography import x509

    try:
        request = x509.load_pem_x509_csr(_b64(spec.get("request")))
    except ValueError as e:
        out["request_error"] = f"not a PEM certificate request: {e}"
        return out
    out["subject"] = request.subject.rfc4514_string()
    try:
        sans = request.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        out["sans"] = [str(getattr(n, "value", n)) for n in sans]
    except x509.ExtensionNotFound:
        out["sans"] = []
    out["signature_valid"] = request.is_signature_valid
    return out


def csr_problems(csr: Mapping[str, Any], node: str, token_ids: Sequence[str]) -> list[str]:
    """Why ``csr`` is not exactly the kubelet client certificate request of ``node`` made with one of
    its bootstrap tokens; [] when it is (the only case that may be approved)."""
    spec = csr.get("spec") or {}
    problems: list[str] = []
    requestors = {f"system:bootstrap:{t}" for t in token_ids}
    if spec.get("username") not in requestors:
        problems.append(f"requestor {spec.get('username')!r} is not this run's bootstrap token "
                        f"({', '.join(sorted(requestors)) or 'none'})")
    if spec.get("signerName") != KUBELET_SIGNER:
        problems.append(f"signer {spec.get('signerName')!r} is not {KUBELET_SIGNER}")
    usages = frozenset(spec.get("usages") or ())
    if usages not in KUBELET_USAGES or len(usages) != len(spec.get("usages") or ()):
        problems.append(f"usages {sorted(usages)} are not a kubelet client's (client auth, digital signature"
                        "[, key encipherment])")
    conditions = {c.get("type") for c in (csr.get("status") or {}).get("conditions") or ()}
    if conditions & {"Approved", "Denied", "Failed"}:
        problems.append(f"already decided: {sorted(conditions)}")
    from cryptography import x509  # Why here: see csr_evidence
    from cryptography.x509.oid import ExtensionOID, NameOID

    try:
        request = x509.load_pem_x509_csr(_b64(spec.get("request")))
    except ValueError as e:
        return [*problems, f"request is not a PEM certificate request: {e}"]
    attrs = [(a.oid, a.value) for a in request.subject]
    want = [(NameOID.ORGANIZATION_NAME, "system:nodes"), (NameOID.COMMON_NAME, f"system:node:{node}")]
    if sorted(attrs, key=lambda a: (a[0].dotted_string, str(a[1]))) != sorted(
            want, key=lambda a: (a[0].dotted_string, a[1])):
        problems.append(f"subject {request.subject.rfc4514_string()!r} is not exactly "
                        f"'CN=system:node:{node},O=system:nodes'")
    for ext in request.extensions:
        if ext.oid == ExtensionOID.SUBJECT_ALTERNATIVE_NAME:
            problems.append(f"asks for subject alternative names {[str(getattr(n, 'value', n)) for n in ext.value]}"
                            " (a kubelet client certificate has none)")
        elif ext.oid in (ExtensionOID.BASIC_CONSTRAINTS, ExtensionOID.NAME_CONSTRAINTS):
            problems.append(f"asks for extension {ext.oid.dotted_string} (constraints)")
    if not request.is_signature_valid:
        problems.append("the request's self-signature is invalid")
    return problems


# -- applying ------------------------------------------------------------------------------------------

def _node_tokens(ctx: KubeContext) -> list[Mapping[str, Any]]:
    items = ctx.kube.list_objects("v1", "secrets", namespace=NAMESPACE,
                                  label_selector=f"{NODE_LABEL}={node_label_value(ctx.node)}")
    return [s for s in items if s.get("type") == TOKEN_TYPE
            and ((s.get("metadata") or {}).get("annotations") or {}).get(NODE_ANNOTATION) == ctx.node]


def _token_id(secret: Mapping[str, Any]) -> str:
    data = secret.get("data") or {}
    if data.get("token-id"):
        return _b64(data["token-id"]).decode(errors="replace")
    return str((secret.get("stringData") or {}).get("token-id")
               or str((secret.get("metadata") or {}).get("name", "")).removeprefix("bootstrap-token-"))


def _delete_tokens(ctx: KubeContext) -> list[str]:
    deleted = []
    for s in _node_tokens(ctx):
        name = str((s.get("metadata") or {}).get("name"))
        if ctx.kube.delete_object("v1", "secrets", NAMESPACE, name):
            deleted.append(f"{NAMESPACE}/{name}")
    return deleted


@applies(BootstrapOperation)
def apply(effect: BootstrapOperation, ctx: KubeContext) -> dict[str, Any]:
    if effect.verb == "bootstrap_token":
        return _create_token(effect, ctx)
    if effect.verb == "approve_node_csr":
        return _approve(effect, ctx)
    deleted = _delete_tokens(ctx)
    left = [str((s.get("metadata") or {}).get("name")) for s in _node_tokens(ctx)]
    if left:
        raise EffectFailed(f"bootstrap tokens of {ctx.node} still there after deleting: {left}",
                           {"deleted": deleted, "left": left})
    ctx.handoff.pop(HANDOFF_KEY, None)
    return {"deleted": deleted, "left": []}


def _create_token(effect: BootstrapOperation, ctx: KubeContext) -> dict[str, Any]:
    stale = _delete_tokens(ctx)  # an earlier run's token of this node (its secret is lost with that run)
    token_id, value = new_token()
    token = f"{token_id}.{value}"
    secrecy.register(token, value)  # masked in every JSON log line of this process
    expires = time.time() + effect.ttl
    body = token_secret(ctx.node, token_id, value, expires_at=expires, group=effect.group, run_id=ctx.run_id)
    name = body["metadata"]["name"]
    ctx.kube.create_object("v1", "secrets", NAMESPACE, body)
    evidence: dict[str, Any] = {"token_id": token_id, "secret": f"{NAMESPACE}/{name}", "expires": rfc3339(expires),
                                "group": effect.group, "stale_deleted": stale}
    try:
        review = ctx.kube.create_object("authentication.k8s.io/v1", "tokenreviews", "", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
            "metadata": {"name": f"runbook-bootstrap-{token_id}"}, "spec": {"token": token}})
    except KubeError as e:
        ctx.kube.delete_object("v1", "secrets", NAMESPACE, name)
        raise EffectFailed(f"could not prove the bootstrap token authenticates (TokenReview: {e}); token "
                           f"deleted, nothing else done", {**evidence, "deleted": True}) from e
    status = review.get("status") or {}
    user = status.get("user") or {}
    evidence["authenticated_as"] = user.get("username", "")
    if not status.get("authenticated") or user.get("username") != f"system:bootstrap:{token_id}" \
            or effect.group not in (user.get("groups") or ()):
        ctx.kube.delete_object("v1", "secrets", NAMESPACE, name)
        raise EffectFailed(
            f"the cluster does not authenticate bootstrap tokens (TokenReview of a fresh token: authenticated="
            f"{bool(status.get('authenticated'))}, user {user.get('username', '')!r}; kube-apiserver needs "
            f"--enable-bootstrap-token-auth): the token was deleted and nothing on {ctx.node} was changed; "
            + manual_steps(ctx.node), {**evidence, "deleted": True, "refused": "no bootstrap-token authenticator"},
            refused=True)
    ctx.handoff[HANDOFF_KEY] = token
    return evidence


def _pending_from(csrs: Sequence[Mapping[str, Any]], token_ids: Sequence[str]) -> list[Mapping[str, Any]]:
    requestors = {f"system:bootstrap:{t}" for t in token_ids}
    return [c for c in csrs if (c.get("spec") or {}).get("username") in requestors
            and not {x.get("type") for x in (c.get("status") or {}).get("conditions") or ()}
            & {"Approved", "Denied", "Failed"}]


def _approve(effect: BootstrapOperation, ctx: KubeContext) -> dict[str, Any]:
    token_ids = [_token_id(s) for s in _node_tokens(ctx)]
    if not token_ids:
        raise EffectFailed(f"no bootstrap token of {ctx.node} exists (kube-system, label {NODE_LABEL}): "
                           "nothing made by this run to approve", {"token_ids": []})
    deadline = ctx.clock() + effect.timeout
    pending: list[Mapping[str, Any]] = []
    while True:
        pending = _pending_from(ctx.kube.list_objects(*CSR_API), token_ids)
        if pending or ctx.clock() >= deadline or ctx.cancel.is_set():
            break
        ctx.progress(f"waiting for the kubelet of {ctx.node} to request its certificate")
        ctx.sleep(POLL_SECONDS)
    if not pending:
        raise EffectFailed(f"no certificate signing request from {ctx.node}'s bootstrap token within "
                           f"{effect.timeout:g}s (kubelet not running with /etc/kubernetes/bootstrap-kubelet.conf?)",
                           {"token_ids": token_ids})
    contents = [csr_content(c) for c in pending]
    checked = [(content, csr_problems(raw, ctx.node, token_ids))
               for content, raw in zip(contents, pending, strict=True)]
    refused = [(content, problems) for content, problems in checked if problems]
    if refused:
        raise EffectFailed(
            f"refused: {len(refused)} certificate signing request(s) made with {ctx.node}'s bootstrap token "
            f"ask for more than node {ctx.node}: " + "; ".join(f"{c['name']}: {', '.join(p)}" for c, p in refused)
            + " (nothing approved)", {"refused": [{**c, "problems": p} for c, p in refused]})
    approved = []
    for raw, content in zip(pending, contents, strict=True):
        body = {"apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest",
                "metadata": dict(raw.get("metadata") or {}), "spec": dict(raw.get("spec") or {}),
                "status": {"conditions": [*((raw.get("status") or {}).get("conditions") or ()), {
                    "type": "Approved", "status": "True", "reason": "RunbookNodeBootstrap",
                    "message": f"runbook run {ctx.run_id or '-'}: kubelet client certificate of {ctx.node} "
                               "(requestor, signer, usages, subject checked)"}]}}
        ctx.kube.replace_object(*CSR_API, "", body, subresource="approval")
        approved.append(content)
    names = {c["name"] for c in approved}
    issued: set[str] = set()
    while True:  # the signer (kube-controller-manager's csrsigning) issues the certificate
        for c in ctx.kube.list_objects(*CSR_API):
            name = (c.get("metadata") or {}).get("name")
            if name in names and (c.get("status") or {}).get("certificate"):
                issued.add(str(name))
        if issued == names or ctx.clock() >= deadline or ctx.cancel.is_set():
            break
        ctx.sleep(POLL_SECONDS)
    evidence = {"approved": approved, "issued": sorted(issued)}
    if issued != names:
        raise EffectFailed(f"approved {sorted(names)} but no certificate was issued within {effect.timeout:g}s "
                           f"(is a signer for {KUBELET_SIGNER} running?)", evidence)
    return evidence


@previews(BootstrapOperation)
def preview(effect: BootstrapOperation, ctx: KubeContext) -> str:
    return ""
