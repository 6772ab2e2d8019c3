"""The kubelet bootstrap verbs (engine.kube_verbs.node_bootstrap): a bootstrap token that expires and is
proved to authenticate (else deleted, refused with the manual steps), a CSR approved only when it asks
for exactly the run's node, every token of the node deleted. Over our FakeKube, taught the three API
calls a real API server answers here (TokenReview, the CSR approval, the signer)."""

from __future__ import annotations

import base64
import copy
import ipaddress
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from engine import kube_verbs as kv
from engine import probes, secrecy
from engine.execution import Executor
from engine.facts import ServiceFacts
from engine.kube_verbs import node_bootstrap as nb
from engine.kube_verbs.effects import EffectFailed
from engine.loader import default_runbooks_dir, load_runbook
from engine.model import KubeAction, RunResult, RunState
from engine.planning import plan_run
from tests.fakes import FakeKube, FakeNodes, RecordingSink, make_host, make_node

NODE = "gpu-3090-3"
CSR_KEY = ("certificates.k8s.io/v1", "certificatesigningrequests")


class BootstrapKube(FakeKube):
    """FakeKube plus what the API server does for a TLS bootstrap: TokenReview against the stored
    bootstrap-token Secrets (only with ``authenticator``), the CSR ``approval`` subresource, and the
    signer issuing approved requests (only with ``signer``)."""

    def __init__(self, *, authenticator: bool = True, signer: bool = True) -> None:
        super().__init__([make_node(NODE, ready=False)])
        self.authenticator, self.signer = authenticator, signer
        self.reviews: list[str] = []
        self.approvals: list[str] = []

    def create_object(self, api_version: str, kind_plural: str, namespace: str,
                      body: Mapping[str, Any]) -> dict[str, Any]:
        if kind_plural != "tokenreviews":
            return super().create_object(api_version, kind_plural, namespace, body)
        token = body["spec"]["token"]
        self.reviews.append(token)
        token_id, _, value = token.partition(".")
        for s in self.objects.get(("v1", "secrets"), []):
            data = s.get("stringData") or {}
            if self.authenticator and data.get("token-id") == token_id and data.get("token-secret") == value:
                return {**body, "status": {"authenticated": True, "user": {
                    "username": f"system:bootstrap:{token_id}",
                    "groups": ["system:bootstrappers", data["auth-extra-groups"], "system:authenticated"]}}}
        return {**body, "status": {"authenticated": False}}

    def replace_object(self, api_version: str, kind_plural: str, namespace: str, body: Mapping[str, Any], *,
                       subresource: str | None = None) -> dict[str, Any]:
        if subresource != "approval":
            return super().replace_object(api_version, kind_plural, namespace, body, subresource=subresource)
        _, cur = self._find(api_version, kind_plural, namespace, body["metadata"]["name"])
        cur.setdefault("status", {})["conditions"] = copy.deepcopy(body["status"]["conditions"])  # type: ignore[index]
        self.approvals.append(body["metadata"]["name"])
        if self.signer:
            cur["status"]["certificate"] = base64.b64encode(b"-----BEGIN CERTIFICATE-----").decode()  # type: ignore[index]
        return copy.deepcopy(dict(cur))

    def add_csr(self, csr: dict[str, Any]) -> None:
        self.objects.setdefault(CSR_KEY, []).append(csr)

    def tokens(self) -> list[Mapping[str, Any]]:
        return [s for s in self.objects.get(("v1", "secrets"), []) if s.get("type") == nb.TOKEN_TYPE]


def ctx(kube: BootstrapKube, node: str = NODE) -> kv.KubeContext:
    return kv.KubeContext(kube, node, kube.clock.now, kube.clock.sleep, threading.Event(), run_id="r-1")


def effect(spec: Mapping[str, Any]) -> Any:
    return kv.kube_effect(KubeAction.model_validate({"kube": spec}).kube, make_node(NODE, ready=False))


def csr(*, name: str = "csr-abc", token_id: str = "abcdef", cn: str = f"system:node:{NODE}",
        orgs: Sequence[str] = ("system:nodes",), ous: Sequence[str] = (), dns: Sequence[str] = (),
        ips: Sequence[str] = (), signer: str = nb.KUBELET_SIGNER,
        usages: Sequence[str] = ("digital signature", "key encipherment", "client auth"),
        requestor: str | None = None, conditions: Sequence[str] = ()) -> dict[str, Any]:
    """A CertificateSigningRequest as the API server stores a kubelet's (or an impostor's)."""
    key = ec.generate_private_key(ec.SECP256R1())
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    attrs += [x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, u) for u in ous]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, cn))
    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name(attrs))
    if dns or ips:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]), critical=False)
    pem = builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
    return {"apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest",
            "metadata": {"name": name, "namespace": "", "resourceVersion": "1"},
            "spec": {"request": base64.b64encode(pem).decode(), "signerName": signer, "usages": list(usages),
                     "username": requestor or f"system:bootstrap:{token_id}",
                     "groups": ["system:bootstrappers", "system:bootstrappers:kubeadm:default-node-token",
                                "system:authenticated"]},
            "status": {"conditions": [{"type": c, "status": "True"} for c in conditions]}}


