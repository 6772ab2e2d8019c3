"""``bench/run``: run the benchmarks, print one JSON object per metric, write bench/results/.

    bench/run [--quick] [--only p1,p3,...] [--runs N] [--p5-fake] [--no-write] ...

Exit status: 0 when every selected benchmark produced its metrics (missed targets included:
benchmarks are not tests), 1 when one of them could not run (its metrics then have value null
and ``detail.error``), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import compileall
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from bench.common import (
    DEFAULT_FLEET_LAB_DIR,
    DEFAULT_JOURNAL,
    DEFAULT_LAB_DIR,
    DEFAULT_WORK_DIR,
    ENGINE_ROOT,
    RESULTS,
    BenchLab,
    Context,
    Metric,
    loadavg,
    log,
    write_results,
)

# benchmark -> the metrics it produces (P6 is measured during P1's engine runs)
PRODUCES: dict[str, tuple[str, ...]] = {
    "p3": ("p3_help_s", "p3_validate_s"),
    "p2": ("p2_verify_reaction_ratio", "p2_verify_reaction_ms"),
    "p4": ("p4_plan_1_s", "p4_plan_100_vs_ansible_ratio"),
    "p1": ("p1_recovery_vs_checked_script_ratio", "p1_recovery_vs_bare_script_ratio", "p6_rss_mb"),
    "p5": ("p5_webhook_rps", "p5_webhook_p99_ms"),
    "p7": ("p7_fleet_20_vs_script_ratio", "p7_fleet_20_vs_1_ratio"),
    "p9": ("p9_run_page_kb", "p9_first_paint_ms", "p9_live_update_ms"),
    "p8": ("p8_alert_to_run_s", "p8_runbook_webhook_ms"),
    "p10": ("p10_webhook_flood_delta_ms", "p10_healthz_upload_ms"),
    "p10b": ("p10_burst_200_decided_s", "p10_budget_violations"),
    "p11": ("p11_runs_list_10k_s",),
}
# cheapest first, the fleet labs together; the real server last (p9: the server and a browser
# on the lab), then the paging loop (p8: monitoring)
ORDER = ("p3", "p2", "p4", "p7", "p1", "p5", "p10", "p10b", "p11", "p9", "p8")


def _runner(name: str, args: argparse.Namespace) -> Callable[[Context], list[Metric]]:
    if name == "p1":
        from bench import p1_recovery

        return p1_recovery.run
    if name == "p2":
        from bench import p2_verify

        return p2_verify.run
    if name == "p3":
        from bench import p3_cold

        return p3_cold.run
    if name == "p7":
        from bench import p7_fleet

        return p7_fleet.run
    if name == "p9":
        from bench import p9_console

        return p9_console.run
    if name == "p8":
        from bench import p8_alert_to_run

        return p8_alert_to_run.run
    if name == "p10":
        from bench import p10_floods

        return p10_floods.run
    if name == "p10b":
        from bench import p10_burst

        return p10_burst.run
    if name == "p11":
        from bench import p11_runs_list

        return p11_runs_list.run
    if name == "p4":
        from bench import p4_plan

        return lambda ctx: p4_plan.run(ctx, fleet=not args.no_fleet)
    from bench import p5_webhook

    return lambda ctx: p5_webhook.run(ctx, fake=args.p5_fake)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/run", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CI smoke: 1-2 runs each, 10- and 4-node fleets, short rounds")
    p.add_argument("--only", default="",
                   help="comma-separated benchmarks: p1,p2,p3,p4,p5,p6,p7,p8,p9,p10,p10b,p11 (p6 runs p1)")
    p.add_argument("--runs", type=int, default=5, help="repetitions per variant (>= 5 unless --quick)")
    p.add_argument("--lab-dir", type=Path, default=Path(DEFAULT_LAB_DIR))
    p.add_argument("--fleet-lab-dir", type=Path, default=Path(DEFAULT_FLEET_LAB_DIR))
    p.add_argument("--journal", type=Path, default=Path(DEFAULT_JOURNAL))
    p.add_argument("--work-dir", type=Path, default=Path(DEFAULT_WORK_DIR), help="per-run logs")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--keep-fleet-lab", action="store_true",
                   help="leave the fleet lab (P4's 100 nodes or P7's 20) running")
    p.add_argument("--down", action="store_true",
                   help="take the incident lab down at the end (it is otherwise left up for the next run)")
    p.add_argument("--p5-fake", action="store_true", help="P5 against bench.fake_serve (no lab needed)")
    p.add_argument("--no-fleet", action="store_true",
                   help="P4 without its 100-node part (p4_plan_100_vs_ansible_ratio is then null)")
    p.add_argument("--no-write", action="store_true", help="print the metrics only")
    p.add_argument("--compare-tree", type=Path, default=None,
                   help="P1: also time the engine of this other tree, interleaved with the others (before/after)")
    p.add_argument("--tree", type=Path, default=None,
                   help="benchmark the engine of another copy of the project (e.g. a snapshot of HEAD)")
    args = p.parse_args(argv)
    wanted = {w.strip().lower() for w in args.only.split(",") if w.strip()}
    unknown = wanted - {*PRODUCES, "p6"}
    if unknown:
        p.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    if "p6" in wanted:
        wanted = (wanted - {"p6"}) | {"p1"}
    args.selected = [b for b in ORDER if not wanted or b in wanted]
    if not args.quick and args.runs < 5:
        p.error("--runs must be >= 5 (use --quick for a smoke run)")
    if args.quick:
        args.runs = 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # The engine's bytecode, as an installed wheel has it (an editable tree under PYTHONDONTWRITEBYTECODE
    # would compile every module in every timed command): docs/performance.md, "Noise"
    for tree in [ENGINE_ROOT, *([args.compare_tree] if args.compare_tree else [])]:
        compileall.compile_dir(str(Path(tree) / "engine"), quiet=1)
    ctx = Context(quick=args.quick, runs=args.runs, lab_dir=args.lab_dir, fleet_lab_dir=args.fleet_lab_dir,
                  journal=args.journal, work_dir=args.work_dir, keep_fleet_lab=args.keep_fleet_lab,
                  compare_tree=args.compare_tree.resolve() if args.compare_tree else None)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    metrics: list[Metric] = []
    failed = False
    only_p6 = "p6" in args.only.lower() and "p1" not in args.only.lower()
    for name in args.selected:
        log(f"{name}: start (load {loadavg()})")
        t0 = time.perf_counter()
        try:
            produced = _runner(name, args)(ctx)
        except Exception as e:
            failed = True
            log(f"{name}: FAILED: {e}")
            traceback.print_exc(file=sys.stderr)
            produced = [Metric(m, None, 0, {"error": f"{type(e).__name__}: {e}"}) for m in PRODUCES[name]]
        if name == "p1" and only_p6:
            produced = [m for m in produced if m.metric == "p6_rss_mb"]
        log(f"{name}: done in {time.perf_counter() - t0:.0f} s")
        for m in produced:
            print(json.dumps(m.as_json()), flush=True)
        metrics.extend(produced)
    if args.down:
        lab = BenchLab(args.lab_dir)
        if lab.running():
            lab.down()
    if not args.no_write:
        meta = {"started": started, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": args.quick,
                "runs": args.runs, "benchmarks": args.selected, "host": platform.node(),
                "python": platform.python_version(), "cpus": _cpus(), "loadavg_end": loadavg(),
                "engine_tree": str(ENGINE_ROOT), "engine_commit": _commit()}
        path = write_results(metrics, meta, args.results_dir)
        log(f"results: {path} (and {args.results_dir / 'latest.json'})")
    return 1 if failed else 0


def _commit() -> str:
    """HEAD of the engine's tree, ``+dirty`` when it has local changes ("" outside git)."""
    import subprocess

    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(ENGINE_ROOT), *args], capture_output=True, text=True, check=False)
        return r.stdout.strip() if r.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    return head + ("+dirty" if head and git("status", "--porcelain", "--untracked-files=no") else "")


def _cpus() -> int:
    import os

    return os.cpu_count() or 0
