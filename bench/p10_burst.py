"""P10 burst (issue 32): 200 nodes fail at once; every node is answered and the budget holds.

* ``p10_burst_200_decided_s``: the **server path**. Two replicas of ``runbook serve --store kubernetes``
  (processes of their own, a leader elected) get four Alertmanager deliveries of 50 alerts at once (two
  each); the figure is from the moment the last delivery was sent to the moment the last answer came
  back: every node decided (``started``, ``queued`` with its place, or ``refused`` with its reason, in
  the answer). Target: <= 2 s. The claims layer alone (``ClusterBudget.claim`` from 2 x 8 workers, the
  previous figure) is in the detail as ``claims_decided_s``.
* ``p10_budget_violations``: versions of the budget object (watched on the API server for the whole
  burst, and, on the server path, until every run ended) holding more claims than the concurrency
  limit, plus granted claims that were judged with the limit already reached, plus nodes left
  without an answer. Target: 0.

Scenario: a control plane of our own (the lab's kube-apiserver + etcd), 200 API-only GPU Nodes (8
GPUs each, ``Ready=False``: written through the API, no kubelet, no host), ``guards.concurrency.max_runs``
= 20 and the default GPU budget (50 %). The server path pages an API-only runbook (it labels the node;
no Ansible, no host) under a breaker of ``max_auto_runs`` 24 and ``max_pending_approvals`` 10 (the
cluster-health rule set out of the way: every node here is NotReady), 2 workers per replica.
``--quick``: 40 nodes, limit 5, deliveries of 10.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import ENGINE_ROOT, Context, Metric, base_env, log, runbook_cmd, started_server, summary

NAMESPACE = "kube-node-lease"
REPLICAS, WORKERS = 2, 8
STORE_NAMESPACE = "runbook-system"  # the server path: its RemediationRuns, its budget Lease
SENDER_TOKEN = "burst-sender-token-5b9e0c"
BURST_LABEL = "runbook.io/test-burst"  # every node of the burst (deleted by it)

# The server path's runbook: API-only (it labels the node), so no host and no Ansible are needed.
BURST_RUNBOOK: dict[str, Any] = {
    "apiVersion": "runbook/v1", "name": "burst-mark", "version": "1.0.0",
    "description": "Mark a node that went NotReady (API-only: the burst's runbook, issue 32).",
    "params": {"node": {"type": "node", "required": True, "description": "The node"}},
    "preconditions": [{"id": "node-exists", "check": {"node_exists": True}, "message": "no such node"}],
    "steps": [{
        "id": "mark", "rollback": "auto", "why": "Say in the API that the burst reached this node.",
        "action": {"kube": {"label": {"runbook.io/burst": "marked"}}},
        "skip_if": [{"node_label": {"key": "runbook.io/burst", "equals": "marked"}}],
        "verify": [{"check": {"node_label": {"key": "runbook.io/burst", "equals": "marked"}}, "timeout": "30s"}],
    }],
    "triggers": [{"alert": "KubeNodeNotReady", "matchers": ['node=~"burst-.+"'], "mode": "auto",
                  "params": {"node": "{{ labels.node }}"}}],
}


def serve_config(*, max_runs: int, max_auto: int, max_approvals: int, workers: int) -> dict[str, Any]:
    """A replica's configuration for the burst: the breaker's rate window and approval budget bite,
    its cluster-health rule is set out of the way (every node of the burst is NotReady)."""
    return {
        "workers": workers, "queue_size": 100, "shutdown_grace": "2s", "cluster_refresh": "1s",
        "replicas": {"lease_duration": 3}, "dedup": {"node_cooldown": 0},
        "breaker": {"max_unhealthy_nodes": 100000, "max_unhealthy_gpus": 10000000, "max_auto_runs": max_auto,
                    "max_pending_approvals": max_approvals, "window": "1h"},
        "guards": {"concurrency": {"max_runs": max_runs}},
    }


def burst_node(name: str) -> dict[str, Any]:
    """An API-only GPU Node (8 GPUs), not Ready, labelled as the burst's."""
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"nvidia.com/gpu.count": "8", BURST_LABEL: "true"}},
            "status": {"capacity": {"nvidia.com/gpu": "8"}, "allocatable": {"nvidia.com/gpu": "8"},
                       "conditions": [{"type": "Ready", "status": "False", "reason": "KubeletNotReady"}]}}


