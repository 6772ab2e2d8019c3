"""P10 burst (issue 32): 200 nodes fail at once; every run claims its place in the cluster's budget.

* ``p10_burst_200_decided_s``: from the first claim of the burst to the last node decided (granted or
  refused with its reason). Target: <= 2 s.
* ``p10_budget_violations``: versions of the budget object (watched on the API server for the whole
  burst) holding more claims than the concurrency limit, plus granted claims that were judged with
  the limit already reached. Target: 0.

Scenario: a control plane of our own (the lab's kube-apiserver + etcd), 200 API-only GPU Nodes (8
GPUs each, ``Ready=False``: written through the API, no kubelet, no host), ``guards.concurrency.max_runs``
= 20 and the default GPU budget (50 %). Two replicas (two ``ClusterBudget`` instances on two
connectors), each with 8 workers (``runbook serve``'s ``workers`` at most 64), decide the 200 runs
at once with ``engine.budget.budget_verdicts`` as the run service does. What is simulated: the
webhook and the dispatcher (P5/P8 measure them) and the runs themselves (a granted run holds its
claim to the end of the burst). ``--quick``: 40 nodes, limit 5.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import Context, Metric, log, summary

NAMESPACE = "kube-node-lease"
REPLICAS, WORKERS = 2, 8


def _node(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"nvidia.com/gpu.count": "8"}},
            "status": {"capacity": {"nvidia.com/gpu": "8"}, "allocatable": {"nvidia.com/gpu": "8"},
                       "conditions": [{"type": "Ready", "status": "False", "reason": "KubeletNotReady"}]}}


class BudgetWatch:
    """Every version of the budget object, as the API server's watch delivers them: the most claims seen."""

    def __init__(self, plane: Any, namespace: str = NAMESPACE) -> None:
        from kubernetes import client, watch

        self.namespace = namespace
        self._api = client.CoordinationV1Api(plane.new_api_client())
        self._watch = watch.Watch()
        self.most, self.versions, self.over = 0, 0, 0
        self.limit = 0
        self.stopped = False
        self.error = ""  # the watch broke before the end of the burst: its count is not complete
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from engine.budget import BUDGET_LEASE, CLAIMS_ANNOTATION

        try:
            for event in self._watch.stream(self._api.list_namespaced_lease, self.namespace,
                                            field_selector=f"metadata.name={BUDGET_LEASE}", timeout_seconds=600):
                annotations = event["object"].metadata.annotations or {}
                n = len(json.loads(annotations.get(CLAIMS_ANNOTATION) or "[]"))
                self.versions += 1
                self.most = max(self.most, n)
                self.over += n > self.limit
        except Exception as e:  # the stream cut when the watch is stopped (or the plane goes away)
            if not self.stopped:
                self.error = f"{type(e).__name__}: {e}"

    def start(self, limit: int) -> None:
        self.limit = limit
        self._thread.start()

    def stop(self) -> None:
        self.stopped = True
        self._watch.stop()


def burst(plane: Any, nodes: int, limit: int) -> dict[str, Any]:
    from engine.budget import ClusterBudget, budget_verdicts, read_nodes
    from engine.connectors.kube import KubeConnector
    from engine.run_guards import Concurrency, GuardConfig

    config = GuardConfig(concurrency=Concurrency(max_runs=limit))
    kube = KubeConnector(kubeconfig=str(plane.kubeconfig))
    for i in range(nodes):  # NotReady (no Ready=True condition): their GPUs are out of service already
        kube.create_object("v1", "nodes", "", _node(f"gpu-{i:03d}"))
    budgets = [ClusterBudget(KubeConnector(kubeconfig=str(plane.kubeconfig)), NAMESPACE) for _ in range(REPLICAS)]
    budgets[0].claims()  # the object exists before the burst
    watch = BudgetWatch(plane)
    watch.start(limit)
    time.sleep(0.5)
    decided: dict[str, tuple[bool, str, float, int]] = {}
    judged_full = 0
    lock = threading.Lock()

    def one(i: int) -> None:
        nonlocal judged_full
        node = f"gpu-{i:03d}"
        budget = budgets[i % REPLICAS]
        nodes = read_nodes(budget.api)  # as the run service: once per claim

        def decide(others: Any) -> str | None:
            stops = [v for v in budget_verdicts(nodes, node, config, others) if v.blocks]
            return "; ".join(f"guard {v.name}: {v.reason}" for v in stops) or None

        result = budget.claim(f"r-burst-{i:03d}", node, decide, gpus=8)
        with lock:
            decided[node] = (result.granted, result.reason, time.perf_counter(), result.attempts)
            judged_full += result.granted and len({c.run for c in result.others}) >= limit

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=REPLICAS * WORKERS) as pool:
        list(pool.map(one, range(nodes)))
    last = max(t for _, _, t, _ in decided.values()) - t0
    time.sleep(1.0)  # the watch delivers the last versions
    watch.stop()
    granted = sum(g for g, _, _, _ in decided.values())
    unanswered = [n for n, (g, reason, _, _) in decided.items() if not g and not reason]
    return {"decided_s": last, "nodes": nodes, "decided": len(decided), "granted": granted,
            "refused": len(decided) - granted, "unanswered": len(unanswered), "limit": limit,
            "refused_by": sorted({reason.split(":")[0] for g, reason, _, _ in decided.values() if not g}),
            "violations": watch.over + judged_full, "most_claims_seen": watch.most,
            "budget_versions_seen": watch.versions, "watch_error": watch.error,
            "attempts": summary([float(a) for _, _, _, a in decided.values()], 1)}


def run(ctx: Context) -> list[Metric]:
    from engine.lab.assets import find_assets
    from engine.lab.controlplane import ControlPlane

    nodes, limit = (40, 5) if ctx.quick else (200, 20)
    assets = find_assets()
    if assets is None:
        raise RuntimeError("no control-plane binaries (scripts/build-control-plane.sh)")
    rounds = []
    for r in range(ctx.runs):
        with tempfile.TemporaryDirectory(prefix="bench-p10b-") as tmp:
            plane = ControlPlane(Path(tmp) / "plane", assets=assets, die_with_parent=True)
            plane.start()
            try:
                rounds.append(burst(plane, nodes, limit))
            finally:
                plane.stop()
        log(f"p10 burst round {r + 1}: {rounds[-1]['decided_s']:.2f} s, {rounds[-1]['violations']} violations")
    detail = {"rounds": rounds, "decided_s": summary([x["decided_s"] for x in rounds]),
              "simulated": "API-only NotReady GPU nodes; the budget claims of 2 replicas x 8 workers on the real "
                           "API server; webhook, dispatcher and the runs themselves are not part of it"}
    return [Metric("p10_burst_200_decided_s", summary([x["decided_s"] for x in rounds])["median"], ctx.runs, detail),
            Metric("p10_budget_violations", float(sum(x["violations"] + x["unanswered"] for x in rounds)), ctx.runs,
                   {"most_claims_seen": max(x["most_claims_seen"] for x in rounds), "limit": limit})]


__all__ = ["burst", "run"]
