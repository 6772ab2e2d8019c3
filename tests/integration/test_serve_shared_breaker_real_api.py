"""The breaker shared across replicas on the real (1.20) API server (issue 15): two serve dispatchers,
each with its own ``KubeRunStore`` client on the same RemediationRuns, decide a node's breaker from the
store: a failed automatic run recorded by one replica opens it at the other; a reset at one is a
``breaker.reset`` event in the RemediationRun's status that closes it at the other."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.lab.controlplane import ControlPlane
from engine.lab.kubectl import Kubectl
from engine.serve.cluster import ClusterSnapshot
from engine.serve.config import load_config
from engine.serve.dispatcher import Dispatcher
from engine.serve.guards import Guards
from engine.serve.metrics import ServeMetrics
from engine.serve.notify import Notifier
from engine.serve.triggers import TriggerIndex
from engine.serve.worker import WorkerPool
from engine.serve_starter import JournalRunStarter
from engine.settings import Settings
from tests.fakes import StaticClusterView

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes"
NS = "runbook-system"


class Follower:
    """An elected replica's leadership, fixed (the real one is engine.serve.leader.LeaderElector)."""

    def is_leader(self) -> bool:
        return False

    def describe(self) -> dict[str, Any]:
        return {"role": "follower"}


@pytest.fixture(scope="module")
def crd(control_plane: ControlPlane, kubectl: Kubectl) -> Iterator[ControlPlane]:
    kubectl("apply", "-f", str(BASE / "namespace.yaml"), "-f", str(BASE / "crd-remediationruns.yaml"))
    kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/remediationruns.runbook.io")
    yield control_plane
    kubectl("delete", "rr", "--all", "-n", NS, check=False)


def _replica(plane: ControlPlane) -> Dispatcher:
    settings = Settings(store="kubernetes", store_namespace=NS, kubeconfig=str(plane.kubeconfig),
                        runbooks_dir=ROOT / "runbooks")
    starter = JournalRunStarter(settings, shared_dedup_window=3600)
    config = load_config(None, env={"RUNBOOK_WEBHOOK_TOKEN": "t" * 32})
    return Dispatcher(config, starter, StaticClusterView(()), index=TriggerIndex(starter.trigger_index(), ()),
                      guards=Guards(config), worker=WorkerPool(1, 1), notifier=Notifier(None),
                      metrics=ServeMetrics(), leadership=Follower())  # type: ignore[arg-type]


def test_a_failed_automatic_run_opens_the_breaker_at_every_replica_and_a_reset_at_one_closes_it_at_all(
        crd: ControlPlane, kubectl: Kubectl) -> None:
    a, b = _replica(crd), _replica(crd)
    healthy = ClusterSnapshot(total_nodes=8, unhealthy_nodes=(), unhealthy_gpus=0)
    store = a.starter.journal  # type: ignore[attr-defined]
    run = store.create_run("gpu-node-recovery", {"node": "omen2"}, ["omen2"], source="alertmanager")
    store.set_state(run, "failed", exit_code=1)  # replica a's automatic run failed
    verdict = b.shared_breaker("gpu-node-recovery", "omen2")
    assert verdict is not None and verdict.open_node is not None and verdict.open_node.run_id == run
    warnings = b.guards.check_auto("gpu-node-recovery", "omen2", healthy, verdict)
    assert any(f"the last automatic run on omen2 ({run}) failed" in w for w in warnings)
    assert a.reset_breaker(node="omen2", by="system:serviceaccount:runbook-system:alice") == ["node:omen2"]
    events = kubectl("get", "rr", run, "-n", NS, "-o", "jsonpath={.status.events[-1]}").stdout
    assert '"kind":"breaker.reset"' in events.replace(" ", "") and "alice" in events
    closed = b.shared_breaker("gpu-node-recovery", "omen2")
    assert closed is not None and closed.open_node is None
    assert b.guards.check_auto("gpu-node-recovery", "omen2", healthy, closed) == []
    assert "omen2" not in b.guards.state()["open_nodes"]