def burst_alert(i: int) -> dict[str, Any]:
    """Alertmanager's v4 alert for node ``burst-<i>`` (KubeNodeNotReady, firing)."""
    node = f"burst-{i:03d}"
    return {"status": "firing", "labels": {"alertname": "KubeNodeNotReady", "node": node, "severity": "warning"},
            "annotations": {"summary": f"{node} is NotReady"}, "startsAt": "2026-12-07T14:00:00.000Z",
            "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://prometheus.example/graph",
            "fingerprint": f"fp-burst-{i:03d}"}


def burst_delivery(first: int, count: int) -> dict[str, Any]:
    """One Alertmanager delivery (v4 payload) of the alerts of nodes ``first`` .. ``first + count - 1``."""
    return {"receiver": "runbook", "status": "firing", "alerts": [burst_alert(i) for i in range(first, first + count)],
            "groupLabels": {"alertname": "KubeNodeNotReady"}, "commonLabels": {"alertname": "KubeNodeNotReady"},
            "commonAnnotations": {}, "externalURL": "http://alertmanager.example", "version": "4",
            "groupKey": f'{{}}:{{alertname="KubeNodeNotReady",batch="{first}"}}', "truncatedAlerts": 0}


def deliver(targets: Sequence[tuple[str, int, int]]) -> tuple[list[dict[str, Any]], float]:
    """Post the deliveries (base URL, first node, count) all at once; their answers, and the seconds
    from the last one sent to the last answer back (every node decided)."""
    import httpx

    sent: list[float] = []
    lock = threading.Lock()

    def one(target: tuple[str, int, int]) -> tuple[dict[str, Any], float]:
        base, first, count = target
        with lock:
            sent.append(time.perf_counter())
        r = httpx.post(base + "/hooks/alertmanager", json=burst_delivery(first, count),
                       headers={"Authorization": f"Bearer {SENDER_TOKEN}"}, timeout=120)
        if r.status_code not in (200, 202):
            raise RuntimeError(f"{base}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json(), time.perf_counter()

    with ThreadPoolExecutor(len(targets)) as pool:
        done = list(pool.map(one, targets))
    return [a for a, _ in done], max(t for _, t in done) - max(sent)


def install_store(kube: Any) -> None:
    """The store namespace and the RemediationRun CRD of deploy/kubernetes, established."""
    import yaml

    from engine.errors import Conflict

    with contextlib.suppress(Conflict):
        kube.create_object("v1", "namespaces", "", {"apiVersion": "v1", "kind": "Namespace",
                                                    "metadata": {"name": STORE_NAMESPACE}})
    crd = yaml.safe_load((ENGINE_ROOT / "deploy" / "kubernetes" / "crd-remediationruns.yaml").read_text())
    with contextlib.suppress(Conflict):
        kube.create_object("apiextensions.k8s.io/v1", "customresourcedefinitions", "", crd)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = kube.read_object("apiextensions.k8s.io/v1", "customresourcedefinitions", "", crd["metadata"]["name"])
        conditions = ((got or {}).get("status") or {}).get("conditions") or []
        if any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions):
            return
        time.sleep(0.1)
    raise RuntimeError("the RemediationRun CRD was not established in 60 s")


