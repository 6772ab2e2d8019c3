"""``engine.kube_run_index.RunIndex`` over a scripted watchable API (our own fake of the connector's
list-and-watch; the real API server: tests/integration/test_kube_store_real_api.py, "following"):
the answer waits for the version asked for, a 410 relists, a broken watch makes the index say
"cannot answer" (the store lists instead), kept objects carry no events or plan."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from engine.errors import Forbidden, KubeError
from engine.kube_run_index import SLIM, RunIndex, slim

_END = object()


def run(name: str, created: float, version: int, source: str = "alertmanager") -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": str(version), "creationTimestamp": created},
            "spec": {"source": source}, "status": {"phase": "Running", "events": [{"seq": 1}],
                                                    "plan": {"steps": ["x"]}, "startedAt": "t"}}


class ScriptedWatch:
    """``list_objects_versioned`` answers ``listed``; each ``watch_objects`` streams what the test
    puts in ``events`` until ``_END``, a put exception, or ``close_watch``."""

    def __init__(self, listed: list[dict[str, Any]], version: int) -> None:
        self.listed, self.version = listed, version
        self.events: queue.Queue[Any] = queue.Queue()
        self.lists = 0
        self.watched_from: list[str] = []
        self.fail_lists = 0

    def list_objects_versioned(self, api_version: str, kind_plural: str, namespace: str
                               ) -> tuple[list[dict[str, Any]], str]:
        self.lists += 1
        if self.fail_lists:
            self.fail_lists -= 1
            raise KubeError("connection refused", retryable=True)
        return [dict(o) for o in self.listed], str(self.version)

    def watch_objects(self, api_version: str, kind_plural: str, namespace: str, resource_version: str, *,
                      on_open: Callable[[Any], None] = lambda resp: None,
                      timeout_seconds: int = 300) -> Iterator[dict[str, Any]]:
        self.watched_from.append(resource_version)
        on_open(self)
        while True:
            item = self.events.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close_watch(self, resp: Any) -> None:
        self.events.put(_END)


def key(o: Mapping[str, Any]) -> tuple[float, str]:
    return float(o["metadata"]["creationTimestamp"]), o["metadata"]["name"]


@pytest.fixture
def api() -> ScriptedWatch:
    return ScriptedWatch([run("r-1", 1, 5), run("r-2", 2, 6, source="cli"), run("r-3", 3, 7)], 10)


@pytest.fixture
def index(api: ScriptedWatch) -> Iterator[RunIndex]:
    idx = RunIndex(api, "runbook.io/v1alpha1", "remediationruns", "ns", sort_key=key).start()
    yield idx
    idx.stop()


def names(objs: list[dict[str, Any]] | None) -> list[str] | None:
    return None if objs is None else [o["metadata"]["name"] for o in objs]


def every(o: Mapping[str, Any]) -> bool:
    return True


def test_the_listed_runs_answer_newest_first_filtered_and_kept_without_events_or_plan(index: RunIndex) -> None:
    got = index.newest(10, keep=lambda o: o["spec"]["source"] != "cli", at_least=10)
    assert names(got) == ["r-3", "r-1"]
    assert got is not None and got[0][SLIM] is True
    assert got[0]["status"]["events"] == [] and "plan" not in got[0]["status"]
    assert got[0]["status"]["startedAt"] == "t"
    assert names(index.newest(1, keep=every, at_least=0)) == ["r-3"]


def test_an_answer_waits_for_the_version_asked_for_and_says_none_when_it_does_not_come(
        index: RunIndex, api: ScriptedWatch) -> None:
    assert index.newest(10, keep=every, at_least=12, wait=0.2) is None  # our write (12) not seen yet

    def later() -> None:
        time.sleep(0.2)
        api.events.put({"type": "ADDED", "object": run("r-4", 4, 12)})

    threading.Thread(target=later).start()
    assert names(index.newest(10, keep=every, at_least=12, wait=5)) == ["r-4", "r-3", "r-2", "r-1"]


def test_modified_and_deleted_events_and_bookmarks_are_applied(index: RunIndex, api: ScriptedWatch) -> None:
    changed = run("r-1", 1, 11)
    changed["status"]["phase"] = "Failed"
    api.events.put({"type": "MODIFIED", "object": changed})
    api.events.put({"type": "DELETED", "object": run("r-3", 3, 12)})
    api.events.put({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "15"}}})
    got = index.newest(10, keep=every, at_least=15, wait=5)
    assert names(got) == ["r-2", "r-1"]
    assert got is not None and got[1]["status"]["phase"] == "Failed"


def test_an_expired_version_relists_and_the_watch_goes_on_from_the_new_list(
        index: RunIndex, api: ScriptedWatch) -> None:
    assert index.newest(10, keep=every, at_least=10, wait=5) is not None
    api.listed, api.version = [run("r-9", 9, 20)], 20
    api.events.put({"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}})
    assert names(index.newest(10, keep=every, at_least=20, wait=5)) == ["r-9"]
    assert api.lists == 2 and api.watched_from[-1] == "20"


def test_a_broken_watch_cannot_answer_until_it_listed_again(index: RunIndex, api: ScriptedWatch) -> None:
    assert index.newest(10, keep=every, at_least=10, wait=5) is not None
    api.fail_lists = 2  # the API server is away for two attempts
    api.events.put(KubeError("connection reset", retryable=True))
    deadline = time.monotonic() + 5
    while index.synced and time.monotonic() < deadline:
        time.sleep(0.01)
    assert index.newest(10, keep=every, at_least=0, wait=0.05) is None  # the store lists meanwhile
    assert names(index.newest(10, keep=every, at_least=10, wait=10)) == ["r-3", "r-2", "r-1"]
    assert api.lists == 4


def test_a_stopped_index_answers_none_at_once(api: ScriptedWatch) -> None:
    idx = RunIndex(api, "runbook.io/v1alpha1", "remediationruns", "ns", sort_key=key).start()
    idx.stop()
    started = time.monotonic()
    assert idx.newest(10, keep=every, at_least=99, wait=5) is None
    assert time.monotonic() - started < 1


def test_slim_keeps_only_the_events_of_the_kinds_asked_and_leaves_the_object_given_untouched() -> None:
    obj = run("r-1", 1, 5)
    obj["status"]["events"] = [{"seq": 1, "kind": "step.start"}, {"seq": 2, "kind": "breaker.reset", "scope": "node"}]
    kept = slim(obj, frozenset({"breaker.reset"}))
    assert kept["status"]["events"] == [{"seq": 2, "kind": "breaker.reset", "scope": "node"}] and kept[SLIM] is True
    assert len(obj["status"]["events"]) == 2 and "plan" in obj["status"] and "plan" not in kept["status"]


def test_one_run_is_answered_known_or_unknown_once_caught_up_and_unsure_before(
        index: RunIndex, api: ScriptedWatch) -> None:
    assert index.one("r-1", at_least=10)[0] is True
    assert index.one("r-nope", at_least=10) == (True, None)
    assert index.one("r-4", at_least=12, wait=0.1) == (False, None)
    api.events.put({"type": "ADDED", "object": run("r-4", 4, 12)})
    known, obj = index.one("r-4", at_least=12, wait=5)
    assert known and obj is not None and obj["metadata"]["name"] == "r-4"


def test_a_forbidden_watch_stops_the_index_for_good_and_lists_answer(api: ScriptedWatch) -> None:
    idx = RunIndex(api, "runbook.io/v1alpha1", "remediationruns", "ns", sort_key=key).start()
    try:
        assert idx.newest(10, keep=every, at_least=10, wait=5) is not None
        api.events.put(Forbidden("watch remediationruns: forbidden", status=403))
        deadline = time.monotonic() + 5
        while idx.synced and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)
        assert idx.newest(10, keep=every, at_least=0, wait=0.1) is None
        assert api.lists == 1  # never listed again: no retry loop against a Role without `watch`
    finally:
        idx.stop()
