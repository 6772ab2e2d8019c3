"""What a page waits for before it is answered: no API round trip once the server's cluster view is
refreshed in the background (never a snapshot older than the TTL, and a failed read still fails
closed), and one journal commit for a new run instead of one per event."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from engine.errors import KubeError
from engine.serve.app import create_app
from engine.serve.cluster import ClusterUnavailable, KubeClusterView
from engine.serve.config import ExclusionConfig, load_config
from engine.serve.notify import Notifier
from engine.serve.starter import RunRequest
from engine.serve_starter import JournalRunStarter
from engine.settings import Settings
from tests.fakes import TOKEN, FakeKube, FakeRunStarter, alert, make_node, trigger_spec, webhook

T0 = 1_800_000_000.0
REPO = Path(__file__).resolve().parents[3]


def _until(predicate: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_a_started_view_picks_up_changes_in_the_background_without_waiting_for_the_ttl() -> None:
    kube = FakeKube([make_node("omen2")])
    clock = [T0]  # the clock stands still: only the background refresh can bring news
    view = KubeClusterView(lambda: kube, ExclusionConfig(), ttl=5, refresh=0.02, clock=lambda: clock[0])
    view.start()
    try:
        assert _until(lambda: kube.calls_to("list_nodes") >= 1), "the first read happens at start, before any page"
        assert view.snapshot().total_nodes == 1
        kube.set_node(make_node("omen3"))
        assert _until(lambda: view.snapshot().total_nodes == 2), "the refresher did not re-read the cluster"
    finally:
        view.stop()


def test_a_snapshot_older_than_the_ttl_is_never_used_and_a_failed_refresh_fails_closed() -> None:
    kube = FakeKube([make_node("omen2")])
    clock = [T0]
    view = KubeClusterView(lambda: kube, ExclusionConfig(), ttl=5, refresh=1, clock=lambda: clock[0])
    view.refresh()
    calls = kube.calls_to("list_nodes")
    assert view.snapshot().total_nodes == 1
    assert kube.calls_to("list_nodes") == calls  # fresh: no API call on the page
    clock[0] += 6  # the refresher stalled: the page reads the cluster itself
    kube.set_node(make_node("omen3"))
    assert view.snapshot().total_nodes == 2 and kube.calls_to("list_nodes") == calls + 1
    kube.error = KubeError("connection refused")
    view.refresh()  # a background read that fails replaces the good snapshot: guards fail closed
    with pytest.raises(ClusterUnavailable, match="connection refused"):
        view.snapshot()


def test_refreshing_is_configured_shorter_than_the_ttl() -> None:
    from engine.errors import UsageError

    assert load_config(None, env={}).cluster_refresh is None  # default: half the TTL
    with pytest.raises(UsageError, match=r"cluster_refresh .* must be shorter than cluster_cache_ttl"):
        load_config(None, env={}, overrides={"cluster_refresh": "5s"})


def test_the_server_starts_the_refresher_so_a_page_is_answered_without_an_api_call() -> None:
    kube = FakeKube([make_node(f"omen{i}", ready=i > 1, gpus=1) for i in range(1, 9)])
    config = load_config(None, env={"RUNBOOK_WEBHOOK_TOKEN": TOKEN})
    view = KubeClusterView(lambda: kube, config.run_guards(), ttl=30, refresh=0)  # the first read only
    app = create_app(config, FakeRunStarter([trigger_spec()]), cluster=view, notifier=Notifier(None),
                     sweep_interval=0)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        assert _until(lambda: kube.calls_to("list_nodes") >= 1), "the server did not read the cluster at start"
        calls = kube.calls_to("list_nodes")
        r = client.post("/hooks/alertmanager", content=json.dumps(webhook(alert("omen1"))),
                        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        assert r.status_code == 202, r.text
        assert kube.calls_to("list_nodes") == calls  # the guards used the snapshot read at start


def test_a_paged_run_is_recorded_with_its_first_events_in_one_commit(tmp_path: Path) -> None:
    settings = Settings(journal=tmp_path / "j.sqlite", runbooks_dir=REPO / "runbooks")
    starter = JournalRunStarter(settings)
    journal = starter.journal
    commits: list[str] = []
    lock = threading.Lock()

    def trace(statement: str) -> None:
        if statement.strip().upper() == "COMMIT":
            with lock:
                commits.append(statement)

    journal._db.set_trace_callback(trace)
    ticket = starter.submit(RunRequest(runbook="gpu-node-recovery", params={"node": "omen2"}, node="omen2",
                                       mode="approve", source="alertmanager", reason="KubeNodeNotReady omen2",
                                       warnings=("breaker: 4 of 8 nodes",), dedup_key="fp-1",
                                       requested_by="alertmanager"))
    journal._db.set_trace_callback(None)
    assert len(commits) == 1
    run = starter.run(ticket.run_id)
    assert [e["kind"] for e in run["events"]] == ["run.requested", "run.note", "run.seal"]
    assert [e["seq"] for e in run["events"]] == [1, 2, 3]
    assert (run["requested_by"], run["dedup_key"], run["reason"], run["warnings"]) == (
        "alertmanager", "fp-1", "KubeNodeNotReady omen2", ["breaker: 4 of 8 nodes"])
    assert (run["state"], run["approval_required"]) == ("pending", True)


def test_the_servers_starter_imports_the_planning_libraries_at_start_not_in_the_first_runs_worker(
        tmp_path: Path) -> None:
    journal, runbooks = str(tmp_path / "j.sqlite"), str(REPO / "runbooks")
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from engine.serve_starter import JournalRunStarter\n"
        "from engine.settings import Settings\n"
        "assert 'ansible_runner' not in sys.modules\n"
        f"JournalRunStarter(Settings(journal=Path({journal!r}), runbooks_dir=Path({runbooks!r})))\n"
        "wanted = ('ansible_runner', 'ansible_runner.interface', 'engine.connectors.ansible')\n"
        "print(sorted(m for m in wanted if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['ansible_runner', 'ansible_runner.interface', 'engine.connectors.ansible']"


def test_while_the_server_runs_threads_switch_every_millisecond_so_busy_workers_delay_answers_less() -> None:
    before = sys.getswitchinterval()
    app = create_app(load_config(None, env={"RUNBOOK_WEBHOOK_TOKEN": TOKEN}), FakeRunStarter([trigger_spec()]),
                     cluster=KubeClusterView(lambda: FakeKube([make_node("omen2")]), ExclusionConfig()),
                     notifier=Notifier(None), sweep_interval=0)
    with TestClient(app, base_url="http://127.0.0.1"):
        assert sys.getswitchinterval() == pytest.approx(min(before, 0.001))
    assert sys.getswitchinterval() == pytest.approx(before)  # the process's own setting is given back


def test_a_delivery_resent_byte_for_byte_is_not_parsed_again_and_is_answered_as_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.serve import app as app_module
    from tests.fakes import INCIDENT_NODES, StaticClusterView

    parses: list[int] = []
    real = app_module.parse_alertmanager

    def counting(body: bytes, **limits: int) -> object:
        parses.append(len(body))
        return real(body, **limits)

    monkeypatch.setattr(app_module, "parse_alertmanager", counting)
    app = create_app(load_config(None, env={"RUNBOOK_WEBHOOK_TOKEN": TOKEN}), FakeRunStarter([trigger_spec()]),
                     cluster=StaticClusterView(INCIDENT_NODES), notifier=Notifier(None), sweep_interval=0)
    page = json.dumps(webhook(alert("omen2", fingerprint="fp-memo"))).encode()
    other = json.dumps(webhook(alert("omen2", fingerprint="fp-memo-2"))).encode()
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    with TestClient(app, base_url="http://127.0.0.1") as client:
        first = client.post("/hooks/alertmanager", content=page, headers=headers)
        answers = [client.post("/hooks/alertmanager", content=page, headers=headers) for _ in range(3)]
        assert client.post("/hooks/alertmanager", content=other, headers=headers).status_code in (200, 202)
        bad = client.post("/hooks/alertmanager", content=b'{"alerts": 1}', headers=headers)
        again = client.post("/hooks/alertmanager", content=b'{"alerts": 1}', headers=headers)
    assert first.status_code == 202 and first.json()["runs"]
    assert [a.json()["decisions"][0]["outcome"] for a in answers] == ["duplicate"] * 3
    assert parses == [len(page), len(other), 13, 13]  # the re-sends were not parsed; errors never kept
    assert bad.status_code == again.status_code == 400
