"""The simulator's and the lab manager's access to the Kubernetes API: raw dicts, watches, small helpers.

``Kube`` wraps one official-client ``ApiClient`` and speaks plain dicts (no model objects): get,
list, create, patch (merge), delete, status patches, for core objects and custom resources alike.
``Informer`` keeps a watched collection in memory (list, then watch; relist on errors) and wakes the
simulator's loop on every event. Timestamps are formatted here (the client's ``isoformat`` drops the
fraction of MicroTime values, which the API server rejects).

Only the lab imports ``kubernetes`` (an import-linter contract allows ``engine.lab.**``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("runbook.lab")
Obj = dict[str, Any]


def rfc3339(ts: float | None = None) -> str:
    """``2025-07-10T15:39:51Z`` (metav1.Time)."""
    return datetime.fromtimestamp(time.time() if ts is None else ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_time(ts: float | None = None) -> str:
    """``2025-07-10T15:39:51.123456Z`` (metav1.MicroTime needs exactly six fractional digits)."""
    return datetime.fromtimestamp(time.time() if ts is None else ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str | None) -> float:
    if not text:
        return 0.0
    text = text.replace("Z", "+00:00")
    return datetime.fromisoformat(text).timestamp()


@dataclass(frozen=True)
class Resource:
    """Where a kind lives in the API: ``group``/``version``/``plural``; namespaced or not."""

    group: str
    version: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
        base = f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
        if sub:
            base += f"/{sub}"
        return base


NODES = Resource("", "v1", "nodes", namespaced=False)
PODS = Resource("", "v1", "pods")
NAMESPACES = Resource("", "v1", "namespaces", namespaced=False)
LEASES = Resource("coordination.k8s.io", "v1", "leases")
DAEMONSETS = Resource("apps", "v1", "daemonsets")
REPLICASETS = Resource("apps", "v1", "replicasets")
CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", namespaced=False)
VMS = Resource("kubevirt.io", "v1", "virtualmachines")
VMIS = Resource("kubevirt.io", "v1", "virtualmachineinstances")
KUBEVIRTS = Resource("kubevirt.io", "v1", "kubevirts")
CLUSTER_POLICIES = Resource("nvidia.com", "v1", "clusterpolicies", namespaced=False)


class Kube:
    """A small raw-JSON client over one ApiClient (its own configuration; nothing global)."""

    def __init__(self, kubeconfig: Path | str) -> None:
        self.kubeconfig = str(kubeconfig)
        self.api = config.new_client_from_config(config_file=self.kubeconfig)
        self.api.configuration.retries = 0

    def close(self) -> None:
        self.api.close()

    def call(self, method: str, path: str, body: Any = None, query: Iterable[tuple[str, Any]] = (),
             content_type: str = "application/json", timeout: float = 15.0) -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        response = self.api.call_api(*self.api.param_serialize(
            method=method, resource_path=path, query_params=list(query), header_params=headers,
            body=body, auth_settings=["BearerToken"]), _request_timeout=timeout)
        response.read()
        if not 200 <= response.status <= 299:
            raise ApiException(http_resp=response)
        return json.loads(response.data) if response.data else None

    # -- verbs ------------------------------------------------------------------------------------
    def get(self, res: Resource, name: str, namespace: str | None = None) -> Obj | None:
        try:
            return self.call("GET", res.path(namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list(self, res: Resource, namespace: str | None = None, selector: str | None = None,
             field_selector: str | None = None) -> tuple[list[Obj], str]:
        query = [("labelSelector", selector)] if selector else []
        if field_selector:
            query.append(("fieldSelector", field_selector))
        data = self.call("GET", res.path(namespace), query=query, timeout=60)
        return data.get("items") or [], data["metadata"].get("resourceVersion", "")

    def create(self, res: Resource, body: Obj, namespace: str | None = None,
               exist_ok: bool = False) -> Obj | None:
        try:
            return self.call("POST", res.path(namespace), body)
        except ApiException as e:
            if exist_ok and e.status == 409:
                return None
            raise

    def patch(self, res: Resource, name: str, body: Obj, namespace: str | None = None,
              sub: str | None = None, missing_ok: bool = True) -> Obj | None:
        try:
            return self.call("PATCH", res.path(namespace, name, sub), body,
                             content_type="application/merge-patch+json")
        except ApiException as e:
            if missing_ok and e.status == 404:
                return None
            raise

    def delete(self, res: Resource, name: str, namespace: str | None = None,
               grace: int | None = None) -> bool:
        query = [("gracePeriodSeconds", grace)] if grace is not None else []
        body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        try:
            self.call("DELETE", res.path(namespace, name), body, query=query)
            return True
        except ApiException as e:
            if e.status in (404, 409):
                return False
            raise

    def delete_collection(self, res: Resource, namespace: str | None = None, selector: str | None = None,
                          grace: int | None = None) -> None:
        query: list[tuple[str, Any]] = [("labelSelector", selector)] if selector else []
        if grace is not None:
            query.append(("gracePeriodSeconds", grace))
        try:
            self.call("DELETE", res.path(namespace), query=query, timeout=60)
        except ApiException as e:
            if e.status != 404:
                raise

    def watch_stream(self, res: Resource, resource_version: str, timeout_seconds: int) -> Iterable[Obj]:
        """Watch events (``{"type", "object"}`` dicts) from ``resource_version`` for up to ``timeout_seconds``."""
        func: Callable[..., Any]
        args: tuple[Any, ...] = ()
        if res.group:
            func = client.CustomObjectsApi(self.api).list_cluster_custom_object
            args = (res.group, res.version, res.plural)
        else:
            core = client.CoreV1Api(self.api)
            func = core.list_node if res.plural == "nodes" else core.list_pod_for_all_namespaces
        w = watch.Watch()
        return w.stream(func, *args, resource_version=resource_version, timeout_seconds=timeout_seconds,
                        allow_watch_bookmarks=True, deserialize=False,
                        _request_timeout=(5, timeout_seconds + 10))


class Informer:
    """An in-memory copy of one watched collection, keyed ``namespace/name``; ``wake`` is set on change."""

    def __init__(self, kube: Kube, res: Resource, wake: threading.Event) -> None:
        self.kube, self.res, self.wake = kube, res, wake
        self.items: dict[str, Obj] = {}
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"informer-{res.plural}", daemon=True)

    @staticmethod
    def key(obj: Obj) -> str:
        meta = obj["metadata"]
        return f"{meta.get('namespace', '')}/{meta['name']}"

    def start(self) -> Informer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def snapshot(self) -> list[Obj]:
        with self._lock:
            return list(self.items.values())

    def get(self, name: str, namespace: str = "") -> Obj | None:
        with self._lock:
            return self.items.get(f"{namespace}/{name}")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                items, rv = self.kube.list(self.res)
                with self._lock:
                    self.items = {self.key(o): o for o in items}
                self.synced.set()
                self.wake.set()
                for event in self.kube.watch_stream(self.res, rv, timeout_seconds=120):
                    if self._stop.is_set():
                        return
                    self._apply(event)
            except Exception as e:  # the API server restarts in fault tests: relist after a pause
                if not self._stop.is_set():
                    log.debug("informer %s: %s; relisting", self.res.plural, e)
                    time.sleep(0.5)

    def _apply(self, event: Obj) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "BOOKMARK" or "metadata" not in obj:
            return
        with self._lock:
            if kind == "DELETED":
                self.items.pop(self.key(obj), None)
            else:
                self.items[self.key(obj)] = obj
        self.wake.set()


def api_error_status(error: BaseException) -> int | None:
    return error.status if isinstance(error, ApiException) else None
