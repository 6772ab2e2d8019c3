"""P7 fleet recovery: 20 GPU nodes down for swap, each a real SSH node host
(``engine/lab/scenarios/fleet-20.yaml``), recovered by

* the engine: ``runbook run gpu-node-recovery -l bench.runbook.io/fleet20=true --max-parallel 10 --yes``;
* a script written by hand (``bench/baseline/recover-fleet.sh``): ``kubectl label`` over the
  selector, ONE ``ansible-playbook`` running swap-off.yml then restart-kubelet.yml over all 20
  hosts (``-f 10``, as many forks as the engine's batches are wide), then ``kubectl wait`` for
  Ready and for ``nvidia.com/gpu`` (the waits the runbook's verification does);
* the engine on one node of the same lab: ``runbook run gpu-node-recovery --node fleet-001 --yes``.

``p7_fleet_20_vs_script_ratio`` = engine (20) / script (20); ``p7_fleet_20_vs_1_ratio`` = engine (20)
/ engine (1). Every run starts from ``runbook lab reset`` (untimed; all 20 nodes down again); the
variants alternate in rotating order; after each run (untimed) every node the run was given must be
Ready with ``nvidia.com/gpu`` allocatable and no CUDA job killed, or the run is reported as a problem
and left out. The fleet lab is brought up for this benchmark and taken down after it
(``--keep-fleet-lab`` keeps it). ``--quick`` uses a 4-node copy with ``--max-parallel 2``.
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.common import (
    BENCH,
    ENGINE_ROOT,
    BenchLab,
    Context,
    Metric,
    loadavg,
    log,
    median,
    rotations,
    run_timed,
    runbook_cmd,
    ssh_control_dir,
    summary,
)

SCENARIO = ENGINE_ROOT / "engine" / "lab" / "scenarios" / "fleet-20.yaml"
SELECTOR = "bench.runbook.io/fleet20=true"
SCRIPT = BENCH / "baseline" / "recover-fleet.sh"
ONE = "fleet-001"
VARIANTS = ("engine-fleet", "script", "engine-1")


def scenario(ctx: Context) -> tuple[Path, int, int]:
    """The scenario file, its fleet size and the engine's --max-parallel (also the script's forks)."""
    if not ctx.quick:
        return SCENARIO, 20, 10
    data: dict[str, Any] = yaml.safe_load(SCENARIO.read_text())
    data["name"] = "fleet-4"
    data["generate"][0]["count"] = 4
    folder = Path(tempfile.gettempdir()) / "bench-scenarios"
    folder.mkdir(exist_ok=True)
    path = folder / "fleet-4.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, 4, 2


def fleet_names(count: int) -> list[str]:
    return [f"fleet-{i:03d}" for i in range(1, count + 1)]


def recovered(lab: BenchLab, names: list[str], timeout: float = 90.0) -> dict[str, Any]:
    """Wait (untimed) until every node of ``names`` is recovered; which are not, and why."""
    deadline = time.monotonic() + timeout
    bad: dict[str, Any] = {}
    while True:
        nodes = {n["name"]: n for n in (lab.status() or {}).get("nodes", [])}
        bad = {}
        for name in names:
            n = nodes.get(name, {})
            if not (n.get("ready") and n.get("gpu_allocatable", {}).get("nvidia.com/gpu") == "1"
                    and n.get("cuda_jobs_killed") in (0, None)):
                bad[name] = {"ready": n.get("ready"), "gpu": n.get("gpu_allocatable", {}).get("nvidia.com/gpu"),
                             "cuda_jobs_killed": n.get("cuda_jobs_killed")}
        if not bad or time.monotonic() >= deadline:
            return {"ok": not bad, "not_recovered": bad}
        time.sleep(1.0)


def run(ctx: Context) -> list[Metric]:
    path, count, parallel = scenario(ctx)
    names = fleet_names(count)
    lab = BenchLab(ctx.fleet_lab_dir, path)
    up_s = lab.up()
    if up_s:
        log(f"P7 fleet lab ({count} SSH hosts down for swap) up in {up_s:.0f} s")
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    problems: list[str] = []
    loads: list[list[float]] = []
    skipped_restart: dict[str, int] = {}  # nodes whose kubelet came back by itself once swap was off
    commands = {
        "engine-fleet": runbook_cmd("run", "gpu-node-recovery", "-l", SELECTOR, "--max-parallel", str(parallel),
                                    "--yes"),
        "engine-1": runbook_cmd("run", "gpu-node-recovery", "--node", ONE, "--yes"),
        "script": ["bash", str(SCRIPT), SELECTOR, str(parallel)],
    }
    try:
        env = ctx.lab_env(lab)
        timing = lab.timing()
        for i, variant in rotations(VARIANTS, ctx.runs):
            reset_s = lab.reset()
            loads.append(loadavg())
            log_path = ctx.log_path(f"p7-{variant}-{i}.log")
            if variant == "script":
                with ssh_control_dir() as cp:
                    t = run_timed(commands[variant], env={**env, "ANSIBLE_SSH_CONTROL_PATH_DIR": str(cp)},
                                  log_path=log_path, timeout=900)
            else:
                t = run_timed(commands[variant], env=env, log_path=log_path, timeout=900)
            if variant != "script":
                text = log_path.read_text(errors="replace")
                skipped_restart[variant] = skipped_restart.get(variant, 0) + len(
                    re.findall(r"restart-kubelet\s+skipped", text))
            state = recovered(lab, [ONE] if variant == "engine-1" else names)
            log(f"P7 {variant:12} run {i + 1}: {t.seconds:6.2f} s rc={t.rc} recovered={state['ok']} "
                f"(reset {reset_s:.0f} s, load {loads[-1][:1]})")
            if t.rc != 0 or not state["ok"]:
                problems.append(f"{variant} run {i + 1}: rc {t.rc}, {state['not_recovered']} (log {log_path})")
                continue
            times[variant].append(t.seconds)
    finally:
        if not ctx.keep_fleet_lab:
            log("P7 fleet lab down")
            lab.down()
    m_fleet, m_script, m_one = (median(times[v]) for v in VARIANTS)
    detail: dict[str, Any] = {
        "nodes": count, "max_parallel": parallel, "scenario": path.name,
        "engine_fleet_s": summary(times["engine-fleet"]), "script_s": summary(times["script"]),
        "engine_1_s": summary(times["engine-1"]),
        "engine_command": " ".join(commands["engine-fleet"][-7:]),
        "baseline_command": f"bench/baseline/recover-fleet.sh {SELECTOR} {parallel}",
        "engine_skipped_restart_kubelet": skipped_restart,
        "lab_timing": timing, "loadavg_at_runs": loads, "problems": problems,
        "note": "wall time from spawn to exit on a freshly reset lab; variants alternate in rotating order",
    }
    return [
        Metric("p7_fleet_20_vs_script_ratio", m_fleet / m_script if m_fleet and m_script else None,
               min(len(times["engine-fleet"]), len(times["script"])), detail),
        Metric("p7_fleet_20_vs_1_ratio", m_fleet / m_one if m_fleet and m_one else None,
               min(len(times["engine-fleet"]), len(times["engine-1"])),
               {"nodes": count, "engine_fleet_s": detail["engine_fleet_s"], "engine_1_s": detail["engine_1_s"],
                "one_node_command": " ".join(commands["engine-1"][-5:])}),
    ]
