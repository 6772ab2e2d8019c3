"""The Kubernetes connector: the engine's only importer of ``kubernetes``.

``KubeConnector`` implements ``engine.connectors.base.KubeAPI`` with the official client. It
converts API objects into ``engine.facts`` values at this boundary (nothing past it sees a
client model or a raw response) and wraps every client error in ``engine.errors.KubeError``
(``NotFound`` for 404, ``Conflict`` for 409, ``retryable`` for 429/5xx and connection errors).

What it must not do: shell out to kubectl, sleep-poll where a watch can wait, or let a dead API
server hang a run (connect timeout 5 s, no client-side connection retries).

Notes on the client (kubernetes 37):

* Requests go through the client's ``ApiClient`` (kubeconfig, auth, TLS, token refresh) on the
  REST paths, and responses are read as JSON. The generated API classes are not used:
  importing ``CoreV1Api`` alone costs ~0.6 s of pydantic set-up on every CLI start, and JSON is
  the shape the watch stream delivers anyway, so one converter serves reads and watches.
* Lease bodies are sent as raw JSON: the client's models serialise datetimes with
  ``isoformat()``, which drops the fraction when microseconds are 0; the apiserver requires a
  MicroTime with exactly six fractional digits and answers 400 otherwise.
* Evictions are sent as raw JSON too, in the version discovery names for ``pods/eviction``
  (``policy/v1`` from Kubernetes 1.22, ``policy/v1beta1`` before, e.g. the lab's 1.20).
* ``kubernetes`` costs ~0.2 s to import, so it is imported in the constructor, not at module load.
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any
from urllib.parse import quote

from engine.connectors.base import (
    AccessReviewResult,
    LeaseRecord,
    NodeEvent,
    PatchType,
    PodRef,
    TokenReviewResult,
)
from engine.errors import Conflict, Forbidden, KubeError, NamespaceTerminating, NotFound
from engine.facts import Condition, NodeFacts, Taint
from engine.resources import format_quantity, pod_spec_requests

MICROTIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"
LIST_PAGE = 500  # items per page of every list (limit/continue)

_PATCH_CONTENT_TYPES: Mapping[str, str] = {
    "merge": "application/merge-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "json": "application/json-patch+json",
}


# --------------------------------------------------------------------------- conversions (pure)


def format_microtime(epoch: float) -> str:
    """A Kubernetes MicroTime: always six fractional digits, UTC, ``Z`` suffix."""
    return datetime.fromtimestamp(epoch, tz=UTC).strftime(MICROTIME_FORMAT)


def parse_time(value: str | None) -> float:
    """RFC 3339 Time or MicroTime (fraction optional) -> epoch seconds; 0.0 when absent."""
    if not value:
        return 0.0
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _transition(value: Any) -> float:
    try:
        return parse_time(value) if isinstance(value, str) else 0.0
    except ValueError:
        return 0.0


def _frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, str]:
    return MappingProxyType({str(k): str(v) for k, v in (mapping or {}).items()})


def node_facts_from_dict(obj: Mapping[str, Any]) -> NodeFacts:
    """A Node as the API serves it (JSON, camelCase) -> ``NodeFacts``."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    return NodeFacts(
        name=meta.get("name", ""),
        labels=_frozen(meta.get("labels")),
        annotations=_frozen(meta.get("annotations")),
        taints=tuple(
            Taint(key=t.get("key", ""), effect=t.get("effect", ""), value=t.get("value") or "")
            for t in spec.get("taints") or ()
        ),
        conditions=tuple(
            Condition(type=c.get("type", ""), status=c.get("status", "Unknown"),
                      reason=c.get("reason") or "", message=c.get("message") or "",
                      since=_transition(c.get("lastTransitionTime")))
            for c in status.get("conditions") or ()
        ),
        capacity=_frozen(status.get("capacity")),
        allocatable=_frozen(status.get("allocatable")),
        unschedulable=bool(spec.get("unschedulable", False)),
        resource_version=meta.get("resourceVersion", ""),
    )


MIRROR_ANNOTATION = "kubernetes.io/config.mirror"


def pod_ref_from_dict(obj: Mapping[str, Any]) -> PodRef:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    owner = next((o for o in meta.get("ownerReferences") or () if (o or {}).get("controller")), None) or {}
    return PodRef(
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        node=spec.get("nodeName") or "",
        labels=_frozen(meta.get("labels")),
        phase=(obj.get("status") or {}).get("phase") or "",
        requests=_pod_requests(spec),
        uid=meta.get("uid") or "",
        controller_kind=str(owner.get("kind") or ""),
        controller_name=str(owner.get("name") or ""),
        mirror=MIRROR_ANNOTATION in (meta.get("annotations") or {}),
        empty_dir=tuple(str(v.get("name", "")) for v in spec.get("volumes") or ()
                        if isinstance(v, Mapping) and "emptyDir" in v),
        deleting=bool(meta.get("deletionTimestamp")),
    )


