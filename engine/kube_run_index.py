"""The store namespace's RemediationRuns kept in memory from the API server's watch: what
``runbook serve`` lists many times a second in a burst (the shared breaker's read of the automatic
runs, ``GET /runs``) without asking the API server each time.

Why a watch and not lists: in a burst of 200 pages, every automatic run let through re-reads the
store (the breaker's bound between replicas rests on the store as it is now). As lists, each read
was a dozen bucket lists waiting for the API server's watch cache to hold this replica's last write,
three quarters of a delivery's time (docs/performance.md, P10 burst). The index is that same watch
cache, one step closer: a list (one consistent snapshot, in pages) and then the watch from its
version, in this process.

Freshness, as the lists had it: an answer waits until the index has seen at least the version of
this store's own last write (``KubeRunStore._written_version``; every RemediationRun of the
namespace is watched, so every write of ours arrives); what other replicas wrote a moment ago may
be missing, exactly as from the API server's watch cache. When the index cannot answer (not yet
synced, the watch broken, its version behind for longer than ``wait``), the caller lists as before:
the index only ever saves reads, it never decides alone.

What is kept per run: the object without ``status.plan`` and without its events but those of the
kinds asked for (``event_kinds``: the breaker's resets), marked ``SLIM``, so 10,000 runs cost a
few MB; records built from it carry no plan (``get_run`` reads it).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from engine.errors import Forbidden, KubeError

log = logging.getLogger(__name__)

SLIM = "runbook.io/slim"  # a key of a kept object: its events and plan were left out
RELIST_BACKOFF_MAX = 5.0  # seconds between attempts while the API server does not answer


class WatchableObjects(Protocol):
    """What the index needs of the Kubernetes connector (``engine.connectors.kube.KubeConnector``)."""

    def list_objects_versioned(self, api_version: str, kind_plural: str, namespace: str
                               ) -> tuple[list[dict[str, Any]], str]: ...

    def watch_objects(self, api_version: str, kind_plural: str, namespace: str, resource_version: str, *,
                      on_open: Callable[[Any], None] = ..., timeout_seconds: int = ...
                      ) -> Iterator[dict[str, Any]]: ...

    @staticmethod
    def close_watch(resp: Any) -> None: ...


def slim(obj: Mapping[str, Any], event_kinds: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The run as the index keeps it: no plan, only the events of ``event_kinds``, marked ``SLIM``."""
    full = obj.get("status") or {}
    status = {k: v for k, v in full.items() if k not in ("events", "plan")}
    status["events"] = [e for e in full.get("events") or () if isinstance(e, Mapping) and e.get("kind") in event_kinds]
    return {**obj, "status": status, SLIM: True}


