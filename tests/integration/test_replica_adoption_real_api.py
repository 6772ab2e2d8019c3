"""A replica killed mid-burst loses nothing: the leader adopts its queue (issue 32), on the real API server.

Two replicas of the real server (``runbook serve --store kubernetes``, each a process in a UTS namespace
with its own host name, as two pods are), one worker each. Replica B starts first and leads; replica
A gets four pages: one run executes at A (its verification waits for a label), three wait
in A's queue. A is killed with SIGKILL: no hand-back. Its liveness Lease (``runbook-replica-...``) goes
unrenewed; the leader sees it unchanged for its duration and adopts the three queued runs (each with one
``run.adopted`` event naming A), then executes them through the one road for a recorded run: their
nodes carry the label the verification waits for, so they succeed. The run A was executing is not
adopted (a running run is the takeover's, by its node Lease).

And the store's guarded claim that makes an adoption happen once: two clients adopting one run at the
same instant (each its own ``KubeRunStore``), exactly one succeeds.

What is simulated: the Nodes (API objects, no kubelet) and Alertmanager (the test posts its payload);
the runbook is API-only. Each replica's lease duration is 3 s, so the whole test takes seconds.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.p10_burst import burst_node
from engine.connectors.kube import KubeConnector
from engine.errors import Conflict
from engine.kube_store import API_VERSION, PLURAL, KubeRunStore
from engine.lab.controlplane import ControlPlane
from engine.lab.kubectl import Kubectl
from engine.locks import REPLICA_LEASE_PREFIX
from tests.integration.lab.serve_helpers import Server, replica_role, start_replica, wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes"
NS = "runbook-system"
TOKEN = "adopt-sender-token-7c1d"
NODES = [f"adopt-{i}" for i in range(4)]
CONFIG = {"workers": 1, "queue_size": 20, "shutdown_grace": "1s", "cluster_refresh": "1s",
          "cluster_cache_ttl": "30s", "replicas": {"lease_duration": 3}, "dedup": {"node_cooldown": 0},
          "breaker": {"max_unhealthy_nodes": 100000, "max_unhealthy_gpus": 10000000, "max_auto_runs": 100,
                      "window": "1h"}}
RUNBOOK: dict[str, Any] = {
    "apiVersion": "runbook/v1", "name": "adopt-mark", "version": "1.0.0",
    "description": "Mark a NotReady node, then wait for a person's go label (API-only).",
    "params": {"node": {"type": "node", "required": True, "description": "The node"}},
    "preconditions": [{"id": "node-exists", "check": {"node_exists": True}, "message": "no such node"}],
    "steps": [{
        "id": "mark", "rollback": "auto", "why": "Say in the API that the page reached this node.",
        "action": {"kube": {"label": {"runbook.io/adopt": "marked"}}},
        "verify": [{"check": {"node_label": {"key": "runbook.io/adopt-go", "equals": "yes"}}, "timeout": "60s"}],
    }],
    "triggers": [{"alert": "KubeNodeNotReady", "matchers": ['node=~"adopt-.+"'], "mode": "auto",
                  "params": {"node": "{{ labels.node }}"}}],
}


def _delivery(nodes: list[str]) -> dict[str, Any]:
    alerts = [{"status": "firing", "labels": {"alertname": "KubeNodeNotReady", "node": n, "severity": "warning"},
               "annotations": {}, "startsAt": "2026-12-07T14:00:00.000Z", "endsAt": "0001-01-01T00:00:00Z",
               "generatorURL": "http://prometheus.example/graph", "fingerprint": f"fp-{n}"} for n in nodes]
    return {"receiver": "runbook", "status": "firing", "alerts": alerts,
            "groupLabels": {"alertname": "KubeNodeNotReady"}, "commonLabels": {"alertname": "KubeNodeNotReady"},
            "commonAnnotations": {}, "externalURL": "http://alertmanager.example", "version": "4",
            "groupKey": '{}:{alertname="KubeNodeNotReady",batch="adopt"}', "truncatedAlerts": 0}


@pytest.fixture(scope="module")
def adopt_cluster(control_plane: ControlPlane, kubectl: Kubectl) -> Iterator[KubeConnector]:
    kubectl("apply", "-f", str(BASE / "namespace.yaml"), "-f", str(BASE / "crd-remediationruns.yaml"))
    kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/remediationruns.runbook.io")
    kube = KubeConnector(kubeconfig=str(control_plane.kubeconfig))
    yield kube
    kubectl("delete", "rr", "--all", "-n", NS, "--wait=false", check=False)
    ours = ("runbook-serve", REPLICA_LEASE_PREFIX, "runbook-node-adopt-")
    for lease in kube.list_objects("coordination.k8s.io/v1", "leases", namespace=NS):
        name = lease["metadata"]["name"]
        if name.startswith(ours):
            kube.delete_object("coordination.k8s.io/v1", "leases", NS, name)


def _replica(plane: ControlPlane, workdir: Path, host: str) -> Server:
    """``runbook serve`` in a UTS namespace of its own, its host name ``host`` (a pod of its own)."""
    return start_replica(plane.kubeconfig, workdir, host, config=CONFIG, namespace=NS, token=TOKEN,
                         runbooks_dir=workdir.parent / "runbooks")


def _let_go(kube: KubeConnector, node: str) -> None:
    """The label the runbook's verification waits for."""
    for _ in range(10):
        obj = dict(kube.read_object("v1", "nodes", "", node) or {})
        meta = dict(obj["metadata"])
        meta["labels"] = {**(meta.get("labels") or {}), "runbook.io/adopt-go": "yes"}
        try:
            kube.replace_object("v1", "nodes", "", {**obj, "metadata": meta})
            return
        except Conflict:  # the run labelled it meanwhile
            continue
    raise AssertionError(f"node {node} could not be labelled")


