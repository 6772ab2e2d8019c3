"""CI's check of bench/ (issue 9): ``bench/run --quick`` runs as shipped, on labs of its own, and prints
every metric it promises, each measured (a benchmark that could not run reports ``null``).

Two tests, one command each (the CI time budget, docs/reliability.md "CI time budget"):

* CI: ``bench/run --quick --no-fleet --only <every benchmark but P7 and P8> --down``: every benchmark
  that needs no fleet lab and no monitoring (P1-P6, P9-P11 and whatever joins them in
  ``bench.harness.ORDER``) runs to its end on the bench's own incident lab, which ``--down`` takes down.
  P8 (the paging loop through the lab's Prometheus and Alertmanager, ~2 min) is the slow twin's: CI's
  ``test_monitoring_loop.py`` and ``test_cluster_mode_lab.py`` page through the same real loop.
* **slow**: ``bench/run --quick --down``, everything: P8, P7's 4-node fleet lab and P4's 10-node one as
  well (~7 more minutes idle). Run it with ``scripts/test.sh -m slow tests/integration/lab/test_bench_quick.py``.

Figures are not held to targets: benchmarks are not tests (docs/performance.md). What is asserted is
that each benchmark ran to its end, that P1's figures are sane (the engine/script ratio between 0.2
and 5: not a broken run timed as fast, nor a hang), that every engine recovery of P1 was timed and
left omen2 recovered, and how often the engine skipped ``restart-kubelet`` (kubelet back by itself
in the lab) is reported (``record_property`` and the test's output); every recovery of P7 (the fleet) left
its nodes recovered; P9's page is that of a succeeded 3-step run; P8's page started a run that
waited for approval.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench import common, harness  # noqa: E402
from engine.lab.manager import Lab  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.lab]

SLOW_BENCHMARKS = ("p7", "p8")  # a fleet lab of its own; the paging loop: the slow test's
FLEET_METRIC_OF_P4 = "p4_plan_100_vs_ansible_ratio"  # P4's fleet part (--no-fleet: null, "skipped")


def bench_quick(tmp_path: Path, *options: str, timeout: float) -> tuple[list[dict[str, Any]], str]:
    """``bench/run --quick ... --down`` on labs in ``tmp_path``: its metrics and the tail of its log."""
    cmd = [sys.executable, str(ROOT / "bench" / "run"), "--quick", *options, "--no-write",
           "--lab-dir", str(tmp_path / "lab"), "--fleet-lab-dir", str(tmp_path / "fleet"),
           "--journal", str(tmp_path / "journal.sqlite"), "--work-dir", str(tmp_path / "work"), "--down"]
    labs = (tmp_path / "lab", tmp_path / "fleet")
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        left_up = [str(folder) for folder in labs if folder.exists()]  # before the clean-up below
    finally:  # a bench that failed or was killed half-way leaves its labs up: take them down
        for folder in labs:
            if (folder / "lab.json").exists():
                Lab(folder).down()
    tail = done.stderr[-4000:]
    metrics = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert done.returncode == 0, tail
    for m in metrics:
        assert list(m) == ["metric", "value", "unit", "runs", "detail"]
    assert left_up == [], tail  # --down took the incident lab down, P4 and P7 their fleet labs
    return metrics, tail


def measured(metrics: list[dict[str, Any]], tail: str, expected: list[str]) -> dict[str, dict[str, Any]]:
    """Exactly the ``expected`` metrics, each with a value from at least one run."""
    assert sorted(m["metric"] for m in metrics) == sorted(expected), tail
    for m in metrics:
        assert m["value"] is not None and m["runs"] >= 1, (m, tail)
    return {m["metric"]: m for m in metrics}


def check_the_incident_lab_benchmarks(by_name: dict[str, dict[str, Any]], tail: str, record_property: Any) -> None:
    """P1 (every engine run timed, omen2 recovered each time, sane ratios) and P9 (the page of a run)."""
    p1 = by_name["p1_recovery_vs_checked_script_ratio"]
    detail = p1["detail"]
    assert detail["problems"] == [], tail  # every variant left omen2 recovered
    assert 0.2 <= p1["value"] <= 5, (p1, tail)
    bare = by_name["p1_recovery_vs_bare_script_ratio"]
    assert 0.2 <= bare["value"] <= 5, (bare, tail)
    # every engine run was timed (a run counts only after rc 0 and omen2 recovered): one per --quick run
    engine_runs = len(detail["engine_s"]["samples"])
    assert engine_runs == p1["runs"] >= 1 and all(s > 0 for s in detail["engine_s"]["samples"]), detail
    skipped = detail["engine_skipped_restart_kubelet"].get("engine", 0)
    assert 0 <= skipped <= engine_runs
    record_property("engine_skipped_restart_kubelet", f"{skipped} of {engine_runs}")
    print(f"P1: the engine skipped restart-kubelet (kubelet back by itself) in {skipped} of {engine_runs} runs")
    p9 = by_name["p9_run_page_kb"]
    assert p9["detail"]["run"]["state"] == "succeeded" and len(p9["detail"]["run"]["steps"]) == 3, tail


def check_the_paging_benchmark(by_name: dict[str, dict[str, Any]], tail: str) -> None:
    """P8: omen2's page went through the lab's Prometheus and Alertmanager to a run waiting for approval."""
    p8 = by_name["p8_alert_to_run_s"]
    (paged,) = p8["detail"]["runs_detail"]
    assert p8["detail"]["problems"] == [] and paged["webhook_status"] == 202, (p8, tail)
    assert paged["rule_for_s"] == paged["lab_timing"]["alert_for_seconds"] and p8["value"] > paged["rule_for_s"]


@pytest.mark.timeout(1800)  # ~3 min idle; a loaded machine takes three times that and more
def test_bench_run_quick_without_fleet_labs_prints_every_metric_with_sane_p1_figures(
        tmp_path: Path, record_property: Any) -> None:
    selected = [b for b in harness.ORDER if b not in SLOW_BENCHMARKS]
    metrics, tail = bench_quick(tmp_path, "--no-fleet", "--only", ",".join(selected), timeout=1700)
    fleet_part = next(m for m in metrics if m["metric"] == FLEET_METRIC_OF_P4)
    assert fleet_part["value"] is None and fleet_part["detail"]["skipped"] == "--no-fleet", fleet_part
    expected = [name for b in selected for name in harness.PRODUCES[b] if name != FLEET_METRIC_OF_P4]
    # all but P7's and P8's and P4's fleet ratio
    assert len(expected) == len(common.METRICS) - len(harness.PRODUCES["p7"]) - len(harness.PRODUCES["p8"]) - 1
    by_name = measured([m for m in metrics if m["metric"] != FLEET_METRIC_OF_P4], tail, expected)
    check_the_incident_lab_benchmarks(by_name, tail, record_property)


@pytest.mark.slow
@pytest.mark.timeout(2400)  # ~7.5 min idle
def test_bench_run_quick_prints_every_metric_with_sane_p1_figures(tmp_path: Path, record_property: Any) -> None:
    metrics, tail = bench_quick(tmp_path, timeout=2300)
    by_name = measured(metrics, tail, list(common.METRICS))
    check_the_incident_lab_benchmarks(by_name, tail, record_property)
    check_the_paging_benchmark(by_name, tail)
    p7 = by_name["p7_fleet_20_vs_script_ratio"]
    assert p7["detail"]["problems"] == [], tail  # every variant left its nodes recovered