class RunIndex:
    """Every RemediationRun of one namespace (``SLIM``), kept by a list and then a watch in a daemon
    thread; relisted when the watch's version expired (410) or the API server went away."""

    def __init__(self, api: WatchableObjects, api_version: str, plural: str, namespace: str, *,
                 sort_key: Callable[[Mapping[str, Any]], Any], event_kinds: frozenset[str] = frozenset()) -> None:
        self.api = api
        self.event_kinds = event_kinds  # the events kept with each run
        self._what = (api_version, plural, namespace)
        self._sort_key = sort_key
        self._objects: dict[str, tuple[Any, dict[str, Any]]] = {}  # name -> (sort key, slim object)
        self._version = 0  # the highest resourceVersion seen (list, event or bookmark)
        self._synced = False
        self._changed = threading.Condition()
        self._stopped = threading.Event()
        self._resp: Any = None
        self._thread = threading.Thread(target=self._run, name=f"run-index-{namespace}", daemon=True)

    # -- the answer ------------------------------------------------------------------------------

    def newest(self, limit: int, *, keep: Callable[[Mapping[str, Any]], bool], at_least: int,
               wait: float = 2.0) -> list[dict[str, Any]] | None:
        """The ``limit`` newest kept objects ``keep`` accepts, newest first, once the index has seen
        version ``at_least``; None when it cannot say within ``wait`` seconds (not synced, broken,
        behind): the caller reads the API server instead."""
        with self._changed:
            if not self._caught_up(at_least, wait):
                return None
            entries = list(self._objects.values())
        chosen = heapq.nlargest(limit, (e for e in entries if keep(e[1])), key=lambda e: e[0])
        return [obj for _, obj in chosen]

    def one(self, name: str, *, at_least: int, wait: float = 2.0) -> tuple[bool, dict[str, Any] | None]:
        """(True, the kept object or None when there is no such run) once the index has seen version
        ``at_least``; (False, None) when it cannot say within ``wait`` seconds."""
        with self._changed:
            if not self._caught_up(at_least, wait):
                return False, None
            entry = self._objects.get(name)
        return True, None if entry is None else entry[1]

    def _caught_up(self, at_least: int, wait: float) -> bool:
        """Wait (holding ``_changed``) until synced at version ``at_least`` or later; False after ``wait``."""
        deadline = time.monotonic() + wait
        while not (self._synced and self._version >= at_least):
            left = deadline - time.monotonic()
            if left <= 0 or self._stopped.is_set():
                return False
            self._changed.wait(left)
        return True

    @property
    def synced(self) -> bool:
        with self._changed:
            return self._synced

    # -- the loop --------------------------------------------------------------------------------

    def start(self) -> RunIndex:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        resp = self._resp
        if resp is not None:
            self.api.close_watch(resp)
        with self._changed:
            self._changed.notify_all()
        self._thread.join(timeout=2.0)

    def _open(self, resp: Any) -> None:
        self._resp = resp
        if self._stopped.is_set():
            self.api.close_watch(resp)

    def _run(self) -> None:
        backoff = 0.2
        version = ""
        while not self._stopped.is_set():
            try:
                if not version:
                    version = self._relist()
                version = self._follow(version)
                backoff = 0.2
            except Forbidden as e:  # Why: no `watch` (an older Role): lists answer for good, said once
                log.warning("run index of %s: %s; the server lists the store instead (grant list and watch "
                            "on remediationruns: deploy/kubernetes/rbac.yaml)", self._what[2], e)
                with self._changed:
                    self._synced = False
                self._stopped.set()
                return
            except Exception as e:  # Why: the server lists instead meanwhile; the index tries again
                if self._stopped.is_set():
                    return
                with self._changed:
                    self._synced = False
                log.warning("run index of %s: %s; lists answer until it is back", self._what[2], e)
                version = ""
                self._stopped.wait(backoff)
                backoff = min(RELIST_BACKOFF_MAX, backoff * 2)

    def _relist(self) -> str:
        items, version = self.api.list_objects_versioned(*self._what)
        kept = {}
        for o in items:
            obj = slim(o, self.event_kinds)
            kept[(obj.get("metadata") or {}).get("name", "")] = (self._sort_key(obj), obj)
        with self._changed:
            self._objects = kept
            self._version = max(self._version, _version_of(version))
            self._synced = True
            self._changed.notify_all()
        return version

    def _follow(self, version: str) -> str:
        """Apply the watch's events from ``version`` until the API server ends the watch: the version
        to watch from next ("" to relist: it expired)."""
        for event in self.api.watch_objects(*self._what, version, on_open=self._open):
            if self._stopped.is_set():
                return version
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    return ""  # our version is too old: list again
                raise KubeError(f"watch: {obj.get('message', obj)}", status=obj.get("code"), retryable=True)
            meta = obj.get("metadata") or {}
            version = str(meta.get("resourceVersion") or version)
            with self._changed:
                if kind in ("ADDED", "MODIFIED"):
                    kept = slim(obj, self.event_kinds)
                    self._objects[meta.get("name", "")] = (self._sort_key(kept), kept)
                elif kind == "DELETED":
                    self._objects.pop(meta.get("name", ""), None)
                self._version = max(self._version, _version_of(version))
                self._changed.notify_all()
        return version


def _version_of(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


__all__ = ["SLIM", "RunIndex", "WatchableObjects", "slim"]
