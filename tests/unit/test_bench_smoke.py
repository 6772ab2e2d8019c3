"""bench/ (issue 9): the harness's contract, a lab-free smoke run, and the engine changes the
benchmarks led to (host facts reuse: ``AnsibleConnector.recent_facts`` and
``probes.gather_probes(host_max_age=...)``).

The full ``bench/run --quick`` needs the lab (root, the control plane):
tests/integration/lab/test_bench_quick.py runs it. Here: ``bench/run --quick --only p3,p5 --p5-fake``,
which needs no lab.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import MappingProxyType

import pytest

from engine import probes
from engine.checks import HOST, NODE
from engine.connectors.ansible import AnsibleConnector, _RunState
from tests.fakes import FakeKube, FakeNodes, make_host, make_node

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import common, harness  # noqa: E402
from bench.p5_webhook import _metric_sum, _ms  # noqa: E402
from bench.p9_console import live_latencies  # noqa: E402

# ------------------------------------------------------------------------------------------ harness


def test_metric_json_has_exactly_the_contract_keys() -> None:
    m = common.Metric("p1_recovery_vs_checked_script_ratio", 0.61234, 5, {"engine_s": 1})
    out = m.as_json()
    assert list(out) == ["metric", "value", "unit", "runs", "detail"]
    assert out["unit"] == "ratio" and out["value"] == 0.6123 and out["runs"] == 5
    assert out["detail"]["target"] == "<= 0.7" and out["detail"]["meets_target"] is True
    assert common.Metric("p5_webhook_rps", 900.0, 5).as_json()["detail"]["meets_target"] is False
    assert common.Metric("p6_rss_mb", None, 0).as_json()["detail"]["meets_target"] is None
    untargeted = common.Metric("p8_alert_to_run_s", 41.5, 1).as_json()["detail"]  # reported with its parts
    assert (untargeted["target"], untargeted["meets_target"]) == (None, None)
    assert common.Metric("p8_runbook_webhook_ms", 120.0, 1).as_json()["detail"]["meets_target"] is False


def test_every_metric_of_the_issue_is_produced_by_one_benchmark() -> None:
    produced = [m for ms in harness.PRODUCES.values() for m in ms]
    assert sorted(produced) == sorted(common.METRICS)
    assert len(common.METRICS) == 23  # issue 25 added P10 (two metrics), issue 32 the burst and P11


def test_only_selects_benchmarks_and_p6_runs_p1() -> None:
    assert harness.parse_args(["--only", "p3,p6"]).selected == ["p3", "p1"]
    assert harness.parse_args([]).selected == list(harness.ORDER)
    assert harness.parse_args(["--quick"]).runs == 1
    with pytest.raises(SystemExit):
        harness.parse_args(["--only", "p99"])
    with pytest.raises(SystemExit):
        harness.parse_args(["--runs", "3"])  # at least 5 unless --quick


def test_rotations_alternate_and_rotate_the_first_variant() -> None:
    order = [name for _, name in common.rotations(["a", "b", "c"], 3)]
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_write_results_keeps_a_timestamped_file_and_latest(tmp_path: Path) -> None:
    path = common.write_results([common.Metric("p3_help_s", 0.1, 10)], {"quick": True}, tmp_path)
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert path.exists() and path != tmp_path / "latest.json"
    assert latest["metrics"][0]["metric"] == "p3_help_s" and latest["quick"] is True


def test_wrk_durations_and_prometheus_sums() -> None:
    assert _ms("850.00us") == pytest.approx(0.85)
    assert _ms("12.5ms") == 12.5 and _ms("1.20s") == 1200.0
    text = ('runbook_serve_webhook_requests_total{endpoint="alertmanager",outcome="duplicate"} 41.0\n'
            'runbook_serve_webhook_requests_total{endpoint="alertmanager",outcome="started"} 1.0\n')
    assert _metric_sum(text, "runbook_serve_webhook_requests_total", outcome="duplicate") == 41.0
    assert _metric_sum(text, "runbook_serve_webhook_requests_total") == 42.0


def test_baseline_scripts_are_valid_bash() -> None:
    for script in sorted((ROOT / "bench" / "baseline").glob("*.sh")):
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_quick_run_without_a_lab_prints_the_metrics(tmp_path: Path) -> None:
    """``bench/run --quick --only p3,p5 --p5-fake``: cold starts and webhook ingest, no lab."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "run"), "--quick", "--only", "p3,p5", "--p5-fake",
                        "--results-dir", str(tmp_path)], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [m["metric"] for m in lines] == ["p3_help_s", "p3_validate_s", "p5_webhook_rps", "p5_webhook_p99_ms"]
    assert all(isinstance(m["value"], float) and m["value"] > 0 for m in lines)
    assert json.loads((tmp_path / "latest.json").read_text())["metrics"] == lines


# ------------------------------------------------------------------------------ host facts reuse


def _connector(tmp_path: Path) -> AnsibleConnector:
    inventory = tmp_path / "inventory.yml"
    inventory.write_text("all:\n  hosts:\n    omen2:\n      ansible_host: 127.0.0.1\n")
    return AnsibleConnector(inventory, tmp_path)


