"""Interfaces of the outside systems, as the engine sees them.

The engine depends on these Protocols, never on ``kubernetes`` or ``ansible_runner``
directly. Implementations: ``engine.connectors.kube.KubeConnector`` and
``engine.connectors.ansible.AnsibleConnector``; unit tests use fakes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from engine.facts import HostFacts, NodeFacts

PatchType = Literal["merge", "strategic", "json"]


@dataclass(frozen=True)
class PodRef:
    namespace: str
    name: str
    node: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    phase: str = ""
    # Resources the pod asks for (resource -> quantity as a plain decimal, e.g. {"nvidia.com/gpu": "1",
    # "cpu": "1.5"}): engine.resources.pod_spec_requests, the scheduler's effective request.
    requests: Mapping[str, str] = field(default_factory=dict)
    # What a drain decides from (engine/kube_verbs/drain.py), read at the connector boundary:
    uid: str = ""
    controller_kind: str = ""  # kind of the ownerReference with controller: true ("" = unmanaged)
    controller_name: str = ""
    mirror: bool = False  # a static pod's mirror (annotation kubernetes.io/config.mirror)
    empty_dir: tuple[str, ...] = ()  # names of its emptyDir volumes (local data a drain would lose)
    deleting: bool = False  # metadata.deletionTimestamp is set

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class LeaseRecord:
    namespace: str
    name: str
    holder: str
    duration_seconds: int
    acquire_time: float  # epoch seconds
    renew_time: float
    resource_version: str
    transitions: int = 0  # spec.leaseTransitions: +1 each time another holder takes it (the fencing token)


@dataclass(frozen=True)
class NodeEvent:
    """A Kubernetes Event about a Node, as runbook reports it (``engine.node_events``)."""

    node: str
    reason: str  # CamelCase, e.g. RemediationStepSucceeded
    note: str  # human-readable; the API caps it at 1 kB
    type: Literal["Normal", "Warning"] = "Normal"
    action: str = "Remediate"
    reporting_controller: str = "runbook"
    reporting_instance: str = "runbook"
    namespace: str = "default"  # where kubelet records Node events and kubectl looks first


@dataclass(frozen=True)
class TokenReviewResult:
    """What the API server's TokenReview says of a bearer token (``authentication.k8s.io/v1``)."""

    authenticated: bool
    username: str = ""
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    error: str = ""  # the server's status.error when not authenticated
    audiences: tuple[str, ...] = ()  # status.audiences: those of the review's the token is valid for


@dataclass(frozen=True)
class AccessReviewResult:
    """What a SubjectAccessReview (``authorization.k8s.io/v1``) decided for one verb and resource."""

    allowed: bool
    denied: bool = False
    reason: str = ""


class KubeReviews(Protocol):
    """The API server as an authenticator and authoriser of other callers (TokenReview,
    SubjectAccessReview). Errors are ``engine.errors.KubeError`` (``Forbidden`` when the identity in
    use may not create reviews: it needs ClusterRole ``system:auth-delegator``)."""

    def review_token(self, token: str, audiences: Sequence[str] = ()) -> TokenReviewResult: ...

    def review_access(self, *, user: str, groups: Sequence[str], uid: str,
                      extra: Mapping[str, Sequence[str]], verb: str, resource: str, group: str,
                      namespace: str) -> AccessReviewResult: ...


