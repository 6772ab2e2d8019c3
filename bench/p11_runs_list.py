"""P11 the run store at fleet size (issue 32): ``p11_runs_list_10k_s``.

10,000 RemediationRuns (``--quick``: 150) in the store namespace of a control plane of our own (the
lab's kube-apiserver + etcd from the cached assets; no node hosts, no simulator), each created as the
engine records a run (labels node, runbook, phase, trigger; a status with a few events), most of them
finished, 20 active. Then, each timed ``runs`` times:

* ``runbook runs --store kubernetes``: the command a person types, as a process (start included);
* the breaker's read: ``KubeRunStore.list_runs(limit=500, sources=WEBHOOK_SOURCES)`` (label-selected by
  ``runbook.io/trigger``) in-process, what ``runbook serve``'s shared
  breaker reads (``Dispatcher._automatic``);
* the recovery's read: ``list_runs(states=active+interrupted)``, label-selected.

The metric is the slower median of the first two (target <= 1 s); the third is in the detail.
What is simulated: runs are written straight into the store (no run was executed); the API server is
the real one. Run it on an idle machine.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import ENGINE_ROOT, Context, Metric, base_env, log, runbook_cmd, summary

NAMESPACE = "runbook-system"
ACTIVE = 20


def _timed(fn: Callable[[], Any], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def fill(kube: Any, count: int) -> None:
    """``count`` runs as the engine records them (create, then status writes), ACTIVE of them running."""
    from engine.kube_store import KubeRunStore

    store = KubeRunStore(kube, NAMESPACE)
    for i in range(count):
        node = f"gpu-{i % 200:03d}"
        run_id = store.create_run("gpu-node-recovery", {"node": node}, [node],
                                  source="alertmanager" if i % 2 else "cli")
        store.append(run_id, "plan", plan_digest="0" * 64, state="ready", steps=[])
        if i >= count - ACTIVE:
            store.set_state(run_id, "running")
        else:
            store.set_state(run_id, "succeeded" if i % 7 else "failed", exit_code=0 if i % 7 else 1)


def run(ctx: Context) -> list[Metric]:
    from engine.connectors.kube import KubeConnector
    from engine.kube_store import KubeRunStore
    from engine.lab.assets import find_assets
    from engine.lab.controlplane import ControlPlane
    from engine.serve.starter import WEBHOOK_SOURCES
    from engine.store import ACTIVE_STATES

    count = 150 if ctx.quick else 10_000
    assets = find_assets()
    if assets is None:
        raise RuntimeError("no control-plane binaries (scripts/build-control-plane.sh)")
    with tempfile.TemporaryDirectory(prefix="bench-p11-") as tmp:
        plane = ControlPlane(Path(tmp) / "plane", assets=assets, die_with_parent=True)
        plane.start()
        try:
            env = base_env({"KUBECONFIG": str(plane.kubeconfig), "HOME": tmp})
            base = ENGINE_ROOT / "deploy" / "kubernetes"
            for manifest in ("namespace.yaml", "crd-remediationruns.yaml"):
                subprocess.run(["kubectl", "apply", "-f", str(base / manifest)], env=env, check=True,
                               capture_output=True, text=True)
            subprocess.run(["kubectl", "wait", "--for=condition=established", "--timeout=60s",
                            "crd/remediationruns.runbook.io"], env=env, check=True, capture_output=True)
            kube = KubeConnector(kubeconfig=str(plane.kubeconfig))
            t0 = time.perf_counter()
            fill(kube, count)
            log(f"p11: {count} runs stored in {time.perf_counter() - t0:.0f} s")
            store = KubeRunStore(kube, NAMESPACE)
            cli = runbook_cmd("runs", "--store", "kubernetes", "--store-namespace", NAMESPACE, "-o", "json")

            def runs_command() -> None:
                subprocess.run(cli, env=env, check=True, capture_output=True, text=True)

            command = _timed(runs_command, ctx.runs)
            breaker = _timed(lambda: store.list_runs(limit=500, sources=WEBHOOK_SOURCES), ctx.runs)
            recovery = _timed(lambda: store.list_runs(limit=1000, states=(*ACTIVE_STATES, "interrupted")),
                              ctx.runs)
        finally:
            plane.stop()
    value = max(summary(command)["median"], summary(breaker)["median"])
    return [Metric("p11_runs_list_10k_s", value, ctx.runs, {
        "stored_runs": count, "runs_command_s": summary(command), "breaker_read_s": summary(breaker),
        "recovery_read_s": summary(recovery), "simulated": "runs written straight into the store; real API server"})]


__all__ = ["fill", "run"]
