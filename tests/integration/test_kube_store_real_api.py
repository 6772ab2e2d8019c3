"""The Kubernetes run store against the real 1.20 API server: the base's CRD, the status subresource,
resourceVersion preconditions (a real 409, re-read and retried, nothing written over), printer
columns for ``kubectl get rr``, retention deletes with preconditions.

Two engines are two ``KubeRunStore`` instances on two ``KubeConnector`` clients; a counting wrapper
of our connector (not of the kubernetes client) proves the conflicts really came from the server.

The run store's whole contract (tests/store_contract.py, the suite every store passes) runs here on
the real API server too: each test in a namespace of its own, a second client as "another process".
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from engine.connectors.kube import KubeConnector
from engine.errors import Conflict
from engine.kube_store import API_VERSION, PLURAL, KubeRunStore
from engine.lab.controlplane import ControlPlane
from engine.lab.kubectl import Kubectl
from engine.store import RunStore
from tests.store_contract import *  # noqa: F403  (the contract's tests and the ``store`` fixture)
from tests.store_contract import StoreBed, set_owner_in

pytestmark = pytest.mark.integration

BASE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
NS = "runbook-system"


class CountingObjects:
    """Our connector, counting the conflicts the API server answered to status writes."""

    def __init__(self, inner: KubeConnector) -> None:
        self.inner = inner
        self.conflicts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def replace_object(self, api_version: str, kind_plural: str, namespace: str, body: Mapping[str, Any], *,
                       subresource: str | None = None) -> dict[str, Any]:
        try:
            return self.inner.replace_object(api_version, kind_plural, namespace, body, subresource=subresource)
        except Conflict:
            self.conflicts += 1
            raise


@pytest.fixture(scope="module")
def crd(control_plane: ControlPlane, kubectl: Kubectl) -> Iterator[ControlPlane]:
    kubectl("apply", "-f", str(BASE / "namespace.yaml"), "-f", str(BASE / "crd-remediationruns.yaml"))
    kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/remediationruns.runbook.io")
    yield control_plane
    kubectl("delete", "rr", "--all", "-n", NS, check=False)


def connector(plane: ControlPlane) -> KubeConnector:
    return KubeConnector(kubeconfig=str(plane.kubeconfig))


_namespaces = iter(range(1, 10_000))


@pytest.fixture(params=["lists", "following"])
def bed(request: pytest.FixtureRequest, crd: ControlPlane, kubectl: Kubectl) -> Iterator[StoreBed]:
    """The contract's store: RemediationRuns in a fresh namespace, each view on its own client;
    ``following``: every view keeps the runs from a watch (``KubeRunStore.follow``, as ``runbook
    serve`` does), so the contract's lists are answered by the index."""
    namespace = f"contract-{next(_namespaces)}"
    kubectl("create", "namespace", namespace)
    opened: list[KubeRunStore] = []

    def reopen() -> RunStore:
        store = KubeRunStore(connector(crd), namespace)
        if request.param == "following":
            assert store.follow()
        opened.append(store)
        return store

    first = reopen()
    yield StoreBed(first, reopen, set_owner_in(first))
    for store in opened:
        store.close()
    kubectl("delete", "rr", "--all", "-n", namespace, check=False)


def test_a_write_with_a_stale_resource_version_is_a_409_retried_on_a_fresh_read_never_written_over(
        crd: ControlPlane) -> None:
    counted = CountingObjects(connector(crd))
    mine = KubeRunStore(counted, NS)  # type: ignore[arg-type]
    theirs = KubeRunStore(connector(crd), NS)
    run_id = mine.create_run("gpu-node-recovery", {"node": "omen2"}, ["omen2"], state="running")
    assert mine.append(run_id, "step.start", step="swap-off") == 1  # mine's copy is current now
    assert theirs.append(run_id, "approval.granted", approved_by="bob") == 2  # another process
    assert counted.conflicts == 0
    assert mine.append(run_id, "action.intent", step="swap-off", action="ansible") == 3
    assert counted.conflicts == 1  # the server refused mine's stale write; mine read again
    events = theirs.events(run_id)
    assert [(e.seq, e.kind, e.data) for e in events] == [
        (1, "step.start", {}), (2, "approval.granted", {"approved_by": "bob"}),
        (3, "action.intent", {"action": "ansible"})]