@contextlib.contextmanager
def serve_replica(plane: Any, work: Path, config: Mapping[str, Any], *,
                  host: str | None = None) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``runbook serve --store kubernetes`` on 127.0.0.1 over ``work/runbooks`` (base URL, process),
    ready once ``/readyz`` answers; SIGTERM on exit. ``host``: in a UTS namespace of its own with that
    host name (root, ``unshare``), as a pod of its own is."""
    import yaml

    from engine.lab.ports import free_port

    work.mkdir(parents=True, exist_ok=True)
    (work / "serve.yaml").write_text(yaml.safe_dump(dict(config)))
    port = free_port("127.0.0.1")
    env = base_env({"HOME": str(work), "KUBECONFIG": str(plane.kubeconfig), "RUNBOOK_STORE": "kubernetes",
                    "RUNBOOK_STORE_NAMESPACE": STORE_NAMESPACE, "RUNBOOK_JOURNAL": str(work / "journal.sqlite"),
                    "RUNBOOK_WEBHOOK_TOKEN": SENDER_TOKEN, "RUNBOOK_RUNBOOKS_DIR": str(work.parent / "runbooks")})
    cmd = runbook_cmd("serve", "--listen", f"127.0.0.1:{port}", "--config", str(work / "serve.yaml"))
    if host is not None:
        cmd = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host, *cmd]
    base = f"http://127.0.0.1:{port}"
    with started_server(cmd, env=env, log=work / "serve.log", ready_url=base + "/readyz", timeout=90) as proc:
        yield base, proc


def _wait(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if predicate():
                return True
        time.sleep(0.25)
    return False


def serve_burst(plane: Any, nodes: int, limit: int, work: Path) -> dict[str, Any]:
    """The server path: two replicas, ``nodes`` alerts in four deliveries at once (see the module doc)."""
    import httpx
    import yaml

    from engine.connectors.kube import KubeConnector

    kube = KubeConnector(kubeconfig=str(plane.kubeconfig))
    install_store(kube)
    for i in range(nodes):
        kube.create_object("v1", "nodes", "", burst_node(f"burst-{i:03d}"))
    (work / "runbooks").mkdir(parents=True, exist_ok=True)
    (work / "runbooks" / "burst-mark.yaml").write_text(yaml.safe_dump(BURST_RUNBOOK, sort_keys=False))
    config = serve_config(max_runs=limit, max_auto=24 if nodes >= 100 else 6, max_approvals=10 if nodes >= 100
                          else 2, workers=2)
    watch = BudgetWatch(plane, STORE_NAMESPACE)
    with contextlib.ExitStack() as stack:
        bases = [stack.enter_context(serve_replica(plane, work / f"replica-{n}", config))[0] for n in "ab"]
        if not _wait(lambda: sorted(httpx.get(b + "/readyz", timeout=5).json()["role"] for b in bases)
                     == ["follower", "leader"], 30):
            raise RuntimeError("no leader elected among the two replicas in 30 s")
        watch.start(limit)
        time.sleep(0.5)
        per = nodes // 4
        answers, decided = deliver([(bases[k % 2], k * per, per) for k in range(4)])
        decisions = [d for a in answers for d in a["decisions"]]
        answered = {d.get("node") for d in decisions if d.get("decision") in ("started", "queued", "refused")}
        counts: dict[str, int] = {}
        for a in answers:
            for k, v in (a.get("counts") or {}).items():
                counts[k] = counts.get(k, 0) + v

        def idle() -> bool:
            return all(httpx.get(b + "/healthz", timeout=5).json()["workers"]["running"] == 0
                       and httpx.get(b + "/healthz", timeout=5).json()["workers"]["queued"] == 0 for b in bases)

        settled = _wait(idle, 300)  # the budget is watched until the runs of the burst ended
        time.sleep(1.0)
        watch.stop()
    return {"decided_s": decided, "nodes": nodes, "answered": len(answered), "unanswered": nodes - len(answered),
            "counts": counts, "limit": limit, "settled": settled, "violations": watch.over,
            "most_claims_seen": watch.most, "budget_versions_seen": watch.versions, "watch_error": watch.error}


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
        kube.create_object("v1", "nodes", "", burst_node(f"gpu-{i:03d}"))
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
                claims = burst(plane, nodes, limit)
                server = serve_burst(plane, nodes, limit, Path(tmp) / "serve")
            finally:
                plane.stop()
        rounds.append({"server": server, "claims": claims})
        log(f"p10 burst round {r + 1}: server path {server['decided_s']:.2f} s ({server['counts']}), "
            f"claims {claims['decided_s']:.2f} s, violations {server['violations']} + {claims['violations']}")
    detail = {"rounds": rounds, "decided_s": summary([x["server"]["decided_s"] for x in rounds]),
              "claims_decided_s": summary([x["claims"]["decided_s"] for x in rounds]),
              "simulated": "API-only NotReady GPU nodes and an API-only runbook (it labels the node); the "
                           "deliveries are posted by the bench as Alertmanager would; two real runbook serve "
                           "replicas on the real API server; the claims layer: 2 replicas x 8 workers of "
                           "ClusterBudget.claim"}
    violations = sum(x["server"]["violations"] + x["server"]["unanswered"] + x["claims"]["violations"]
                     + x["claims"]["unanswered"] for x in rounds)
    return [Metric("p10_burst_200_decided_s", summary([x["server"]["decided_s"] for x in rounds])["median"],
                   ctx.runs, detail),
            Metric("p10_budget_violations", float(violations), ctx.runs,
                   {"most_claims_seen": max(max(x["server"]["most_claims_seen"], x["claims"]["most_claims_seen"])
                                            for x in rounds), "limit": limit})]


__all__ = ["BURST_RUNBOOK", "burst", "burst_delivery", "burst_node", "deliver", "install_store", "run", "serve_burst",
           "serve_config", "serve_replica"]