# -- the CSR check -------------------------------------------------------------------------------------

def test_the_kubelets_own_request_for_exactly_its_node_has_nothing_wrong() -> None:
    assert nb.csr_problems(csr(), NODE, ["abcdef"]) == []
    newer = csr(usages=("digital signature", "client auth"))  # newer kubelets leave out key encipherment
    assert nb.csr_problems(newer, NODE, ["abcdef"]) == []


@pytest.mark.parametrize(("hostile", "why"), [
    ({"cn": "system:node:gpu-3090-1"}, "subject"),                              # another node
    ({"cn": "system:node:gpu-3090-3x"}, "subject"),                             # a prefix is not the node
    ({"orgs": ("system:nodes", "system:masters")}, "subject"),                 # an extra group
    ({"orgs": ("system:masters",)}, "subject"),                                 # the wrong group
    ({"ous": ("ops",)}, "subject"),                                             # anything more in the subject
    ({"signer": "kubernetes.io/kube-apiserver-client"}, "signer"),              # any client certificate
    ({"signer": "kubernetes.io/kubelet-serving"}, "signer"),
    ({"usages": ("digital signature", "key encipherment", "client auth", "server auth")}, "usages"),
    ({"usages": ("digital signature", "key encipherment", "server auth")}, "usages"),
    ({"usages": ("client auth", "client auth", "digital signature")}, "usages"),
    ({"dns": ("kubernetes.default.svc",)}, "subject alternative names"),        # a serving SAN
    ({"ips": ("10.96.0.1",)}, "subject alternative names"),
    ({"requestor": "system:bootstrap:zzzzzz"}, "requestor"),                    # another token's request
    ({"requestor": "system:node:gpu-3090-1"}, "requestor"),                     # another node's kubelet
    ({"requestor": "admin"}, "requestor"),
    ({"conditions": ("Denied",)}, "already decided"),
])
def test_a_request_that_asks_for_more_or_other_than_that_node_is_refused(hostile: dict[str, Any], why: str) -> None:
    problems = nb.csr_problems(csr(**hostile), NODE, ["abcdef"])
    assert problems and any(why in p for p in problems), problems


def test_a_request_that_is_no_certificate_request_is_refused() -> None:
    bad = csr()
    bad["spec"]["request"] = base64.b64encode(b"not a pem").decode()
    assert any("not a PEM certificate request" in p for p in nb.csr_problems(bad, NODE, ["abcdef"]))


# -- the token's life -----------------------------------------------------------------------------------

def test_a_token_is_created_expiring_for_bootstrap_authentication_only_and_proved_to_authenticate() -> None:
    kube = BootstrapKube()
    c = ctx(kube)
    evidence = kv.apply(effect({"bootstrap_token": {"ttl": "10m"}}), c)
    (secret,) = kube.tokens()
    data = secret["stringData"]
    assert secret["metadata"]["namespace"] == "kube-system"
    assert secret["metadata"]["name"] == f"bootstrap-token-{data['token-id']}"
    assert secret["metadata"]["labels"] == {nb.NODE_LABEL: NODE}
    assert data["usage-bootstrap-authentication"] == "true" and "usage-bootstrap-signing" not in data
    assert data["auth-extra-groups"] == "system:bootstrappers:kubeadm:default-node-token"
    assert data["expiration"].endswith("Z")
    token = f"{data['token-id']}.{data['token-secret']}"
    assert kube.reviews == [token]  # proved through the API before anyone uses it
    assert c.handoff[nb.HANDOFF_KEY] == token  # for the run's playbook only...
    assert data["token-secret"] not in repr(evidence)  # ...never in the evidence (journaled)
    assert evidence["token_id"] == data["token-id"] and evidence["authenticated_as"].endswith(data["token-id"])
    assert token in secrecy.known()  # masked in JSON logs


def test_the_token_expires_within_its_ttl() -> None:
    kube = BootstrapKube()
    before = time.time()
    kv.apply(effect({"bootstrap_token": {"ttl": "10m"}}), ctx(kube))
    after = time.time()
    assert nb.rfc3339(before + 600) <= kube.tokens()[0]["stringData"]["expiration"] <= nb.rfc3339(after + 600)