def eviction_version_from_discovery(core_v1: Mapping[str, Any]) -> str | None:
    """The Eviction version in a ``/api/v1`` discovery document: the ``pods/eviction`` subresource
    names its group and version (``policy``/``v1`` from 1.22, ``v1beta1`` before; 1.21 already serves
    ``policy/v1`` for PodDisruptionBudgets but not for Eviction, so the group alone does not say)."""
    for r in core_v1.get("resources") or ():
        if isinstance(r, Mapping) and r.get("name") == "pods/eviction":
            group, version = r.get("group") or "policy", r.get("version")
            return f"{group}/{version}" if version else "policy/v1beta1"
    return None


def _pod_requests(spec: Mapping[str, Any]) -> Mapping[str, str]:
    """What the pod asks for, resource -> quantity (``engine.resources.pod_spec_requests``: the
    scheduler's effective request), as plain decimal strings."""
    return MappingProxyType({k: format_quantity(v) for k, v in pod_spec_requests(spec).items()})


def lease_record_from_dict(obj: Mapping[str, Any]) -> LeaseRecord:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    return LeaseRecord(
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        holder=spec.get("holderIdentity") or "",
        duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
        acquire_time=parse_time(spec.get("acquireTime")),
        renew_time=parse_time(spec.get("renewTime")),
        resource_version=meta.get("resourceVersion", ""),
        transitions=int(spec.get("leaseTransitions") or 0),
    )


def token_review_from_dict(obj: Mapping[str, Any]) -> TokenReviewResult:
    """A TokenReview's answer (JSON) -> ``TokenReviewResult``."""
    status = obj.get("status") or {}
    user = status.get("user") or {}
    extra = {str(k): tuple(str(x) for x in (v or ())) for k, v in (user.get("extra") or {}).items()}
    return TokenReviewResult(authenticated=bool(status.get("authenticated")),
                             username=str(user.get("username") or ""), uid=str(user.get("uid") or ""),
                             groups=tuple(str(g) for g in user.get("groups") or ()),
                             extra=MappingProxyType(extra), error=str(status.get("error") or ""),
                             audiences=tuple(str(a) for a in status.get("audiences") or ()))


def _status_message(body: str | bytes | None) -> str:
    """The ``message`` of a Kubernetes Status body, else the body itself (shortened)."""
    if not body:
        return ""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        status = json.loads(text)
    except ValueError:
        return text.strip()[:300]
    if isinstance(status, dict) and status.get("message"):
        return str(status["message"])
    return text.strip()[:300]


# --------------------------------------------------------------------------- the connector