class KubeAPI(Protocol):
    """Kubernetes, reduced to what runbooks need. Errors are ``engine.errors.KubeError``."""

    def read_node(self, name: str) -> NodeFacts | None: ...

    def list_nodes(self, label_selector: str | None = None) -> list[NodeFacts]: ...

    def patch_node(self, name: str, patch: Any, *, patch_type: PatchType = "merge",
                   dry_run: bool = False) -> NodeFacts: ...

    def list_pods(self, *, node: str | None = None, label_selector: str | None = None,
                  namespace: str | None = None) -> list[PodRef]: ...

    def evict_pod(self, pod: PodRef, *, dry_run: bool = False, grace_seconds: int | None = None) -> None:
        """An Eviction of the version ``eviction_version`` names. A PodDisruptionBudget's refusal
        raises ``KubeError`` with status 429 (retryable); a pod already gone is not an error."""
        ...

    def eviction_version(self) -> str:
        """The Eviction API version the server serves for ``pods/eviction`` (discovery):
        ``policy/v1`` (Kubernetes >= 1.22) or ``policy/v1beta1``."""
        ...

    def wait_for_pods_gone(self, pods: Sequence[PodRef], timeout: float) -> list[PodRef]:
        """Watch until none of ``pods`` exists any more (a pod recreated under the same name with
        another uid counts as gone), or ``timeout``; returns those still there."""
        ...

    def delete_pod(self, pod: PodRef, *, dry_run: bool = False, grace_seconds: int | None = None) -> None: ...

    def list_objects(self, api_version: str, kind_plural: str, *, namespace: str | None = None,
                     label_selector: str | None = None, cached: bool = False,
                     not_older_than: str | None = None) -> list[Mapping[str, Any]]:
        """Any listable kind (core or custom), as plain mappings. ``cached``: served from the API
        server's watch cache (no etcd read of every object): as it is (``resourceVersion=0``, it may
        lag the latest write by a moment), or once it holds at least ``not_older_than`` (a
        resourceVersion the caller wrote: it reads its own writes)."""
        ...

    # Any object by kind (Secrets, TokenReviews, CertificateSigningRequests: the kubelet bootstrap
    # verbs, engine.kube_verbs.node_bootstrap); the same calls as ``ObjectAPI`` (namespace "": a
    # cluster-scoped kind)
    def read_object(self, api_version: str, kind_plural: str, namespace: str, name: str) -> dict[str, Any] | None: ...

    def create_object(self, api_version: str, kind_plural: str, namespace: str,
                      body: Mapping[str, Any]) -> dict[str, Any]: ...

    def replace_object(self, api_version: str, kind_plural: str, namespace: str, body: Mapping[str, Any], *,
                       subresource: str | None = None) -> dict[str, Any]: ...

    def delete_object(self, api_version: str, kind_plural: str, namespace: str, name: str, *,
                      resource_version: str | None = None) -> bool: ...

    def served_resources(self, api_version: str) -> frozenset[str] | None:
        """API discovery: the resource names (plurals) the server serves under ``api_version``
        (e.g. ``"remediation.medik8s.io/v1alpha1"``), or None when it serves no such group/version."""
        ...

    def wait_for_node(self, name: str, predicate: Callable[[NodeFacts | None], bool],
                      timeout: float) -> tuple[bool, NodeFacts | None]:
        """Watch the node until ``predicate`` holds (True, node) or ``timeout`` (False, last seen)."""
        ...

    def read_lease(self, namespace: str, name: str) -> LeaseRecord | None: ...

    def create_lease(self, namespace: str, name: str, holder: str, duration_seconds: int) -> LeaseRecord:
        """Raises ``Conflict`` when it already exists."""
        ...

    def update_lease(self, lease: LeaseRecord, holder: str, duration_seconds: int,
                     *, acquire: bool) -> LeaseRecord:
        """Replace with the given resourceVersion; ``Conflict`` (409) when it is stale."""
        ...

    def delete_lease(self, lease: LeaseRecord) -> None: ...

    def create_node_event(self, event: NodeEvent) -> None:
        """Record ``event`` as a Kubernetes Event about its Node (what ``kubectl describe node`` and
        ``kubectl get events`` show)."""
        ...


class IdentityAPI(Protocol):
    """Who the Kubernetes credential in use is and what it may do (``runbook approve`` in cluster mode)."""

    def self_access_review(self, verb: str, group: str, resource: str, *, namespace: str = "",
                           name: str = "", subresource: str = "") -> tuple[bool, str]:
        """SelfSubjectAccessReview: (allowed, the authorizer's reason)."""
        ...

    def authenticated_user(self) -> str:
        """The username the API server authenticates the credential as (never the kubeconfig's text)."""
        ...