def _facts_event(kind: str, **res: object) -> dict[str, object]:
    return {"event": kind, "event_data": {"host": "omen2", "task": "t", "res": res}}


def test_run_state_dates_facts_from_the_probe_task_start() -> None:
    state = _RunState(node_of=lambda h: h, on_event=None)
    state.handle(_facts_event("runner_on_start"))  # the probe task
    probe_started = state.task_starts["omen2"][-1]
    time.sleep(0.01)
    state.handle(_facts_event("runner_on_start"))  # set_stats
    stats = {"data": {"runbook_facts": {"version": 1}}}
    state.handle(_facts_event("runner_on_ok", ansible_stats=stats))
    assert state.facts_at["omen2"] == probe_started
    assert state.facts["omen2"] == {"version": 1}


def test_recent_facts_by_age_and_files(tmp_path: Path) -> None:
    conn = _connector(tmp_path)
    facts = make_host("omen2")
    assert conn.recent_facts(["omen2"], max_age=10) == {}
    conn._remember({"omen2": facts}, {"omen2": time.monotonic() - 3})
    (got, age), = conn.recent_facts(["omen2"], max_age=10).values()
    assert got is facts and 3 <= age < 10
    assert conn.recent_facts(["omen2"], max_age=2) == {}  # too old
    assert conn.recent_facts(["omen2"], max_age=0) == {}  # reuse off
    assert conn.recent_facts(["omen2"], max_age=10, files=["/etc/x"]) == {}  # does not report the file
    conn._forget(["omen2"])  # a new run on the node
    assert conn.recent_facts(["omen2"], max_age=10) == {}
    conn.close()


def test_a_run_forgets_facts_even_when_ansible_cannot_start(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    conn = _connector(tmp_path)
    (tmp_path / "p.yml").write_text("- hosts: all\n  tasks: []\n")
    conn._remember({"omen2": make_host("omen2")}, {"omen2": time.monotonic()})

    def broken(*_: object, **__: object) -> tuple[str, int]:
        from engine.errors import HostError

        raise HostError("ansible-runner could not run")

    monkeypatch.setattr(conn, "_run", broken)
    with pytest.raises(Exception, match="could not run"):
        conn.run_playbook(Path("p.yml"), ["omen2"])
    assert conn.recent_facts(["omen2"], max_age=60) == {}
    conn.close()


class _RecentNodes(FakeNodes):
    """FakeNodes that also keeps recent facts, as AnsibleConnector does."""

    def __init__(self, recent: dict[str, object], **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.recent = recent
        self.asked: list[float] = []

    def recent_facts(self, nodes: list[str], *, max_age: float,
                     files: list[str] = ()) -> dict[str, tuple[object, float]]:
        self.asked.append(max_age)
        return {n: (self.recent[n], 1.5) for n in nodes if n in self.recent} if max_age > 0 else {}


def test_gather_reuses_recent_host_facts_only_when_asked() -> None:
    fresh, recent = make_host("omen2", kubelet="active"), make_host("omen2", kubelet="activating")
    nodes = _RecentNodes({"omen2": recent}, hosts=MappingProxyType({"omen2": fresh}))
    kube = FakeKube([make_node("omen2")])
    default = probes.gather_probes({HOST, NODE}, "omen2", kube, nodes)
    assert default.host is fresh and len(nodes.gathers) == 1  # default: always a new facts run
    reused = probes.gather_probes({HOST, NODE}, "omen2", kube, nodes, host_max_age=10)
    assert reused.host is recent and len(nodes.gathers) == 1  # no new facts run
    assert reused.host_age == 1.5 and default.host_age is None  # the age is kept for the journal
    assert reused.node is not None and reused.node.name == "omen2"  # the node is still read live
    nodes.recent = {}
    assert probes.gather_probes({HOST}, "omen2", kube, nodes, host_max_age=10).host is fresh
    assert len(nodes.gathers) == 2


def test_gather_many_gathers_only_the_nodes_without_recent_facts() -> None:
    nodes = _RecentNodes({"a": make_host("a")}, hosts={"a": make_host("a"), "b": make_host("b")})
    out = probes.gather_probes_many({HOST}, ["a", "b"], None, nodes, host_max_age=5)
    assert nodes.gathers == [(["b"], [])]
    assert out["a"].host is nodes.recent["a"] and out["b"].host is not None


def test_a_live_update_is_timed_from_each_journal_event_to_the_first_dom_update_that_shows_it() -> None:
    events = [{"time": "2026-12-03T10:00:00.000Z"}, {"time": "2026-12-03T10:00:01.000Z"},
              {"time": "2026-12-03T10:00:01.100Z"}, {"time": "2026-12-03T10:00:05.000Z"}]
    t0 = 1796292000000.0  # 2026-12-03T10:00:00Z in epoch ms
    updates = [[t0 + 10, 1], [t0 + 1180, 2], [t0 + 1300, 3], [t0 + 5240, 4]]
    # the first event came before the approval (not measured); the third shows in the update that
    # shows three entries, not the one that showed two
    assert live_latencies(events, t0 + 500, updates) == pytest.approx([180.0, 200.0, 240.0])
    assert live_latencies(events, t0 + 500, updates[:2]) == pytest.approx([180.0])