def test_the_spec_is_written_once_and_the_status_only_through_its_subresource(
        crd: ControlPlane, kubectl: Kubectl) -> None:
    kube = connector(crd)
    store = KubeRunStore(kube, NS)
    run_id = store.create_run("gpu-node-recovery", {"node": "omen2"}, ["omen2"])
    store.set_state(run_id, "running")
    obj = kubectl.json("get", "rr", run_id, "-n", NS)
    assert obj["spec"] == {"runbook": "gpu-node-recovery", "node": "omen2", "nodes": ["omen2"],
                           "params": {"node": "omen2"}, "source": "cli", "mode": "auto"}
    assert obj["status"]["phase"] == "Running" and obj["status"]["owner"]["pid"] > 0
    # the main resource ignores a status (what makes a spec writer unable to fake progress) ...
    kube.replace_object(API_VERSION, PLURAL, NS, {**obj, "status": {**obj["status"], "phase": "Succeeded"}})
    assert store.get_run(run_id).state == "running"
    # ... and a POST's status is dropped: the store writes its first status after creating
    created = kube.create_object(API_VERSION, PLURAL, NS, {
        "apiVersion": API_VERSION, "kind": "RemediationRun", "metadata": {"name": "r-posted-status"},
        "spec": {"runbook": "x", "node": "omen2"}, "status": {"phase": "Succeeded"}})
    assert "status" not in created
    assert store.get_run("r-posted-status").state == "pending"
    # a stale resourceVersion on the status subresource is refused by the server
    store.append(run_id, "step.start", step="swap-off")  # obj is stale from here on
    with pytest.raises(Conflict):
        kube.replace_object(API_VERSION, PLURAL, NS, {**obj, "status": {"phase": "Failed"}}, subresource="status")
    assert store.get_run(run_id).state == "running"


def test_kubectl_get_rr_shows_runbook_node_phase_and_age(crd: ControlPlane, kubectl: Kubectl) -> None:
    store = KubeRunStore(connector(crd), NS)
    run_id = store.create_run("gpu-node-recovery", {"node": "omen2"}, ["omen2"])
    store.set_state(run_id, "waiting-approval")
    lines = kubectl("get", "rr", run_id, "-n", NS).stdout.splitlines()
    assert lines[0].split() == ["NAME", "RUNBOOK", "NODE", "PHASE", "AGE"]
    assert lines[1].split()[:4] == [run_id, "gpu-node-recovery", "omen2", "WaitingApproval"]
    child = store.create_run("node-reboot", {"node": "omen2"}, ["omen2"])
    store.append(child, "escalation.of", run=run_id, runbook="gpu-node-recovery", remaining=[])
    wide = kubectl("get", "rr", child, "-n", NS, "-o", "wide").stdout.splitlines()
    assert wide[0].split() == ["NAME", "RUNBOOK", "NODE", "PHASE", "AGE", "PARENT"]
    assert wide[1].split()[-1] == run_id  # escalated from it (issue 29)


def test_retention_deletes_only_finished_runs_past_the_count_or_age(crd: ControlPlane) -> None:
    store = KubeRunStore(connector(crd), "retention-test")
    kube = store.api
    assert isinstance(kube, KubeConnector)
    kube._raw("POST", "/api/v1/namespaces", "create namespace",
              body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "retention-test"}})
    ids = []
    for i in range(4):
        ids.append(store.create_run("rb", {"i": i}, ["omen2"]))
        time.sleep(0.01)
    for run_id in ids[:3]:
        store.set_state(run_id, "succeeded", exit_code=0)
    assert sorted(store.prune(keep=1)) == sorted(ids[:2])  # ids[3] is pending: kept
    assert {r.id for r in store.list_runs()} == {ids[2], ids[3]}
    finished = store.get_run(ids[2]).finished
    assert finished is not None
    assert store.prune(keep=5, max_age=60, now=finished + 61) == [ids[2]]
    assert [r.id for r in store.list_runs()] == [ids[3]]
    stale = kube.read_object(API_VERSION, PLURAL, "retention-test", ids[3])
    assert stale is not None
    store.append(ids[3], "run.note", note="changed since read")
    with pytest.raises(Conflict):  # a delete at a stale version is refused: a changed run is never lost
        kube.delete_object(API_VERSION, PLURAL, "retention-test", ids[3],
                           resource_version=stale["metadata"]["resourceVersion"])