def test_a_cluster_without_the_bootstrap_authenticator_is_refused_with_the_manual_steps_and_the_token_deleted() -> None:
    kube = BootstrapKube(authenticator=False)
    c = ctx(kube)
    with pytest.raises(EffectFailed) as e:
        kv.apply(effect({"bootstrap_token": True}), c)
    text = str(e.value)
    assert "does not authenticate bootstrap tokens" in text and "--enable-bootstrap-token-auth" in text
    assert f"kubeadm kubeconfig user --org system:nodes --client-name system:node:{NODE}" in text
    assert "kubectl certificate approve" in text and f"nothing on {NODE} was changed" in text
    assert kube.tokens() == [] and c.handoff == {}  # no credential left behind
    assert e.value.evidence["refused"] == "no bootstrap-token authenticator" and e.value.refused  # blocked, not failed


def test_an_earlier_runs_token_of_the_node_is_replaced_and_other_nodes_tokens_are_left() -> None:
    kube = BootstrapKube()
    kv.apply(effect({"bootstrap_token": True}), ctx(kube, "gpu-3090-1"))
    kv.apply(effect({"bootstrap_token": True}), ctx(kube))
    first = kube.tokens()[-1]["metadata"]["name"]
    evidence = kv.apply(effect({"bootstrap_token": True}), ctx(kube))
    assert evidence["stale_deleted"] == [f"kube-system/{first}"]
    nodes = sorted(s["metadata"]["annotations"][nb.NODE_ANNOTATION] for s in kube.tokens())
    assert nodes == ["gpu-3090-1", NODE]


def test_deleting_removes_every_token_of_the_node_and_only_those() -> None:
    kube = BootstrapKube()
    kv.apply(effect({"bootstrap_token": True}), ctx(kube, "gpu-3090-1"))
    c = ctx(kube)
    kv.apply(effect({"bootstrap_token": True}), c)
    evidence = kv.apply(effect({"delete_bootstrap_tokens": True}), c)
    assert len(evidence["deleted"]) == 1 and evidence["left"] == []
    assert [s["metadata"]["annotations"][nb.NODE_ANNOTATION] for s in kube.tokens()] == ["gpu-3090-1"]
    assert c.handoff == {}
    assert kv.apply(effect({"delete_bootstrap_tokens": True}), c) == {"deleted": [], "left": []}  # again: nothing


# -- approving -----------------------------------------------------------------------------------------

def _token_id(kube: BootstrapKube) -> str:
    return str(kube.tokens()[-1]["stringData"]["token-id"])


def test_the_nodes_request_made_with_its_token_is_approved_and_issued() -> None:
    kube = BootstrapKube()
    c = ctx(kube)
    kv.apply(effect({"bootstrap_token": True}), c)
    kube.add_csr(csr(name="csr-kubelet", token_id=_token_id(kube)))
    kube.add_csr(csr(name="csr-other", token_id="zzzzzz", cn="system:node:gpu-3090-1"))  # not ours: untouched
    evidence = kv.apply(effect({"approve_node_csr": True}), c)
    assert kube.approvals == ["csr-kubelet"]
    assert evidence["issued"] == ["csr-kubelet"]
    (approved,) = evidence["approved"]
    assert approved["subject"] == f"CN=system:node:{NODE},O=system:nodes" and approved["sans"] == []


@pytest.mark.parametrize("hostile", [{"cn": "system:node:gpu-3090-1"}, {"orgs": ("system:nodes", "system:masters")},
                                     {"signer": "kubernetes.io/kube-apiserver-client"},
                                     {"usages": ("digital signature", "client auth", "server auth")},
                                     {"dns": ("evil.example",)}])
def test_a_hostile_request_made_with_the_token_is_refused_with_its_content_and_nothing_is_approved(
        hostile: dict[str, Any]) -> None:
    kube = BootstrapKube()
    c = ctx(kube)
    kv.apply(effect({"bootstrap_token": True}), c)
    kube.add_csr(csr(name="csr-hostile", token_id=_token_id(kube), **hostile))
    kube.add_csr(csr(name="csr-kubelet", token_id=_token_id(kube)))
    with pytest.raises(EffectFailed) as e:
        kv.apply(effect({"approve_node_csr": True}), c)
    assert kube.approvals == []  # not even the good one: the token was used for something else
    assert "csr-hostile" in str(e.value) and "nothing approved" in str(e.value)
    (refused,) = e.value.evidence["refused"]
    assert refused["name"] == "csr-hostile" and refused["requestor"].startswith("system:bootstrap:")
    assert refused["problems"] and "subject" in refused and "usages" in refused and "signer" in refused


def test_no_request_by_the_timeout_fails_without_approving_anything() -> None:
    kube = BootstrapKube()
    c = ctx(kube)
    kv.apply(effect({"bootstrap_token": True}), c)
    start = kube.clock.now()
    with pytest.raises(EffectFailed, match="no certificate signing request"):
        kv.apply(effect({"approve_node_csr": {"timeout": "30s"}}), c)
    assert kube.clock.now() - start >= 30 and kube.approvals == []


