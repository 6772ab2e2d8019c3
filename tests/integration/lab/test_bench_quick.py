"""CI's check of bench/ (issue 9): ``bench/run --quick`` runs on a lab of its own and prints
every metric of the issue, each measured (a benchmark that could not run reports ``null``).

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

from bench import common  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.lab]


def test_bench_run_quick_prints_every_metric_with_sane_p1_figures(tmp_path: Path,
                                                                  record_property: Any) -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "run"), "--quick", "--no-write",
           "--lab-dir", str(tmp_path / "lab"), "--fleet-lab-dir", str(tmp_path / "fleet"),
           "--journal", str(tmp_path / "journal.sqlite"), "--work-dir", str(tmp_path / "work"), "--down"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)  # P7's 4-node fleet adds ~4 min
    tail = done.stderr[-4000:]
    metrics = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert done.returncode == 0, tail
    assert sorted(m["metric"] for m in metrics) == sorted(common.METRICS), tail
    for m in metrics:
        assert list(m) == ["metric", "value", "unit", "runs", "detail"]
        assert m["value"] is not None and m["runs"] >= 1, (m, tail)
    p1 = next(m for m in metrics if m["metric"] == "p1_recovery_vs_checked_script_ratio")
    detail = p1["detail"]
    assert detail["problems"] == [], tail  # every variant left omen2 recovered
    assert 0.2 <= p1["value"] <= 5, (p1, tail)
    bare = next(m for m in metrics if m["metric"] == "p1_recovery_vs_bare_script_ratio")
    assert 0.2 <= bare["value"] <= 5, (bare, tail)
    # every engine run was timed (a run counts only after rc 0 and omen2 recovered): one per --quick run
    engine_runs = len(detail["engine_s"]["samples"])
    assert engine_runs == p1["runs"] >= 1 and all(s > 0 for s in detail["engine_s"]["samples"]), detail
    skipped = detail["engine_skipped_restart_kubelet"].get("engine", 0)
    assert 0 <= skipped <= engine_runs
    record_property("engine_skipped_restart_kubelet", f"{skipped} of {engine_runs}")
    print(f"P1: the engine skipped restart-kubelet (kubelet back by itself) in {skipped} of {engine_runs} runs")
    p7 = next(m for m in metrics if m["metric"] == "p7_fleet_20_vs_script_ratio")
    assert p7["detail"]["problems"] == [], tail  # every variant left its nodes recovered
    p9 = next(m for m in metrics if m["metric"] == "p9_run_page_kb")
    assert p9["detail"]["run"]["state"] == "succeeded" and len(p9["detail"]["run"]["steps"]) == 3, tail
    # P8: omen2's page went through the lab's Prometheus and Alertmanager to a run waiting for approval
    p8 = next(m for m in metrics if m["metric"] == "p8_alert_to_run_s")
    (paged,) = p8["detail"]["runs_detail"]
    assert p8["detail"]["problems"] == [] and paged["webhook_status"] == 202, (p8, tail)
    assert paged["rule_for_s"] == paged["lab_timing"]["alert_for_seconds"] and p8["value"] > paged["rule_for_s"]
    assert not (tmp_path / "lab").exists() and not (tmp_path / "fleet").exists()  # labs taken down
