"""RemediationRun labels on our fake API (the real server's selectors: tests/integration/
test_run_labels_real_api.py): the phase label follows the phase, lists ask the server by label."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.errors import KubeError
from engine.kube_store import API_VERSION, NOT_BUCKETED, PHASE_LABEL, PLURAL, TRIGGER_LABEL, KubeRunStore
from tests.fakes import FakeKube

NS = "runbook-system"


def labels(kube: FakeKube, run_id: str) -> dict[str, str]:
    obj = kube.read_object(API_VERSION, PLURAL, NS, run_id)
    assert obj is not None
    return dict(obj["metadata"].get("labels") or {})


def test_the_phase_label_follows_every_state_and_the_trigger_is_the_source() -> None:
    kube = FakeKube()
    store = KubeRunStore(kube, NS)
    run_id = store.create_run("gpu-node-recovery", {"node": "gpu-1"}, ["gpu-1"], source="remediation")
    assert labels(kube, run_id)[PHASE_LABEL] == "Pending" and labels(kube, run_id)[TRIGGER_LABEL] == "remediation"
    for state, phase in (("running", "Running"), ("waiting-approval", "WaitingApproval"), ("failed", "Failed")):
        store.set_state(run_id, state)
        assert labels(kube, run_id)[PHASE_LABEL] == phase
    store.append(run_id, "note")  # the status writes go on after the label writes (fresh versions)
    assert store.get_run(run_id).state == "failed"


def test_lists_by_state_are_label_selected_with_the_phases_a_label_can_lag_behind() -> None:
    kube = FakeKube()
    store = KubeRunStore(kube, NS)
    store.create_run("x", {}, ["gpu-1"])
    kube.calls.clear()
    store.list_runs(states=("succeeded",))
    store.prune(keep=10)
    selectors = [args[3] for name, args in kube.calls if name == "list_objects"]
    assert selectors == [f"{PHASE_LABEL} in (Interrupted,Pending,Running,Succeeded,WaitingApproval)",
                         f"!{PHASE_LABEL}",
                         f"{PHASE_LABEL} in (Blocked,Cancelled,Failed,Interrupted,Pending,Running,Succeeded,"
                         "WaitingApproval)", f"!{PHASE_LABEL}"]


def test_a_label_that_cannot_be_written_leaves_the_run_recorded() -> None:
    kube = FakeKube()
    store = KubeRunStore(kube, NS)
    run_id = store.create_run("x", {}, ["gpu-1"])
    real = kube.replace_object

    def no_main_writes(api_version: str, plural: str, namespace: str, body: dict, *,  # type: ignore[type-arg]
                       subresource: str | None = None) -> dict:  # type: ignore[type-arg]
        if subresource is None:
            raise KubeError("forbidden: update remediationruns", status=403)
        return real(api_version, plural, namespace, body, subresource=subresource)

    kube.replace_object = no_main_writes  # type: ignore[method-assign]
    store.set_state(run_id, "running")
    assert store.get_run(run_id).state == "running" and labels(kube, run_id)[PHASE_LABEL] == "Pending"


def test_the_breakers_read_of_webhook_runs_is_selected_by_trigger_label() -> None:
    kube = FakeKube()
    store = KubeRunStore(kube, NS)
    store.create_run("x", {}, ["gpu-1"], source="alertmanager")
    store.create_run("x", {}, ["gpu-2"], source="cli")
    kube.calls.clear()
    assert [r.source for r in store.list_runs(sources=("pagerduty", "alertmanager"))] == ["alertmanager"]
    newest = [args[3] for name, args in kube.calls if name == "list_objects"]
    # the newest runs: those without created labels, then created-time buckets (this fake ignores
    # selectors, so the walk goes to its horizon), every list selected by trigger
    assert newest[0] == f"{TRIGGER_LABEL} in (alertmanager,pagerduty),{NOT_BUCKETED}"
    assert all(s.startswith(f"{TRIGGER_LABEL} in (alertmanager,pagerduty)") for s in newest)
    assert any("runbook.io/created-second in (" in s for s in newest)
    assert any("runbook.io/created-day in (" in s for s in newest)
    kube.calls.clear()
    store.list_runs(states=("failed",), sources=("alertmanager",))
    selectors = [args[3] for name, args in kube.calls if name == "list_objects"]
    assert selectors == [f"{PHASE_LABEL} in (Failed,Interrupted,Pending,Running,WaitingApproval),"
                         f"{TRIGGER_LABEL} in (alertmanager)", f"!{PHASE_LABEL}"]


def test_a_source_no_label_can_name_reads_by_phase_only_and_the_spec_decides() -> None:
    kube = FakeKube()
    store = KubeRunStore(kube, NS)
    store.create_run("x", {}, ["gpu-1"], source="a source with spaces")
    kube.calls.clear()
    assert len(store.list_runs(sources=("a source with spaces",))) == 1
    assert [args[3] for name, args in kube.calls if name == "list_objects"] == [None]


def test_a_new_run_and_its_first_events_cost_two_writes() -> None:
    kube = FakeKube()
    store = KubeRunStore(kube, NS)
    kube.calls.clear()
    run_id = store.create_run("x", {}, ["gpu-1"], source="alertmanager",
                              events=[("run.requested", {"by": "alertmanager"}), ("run.note", {"mode": "auto"}),
                                      ("run.seal", {"mac": "m"})])
    writes = [name for name, _ in kube.calls if name in ("create_object", "replace_object")]
    assert writes == ["create_object", "replace_object"]
    assert [(e.seq, e.kind) for e in store.events(run_id)] == [(1, "run.requested"), (2, "run.note"), (3, "run.seal")]


class LaggingCache(FakeKube):
    """A watch cache that still lists what was deleted (``ghosts``) and records the version each
    cached list asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.ghosts: list[dict[str, Any]] = []
        self.asked: list[str | None] = []

    def list_objects(self, api_version: str, kind_plural: str, *, namespace: str | None = None,
                     label_selector: str | None = None, cached: bool = False,
                     not_older_than: str | None = None) -> list[Mapping[str, Any]]:
        now = super().list_objects(api_version, kind_plural, namespace=namespace, label_selector=label_selector)
        if cached:
            self.asked.append(not_older_than)
            return [*now, *self.ghosts]
        return now


def test_the_newest_runs_from_a_watch_cache_include_the_stores_own_writes_and_not_its_deletes() -> None:
    kube = LaggingCache()
    store = KubeRunStore(kube, NS)
    first = store.create_run("x", {}, ["gpu-1"])
    second = store.create_run("x", {}, ["gpu-2"])
    store.set_state(first, "succeeded", exit_code=0)
    last = kube.read_object(API_VERSION, PLURAL, NS, first)
    assert last is not None
    assert {r.id for r in store.list_runs(limit=5)} == {first, second}
    assert set(kube.asked) == {last["metadata"]["resourceVersion"]}  # the cache holds our last write
    assert store.prune(keep=0) == [first]
    kube.ghosts.append(last)  # the cache has not seen the delete yet
    assert {r.id for r in store.list_runs(limit=5)} == {second}
