"""Approvals authorised by Kubernetes RBAC (cluster mode, issue 15): may the caller approve, and who is it.

``runbook approve --store kubernetes`` asks the API server, with the caller's own kubeconfig: a
SelfSubjectAccessReview for verb ``approve`` on ``remediationruns`` (group ``runbook.io``) in the store
namespace, for that run; then the authenticated username (``IdentityAPI.authenticated_user``:
SelfSubjectReview where served, else TokenReview of the caller's own token, else the client
certificate's CN). That username is what the store records as the approver: never a name typed on
the command line.

What it must not do: record anything (the store does, after this says yes), guess an identity from
the kubeconfig's text, or let an unanswerable question pass (an API error refuses: fail closed).
"""

from __future__ import annotations

from engine.connectors.base import IdentityAPI
from engine.errors import Forbidden, KubeError

GROUP = "runbook.io"
RESOURCE = "remediationruns"
VERB = "approve"
PERMISSION = f'verb "{VERB}" on "{RESOURCE}" (apiGroup {GROUP})'


class ApprovalForbidden(Forbidden):
    """The caller may not approve (RBAC said no, or could not be asked): exit 3, nothing recorded."""


def authorize_approval(api: IdentityAPI, namespace: str, run_name: str) -> str:
    """The authenticated username of a caller RBAC allows to approve ``run_name``; else ``ApprovalForbidden``
    naming the missing permission."""
    try:
        allowed, reason = api.self_access_review(VERB, GROUP, RESOURCE, namespace=namespace, name=run_name)
    except KubeError as e:
        raise ApprovalForbidden(f"cannot ask the API server whether you may approve run {run_name}: {e}") from e
    if not allowed:
        why = f" ({reason})" if reason else ""
        raise ApprovalForbidden(
            f"forbidden: you may not approve run {run_name}: approving needs {PERMISSION} in namespace "
            f"{namespace}{why}; bind the ClusterRole runbook-approver (deploy/kubernetes/approver-rbac.yaml)")
    try:
        return api.authenticated_user()
    except KubeError as e:
        raise ApprovalForbidden(
            f"forbidden: the approval of run {run_name} needs your authenticated username, and the API server "
            f"would not tell it: {e}. On Kubernetes < 1.26 it comes from a TokenReview of your own token, "
            "which needs verb \"create\" on \"tokenreviews\" (apiGroup authentication.k8s.io, cluster-wide): "
            "bind the ClusterRole runbook-approver-identity with a ClusterRoleBinding") from e
