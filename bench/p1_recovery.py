"""P1 recovery (and P6 memory): ``runbook run gpu-node-recovery --node omen2 --yes`` on a freshly reset
lab, against the same recovery scripted by hand (``bench/baseline/recover-checked.sh``, with the same
checks; ``recover-bare.sh``, no checks).

Every run starts from ``runbook lab reset`` (not timed). The three variants alternate (engine,
checked, bare; then checked, bare, engine; ...). Each run's wall time goes from spawning the
command to its exit. After each run (not timed) the lab must show omen2 recovered: Ready,
``nvidia.com/gpu`` allocatable and no CUDA job killed; a run that did not recover is reported.

With ``--compare-tree DIR`` a fourth variant, the engine of another copy of the project (its
runbooks and playbooks too), runs interleaved with the three others on the same lab: before/after
figures from one session, with the same load (``detail.compare``).

The engine runs through ``python -m bench.rss`` (``engine.cli.main`` in-process, as the console
script runs it), which records the process's peak RSS for P6. The baselines get a fresh SSH
control-path folder each (a cold start, as the engine has; their masters are closed afterwards).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Any

from bench.common import (
    BENCH,
    ROOT,
    Context,
    Metric,
    loadavg,
    log,
    median,
    rotations,
    run_timed,
    ssh_control_dir,
    summary,
)

NODE = "omen2"
VARIANTS = ("engine", "checked", "bare")
SCRIPTS = {"checked": BENCH / "baseline" / "recover-checked.sh", "bare": BENCH / "baseline" / "recover-bare.sh"}


def recovered(ctx: Context, timeout: float = 90.0) -> dict[str, Any]:
    """Wait (untimed) until omen2 is recovered; the last status seen."""
    lab = ctx.lab()
    deadline = time.monotonic() + timeout
    node: dict[str, Any] = {}
    while time.monotonic() < deadline:
        node = lab.node(NODE)
        if node.get("ready") and node.get("gpu_allocatable", {}).get("nvidia.com/gpu") == "1":
            break
        time.sleep(1.0)
    return {"ready": bool(node.get("ready")), "gpu": node.get("gpu_allocatable", {}).get("nvidia.com/gpu"),
            "workload": node.get("workload"), "cuda_jobs_killed": node.get("cuda_jobs_killed"),
            "ok": bool(node.get("ready")) and node.get("gpu_allocatable", {}).get("nvidia.com/gpu") == "1"
            and node.get("cuda_jobs_killed") == 0 and node.get("workload") == "container"}


def run(ctx: Context) -> list[Metric]:
    lab = ctx.lab()
    env = ctx.lab_env()
    timing = lab.timing()
    variants = [*VARIANTS, "engine-compare"] if ctx.compare_tree else list(VARIANTS)
    times: dict[str, list[float]] = {v: [] for v in variants}
    rss_mb: list[float] = []
    problems: list[str] = []
    skipped_restart: dict[str, int] = {}
    loads: list[list[float]] = []
    for i, variant in rotations(variants, ctx.runs):
        reset_s = lab.reset()
        loads.append(loadavg())
        log_path = ctx.log_path(f"p1-{variant}-{i}.log")
        if variant in ("engine", "engine-compare"):
            rss_file = ctx.log_path(f"p1-rss-{variant}-{i}.json")
            rss_file.unlink(missing_ok=True)
            cmd = [sys.executable, "-m", "bench.rss", str(rss_file), "--",
                   "run", "gpu-node-recovery", "--node", NODE, "--yes"]
            if variant == "engine":
                t = run_timed(cmd, env=env, log_path=log_path)
            else:  # the other tree's engine, runbooks and playbooks; the same lab and scripts
                assert ctx.compare_tree is not None
                other = {**env, "PYTHONPATH": os.pathsep.join([str(ctx.compare_tree), str(ROOT)])}
                t = run_timed(cmd, env=other, cwd=ctx.compare_tree, log_path=log_path)
            if rss_file.exists() and variant == "engine":
                rss_mb.append(json.loads(rss_file.read_text())["vmhwm_kb"] / 1024)
            if re.search(r"restart-kubelet\s+skipped", t.output):
                skipped_restart[variant] = skipped_restart.get(variant, 0) + 1
        else:
            with ssh_control_dir() as cp:
                t = run_timed(["bash", str(SCRIPTS[variant]), NODE],
                              env={**env, "ANSIBLE_SSH_CONTROL_PATH_DIR": str(cp)}, log_path=log_path)
        state = recovered(ctx)
        log(f"P1 {variant:8} run {i + 1}: {t.seconds:6.2f} s rc={t.rc} recovered={state['ok']} "
            f"(reset {reset_s:.0f} s, load {loads[-1][:1]})")
        if t.rc != 0 or not state["ok"]:
            problems.append(f"{variant} run {i + 1}: rc {t.rc}, {state} (log {log_path})")
            continue
        times[variant].append(t.seconds)

    m_engine, m_checked, m_bare = (median(times[v]) for v in VARIANTS)
    detail: dict[str, Any] = {
        "engine_s": summary(times["engine"]), "checked_s": summary(times["checked"]), "bare_s": summary(times["bare"]),
        "engine_skipped_restart_kubelet": skipped_restart, "lab_timing": timing, "loadavg_at_runs": loads,
        "problems": problems,
        "note": "wall time from spawn to exit on a freshly reset lab; variants alternate in rotating order",
    }
    if ctx.compare_tree:
        m_other = median(times["engine-compare"])
        detail["compare"] = {
            "tree": str(ctx.compare_tree), "engine_s": summary(times["engine-compare"]),
            "vs_checked": round(m_other / m_checked, 4) if m_other and m_checked else None,
            "vs_bare": round(m_other / m_bare, 4) if m_other and m_bare else None}
    out = [
        Metric("p1_recovery_vs_checked_script_ratio",
               m_engine / m_checked if m_engine and m_checked else None,
               min(len(times["engine"]), len(times["checked"])), detail),
        Metric("p1_recovery_vs_bare_script_ratio", m_engine / m_bare if m_engine and m_bare else None,
               min(len(times["engine"]), len(times["bare"])), {"engine_s": detail["engine_s"],
                                                                 "bare_s": detail["bare_s"]}),
        Metric("p6_rss_mb", median(rss_mb), len(rss_mb),
               {"peak_rss_mb": summary(rss_mb, 1), "max_mb": round(max(rss_mb), 1) if rss_mb else None,
                "what": "VmHWM of the runbook process during P1's engine runs (ansible children excluded)"}),
    ]
    return out
