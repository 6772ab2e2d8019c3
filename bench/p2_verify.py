"""P2 verify reaction: from the moment a node turns Ready in the API to the engine recording the
verification as passed, against ``kubectl wait --for=condition=Ready`` on the same event.

Per repetition, on the lab's real API server:

1. create a node ``bench-p2-N`` (no kubelet, no Lease, a NoSchedule taint) and set its Ready
   condition to False through the status subresource;
2. start ``kubectl wait --for=condition=Ready node/bench-p2-N`` and, in a thread of this process,
   the engine: ``runs.plan_targets`` + ``Executor.execute`` of ``bench/runbooks/bench-wait-ready.yaml`` (one check-only
   step verified by ``node_ready: true``) through the real ``KubeConnector`` (its node watch) and a
   ``JournalSink`` on a real SQLite journal;
3. once both wait (the engine's ``step.start`` seen, then 1.5 s), T0 = just before this process
   PATCHes the node's status to Ready=True;
4. engine time = when the journal append of the passing ``verify.result`` returned; kubectl time =
   when its process exited (seen by a thread blocked in ``wait()``). Both minus T0, in ms;
5. delete the node.
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import ENGINE_ROOT, ROOT, Context, Metric, log, median, summary, tool

RUNBOOK = ROOT / "bench" / "runbooks" / "bench-wait-ready.yaml"
SETTLE_S = 1.5


def _now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _ready(status: str) -> dict[str, Any]:
    now = _now_rfc3339()
    return {"status": {"conditions": [{
        "type": "Ready", "status": status, "reason": "KubeletReady" if status == "True" else "BenchNotReady",
        "message": "set by bench/p2_verify.py", "lastHeartbeatTime": now, "lastTransitionTime": now}]}}


class _TimingSink:
    """The journal first (write-ahead, as in a real run), then the time the passing verify was recorded."""

    def __init__(self, journal: Any, run_id: str) -> None:
        from engine.store import JournalSink

        self.inner = JournalSink(journal, run_id)
        self.step_started = threading.Event()
        self.passed_at: float | None = None

    def emit(self, kind: str, **data: Any) -> None:
        self.inner.emit(kind, **dict(data))
        if kind == "verify.result" and data.get("holds") is True and self.passed_at is None:
            self.passed_at = time.perf_counter()
        if kind == "step.start":
            self.step_started.set()


def _one(i: int, kube_admin: Any, kube_engine: Any, journal: Any, env: dict[str, str]) -> dict[str, Any]:
    from engine.execution import Executor
    from engine.lab.sim_kube import NODES
    from engine.loader import load
    from engine.params import prepare_run
    from engine.runs import plan_targets

    name = f"bench-p2-{i}-{int(time.time()) % 100000}"
    manifest = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"bench.runbook.io/p2": "true"}},
                "spec": {"taints": [{"key": "bench.runbook.io/p2", "effect": "NoSchedule"}]}}
    kube_admin.create(NODES, manifest)
    try:
        kube_admin.patch(NODES, name, _ready("False"), sub="status")
        kubectl = subprocess.Popen([tool("kubectl", path=env.get("PATH")), "wait", "--for=condition=Ready",
                                    f"node/{name}", "--timeout=30s"],
                                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        kubectl_done: dict[str, Any] = {}

        def watch_kubectl() -> None:
            kubectl_done["rc"] = kubectl.wait()
            kubectl_done["at"] = time.perf_counter()

        loaded = load(RUNBOOK, playbooks_dir=ENGINE_ROOT / "playbooks")
        prepared = prepare_run(loaded, {}, node=name)
        run_id = journal.create_run(loaded.name, prepared.params, [name], source="bench")
        sink = _TimingSink(journal, run_id)
        outcome: dict[str, Any] = {}

        def engine() -> None:
            try:
                plan = plan_targets([prepared], kube_engine, None, preview=False)[0]
                outcome["result"] = Executor(kube_engine, None, events=sink, playbooks_dir=loaded.playbooks_dir
                                             ).execute(plan, prepared.runbook, prepared.params)
            except Exception as e:  # reported below
                outcome["error"] = e

        threads = [threading.Thread(target=watch_kubectl, daemon=True), threading.Thread(target=engine, daemon=True)]
        for t in threads:
            t.start()
        if not sink.step_started.wait(30):
            raise RuntimeError(f"the engine did not start waiting: {outcome}")
        time.sleep(SETTLE_S)
        t0 = time.perf_counter()
        kube_admin.patch(NODES, name, _ready("True"), sub="status")
        for t in threads:
            t.join(40)
        result = outcome.get("result")
        if "error" in outcome or result is None or result.exit_code != 0 or sink.passed_at is None:
            raise RuntimeError(f"engine run did not pass: {outcome}")
        if kubectl_done.get("rc") != 0:
            raise RuntimeError(f"kubectl wait failed: rc {kubectl_done.get('rc')}: "
                               f"{kubectl.stderr.read().decode() if kubectl.stderr else ''}")
        return {"engine_ms": (sink.passed_at - t0) * 1000, "kubectl_ms": (kubectl_done["at"] - t0) * 1000}
    finally:
        kube_admin.delete(NODES, name)


def run(ctx: Context) -> list[Metric]:
    from engine.connectors.kube import KubeConnector
    from engine.journal import Journal
    from engine.lab.sim_kube import Kube

    lab = ctx.lab()
    env = ctx.lab_env()
    record = lab.record()
    kube_admin = Kube(record["kubeconfig"])
    kube_engine = KubeConnector(kubeconfig=record["kubeconfig"])
    reps = 2 if ctx.quick else max(10, ctx.runs)
    engine_ms: list[float] = []
    kubectl_ms: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-p2-") as tmp:
        journal = Journal(Path(tmp) / "journal.sqlite")
        try:
            for i in range(reps):
                r = _one(i, kube_admin, kube_engine, journal, env)
                engine_ms.append(r["engine_ms"])
                kubectl_ms.append(r["kubectl_ms"])
                log(f"P2 run {i + 1}: engine {r['engine_ms']:.1f} ms, kubectl wait {r['kubectl_ms']:.1f} ms")
        finally:
            kube_engine.close()
            kube_admin.close()
    m_engine, m_kubectl = median(engine_ms), median(kubectl_ms)
    ratios = [e / k for e, k in zip(engine_ms, kubectl_ms, strict=True) if k > 0]
    detail = {"engine_ms": summary(engine_ms, 1), "kubectl_wait_ms": summary(kubectl_ms, 1),
              "paired_ratio": summary(ratios), "settle_s": SETTLE_S,
              "how": "node Ready flipped via the status subresource; engine = JournalSink append of the passing "
                     "verify.result; kubectl = process exit"}
    return [
        Metric("p2_verify_reaction_ratio", m_engine / m_kubectl if m_engine and m_kubectl else None, len(engine_ms),
               detail),
        Metric("p2_verify_reaction_ms", m_engine, len(engine_ms), {"engine_ms": detail["engine_ms"],
                                                                    "kubectl_wait_ms": detail["kubectl_wait_ms"]}),
    ]
