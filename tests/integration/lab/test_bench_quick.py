"""CI's check of bench/ (issue 9): ``bench/run --quick`` runs on a lab of its own and prints
every metric of the issue, each measured (a benchmark that could not run reports ``null``).

Figures are not asserted: benchmarks are not tests (docs/performance.md). What is asserted is
that each benchmark ran to its end and that every recovery of P1 (omen2) and P7 (the fleet) left
its nodes recovered.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.lab]


def test_bench_run_quick_prints_every_metric(tmp_path: Path) -> None:
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
    assert p1["detail"]["problems"] == [], tail  # every variant left omen2 recovered
    p7 = next(m for m in metrics if m["metric"] == "p7_fleet_20_vs_script_ratio")
    assert p7["detail"]["problems"] == [], tail  # every variant left its nodes recovered
    assert not (tmp_path / "lab").exists() and not (tmp_path / "fleet").exists()  # labs taken down