class ObjectAPI(Protocol):
    """Namespaced objects of one kind (custom resources: the run store, ``engine.kube_store``) as
    plain JSON documents. Errors are ``engine.errors.KubeError`` (``Conflict`` for a stale
    resourceVersion, ``Forbidden`` for RBAC)."""

    def read_object(self, api_version: str, kind_plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        ...

    def list_objects(self, api_version: str, kind_plural: str, *, namespace: str | None = None,
                     label_selector: str | None = None, cached: bool = False,
                     not_older_than: str | None = None) -> list[Mapping[str, Any]]: ...

    def create_object(self, api_version: str, kind_plural: str, namespace: str,
                      body: Mapping[str, Any]) -> dict[str, Any]:
        """POST; ``Conflict`` when an object of that name exists. Returns the created object."""
        ...

    def replace_object(self, api_version: str, kind_plural: str, namespace: str, body: Mapping[str, Any], *,
                       subresource: str | None = None) -> dict[str, Any]:
        """PUT the object (or its ``subresource``, e.g. ``status``) with the ``metadata.resourceVersion``
        of ``body`` as precondition: ``Conflict`` (409) when it is stale. Returns the new object."""
        ...

    def delete_object(self, api_version: str, kind_plural: str, namespace: str, name: str, *,
                      resource_version: str | None = None) -> bool:
        """DELETE, only that version when given (``Conflict`` otherwise); False when already gone."""
        ...


TaskEvent = Mapping[str, Any]  # {"host", "task", "status": ok|changed|failed|skipped|unreachable, "msg"}


@dataclass(frozen=True)
class PlaybookResult:
    """The outcome of one ansible-runner run over one or more hosts."""

    status: str  # successful | failed | timeout | canceled
    rc: int
    changed: Mapping[str, bool] = field(default_factory=dict)
    failed_hosts: Mapping[str, str] = field(default_factory=dict)  # host -> message
    unreachable_hosts: Mapping[str, str] = field(default_factory=dict)
    diffs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # host -> unified diffs
    host_facts: Mapping[str, HostFacts] = field(default_factory=dict)  # facts returned after acting
    tasks: tuple[TaskEvent, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "successful" and not self.failed_hosts and not self.unreachable_hosts


class NodeAutomation(Protocol):
    """Sudo work and host facts on node hosts, through Ansible. Every member is one the core calls;
    the core never probes an implementation for optional ones."""

    @property
    def facts_become(self) -> bool | None:
        """Whether facts runs use sudo: a check-mode preview started before the plan must run with
        the same privilege (its closing facts stand in for a facts run). None: any privilege will do
        (a connector whose facts do not depend on it, such as the test fakes)."""
        ...

    def inventory_host(self, node: str) -> str:
        """The inventory host for a Kubernetes node (hostvar ``k8s_node_name`` or same name).
        Raises ``HostError`` for a node the inventory does not know."""
        ...

    def gather_facts(self, nodes: Sequence[str], files: Sequence[str] = ()) -> Mapping[str, HostFacts | Exception]:
        """One read-only run for all nodes (forks); per node, facts or the error.
        ``files``: paths whose existence, content and digest the facts should include."""
        ...

    def run_playbook(self, playbook: Path, nodes: Sequence[str], *, extravars: Mapping[str, Any] | None = None,
                     become: bool = True, timeout: float = 300, check: bool = False,
                     on_event: Callable[[TaskEvent], None] | None = None) -> PlaybookResult: ...

    def recent_facts(self, nodes: Sequence[str], *, max_age: float,
                     files: Sequence[str] = ()) -> Mapping[str, tuple[HostFacts, float]]:
        """Facts at most ``max_age`` seconds old the connector already holds (from its last facts run
        or the facts a playbook published at its end) reporting on every path in ``files``, with
        their age in seconds; nodes without such facts are left out ({} when it keeps none)."""
        ...

    def cancel(self) -> None:
        """Stop the running playbook now (its whole process tree); later playbooks are refused.
        Safe to call from a signal handler."""
        ...

    def close(self) -> None:
        """End SSH control masters and remove the private data dir (no artifacts kept)."""
        ...