def test_a_run_whose_owner_died_is_recorded_interrupted_by_its_reader_for_kubectl(
        crd: ControlPlane, kubectl: Kubectl) -> None:
    kube = connector(crd)
    store = KubeRunStore(kube, NS)
    run_id = store.create_run("gpu-node-recovery", {"node": "omen2"}, ["omen2"], state="running")
    obj = kube.read_object(API_VERSION, PLURAL, NS, run_id)
    assert obj is not None
    obj["status"]["owner"]["start"] = "a-boot-long-gone/1"  # the owner is gone (another boot)
    kube.replace_object(API_VERSION, PLURAL, NS, obj, subresource="status")
    reader = KubeRunStore(connector(crd), NS)
    assert {r.id: r.state for r in reader.list_runs()}[run_id] == "interrupted"
    st = kubectl.json("get", "rr", run_id, "-n", NS)["status"]
    assert st["phase"] == "Interrupted" and st["owner"]["pid"] is None and "runbook resume" in st["message"]


class ListCounting:
    """Our connector, counting its lists and reads (what a following store must not need)."""

    def __init__(self, inner: KubeConnector) -> None:
        self.inner = inner
        self.lists = 0
        self.reads = 0

    def read_object(self, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
        self.reads += 1
        return self.inner.read_object(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def list_objects(self, *args: Any, **kwargs: Any) -> list[Mapping[str, Any]]:
        self.lists += 1
        return self.inner.list_objects(*args, **kwargs)


def _eventually(read: Any, want: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    got = read()
    while got != want and time.monotonic() < deadline:
        time.sleep(0.05)
        got = read()
    return got


def test_a_following_store_lists_from_its_watch_its_own_writes_at_once_and_another_writers_soon(
        crd: ControlPlane, kubectl: Kubectl) -> None:
    """``KubeRunStore.follow`` (runbook serve): the newest-first lists come from the index the watch
    keeps, never a list call once synced, with the contract's freshness: this store's own writes at
    once, another replica's creates, state changes and deletes within the watch's delay; its plan and
    events are still read whole."""
    namespace = "following-1"
    kubectl("create", "namespace", namespace)
    counted = ListCounting(connector(crd))
    mine = KubeRunStore(counted, namespace)  # type: ignore[arg-type]
    theirs = KubeRunStore(connector(crd), namespace)
    try:
        paged = [theirs.create_run("rb", {}, [f"gpu-{i}"], source="alertmanager") for i in range(3)]
        assert mine.follow(event_kinds=("breaker.reset",))
        webhook = ("alertmanager", "pagerduty")

        def listed() -> list[tuple[str, str]]:
            return [(r.id, r.state) for r in mine.list_runs(sources=webhook)]

        assert _eventually(listed, [(i, "pending") for i in reversed(paged)]) == [
            (i, "pending") for i in reversed(paged)]
        own = mine.create_run("rb", {}, ["gpu-9"], source="pagerduty")  # read at once: no wait
        assert [r.id for r in mine.list_runs(sources=webhook, limit=1)] == [own]
        mine.set_plan(own, {"steps": ["relabel"]}, "sha256:p")
        mine.append(own, "step.start", step="relabel")
        theirs.set_state(paged[0], "failed", exit_code=1)
        want = [(own, "pending"), (paged[2], "pending"), (paged[1], "pending"), (paged[0], "failed")]
        assert _eventually(listed, want) == want
        for run_id in paged[1:]:
            theirs.set_state(run_id, "succeeded", exit_code=0)
        assert sorted(theirs.prune(keep=0)) == sorted([paged[0], *paged[1:]])
        assert _eventually(listed, [(own, "pending")]) == [(own, "pending")]
        assert mine.get_run(own).plan == {"steps": ["relabel"]}  # a read, not the index's copy
        assert [e.kind for e in mine.events(own)] == ["step.start"]
        assert counted.lists == 0  # every list above came from the watch
        reads = counted.reads
        theirs.append(own, "breaker.reset", scope="node", by="alice")  # another replica's reset

        def resets() -> list[Any]:
            return [e.data.get("scope") for e in mine.events_of(own, ("breaker.reset",))]

        assert _eventually(resets, ["node"]) == ["node"]
        assert counted.reads == reads  # the kept events answered, no read of the run
    finally:
        mine.close()
        kubectl("delete", "namespace", namespace, "--wait=false", check=False)