class KubeConnector:
    """``KubeAPI`` over the official client. One instance per process is enough (thread-safe)."""

    def __init__(self, kubeconfig: str | None = None, context: str | None = None,
                 in_cluster: bool = False, *, connect_timeout: float = 5.0,
                 read_timeout: float = 30.0, clock: Callable[[], float] = time.time) -> None:
        """``clock`` (epoch seconds) stamps Lease times; tests inject one."""
        try:
            import urllib3
            from kubernetes import client, config
            from kubernetes.config.config_exception import ConfigException
        except ImportError as e:  # pragma: no cover - a dependency of the package
            raise KubeError(f"the kubernetes client is not installed: {e}") from e
        self._client = client
        self._urllib3 = urllib3
        self._timeout = (connect_timeout, read_timeout)
        self._clock = clock
        self._connect_timeout = connect_timeout
        cfg = client.Configuration()
        try:
            if in_cluster:
                config.load_incluster_config(client_configuration=cfg)
            else:
                config.load_kube_config(config_file=kubeconfig, context=context,
                                        client_configuration=cfg)
        except (ConfigException, OSError, ValueError, TypeError) as e:
            where = "in-cluster configuration" if in_cluster else (
                f"kubeconfig {kubeconfig}" if kubeconfig else "the default kubeconfig")
            ctx = f" (context {context})" if context else ""
            raise KubeError(f"cannot load {where}{ctx}: {e}") from e
        # Fail fast: urllib3 would otherwise retry a refused connection three times.
        cfg.retries = False
        if not cfg.verify_ssl:
            # The kubeconfig asked for insecure-skip-tls-verify; do not warn on every request.
            warnings.filterwarnings("ignore", category=urllib3.exceptions.InsecureRequestWarning)
        self.host: str = cfg.host
        self._api = client.ApiClient(cfg)
        self._eviction_version: str | None = None  # discovered on first eviction

    # ------------------------------------------------------------------ plumbing

    def _wrap(self, e: BaseException, what: str) -> KubeError:
        """Translate a client/transport exception into our error types."""
        if isinstance(e, KubeError):
            return e
        if isinstance(e, self._client.ApiException):
            status = int(e.status or 0)
            msg = _status_message(e.body) or (e.reason or "")
            text = f"{what}: {msg}" if msg else f"{what}: HTTP {status}"
            if status == 404:
                return NotFound(text, status=404)
            if status == 409:
                return Conflict(text, status=409)
            if status == 403:
                return Forbidden(f"{text} (forbidden: grant this permission to the identity in use, "
                                 "see deploy/kubernetes/rbac.yaml)", status=403)
            if status == 0:  # the client's own wrapper for TLS/protocol failures
                return KubeError(f"{what}: cannot talk to the API server at {self.host}: {e.reason}",
                                 retryable=True)
            return KubeError(text, status=status, retryable=status == 429 or status >= 500)
        if isinstance(e, self._urllib3.exceptions.HTTPError | OSError):
            return KubeError(f"{what}: API server {self.host} unreachable: {_short(e)}", retryable=True)
        return KubeError(f"{what}: {e}")

    def _raw(self, method: str, path: str, what: str, *, query: Sequence[tuple[str, Any]] = (),
             body: Any = None, content_type: str = "application/json",
             timeout: tuple[float, float] | None = None, stream: bool = False) -> Any:
        """One REST call with an exact JSON body; returns the decoded JSON body.

        ``stream=True`` returns the open urllib3 response instead (for watches).
        """
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        params = [(k, v) for k, v in query if v is not None]
        try:
            req = self._api.param_serialize(method=method, resource_path=path,
                                            query_params=params or None, header_params=headers,
                                            body=body, auth_settings=["BearerToken"])
            resp = self._api.call_api(*req, _request_timeout=timeout or self._timeout)
            if stream and 200 <= resp.status <= 299:
                return resp.response
            data = resp.read()
            if not 200 <= resp.status <= 299:
                raise self._client.ApiException.from_response(http_resp=resp, body=None, data=None)
        except Exception as e:
            raise self._wrap(e, what) from e
        return json.loads(data) if data else {}

    # ------------------------------------------------------------------ nodes

    def read_node(self, name: str) -> NodeFacts | None:
        try:
            obj = self._raw("GET", f"/api/v1/nodes/{_q(name)}", f"read node {name}")
        except NotFound:
            return None
        return node_facts_from_dict(obj)

    def list_nodes(self, label_selector: str | None = None) -> list[NodeFacts]:
        return [node_facts_from_dict(i) for i in self._list_pages("/api/v1/nodes", "list nodes", label_selector)]

    def patch_node(self, name: str, patch: Any, *, patch_type: PatchType = "merge",
                   dry_run: bool = False) -> NodeFacts:
        if patch_type not in _PATCH_CONTENT_TYPES:
            raise KubeError(f"unknown patch type {patch_type!r} (merge, strategic or json)")
        if patch_type == "json" and not isinstance(patch, list):
            # The client would silently send a non-list as a strategic merge patch.
            raise KubeError("a json patch is a list of operations")
        obj = self._raw("PATCH", f"/api/v1/nodes/{_q(name)}", f"patch node {name}", body=patch,
                        query=[("dryRun", "All" if dry_run else None)],
                        content_type=_PATCH_CONTENT_TYPES[patch_type])
        return node_facts_from_dict(obj)

    def _list_node_with_rv(self, name: str) -> tuple[NodeFacts | None, str]:
        """The node (or None) and the list's resourceVersion: where a watch starts."""
        obj = self._raw("GET", "/api/v1/nodes", f"read node {name}",
                        query=[("fieldSelector", f"metadata.name={name}")])
        items = obj.get("items") or []
        rv = (obj.get("metadata") or {}).get("resourceVersion", "")
        return (node_facts_from_dict(items[0]) if items else None), rv

    def wait_for_node(self, name: str, predicate: Callable[[NodeFacts | None], bool],
                      timeout: float) -> tuple[bool, NodeFacts | None]:
        """Watch one node until ``predicate`` holds or ``timeout`` seconds pass.

        The watch streams in a helper thread; this thread waits on a queue with the exact
        remaining time, so the deadline is honoured to the millisecond and a change is seen
        as soon as the API server sends it. Expired watches (410 Gone) re-list and re-watch;
        server-side stream ends re-watch from the last resourceVersion.
        """
        deadline = time.monotonic() + max(0.0, timeout)
        node, rv = self._list_node_with_rv(name)
        if predicate(node):
            return True, node
        watch = _NodeWatch(self, name, rv, deadline)
        watch.start()
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    item = watch.events.get(timeout=remaining)
                except queue.Empty:
                    break
                if isinstance(item, BaseException):
                    raise item
                node = item.node
                if predicate(node):
                    return True, node
        finally:
            watch.stop()
        if watch.failing is not None:
            raise KubeError(f"watching node {name}: {watch.failing}", retryable=True)
        return False, node

    # ------------------------------------------------------------------ pods

    def list_pods(self, *, node: str | None = None, label_selector: str | None = None,
                  namespace: str | None = None) -> list[PodRef]:
        field_selector = f"spec.nodeName={node}" if node else None
        path = f"/api/v1/namespaces/{_q(namespace)}/pods" if namespace else "/api/v1/pods"
        obj = self._raw("GET", path, "list pods" + (f" in {namespace}" if namespace else ""),
                        query=[("labelSelector", label_selector), ("fieldSelector", field_selector)])
        return [pod_ref_from_dict(i) for i in obj.get("items") or ()]

    def eviction_version(self) -> str:
        """Discovery of ``pods/eviction`` under ``/api/v1`` (once per connector)."""
        if self._eviction_version is None:
            doc = self._raw("GET", "/api/v1", "discover the Eviction API version")
            version = eviction_version_from_discovery(doc)
            if version is None:
                raise KubeError("the API server serves no pods/eviction subresource")
            self._eviction_version = version
        return self._eviction_version

    def evict_pod(self, pod: PodRef, *, dry_run: bool = False, grace_seconds: int | None = None) -> None:
        """Evict through the Eviction subresource, in the version discovery names (honours
        PodDisruptionBudgets: their refusal is HTTP 429, raised as a retryable ``KubeError``)."""
        what = f"evict pod {pod.namespace}/{pod.name}"
        path = f"/api/v1/namespaces/{_q(pod.namespace)}/pods/{_q(pod.name)}/eviction"
        body: dict[str, Any] = {"apiVersion": self.eviction_version(), "kind": "Eviction",
                                "metadata": {"name": pod.name, "namespace": pod.namespace}}
        options: dict[str, Any] = {}
        if dry_run:
            options["dryRun"] = ["All"]
        if grace_seconds is not None:
            options["gracePeriodSeconds"] = grace_seconds
        if pod.uid:
            options["preconditions"] = {"uid": pod.uid}  # not a namesake created since we listed
        if options:
            body["deleteOptions"] = options
        try:
            self._raw("POST", path, what, body=body, query=[("dryRun", "All")] if dry_run else ())
        except NotFound:
            return  # the pod is already gone: nothing to evict
        except Forbidden as e:
            # NamespaceLifecycle refuses every create, evictions included, in a namespace being
            # deleted (cause NamespaceTerminating): kubectl drain waits or retries, never fails at once.
            if "being terminated" in str(e):
                raise NamespaceTerminating(f"{what}: its namespace {pod.namespace} is being deleted", status=403,
                                           retryable=True) from e
            raise
        except KubeError as e:
            if e.status == 429:
                raise KubeError(f"{what}: refused by a disruption budget: {e}", status=429,
                                retryable=True) from e
            if e.status == 409 and pod.uid and "UID" in str(e):
                return  # the pod we listed is gone; a namesake took its place
            raise

    def wait_for_pods_gone(self, pods: Sequence[PodRef], timeout: float) -> list[PodRef]:
        """List, then watch the pods of their nodes, until none of ``pods`` (by uid when known)
        is left or ``timeout`` passes."""
        deadline = time.monotonic() + max(0.0, timeout)
        waiting = {p.key: p for p in pods}
        nodes = sorted({p.node for p in pods})

        def still(obj: Mapping[str, Any]) -> str | None:
            ref = pod_ref_from_dict(obj)
            mine = waiting.get(ref.key)
            return ref.key if mine is not None and (not mine.uid or mine.uid == ref.uid) else None

        while waiting:
            present: set[str] = set()
            rvs: dict[str, str] = {}
            for node in nodes:
                obj = self._raw("GET", "/api/v1/pods", f"list pods on {node}",
                                query=[("fieldSelector", f"spec.nodeName={node}" if node else None)])
                rvs[node] = (obj.get("metadata") or {}).get("resourceVersion", "")
                present.update(k for k in (still(i) for i in obj.get("items") or ()) if k)
            for key in [k for k in waiting if k not in present]:
                del waiting[key]
            remaining = deadline - time.monotonic()
            if not waiting or remaining <= 0:
                break
            node = waiting[next(iter(waiting))].node
            query = [("fieldSelector", f"spec.nodeName={node}" if node else None), ("watch", "true"),
                     ("resourceVersion", rvs.get(node) or None),
                     ("timeoutSeconds", max(1, math.ceil(remaining)))]
            resp = self._raw("GET", "/api/v1/pods", f"watch pods on {node}", query=query,
                             timeout=(self._connect_timeout, remaining + 5.0), stream=True)
            try:
                for line in _lines(resp):
                    if not line:
                        continue
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        break  # expired resourceVersion: list again
                    gone = still(event.get("object") or {}) if event.get("type") == "DELETED" else None
                    if gone is not None:
                        del waiting[gone]
                        if not waiting or not any(p.node == node for p in waiting.values()):
                            break
                    if time.monotonic() >= deadline:
                        break
            except Exception as e:
                raise self._wrap(e, f"watch pods on {node}") from e
            finally:
                _shutdown(resp)
                with contextlib.suppress(Exception):
                    resp.release_conn()
        return list(waiting.values())

    def delete_pod(self, pod: PodRef, *, dry_run: bool = False, grace_seconds: int | None = None) -> None:
        body: dict[str, Any] = {}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        if dry_run:
            body["dryRun"] = ["All"]
        try:
            self._raw("DELETE", f"/api/v1/namespaces/{_q(pod.namespace)}/pods/{_q(pod.name)}",
                      f"delete pod {pod.namespace}/{pod.name}", body=body or None,
                      query=[("dryRun", "All" if dry_run else None),
                             ("gracePeriodSeconds", grace_seconds)])
        except NotFound:
            return  # already gone

    # ------------------------------------------------------------------ any kind

    def list_objects(self, api_version: str, kind_plural: str, *, namespace: str | None = None,
                     label_selector: str | None = None, cached: bool = False,
                     not_older_than: str | None = None) -> list[Mapping[str, Any]]:
        """Core kinds (``v1``) under ``/api/v1``, group kinds (custom resources included) under
        ``/apis/<group>/<version>``; items as read-only plain mappings, read in pages of ``LIST_PAGE``
        (``limit``/``continue``; an expired continue token is a ``KubeError``, retryable). ``cached``:
        answered from the API server's watch cache (no etcd read of every object to apply the selector):
        ``resourceVersion=0``, which may lag the latest write by a moment, or ``not_older_than`` (the
        cache waits until it holds that version: the caller reads its own writes)."""
        what = f"list {kind_plural}.{api_version}" + (f" in {namespace}" if namespace else "")
        prefix = f"/api/{_q(api_version)}" if "/" not in api_version else (
            "/apis/" + "/".join(_q(p) for p in api_version.split("/", 1)))
        path = (f"{prefix}/namespaces/{_q(namespace)}/{_q(kind_plural)}" if namespace
                else f"{prefix}/{_q(kind_plural)}")
        version = (not_older_than or "0") if cached else None
        return [MappingProxyType(i) for i in self._list_pages(path, what, label_selector, version=version)]

    def list_objects_versioned(self, api_version: str, kind_plural: str, namespace: str
                               ) -> tuple[list[dict[str, Any]], str]:
        """Every object of the kind in ``namespace``, read from etcd in pages (one consistent
        snapshot: every page is of the first page's version), and that version: where a watch of the
        same objects starts (``watch_objects``)."""
        return self._read_pages(self._objects_path(api_version, kind_plural, namespace),
                                f"list {kind_plural}.{api_version} in {namespace}", None)

    def watch_objects(self, api_version: str, kind_plural: str, namespace: str, resource_version: str, *,
                      on_open: Callable[[Any], None] = lambda resp: None,
                      timeout_seconds: int = 300) -> Iterator[dict[str, Any]]:
        """The watch events (``{"type", "object"}``: ADDED, MODIFIED, DELETED, BOOKMARK, ERROR) of the
        kind in ``namespace`` after ``resource_version``, as the API server sends them, until it ends
        the watch (``timeout_seconds``). ``on_open`` gets the open response: shutting it down
        (``close_watch``) ends the iteration at once from another thread."""
        query = [("watch", "true"), ("allowWatchBookmarks", "true"), ("resourceVersion", resource_version),
                 ("timeoutSeconds", timeout_seconds)]
        resp = self._raw("GET", self._objects_path(api_version, kind_plural, namespace),
                         f"watch {kind_plural}.{api_version} in {namespace}", query=query,
                         timeout=(self._connect_timeout, timeout_seconds + 30.0), stream=True)
        on_open(resp)
        try:
            for line in _lines(resp):
                if line:
                    yield json.loads(line)
        except Exception as e:
            raise self._wrap(e, f"watch {kind_plural}.{api_version} in {namespace}") from e
        finally:
            resp.release_conn()

    @staticmethod
    def close_watch(resp: Any) -> None:
        """End a ``watch_objects`` iteration blocked on its socket (from another thread)."""
        _shutdown(resp)

    def _list_pages(self, path: str, what: str, label_selector: str | None, *,
                    version: str | None = None) -> list[dict[str, Any]]:
        """Every item of a list, read in pages of ``LIST_PAGE`` (limit/continue), so the API server
        never builds one huge answer (10,000 RemediationRuns, thousands of nodes)."""
        return self._read_pages(path, what, label_selector, version=version)[0]

    def _read_pages(self, path: str, what: str, label_selector: str | None, *,
                    version: str | None = None) -> tuple[list[dict[str, Any]], str]:
        """``_list_pages``' items and the list's resourceVersion (the first page's: every page of a
        continued list is of that snapshot)."""
        items: list[dict[str, Any]] = []
        token: str | None = None
        listed = ""
        while True:
            # From the watch cache (``version``): one answer, no pages (before 1.27 the cache cannot
            # page, and a limit with a version other than "0" would send the read to etcd).
            obj = self._raw("GET", path, what, query=[("labelSelector", label_selector),
                                                      ("limit", None if version else LIST_PAGE),
                                                      ("continue", token), ("resourceVersion", version)])
            items.extend(obj.get("items") or ())
            listed = listed or str((obj.get("metadata") or {}).get("resourceVersion") or "")
            token = (obj.get("metadata") or {}).get("continue") or None
            if token is None:
                return items, listed

    @staticmethod
    def _objects_path(api_version: str, kind_plural: str, namespace: str, name: str | None = None,
                      subresource: str | None = None) -> str:
        prefix = f"/api/{_q(api_version)}" if "/" not in api_version else (
            "/apis/" + "/".join(_q(p) for p in api_version.split("/", 1)))
        # namespace "": a cluster-scoped kind (CertificateSigningRequests: engine.store_approvals)
        path = f"{prefix}/namespaces/{_q(namespace)}/{_q(kind_plural)}" if namespace else f"{prefix}/{_q(kind_plural)}"
        if name:
            path += f"/{_q(name)}"
        if subresource:
            path += f"/{_q(subresource)}"
        return path

    def read_object(self, api_version: str, kind_plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return dict(self._raw("GET", self._objects_path(api_version, kind_plural, namespace, name),
                                  f"read {kind_plural}.{api_version} {namespace}/{name}"))
        except NotFound:
            return None

    def create_object(self, api_version: str, kind_plural: str, namespace: str,
                      body: Mapping[str, Any]) -> dict[str, Any]:
        name = (body.get("metadata") or {}).get("name", "")
        return dict(self._raw("POST", self._objects_path(api_version, kind_plural, namespace),
                              f"create {kind_plural}.{api_version} {namespace}/{name}", body=dict(body)))

    def replace_object(self, api_version: str, kind_plural: str, namespace: str, body: Mapping[str, Any], *,
                       subresource: str | None = None) -> dict[str, Any]:
        """PUT with ``body``'s resourceVersion: a stale one gets ``Conflict`` (409), never a lost update."""
        name = (body.get("metadata") or {}).get("name", "")
        what = f"update {kind_plural}{'/' + subresource if subresource else ''}.{api_version} {namespace}/{name}"
        return dict(self._raw("PUT", self._objects_path(api_version, kind_plural, namespace, name, subresource),
                              what, body=dict(body)))

    def delete_object(self, api_version: str, kind_plural: str, namespace: str, name: str, *,
                      resource_version: str | None = None) -> bool:
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if resource_version:
            body["preconditions"] = {"resourceVersion": resource_version}
        try:
            self._raw("DELETE", self._objects_path(api_version, kind_plural, namespace, name),
                      f"delete {kind_plural}.{api_version} {namespace}/{name}", body=body)
        except NotFound:
            return False
        return True

    def served_resources(self, api_version: str) -> frozenset[str] | None:
        """Discovery (``/api/v1`` or ``/apis/<group>/<version>``): the plural names served there,
        subresources left out; None on 404 (the group/version is not served)."""
        path = f"/api/{_q(api_version)}" if "/" not in api_version else (
            "/apis/" + "/".join(_q(p) for p in api_version.split("/", 1)))
        try:
            obj = self._raw("GET", path, f"discover {api_version}")
        except NotFound:
            return None
        return frozenset(str(r.get("name")) for r in obj.get("resources") or ()
                         if isinstance(r, Mapping) and "/" not in str(r.get("name", "/")))

    # ------------------------------------------------------------------ leases

    @staticmethod
    def _lease_path(namespace: str, name: str | None = None) -> str:
        base = f"/apis/coordination.k8s.io/v1/namespaces/{_q(namespace)}/leases"
        return f"{base}/{_q(name)}" if name else base

    def read_lease(self, namespace: str, name: str) -> LeaseRecord | None:
        try:
            obj = self._raw("GET", self._lease_path(namespace, name), f"read lease {namespace}/{name}")
        except NotFound:
            return None
        return lease_record_from_dict(obj)

    def create_lease(self, namespace: str, name: str, holder: str, duration_seconds: int) -> LeaseRecord:
        now = format_microtime(self._clock())
        body = {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": int(duration_seconds),
                     "acquireTime": now, "renewTime": now, "leaseTransitions": 0},
        }
        obj = self._raw("POST", self._lease_path(namespace), f"create lease {namespace}/{name}", body=body)
        return lease_record_from_dict(obj)

    def update_lease(self, lease: LeaseRecord, holder: str, duration_seconds: int,
                     *, acquire: bool) -> LeaseRecord:
        """PUT with the record's resourceVersion: a stale record gets ``Conflict`` (409)."""
        what = f"update lease {lease.namespace}/{lease.name}"
        now = self._clock()
        current = self._raw("GET", self._lease_path(lease.namespace, lease.name), what)
        transitions = int((current.get("spec") or {}).get("leaseTransitions") or 0)
        if acquire and holder != lease.holder:
            transitions += 1
        body = {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": lease.name, "namespace": lease.namespace,
                         "resourceVersion": lease.resource_version},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": int(duration_seconds),
                     "acquireTime": format_microtime(now if acquire or not lease.acquire_time
                                                     else lease.acquire_time),
                     "renewTime": format_microtime(now), "leaseTransitions": transitions},
        }
        obj = self._raw("PUT", self._lease_path(lease.namespace, lease.name), what, body=body)
        return lease_record_from_dict(obj)

    def delete_lease(self, lease: LeaseRecord) -> None:
        """Delete only the version we hold (precondition): a stale record gets ``Conflict``."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if lease.resource_version:
            body["preconditions"] = {"resourceVersion": lease.resource_version}
        try:
            self._raw("DELETE", self._lease_path(lease.namespace, lease.name),
                      f"delete lease {lease.namespace}/{lease.name}", body=body)
        except NotFound:
            return

    # ------------------------------------------------------------------ who the caller is, what it may do

    def self_access_review(self, verb: str, group: str, resource: str, *, namespace: str = "",
                           name: str = "", subresource: str = "") -> tuple[bool, str]:
        """SelfSubjectAccessReview (authorization.k8s.io/v1, served by every supported release and
        allowed to every authenticated user): may *this connector's identity* do ``verb`` on the
        resource? (allowed, the authorizer's reason or denial)."""
        attrs = {k: v for k, v in (("verb", verb), ("group", group), ("resource", resource),
                                   ("namespace", namespace), ("name", name), ("subresource", subresource)) if v}
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": attrs}}
        obj = self._raw("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                        f"review access to {verb} {resource}.{group}", body=body)
        status = obj.get("status") or {}
        return bool(status.get("allowed")) and not status.get("denied"), str(
            status.get("reason") or status.get("evaluationError") or "")

    def authenticated_user(self) -> str:
        """The username the API server authenticates this connector's credential as.

        1. SelfSubjectReview (``authentication.k8s.io`` v1 from Kubernetes 1.28, v1beta1 1.27, v1alpha1
           1.26 when enabled): allowed to everyone, asks the server itself.
        2. Older servers (the lab's 1.20) serve none of them. A bearer token is then sent to
           TokenReview (``authentication.k8s.io/v1``), which answers for exactly that token; it needs
           ``create`` on ``tokenreviews`` (``Forbidden`` names it otherwise). A client certificate
           is authenticated by its subject's CN (the API server's x509 rule).
        Never a name read from the kubeconfig's text: a ``KubeError`` when none of these can tell."""
        for version in ("v1", "v1beta1", "v1alpha1"):
            try:
                obj = self._raw("POST", f"/apis/authentication.k8s.io/{version}/selfsubjectreviews",
                                "review the caller's own identity",
                                body={"apiVersion": f"authentication.k8s.io/{version}", "kind": "SelfSubjectReview"})
            except (NotFound, Forbidden):
                # Not served by this release: 404, or 403 where RBAC is asked before the route is
                # found (1.20 answers 403 "cannot create resource selfsubjectreviews" to a non-admin).
                continue
            user = ((obj.get("status") or {}).get("userInfo") or {}).get("username")
            if user:
                return str(user)
        cfg = self._api.configuration
        token = str((cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken") or "")
        token = token.removeprefix("Bearer ").removeprefix("bearer ").strip()
        if token:
            review: dict[str, Any] = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                                      "spec": {"token": token}}
            obj = self._raw("POST", "/apis/authentication.k8s.io/v1/tokenreviews",
                            "review the caller's own token (this server serves no SelfSubjectReview)", body=review)
            status = obj.get("status") or {}
            user = (status.get("user") or {}).get("username")
            if not status.get("authenticated") or not user:
                raise KubeError(f"the API server at {self.host} does not authenticate this kubeconfig's token: "
                                f"{status.get('error') or 'not authenticated'}")
            return str(user)
        if cfg.cert_file:
            return _certificate_user(cfg.cert_file)
        raise KubeError(f"cannot tell who this kubeconfig authenticates as at {self.host}: no bearer token, no "
                        "client certificate, and the server serves no SelfSubjectReview (Kubernetes < 1.26)")

    # ------------------------------------------------------------------ events

    def create_node_event(self, event: NodeEvent) -> None:
        """POST a core/v1 Event about the Node, in ``event.namespace`` (``default``, as kubelet does).

        core/v1 rather than events.k8s.io/v1: the latter requires ``regarding.namespace`` to equal the
        Event's namespace, and a Node has none, so such an Event would not match the
        ``involvedObject.namespace`` that ``kubectl describe node`` searches. ``involvedObject.uid`` is
        the node's name, as kubelet sets it and as ``kubectl describe node`` searches for it.
        """
        now = self._clock()
        stamp = datetime.fromtimestamp(now, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{event.node}.{int(now * 1e9):x}", "namespace": event.namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": event.node, "uid": event.node},
            "reason": event.reason, "message": event.note[:1000], "type": event.type,
            "source": {"component": event.reporting_controller},
            "reportingComponent": event.reporting_controller,
            "reportingInstance": event.reporting_instance, "action": event.action,
            "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
        }
        self._raw("POST", f"/api/v1/namespaces/{_q(event.namespace)}/events",
                  f"create event {event.reason} on node {event.node}", body=body)

    # ------------------------------------------------------------------ reviews (who is calling us)

    def review_token(self, token: str, audiences: Sequence[str] = ()) -> TokenReviewResult:
        """POST a TokenReview: who the API server says ``token`` belongs to. Never logs the token."""
        spec: dict[str, Any] = {"token": token}
        if audiences:
            spec["audiences"] = list(audiences)
        obj = self._raw("POST", "/apis/authentication.k8s.io/v1/tokenreviews", "create tokenreview",
                        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec})
        return token_review_from_dict(obj)

    def review_access(self, *, user: str, groups: Sequence[str], uid: str,
                      extra: Mapping[str, Sequence[str]], verb: str, resource: str, group: str,
                      namespace: str) -> AccessReviewResult:
        """POST a SubjectAccessReview: may ``user`` (with its groups) ``verb`` ``resource`` in ``namespace``."""
        spec: dict[str, Any] = {
            "user": user, "groups": list(groups),
            "resourceAttributes": {"namespace": namespace, "verb": verb, "group": group, "resource": resource}}
        if uid:
            spec["uid"] = uid
        if extra:
            spec["extra"] = {k: list(v) for k, v in extra.items()}
        obj = self._raw("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews",
                        f"create subjectaccessreview ({verb} {resource}.{group})",
                        body={"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec})
        status = obj.get("status") or {}
        return AccessReviewResult(allowed=bool(status.get("allowed")), denied=bool(status.get("denied")),
                                  reason=str(status.get("reason") or status.get("evaluationError") or ""))

    def close(self) -> None:
        """Release the HTTP connection pool."""
        with contextlib.suppress(Exception):  # best effort; nothing to report
            self._api.close()


# --------------------------------------------------------------------------- the watch helper


class _Seen:
    """One observation of the watched node (None: it does not exist)."""

    __slots__ = ("node",)

    def __init__(self, node: NodeFacts | None) -> None:
        self.node = node


class _NodeWatch:
    """Streams one node's watch events into ``events`` until stopped.

    Runs in a daemon thread. ``stop()`` shuts the socket down, which wakes the blocked read at
    once. Connection errors are retried (with a short backoff) until the deadline; while they
    last, ``failing`` holds the reason so the waiter can tell "API down" from "never true".
    """

    def __init__(self, conn: KubeConnector, name: str, resource_version: str, deadline: float) -> None:
        self.conn = conn
        self.name = name
        self.rv = resource_version
        self.deadline = deadline
        self.events: queue.Queue[_Seen | BaseException] = queue.Queue()
        self.failing: str | None = None
        self._stopped = threading.Event()
        self._resp: Any = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"watch-node-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            resp = self._resp
        if resp is not None:
            _shutdown(resp)
        self._thread.join(timeout=1.0)

    def _open(self) -> Any:
        remaining = max(1, math.ceil(self.deadline - time.monotonic()))
        query = [("fieldSelector", f"metadata.name={self.name}"), ("watch", "true"),
                 ("allowWatchBookmarks", "true"), ("timeoutSeconds", remaining + 1),
                 ("resourceVersion", self.rv or None)]
        return self.conn._raw("GET", "/api/v1/nodes", f"watch node {self.name}", query=query,
                              timeout=(self.conn._connect_timeout, remaining + 30.0), stream=True)

    def _relist(self) -> None:
        node, self.rv = self.conn._list_node_with_rv(self.name)
        self.events.put(_Seen(node))

    def _run(self) -> None:
        backoff = 0.1
        while not self._stopped.is_set() and time.monotonic() < self.deadline:
            try:
                resp = self._open()
                with self._lock:
                    self._resp = resp
                if self._stopped.is_set():
                    _shutdown(resp)
                    return
                self.failing = None
                backoff = 0.1
                for line in _lines(resp):
                    if self._stopped.is_set():
                        return
                    if not line:
                        continue
                    if self._handle(json.loads(line)) == "relist":
                        self._relist()
                        break
            except Exception as e:
                if self._stopped.is_set():
                    return
                err = self.conn._wrap(e, f"watch node {self.name}")
                if err.status == 410:
                    try:
                        self._relist()
                        continue
                    except Exception as e2:
                        err = self.conn._wrap(e2, f"watch node {self.name}")
                if not err.retryable:
                    self.events.put(err)
                    return
                self.failing = str(err)
                self._stopped.wait(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                with self._lock:
                    resp, self._resp = self._resp, None
                if resp is not None:
                    resp.release_conn()

    def _handle(self, event: Mapping[str, Any]) -> str:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                return "relist"  # our resourceVersion expired: read again and re-watch
            raise KubeError(f"watch node {self.name}: {obj.get('message', obj)}",
                            status=obj.get("code"), retryable=True)
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if rv:
            self.rv = rv
        if kind == "BOOKMARK":
            return ""
        self.events.put(_Seen(None if kind == "DELETED" else node_facts_from_dict(obj)))
        return ""


def _lines(resp: Any) -> Iterator[str]:
    """Newline-delimited JSON events, yielded as soon as each chunk arrives."""
    buffer = b""
    for chunk in resp.stream(amt=None, decode_content=False):
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield line.decode("utf-8", "replace")


def _shutdown(resp: Any) -> None:
    """Wake a reader blocked on this response's socket (urllib3 >= 2.3), then close it."""
    with contextlib.suppress(Exception):  # already closed, or urllib3 < 2.3
        resp.shutdown()
    with contextlib.suppress(Exception):
        resp.close()


def _certificate_user(cert_file: str) -> str:
    """The CN of a client certificate: the username the API server's x509 authenticator assigns."""
    try:
        from cryptography import x509
        from cryptography.x509.oid import NameOID

        with open(cert_file, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    except (ImportError, OSError, ValueError) as e:
        raise KubeError(f"cannot read the client certificate {cert_file}: {e}") from e
    if not names:
        raise KubeError(f"the client certificate {cert_file} has no CN: no username")
    return str(names[0].value)


def _q(segment: str) -> str:
    return quote(segment, safe="")


def _short(e: BaseException) -> str:
    reason = getattr(e, "reason", None)
    return str(reason or e).splitlines()[0][:300]
