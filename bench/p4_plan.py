"""P4 plan: ``runbook plan gpu-node-recovery --node omen2`` on the incident lab (omen2 down for swap,
so the plan gathers facts and previews swap-off from them: ``preview: facts``), and ``runbook plan`` over 100
nodes selected by label against one Ansible ad-hoc command over the same 100 hosts.

The 100 nodes live in a second lab (``bench/scenarios/fleet-100.yaml``: healthy RTX 3090 nodes with
real SSH hosts, label ``bench.runbook.io/fleet=true``), brought up for this benchmark and taken down
after it (``--keep-fleet-lab`` keeps it). ``--quick`` uses a 10-node copy. The ad-hoc baseline runs
with ``-f 10``, the same number of forks as the engine's facts run, as the login user (the engine's
facts run uses sudo when it has a become password, as in the lab); it gets a fresh SSH
control-path folder each run, as the engine does.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml

from bench.common import (
    SCENARIOS,
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
    tool,
)

SELECTOR = "bench.runbook.io/fleet=true"
FORKS = 10  # engine.connectors.ansible.AnsibleConnector's default
# `swapon` lives in /usr/sbin, which a non-root login's PATH lacks on Debian: the plain
# `-a 'swapon --show'` of the issue fails with "No such file or directory" on every host.
SWAPON = "/usr/sbin/swapon --show"


def plan_one(ctx: Context) -> Metric:
    lab = ctx.lab()
    lab.reset()  # omen2 down for swap: a plan with two changing playbook steps (two previews)
    env = ctx.lab_env()
    runs = 1 if ctx.quick else max(5, ctx.runs)
    times: list[float] = []
    loads = []
    for i in range(runs):
        loads.append(loadavg())
        t = run_timed(runbook_cmd("plan", "gpu-node-recovery", "--node", "omen2"), env=env,
                      log_path=ctx.log_path(f"p4-plan-1-{i}.log"))
        if t.rc not in (0,):
            raise RuntimeError(f"runbook plan failed (rc {t.rc}): {t.output[-800:]}")
        times.append(t.seconds)
        log(f"P4 plan omen2 run {i + 1}: {t.seconds:.2f} s")
    return Metric("p4_plan_1_s", median(times), len(times),
                  {"command": "runbook plan gpu-node-recovery --node omen2", "samples_s": summary(times),
                   "state": "incident (omen2 NotReady for swap): one facts run; swap-off and bind-gpus "
                            "previewed from the facts (preview: facts), restart-kubelet has preview: false",
                   "loadavg_at_runs": loads})


def fleet_scenario(ctx: Context) -> tuple[Path, int]:
    source = SCENARIOS / "fleet-100.yaml"
    if not ctx.quick:
        return source, 100
    data: dict[str, Any] = yaml.safe_load(source.read_text())
    data["name"] = "bench-fleet-10"
    data["generate"][0]["count"] = 10
    folder = Path(tempfile.gettempdir()) / "bench-scenarios"
    folder.mkdir(exist_ok=True)
    path = folder / "fleet-10.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, 10


def plan_fleet(ctx: Context) -> Metric:
    scenario, count = fleet_scenario(ctx)
    lab = BenchLab(ctx.fleet_lab_dir, scenario)
    up_s = lab.up()
    if up_s:
        log(f"fleet lab ({count} SSH hosts) up in {up_s:.0f} s")
    try:
        env = ctx.lab_env(lab)
        inventory = env["RUNBOOK_INVENTORY"]
        engine_cmd = runbook_cmd("plan", "gpu-node-recovery", "--selector", SELECTOR)
        ansible_cmd = [tool("ansible", path=env.get("PATH")), "-i", inventory, "all", "-f", str(FORKS), "-m",
                       "command", "-a", SWAPON]
        runs = 1 if ctx.quick else max(5, ctx.runs)
        times: dict[str, list[float]] = {"engine": [], "ansible": []}
        loads = []
        for i, variant in rotations(["engine", "ansible"], runs):
            loads.append(loadavg())
            log_path = ctx.log_path(f"p4-fleet-{variant}-{i}.log")
            if variant == "engine":
                t = run_timed(engine_cmd, env=env, log_path=log_path)
            else:
                with ssh_control_dir() as cp:
                    t = run_timed(ansible_cmd, env={**env, "ANSIBLE_SSH_CONTROL_PATH_DIR": str(cp)},
                                  log_path=log_path)
            if t.rc != 0:
                raise RuntimeError(f"P4 fleet {variant} failed (rc {t.rc}), log {log_path}: {t.output[-800:]}")
            times[variant].append(t.seconds)
            log(f"P4 fleet {variant:7} run {i + 1}: {t.seconds:.2f} s ({count} hosts)")
    finally:
        if not ctx.keep_fleet_lab:
            log("fleet lab down")
            lab.down()
    m_engine, m_ansible = median(times["engine"]), median(times["ansible"])
    return Metric("p4_plan_100_vs_ansible_ratio", m_engine / m_ansible if m_engine and m_ansible else None,
                  len(times["engine"]),
                  {"hosts": count, "engine_s": summary(times["engine"]), "ansible_s": summary(times["ansible"]),
                   "engine_command": f"runbook plan gpu-node-recovery --selector {SELECTOR}",
                   "baseline_command": f"ansible -i INVENTORY all -f {FORKS} -m command -a '{SWAPON}'",
                   "scenario": scenario.name, "loadavg_at_runs": loads})


def run(ctx: Context, *, fleet: bool = True) -> list[Metric]:
    skipped = Metric("p4_plan_100_vs_ansible_ratio", None, 0, {"skipped": "--no-fleet"})
    return [plan_one(ctx), plan_fleet(ctx) if fleet else skipped]
