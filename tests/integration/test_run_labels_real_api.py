"""RemediationRuns at fleet size against the real 1.20 API server: every run carries the labels node,
runbook, phase and trigger (the phase label follows the phase), the store's lists are label-selected,
and every list the connector makes is read in pages (limit/continue)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from engine.connectors import kube as kube_connector
from engine.connectors.kube import KubeConnector
from engine.kube_store import API_VERSION, PHASE_LABEL, PLURAL, KubeRunStore
from engine.lab.controlplane import ControlPlane
from engine.lab.kubectl import Kubectl

pytestmark = pytest.mark.integration

BASE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
NS = "runbook-labels"


class Recording:
    """Our connector, recording the label selectors of the lists and the pages the server answered."""

    def __init__(self, inner: KubeConnector) -> None:
        self.inner = inner
        self.selectors: list[str | None] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def list_objects(self, api_version: str, kind_plural: str, *, namespace: str | None = None,
                     label_selector: str | None = None, cached: bool = False,
                     not_older_than: str | None = None) -> list[Mapping[str, Any]]:
        self.selectors.append(label_selector)
        return self.inner.list_objects(api_version, kind_plural, namespace=namespace, label_selector=label_selector,
                                       cached=cached, not_older_than=not_older_than)


@pytest.fixture(scope="module")
def crd(control_plane: ControlPlane, kubectl: Kubectl) -> Iterator[ControlPlane]:
    kubectl("apply", "-f", str(BASE / "crd-remediationruns.yaml"))
    kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/remediationruns.runbook.io")
    kubectl("create", "namespace", NS, check=False)
    yield control_plane
    kubectl("delete", "rr", "--all", "-n", NS, check=False)


def test_runs_carry_node_runbook_phase_and_trigger_labels_and_lists_select_by_them(
        crd: ControlPlane, kubectl: Kubectl, monkeypatch: pytest.MonkeyPatch) -> None:
    kube = Recording(KubeConnector(kubeconfig=str(crd.kubeconfig)))
    store = KubeRunStore(kube, NS)  # type: ignore[arg-type]
    done = store.create_run("gpu-node-recovery", {"node": "gpu-1"}, ["gpu-1"], source="alertmanager")
    store.set_state(done, "running")
    store.set_state(done, "succeeded", exit_code=0)
    running = store.create_run("gpu-node-recovery", {"node": "gpu-2"}, ["gpu-2"], source="cli")
    store.set_state(running, "running")
    labels = kubectl.json("get", "rr", done, "-n", NS)["metadata"]["labels"]
    assert {k: labels[k] for k in (PHASE_LABEL, "runbook.io/node", "runbook.io/runbook", "runbook.io/trigger")} == {
        PHASE_LABEL: "Succeeded", "runbook.io/node": "gpu-1", "runbook.io/runbook": "gpu-node-recovery",
        "runbook.io/trigger": "alertmanager"}
    names = kubectl("get", "rr", "-n", NS, "-l", f"{PHASE_LABEL}=Running", "-o", "name").stdout.split()
    assert names == [f"remediationrun.runbook.io/{running}"]
    # a run recorded before the labels existed (no phase label) is still found
    legacy = kube.create_object(API_VERSION, PLURAL, NS, {
        "apiVersion": API_VERSION, "kind": "RemediationRun", "metadata": {"name": "r-legacy"},
        "spec": {"runbook": "x", "node": "gpu-3"}})
    assert "labels" not in legacy["metadata"]
    kube.selectors.clear()
    active = [r.id for r in store.list_runs(states=("pending", "running"))]
    assert sorted(active) == sorted([running, "r-legacy"])
    assert kube.selectors == [f"{PHASE_LABEL} in (Interrupted,Pending,Running,WaitingApproval)", f"!{PHASE_LABEL}"]
    # every list is read in pages: with pages of 1, the three runs come in three answers
    monkeypatch.setattr(kube_connector, "LIST_PAGE", 1)
    queries: list[dict[str, Any]] = []
    raw = kube.inner._raw

    def counting(method: str, path: str, what: str, **kw: Any) -> Any:
        queries.append(dict(kw.get("query") or ()))
        return raw(method, path, what, **kw)

    monkeypatch.setattr(kube.inner, "_raw", counting)
    everything = ("pending", "running", "succeeded")
    assert sorted(r.id for r in store.list_runs(states=everything)) == sorted([done, running, "r-legacy"])
    pages = [q for q in queries if q.get("limit") == 1]
    # the labelled two in two answers (and a last, empty one: the selector filters after the read),
    # then the unlabelled one
    assert [q["continue"] is not None for q in pages] == [False, True, True, False]
    assert sorted(r.id for r in store.list_runs()) == sorted([done, running, "r-legacy"])
    assert [r.id for r in store.list_runs(states=("succeeded",))] == [done]
    assert store.prune(keep=0, max_age=None) == [done]


def test_the_newest_runs_are_read_bucket_by_bucket_newest_first_never_every_run(crd: ControlPlane) -> None:
    """``runbook runs`` (``list_runs(limit=N)``) and the breaker's read (with sources) on a history
    spread over seconds, hours and days: the N newest exactly, by lists of created-time buckets
    (plus one for runs without those labels), none of them of every run."""
    kube = Recording(KubeConnector(kubeconfig=str(crd.kubeconfig)))
    for o in kube.list_objects(API_VERSION, PLURAL, namespace=NS):
        kube.delete_object(API_VERSION, PLURAL, NS, o["metadata"]["name"])
    now = time.time()
    ages = [0.5, 1.5, 3, 7, 40, 200, 3000, 7200, 90000, 400000, 5000000]  # seconds ago
    created: dict[str, float] = {}
    webhook: set[str] = set()
    for i, age in enumerate(ages):
        at = now - age
        store = KubeRunStore(kube, NS, clock=lambda at=at: at)  # type: ignore[arg-type]
        source = "alertmanager" if i % 2 else "cli"
        run_id = store.create_run("gpu-node-recovery", {"node": f"gpu-{i}"}, [f"gpu-{i}"], source=source)
        created[run_id] = at
        if source != "cli":
            webhook.add(run_id)
    newest_first = sorted(created, key=lambda rid: -created[rid])
    store = KubeRunStore(kube, NS)  # type: ignore[arg-type]
    for limit in (1, 3, 6, 9, 50):
        kube.selectors.clear()
        assert [r.id for r in store.list_runs(limit=limit)] == newest_first[:limit], limit
        assert all(s and "created-" in s for s in kube.selectors[:-1]), kube.selectors
        if limit < len(ages):
            assert len(kube.selectors) <= 25 and all(s and "created-" in s for s in kube.selectors), kube.selectors
    kube.selectors.clear()
    assert [r.id for r in store.list_runs(limit=3, sources=("alertmanager", "pagerduty"))] == \
        [rid for rid in newest_first if rid in webhook][:3]
    assert all("runbook.io/trigger in (alertmanager,pagerduty)" in str(s) for s in kube.selectors)


def test_the_newest_runs_read_from_the_watch_cache_include_this_stores_own_writes(crd: ControlPlane) -> None:
    """The newest-first lists are answered by the API server's watch cache, which trails etcd by a
    moment: a store still reads its own writes (the cache is asked for at least the version it last
    wrote) and never lists a run it deleted, however fast the next list comes."""
    store = KubeRunStore(KubeConnector(kubeconfig=str(crd.kubeconfig)), NS)
    for _ in range(25):
        run_id = store.create_run("gpu-node-recovery", {"node": "gpu-9"}, ["gpu-9"], source="cli")
        assert run_id in {r.id for r in store.list_runs(limit=5)}
        store.set_state(run_id, "succeeded", exit_code=0)
        assert {r.id: r.state for r in store.list_runs(limit=5)}[run_id] == "succeeded"
        assert run_id in store.prune(keep=0)
        assert run_id not in {r.id for r in store.list_runs(limit=5)}
