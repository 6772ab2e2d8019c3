"""Kubernetes identity for ``runbook serve`` (``auth.mode: kubernetes``) against the real test API
server: ServiceAccount tokens minted with TokenRequest are checked by TokenReview, and their roles
come from real RBAC objects through SubjectAccessReview (verb ``approve`` on
``remediationruns.runbook.io`` in the store namespace -> approver; ``get`` + ``list`` -> reader). The
JSON approval API and the console (login form -> session) record the TokenReview username as the
approver; a revoked binding stops approvals; a server whose own identity may not create reviews
refuses (503) instead of guessing. No mocks: every answer comes from kube-apiserver's authenticator
and RBAC authoriser.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from engine.connectors.kube import KubeConnector
from engine.lab.controlplane import ControlPlane
from engine.serve.access import Identity
from engine.serve.kube_identity import DEFAULT_AUDIENCE, IdentityUnavailable, KubeIdentity
from tests.fakes import FakeRunStarter, alert, served, trigger_spec

pytestmark = pytest.mark.integration

NS = "runbook-system"  # the store namespace
OTHER_NS = "ident-elsewhere"


def sa_user(name: str, namespace: str = NS) -> str:
    return f"system:serviceaccount:{namespace}:{name}"


class Bed:
    """The RBAC objects of this module and tokens for its ServiceAccounts."""

    def __init__(self, plane: ControlPlane, api_client: Any, tmp: Path) -> None:
        from kubernetes import client

        self.plane, self.tmp = plane, tmp
        self.core = client.CoreV1Api(api_client)
        self.rbac = client.RbacAuthorizationV1Api(api_client)
        self.admin = KubeConnector(kubeconfig=str(plane.kubeconfig))
        self.suffix = secrets.token_hex(3)  # RBAC objects are cluster state: names unique per run

    def namespace(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.create_namespace({"metadata": {"name": name}})
        except ApiException as e:
            if e.status != 409:
                raise

    def service_account(self, name: str, namespace: str = NS) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
        except ApiException as e:
            if e.status != 409:
                raise

    def role(self, name: str, verbs: list[str], namespace: str = NS) -> None:
        self.rbac.create_namespaced_role(namespace, {
            "metadata": {"name": name},
            "rules": [{"apiGroups": ["runbook.io"], "resources": ["remediationruns"], "verbs": verbs}]})

    def bind(self, binding: str, role: str, sa: str, namespace: str = NS, *, sa_namespace: str = NS,
             cluster_role: bool = False) -> None:
        body = {"metadata": {"name": binding},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                            "kind": "ClusterRole" if cluster_role else "Role", "name": role},
                "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": sa_namespace}]}
        if cluster_role and namespace == "":
            self.rbac.create_cluster_role_binding(body)
        else:
            self.rbac.create_namespaced_role_binding(namespace, body)

    def token(self, sa: str, namespace: str = NS, audiences: Sequence[str] = (DEFAULT_AUDIENCE,)) -> str:
        """A TokenRequest token made for runbook (the audience a console login needs), or for
        ``audiences`` (``()``: the API server's own)."""
        return self.plane.issue_token(namespace, sa, expiration_seconds=3600, audiences=audiences)

    def identity(self, *, cache_seconds: float = 0.0, conn: KubeConnector | None = None,
                 audiences: Sequence[str] = (DEFAULT_AUDIENCE,)) -> KubeIdentity:
        use = conn or self.admin
        return KubeIdentity(lambda: use, NS, cache_seconds=cache_seconds, audiences=audiences)


@pytest.fixture(scope="module")
def bed(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    with control_plane.new_api_client() as api_client:
        b = Bed(control_plane, api_client, tmp_path_factory.mktemp("kube-identity"))
        for ns in (NS, OTHER_NS):
            b.namespace(ns)
        suffix = b.suffix
        for sa in ("oncall", "viewer", "stranger", "revoked", "serve-noreview", "serve-delegated"):
            b.service_account(sa)
        b.role(f"runs-approver-{suffix}", ["approve", "get", "list"])
        b.role(f"runs-reader-{suffix}", ["get", "list"])
        b.role(f"runs-approver-{suffix}", ["approve", "get", "list"], namespace=OTHER_NS)
        b.bind(f"oncall-{suffix}", f"runs-approver-{suffix}", "oncall")
        b.bind(f"revoked-{suffix}", f"runs-approver-{suffix}", "revoked")
        b.bind(f"viewer-{suffix}", f"runs-reader-{suffix}", "viewer")
        # stranger may approve runs - in another namespace, which is not the store's
        b.bind(f"stranger-{suffix}", f"runs-approver-{suffix}", "stranger", namespace=OTHER_NS)
        b.bind(f"serve-delegated-{suffix}", "system:auth-delegator", "serve-delegated", namespace="",
               cluster_role=True)
        try:
            yield b
        finally:
            b.admin.close()


def test_a_service_account_allowed_to_approve_remediationruns_is_an_approver_under_its_tokenreview_username(
        bed: Bed) -> None:
    assert bed.identity().identify(bed.token("oncall")) == Identity(sa_user("oncall"), "approver")


def test_tokenreview_names_the_runbook_audience_and_a_token_made_for_the_api_server_alone_is_no_login(
        bed: Bed) -> None:
    """#25 item 7, on the real API server: TokenRequest tokens carry audiences; the review asks for
    ``runbook`` and the answer's status.audiences confirms it. A token made for the API server (the
    TokenRequest default, what a kubeconfig holds) is refused unless the operator opts in."""
    for_runbook = bed.token("oncall")
    for_api_server = bed.token("oncall", audiences=())
    review = bed.admin.review_token(for_runbook, (DEFAULT_AUDIENCE,))
    assert review.authenticated and review.audiences == (DEFAULT_AUDIENCE,)
    assert not bed.admin.review_token(for_api_server, (DEFAULT_AUDIENCE,)).authenticated
    ident = bed.identity()
    assert ident.identify(for_runbook) == Identity(sa_user("oncall"), "approver")
    assert ident.identify(for_api_server) is None
    opted_in = bed.identity(audiences=())  # auth.kubernetes.api_server_audience: true
    assert opted_in.identify(for_api_server) == Identity(sa_user("oncall"), "approver")
    assert opted_in.identify(for_runbook) is None  # made for runbook, not for the API server
    other = bed.token("oncall", audiences=("another-service",))
    assert ident.identify(other) is None and opted_in.identify(other) is None


def test_get_and_list_make_a_reader_and_an_approve_grant_in_another_namespace_makes_no_role(bed: Bed) -> None:
    ident = bed.identity()
    assert ident.identify(bed.token("viewer")) == Identity(sa_user("viewer"), "reader")
    stranger = ident.identify(bed.token("stranger"))
    assert stranger == Identity(sa_user("stranger"), "none")
    assert stranger is not None and not stranger.may("reader", "approver")


def test_a_token_the_api_server_did_not_issue_or_whose_signature_was_changed_is_no_identity(bed: Bed) -> None:
    ident = bed.identity()
    real = bed.token("oncall")
    head, payload, signature = real.split(".")
    forged = ".".join([head, payload, signature[:-4] + ("AAAA" if not signature.endswith("AAAA") else "BBBB")])
    assert ident.identify(forged) is None
    assert ident.identify("not-a-token-" + secrets.token_hex(8)) is None
    assert ident.identify("") is None


def test_removing_the_rolebinding_takes_approval_away_within_the_cache_time(bed: Bed) -> None:
    token = bed.token("revoked")
    cached = bed.identity(cache_seconds=60)
    assert cached.identify(token) == Identity(sa_user("revoked"), "approver")
    bed.rbac.delete_namespaced_role_binding(f"revoked-{bed.suffix}", NS)
    assert cached.identify(token) == Identity(sa_user("revoked"), "approver")  # cached answer
    cached.forget()
    assert cached.identify(token) == Identity(sa_user("revoked"), "none")


def test_a_server_whose_own_identity_may_not_create_reviews_refuses_and_one_bound_to_auth_delegator_answers(
        bed: Bed) -> None:
    token = bed.token("oncall")
    bare = KubeConnector(kubeconfig=str(bed.plane.service_account_kubeconfig(NS, "serve-noreview",
                                                                             bed.tmp / "noreview")))
    delegated = KubeConnector(kubeconfig=str(bed.plane.service_account_kubeconfig(NS, "serve-delegated",
                                                                                  bed.tmp / "delegated")))
    try:
        with pytest.raises(IdentityUnavailable, match="system:auth-delegator"):
            bed.identity(conn=bare).identify(token)
        assert bed.identity(conn=delegated).identify(token) == Identity(sa_user("oncall"), "approver")
    finally:
        bare.close()
        delegated.close()


def _waiting(s: Any) -> str:
    assert s.post_alerts(alert("omen2")).status_code == 202
    s.idle()
    run_id: str = s.starter.runs()[0]["id"]
    assert s.starter.run(run_id)["state"] == "waiting-approval"
    return run_id


def test_the_json_api_records_the_tokenreview_username_and_refuses_readers_strangers_and_forgeries(
        bed: Bed) -> None:
    starter = FakeRunStarter([trigger_spec(mode="approve", matchers=('node=~"omen.*"',))])
    with served("approve", starter=starter, identity=bed.identity(), auth={"reads": "token"}) as s:
        run_id = _waiting(s)
        digest = s.starter.run(run_id)["plan_digest"]

        def bearer(token: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {token}"}

        viewer, stranger, oncall = bed.token("viewer"), bed.token("stranger"), bed.token("oncall")
        assert s.client.get("/runs", headers=bearer(viewer)).status_code == 200
        assert s.client.get("/runs", headers=bearer(stranger)).status_code == 403
        assert s.client.get("/runs", headers=bearer("forged-" + secrets.token_hex(8))).status_code == 401
        refused = s.client.post(f"/runs/{run_id}/approve", json={"plan_digest": digest}, headers=bearer(viewer))
        assert refused.status_code == 403 and "may not approve" in refused.json()["error"]
        assert s.starter.run(run_id)["approved_by"] is None
        ok = s.client.post(f"/runs/{run_id}/approve", json={"plan_digest": digest}, headers=bearer(oncall))
        assert ok.status_code in (200, 202), ok.text
        assert s.starter.run(run_id)["approved_by"] == sa_user("oncall")


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found is not None
    return found.group(1)


def test_the_console_logs_in_with_a_service_account_token_and_a_revoked_binding_stops_its_session(
        bed: Bed) -> None:
    suffix = bed.suffix
    bed.service_account("oncall-2")
    bed.bind(f"oncall-2-{suffix}", f"runs-approver-{suffix}", "oncall-2")
    starter = FakeRunStarter([trigger_spec(mode="approve", matchers=('node=~"omen.*"',))])
    with served("approve", starter=starter, identity=bed.identity(), auth={"reads": "token"}) as s:
        first, second = _waiting(s), None
        assert s.post_alerts(alert("omen3")).status_code == 202
        s.idle()
        second = next(r["id"] for r in s.starter.runs() if r["id"] != first)

        s.client.cookies.clear()
        form = s.client.get("/ui/login")
        stranger = s.client.post("/ui/login", data={"csrf": _csrf(form.text), "credential": bed.token("stranger")},
                                 follow_redirects=False)
        assert stranger.status_code == 403 and "may not read runs" in stranger.text
        s.client.cookies.clear()
        form = s.client.get("/ui/login")
        login = s.client.post("/ui/login", data={"csrf": _csrf(form.text), "credential": bed.token("oncall-2"),
                                                 "next": "/ui/"}, follow_redirects=False)
        assert login.status_code == 303 and "runbook_session" in s.client.cookies
        page = s.client.get(f"/ui/runs/{first}")
        assert sa_user("oncall-2") in page.text and 'id="approve"' in page.text
        ok = s.client.post(f"/ui/runs/{first}/decision", data={
            "csrf": _csrf(page.text), "action": "approve", "plan_digest": s.starter.run(first)["plan_digest"]})
        assert ok.status_code == 200 and s.starter.run(first)["approved_by"] == sa_user("oncall-2")

        bed.rbac.delete_namespaced_role_binding(f"oncall-2-{suffix}", NS)
        page = s.client.get(f"/ui/runs/{second}")
        refused = s.client.post(f"/ui/runs/{second}/decision", data={
            "csrf": _csrf(page.text), "action": "approve", "plan_digest": s.starter.run(second)["plan_digest"]})
        assert refused.status_code == 403 and f"{sa_user('oncall-2')} (none) may not approve" in refused.text
        assert s.starter.run(second)["approved_by"] is None


def test_when_kubernetes_cannot_be_asked_the_api_and_the_login_answer_503_and_nothing_is_approved(
        bed: Bed) -> None:
    bare = KubeConnector(kubeconfig=str(bed.plane.service_account_kubeconfig(NS, "serve-noreview",
                                                                             bed.tmp / "noreview-http")))
    starter = FakeRunStarter([trigger_spec(mode="approve", matchers=('node=~"omen.*"',))])
    try:
        with served("approve", starter=starter, identity=bed.identity(conn=bare), auth={"reads": "token"}) as s:
            run_id = _waiting(s)
            oncall = {"Authorization": f"Bearer {bed.token('oncall')}"}
            reads = s.client.get("/runs", headers=oncall)
            assert reads.status_code == 503 and "system:auth-delegator" in reads.json()["error"]
            approve = s.client.post(f"/runs/{run_id}/approve", headers=oncall,
                                    json={"plan_digest": s.starter.run(run_id)["plan_digest"]})
            assert approve.status_code == 503 and s.starter.run(run_id)["approved_by"] is None
            s.client.cookies.clear()
            form = s.client.get("/ui/login")
            login = s.client.post("/ui/login", data={"csrf": _csrf(form.text), "credential": bed.token("oncall")},
                                  follow_redirects=False)
            assert login.status_code == 503 and "runbook_session" not in s.client.cookies
    finally:
        bare.close()