def test_a_killed_replicas_queued_runs_are_adopted_once_by_the_leader_and_finish(
        control_plane: ControlPlane, adopt_cluster: KubeConnector, tmp_path: Path) -> None:
    kube = adopt_cluster
    for n in NODES:
        kube.create_object("v1", "nodes", "", burst_node(n))
    (tmp_path / "runbooks").mkdir()
    (tmp_path / "runbooks" / "adopt-mark.yaml").write_text(yaml.safe_dump(RUNBOOK, sort_keys=False))
    leader = _replica(control_plane, tmp_path / "replica-b", "replica-b")
    wait_until(lambda: replica_role(leader) == "leader", 20, "replica-b leads")
    doomed = _replica(control_plane, tmp_path / "replica-a", "replica-a")
    store = KubeRunStore(kube, NS)
    try:
        assert replica_role(doomed) == "follower"
        leases = [o["metadata"]["name"] for o in kube.list_objects("coordination.k8s.io/v1", "leases", namespace=NS)]
        assert sum(name.startswith(REPLICA_LEASE_PREFIX) for name in leases) == 2, leases  # one per replica

        r = httpx.post(doomed.url + "/hooks/alertmanager", json=_delivery(NODES),
                       headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        assert r.status_code in (200, 202), r.text
        decisions = r.json()["decisions"]
        queued = [d["run_id"] for d in decisions if d.get("queue_position")]
        executing = [d["run_id"] for d in decisions if d["decision"] == "started" and not d.get("queue_position")]
        assert len(queued) == 3 and len(executing) == 1, decisions
        wait_until(lambda: store.get_run(executing[0]).state.value == "running", 20, "A executes its first run")

        # -- A dies without a word: its queue stays owned by a dead process on "another machine" ----
        os.kill(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait(10)
        killed_at = time.monotonic()
        assert all(store.get_run(rid).owner_host == "replica-a" for rid in queued)
        for rid in queued:  # nobody is left at A to act on them: their verification may pass at once
            _let_go(kube, store.get_run(rid).nodes[0])

        def adopted() -> bool:
            return all(store.get_run(rid).owner_host == "replica-b" for rid in queued)

        wait_until(adopted, 30, "the leader adopts A's queue",
               lambda: {rid: (store.get_run(rid).state.value, store.get_run(rid).owner_host) for rid in queued})
        assert time.monotonic() - killed_at >= 3  # not before A's Lease was seen unchanged for its duration
        wait_until(lambda: all(store.get_run(rid).state.value == "succeeded" for rid in queued), 60,
               "the adopted runs finish", lambda: {rid: store.get_run(rid).state.value for rid in queued})
        for rid in queued:
            kinds = [e.kind for e in store.events(rid)]
            adoptions = [e for e in store.events(rid) if e.kind == "run.adopted"]
            assert len(adoptions) == 1, kinds  # adopted exactly once
            assert str(adoptions[0].data["previous_owner"]).startswith("replica-a/")
            assert "liveness Lease" in str(adoptions[0].data["reason"])
            assert kinds.count("step.start") == 1, kinds  # executed once, at the leader
        assert not any(e.kind == "run.adopted" for e in store.events(executing[0]))  # running: not a queue
        left = [o["metadata"]["name"] for o in kube.list_objects("coordination.k8s.io/v1", "leases", namespace=NS)
                if o["metadata"]["name"].startswith(REPLICA_LEASE_PREFIX)]
        assert len(left) == 1, left  # the dead replica's liveness Lease was deleted once its queue was adopted
    except AssertionError as e:
        tails = "\n".join(f"--- {s.log_path.parent.name}:\n{s.log_tail(20)}" for s in (leader, doomed))
        raise AssertionError(f"{e}\n{tails}") from None
    finally:
        doomed.stop()
        leader.stop()


def test_two_processes_adopting_one_run_at_once_one_wins(control_plane: ControlPlane,
                                                         adopt_cluster: KubeConnector) -> None:
    kube = adopt_cluster
    run_id = KubeRunStore(kube, NS).create_run("adopt-mark", {"node": "adopt-x"}, ["adopt-x"], source="alertmanager")
    dead = ("replica-gone", 4242, "boot/1")
    obj = dict(kube.read_object(API_VERSION, PLURAL, NS, run_id) or {})
    status = {**dict(obj.get("status") or {}), "owner": {"host": dead[0], "pid": dead[1], "start": dead[2]}}
    kube.replace_object(API_VERSION, PLURAL, NS, {**obj, "status": status}, subresource="status")

    barrier = threading.Barrier(2)
    results: list[bool] = []

    def adopt() -> None:
        store = KubeRunStore(KubeConnector(kubeconfig=str(control_plane.kubeconfig)), NS)  # a client of its own
        barrier.wait()
        results.append(store.claim(run_id, from_owner=dead))

    threads = [threading.Thread(target=adopt) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == [False, True]
    # and once adopted, an adoption from the dead owner changes nothing
    assert KubeRunStore(kube, NS).claim(run_id, from_owner=dead) is False
