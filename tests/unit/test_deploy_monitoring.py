"""deploy/monitoring: the alerting rules pass ``promtool check rules`` and their own ``promtool test
rules``, and every metric the rules and the Grafana dashboard read is one ``runbook serve`` exposes.

promtool is Debian's (package ``prometheus``, installed by scripts/prepare.sh); without it these
tests skip, which fails under CI=true.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.serve.metrics import ServeMetrics

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "monitoring"
# PromQL words that look like metric names but are functions, keywords or aggregations
_PROMQL = {"sum", "by", "without", "max", "min", "increase", "rate", "histogram_quantile", "absent", "or",
           "vector", "and", "unless", "on", "ignoring", "le", "humanize", "count", "avg", "time"}


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return found


def _exported_names() -> set[str]:
    """Every sample name runbook serve's /metrics can carry (counters' _total, histograms' _bucket...)."""
    metrics = ServeMetrics()
    metrics.runs_started.labels(runbook="r", mode="auto").inc()
    metrics.runs_succeeded.labels(runbook="r").inc()
    metrics.runs_failed.labels(runbook="r").inc()
    metrics.runs_blocked.labels(runbook="r", reason="x").inc()
    metrics.webhook_requests.labels(endpoint="e", outcome="o").inc()
    metrics.webhook_seconds.labels(endpoint="e").observe(0.1)
    metrics.verify_seconds.observe(0.1)
    metrics.set_breaker("node", "n", True)
    metrics.runs_finished.labels(runbook="r", state="succeeded", trigger="alertmanager").inc()
    metrics.alert_to_run_start.labels(runbook="r").observe(1)
    metrics.alert_to_recovery.labels(runbook="r").observe(1)
    metrics.journal_errors.labels(operation="read-run").inc()
    metrics.observe_run("r", [
        {"kind": "step.outcome", "step": "s", "status": "succeeded", "started_at": 1.0, "finished_at": 2.0},
        {"kind": "verify.result", "step": "s", "holds": True, "elapsed": 1.0},
        {"kind": "guard.result", "step": "s", "check": "c", "holds": False},
        {"kind": "run.state", "time": "2026-01-01T00:00:00.000Z"},
        {"kind": "lock.acquired", "time": "2026-01-01T00:00:01.000Z"}])
    return {s.name for family in metrics.registry.collect() for s in family.samples} | {"up"}


def _metric_names(expr: str) -> set[str]:
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\bby\s*\([^)]*\)", "", expr)  # grouping labels
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    return {w for w in words if w not in _PROMQL and not w.startswith("$")}


def _dashboard_exprs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return ([node["expr"]] if isinstance(node.get("expr"), str) else []) + [
            e for v in node.values() for e in _dashboard_exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in _dashboard_exprs(v)]
    return []


def test_promtool_check_rules_accepts_every_rule_file_in_deploy_monitoring() -> None:
    files = sorted(str(p) for p in DEPLOY.glob("*.yaml"))
    assert files, "no rule files in deploy/monitoring"
    result = subprocess.run([promtool(), "check", "rules", *files], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 6 rules found" in result.stdout


def test_the_runbook_alerts_fire_on_the_series_that_should_fire_them() -> None:
    tests = sorted(str(p) for p in (DEPLOY / "tests").glob("*.yaml"))
    result = subprocess.run([promtool(), "test", "rules", *tests], capture_output=True, text=True, check=False,
                            cwd=DEPLOY / "tests")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_lab_copy_of_the_upstream_node_rules_passes_promtool_too(tmp_path: Path) -> None:
    from engine.lab.monitoring import compress_for, upstream_rules_path

    lab_copy = tmp_path / "rules.yaml"
    lab_copy.write_text(compress_for(upstream_rules_path().read_text(), 10))
    for path in (upstream_rules_path(), lab_copy):
        result = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True,
                                check=False)
        assert result.returncode == 0, result.stdout + result.stderr


def test_every_metric_the_rules_and_the_dashboard_read_is_one_the_server_exposes() -> None:
    exported = _exported_names()
    exprs = [r["expr"] for g in yaml.safe_load((DEPLOY / "runbook-alerts.yaml").read_text())["groups"]
             for r in g["rules"]]
    dashboard = json.loads((DEPLOY / "runbook-dashboard.json").read_text())
    exprs += _dashboard_exprs(dashboard["panels"])
    assert len(exprs) > 10
    read = set().union(*(_metric_names(e) for e in exprs))
    assert read - exported == set(), f"not exposed by runbook serve: {sorted(read - exported)}"
    assert {"runbook_serve_runs_failed_total", "runbook_serve_breaker_open", "up"} <= read