def test_without_a_token_of_the_node_nothing_is_approved() -> None:
    kube = BootstrapKube()
    kube.add_csr(csr(name="csr-kubelet"))
    with pytest.raises(EffectFailed, match="no bootstrap token"):
        kv.apply(effect({"approve_node_csr": True}), ctx(kube))
    assert kube.approvals == []


def test_an_approved_request_the_signer_never_issues_fails_the_step() -> None:
    kube = BootstrapKube(signer=False)
    c = ctx(kube)
    kv.apply(effect({"bootstrap_token": True}), c)
    kube.add_csr(csr(name="csr-kubelet", token_id=_token_id(kube)))
    with pytest.raises(EffectFailed, match="no certificate was issued"):
        kv.apply(effect({"approve_node_csr": {"timeout": "20s"}}), c)
    assert kube.approvals == ["csr-kubelet"]


# -- the shipped runbook, end to end over the fakes ------------------------------------------------------

CERT = ("E bootstrap.go:266] part of the existing bootstrap client certificate in /etc/kubernetes/kubelet.conf "
        "is expired: 2025-03-20 08:12:44 +0000 UTC")


PLAYBOOKS = default_runbooks_dir().parent / "playbooks"
RUNBOOK = load_runbook(default_runbooks_dir() / "kubelet-client-cert-expired.yaml", playbooks_dir=PLAYBOOKS)
PARAMS = {"node": NODE, "ready_timeout": 60}


def run(kube: BootstrapKube, nodes: FakeNodes, sink: RecordingSink) -> RunResult:
    facts = probes.gather(RUNBOOK, PARAMS, NODE, kube, nodes, clock=kube.clock.wall)
    plan = plan_run(RUNBOOK, PARAMS, facts, runbook_digest="d" * 64, now=datetime(2026, 12, 3, tzinfo=UTC))
    return Executor(kube, nodes, events=sink, playbooks_dir=PLAYBOOKS, clock=kube.clock, sleep=kube.clock.sleep,
                    wall=kube.clock.wall).execute(plan, RUNBOOK, PARAMS)


def test_the_runbook_on_a_cluster_without_the_authenticator_is_refused_before_the_host_is_touched() -> None:
    kube = BootstrapKube(authenticator=False)
    nodes = FakeNodes({NODE: make_host(NODE, kubelet="activating", journal=CERT)}, clock=kube.clock)
    result = run(kube, nodes, RecordingSink())
    assert result.state is RunState.BLOCKED and result.exit_code == 3, result
    assert [(o.step, o.status.value) for o in result.outcomes] == [("create-bootstrap-token", "blocked")]
    assert "kubeadm kubeconfig user --org system:nodes" in result.reason
    assert [r for r in nodes.runs if not r["check"]] == [] and kube.tokens() == []


def test_the_runbook_hands_the_token_to_its_playbook_only_and_the_kubelets_csr_brings_the_node_back() -> None:
    kube = BootstrapKube()
    nodes = FakeNodes({NODE: make_host(NODE, kubelet="activating", journal=CERT)}, clock=kube.clock)
    approvals = kube.approvals

    def kubelet_bootstraps(fake: FakeNodes, node: str, evars: dict[str, Any]) -> None:
        token_id = evars["runbook_secret_bootstrap_token"].split(".")[0]  # what kubelet reads from the file
        kube.add_csr(csr(name="csr-kubelet", token_id=token_id))
        fake.update(node, services={"kubelet": ServiceFacts("kubelet", "active")})

    nodes.effects["kubelet-bootstrap.yml"] = kubelet_bootstraps
    original = kube.replace_object

    def approve_then_ready(*args: Any, **kw: Any) -> dict[str, Any]:
        out = original(*args, **kw)
        if kw.get("subresource") == "approval":
            kube.set_ready(NODE, True)  # the issued certificate: kubelet posts status again
        return out

    kube.replace_object = approve_then_ready  # type: ignore[method-assign]
    sink = RecordingSink()
    result = run(kube, nodes, sink)
    assert [(o.step, o.status.value) for o in result.outcomes] == [
        ("create-bootstrap-token", "succeeded"), ("write-bootstrap-kubeconfig", "succeeded"),
        ("approve-node-csr", "succeeded"), ("delete-bootstrap-token", "succeeded")], result.outcomes
    (playbook_run,) = [r for r in nodes.runs if not r["check"]]
    token = playbook_run["extravars"]["runbook_secret_bootstrap_token"]
    assert token == kube.reviews[0] and approvals == ["csr-kubelet"]
    assert kube.tokens() == []  # deleted at the end
    assert token.split(".")[1] not in repr(sink.events)  # never journaled, not even in the command line
